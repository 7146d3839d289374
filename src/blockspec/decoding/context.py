"""Where committed tokens' target features become draft context K/V (docs/design.md
section 4): the round hands every verified row's features to a `DraftContext`.
`PendingContext` buffers them (generate and the engine); the captured steps' context
(decoding/captured.py) appends them at once.
"""

from __future__ import annotations

from typing import Protocol

import torch

from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import AnyDraft
from blockspec.models.kv_cache import KVCache




class DraftContext(Protocol):
    """Where committed tokens' target features become draft context K/V."""

    def flush(self, rows: int) -> None:
        """The first `rows` rows are about to draft: their context must be complete."""

    def add(self, features: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor | None = None) -> None:
        """Row r (of the first features.shape[0]) committed the tokens of its first counts[r]
        features; next_tokens [R, W] (EAGLE-3): the token committed after each of them."""

    def keep_rows(self, keep: list[int]) -> None:
        """Rows keep[i] become rows i (the others finished), as the caches' rows do."""


class PendingContext:
    """Target features of tokens each row has committed that the draft has not yet
    turned into context K/V (the `DraftContext` of generate and the engine).

    A gated engine runs stretches of AR rounds; projecting each round's one token per
    row into every draft layer's K/V costs a few small GEMMs and KV writes per round.
    Rows buffer the features here instead and hand them to the draft in one batch,
    right before they draft. An EAGLE-3 draft's context also reads the token after each
    position: those buffer beside them (`tokens`, when `add` is given them).

    A long AR stretch costs next to nothing: when a row's buffer would overflow it keeps
    only its `keep` latest features (a bounded buffer, never a flush into the draft) and
    the row is marked cut; when it drafts again its draft context is rebuilt from that
    recent window (its draft cache emptied, the window appended at positions 0..: RoPE
    sees the same relative positions). The draft then sees a shorter context, which may
    cost acceptance for a few rounds but never correctness: verification alone decides
    what is committed.

    A prompt's features wait here too (`seed`, from generate's prefill) until the row
    first drafts: a call whose rows never draft (sampling where drafting does not pay)
    never projects its prompts into the draft's K/V."""

    def __init__(self, draft: AnyDraft, cache: KVCache, capacity: int, keep: int | None = None) -> None:
        self.draft, self.cache, self.capacity = draft, cache, capacity
        self.window = draft.config.num_drafts
        self.keep = keep if keep is not None else min(capacity // 2, capacity - self.window - 1)
        if not 1 <= self.keep <= capacity - self.window - 1:
            raise BlockspecError(f"pending context: keep must be in 1..{capacity - self.window - 1} for a "
                                 f"capacity of {capacity}, got {self.keep}")
        self.buf: torch.Tensor | None = None     # [rows, capacity, F], allocated on first use
        self.tokens: torch.Tensor | None = None  # [rows, capacity] the tokens after them (EAGLE-3)
        self.lengths = torch.zeros(cache.rows, dtype=torch.long)
        self._row_starts = torch.arange(cache.rows) * capacity   # row r's first slot in the flat buffer
        self.cut = torch.zeros(cache.rows, dtype=torch.bool)   # the buffer no longer continues the draft context
        # Per row: its prompt's features [T, F] (and next tokens [T], EAGLE-3), not yet in its draft context.
        self.prompts: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * cache.rows

    def seed(self, start: int, features: torch.Tensor, counts: torch.Tensor,
             next_tokens: torch.Tensor | None = None) -> None:
        """Rows start, start + 1, ... (one per features row) committed their prompts: row
        start + i's first counts[i] features (and next_tokens) wait until it first drafts.
        Their draft context must be empty."""
        for i, n in enumerate(counts.tolist()):
            if int(self.cache.lengths[start + i]) or int(self.lengths[start + i]):
                raise BlockspecError("pending context: a prompt seeds an empty row only")  # invariant
            self.prompts[start + i] = (features[i, :n], None if next_tokens is None else next_tokens[i, :n])

    def _flush_prompts(self, start: int, rows: int) -> None:
        """Rows start..rows-1 whose prompts wait append them to their (empty) draft context,
        a contiguous run of such rows in one draft forward."""
        row = start
        while row < rows:
            if self.prompts[row] is None:
                row += 1
                continue
            end = row
            while end < rows and self.prompts[end] is not None:
                end += 1
            parts = [p for p in self.prompts[row:end] if p is not None]
            counts = torch.tensor([f.shape[0] for f, _ in parts], device=self.cache.lengths.device)
            features = torch.nn.utils.rnn.pad_sequence([f for f, _ in parts], batch_first=True)
            cache = self.cache.slice_rows(row, end)
            if parts[0][1] is not None:
                tokens = torch.nn.utils.rnn.pad_sequence([t for _, t in parts if t is not None], batch_first=True)
                self.draft.append_context(cache, features, counts, tokens)
            else:
                self.draft.append_context(cache, features, counts)
            self.prompts[row:end] = [None] * (end - row)
            row = end

    def add(self, features: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor | None = None) -> None:
        """Row r (of the first features.shape[0]) appends its first counts[r] features (and
        next_tokens [R, W]: the token committed after each, EAGLE-3)."""
        r, w, f = features.shape
        if self.buf is None:
            self.buf = features.new_zeros(self.cache.rows, self.capacity, f)
        if next_tokens is not None and self.tokens is None:
            self.tokens = next_tokens.new_zeros(self.cache.rows, self.capacity)
        if w == 1:   # an AR round: one feature per row, nothing to read from the device
            lengths = self.lengths[:r]
            top = int(lengths.max()) + 1
            if top > self.capacity:
                raise BlockspecError("pending draft context overflow (trim before adding)")  # invariant
            # One index_copy_ into the flat buffer (row r's slot n is r * capacity + n): the
            # advanced-index write cost ~3x as much, every AR round of a speculative run.
            at = (self._row_starts[:r] + lengths).to(features.device)
            self.buf.view(-1, f).index_copy_(0, at, features[:, 0])
            if self.tokens is not None and next_tokens is not None:
                self.tokens.view(-1).index_copy_(0, at, next_tokens[:, 0])
            lengths += 1
            if self.capacity - top <= self.window:   # the next round could overflow it
                self._trim(r)
            return
        counts = counts.to("cpu")
        if int((self.lengths[:r] + counts).max()) > self.capacity:
            raise BlockspecError("pending draft context overflow (trim before adding)")  # invariant
        keep = torch.arange(w).unsqueeze(0) < counts.unsqueeze(1)
        row_idx = torch.arange(r).unsqueeze(1).expand(r, w)[keep]
        col_idx = (self.lengths[:r].unsqueeze(1) + torch.arange(w))[keep]
        at = (row_idx.to(features.device), col_idx.to(features.device))
        self.buf[at] = features[keep.to(features.device)]
        if self.tokens is not None and next_tokens is not None:
            self.tokens[at] = next_tokens[keep.to(features.device)]
        self.lengths[:r] += counts
        if self.room(r) <= self.window:   # the next round could overflow it
            self._trim(r)

    def _trim(self, rows: int) -> None:
        """Rows (of the first `rows`) whose buffer could overflow next round keep only their
        `keep` latest features (and tokens), moved to the buffer's front, and are marked cut."""
        full = torch.nonzero(self.capacity - self.lengths[:rows] <= self.window).flatten()
        if full.numel() == 0:
            return
        assert self.buf is not None
        start = self.lengths[full] - self.keep                        # [n] each row's first kept feature
        cols = start.unsqueeze(1) + torch.arange(self.keep)          # [n, keep]
        dev = self.buf.device
        rows_at, cols_at = full.to(dev), cols.to(dev)
        self.buf[rows_at, :self.keep] = self.buf[rows_at.unsqueeze(1), cols_at]   # gathered copies
        if self.tokens is not None:
            self.tokens[rows_at, :self.keep] = self.tokens[rows_at.unsqueeze(1), cols_at]
        self.lengths[full] = self.keep
        self.cut[full] = True
        for row in full.tolist():   # rebuilt from the recent window: the prompt is not part of it
            self.prompts[row] = None

    def room(self, rows: int) -> int:
        return self.capacity - int(self.lengths[:rows].max()) if rows else self.capacity

    def flush(self, rows: int, start: int = 0) -> None:
        """Append rows start..rows-1's waiting prompts, then their buffered features, to
        their draft context; a cut row's draft context is first emptied (rebuilt from its
        recent window)."""
        if any(p is not None for p in self.prompts[start:rows]):
            self._flush_prompts(start, rows)
        n = int(self.lengths[start:rows].max()) if rows > start else 0
        if n == 0:
            return
        assert self.buf is not None
        cut = torch.nonzero(self.cut[start:rows]).flatten() + start
        if cut.numel():
            self.cache.lengths[cut.to(self.cache.lengths.device)] = 0
            self.cut[cut] = False
        cache, counts = self.cache.slice_rows(start, rows), self.lengths[start:rows].to(self.cache.lengths.device)
        if self.tokens is not None:
            self.draft.append_context(cache, self.buf[start:rows, :n], counts, self.tokens[start:rows, :n])
        else:
            self.draft.append_context(cache, self.buf[start:rows, :n], counts)
        self.lengths[start:rows] = 0

    def clear(self, start: int, stop: int) -> None:
        self.lengths[start:stop] = 0
        self.cut[start:stop] = False
        self.prompts[start:stop] = [None] * (stop - start)

    def _copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Rows dst take rows src's buffered features, tokens, lengths and cut marks (advanced
        indexing: the right side is a copy, so src and dst may overlap)."""
        if self.buf is not None:
            n = int(self.lengths[src].max())
            self.buf[dst, :n] = self.buf[src, :n]
            if self.tokens is not None:
                self.tokens[dst, :n] = self.tokens[src, :n]
        self.lengths[dst] = self.lengths[src]
        self.cut[dst] = self.cut[src]
        moved = [self.prompts[i] for i in src]
        for i, prompt in zip(dst, moved):
            self.prompts[i] = prompt

    def keep_rows(self, keep: list[int]) -> None:
        """Rows keep[i] become rows i with what they buffered (the draft cache keeps the same
        rows: `KVCache.keep_rows`); the rows past them are emptied."""
        rows = len(self.prompts)
        self._copy_rows(keep, list(range(len(keep))))
        self.clear(len(keep), rows)

    def swap(self, a: int, b: int) -> None:
        """Exchange rows a and b's buffered features."""
        self._copy_rows([b, a], [a, b])

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        self._copy_rows(src, dst)
        self.lengths[src] = 0
        self.cut[src] = False
        for i in set(src) - set(dst):
            self.prompts[i] = None
