"""The batch-1 speculative loop behind calibration and simulated acceptance (docs/design.md section 4).

Temporary: it goes once the one round in blockspec.decoding takes observers and forced acceptance.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from blockspec.config import SamplingParams
from blockspec.decoding.generate import RequestStats, RowState, Timing, check_lengths
from blockspec.decoding.sampling import RowSampler, Verdict, sample, verify
from blockspec.decoding.speculate import Proposal, prefill, propose, verify_and_commit
from blockspec.models.draft import DraftModel
from blockspec.models.kv_cache import KVCache
from blockspec.models.target import TargetModel


def sync(device: torch.device) -> None:
    """Wall-clock times are only meaningful once queued GPU work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LoopResult:
    """One request decoded by :func:`speculative_loop`."""

    tokens: list[int]
    stats: RequestStats
    timing: Timing
    confidences: list[list[float]]   # per round, c_k of the proposal (empty without a confidence head)


def forced_commit(target: TargetModel, cache: KVCache, anchors: torch.Tensor, proposal: Proposal,
                  sampler: RowSampler, draft: DraftModel, draft_cache: KVCache, accepted: int,
                  rule: str = "rejection") -> Verdict:
    """`speculate.verify_and_commit` with the outcome imposed: `accepted` drafts kept.

    The target forward and the acceptance rule still run (their cost is what a
    simulated run measures; the rule's verdict is discarded), then the bonus is
    drawn from the target row after the imposed prefix and both caches keep
    exactly that prefix, as a real commit would."""
    start = cache.lengths.clone()
    seq = torch.cat([anchors.unsqueeze(1), proposal.tokens], dim=1)
    out = target(seq, cache, capture=tuple(draft.config.target_layer_ids))
    verify(out.logits, proposal.tokens, proposal.probs, sampler, rule=rule)
    kept = torch.full_like(anchors, accepted)
    bonus = sample(out.logits[:, accepted:accepted + 1], sampler)[0][:, 0]
    cache.truncate(start + kept + 1)
    assert out.features is not None
    draft.append_context(draft_cache, out.features, kept + 1)
    return Verdict(kept, bonus)


@torch.inference_mode()
def speculative_loop(target: TargetModel, draft: DraftModel, prompt_ids: list[int], params: SamplingParams, *,
                     accept: Iterator[int] | None = None, rule: str = "rejection") -> LoopResult:
    """Decode one request round by round with the `speculate` functions.

    Same rounds as `generate` for batch 1, plus what `generate` does not expose:
    each round's per-slot confidences (calibration) and, with `accept`, an
    imposed accepted length per round (simulated acceptance, not lossless)."""
    check_lengths(target, [prompt_ids], [params])
    device = target.device
    state = RowState(params, target.config.eos_token_id)
    width = draft.config.block_size + 1
    capacity = len(prompt_ids) + params.max_new_tokens + width + 1
    cache, draft_cache = target.new_cache(1, capacity), draft.new_cache(1, capacity + width)
    sampler = RowSampler.from_params([params], device)
    timing, confidences = Timing(), []
    t0 = time.perf_counter()
    anchors = prefill(target, cache, [prompt_ids], sampler, draft, draft_cache)
    sync(device)
    timing.prefill_s = time.perf_counter() - t0
    state.emit(anchors.tolist())
    while state.finish_reason is None:
        t0 = time.perf_counter()
        proposal = propose(draft, target, draft_cache, anchors, sampler)
        sync(device)
        t1 = time.perf_counter()
        if accept is None:
            verdict = verify_and_commit(target, cache, anchors, proposal, sampler, draft, draft_cache, rule=rule)
        else:
            verdict = forced_commit(target, cache, anchors, proposal, sampler, draft, draft_cache, next(accept), rule)
        sync(device)
        timing.draft_s += t1 - t0
        timing.verify_s += time.perf_counter() - t1
        timing.rounds += 1
        drafted, accepted = proposal.tokens[0].tolist(), int(verdict.accepted[0])
        if proposal.confidence is not None:
            confidences.append(proposal.confidence[0].tolist())
        state.stats.verified.append(len(drafted))
        state.stats.accepted.append(accepted)
        state.emit(drafted[:accepted] + [int(verdict.bonus[0])])
        anchors = verdict.bonus
    return LoopResult(state.tokens, state.stats, timing, confidences)
