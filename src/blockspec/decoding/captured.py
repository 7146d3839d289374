"""Captured rounds: the round's three forwards as static-shape graphs (docs/design.md
section 12, "Captured rounds").

`CapturedSteps` owns the target and draft KV buffers of a batch and runs the static
steps of `models/static_steps.py` on them: the target's decode / verify forward over
[R, W] tokens and the draft's block and context forwards. Rows are padded up to a
bucket (1, 2, 4, 8, 16, 32, then multiples of 32; at most the buffers' rows) and a
verify's width (anchor + the most drafts a row verifies: DSpark's planner and the
draft gate vary it) up to a width bucket (1, 2, 4, 8, ... capped at the window), so a
few graphs serve every batch: (row buckets x width buckets) per step. On CUDA each step is
captured into a CUDA graph of the eager static code ("graphs", the default: one launch
per step), or compiled with `torch.compile(mode="reduce-overhead")` ("compile"); elsewhere
it is compiled with plain inductor, or run eagerly (`compile=False`: the same static
code, for tests). `CapturedForwards` is the round's forwards strategy over these steps.

The buffers never move while graphs hold their addresses: the batch's caches are row
views of them, finished rows are compacted in place (`keep_rows`), and a later
generation with no more rows and the same capacity reuses them (`captured_steps`
keeps one runner per target and draft). The engine's runner adopts its slot pool's
buffers instead (`adopt`), and the pool moves rows in place as it always does.

Padding rows of a bucket are whatever rows of the buffers follow the real ones (free
slots, a prompt being prefilled in chunks): a step writes K/V only into slots at or past
each row's length, which hold nothing committed, so they are never harmed.

Host synchronisations: none inside the steps; the round's one is the transfer of its
outcome (accepted counts, bonus tokens, drafted tokens) to the host. Sampled (non-greedy)
rows still add the sampler's per-row CPU generators and checks (decoding/sampling.py);
compaction when rows finish reads the longest kept row once.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from blockspec.decoding.round import Forwards, verified_width
from blockspec.errors import BlockspecError
from blockspec.models import static_steps
from blockspec.models.draft import DraftModel
from blockspec.models.kv_cache import KVCache
from blockspec.models.layers import Attention
from blockspec.models.target import TargetModel

EAGLE3_NOT_CAPTURED = "compile (captured static steps) does not run EAGLE-3 chains or trees yet; drop --compile"

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
MODES = ("eager", "compile", "graphs")


def row_bucket(rows: int) -> int:
    """The smallest bucket holding `rows` (past 32: the next multiple of 32)."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return -(-rows // ROW_BUCKETS[-1]) * ROW_BUCKETS[-1]


def width_bucket(width: int, window: int) -> int:
    """The verify width a step runs at: 1, else the smallest power of two holding `width`,
    capped at `window` (anchor + all drafts). Causal attention: padding after a row's
    tokens changes none of its positions."""
    if width <= 1:
        return width
    return min(window, 1 << (width - 1).bit_length())


