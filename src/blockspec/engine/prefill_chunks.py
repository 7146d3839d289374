"""Chunked prefill for the engine: a long prompt cannot stall the running requests.

A prompt longer than `chunk` tokens is not prefilled in one forward at admission:
it is prefilled `chunk` tokens per engine step, and every step still runs its
round for the running requests (vLLM's --max-num-batched-tokens with chunked
prefill, SGLang's --chunked-prefill-size). Each chunk's target features are
appended to the draft context at once, so the request's draft context is whole
when it joins. Only when the last chunk has sampled the first token does the
request join the running rows (and so the rounds).

Bookkeeping, kept out of the engine: at most one prompt is chunk-prefilled at a
time (the budget is per step, and a first-come-first-served budget would only
ever advance the oldest prompt anyway). It stays in the engine's waiting queue
while it is prefilled, so cancellation, shutdown and failure treat it like any
queued request, and it holds the pool's LAST row, which the running rows
(always rows 0..R-1) and batch admission never reach while it is held. On
joining, its rows move to row R (one copy of the prompt's K/V).

Length-dependent RoPE (dynamic NTK, longrope) rotates a prompt by the whole
prompt's length, which a chunk does not know: those targets prefill whole.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

import torch

from blockspec.config import SamplingParams
from blockspec.decoding.prefill import first_logprobs
from blockspec.decoding.sampling import RowSampler, sample
from blockspec.engine.handles import RequestHandle
from blockspec.engine.slots import SlotPool
from blockspec.engine.stats import EngineStats
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import AnyDraft, Eagle3Drafter
from blockspec.models.target import TargetModel

# Default chunk, in prompt tokens per engine step. CUDA: vLLM's and SGLang's default chunk
# (2048), where a chunk's GEMMs already run at full throughput. CPU: 512 keeps a step's
# prefill to ~0.2 s on the first embedded (256 x 8) target, and a 2048-token prompt in chunks of
# 512 costs 6% more than in one forward (docs/results.md, benchmarks/attention_kernels.py).
DEFAULT_CHUNK = {"cuda": 2048, "cpu": 512}


def chunk_size(value: int | None, device: torch.device) -> int:
    """The chunk budget: `value`, or the device's default; BlockspecError if not a positive int."""
    if value is None:
        return DEFAULT_CHUNK.get(device.type, DEFAULT_CHUNK["cuda"])
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BlockspecError(f"prefill_chunk_tokens must be a positive number of tokens, got {value!r}")
    return value


class PrefillRequest(Protocol):
    """What chunked prefill reads of an engine request (it writes none of it)."""

    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    handle: RequestHandle


class ChunkedPrefill:
    """The one prompt being prefilled a chunk per step (see the module docstring). The
    engine admits through `admit`, runs `advance` once per step and, when it returns the
    finished request, moves it into the running rows with `release`."""

    def __init__(self, target: TargetModel, draft: AnyDraft | None, slots: SlotPool, stats: EngineStats,
                 chunk: int) -> None:
        self.target, self.draft, self.slots, self.stats = target, draft, slots, stats
        self.chunk = chunk
        self.row = slots.rows - 1
        self.req: PrefillRequest | None = None   # the request in flight, still in the engine's queue
        self.done = 0             # its prompt tokens already in the cache

    @property
    def rows_held(self) -> int:
        return 0 if self.req is None else 1

    def chunked(self, req: PrefillRequest) -> bool:
        """Whether this request's prompt is prefilled in chunks."""
        return (len(req.prompt) > self.chunk and not self.target.rotary.rope.length_dependent
                and req.params.prompt_logprobs is None   # scored in one forward: every position's logits
                and self.slots.rows > 1)   # one slot: the only row is the running one

    def admit(self, waiting: deque, free: int) -> list[PrefillRequest]:
        """Pop, in order, up to `free` short-prompt requests for the batched prefill (returned),
        and start the first long prompt if none is in flight and a row is free (it stays in
        `waiting`). Long prompts waiting behind the one in flight keep their place; short
        ones behind them may overtake them (not whole prompts: that is the point)."""
        taken: list[PrefillRequest] = []
        for req in list(waiting):
            if len(taken) >= free:
                break
            if req is self.req:
                continue
            if not self.chunked(req):
                taken.append(req)
            elif self.req is None:
                self._start(req)
                free -= 1
        for req in taken:
            waiting.remove(req)
        return taken

    def _start(self, req: PrefillRequest) -> None:
        self.req, self.done = req, 0
        self.slots.reset(self.row, self.row + 1)
        self.stats.admitted(req.handle.times, time.monotonic())

    def advance(self) -> tuple[PrefillRequest, int, list | None] | None:
        """Prefill the next chunk of the prompt in flight. Returns (request, first token, its logprobs)
        once its last chunk ran; the caller then moves it with `release`."""
        req = self.req
        if req is None:
            return None
        if req.handle.done:            # cancelled or failed while queued: free the row
            self.req = None
            return None
        t0 = time.perf_counter()
        part = req.prompt[self.done:self.done + self.chunk]
        last = self.done + len(part) == len(req.prompt)
        dev = self.target.device
        view, draft_view = self.slots.views(self.row, self.row + 1)
        capture = tuple(self.draft.config.target_layer_ids) if self.draft is not None else ()
        out = self.target(torch.tensor([part], device=dev), view, capture=capture,
                          logits_at=torch.tensor([[len(part) - 1]], device=dev),
                          output="logits" if last else "hidden")   # earlier chunks need no lm_head
        first = None
        if last:   # the request's own generator draws its first token, as a whole prefill does
            sampler = RowSampler.from_params([req.params], dev, [req.generator], [(req.prompt, [])],
                                             self.target.config.vocab_size)
            token = sample(sampler.adjusted(out.logits), sampler)[0][:, 0]
            logprobs = first_logprobs(out.logits, token, sampler)
            first = (int(token[0]), logprobs[0] if logprobs is not None else None)
        if isinstance(self.draft, Eagle3Drafter):
            # EAGLE-3 pairs each position with the token after it: the prompt's, then the first token.
            after = req.prompt[self.done + 1:self.done + len(part) + 1] + ([first[0]] if first else [])
            assert draft_view is not None and out.features is not None
            self.draft.append_context(draft_view, out.features, len(part), torch.tensor([after], device=dev))
        elif self.draft is not None:
            assert draft_view is not None and out.features is not None
            self.draft.append_context(draft_view, out.features, len(part))
        self.done += len(part)
        self.stats.prefill(len(part), time.perf_counter() - t0)
        return None if first is None else (req, *first)


    def release(self, row: int) -> None:
        """Move the finished prompt's target and draft rows to `row` (the next running row)."""
        if row != self.row:
            self.slots.cache.move_rows([self.row], [row])
            if self.slots.draft_cache is not None:
                self.slots.draft_cache.move_rows([self.row], [row])
        if self.slots.pending is not None:   # its context went straight to the draft cache
            self.slots.pending.clear(row, row + 1)
        self.req = None
