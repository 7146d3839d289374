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

# AR rounds' features are written into the buffer together every this many rounds.
SETTLE_ROUNDS = 8



def append_to_draft(draft: AnyDraft, cache: KVCache, features: torch.Tensor, counts: torch.Tensor | int,
                    next_tokens: torch.Tensor | None = None) -> None:
    """Project features into the draft's context K/V (`append_context`); next_tokens: the
    token after each position, which only an EAGLE-3 draft's context reads."""
    if next_tokens is None:
        draft.append_context(cache, features, counts)
    else:
        draft.append_context(cache, features, counts, next_tokens)


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

    An AR round's features are kept as they come (a list append, where writing each
    round's one feature per row took several small tensor operations: 12 us a round on
    a CPU) and written in one copy every SETTLE_ROUNDS rounds, or before anything reads
    or moves the buffer.

    A prompt's features wait here too (`seed`, from prefill) until the row first drafts:
    a request that never drafts (sampling where drafting does not pay) never projects
    its prompt into the draft's K/V. prompt_capacity: the longest prompt that waits (an
    engine's memory plan budgets that many features per slot); a longer one enters the
    draft context at once. None: any prompt waits (generate, whose batch is its own)."""

    def __init__(self, draft: AnyDraft, cache: KVCache, capacity: int, keep: int | None = None,
                 prompt_capacity: int | None = None) -> None:
        self.draft, self.cache, self.capacity = draft, cache, capacity
        self.prompt_capacity = prompt_capacity
        self.window = draft.config.num_drafts
        self.keep = keep if keep is not None else min(capacity // 2, capacity - self.window - 1)
        if not 1 <= self.keep <= capacity - self.window - 1:
            raise BlockspecError(f"pending context: keep must be in 1..{capacity - self.window - 1} for a "
                                 f"capacity of {capacity}, got {self.keep}")
        self._buf: torch.Tensor | None = None     # [rows, capacity, F], allocated on first use
        self.tokens: torch.Tensor | None = None  # [rows, capacity] the tokens after them (EAGLE-3)
        self._lengths = torch.zeros(cache.rows, dtype=torch.long)
        self._row_starts = torch.arange(cache.rows) * capacity   # row r's first slot in the flat buffer
        self._cut = torch.zeros(cache.rows, dtype=torch.bool)   # the buffer no longer continues the draft context
        # Per row: its prompt's features [T, F] (and next tokens [T], EAGLE-3), not yet in its draft context.
        self.prompts: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * cache.rows
        # AR rounds' features [r, 1, F] (and next tokens [r, 1]) not yet in the buffer; at most
        # window + 1 of them, so they fit in the room every write leaves (> window). Held by
        # reference: eager forwards return fresh tensors (captured steps, whose outputs are
        # overwritten by the next replay, append at once: `captured.CapturedContext`).
        self._ar: list[torch.Tensor] = []
        self._ar_tokens: list[torch.Tensor] = []
        self._settle_every = min(SETTLE_ROUNDS, self.window + 1)

    @property
    def lengths(self) -> torch.Tensor:
        """[rows] features buffered per row."""
        self.settle()
        return self._lengths

    @property
    def buf(self) -> torch.Tensor | None:
        """[rows, capacity, F] the buffered features (row r's first lengths[r])."""
        self.settle()
        return self._buf

    @property
    def cut(self) -> torch.Tensor:
        """[rows] whose buffer no longer continues their draft context."""
        self.settle()
        return self._cut

    def seed(self, start: int, features: torch.Tensor, counts: torch.Tensor,
             next_tokens: torch.Tensor | None = None) -> None:
        """Rows start, start + 1, ... (one per features row) committed their prompts: row
        start + i's first counts[i] features (and next_tokens) wait until it first drafts
        (copies: the batch's features are not kept alive), or enter its draft context now
        when longer than `prompt_capacity`. Their draft context must be empty."""
        self.settle()
        for i, n in enumerate(counts.tolist()):
            row = start + i
            if int(self.cache.lengths[row]) or int(self._lengths[row]):
                raise BlockspecError("pending context: a prompt seeds an empty row only")  # invariant
            tokens = None if next_tokens is None else next_tokens[i:i + 1, :n]
            if self.prompt_capacity is not None and n > self.prompt_capacity:
                append_to_draft(self.draft, self.cache.slice_rows(row, row + 1), features[i:i + 1, :n],
                                counts[i:i + 1], tokens)
                continue
            self.prompts[row] = (features[i, :n].clone(), None if tokens is None else tokens[0].clone())

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
            tokens = (torch.nn.utils.rnn.pad_sequence([t for _, t in parts if t is not None], batch_first=True)
                      if parts[0][1] is not None else None)
            append_to_draft(self.draft, cache, features, counts, tokens)
            self.prompts[row:end] = [None] * (end - row)
            row = end

    def add(self, features: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor | None = None) -> None:
        """Row r (of the first features.shape[0]) appends its first counts[r] features (and
        next_tokens [R, W]: the token committed after each, EAGLE-3)."""
        r, w, f = features.shape
        if w == 1:   # an AR round: kept as it comes, written with the next ones (`settle`)
            if self._ar and self._ar[0].shape[0] != r:
                self.settle()
            self._ar.append(features)
            if next_tokens is not None:
                self._ar_tokens.append(next_tokens)
            if len(self._ar) >= self._settle_every:
                self.settle()
            return
        self.settle()
        self._allocate(features, next_tokens)
        counts = counts.to("cpu")
        if int((self._lengths[:r] + counts).max()) > self.capacity:
            raise BlockspecError("pending draft context overflow (trim before adding)")  # invariant
        keep = torch.arange(w).unsqueeze(0) < counts.unsqueeze(1)
        row_idx = torch.arange(r).unsqueeze(1).expand(r, w)[keep]
        col_idx = (self._lengths[:r].unsqueeze(1) + torch.arange(w))[keep]
        at = (row_idx.to(features.device), col_idx.to(features.device))
        self._buf[at] = features[keep.to(features.device)]
        if self.tokens is not None and next_tokens is not None:
            self.tokens[at] = next_tokens[keep.to(features.device)]
        self._lengths[:r] += counts
        if self._room(r) <= self.window:   # the next round could overflow it
            self._trim(r)

    def _allocate(self, features: torch.Tensor, next_tokens: torch.Tensor | None) -> None:
        if self._buf is None:
            self._buf = features.new_zeros(self.cache.rows, self.capacity, features.shape[-1])
        if next_tokens is not None and self.tokens is None:
            self.tokens = next_tokens.new_zeros(self.cache.rows, self.capacity)

    def settle(self) -> None:
        """Write the AR rounds' features kept as they came into the buffer, in one copy
        (row r's go to its slots lengths[r], lengths[r] + 1, ...), then trim the rows the
        next round could overflow."""
        if not self._ar:
            return
        # As the rounds ran (inference mode or not): a caller may read the buffer outside it.
        with torch.inference_mode(self._ar[0].is_inference()):
            features = torch.cat(self._ar, dim=1) if len(self._ar) > 1 else self._ar[0]   # [r, n, F]
            tokens = (None if not self._ar_tokens else
                      torch.cat(self._ar_tokens, dim=1) if len(self._ar_tokens) > 1 else self._ar_tokens[0])
            self._ar, self._ar_tokens = [], []
            r, n, f = features.shape
            self._allocate(features, tokens)
            assert self._buf is not None
            lengths = self._lengths[:r]
            if int(lengths.max()) + n > self.capacity:
                raise BlockspecError("pending draft context overflow (trim before adding)")  # invariant
            # One index_copy_ into the flat buffer (row r's slot j is r * capacity + j).
            at = (self._row_starts[:r, None] + lengths[:, None] + torch.arange(n)).reshape(-1).to(features.device)
            self._buf.view(-1, f).index_copy_(0, at, features.reshape(r * n, f))
            if self.tokens is not None and tokens is not None:
                self.tokens.view(-1).index_copy_(0, at, tokens.reshape(r * n))
            lengths += n
            if self._room(r) <= self.window:   # the next round could overflow it
                self._trim(r)

    def _trim(self, rows: int) -> None:
        """Rows (of the first `rows`) whose buffer could overflow next round keep only their
        `keep` latest features (and tokens), moved to the buffer's front, and are marked cut."""
        full = torch.nonzero(self.capacity - self._lengths[:rows] <= self.window).flatten()
        if full.numel() == 0:
            return
        assert self._buf is not None
        start = self._lengths[full] - self.keep                        # [n] each row's first kept feature
        cols = start.unsqueeze(1) + torch.arange(self.keep)          # [n, keep]
        dev = self._buf.device
        rows_at, cols_at = full.to(dev), cols.to(dev)
        self._buf[rows_at, :self.keep] = self._buf[rows_at.unsqueeze(1), cols_at]   # gathered copies
        if self.tokens is not None:
            self.tokens[rows_at, :self.keep] = self.tokens[rows_at.unsqueeze(1), cols_at]
        self._lengths[full] = self.keep
        self._cut[full] = True
        for row in full.tolist():   # rebuilt from the recent window: the prompt is not part of it
            self.prompts[row] = None

    def room(self, rows: int) -> int:
        self.settle()
        return self._room(rows)

    def _room(self, rows: int) -> int:
        return self.capacity - int(self._lengths[:rows].max()) if rows else self.capacity

    def flush(self, rows: int, start: int = 0) -> None:
        """Append rows start..rows-1's waiting prompts, then their buffered features, to
        their draft context; a cut row's draft context is first emptied (rebuilt from its
        recent window)."""
        self.settle()
        if any(p is not None for p in self.prompts[start:rows]):
            self._flush_prompts(start, rows)
        n = int(self._lengths[start:rows].max()) if rows > start else 0
        if n == 0:
            return
        assert self._buf is not None
        cut = torch.nonzero(self._cut[start:rows]).flatten() + start
        if cut.numel():
            self.cache.lengths[cut.to(self.cache.lengths.device)] = 0
            self._cut[cut] = False
        cache, counts = self.cache.slice_rows(start, rows), self._lengths[start:rows].to(self.cache.lengths.device)
        append_to_draft(self.draft, cache, self._buf[start:rows, :n], counts,
                        None if self.tokens is None else self.tokens[start:rows, :n])
        self._lengths[start:rows] = 0

    def clear(self, start: int, stop: int) -> None:
        self.settle()
        self._lengths[start:stop] = 0
        self._cut[start:stop] = False
        self.prompts[start:stop] = [None] * (stop - start)

    def _copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Rows dst take rows src's buffered features, tokens, lengths and cut marks (advanced
        indexing: the right side is a copy, so src and dst may overlap)."""
        self.settle()
        if self._buf is not None:
            n = int(self._lengths[src].max())
            self._buf[dst, :n] = self._buf[src, :n]
            if self.tokens is not None:
                self.tokens[dst, :n] = self.tokens[src, :n]
        self._lengths[dst] = self._lengths[src]
        self._cut[dst] = self._cut[src]
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
        self.settle()
        self._copy_rows(src, dst)
        self._lengths[src] = 0
        self._cut[src] = False
        for i in set(src) - set(dst):
            self.prompts[i] = None
