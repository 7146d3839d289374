"""Captured rounds: the round's three forwards as static-shape graphs (docs/design.md
section 12, "Captured rounds").

`CapturedSteps` owns the target and draft KV buffers of a batch and runs the static
steps of `models/static_steps.py` on them: the target's decode / verify forward over
[R, W] tokens and the draft's block and context forwards. Rows are padded up to a
bucket (1, 2, 4, 8, 16, 32, then multiples of 32) so a few graphs serve every batch
size; widths are whatever the round uses (1 for AR, g + 1 for verify, the block for
the draft), so a generation compiles at most (buckets x 3) graphs. On CUDA the steps
are compiled with `torch.compile(mode="reduce-overhead")` (CUDA graphs: one launch per
step), elsewhere with plain inductor, or run eagerly (`compile=False`: the same static
code, for tests).

The buffers never move while graphs hold their addresses: the batch's caches are row
views of them, finished rows are compacted in place (`keep_rows`), and a later
generation with no more rows and the same capacity reuses them (`captured_steps`
keeps one runner per target and draft).

Host synchronisations: none inside the steps; the round's one is the transfer of its
outcome (accepted counts, bonus tokens, drafted tokens) to the host. Sampled (non-greedy)
rows still add the sampler's per-row CPU generators and checks (decoding/sampling.py);
compaction when rows finish reads the longest kept row once.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from blockspec.errors import BlockspecError
from blockspec.models import static_steps
from blockspec.models.draft import DraftModel
from blockspec.models.kv_cache import KVCache
from blockspec.models.target import TargetModel

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)


def row_bucket(rows: int) -> int:
    """The smallest bucket holding `rows` (past 32: the next multiple of 32)."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return -(-rows // ROW_BUCKETS[-1]) * ROW_BUCKETS[-1]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [R, ...] zero-padded to `rows` rows (a device op: no host read)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class CapturedSteps:
    """Static-shape (optionally compiled) target and draft steps over buffers it owns.

    compile: True = torch.compile (CUDA graphs on CUDA, inductor on CPU); False = run the
    static steps eagerly (same shapes and results, no compilation)."""

    def __init__(self, target: TargetModel, draft: DraftModel | None = None, *, compile: bool = True) -> None:
        self.target, self.draft, self.compile = target, draft, compile
        self.cuda_graphs = compile and target.device.type == "cuda"
        self.cache: KVCache | None = None          # the target's buffers (rows >= every batch using them)
        self.draft_cache: KVCache | None = None
        self._steps: dict[tuple, Callable] = {}
        if compile:
            # One compiled specialisation per (step, bucket, width): more than dynamo's default
            # of 8 per code object (then it would silently fall back to eager).
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 512)

    # -- buffers --------------------------------------------------------------------
    def new_caches(self, rows: int, capacity: int, draft_capacity: int = 0) -> tuple[KVCache, KVCache | None]:
        """Row views (`rows` rows, lengths zero) of the target and draft buffers, which are
        reused when they hold the rows' bucket at this capacity and reallocated otherwise."""
        need = row_bucket(rows)
        cache = self.cache
        if cache is None or cache.rows < need or cache.capacity != capacity:
            self.cache = self._static(self.target.new_cache(need, capacity))
        if self.draft is not None:
            dc = self.draft_cache
            if dc is None or dc.rows < need or dc.capacity != draft_capacity:
                self.draft_cache = self._static(self.draft.new_cache(need, draft_capacity))
        for c in (self.cache, self.draft_cache):
            if c is not None:
                c.reset()
        return self.cache.slice_rows(0, rows), (self.draft_cache.slice_rows(0, rows)
                                                if self.draft_cache is not None else None)

    def _static(self, cache: KVCache) -> KVCache:
        if self.cuda_graphs:
            # CUDA graphs may mutate an input in place only at an address fixed for the graph's life.
            for t in (cache.k, cache.v, cache.lengths):
                torch._dynamo.mark_static_address(t, guard=False)
        return cache

    def keep_rows(self, keep: list[int]) -> tuple[KVCache, KVCache | None]:
        """Rows `keep` (ascending) move to the front of both buffers, in place (graphs hold the
        buffers' addresses, so they are never reallocated); returns the new row views."""
        n = len(keep)
        for cache in (self.cache, self.draft_cache):
            if cache is None:
                continue
            index = torch.tensor(keep, device=cache.lengths.device)
            lengths = cache.lengths[index]
            moved = [(src, dst) for dst, src in enumerate(keep) if src != dst]
            if moved:
                span = int(lengths.max())   # copy valid slots only (one host read per compaction)
                src = torch.tensor([s for s, _ in moved], device=index.device)
                dst = torch.tensor([d for _, d in moved], device=index.device)
                # The right-hand sides are gathered copies, so overlapping src / dst rows are safe.
                cache.k[:, dst, :, :span] = cache.k[:, src, :, :span]
                cache.v[:, dst, :, :span] = cache.v[:, src, :, :span]
            cache.lengths[:n] = lengths
            cache.lengths[n:] = 0     # padding rows of a bucket: empty, never near the capacity
        return self._views(n)

    def _views(self, rows: int) -> tuple[KVCache, KVCache | None]:
        assert self.cache is not None
        return self.cache.slice_rows(0, rows), (self.draft_cache.slice_rows(0, rows)
                                                if self.draft_cache is not None else None)

    def _base(self, view: KVCache, base: KVCache | None) -> KVCache:
        """The owned buffer a round's cache view belongs to (its first rows)."""
        if base is None or view.k.data_ptr() != base.k.data_ptr() or view.rows > base.rows:
            raise BlockspecError("captured steps run only on the row views of their own caches (new_caches)")
        return base

    # -- steps ----------------------------------------------------------------------
    def _step(self, name: str, fn: Callable, rows: int, width: int) -> Callable:
        key = (name, rows, width)
        step = self._steps.get(key)
        if step is None:
            if not self.compile:
                step = fn
            elif self.cuda_graphs:
                step = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
            else:
                step = torch.compile(fn, fullgraph=True, dynamic=False)
            self._steps[key] = step
        return step

    def _mark_step(self) -> None:
        if self.cuda_graphs:
            # The previous step's graph outputs have been consumed: their memory may be reused.
            torch.compiler.cudagraph_mark_step_begin()

    def target_forward(self, cache: KVCache, tokens: torch.Tensor, capture: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [R, W] after each row of the view `cache` (K/V written, lengths unchanged:
        the caller commits) -> logits [R, W, V], features [R, W, F] or None."""
        base = self._base(cache, self.cache)
        r, w = tokens.shape
        b = row_bucket(r)
        step = self._step(f"target{capture}", static_steps.target_step, b, w)
        self._mark_step()
        logits, features = step(self.target, _pad_rows(tokens, b), base, capture)
        return logits[:r], None if features is None else features[:r]

    def block_hidden(self, draft: DraftModel, block_ids: torch.Tensor, cache: KVCache,
                     embed: nn.Embedding) -> torch.Tensor:
        """`DraftModel.block_hidden` for the rows of the view `cache`: [R, S] -> [R, S, H]."""
        base = self._base(cache, self.draft_cache)
        r, s = block_ids.shape
        b = row_bucket(r)
        step = self._step("draft_block", static_steps.draft_block, b, s)
        self._mark_step()
        return step(draft, _pad_rows(block_ids, b), base, embed)[:r]

    def append_context(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        """The first R rows' features [R, W, F] become draft context; row r keeps counts[r]."""
        assert self.draft is not None and self.draft_cache is not None
        r, w = features.shape[:2]
        b = row_bucket(r)
        step = self._step("draft_context", static_steps.draft_context, b, w)
        self._mark_step()
        step(self.draft, _pad_rows(features, b), self.draft_cache)
        self.draft_cache.lengths[:r] += counts

    def context(self) -> "CapturedContext":
        return CapturedContext(self)


class CapturedContext:
    """The round's `DraftContext` over captured steps: features go to the draft at once."""

    def __init__(self, steps: CapturedSteps) -> None:
        self.steps = steps

    def flush(self, rows: int) -> None:
        pass

    def add(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        self.steps.append_context(features, counts)


def captured_steps(target: TargetModel, draft: DraftModel | None, compile: bool | None = None) -> CapturedSteps:
    """The target's runner for `draft`, kept on the target (as `TargetModel.compile_decode`
    keeps its step) so a later generation with the same draft reuses its buffers and graphs
    instead of compiling again. One runner per target: another draft replaces it (bounded
    memory). compile None: the existing runner whatever its mode, else a compiling one
    (tests install an eager one first). `release_captured` frees the buffers."""
    runner = target.__dict__.get("_captured_steps")
    if runner is None or runner.draft is not draft or (compile is not None and runner.compile != compile):
        runner = CapturedSteps(target, draft, compile=True if compile is None else compile)
        target.__dict__["_captured_steps"] = runner
    return runner


def release_captured(target: TargetModel) -> None:
    """Drop the target's captured runners and their KV buffers."""
    target.__dict__.pop("_captured_steps", None)
