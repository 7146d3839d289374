"""Continuous batching: a request queue over a fixed pool of KV slots.

Requests join (batched prefill) and leave (finish, cancel) between steps. Each
step drafts for every running request with ONE draft forward and verifies all
of them with ONE packed target forward, in which every request verifies its
own number of drafts (DSpark's confidence scheduler, or the full window).

Slots: the target and draft caches are preallocated with `rows` rows of
`max_model_len` (+ a block margin) positions. Running requests always occupy
rows 0..R-1 (a leaving request's row is refilled by moving the last row), so
the running batch is a zero-copy slice of the pool.

Use it synchronously (`submit`, `step`, `run_until_done`) or from a background
thread (`start`, `submit`, iterate / await the handle, `shutdown`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import warnings
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Protocol

import torch

from blockspec.config import SamplingParams
from blockspec.decoding.generate import Completion, RowState, check_method
from blockspec.models.kv_cache import KVCache
from blockspec.decoding.sampling import RowSampler, Verdict, verify
from blockspec.decoding.scheduler import ConfidenceCalibration, CostTable, DraftGate, plan
from blockspec.decoding.speculate import Proposal, prefill, propose
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel

log = logging.getLogger(__name__)


class Detokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


# -- packed verification ------------------------------------------------------------

def verify_packed(target: TargetModel, cache: KVCache, anchors: torch.Tensor, proposal: Proposal | None,
                  sampler: RowSampler, num_drafts: torch.Tensor, capture: tuple[int, ...] = (),
                  rule: str = "rejection") -> tuple[Verdict, torch.Tensor | None]:
    """Packed counterpart of `speculate.verify_and_commit`: row r verifies
    [anchor, d_1..d_{num_drafts[r]}] in one ragged target forward; drafts past
    num_drafts[r] count as not proposed. Keeps the accepted prefix in the target cache.

    Returns the verdict and, with `capture`, the captured features of each row's kept
    tokens, [R, max(accepted + 1), F] (row r's first accepted[r] + 1 are valid): the
    draft's next context."""
    r = anchors.shape[0]
    start = cache.lengths.clone()
    if proposal is None:  # AR: a zero-width proposal (rejection sampling needs a Q tensor)
        v = target.config.vocab_size
        proposal = Proposal(anchors.new_zeros(r, 0), torch.zeros(r, 0, v, device=anchors.device), None)
        num_drafts = torch.zeros_like(anchors)
    # Verify up to the widest row only (the full window unless scheduled). Rows keep
    # their own generators, so full-window rounds draw the same uniforms as generate().
    g = int(num_drafts.max()) if r else 0
    proposal = Proposal(proposal.tokens[:, :g], None if proposal.probs is None else proposal.probs[:, :g], None)
    seq = torch.cat([anchors.unsqueeze(1), proposal.tokens], dim=1)        # [R, g+1]
    valid = torch.arange(g + 1, device=seq.device).unsqueeze(0) <= num_drafts.unsqueeze(1)
    out = target.forward_packed(seq[valid], num_drafts + 1, cache, capture=capture)
    # Back to [R, g+1]; slots past a row's own count stay zero (not proposed: never read).
    logits = out.logits.new_zeros(r, g + 1, out.logits.shape[-1])
    logits[valid] = out.logits[0]
    verdict = verify(logits, proposal.tokens, proposal.probs, sampler, num_drafts, rule)
    # Keep anchor + accepted drafts; the bonus gets its KV when it is the next anchor.
    cache.truncate(start + verdict.accepted + 1)
    if not capture:
        return verdict, None
    assert out.features is not None
    return verdict, unpack_rows(out.features[0], valid, verdict.accepted + 1)


class PendingContext:
    """Target features of tokens each row has committed that the draft has not yet
    turned into context K/V.

    A gated engine runs stretches of AR rounds; projecting each round's one token per
    row into every draft layer's K/V costs a few small GEMMs and KV writes per round.
    Rows buffer the features here instead and hand them to the draft in one batch:
    right before they draft, or for everyone when a buffer would overflow."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.capacity = capacity
        self.buf: torch.Tensor | None = None     # [rows, capacity, F], allocated on first use
        self.rows = rows
        self.lengths = torch.zeros(rows, dtype=torch.long)

    def add(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        """Row r (of the first features.shape[0]) appends its first counts[r] features."""
        r, w, f = features.shape
        if self.buf is None:
            self.buf = features.new_zeros(self.rows, self.capacity, f)
        counts = counts.to("cpu")
        if int((self.lengths[:r] + counts).max()) > self.capacity:
            raise BlockspecError("pending draft context overflow (flush before adding)")  # engine invariant
        keep = torch.arange(w).unsqueeze(0) < counts.unsqueeze(1)
        row_idx = torch.arange(r).unsqueeze(1).expand(r, w)[keep]
        col_idx = (self.lengths[:r].unsqueeze(1) + torch.arange(w))[keep]
        self.buf[row_idx.to(features.device), col_idx.to(features.device)] = features[keep.to(features.device)]
        self.lengths[:r] += counts

    def room(self, rows: int) -> int:
        return self.capacity - int(self.lengths[:rows].max()) if rows else self.capacity

    def flush(self, draft: DraftModel, cache: KVCache, start: int, stop: int) -> None:
        """Append rows start..stop's buffered features to their draft context (cache:
        the draft cache rows start..stop)."""
        n = int(self.lengths[start:stop].max()) if stop > start else 0
        if n == 0:
            return
        assert self.buf is not None
        draft.append_context(cache, self.buf[start:stop, :n], self.lengths[start:stop].to(cache.lengths.device))
        self.lengths[start:stop] = 0

    def clear(self, start: int, stop: int) -> None:
        self.lengths[start:stop] = 0

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        if self.buf is not None:
            n = int(self.lengths[src].max())
            self.buf[dst, :n] = self.buf[src, :n]
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0


def pad_rows(proposal: Proposal, rows: int, vocab: int | None = None) -> Proposal:
    """A proposal for the first k rows, zero-padded to `rows` (the others verify no drafts).

    vocab: the batch samples somewhere, so rejection sampling needs every drafted
    row's proposal distribution; greedy drafts (probs None) were drawn from a point
    mass, which is what they get."""
    k, g = proposal.tokens.shape
    tokens = torch.cat([proposal.tokens, proposal.tokens.new_zeros(rows - k, g)])
    probs = proposal.probs
    if probs is None and vocab is not None:
        probs = torch.nn.functional.one_hot(proposal.tokens, vocab).float()
    if probs is not None:
        probs = torch.cat([probs, probs.new_zeros(rows - k, *probs.shape[1:])])
    return Proposal(tokens, probs, None)


def unpack_rows(packed: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """packed [N, F] in row-major order of `valid` [R, W] -> [R, max(keep), F], zero padded."""
    width = int(keep.max())
    out = packed.new_zeros(valid.shape[0], width, packed.shape[-1])
    cols = valid.nonzero()[:, 1]
    take = cols < width
    out[valid[:, :width]] = packed[take]
    return out


def batch_sampler(params: list[SamplingParams], generators: list[torch.Generator],
                  device: torch.device) -> RowSampler:
    """The running batch's sampler, reusing each request's own generator."""
    return RowSampler(torch.tensor([float(p.temperature) for p in params], device=device),
                      torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
                      torch.tensor([float(p.top_p) for p in params], device=device), generators)


# -- text and stop strings ----------------------------------------------------------

class TextTracker:
    """Incremental detokenisation of one request, with stop strings.

    Text (and, when stop strings are set, tokens) that could still turn out to
    be the start of a stop string is held back; on a hit, tokens and text are
    cut where the stop string begins."""

    def __init__(self, tokenizer: Detokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""          # the request's text so far (cut at a stop string)
        self.sent_tokens = 0
        self.sent_chars = 0

    def push(self, new_ids: list[int], final: bool) -> tuple[list[int], str, bool]:
        """Add tokens; return (token delta, text delta, stop string hit)."""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        cut = self._find_stop(text)
        if cut is not None:
            del self.ids[self._tokens_within(cut):]
            text, final = text[:cut], True
        self.text = text
        if final:
            safe_chars, safe_tokens = len(text), len(self.ids)
        else:
            safe_chars = len(text) - self.hold
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
                safe_chars = min(safe_chars, len(text.rstrip("\ufffd")))
            safe_chars = max(safe_chars, self.sent_chars)
            safe_tokens = self._tokens_within(safe_chars) if self.stops else len(self.ids)
        tokens = self.ids[self.sent_tokens:safe_tokens]
        delta = text[self.sent_chars:safe_chars]
        self.sent_tokens = max(self.sent_tokens, safe_tokens)
        self.sent_chars = max(self.sent_chars, safe_chars)
        return tokens, delta, cut is not None

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.sent_chars - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return max(min(hits), self.sent_chars) if hits else None

    def _tokens_within(self, chars: int) -> int:
        """Most tokens (>= those already sent) whose text fits in the first `chars` characters."""
        for k in range(len(self.ids), self.sent_tokens, -1):
            if len(self.tokenizer.decode(self.ids[:k])) <= chars:
                return k
        return self.sent_tokens


# -- request handles ----------------------------------------------------------------

@dataclass
class RequestOutput:
    """One streamed delta of a request."""

    request_id: str
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None   # "stop" | "length" | "cancelled" | "error" once finished


class RequestHandle:
    """Thread-safe view of one request: iterate (sync or async) over deltas,
    block on `result()` or `await handle` for the final Completion."""

    def __init__(self, request_id: str, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        self.request_id = request_id
        self._on_output = on_output
        self._lock = threading.Lock()
        self._deltas: queue.Queue[RequestOutput] = queue.Queue()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None
        self._future: concurrent.futures.Future[Completion] = concurrent.futures.Future()
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._future.done()

    def _publish(self, out: RequestOutput, completion: Completion | None = None) -> None:
        """Called by the engine thread."""
        with self._lock:
            if self._async is not None:
                loop, aq = self._async
                loop.call_soon_threadsafe(aq.put_nowait, out)
            else:
                self._deltas.put(out)
        if self._on_output is not None:
            try:
                self._on_output(out)
            except Exception as exc:  # a client's callback must not take the engine down
                self.error = exc
                log.exception("on_output callback of request %s failed", self.request_id)
        if completion is not None and not self._future.done():  # an awaiting task may have been cancelled
            self._future.set_result(completion)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._deltas.get()
            yield out
            if out.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        aq: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:  # move what was already produced, then receive directly
            while not self._deltas.empty():
                aq.put_nowait(self._deltas.get_nowait())
            self._async = (asyncio.get_running_loop(), aq)
        while True:
            out = await aq.get()
            yield out
            if out.finished:
                return

    def result(self, timeout: float | None = None) -> Completion:
        return self._future.result(timeout)

    def __await__(self):
        # Shielded: cancelling the awaiting task must not cancel the request's future.
        return asyncio.shield(asyncio.wrap_future(self._future)).__await__()


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    state: RowState
    handle: RequestHandle
    generator: torch.Generator
    text: TextTracker | None
    anchor: int = -1


# -- the engine ---------------------------------------------------------------------

class Engine:
    """Continuous-batching speculative decoding over a fixed KV slot pool.

    method: "ar" | "dflash" | "dspark"; scheduled: DSpark confidence scheduling
    with `cost_table` (no table: verify every draft); rows = min(max_running,
    slots that fit in kv_memory_gb GiB of target + draft KV); each slot holds
    max_model_len positions (default: the target's max_position_embeddings).
    min_survival (scheduled): drafts whose prefix survival is below it are neither
    drafted nor verified.
    draft_gate: skip drafting in rounds where the cost table (with draft times)
    predicts a plain AR round is faster (`scheduler.DraftGate`); None = on for
    scheduled DSpark given such a table. With dflash / unscheduled dspark the
    drafting rows verify the full window and the gate learns from their measured
    acceptance. gate_feedback: the gate scales the table by the measured wall time
    of finished rounds (`DraftGate.observe`); off, it trusts the table alone (for
    tables in other units than this machine's seconds, as in tests).
    calibrate_confidence (scheduled): rescale the confidence head online by the
    verified outcomes (`scheduler.ConfidenceCalibration`); off, trust the head as
    shipped (e.g. calibrated offline for this decoding mode)."""

    def __init__(self, target: TargetModel, draft: DraftModel | None = None, method: str = "ar",
                 scheduled: bool = False, max_running: int = 32, kv_memory_gb: float | None = None,
                 max_model_len: int | None = None, cost_table: CostTable | None = None,
                 rule: str = "rejection", tokenizer: Detokenizer | None = None,
                 min_survival: float = 0.02, draft_gate: bool | None = None, gate_feedback: bool = True,
                 calibrate_confidence: bool = True) -> None:
        check_method(method, draft)
        if draft is not None and method != "ar":
            draft.config.check_target(target.config)
        self._check_scheduling(method, draft, scheduled, cost_table, target)
        if draft_gate is None:
            draft_gate = scheduled and cost_table is not None and cost_table.has_draft_times
        if draft_gate and (method == "ar" or cost_table is None or not cost_table.has_draft_times):
            raise BlockspecError("draft_gate needs a speculative method and a cost table with draft times "
                                 "(blockspec profile --draft ...)")
        if rule not in ("rejection", "match"):
            raise BlockspecError(f"unknown verification rule {rule!r} (choose rejection or match)")
        if not 0.0 <= min_survival < 1.0:
            raise BlockspecError(f"min_survival must be in [0, 1), got {min_survival!r}")
        self.min_survival = float(min_survival)
        if not isinstance(max_running, int) or max_running < 1:
            raise BlockspecError(f"max_running must be a positive integer, got {max_running!r}")
        self.target, self.method, self.rule, self.tokenizer = target, method, rule, tokenizer
        self.draft = draft if method != "ar" else None
        self.cost_table = cost_table if scheduled else None
        self._gate = None
        self._gate_feedback = gate_feedback
        if draft_gate:
            assert draft is not None and cost_table is not None
            if not scheduled:
                cost_table.check_target(target)
            self._gate = DraftGate(cost_table, draft.config.num_drafts, min_survival=self.min_survival,
                                   full_window=not scheduled)
        # Scheduled DSpark rescales the confidences by verified outcomes (ConfidenceCalibration).
        self._calibration = (ConfidenceCalibration(draft.config.num_drafts) if calibrate_confidence and scheduled
                             and cost_table is not None and draft is not None else None)
        self.max_model_len = self._model_len(max_model_len)
        margin = self.draft.config.block_size + 2 if self.draft is not None else 2
        self.slot_capacity = self.max_model_len + margin
        # Buffered draft context: room for two rounds' tokens (rows flush before they
        # draft); the draft cache gets that much extra room for a flush's padding.
        self.pending_capacity = max(32, 2 * (self.draft.config.block_size + 1)) if self.draft is not None else 0
        self.row_bytes = self._row_bytes()
        self.rows = self._rows(max_running, kv_memory_gb)
        with torch.inference_mode():  # inference tensors: every later write happens in inference mode
            self._cache = target.new_cache(self.rows, self.slot_capacity)
            self._draft_cache = (self.draft.new_cache(self.rows, self.slot_capacity + self.pending_capacity)
                                 if self.draft else None)
        self._pending = PendingContext(self.rows, self.pending_capacity) if self.draft else None
        self._capture = tuple(self.draft.config.target_layer_ids) if self.draft is not None else ()
        self._lock = threading.Lock()        # queue, cancellations, counters
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
        self._stats: Counter = Counter()
        self._accepted_hist: Counter = Counter()
        self._verified_hist: Counter = Counter()
        self._block_hist: Counter = Counter()   # drafting rounds by block length (drafts)
        # Keys fixed up front: metrics() may copy it while the engine thread adds to it.
        self._times = {"prefill": 0.0, "draft": 0.0, "plan": 0.0, "verify": 0.0}

    # -- construction helpers ------------------------------------------------------
    @staticmethod
    def _check_scheduling(method: str, draft: DraftModel | None, scheduled: bool,
                          table: CostTable | None, target: TargetModel) -> None:
        if not scheduled:
            return
        if method != "dspark" or draft is None or draft.confidence_head is None:
            raise BlockspecError("scheduled verification needs method 'dspark' and a draft with a confidence head")
        if table is None:
            warnings.warn("scheduled=True without a cost table: every draft is verified", stacklevel=3)
        else:
            table.check_target(target)

    def _model_len(self, max_model_len: int | None) -> int:
        limit = self.target.config.max_position_embeddings
        if max_model_len is None:
            return limit
        if not isinstance(max_model_len, int) or not 1 < max_model_len <= limit:
            raise BlockspecError(f"max_model_len must be an integer in 2..{limit} (the model's "
                                 f"max_position_embeddings), got {max_model_len!r}")
        return max_model_len

    def _row_bytes(self) -> int:
        """Bytes of one slot: K and V of every target (and draft) layer."""
        def cache_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, slots: int) -> int:
            return 2 * layers * kv_heads * slots * head_dim * torch.finfo(dtype).bits // 8
        tc = self.target.config
        total = cache_bytes(tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim, self.target.dtype,
                            self.slot_capacity)
        if self.draft is not None:
            dc = self.draft.config
            total += cache_bytes(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim, self.draft.dtype,
                                 self.slot_capacity + self.pending_capacity)
            # The pending-context buffer: features of the selected target layers.
            total += self.pending_capacity * len(dc.target_layer_ids) * dc.hidden_size * 4
        return total

    def _rows(self, max_running: int, kv_memory_gb: float | None) -> int:
        if kv_memory_gb is None:
            return max_running
        fit = int(kv_memory_gb * 2**30 // self.row_bytes)
        if fit < 1:
            raise BlockspecError(
                f"kv_memory_gb={kv_memory_gb} holds no request slot: one slot of {self.slot_capacity} positions "
                f"needs {self.row_bytes / 2**30:.4f} GiB; raise kv_memory_gb or lower max_model_len")
        return min(max_running, fit)

    # -- public API ----------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None,
               on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Queue a request. Raises BlockspecError (and queues nothing) if it can never run."""
        params = params or SamplingParams()
        if self._closed:
            raise BlockspecError("the engine is shut down; no new requests")
        prompt = self._check_request(prompt_ids, params)
        with self._lock:
            if self._closed:
                raise BlockspecError("the engine is shut down; no new requests")
            rid = request_id if request_id is not None else f"req-{next(self._counter)}"
            if rid in self._live:
                self._stats["rejected"] += 1
                raise BlockspecError(f"request id {rid!r} is already in use")
            gen = RowSampler.from_params([params]).generators[0]
            text = TextTracker(self.tokenizer, params.stop) if self.tokenizer is not None else None
            req = Request(rid, prompt, params, RowState(params, self.target.config.eos_token_id),
                          RequestHandle(rid, on_output), gen, text)
            self._waiting.append(req)
            self._live[rid] = req
            self._stats["submitted"] += 1
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
            s = self._stats
            rounds = s["request_rounds"]
            return {
                "method": self.method, "scheduled": self.cost_table is not None,
                "draft_gate": self._gate is not None, "slots": self.rows,
                "slot_capacity": self.slot_capacity, "max_model_len": self.max_model_len,
                "kv_bytes_per_slot": self.row_bytes,
                "kv_bytes_in_use": len(self._running) * self.row_bytes,
                "kv_bytes_total": self.rows * self.row_bytes,
                "running": len(self._running), "waiting": len(self._waiting),
                "submitted": s["submitted"], "finished": s["finished"], "cancelled": s["cancelled"],
                "rejected": s["rejected"], "failed": s["failed"],
                "prompt_tokens": s["prompt_tokens"], "generated_tokens": s["generated_tokens"],
                "prefill_batches": s["prefill_batches"], "rounds": s["rounds"], "request_rounds": rounds,
                "drafting_rounds": s["drafting_rounds"], "undrafted_request_rounds": s["undrafted_request_rounds"],
                "verified_tokens": s["verified_tokens"], "drafts_verified": s["drafts_verified"],
                "drafts_accepted": s["drafts_accepted"],
                "tau": (s["drafts_accepted"] + rounds) / rounds if rounds else 0.0,
                "accepted_histogram": dict(sorted(self._accepted_hist.items())),
                "verified_histogram": dict(sorted(self._verified_hist.items())),
                "draft_block_histogram": dict(sorted(self._block_hist.items())),
                "time_s": dict(self._times),
            }

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
            if req.id in ids and req.state.finish_reason is None:
                req.state.finish_reason = "cancelled"
        self._retire()

    def _admit(self) -> None:
        """Prefill as many waiting requests as there are free slots, in one batch."""
        with self._lock:
            free = self.rows - len(self._running)
            new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            first, last = len(self._running), len(self._running) + len(new)
            self._running.extend(new)
        if not new:
            return
        t0 = time.perf_counter()
        view, draft_view = self._views(first, last)
        view.lengths.zero_()
        if draft_view is not None:
            draft_view.lengths.zero_()
        sampler = batch_sampler([r.params for r in new], [r.generator for r in new], self.target.device)
        anchors = prefill(self.target, view, [r.prompt for r in new], sampler, self.draft, draft_view)
        for req, tok in zip(new, anchors.tolist()):
            req.anchor = tok
            self._emit(req, [tok])
        with self._lock:
            self._stats["prompt_tokens"] += sum(len(r.prompt) for r in new)
            self._stats["prefill_batches"] += 1
        self._times["prefill"] += time.perf_counter() - t0

    def _round(self) -> None:
        """Draft for the running requests (one draft forward), plan, verify (one packed forward)."""
        t_start = time.perf_counter()
        reqs = self._running
        r = len(reqs)
        view, draft_view = self._views(0, r)
        device = self.target.device
        anchors = torch.tensor([q.anchor for q in reqs], dtype=torch.long, device=device)
        sampler = batch_sampler([q.params for q in reqs], [q.generator for q in reqs], device)
        t0 = time.perf_counter()
        # The first k requests draft a block of `block` drafts: all of them and the full
        # window, or fewer rows / a shorter block when the draft gate says so.
        k, block = 0, 0
        if self.draft is not None:
            k, block = (r, self.draft.config.num_drafts) if self._gate is None else self._gate.decide(r)
        proposal = None
        if k:
            sub_view = draft_view if k == r else draft_view.slice_rows(0, k)
            self._pending.flush(self.draft, sub_view, 0, k)
            sub_sampler = sampler if k == r else sampler.select(list(range(k)))
            min_survival = self.min_survival if self.cost_table is not None else 0.0
            proposal = propose(self.draft, self.target, sub_view, anchors[:k], sub_sampler,
                               num_drafts=block, min_survival=min_survival)
        raw_confidence = None
        if proposal is not None and self._calibration is not None and proposal.confidence is not None:
            raw_confidence = proposal.confidence
            proposal.confidence = self._calibration.apply(raw_confidence)
        t1 = time.perf_counter()
        lens = self._plan(proposal, r, block)
        if proposal is not None and k < r:
            proposal = pad_rows(proposal, r, None if sampler.all_greedy else self.target.config.vocab_size)
        t2 = time.perf_counter()
        verdict, features = verify_packed(self.target, view, anchors, proposal, sampler, lens, self._capture,
                                          self.rule)
        if raw_confidence is not None:  # used from the next round on
            self._calibration.observe(raw_confidence, lens[:k], verdict.accepted[:k])
        if self._gate is not None and proposal is not None:
            self._gate.update(self._outcome(proposal, lens[:k], verdict.accepted[:k]), block)
        if features is not None:
            self._pending.add(features, verdict.accepted + 1)
            if self._pending.room(r) <= self.draft.config.num_drafts:  # the next round could overflow it
                self._pending.flush(self.draft, draft_view, 0, r)
        t3 = time.perf_counter()
        self._commit(reqs, proposal, lens, verdict, k, block)
        if self._gate is not None and self._gate_feedback:  # the round's real cost, bookkeeping included
            self._gate.observe(r, k, block, int(lens.sum()), time.perf_counter() - t_start)
        self._times["draft"] += t1 - t0
        self._times["plan"] += t2 - t1
        self._times["verify"] += t3 - t2

    def _plan(self, proposal: Proposal | None, r: int, block: int) -> torch.Tensor:
        """Drafts each of the r running requests verifies (zero for those that did not draft);
        `block`: the drafted block's length (its draft time is spent)."""
        device = self.target.device
        lens = torch.zeros(r, dtype=torch.long, device=device)
        if proposal is None:
            return lens
        k, g = proposal.tokens.shape
        table = self.cost_table
        if table is None or proposal.confidence is None:
            lens[:k] = g
            return lens
        draft_s = table.draft_time(k, slots=block) if table.has_draft_times else 0.0
        survival = torch.cumprod(proposal.confidence, dim=1)
        lens[:k] = plan(survival, table, draft_s, self.min_survival, base_rows=r).to(device)
        return lens

    def _outcome(self, proposal: Proposal, verified: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """What the drafting rows [k, g] showed of their prefix survival, for the gate:
        1 / 0 for each verified slot (accepted or not), and past a row's verified
        length, when all of it was accepted, the confidences' survival from there on
        (never verified, so never measured). Measured outcomes, not the confidences,
        decide the block: a head trained for sampled acceptance under-rates greedy."""
        g = proposal.tokens.shape[1]
        slot = torch.arange(g, device=accepted.device).unsqueeze(0)
        verified, accepted = verified.unsqueeze(1), accepted.unsqueeze(1)
        measured = (slot < accepted).double()
        if proposal.confidence is None:
            return measured
        beyond = torch.cumprod(torch.where(slot < verified, 1.0, proposal.confidence.double()), dim=1)
        return torch.where(slot < verified, measured, beyond * (accepted == verified))

    def _commit(self, reqs: list[Request], proposal: Proposal | None, lens: torch.Tensor,
                verdict: Verdict, drafting: int, block: int) -> None:
        """Emit each request's accepted drafts + bonus; `drafting`: how many (first) requests
        drafted, and a block of how many drafts."""
        accepted, bonus, verified = verdict.accepted.tolist(), verdict.bonus.tolist(), lens.tolist()
        drafted = proposal.tokens.tolist() if proposal is not None else [[] for _ in reqs]
        for i, req in enumerate(reqs):
            req.state.stats.verified.append(verified[i])
            req.state.stats.accepted.append(accepted[i])
            req.anchor = bonus[i]
            self._emit(req, drafted[i][:accepted[i]] + [bonus[i]])
        with self._lock:
            self._stats["rounds"] += 1
            self._stats["request_rounds"] += len(reqs)
            # Request-rounds of a speculative engine without a draft: the draft gate chose AR.
            self._stats["drafting_rounds"] += int(drafting > 0)
            if drafting:
                self._block_hist[block] += 1
            self._stats["undrafted_request_rounds"] += (len(reqs) - drafting) if self.draft is not None else 0
            self._stats["verified_tokens"] += sum(verified) + len(reqs)
            self._stats["drafts_verified"] += sum(verified)
            self._stats["drafts_accepted"] += sum(accepted)
            self._accepted_hist.update(accepted)
            self._verified_hist.update(verified)

    def _emit(self, req: Request, new: list[int]) -> None:
        """Apply stop tokens / length (RowState), then stop strings, then stream the delta."""
        state = req.state
        kept = state.emit(new)
        text = None
        if req.text is not None:
            kept, text, hit = req.text.push(kept, final=state.finish_reason is not None)
            if hit:
                state.finish_reason = "stop"
                del state.tokens[len(req.text.ids):]
        with self._lock:
            self._stats["generated_tokens"] += len(kept)
        if state.finish_reason is None:
            if kept or text:
                req.handle._publish(RequestOutput(req.id, kept, text, False, None))
            return
        req.handle._publish(RequestOutput(req.id, kept, text, True, state.finish_reason), self._completion(req))
        with self._lock:
            self._stats["finished"] += 1

    def _completion(self, req: Request) -> Completion:
        text = req.text.text if req.text is not None else None
        return Completion(list(req.state.tokens), req.state.finish_reason or "length", req.state.stats, text)

    def _finish(self, req: Request, reason: str) -> None:
        """End a request that did not finish by itself (cancelled / error)."""
        req.state.finish_reason = reason
        req.handle._publish(RequestOutput(req.id, [], None, True, reason), self._completion(req))
        with self._lock:
            self._stats["cancelled" if reason == "cancelled" else "failed"] += 1
            self._live.pop(req.id, None)

    def _retire(self) -> None:
        """Free the slots of finished / cancelled requests, keeping live rows contiguous:
        the last live rows move into the holes (only their valid slots are copied)."""
        done = [row for row, req in enumerate(self._running) if req.state.finish_reason is not None]
        if not done:
            return
        for row in done:
            req = self._running[row]
            if req.state.finish_reason == "cancelled" and not req.handle.done:
                self._finish(req, "cancelled")
        live = len(self._running) - len(done)
        holes = [row for row in done if row < live]
        finished = set(done)
        movers = [row for row in range(live, len(self._running)) if row not in finished]
        self._cache.move_rows(movers, holes)
        if self._draft_cache is not None:
            self._draft_cache.move_rows(movers, holes)
            self._pending.move_rows(movers, holes)
            self._pending.clear(live, len(self._running))
        with self._lock:
            for row in done:
                self._live.pop(self._running[row].id, None)
            for src, dst in zip(movers, holes):
                self._running[dst] = self._running[src]
            del self._running[live:]

    def _views(self, start: int, stop: int) -> tuple[KVCache, KVCache | None]:
        draft_view = self._draft_cache.slice_rows(start, stop) if self._draft_cache is not None else None
        return self._cache.slice_rows(start, stop), draft_view

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """Reject at submit what can never run; nothing else is affected."""
        def reject(msg: str) -> BlockspecError:
            with self._lock:
                self._stats["rejected"] += 1
            return BlockspecError(msg)
        if not isinstance(params, SamplingParams):
            raise reject("params must be a SamplingParams")
        prompt = [int(t) for t in prompt_ids]
        vocab = self.target.config.vocab_size
        if not prompt:
            raise reject("the prompt is empty")
        if any(t < 0 or t >= vocab for t in prompt):
            raise reject(f"prompt token ids must be in 0..{vocab - 1}")
        need = len(prompt) + params.max_new_tokens
        if need > self.max_model_len:
            raise reject(
                f"request needs {need} positions (prompt {len(prompt)} + max_new_tokens {params.max_new_tokens}) "
                f"but the engine holds at most max_model_len={self.max_model_len} per request")
        if params.stop and self.tokenizer is None:
            raise reject("stop strings need a tokenizer; pass tokenizer= to the Engine or use stop_token_ids")
        return prompt

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
