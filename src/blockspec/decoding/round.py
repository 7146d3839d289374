"""The one speculative round, used by every decoding path (docs/design.md sections 4 and 12).

`prefill.prefill` starts rows and samples their first anchor. A round is
`propose` (one draft forward for the block; DSpark's Markov head then samples
slot by slot) -> the policy's verify lengths (how many drafts each row verifies) ->
`verify_and_commit` (one target forward over [anchor, drafts], the acceptance
rule, the caches rolled back to the accepted prefix) -> the accepted rows'
target features handed to the draft context. An EAGLE-3 draft tree (decoding/tree.py) runs
the same round: its nodes verified in one forward under a tree mask, the accepted path's
K/V moved into place (`verify_tree_and_commit`). `speculative_round` runs those
steps under a `Policy` (decoding/policy.py); `generate`, the engine, the bench and
calibration (observers of `generate`) all call it. AR decoding is the same round
with zero drafts.

How the models run is one strategy object carried in the round's inputs
(`Forwards`): dense eager forwards (generate), one packed ragged target forward
(`PackedForwards`: the engine) or captured static steps (`captured.CapturedForwards`).
Whoever needs to see or change a round's steps wraps that object (`WrappedForwards`):
the bench's simulated acceptance, the tests' oracles.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from blockspec.config import temperature_band
from blockspec.decoding.context import DraftContext
from blockspec.decoding.logprobs import row_logprobs
from blockspec.decoding.prefill import next_tokens
from blockspec.decoding.proposal import (ConfidenceMap, Proposal, chain_proposal, markov_drafts, proposal_of,
                                         tree_proposal)
from blockspec.decoding.sampling import RowSampler, Verdict, argmax_last, sample, verify, verify_tree
from blockspec.decoding.tree import TokenTree, keep_path
from blockspec.models.chain_draft import AnyDraft, Eagle3Cache, Eagle3Drafter
from blockspec.models.draft import DraftModel
from blockspec.models.kv_cache import KVCache
from blockspec.models.target import TargetModel

__all__ = ["AnyDraft", "ConfidenceMap", "Forwards", "PackedForwards", "Policy", "Proposal", "RoundInputs",
           "RoundOutcome", "WrappedForwards", "pad_rows", "propose", "speculative_round", "verify_and_commit"]


# -- verify and commit --------------------------------------------------------------

def _packed_forward(target: TargetModel, cache: KVCache, anchors: torch.Tensor, drafts: torch.Tensor,
                    counts: torch.Tensor, capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row r runs [anchor, d_1..d_counts[r]] in one ragged forward; back to [R, g+1, V]
    (slots past a row's own count stay zero: not proposed, never read) and the
    features to [R, g+1, F] the same way."""
    r, g = drafts.shape
    seq = torch.cat([anchors.unsqueeze(1), drafts], dim=1)
    valid = torch.arange(g + 1, device=seq.device).unsqueeze(0) <= counts.unsqueeze(1)
    out = target.forward_packed(seq[valid], counts + 1, cache, capture=capture)
    logits = out.logits.new_zeros(r, g + 1, out.logits.shape[-1])
    logits[valid] = out.logits[0]
    if out.features is None:
        return logits, None
    features = out.features.new_zeros(r, g + 1, out.features.shape[-1])
    features[valid] = out.features[0]
    return logits, features


# -- the forwards strategy ------------------------------------------------------

