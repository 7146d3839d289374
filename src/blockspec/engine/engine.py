"""Continuous batching: a request queue and its engine thread over a slot pool.

Requests join (batched prefill) and leave (finish, cancel) between steps. Each
step runs ONE round (`round.speculative_round`) for every running request: one
draft forward and one packed target forward, in which every request verifies
its own number of drafts (`round.PackedForwards`), as the round policy
(`policy.RoundPolicy`: draft gate, DSpark planner, confidence recalibration, early
stop) decides. An EAGLE-3 draft tree (`--speculative-eagle-topk` > 1, fixed policy) verifies
every row's whole tree in one forward under its tree mask instead
(`Forwards.verify_tree_and_commit`), rows of any length side by side.

With `EngineOptions(compile=True)` (`serve --compile`) the rounds' forwards are captured
static-shape steps over the pool's own buffers (decoding/captured.py: CUDA graphs on
CUDA): rows padded to a row bucket, the ragged verify padded to the most drafts any row
verifies, then to its width bucket. Prefill (whole or chunked) stays eager.

Use it synchronously (`submit`, `step`, `run_until_done`) or from a background
thread (`start`, `submit`, iterate / await the handle, `shutdown`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from blockspec.config import RULES, SamplingParams
from blockspec.decoding.captured import EAGLE3_NOT_CAPTURED, MODES as CAPTURE_MODES, CapturedSteps
from blockspec.decoding.context import DraftContext
from blockspec.decoding.generate import check_method, check_tree
from blockspec.decoding.output import Completion, Detokenizer, RequestOutputState
from blockspec.decoding.policy import PolicyOptions, RoundPolicy
from blockspec.decoding.prefill import ContextSink, prefill
from blockspec.decoding.round import Forwards, PackedForwards, RoundInputs, speculative_round
from blockspec.decoding.sampling import RowSampler, new_generator
from blockspec.engine.handles import RequestHandle, RequestOutput
from blockspec.engine.memory import plan_for_models
from blockspec.engine.prefill_chunks import ChunkedPrefill, chunk_size
from blockspec.engine.slots import SlotPool
from blockspec.engine.stats import EngineStats
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import AnyDraft, Eagle3Drafter
from blockspec.models.target import TargetModel

__all__ = ["Engine", "EngineOptions", "RequestHandle", "RequestOutput"]


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """The engine's runtime settings besides its size (max_running, max_model_len).

    rule: the verification rule when sampling. Memory (`memory.plan_for_models`): slots
    that fit kv_memory_gb, else gpu_memory_utilization of the free memory.
    prefill_chunk_tokens: longer prompts are prefilled that many tokens per step
    (None: 2048 on CUDA, 512 on CPU). compile: rounds on captured static-shape steps
    (`captured.CapturedSteps`); capture_mode: how ("graphs", "compile", "eager": the
    same static code uncaptured, for tests; None: graphs on CUDA, compile elsewhere)."""

    rule: str = "rejection"
    kv_memory_gb: float | None = None
    gpu_memory_utilization: float | None = None
    prefill_chunk_tokens: int | None = None
    compile: bool = False
    capture_mode: str | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise BlockspecError(f"unknown verification rule {self.rule!r} (choose rejection or match)")
        if self.capture_mode is not None and (not self.compile or self.capture_mode not in CAPTURE_MODES):
            raise BlockspecError(f"capture_mode needs compile=True and one of {', '.join(CAPTURE_MODES)}, "
                                 f"got {self.capture_mode!r}")


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    output: RequestOutputState
    handle: RequestHandle
    generator: torch.Generator
    anchor: int = -1


def check_request(prompt_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                  has_tokenizer: bool) -> list[int]:
    """The prompt as ints, or BlockspecError for a request that can never run."""
    if not isinstance(params, SamplingParams):
        raise BlockspecError("params must be a SamplingParams")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise BlockspecError("the prompt is empty")
    if any(t < 0 or t >= vocab for t in prompt):
        raise BlockspecError(f"prompt token ids must be in 0..{vocab - 1}")
    params.check_vocab(vocab)  # a stop id the model cannot produce would never stop
    need = len(prompt) + params.max_new_tokens
    if need > max_model_len:
        raise BlockspecError(
            f"request needs {need} positions (prompt {len(prompt)} + max_new_tokens {params.max_new_tokens}) "
            f"but the engine holds at most max_model_len={max_model_len} per request")
    if params.stop and not has_tokenizer:
        raise BlockspecError("stop strings need a tokenizer; pass tokenizer= to the Engine or use stop_token_ids")
    return prompt


def round_strategy(slots: SlotPool, options: EngineOptions
                   ) -> tuple[CapturedSteps | None, Forwards, DraftContext | None]:
    """(captured runner, forwards, draft context) of the engine's rounds: packed eager forwards
    with the pool's buffered context, or captured steps on the pool's own buffers (which the
    pool moves in place, so graphs keep their addresses) appending every round's context."""
    if not options.compile:
        return None, PackedForwards(), slots.pending
    if isinstance(slots.draft, Eagle3Drafter):
        raise BlockspecError(EAGLE3_NOT_CAPTURED)
    captured = CapturedSteps(slots.target, slots.draft, mode=options.capture_mode)
    captured.adopt(slots.cache, slots.draft_cache)
    return captured, captured.forwards(), captured.context() if slots.draft is not None else None