def _pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [R, W, ...] zero-padded to `width` along dim 1."""
    if x.shape[1] == width:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], *x.shape[2:])], dim=1)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [R, ...] zero-padded to `rows` rows (a device op: no host read)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class CapturedSteps:
    """Static-shape target and draft steps over buffers it owns, run as `mode` says:

    - "graphs" (the CUDA default): each (step, bucket, width) is captured once into a
      `torch.cuda.CUDAGraph` from the eager static code (one warm-up run, then capture:
      well under a second for an 8B target, where compiling takes minutes) and replayed;
    - "compile": `torch.compile` of the static code (mode="reduce-overhead", i.e. CUDA
      graphs of inductor kernels, on CUDA; plain inductor elsewhere: the CPU default);
    - "eager": the static code as is (tests; same shapes and results).
    compile=False forces "eager"."""

    def __init__(self, target: TargetModel, draft: DraftModel | None = None, *, compile: bool = True,
                 mode: str | None = None) -> None:
        cuda = target.device.type == "cuda"
        # longrope builds its long factors on the host per call: a copy a CUDA graph cannot capture.
        host_rope = any(m is not None and m.config.rope.rope_type == "longrope" for m in (target, draft))
        mode = "eager" if not compile else mode or ("graphs" if cuda and not host_rope else "compile")
        if mode not in MODES or (mode == "graphs" and not cuda):
            raise BlockspecError(f"captured mode must be one of {', '.join(MODES)} (graphs: CUDA only), got {mode!r}")
        if draft is not None and draft.config.is_windowed:
            raise BlockspecError("captured (compiled) rounds do not run sliding-window drafts yet; "
                                 "run them without compile")
        self.target, self.draft, self.compile, self.mode = target, draft, compile, mode
        self.cuda_graphs = cuda and mode != "eager"
        self.cache: KVCache | None = None          # the target's buffers (rows >= every batch using them)
        self.draft_cache: KVCache | None = None
        self._steps: dict[tuple, Callable] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "graphs" else None   # shared by every graph
        if mode == "compile":
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
        cache, dc = self.cache, self.draft_cache
        if cache is None or cache.rows < need or cache.capacity != capacity:
            self.cache = None   # (freed before the new one is allocated)
            self.cache = self._static(self.target.new_cache(need, capacity))
        if self.draft is not None and (dc is None or dc.rows < need or dc.capacity != draft_capacity):
            self.draft_cache = None
            self.draft_cache = self._static(self.draft.new_cache(need, draft_capacity))
        if self.cache is not cache or self.draft_cache is not dc:
            self._steps.clear()   # recorded graphs (and step closures) address the old buffers
        for c in (self.cache, self.draft_cache):
            if c is not None:
                c.reset()
        return self.cache.slice_rows(0, rows), (self.draft_cache.slice_rows(0, rows)
                                                if self.draft_cache is not None else None)

    def adopt(self, cache: KVCache, draft_cache: KVCache | None) -> None:
        """Run on these buffers from now on (the engine's slot pool, which moves its rows in
        place): graphs recorded over other buffers are dropped."""
        if (draft_cache is None) != (self.draft is None):
            raise BlockspecError("captured steps need a draft cache exactly when they have a draft")
        self.cache = self._static(cache)
        self.draft_cache = self._static(draft_cache) if draft_cache is not None else None
        self._steps.clear()

    def _static(self, cache: KVCache) -> KVCache:
        if self.mode == "compile" and self.cuda_graphs:
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
            raise BlockspecError("captured steps run only on the row views of their own caches (new_caches, adopt)")
        return base

    @staticmethod
    def _bucket(rows: int, base: KVCache) -> int:
        """Rows a step runs: the bucket, within the buffer (a pool of 5 slots runs 5, not 8)."""
        return min(row_bucket(rows), base.rows)

    # -- steps ----------------------------------------------------------------------
    def _run(self, name: str, fn: Callable, width: int, module: nn.Module, x: torch.Tensor, base: KVCache,
             *extra) -> object:
        """fn(module, x, base, *extra) for x [bucket, width, ...], as this runner's mode says."""
        key = (name, x.shape[0], width)
        step = self._steps.get(key)
        if step is None:
            if self.mode == "graphs":
                step = self._capture(fn, module, x, base, extra)
            elif self.mode == "compile":
                opts = dict(mode="reduce-overhead") if self.cuda_graphs else {}
                compiled = torch.compile(fn, fullgraph=True, dynamic=False, **opts)
                step = lambda x_, c=compiled: c(module, x_, base, *extra)   # noqa: E731
            else:
                step = lambda x_: fn(module, x_, base, *extra)   # noqa: E731
            self._steps[key] = step
        if self.mode == "compile" and self.cuda_graphs:
            # The previous step's graph outputs have been consumed: their memory may be reused.
            torch.compiler.cudagraph_mark_step_begin()
        return step(x)

    def _capture(self, fn: Callable, module: nn.Module, example: torch.Tensor, base: KVCache,
                 extra: tuple) -> Callable:
        """A CUDA graph of fn over a static copy of `example`: replaying copies the new input
        in and returns the graph's own output tensors. Graphs share one memory pool, so an
        output stays valid only until the next replay of ANY step: the round consumes each
        (enqueues its readers) before it runs the next step. Warm-up and capture write K/V
        only into slots past every row's length, which hold nothing committed."""
        static_in = example.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # lazy inits (RoPE tables, cuBLAS workspaces) outside the capture
            fn(module, static_in, base, *extra)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = fn(module, static_in, base, *extra)
        keep = self._lazy_tensors()

        def replay(x: torch.Tensor) -> object:
            static_in.copy_(x)
            graph.replay()
            return static_out
        replay.keep_alive = keep   # type: ignore[attr-defined]
        return replay

    def _lazy_tensors(self) -> list[torch.Tensor]:
        """Tensors the models build lazily and replace when they grow (RoPE tables, the fused
        q/k norm weights): a graph reads them by address, so it holds the ones it captured
        (a later, longer eager forward regrowing a table must not free memory a graph reads)."""
        keep: list[torch.Tensor] = []
        for model in (self.target, self.draft):
            if model is None:
                continue
            for pair in model.rotary._tables.values():
                keep.extend(pair)
            keep.extend(m._qk_weight for m in model.modules()
                        if isinstance(m, Attention) and m._qk_weight is not None)
        return keep

    def target_forward(self, cache: KVCache, tokens: torch.Tensor, capture: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [R, W] after each row of the view `cache` (K/V written, lengths unchanged:
        the caller commits) -> logits [R, W, V], features [R, W, F] or None.

        A verify shorter than the draft's window (a shorter gated block, DSpark's early
        stop or planned lengths) runs at its width bucket, padded after its tokens:
        attention is causal, so the padding changes no real position."""
        base = self._base(cache, self.cache)
        r, w = tokens.shape
        tokens = _pad_width(tokens, width_bucket(w, self.window(w)))
        logits, features = self._run(f"target{capture}", static_steps.target_step, tokens.shape[1], self.target,
                                     _pad_rows(tokens, self._bucket(r, base)), base, capture)
        return logits[:r, :w], None if features is None else features[:r, :w]

    def window(self, width: int) -> int:
        """The widest verify: anchor + the draft's window (AR: the width itself)."""
        return self.draft.config.num_drafts + 1 if self.draft is not None else width

    def block_hidden(self, draft: DraftModel, block_ids: torch.Tensor, cache: KVCache,
                     embed: nn.Embedding) -> torch.Tensor:
        """`DraftModel.block_hidden` for the rows of the view `cache`: [R, S] -> [R, S, H]."""
        base = self._base(cache, self.draft_cache)
        if draft is not self.draft:
            raise BlockspecError("captured steps run the draft they were built for")
        r, s = block_ids.shape
        hidden = self._run("draft_block", static_steps.draft_block, s, draft,
                           _pad_rows(block_ids, self._bucket(r, base)), base, embed)
        return hidden[:r]

    def append_context(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        """The first R rows' features [R, W, F] become draft context; row r keeps counts[r].
        Widths are padded to their bucket, as in `target_forward` (the extra slots lie past
        what any row keeps)."""
        assert self.draft is not None and self.draft_cache is not None
        r, w = features.shape[:2]
        features = _pad_width(features, width_bucket(w, self.window(w)))
        self._run("draft_context", static_steps.draft_context, features.shape[1], self.draft,
                  _pad_rows(features, self._bucket(r, self.draft_cache)), self.draft_cache)
        self.draft_cache.lengths[:r] += counts

    def context(self) -> "CapturedContext":
        return CapturedContext(self)

    def forwards(self) -> "CapturedForwards":
        return CapturedForwards(self)


class CapturedContext:
    """The round's `DraftContext` over captured steps: features go to the draft at once."""

    def __init__(self, steps: CapturedSteps) -> None:
        self.steps = steps

    def flush(self, rows: int) -> None:
        pass

    def add(self, features: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor | None = None) -> None:
        self.steps.append_context(features, counts)   # DFlash / DSpark only: no token reads its context

    def keep_rows(self, keep: list[int]) -> None:
        pass   # nothing buffered: the runner keeps its caches' rows (`CapturedSteps.keep_rows`)


class CapturedForwards(Forwards):
    """The round's forwards as captured steps (dense rows): the draft's block forward and the
    target's verify forward run on the runner's buffers, and the commit sets the lengths
    without reading them on the host (the static step left them alone). The verify spans
    the most drafts any row verifies (ragged rows: the others' extra positions are computed
    and never read, as `PackedForwards` leaves them out), a host value: the policy plans
    verify lengths on the host."""

    def __init__(self, steps: CapturedSteps) -> None:
        self.steps = steps

    def width(self, drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> int:
        return verified_width(drafts, num_drafts)

    def draft_block(self, draft: DraftModel, block_ids: torch.Tensor, draft_cache: KVCache,
                    embed: nn.Embedding) -> torch.Tensor:
        return self.steps.block_hidden(draft, block_ids, draft_cache, embed)

    def target_forward(self, target: TargetModel, cache: KVCache, anchors: torch.Tensor, drafts: torch.Tensor,
                       num_drafts: torch.Tensor | None, capture: tuple[int, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.steps.target_forward(cache, torch.cat([anchors.unsqueeze(1), drafts], dim=1), capture)

    def commit(self, cache: KVCache, start: torch.Tensor, accepted: torch.Tensor) -> None:
        cache.lengths.copy_(start + accepted + 1)


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
