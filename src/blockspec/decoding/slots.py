"""The engine's slot pool: preallocated target and draft KV caches with one row
per running request, and the draft context each row has not yet absorbed.

Running requests always occupy rows 0..R-1 (a leaving request's row is
refilled by moving the last row), so the running batch is a zero-copy slice
of the pool. Each slot holds max_model_len positions plus a block margin.

How many slots of how many positions is the memory plan (memory.py): a pure
function of the models' shapes, dtypes and a byte budget, the budget coming from
the free memory after the weights (like vLLM's --gpu-memory-utilization).
"""

from __future__ import annotations

import torch

from blockspec.decoding.memory import MemoryPlan
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.kv_cache import KVCache
from blockspec.models.target import TargetModel


class PendingContext:
    """Target features of tokens each row has committed that the draft has not yet
    turned into context K/V (the engine's `DraftContext`).

    A gated engine runs stretches of AR rounds; projecting each round's one token per
    row into every draft layer's K/V costs a few small GEMMs and KV writes per round.
    Rows buffer the features here instead and hand them to the draft in one batch:
    right before they draft, or for everyone when a buffer would overflow."""

    def __init__(self, draft: DraftModel, cache: KVCache, capacity: int) -> None:
        self.draft, self.cache, self.capacity = draft, cache, capacity
        self.window = draft.config.num_drafts
        self.buf: torch.Tensor | None = None     # [rows, capacity, F], allocated on first use
        self.lengths = torch.zeros(cache.rows, dtype=torch.long)

    def add(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        """Row r (of the first features.shape[0]) appends its first counts[r] features."""
        r, w, f = features.shape
        if self.buf is None:
            self.buf = features.new_zeros(self.cache.rows, self.capacity, f)
        if w == 1:   # an AR round: one feature per row, nothing to read from the device
            lengths = self.lengths[:r]
            top = int(lengths.max()) + 1
            if top > self.capacity:
                raise BlockspecError("pending draft context overflow (flush before adding)")  # engine invariant
            self.buf[torch.arange(r, device=features.device), lengths.to(features.device)] = features[:, 0]
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
        self.buf[row_idx.to(features.device), col_idx.to(features.device)] = features[keep.to(features.device)]
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
        self.draft.append_context(self.cache.slice_rows(start, rows), self.buf[start:rows, :n],
                                  self.lengths[start:rows].to(self.cache.lengths.device))
        self.lengths[start:rows] = 0

    def clear(self, start: int, stop: int) -> None:
        self.lengths[start:stop] = 0

    def swap(self, a: int, b: int) -> None:
        """Exchange rows a and b's buffered features."""
        ab, ba = [a, b], [b, a]
        if self.buf is not None:
            n = int(self.lengths[ab].max())
            self.buf[ab, :n] = self.buf[ba, :n]
        self.lengths[ab] = self.lengths[ba]

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        if self.buf is not None:
            n = int(self.lengths[src].max())
            self.buf[dst, :n] = self.buf[src, :n]
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0


class SlotPool:
    """`plan.slots` KV slots of `plan.max_model_len` positions (plus the block margin) for the
    target (and the draft): exactly the plan's bytes (`plan.slot_bytes` per slot)."""

    def __init__(self, target: TargetModel, draft: DraftModel | None, plan: MemoryPlan) -> None:
        self.target, self.draft, self.plan = target, draft, plan
        self.slot_capacity = plan.max_model_len + plan.shapes.margin
        self.pending_capacity = plan.shapes.pending_positions
        self.row_bytes = plan.slot_bytes
        self.rows = plan.slots
        with torch.inference_mode():  # inference tensors: every later write happens in inference mode
            self.cache = target.new_cache(self.rows, self.slot_capacity)
            self.draft_cache = (draft.new_cache(self.rows, self.slot_capacity + self.pending_capacity)
                                if draft is not None else None)
        self.pending = (PendingContext(draft, self.draft_cache, self.pending_capacity)
                        if draft is not None and self.draft_cache is not None else None)

    def usage(self, running: int) -> dict[str, int]:
        """Slot and KV-memory figures with `running` rows in use (for /metrics)."""
        return {"slots": self.rows, "slot_capacity": self.slot_capacity, "kv_bytes_per_slot": self.row_bytes,
                "kv_bytes_in_use": running * self.row_bytes, "kv_bytes_total": self.rows * self.row_bytes}

    def views(self, start: int, stop: int) -> tuple[KVCache, KVCache | None]:
        """Rows start..stop-1 of both caches, sharing storage with the pool."""
        draft_view = self.draft_cache.slice_rows(start, stop) if self.draft_cache is not None else None
        return self.cache.slice_rows(start, stop), draft_view

    def reset(self, start: int, stop: int) -> None:
        """Empty rows start..stop-1 for new requests."""
        view, draft_view = self.views(start, stop)
        view.lengths.zero_()
        if draft_view is not None:
            draft_view.lengths.zero_()

    def order_by_band(self, bands: list[int]) -> list[tuple[int, int]]:
        """Put the running rows (of these temperature bands) in band order, greedy first, so
        a round's drafting rows are a prefix (`gate.DraftGate`). Rows arrive at the end of
        the pool, so few are out of place: the fewest swaps (`band_swaps`), each copying
        two rows' valid slots. Returns the swaps made, in order."""
        swaps = band_swaps(bands)
        for a, b in swaps:
            ab, ba = [a, b], [b, a]
            for cache in (self.cache, self.draft_cache):
                if cache is None:
                    continue
                n = int(cache.lengths[ab].max())
                cache.k[:, ab, :, :n] = cache.k[:, ba, :, :n]   # advanced indexing: the right side is a copy
                cache.v[:, ab, :, :n] = cache.v[:, ba, :, :n]
                cache.lengths[ab] = cache.lengths[ba]
            if self.pending is not None:
                self.pending.swap(a, b)
        return swaps

    def compact(self, running: int, done: list[int]) -> list[tuple[int, int]]:
        """Free the rows in `done` (of the first `running`) and keep live rows contiguous:
        the last live rows move into the holes (only their valid slots are copied).
        Returns the (source, destination) row moves."""
        live = running - len(done)
        holes = [row for row in done if row < live]
        finished = set(done)
        movers = [row for row in range(live, running) if row not in finished]
        self.cache.move_rows(movers, holes)
        if self.draft_cache is not None and self.pending is not None:
            self.draft_cache.move_rows(movers, holes)
            self.pending.move_rows(movers, holes)
            self.pending.clear(live, running)
        return list(zip(movers, holes))


def band_swaps(bands: list[int]) -> list[tuple[int, int]]:
    """Swaps (a, b), applied in order, that sort `bands` (not stably: rows of one band are
    interchangeable); a row already in its band's range never moves."""
    bands = list(bands)
    target = sorted(bands)
    swaps = []
    for i, want in enumerate(target):
        if bands[i] == want:
            continue
        misplaced = [j for j in range(i + 1, len(bands)) if bands[j] == want and bands[j] != target[j]]
        # Prefer a row that belongs where row i's band goes: one swap places both.
        j = next((j for j in misplaced if target[j] == bands[i]), misplaced[0])
        bands[i], bands[j] = bands[j], bands[i]
        swaps.append((i, j))
    return swaps
