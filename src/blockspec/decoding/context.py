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


class PendingContext:
    """Target features of tokens each row has committed that the draft has not yet
    turned into context K/V (the `DraftContext` of generate and the engine).

    A gated engine runs stretches of AR rounds; projecting each round's one token per
    row into every draft layer's K/V costs a few small GEMMs and KV writes per round.
    Rows buffer the features here instead and hand them to the draft in one batch:
    right before they draft, or for everyone when a buffer would overflow. An EAGLE-3
    draft's context also reads the token after each position: those buffer beside them
    (`tokens`, when `add` is given them)."""

    def __init__(self, draft: AnyDraft, cache: KVCache, capacity: int) -> None:
        self.draft, self.cache, self.capacity = draft, cache, capacity
        self.window = draft.config.num_drafts
        self.buf: torch.Tensor | None = None     # [rows, capacity, F], allocated on first use
        self.tokens: torch.Tensor | None = None  # [rows, capacity] the tokens after them (EAGLE-3)
        self.lengths = torch.zeros(cache.rows, dtype=torch.long)

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
                raise BlockspecError("pending draft context overflow (flush before adding)")  # engine invariant
            at = (torch.arange(r, device=features.device), lengths.to(features.device))
            self.buf[at] = features[:, 0]
            if self.tokens is not None and next_tokens is not None:
                self.tokens[at] = next_tokens[:, 0]
            lengths += 1
            if self.capacity - top <= self.window:   # the next round could overflow it
                self.flush(r)
            return
        counts = counts.to("cpu")
        if int((self.lengths[:r] + counts).max()) > self.capacity:
            raise BlockspecError("pending draft context overflow (flush before adding)")  # engine invariant
        keep = torch.arange(w).unsqueeze(0) < counts.unsqueeze(1)
        row_idx = torch.arange(r).unsqueeze(1).expand(r, w)[keep]
        col_idx = (self.lengths[:r].unsqueeze(1) + torch.arange(w))[keep]
        at = (row_idx.to(features.device), col_idx.to(features.device))
        self.buf[at] = features[keep.to(features.device)]
        if self.tokens is not None and next_tokens is not None:
            self.tokens[at] = next_tokens[keep.to(features.device)]
        self.lengths[:r] += counts
        if self.room(r) <= self.window:   # the next round could overflow it
            self.flush(r)

    def room(self, rows: int) -> int:
        return self.capacity - int(self.lengths[:rows].max()) if rows else self.capacity

    def flush(self, rows: int, start: int = 0) -> None:
        """Append rows start..rows-1's buffered features to their draft context."""
        n = int(self.lengths[start:rows].max()) if rows > start else 0
        if n == 0:
            return
        assert self.buf is not None
        cache, counts = self.cache.slice_rows(start, rows), self.lengths[start:rows].to(self.cache.lengths.device)
        if self.tokens is not None:
            self.draft.append_context(cache, self.buf[start:rows, :n], counts, self.tokens[start:rows, :n])
        else:
            self.draft.append_context(cache, self.buf[start:rows, :n], counts)
        self.lengths[start:rows] = 0

    def clear(self, start: int, stop: int) -> None:
        self.lengths[start:stop] = 0

    def swap(self, a: int, b: int) -> None:
        """Exchange rows a and b's buffered features."""
        ab, ba = [a, b], [b, a]
        if self.buf is not None:
            n = int(self.lengths[ab].max())
            self.buf[ab, :n] = self.buf[ba, :n]
            if self.tokens is not None:
                self.tokens[ab, :n] = self.tokens[ba, :n]
        self.lengths[ab] = self.lengths[ba]

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        if self.buf is not None:
            n = int(self.lengths[src].max())
            self.buf[dst, :n] = self.buf[src, :n]
            if self.tokens is not None:
                self.tokens[dst, :n] = self.tokens[src, :n]
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0