class Forwards:
    """The round's model forwards, dense and eager (generate's default): the draft's block
    forward, one target forward over [R, g+1] (the one-token decode step for AR), the
    acceptance rule, the commit. `propose` and `verify_and_commit` are the round's two
    halves built from those steps; subclasses and wrappers replace steps, not the round."""

    def draft_block(self, draft: DraftModel, block_ids: torch.Tensor, draft_cache: KVCache,
                    embed: nn.Embedding) -> torch.Tensor:
        """`DraftModel.block_hidden`: [R, S] -> [R, S, H]."""
        return draft.block_hidden(block_ids, draft_cache, embed)

    def draft_chain(self, draft: Eagle3Drafter, draft_cache: KVCache, sampler: RowSampler, g: int) -> Proposal:
        """EAGLE-3's proposal: g chained one-token draft forwards (`proposal.chain_proposal`)."""
        assert isinstance(draft_cache, Eagle3Cache)
        return chain_proposal(draft, draft_cache, sampler, g)

    def draft_tree(self, draft: Eagle3Drafter, draft_cache: KVCache, sampler: RowSampler) -> Proposal:
        """EAGLE-3's tree proposal: one draft forward per level (`proposal.tree_proposal`)."""
        assert isinstance(draft_cache, Eagle3Cache)
        return tree_proposal(draft, draft_cache, sampler)

    def width(self, drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> int:
        """Drafts per row the verify forward spans."""
        return drafts.shape[1]

    def target_forward(self, target: TargetModel, cache: KVCache, anchors: torch.Tensor, drafts: torch.Tensor,
                       num_drafts: torch.Tensor | None, capture: tuple[int, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, g+1, V] (and with `capture` features [R, g+1, F]) of [anchor, drafts]."""
        if drafts.shape[1] == 0 and not capture:
            return target.decode_step(anchors, cache), None
        seq = torch.cat([anchors.unsqueeze(1), drafts], dim=1) if drafts.shape[1] else anchors.unsqueeze(1)
        out = target(seq, cache, capture=capture)
        return out.logits, out.features

    def tree_forward(self, target: TargetModel, cache: KVCache, anchors: torch.Tensor, drafts: torch.Tensor,
                     tree: TokenTree, capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, n+1, V] (and with `capture` features) of [anchor, drafts] as a tree: one
        forward in which each node sees the committed context and its ancestors, at its depth."""
        start = cache.lengths.clone()
        seq = torch.cat([anchors.unsqueeze(1), drafts], dim=1)
        upto = cache.check_room(seq.shape[1]) + seq.shape[1]
        out = target(seq, cache, capture=capture, mask=tree.verify_mask(start, upto), positions=tree.positions(start))
        return out.logits, out.features

    def verdict(self, logits: torch.Tensor, drafts: torch.Tensor, probs: torch.Tensor | None, sampler: RowSampler,
                num_drafts: torch.Tensor | None, rule: str) -> Verdict:
        """The acceptance rule (`sampling.verify`)."""
        return verify(logits, drafts, probs, sampler, num_drafts, rule)

    def commit(self, cache: KVCache, start: torch.Tensor, accepted: torch.Tensor) -> None:
        """Keep anchor + accepted drafts; the bonus gets its KV when it is the next anchor."""
        cache.truncate(start + accepted + 1)

    def commit_path(self, cache: KVCache, start: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """A tree's commit: the accepted path's K/V moved into place (`tree.keep_path`)."""
        keep_path(cache, start, path, accepted)

    def propose(self, draft: AnyDraft, target: TargetModel, draft_cache: KVCache, anchors: torch.Tensor,
                    sampler: RowSampler, block: int | None = None, stop_below: float = 0.0,
                    confidence_map: ConfidenceMap | None = None) -> Proposal:
        """One draft forward for the whole block, then sampling of g drafts.

        block: the round's block length in drafts g, shorter than trained (g < the draft's
        num_drafts; the block holds the anchor and g - 1 or g mask slots by layout) costs
        less per row (default: the draft's num_drafts). confidence_map: what the policy
        plans with, from the head's raw confidences (online recalibration); the proposal
        carries both. stop_below (DSpark with a confidence head): stop drafting once
        every row's prefix survival, as the policy computes it, is below it (checked every
        `proposal.STOP_CHECK_SLOTS` slots; the policy never admits such slots, so they
        need no logits); the proposal is then shorter than g. An EAGLE-3 draft proposes
        a chain of g drafts instead (`draft_chain`; its context already ends with the anchor)."""
        cfg = draft.config
        g = cfg.num_drafts if block is None else block
        if not 1 <= g <= cfg.num_drafts:
            raise ValueError(f"a block of g drafts needs g in 1..{cfg.num_drafts} (the draft's num_drafts), got {g}")
        if isinstance(draft, Eagle3Drafter) and draft.config.tree is not None:
            if g != cfg.num_drafts:
                raise ValueError(f"an EAGLE-3 tree verifies all its {cfg.num_drafts} drafts; a block of {g} asked")
            return self.draft_tree(draft, draft_cache, sampler)
        if isinstance(draft, Eagle3Drafter):
            return self.draft_chain(draft, draft_cache, sampler, g)
        block_ids = torch.full((anchors.shape[0], cfg.first_draft_slot + g), cfg.mask_token_id, dtype=torch.long,
                           device=anchors.device)
        block_ids[:, 0] = anchors
        hidden = self.draft_block(draft, block_ids, draft_cache, target.embed_tokens)
        slots = hidden[:, cfg.first_draft_slot:cfg.first_draft_slot + g]
        if draft.markov_head is None:
            base = target.lm_head(slots.to(target.dtype)).float()
            tokens, probs = (argmax_last(base), None) if sampler.all_greedy else sample(base, sampler)
            prev = torch.cat([anchors.unsqueeze(1), tokens[:, :-1]], dim=1)
            raw = draft.confidence(slots, prev) if draft.confidence_head is not None else None
            return proposal_of(tokens, probs, raw, confidence_map)
        early_stop = stop_below > 0 and draft.confidence_head is not None
        tokens, probs, raw = markov_drafts(draft, target, slots, anchors, sampler, g,
                                            stop_below if early_stop else 0.0, confidence_map)
        if raw is None and draft.confidence_head is not None:
            prev = torch.cat([anchors.unsqueeze(1), tokens[:, :-1]], dim=1)
            raw = draft.confidence(slots, prev)
        return proposal_of(tokens, probs, raw, confidence_map)

    def verify_and_commit(self, target: TargetModel, cache: KVCache, anchors: torch.Tensor,
                          proposal: Proposal | None, sampler: RowSampler, num_drafts: torch.Tensor | None = None,
                          capture: tuple[int, ...] = (), rule: str = "rejection"
                          ) -> tuple[Verdict, torch.Tensor | None]:
        """Target forward over [anchor, drafts]; keep the accepted prefix in the target cache.

        num_drafts [R]: drafts each row verifies (default all; the rest count as not
        proposed). Returns the verdict and, with `capture`, the target features of each
        row's new tokens [R, W, F] (row r's first accepted[r] + 1 are the kept ones):
        the draft's next context. A tree (`proposal.tree`): `verify_tree_and_commit`."""
        if proposal is not None and proposal.tree is not None:
            return self.verify_tree_and_commit(target, cache, anchors, proposal, sampler, capture)
        start = cache.lengths.clone()
        drafts = proposal.tokens if proposal is not None else anchors.new_zeros(anchors.shape[0], 0)
        probs = proposal.probs if proposal is not None else None
        g = self.width(drafts, num_drafts)
        drafts, probs = drafts[:, :g], None if probs is None else probs[:, :g]
        if num_drafts is not None:   # planned on the host: one small copy that waits for nothing
            num_drafts = num_drafts.to(drafts.device, non_blocking=True)
        raw, features = self.target_forward(target, cache, anchors, drafts, num_drafts, capture)
        logits = sampler.adjusted(raw, drafts)   # penalties: the target's distribution itself changes
        verdict = self.verdict(logits, drafts, probs, sampler, num_drafts, rule)
        if sampler.logprobs is not None:
            committed = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
            committed.scatter_(1, verdict.accepted.unsqueeze(1), verdict.bonus.unsqueeze(1))
            verdict.logprobs = row_logprobs(raw, committed, (verdict.accepted + 1).tolist(), sampler.logprobs)
        self.commit(cache, start, verdict.accepted)
        return verdict, features

    def verify_tree_and_commit(self, target: TargetModel, cache: KVCache, anchors: torch.Tensor, proposal: Proposal,
                               sampler: RowSampler, capture: tuple[int, ...] = ()
                               ) -> tuple[Verdict, torch.Tensor | None]:
        """`verify_and_commit` for a draft tree: one target forward over every node
        (`tree_forward`), the tree rule (`sampling.verify_tree`: the verdict carries
        the accepted path), the path's K/V kept in place (`commit_path`). The features and
        log-probabilities returned are the path's, in order, as a chain's prefix would be."""
        assert proposal.tree is not None
        if sampler.adjust is not None:
            raise ValueError("tree verification does not apply penalties or logit_bias")
        start = cache.lengths.clone()
        raw, features = self.tree_forward(target, cache, anchors, proposal.tokens, proposal.tree, capture)
        verdict = verify_tree(raw, proposal.tokens, proposal.tree.parents, proposal.tree.depths, sampler)
        path = verdict.path
        assert path is not None
        if features is not None:
            features = features.gather(1, path.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        if sampler.logprobs is not None:
            on_path = raw.gather(1, path.unsqueeze(-1).expand(-1, -1, raw.shape[-1]))
            committed = torch.cat([committed_drafts(anchors, proposal, verdict), verdict.bonus.unsqueeze(1)], dim=1)
            committed.scatter_(1, verdict.accepted.unsqueeze(1), verdict.bonus.unsqueeze(1))
            verdict.logprobs = row_logprobs(on_path, committed, (verdict.accepted + 1).tolist(), sampler.logprobs)
        self.commit_path(cache, start, path, verdict.accepted)
        return verdict, features


def committed_drafts(anchors: torch.Tensor, proposal: Proposal, verdict: Verdict) -> torch.Tensor:
    """The drafts a row's accepted prefix is read from [R, W]: the proposal's own for a
    chain, the accepted path's tokens for a tree (its first `accepted` are the accepted)."""
    if verdict.path is None:
        return proposal.tokens
    seq = torch.cat([anchors.unsqueeze(1), proposal.tokens], dim=1)
    return seq.gather(1, verdict.path)[:, 1:]


def verified_width(drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> int:
    """The most drafts any row verifies (num_drafts: on the host, as the policy plans them)."""
    return int(num_drafts.max()) if num_drafts is not None and drafts.shape[0] else drafts.shape[1]


class PackedForwards(Forwards):
    """The engine's: one ragged target forward (`TargetModel.forward_packed`) in which row r
    runs only its anchor and first num_drafts[r] drafts."""

    def width(self, drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> int:
        return verified_width(drafts, num_drafts)

    def target_forward(self, target: TargetModel, cache: KVCache, anchors: torch.Tensor, drafts: torch.Tensor,
                       num_drafts: torch.Tensor | None, capture: tuple[int, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        counts = num_drafts if num_drafts is not None else torch.full_like(anchors, drafts.shape[1])
        return _packed_forward(target, cache, anchors, drafts, counts, capture)


class WrappedForwards(Forwards):
    """Forwards that run another's steps (`inner`); subclasses replace the ones they watch or change."""

    def __init__(self, inner: Forwards) -> None:
        self.inner = inner

    def draft_block(self, draft: DraftModel, block_ids: torch.Tensor, draft_cache: KVCache,
                    embed: nn.Embedding) -> torch.Tensor:
        return self.inner.draft_block(draft, block_ids, draft_cache, embed)

    def draft_chain(self, draft: Eagle3Drafter, draft_cache: KVCache, sampler: RowSampler, g: int) -> Proposal:
        return self.inner.draft_chain(draft, draft_cache, sampler, g)

    def draft_tree(self, draft: Eagle3Drafter, draft_cache: KVCache, sampler: RowSampler) -> Proposal:
        return self.inner.draft_tree(draft, draft_cache, sampler)

    def tree_forward(self, target: TargetModel, cache: KVCache, anchors: torch.Tensor, drafts: torch.Tensor,
                     tree: TokenTree, capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.inner.tree_forward(target, cache, anchors, drafts, tree, capture)

    def width(self, drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> int:
        return self.inner.width(drafts, num_drafts)

    def target_forward(self, target: TargetModel, cache: KVCache, anchors: torch.Tensor, drafts: torch.Tensor,
                       num_drafts: torch.Tensor | None, capture: tuple[int, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.inner.target_forward(target, cache, anchors, drafts, num_drafts, capture)

    def verdict(self, logits: torch.Tensor, drafts: torch.Tensor, probs: torch.Tensor | None, sampler: RowSampler,
                num_drafts: torch.Tensor | None, rule: str) -> Verdict:
        return self.inner.verdict(logits, drafts, probs, sampler, num_drafts, rule)

    def commit(self, cache: KVCache, start: torch.Tensor, accepted: torch.Tensor) -> None:
        self.inner.commit(cache, start, accepted)

    def commit_path(self, cache: KVCache, start: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> None:
        self.inner.commit_path(cache, start, path, accepted)


DENSE = Forwards()


def propose(draft: AnyDraft, target: TargetModel, draft_cache: KVCache, anchors: torch.Tensor,
            sampler: RowSampler, block: int | None = None, *, stop_below: float = 0.0,
            confidence_map: ConfidenceMap | None = None) -> Proposal:
    """`Forwards.propose` with dense eager forwards (profiling, tests)."""
    return DENSE.propose(draft, target, draft_cache, anchors, sampler, block, stop_below, confidence_map)


def verify_and_commit(target: TargetModel, cache: KVCache, anchors: torch.Tensor, proposal: Proposal | None,
                      sampler: RowSampler, *, num_drafts: torch.Tensor | None = None,
                      capture: tuple[int, ...] = (), rule: str = "rejection") -> tuple[Verdict, torch.Tensor | None]:
    """`Forwards.verify_and_commit` with dense eager forwards (profiling, tests)."""
    return DENSE.verify_and_commit(target, cache, anchors, proposal, sampler, num_drafts, capture, rule)


# -- the round ----------------------------------------------------------------------

class Policy(Protocol):
    """What the round asks of its policy (`policy.RoundPolicy`): who drafts how long a
    block, how many drafts each row verifies, and what the round taught."""

    def decide(self, bands: Sequence[int]) -> tuple[int, int]:
        """(first k rows that draft, block length in drafts) for rows of these temperature
        bands (`config.temperature_band`, rows ordered by band); (0, 0): an AR round."""

    def stop_below(self, rows: int) -> float:
        """Early-stop floor for drafting `rows` rows (0: draft every slot)."""

    def confidence_map(self) -> ConfidenceMap | None:
        """Raw confidences -> the ones `verify_lengths` uses (None: as the head says)."""

    def verify_lengths(self, proposal: Proposal | None, rows: int, block: int) -> torch.Tensor | None:
        """Drafts each of `rows` rows verifies [rows], on the host (None: every row its whole proposal)."""

    def observe(self, outcome: "RoundOutcome", proposal: Proposal | None, lens: torch.Tensor | None) -> None:
        """The finished round (lens: what `verify_lengths` returned)."""

    def observe_time(self, rows: int, outcome: "RoundOutcome", seconds: float) -> None:
        """The finished round's wall time, the caller's bookkeeping included."""


@dataclass
class RoundOutcome:
    """What one round did, per batch row."""

    drafted: list[list[int]]      # tokens proposed to each row (empty for rows that did not draft;
                                  # a tree: its accepted path's, padded to the tree's depth)
    verified: list[int]           # drafts each row verified
    accepted: list[int]           # drafts each row accepted
    bonus: list[int]              # the token sampled after each row's accepted prefix (the next anchor)
    raw_confidence: torch.Tensor | None   # [drafting rows, g] the head's confidences (None without a head)
    drafting_rows: int            # the first rows drafted this round
    block: int                    # the drafted block's length in drafts (0: AR round)
    draft_s: float = 0.0
    plan_s: float = 0.0
    verify_s: float = 0.0
    logprobs: list | None = None  # per row: its new tokens' TokenLogprobs (None: the row asked none)

    def new_tokens(self, row: int) -> list[int]:
        """Row's committed tokens this round: accepted drafts, then the bonus."""
        return self.drafted[row][:self.accepted[row]] + [self.bonus[row]]


@dataclass
class RoundInputs:
    """The running rows of a batch: models, caches, anchors and sampler (rows in cache order)."""

    target: TargetModel
    draft: AnyDraft | None
    cache: KVCache
    draft_cache: KVCache | None
    context: DraftContext | None
    anchors: torch.Tensor
    sampler: RowSampler
    bands: list[int] | None = None   # each row's temperature band (None: read from the sampler)
    forwards: Forwards = DENSE       # how the models run (dense, packed, captured; wrapped by the bench / tests)


def speculative_round(batch: RoundInputs, policy: Policy, *, rule: str = "rejection") -> RoundOutcome:
    """Draft (the first k rows, one draft forward), plan, verify (one target forward),
    commit to both caches, and let the policy observe the round."""
    t_start = time.perf_counter()
    draft, target, anchors, sampler, forwards = batch.draft, batch.target, batch.anchors, batch.sampler, batch.forwards
    r = anchors.shape[0]
    bands = batch.bands if batch.bands is not None else [temperature_band(t) for t in sampler.temperature.tolist()]
    k, block = policy.decide(bands) if draft is not None else (0, 0)
    proposal = None
    if k:
        assert batch.context is not None and batch.draft_cache is not None
        batch.context.flush(k)   # (its time is drafting's: counted in draft_s and the round's)
        sub = sampler if k == r else sampler.select(list(range(k)))
        cache = batch.draft_cache if k == r else batch.draft_cache.slice_rows(0, k)
        proposal = forwards.propose(draft, target, cache, anchors[:k], sub, block, policy.stop_below(k),
                                    policy.confidence_map())
    t_drafted = time.perf_counter()
    lens = policy.verify_lengths(proposal, r, block)
    if proposal is not None and k < r:
        proposal = pad_rows(proposal, r, None if sampler.all_greedy else target.config.vocab_size)
    t_planned = time.perf_counter()
    capture = tuple(draft.config.target_layer_ids) if draft is not None else ()
    verdict, features = forwards.verify_and_commit(target, batch.cache, anchors, proposal, sampler, lens, capture,
                                                   rule)
    drafts = None if proposal is None else committed_drafts(anchors, proposal, verdict)
    if features is not None:
        assert batch.context is not None and draft is not None
        counts = verdict.accepted + 1
        if isinstance(draft, Eagle3Drafter):   # EAGLE-3's context pairs each position with the token after it
            seq = anchors.unsqueeze(1) if drafts is None else torch.cat([anchors.unsqueeze(1), drafts], 1)
            batch.context.add(features, counts, next_tokens(seq[:, :features.shape[1]], counts, verdict.bonus))
        else:
            batch.context.add(features, counts)
    t_verified = time.perf_counter()
    proposed = proposal.tokens.shape[1] if proposal is not None else 0
    accepted, bonus, drafted, verified = _outcome_lists(verdict, drafts, proposed, lens, r)
    raw = proposal.raw_confidence if proposal is not None else None
    outcome = RoundOutcome(drafted, verified, accepted, bonus, None if raw is None else raw[:k],
                           k, block if k else 0, draft_s=t_drafted - t_start, plan_s=t_planned - t_drafted,
                           verify_s=t_verified - t_planned, logprobs=verdict.logprobs)
    batch.anchors = verdict.bonus
    policy.observe(outcome, proposal, lens)
    return outcome


def _outcome_lists(verdict: Verdict, drafts: torch.Tensor | None, proposed: int, lens: torch.Tensor | None,
                   rows: int) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """(accepted, bonus, drafted, verified) on the host in ONE transfer: the round's only
    synchronisation on a GPU (each .tolist() would be a device-to-host copy and a wait).
    drafts: what `committed_drafts` read the accepted prefix from; proposed: drafts per
    row (every row verifies them all unless `lens` says otherwise)."""
    parts = [verdict.accepted.view(rows, 1), verdict.bonus.view(rows, 1)]
    g = drafts.shape[1] if drafts is not None else 0
    if drafts is not None:
        parts.append(drafts)
    if lens is not None:   # (planned on the host: copied to the device to travel back with the rest)
        parts.append(lens.to(verdict.accepted.device, non_blocking=True).view(rows, 1))
    host = torch.cat([p.to(torch.long) for p in parts], dim=1).tolist()
    accepted, bonus = [h[0] for h in host], [h[1] for h in host]
    drafted = [h[2:2 + g] for h in host]
    verified = [h[2 + g] for h in host] if lens is not None else [proposed] * rows
    return accepted, bonus, drafted, verified


def pad_rows(proposal: Proposal, rows: int, vocab: int | None = None) -> Proposal:
    """A proposal for the first k rows, zero-padded to `rows` (the others verify no drafts).

    vocab: the batch samples somewhere, so rejection sampling needs every drafted
    row's proposal distribution; greedy drafts (probs None) were drawn from a point
    mass, which is what they get."""
    # Trees run the fixed policy, so every row drafts and none is padded; a padded tree would
    # verify its padding as a chain.
    assert proposal.tree is None, "a tree proposal is never padded"
    k, g = proposal.tokens.shape
    tokens = torch.cat([proposal.tokens, proposal.tokens.new_zeros(rows - k, g)])
    probs = proposal.probs
    if probs is None and vocab is not None:
        probs = torch.nn.functional.one_hot(proposal.tokens, vocab).float()
    if probs is not None:
        probs = torch.cat([probs, probs.new_zeros(rows - k, *probs.shape[1:])])
    # The confidences travel too: the policy learns the drafting rows' survival past what they
    # verified from them (dropping them taught the gate survival 0 there whenever only some rows
    # drafted, so DSpark stopped drafting where its full window wins).
    confidence = proposal.confidence
    if confidence is not None:
        confidence = torch.cat([confidence, confidence.new_zeros(rows - k, g)])
    return Proposal(tokens, probs, confidence, proposal.raw_confidence)