def request_sampler(reqs: list[Any], target: TargetModel) -> RowSampler:
    """The rows' sampler: their parameters, own generators and (for penalties) token histories."""
    return RowSampler.from_params([r.params for r in reqs], target.device, [r.generator for r in reqs],
                                  [(r.prompt, r.output.tokens) for r in reqs], target.config.vocab_size)


class Engine:
    """Continuous-batching speculative decoding over a fixed KV slot pool.

    method: "ar" | "dflash" | "dspark" | "eagle3". policy: a `RoundPolicy` or the `PolicyOptions` to
    build one from (`RoundPolicy.for_method`; default adaptive). Memory: rows = min(max_running,
    slots that fit the options' budget: `memory.plan_for_models`) of max_model_len positions.
    forwards: the round's strategy (`round.PackedForwards`, or the captured steps' with
    options.compile; the bench and tests wrap it)."""

    def __init__(self, target: TargetModel, draft: AnyDraft | None = None, method: str = "ar", *,
                 max_running: int = 32, max_model_len: int | None = None, tokenizer: Detokenizer | None = None,
                 policy: RoundPolicy | PolicyOptions | None = None, options: EngineOptions | None = None) -> None:
        check_method(method, draft)
        options = options or EngineOptions()
        chunk = chunk_size(options.prefill_chunk_tokens, target.device)
        self.target, self.method, self.rule, self.tokenizer = target, method, options.rule, tokenizer
        self.draft = draft if method != "ar" else None
        if self.draft is not None:
            self.draft.config.check_target(target.config)
        self.policy = RoundPolicy.of(policy, target, self.draft, method, max_running)
        check_tree(self.draft, [], self.policy, self.rule)
        # Slots x length from the memory free now (the weights are loaded): never
        # max_running x max_position_embeddings blindly.
        self.memory_plan = plan_for_models(target, self.draft, max_running, max_model_len, options.kv_memory_gb,
                                           options.gpu_memory_utilization)
        self.max_model_len = self.memory_plan.max_model_len
        self.slots = SlotPool(target, self.draft, self.memory_plan, buffered=not options.compile)
        self.captured, self.forwards, self.context = round_strategy(self.slots, options)
        self.stats = EngineStats(speculative=self.draft is not None)
        self.chunks = ChunkedPrefill(target, self.draft, self.slots, self.stats, chunk)
        self._lock = threading.Lock()        # queue, cancellations, live requests
        self._step_lock = threading.Lock()   # one step at a time; caches change only under it
        self._wake = threading.Event()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []    # index == cache row
        self._cancel: set[str] = set()
        self._live: dict[str, Request] = {}   # submitted, not yet retired
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._drain = True
        self.failure: BaseException | None = None

    @property
    def rows(self) -> int:
        return self.slots.rows

    # -- public API ----------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None,
               on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Queue a request. Raises BlockspecError (and queues nothing) if it can never run."""
        params = params or SamplingParams()
        if self._closed:
            raise BlockspecError("the engine is shut down; no new requests")
        try:
            prompt = check_request(prompt_ids, params, self.target.config.vocab_size, self.max_model_len,
                                   self.tokenizer is not None)
            check_tree(self.draft, [params], self.policy, self.rule)   # what a draft tree cannot serve
        except BlockspecError:
            self.stats.count("rejected")
            raise
        with self._lock:
            if self._closed:
                raise BlockspecError("the engine is shut down; no new requests")
            rid = request_id if request_id is not None else f"req-{next(self._counter)}"
            if rid in self._live:
                self.stats.count("rejected")
                raise BlockspecError(f"request id {rid!r} is already in use")
            output = RequestOutputState(params, self.target.config.eos_token_id, self.tokenizer)
            req = Request(rid, prompt, params, output, RequestHandle(rid, on_output), new_generator(params))
            self._waiting.append(req)
            self._live[rid] = req
            self.stats.count("submitted")
        self._wake.set()
        return req.handle

    def cancel(self, request_id: str) -> bool:
        """Cancel a waiting or running request (from any thread); its slot is freed. False if unknown/finished."""
        with self._lock:
            req = self._live.get(request_id)
            if req is None or req.handle.done:
                return False
            self._cancel.add(request_id)
        if self._step_lock.acquire(blocking=False):  # not mid-step: free it now
            try:
                with torch.inference_mode():
                    self._apply_cancels()
            finally:
                self._step_lock.release()
        self._wake.set()
        return True

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running or self._cancel)

    def step(self) -> bool:
        """One engine step: cancellations, admission (batched prefill), one round for
        every running request, retirement. Returns whether work remains."""
        with self._step_lock, torch.inference_mode():
            self._apply_cancels()
            self._admit()
            self._retire()
            if self._running:
                self._round()
                self._retire()
                if not self._running:   # drained: the next engine of these models starts from here
                    self.policy.remember()
        return self.has_work

    def run_until_done(self) -> None:
        """Step until every submitted request has finished (synchronous mode only)."""
        if self._thread is not None:
            raise BlockspecError("the engine runs in a background thread; wait on the handles instead")
        while self.step():
            pass

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Convenience: submit all, run to completion, return completions in order."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        handles = [self.submit(p, sp) for p, sp in zip(prompts, params)]
        self.run_until_done()
        return [h.result() for h in handles]

    def start(self) -> None:
        """Run steps in a background thread until `shutdown`."""
        if self._thread is not None:
            raise BlockspecError("the engine is already running")
        if self._closed:
            raise BlockspecError("the engine is shut down")
        self._thread = threading.Thread(target=self._loop, name="blockspec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; drain=True finishes queued and running ones,
        drain=False cancels them. Joins the background thread."""
        with self._lock:
            self._closed = True
            self._drain = drain
            if not drain:
                self._cancel.update(r.id for r in itertools.chain(self._waiting, self._running))
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise BlockspecError("engine thread did not stop in time")
            self._thread = None
        elif drain:
            self.run_until_done()
        else:
            self.step()

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            running, waiting = len(self._running), len(self._waiting)
        return {"method": self.method, **self.policy.metrics(), "max_model_len": self.max_model_len,
                **self.slots.usage(running), "running": running, "waiting": waiting, **self.stats.snapshot()}

    # -- step internals ------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                work = self.has_work
                if self._stopping and not (self._drain and work) and not self._cancel:
                    return
                if work:
                    self.step()
                else:  # idle: sleep until submit / cancel / shutdown wakes us
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # a failed step fails every request, never hangs a client
            self.failure = exc
            self._fail_all(exc)

    def _apply_cancels(self) -> None:
        with self._lock:
            ids, self._cancel = self._cancel, set()
            waiting = [r for r in self._waiting if r.id in ids]
            self._waiting = deque(r for r in self._waiting if r.id not in ids)
        for req in waiting:
            self._finish(req, "cancelled")
        for req in self._running:
            if req.id in ids and not req.output.finished:
                self._finish(req, "cancelled")   # now: its held-back tokens go out with the end
        self._retire()

    def _admit(self) -> None:
        """Prefill as many waiting requests as there are free slots, in one batch; a longer prompt
        than the chunk budget goes a chunk per step (`ChunkedPrefill`), then joins the rounds."""
        with self._lock:
            new = self.chunks.admit(self._waiting, self.rows - len(self._running) - self.chunks.rows_held)
            first, last = len(self._running), len(self._running) + len(new)
            self._running.extend(new)
        self._join_chunked()   # after `new`
        if not new:
            return
        t0 = time.perf_counter()
        admitted = time.monotonic()
        for req in new:
            self.stats.admitted(req.handle.times, admitted)
        self.slots.reset(first, last)
        view, draft_view = self.slots.views(first, last)
        sampler = request_sampler(new, self.target)
        tops = [-1 if r.params.prompt_logprobs is None else r.params.prompt_logprobs for r in new]
        done = prefill(self.target, view, [r.prompt for r in new], sampler,
                       ContextSink(self.draft, draft_view, self.slots.pending, first), tops)
        for i, (req, tok) in enumerate(zip(new, done.anchors.tolist())):
            req.anchor = tok
            if done.prompt_logprobs is not None:
                req.output.prompt_logprobs = done.prompt_logprobs[i]
            self._emit(req, [tok], done.logprobs[i] if done.logprobs is not None else None)
        self.stats.prefill(sum(len(r.prompt) for r in new), time.perf_counter() - t0)

    def _join_chunked(self) -> None:
        """Advance the chunked prompt; when done it joins the running rows, its first token its anchor."""
        joined = self.chunks.advance()
        if joined is None:
            return
        req, req.anchor, logprobs = joined
        with self._lock:
            self._waiting.remove(req)
            self.chunks.release(len(self._running))
            self._running.append(req)
        self._emit(req, [req.anchor], logprobs)

    def _round(self) -> None:
        """One round for every running request, then their tokens streamed."""
        t_start = time.perf_counter()
        reqs = self._running
        bands = [q.params.band for q in reqs]
        with self._lock:   # band order, greedy first: drafting rows are a prefix
            for a, b in self.slots.order_by_band(bands):
                reqs[a], reqs[b], bands[a], bands[b] = reqs[b], reqs[a], bands[b], bands[a]
        view, draft_view = self.slots.views(0, len(reqs))
        anchors = torch.tensor([q.anchor for q in reqs], dtype=torch.long, device=self.target.device)
        batch = RoundInputs(self.target, self.draft, view, draft_view, self.context, anchors,
                            request_sampler(reqs, self.target), bands, self.forwards)
        outcome = speculative_round(batch, self.policy, rule=self.rule)
        for i, req in enumerate(reqs):
            req.output.record_round(outcome.verified[i], outcome.accepted[i])
            req.anchor = outcome.bonus[i]
            self._emit(req, outcome.new_tokens(i), outcome.logprobs[i] if outcome.logprobs is not None else None)
        self.stats.round(outcome)
        # The round's real cost, bookkeeping included.
        self.policy.observe_time(len(reqs), outcome, time.perf_counter() - t_start)

    def _emit(self, req: Request, new: list[int], logprobs: list | None = None) -> None:
        """Apply stop tokens, length and stop strings, then stream the delta."""
        delta = req.output.push(new, logprobs)
        now = time.monotonic()
        # Statistics before publishing: a client that saw its end finds it in /metrics.
        self.stats.tokens(req.handle.times, len(delta.tokens), now)
        if not delta.finished:
            if delta.tokens or delta.text or delta.prompt_logprobs:
                req.handle.publish(RequestOutput(req.id, delta.tokens, delta.text, False, None, delta.logprobs,
                                                 delta.prompt_logprobs))
            return
        self.stats.request_finished(req.handle.times, req.output.finish_reason, now)
        req.handle.publish(RequestOutput(req.id, delta.tokens, delta.text, True, req.output.finish_reason,
                                         delta.logprobs, delta.prompt_logprobs), req.output.completion())
        self.stats.count("finished")

    def _finish(self, req: Request, reason: str) -> None:
        """End a request that did not finish by itself (cancelled / error), with what it held back."""
        delta = req.output.finish(reason)
        now = time.monotonic()
        self.stats.tokens(req.handle.times, len(delta.tokens), now)
        self.stats.request_finished(req.handle.times, reason, now)
        req.handle.publish(RequestOutput(req.id, delta.tokens, delta.text, True, reason, delta.logprobs,
                                         delta.prompt_logprobs), req.output.completion())
        self.stats.count("cancelled" if reason == "cancelled" else "failed")
        with self._lock:
            self._live.pop(req.id, None)

    def _retire(self) -> None:
        """Free the slots of finished / cancelled requests (the pool keeps live rows contiguous)."""
        done = [row for row, req in enumerate(self._running) if req.output.finished]
        if not done:
            return
        for row in done:
            req = self._running[row]
            if req.output.finish_reason == "cancelled" and not req.handle.done:
                self._finish(req, "cancelled")
        moves = self.slots.compact(len(self._running), done)
        with self._lock:
            for row in done:
                self._live.pop(self._running[row].id, None)
            for src, dst in moves:
                self._running[dst] = self._running[src]
            del self._running[len(self._running) - len(done):]

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            reqs = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._closed = True
            self._running = []
        for req in reqs:
            if not req.handle.done:
                req.handle.error = exc
                self._finish(req, "error")
