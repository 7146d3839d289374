"""Batch generation for `ar`, `dflash` and `dspark`.

Rows have different prompt lengths, accept different numbers of drafts each
round and finish at different times; a finished row leaves the batch (its
cache rows are dropped) so the others stop paying for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from blockspec.config import SamplingParams
from blockspec.decoding.sampling import RowSampler
from blockspec.decoding.speculate import prefill, propose, verify_and_commit
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel

METHODS = ("ar", "dflash", "dspark")


@dataclass
class RequestStats:
    """Per-request record of every round: drafts verified and drafts accepted."""

    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        return (sum(self.accepted) + self.rounds) / max(1, self.rounds)


@dataclass
class Timing:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.draft_s + self.verify_s


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str          # "stop" | "length"
    stats: RequestStats
    text: str | None = None


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
        return (sum(sum(c.stats.accepted) for c in self.completions) + rounds) / max(1, rounds)


class RowState:
    """Output bookkeeping of one request: stop tokens and max_new_tokens."""

    def __init__(self, params: SamplingParams, eos_ids: list[int]) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stats = RequestStats()

    def emit(self, new: list[int]) -> list[int]:
        """Append tokens until a stop token or the length limit; return those kept."""
        kept = []
        for tok in new:
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            kept.append(tok)
            self.tokens.append(tok)
            if len(self.tokens) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        return kept


def check_method(method: str, draft: DraftModel | None) -> None:
    if method not in METHODS:
        raise BlockspecError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if method != "ar" and draft is None:
        raise BlockspecError(f"method {method!r} needs a draft model")
    if method == "dspark" and draft is not None and not draft.config.is_dspark:
        raise BlockspecError("method 'dspark' needs a draft with a Markov or confidence head")


def check_lengths(target: TargetModel, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    limit = target.config.max_position_embeddings
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if not p:
            raise BlockspecError(f"prompt {i} is empty")
        if len(p) + sp.max_new_tokens > limit:
            raise BlockspecError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={sp.max_new_tokens} it needs "
                f"{len(p) + sp.max_new_tokens} positions but the model supports {limit}")


@torch.inference_mode()
def generate(target: TargetModel, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             draft: DraftModel | None = None, method: str | None = None, rule: str = "rejection",
             on_tokens: Callable[[int, list[int]], None] | None = None,
             compile: bool = False) -> GenerationOutput:
    """Generate for a batch of tokenised prompts. `on_tokens(row, tokens)` streams output.

    compile: AR decoding runs the target's torch.compile'd one-token step
    (`TargetModel.compile_decode`, kept on the model for later calls)."""
    method = method or ("ar" if draft is None else ("dspark" if draft.config.is_dspark else "dflash"))
    check_method(method, draft)
    if method == "ar":
        draft = None
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise BlockspecError("need one SamplingParams per prompt")
    check_lengths(target, prompts, params)
    eos = target.config.eos_token_id
    states = [RowState(p, eos) for p in params]
    width = draft.config.block_size + 1 if draft is not None else 1
    capacity = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params)) + width + 1
    if method == "ar" and compile:
        target.compile_decode()
    if method == "ar" and target.decode_compiled:
        # The compiled step's shapes include the capacity: round it up to a power of two
        # so nearby prompt lengths share one graph.
        capacity = max(256, 1 << (capacity - 1).bit_length())
    cache = target.new_cache(len(prompts), capacity)
    draft_cache = draft.new_cache(len(prompts), capacity + width) if draft is not None else None
    sampler = RowSampler.from_params(params, target.device)
    timing = Timing()

    t0 = time.perf_counter()
    anchors = prefill(target, cache, prompts, sampler, draft, draft_cache)
    timing.prefill_s = time.perf_counter() - t0
    active = list(range(len(prompts)))
    for r, tok in enumerate(anchors.tolist()):
        kept = states[r].emit([tok])
        if on_tokens and kept:
            on_tokens(r, kept)

    while True:
        done = [i for i, r in enumerate(active) if states[r].finish_reason is not None]
        if done:
            keep = [i for i, r in enumerate(active) if states[r].finish_reason is None]
            if not keep:
                break
            index = torch.tensor(keep, device=target.device)
            cache.keep_rows(index)
            if draft_cache is not None:
                draft_cache.keep_rows(index)
            sampler = sampler.select(keep)
            anchors = anchors[index]
            active = [active[i] for i in keep]
        t0 = time.perf_counter()
        proposal = propose(draft, target, draft_cache, anchors, sampler) if draft is not None else None
        t1 = time.perf_counter()
        verdict = verify_and_commit(target, cache, anchors, proposal, sampler, draft, draft_cache, rule=rule)
        t2 = time.perf_counter()
        timing.draft_s += t1 - t0
        timing.verify_s += t2 - t1
        timing.rounds += 1
        accepted = verdict.accepted.tolist()
        bonus = verdict.bonus.tolist()
        drafted = proposal.tokens.tolist() if proposal is not None else [[] for _ in active]
        for i, r in enumerate(active):
            state = states[r]
            state.stats.verified.append(len(drafted[i]))
            state.stats.accepted.append(accepted[i])
            kept = state.emit(drafted[i][:accepted[i]] + [bonus[i]])
            if on_tokens and kept:
                on_tokens(r, kept)
        anchors = verdict.bonus
    completions = [Completion(s.tokens, s.finish_reason or "length", s.stats) for s in states]
    return GenerationOutput(completions, timing)
