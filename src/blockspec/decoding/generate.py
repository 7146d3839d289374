"""Batch generation for `ar`, `dflash`, `dspark` and `eagle3`: a short loop over the one round.

Rows have different prompt lengths, accept different numbers of drafts each
round and finish at different times; a finished row leaves the batch (its
cache rows are dropped) so the others stop paying for it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from blockspec.config import METHODS, SamplingParams
from blockspec.decoding.captured import EAGLE3_NOT_CAPTURED, CapturedSteps, captured_steps
from blockspec.decoding.context import PendingContext
from blockspec.decoding.output import Completion, Detokenizer, RequestOutputState, RequestStats
from blockspec.decoding.penalties import LogitAdjust
from blockspec.decoding.policy import TREE_NEEDS_FIXED_POLICY, PolicyOptions, RoundPolicy, is_tree
from blockspec.decoding.prefill import ContextSink, Prefilled, prefill
from blockspec.decoding.round import DENSE, Forwards, RoundInputs, RoundOutcome, speculative_round
from blockspec.decoding.sampling import RowSampler
from blockspec.errors import BlockspecError
from blockspec.metrics import prefix_outcomes, survival, tau
from blockspec.models.chain_draft import AnyDraft, Eagle3Drafter
from blockspec.models.target import TargetModel

# Target features a row may buffer before the draft must absorb them (AR stretches of the adaptive policy).
PENDING_POSITIONS = 64

__all__ = ["Completion", "GenerateOptions", "GenerationOutput", "RequestStats", "RoundObserver", "RoundRecord",
           "RoundRecorder", "Timing", "generate"]


@dataclass
class Timing:
    """Where a call's time went. policy_s: building the policy, a first measurement of
    the cost table included (`table_cache`): setup, kept out of any decoding speed."""

    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0
    policy_s: float = 0.0


@dataclass
class GenerationOutput:
    completions: list[Completion]
    timing: Timing

    @property
    def new_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    @property
    def tau(self) -> float:
        rounds = sum(c.stats.rounds for c in self.completions)
        return tau(sum(sum(c.stats.accepted) for c in self.completions), rounds, empty=0.0)


class RoundObserver(Protocol):
    def on_round(self, outcome: RoundOutcome, requests: list[int]) -> None:
        """After every round; requests[i]: the prompt index of batch row i."""


def check_method(method: str, draft: AnyDraft | None) -> None:
    if method not in METHODS:
        raise BlockspecError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if method != "ar" and draft is None:
        raise BlockspecError(f"method {method!r} needs a draft model")
    if draft is not None and method != "ar" and (method == "eagle3") != isinstance(draft, Eagle3Drafter):
        raise BlockspecError(f"method {method!r} cannot run this draft (its method is {method_of(draft)})")
    if method == "dspark" and draft is not None and not draft.config.is_dspark:
        raise BlockspecError("method 'dspark' needs a draft with a Markov or confidence head")


def check_tree(draft: AnyDraft | None, params: list[SamplingParams], policy: RoundPolicy, rule: str) -> None:
    """What an EAGLE-3 draft tree (`ChainDraftConfig.tree`) runs with, refused in one line
    otherwise: its own rule (`sampling.verify_tree`: recursive rejection over siblings when
    sampling, not sample-and-match), no penalties, and a fixed policy (the adaptive one plans
    chains and blocks)."""
    if not is_tree(draft):
        return
    if rule != "rejection" and any(not sp.greedy for sp in params):
        raise BlockspecError(f"EAGLE-3 tree drafting (topk > 1) samples with its own rejection rule over siblings; "
                             f"--rule {rule} runs chains only")
    if any(sp.penalized for sp in params):
        raise BlockspecError("EAGLE-3 tree drafting (topk > 1) does not apply penalties or logit_bias; use a chain "
                             "(topk 1)")
    if not policy.fixed:
        raise BlockspecError(TREE_NEEDS_FIXED_POLICY)


def method_of(draft: AnyDraft | None) -> str:
    """The method a draft runs when none is named: its own."""
    if draft is None:
        return "ar"
    return "eagle3" if isinstance(draft, Eagle3Drafter) else ("dspark" if draft.config.is_dspark else "dflash")


def check_lengths(target: TargetModel, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    limit = target.config.supported_length  # max_position_embeddings, scaled by yarn / linear / dynamic RoPE
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if not p:
            raise BlockspecError(f"prompt {i} is empty")
        if len(p) + sp.max_new_tokens > limit:
            raise BlockspecError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={sp.max_new_tokens} it needs "
                f"{len(p) + sp.max_new_tokens} positions but the model supports {limit}")


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """How `generate` runs and whom it tells.

    compile: speculative methods (and AR on CUDA) run the round's forwards as captured
    static-shape steps (decoding/captured.py: CUDA graphs on CUDA, inductor elsewhere); AR
    on the CPU runs the target's torch.compile'd one-token step (`TargetModel.compile_decode`).
    Both stay on the model for later calls.
    tokenizer: needed for stop strings (`SamplingParams.stop`); completions then carry text.
    on_tokens(row, tokens): streams each row's new tokens.
    observer: sees every round's outcome (calibration, traces).
    forwards: wraps the round's forwards strategy (`round.WrappedForwards`: the bench's
    simulated acceptance, test oracles)."""

    compile: bool = False
    tokenizer: Detokenizer | None = None
    on_tokens: Callable[[int, list[int]], None] | None = None
    observer: RoundObserver | None = None
    forwards: Callable[[Forwards], Forwards] | None = None


@torch.inference_mode()
def generate(target: TargetModel, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             draft: AnyDraft | None = None, method: str | None = None, rule: str = "rejection", *,
             policy: RoundPolicy | PolicyOptions | None = None,
             options: GenerateOptions | None = None) -> GenerationOutput:
    """Generate for a batch of tokenised prompts.

    policy: how rounds draft (`PolicyOptions`, built by `RoundPolicy.for_method`; default:
    the adaptive policy, i.e. the draft gate per temperature band, DSpark's scheduler,
    the cost table measured once per machine and cached; `PolicyOptions(adapt=False)`:
    every round drafts and verifies the full window), or a `RoundPolicy` to use (and keep
    learning in). A policy built here starts from what earlier calls with the same models
    and options learned (`PolicyOptions.memory`) and keeps what it learned when the call
    ends.
    options: compile, tokenizer, streaming and observers (`GenerateOptions`)."""
    options = options or GenerateOptions()
    method = method or method_of(draft)
    check_method(method, draft)
    draft = None if method == "ar" else draft
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    if len(params) != len(prompts):
        raise BlockspecError("need one SamplingParams per prompt")
    check_lengths(target, prompts, params)
    for sp in params:
        sp.check_vocab(target.config.vocab_size)
    states = [RequestOutputState(p, target.config.eos_token_id, options.tokenizer) for p in params]
    t_policy = time.perf_counter()
    policy = RoundPolicy.of(policy, target, draft, method, len(prompts))
    policy_s = time.perf_counter() - t_policy
    check_tree(draft, params, policy, rule)
    # Rows in temperature-band order (greedy first): a round's drafting rows are a prefix.
    active = sorted(range(len(prompts)), key=lambda i: params[i].band)
    batch = _start(target, draft, [prompts[i] for i in active], [params[i] for i in active], options)
    timing = Timing(prefill_s=batch.prefill_s, policy_s=policy_s)
    first = batch.prefilled
    for i, (r, tok) in enumerate(zip(active, batch.inputs.anchors.tolist())):
        if first.prompt_logprobs is not None:
            states[r].prompt_logprobs = first.prompt_logprobs[i]
        _emit(states[r], r, [tok], options.on_tokens, first.logprobs[i] if first.logprobs is not None else None)
    while True:
        kept = _drop_finished(batch, active, states)
        if not kept:
            break
        if kept != active or batch.inputs.bands is None:   # the batch changed: its rows' bands
            batch.inputs.bands = [params[r].band for r in kept]
        active = kept
        if batch.inputs.sampler.adjust is not None:   # the penalties count every token emitted so far
            batch.inputs.sampler.adjust = LogitAdjust.build(
                [params[r] for r in active], [(prompts[r], states[r].tokens) for r in active],
                target.config.vocab_size, target.device)
        t_round = time.perf_counter()
        outcome = speculative_round(batch.inputs, policy, rule=rule)
        timing.draft_s += outcome.draft_s
        timing.verify_s += outcome.plan_s + outcome.verify_s
        timing.rounds += 1
        for i, r in enumerate(active):
            states[r].record_round(outcome.verified[i], outcome.accepted[i])
            _emit(states[r], r, outcome.new_tokens(i), options.on_tokens,
                  outcome.logprobs[i] if outcome.logprobs is not None else None)
        policy.observe_time(len(active), outcome, time.perf_counter() - t_round)   # bookkeeping included
        if options.observer is not None:
            options.observer.on_round(outcome, active)
    policy.remember()
    return GenerationOutput([s.completion() for s in states], timing)


@dataclass
class _Batch:
    inputs: RoundInputs
    prefill_s: float
    prefilled: Prefilled
    captured: CapturedSteps | None   # the static steps' runner, owner of the caches (compile)


def _start(target: TargetModel, draft: AnyDraft | None, prompts: list[list[int]], params: list[SamplingParams],
           options: GenerateOptions) -> _Batch:
    """Allocate the caches for the whole generation and prefill every prompt."""
    width = draft.config.block_size + 1 if draft is not None else 1
    capacity = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params)) + width + 1
    # compile: speculative rounds (every round on CUDA) run as captured static steps
    # (decoding/captured.py); CPU AR keeps its tuned compiled decode step.
    compile = options.compile
    if compile and isinstance(draft, Eagle3Drafter):
        raise BlockspecError(EAGLE3_NOT_CAPTURED)
    captured = (captured_steps(target, draft) if compile and (draft is not None or target.device.type == "cuda")
                else None)
    if compile and captured is None:
        target.compile_decode()
    if captured is not None or (draft is None and target.decode_compiled):
        # The compiled step's shapes include the capacity: round it up to a power of two
        # so nearby prompt lengths share one graph.
        capacity = max(256, 1 << (capacity - 1).bit_length())
    if captured is not None:
        cache, draft_cache = captured.new_caches(len(prompts), capacity, capacity + width)
    else:
        cache = target.new_cache(len(prompts), capacity)
        draft_cache = draft.new_cache(len(prompts), capacity + width + PENDING_POSITIONS) if draft is not None else None
    sampler = RowSampler.from_params(params, target.device, histories=[(p, []) for p in prompts],
                                     vocab=target.config.vocab_size)
    # The prompts' features and those of rounds that do not draft wait; the draft turns
    # them into context K/V in one batch right before a row next drafts (`PendingContext`):
    # a call that never drafts never runs the draft.
    pending = (PendingContext(draft, draft_cache, PENDING_POSITIONS)
               if draft is not None and draft_cache is not None and captured is None else None)
    t0 = time.perf_counter()
    done = prefill(target, cache, prompts, sampler, ContextSink(draft, draft_cache, pending),
                   [-1 if p.prompt_logprobs is None else p.prompt_logprobs for p in params])
    context = captured.context() if captured is not None and draft is not None else pending
    forwards = captured.forwards() if captured is not None else DENSE
    if options.forwards is not None:
        forwards = options.forwards(forwards)
    return _Batch(RoundInputs(target, draft, cache, draft_cache, context, done.anchors, sampler, forwards=forwards),
                  time.perf_counter() - t0, done, captured)


def _emit(state: RequestOutputState, row: int, tokens: list[int],
          on_tokens: Callable[[int, list[int]], None] | None, logprobs: list | None = None) -> None:
    delta = state.push(tokens, logprobs)
    if on_tokens is not None and delta.tokens:
        on_tokens(row, delta.tokens)


def _drop_finished(owner: _Batch, active: list[int], states: list[RequestOutputState]) -> list[int]:
    """Finished rows leave the batch: caches, sampler and anchors keep the others."""
    batch = owner.inputs
    keep = [i for i, r in enumerate(active) if not states[r].finished]
    if len(keep) == len(active) or not keep:
        return [active[i] for i in keep]
    index = torch.tensor(keep, device=batch.anchors.device)
    if batch.context is not None:   # buffered draft context moves with its rows
        batch.context.keep_rows(keep)
    if owner.captured is not None:   # its buffers stay put: compiled graphs hold their addresses
        batch.cache, batch.draft_cache = owner.captured.keep_rows(keep)
    else:
        batch.cache.keep_rows(index)
        if batch.draft_cache is not None:
            batch.draft_cache.keep_rows(index)
    batch.sampler = batch.sampler.select(keep)
    batch.anchors = batch.anchors[index]
    return [active[i] for i in keep]


@dataclass(frozen=True)
class RoundRecord:
    """One request's part of one verify round."""

    request: int                      # the prompt's index in its `generate` call
    verified: int                     # drafts verified
    accepted: int                     # drafts accepted
    confidences: tuple[float, ...]    # c_k of the drafted slots (empty when the draft has no confidence head)


class RoundRecorder:
    """Round observer for ``GenerateOptions(observer=...)``: one :class:`RoundRecord` per request per round."""

    def __init__(self) -> None:
        self.records: list[RoundRecord] = []

    def on_round(self, outcome: RoundOutcome, requests: Sequence[int]) -> None:
        conf = outcome.raw_confidence.tolist() if outcome.raw_confidence is not None else []
        for i, request in enumerate(requests):
            self.records.append(RoundRecord(request, outcome.verified[i], outcome.accepted[i],
                                            tuple(conf[i]) if i < len(conf) else ()))

    def survival_outcomes(self) -> tuple[list[float], list[int]]:
        """Every verified slot of every round with confidences: its prefix survival ``s_k``
        and whether the prefix up to it was accepted (the pairs :func:`calibration` scores)."""
        pred: list[float] = []
        outcome: list[int] = []
        for r in self.records:
            if r.confidences:
                pred.extend(survival(r.confidences)[:r.verified])
                outcome.extend(prefix_outcomes(r.accepted, r.verified))
        return pred, outcome
