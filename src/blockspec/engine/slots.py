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

from blockspec.decoding.context import PendingContext
from blockspec.engine.memory import MemoryPlan
from blockspec.models.chain_draft import AnyDraft
from blockspec.models.kv_cache import KVCache
from blockspec.models.target import TargetModel


class SlotPool:
    """`plan.slots` KV slots of `plan.max_model_len` positions (plus the block margin) for the
    target (and the draft): exactly the plan's bytes (`plan.slot_bytes` per slot).
    buffered: the draft context of rounds that did not draft, and a prompt of at most
    `plan.shapes.prompt_positions`, wait in a `PendingContext` until the row drafts (eager
    rounds); captured rounds append every round's context at once (no buffer)."""

    def __init__(self, target: TargetModel, draft: AnyDraft | None, plan: MemoryPlan,
                 buffered: bool = True) -> None:
        self.target, self.draft, self.plan = target, draft, plan
        self.slot_capacity = plan.max_model_len + plan.shapes.margin
        self.pending_capacity = plan.shapes.pending_positions
        self.row_bytes = plan.slot_bytes
        self.rows = plan.slots
        with torch.inference_mode():  # inference tensors: every later write happens in inference mode
            self.cache = target.new_cache(self.rows, self.slot_capacity)
            self.draft_cache = (draft.new_cache(self.rows, self.slot_capacity + self.pending_capacity)
                                if draft is not None else None)
        self.pending = (PendingContext(draft, self.draft_cache, self.pending_capacity,
                                       prompt_capacity=plan.shapes.prompt_positions)
                        if buffered and draft is not None and self.draft_cache is not None else None)

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
            for cache in (self.cache, self.draft_cache):
                if cache is not None:
                    cache.swap_rows(a, b)
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
        if self.draft_cache is not None:
            self.draft_cache.move_rows(movers, holes)
        if self.pending is not None:
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
