"""One speculative round as plain functions: propose -> verify -> commit.

`prefill` starts rows; `propose` runs the draft block once (DSpark's Markov
head then samples slot by slot); `verify_and_commit` runs the target over
[anchor, drafts], applies the acceptance rule, rolls the target cache back to
the accepted prefix and feeds the accepted rows' features to the draft
context. AR decoding is the same round with zero drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.models.kv_cache import KVCache
from blockspec.decoding.sampling import RowSampler, Verdict, argmax_last, sample, verify
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel, TargetOutput


EARLY_STOP_ROWS = 8


@dataclass
class Proposal:
    tokens: torch.Tensor                # [R, g] drafted tokens
    probs: torch.Tensor | None          # [R, g, V] the exact distributions they were drawn from
                                        # (None when every row is greedy: verification only compares tokens)
    confidence: torch.Tensor | None     # [R, g] per-slot acceptance probability (DSpark)


def padding_groups(lengths: list[int], max_padding: float = 0.25) -> list[tuple[int, int]]:
    """Contiguous row ranges [a, b) whose right-padded size stays within
    (1 + max_padding) x their real tokens: a padded batch of very different prompt
    lengths costs more than separate forwards (32 HumanEval prompts: 1.21 s padded,
    0.66 s grouped; benchmarks/prefill.py)."""
    groups, start, longest, total = [], 0, 0, 0
    for i, n in enumerate(lengths):
        if i > start and max(longest, n) * (i - start + 1) > (1 + max_padding) * (total + n):
            groups.append((start, i))
            start, longest, total = i, 0, 0
        longest, total = max(longest, n), total + n
    if lengths:
        groups.append((start, len(lengths)))
    return groups


def prefill(target: TargetModel, cache: KVCache, prompts: list[list[int]], sampler: RowSampler,
            draft: DraftModel | None = None, draft_cache: KVCache | None = None) -> torch.Tensor:
    """Run the prompts through the target (right-padded, in groups of similar length:
    `padding_groups`), seed the draft context, and sample each row's first token (the
    first anchor; every row draws from its own generator, so grouping changes no
    draw). Returns anchors [R]."""
    groups = padding_groups([len(p) for p in prompts])
    if len(groups) == 1:
        return _prefill_rows(target, cache, prompts, sampler, draft, draft_cache)
    return torch.cat([_prefill_rows(target, cache.slice_rows(a, b), prompts[a:b], sampler.select(list(range(a, b))),
                                    draft, draft_cache.slice_rows(a, b) if draft_cache is not None else None)
                      for a, b in groups])


def _prefill_rows(target: TargetModel, cache: KVCache, prompts: list[list[int]], sampler: RowSampler,
                  draft: DraftModel | None, draft_cache: KVCache | None) -> torch.Tensor:
    device = target.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p, device=device)
    capture = tuple(draft.config.target_layer_ids) if draft is not None else ()
    out = target(ids, cache, num_new=lengths, capture=capture, logits_at=(lengths - 1).unsqueeze(1))
    if draft is not None:
        assert draft_cache is not None and out.features is not None
        draft.append_context(draft_cache, out.features, lengths)
    return sample(out.logits, sampler)[0][:, 0]


def propose(draft: DraftModel, target: TargetModel, draft_cache: KVCache, anchors: torch.Tensor,
            sampler: RowSampler, num_drafts: int | None = None, min_survival: float = 0.0) -> Proposal:
    """One draft forward for the whole block, then sampling of g drafts.

    num_drafts: draft a shorter block than trained (g < the draft's window; the
    block holds the anchor and g - 1 or g mask slots by layout), which costs less
    per row: the draft gate shortens the block under load (`scheduler.DraftGate`).
    min_survival (DSpark with a confidence head, fewer than EARLY_STOP_ROWS rows):
    stop drafting at the first slot where every row's prefix survival is below
    it. `scheduler.plan` never admits such slots when given the same floor, so
    they need no logits at all; the proposal is then shorter than g."""
    cfg = draft.config
    g = cfg.num_drafts if num_drafts is None else num_drafts
    if not 1 <= g <= cfg.num_drafts:
        raise ValueError(f"num_drafts must be in 1..{cfg.num_drafts}, got {g}")
    block = torch.full((anchors.shape[0], cfg.first_draft_slot + g), cfg.mask_token_id, dtype=torch.long,
                       device=anchors.device)
    block[:, 0] = anchors
    hidden = draft.block_hidden(block, draft_cache, target.embed_tokens)
    slots = hidden[:, cfg.first_draft_slot:cfg.first_draft_slot + g]
    greedy = sampler.all_greedy
    if draft.markov_head is None:
        base = target.lm_head(slots.to(target.dtype)).float()
        tokens, probs = (argmax_last(base), None) if greedy else sample(base, sampler)
        prev = torch.cat([anchors.unsqueeze(1), tokens[:, :-1]], dim=1)
        confidence = draft.confidence(slots, prev) if draft.confidence_head is not None else None
        return Proposal(tokens, probs, confidence)
    # Semi-autoregressive: slot k's logits depend on the token drafted at k-1.
    # Early stop pays only for a few rows: with EARLY_STOP_ROWS or more, all of them
    # rarely fall below the floor together, and slot-by-slot lm_head calls and
    # checks cost more than one lm_head call for the block (plan applies the floor anyway).
    early_stop = min_survival > 0 and draft.confidence_head is not None and anchors.shape[0] < EARLY_STOP_ROWS
    # lm_head in chunks of ~64 rows x slots: one GEMM when all slots are needed anyway,
    # several when drafting may stop early (their logits are then never computed).
    chunk = max(1, 64 // anchors.shape[0]) if early_stop else g
    head = draft.markov_head
    state = head.initial_state(anchors.shape[0], slots)
    survival = torch.ones(anchors.shape[0], device=anchors.device)
    terms = draft.confidence_terms(slots) if early_stop else None
    prev_tok, toks, dists, prevs, confs = anchors, [], [], [], []
    for k in range(g):
        if k % chunk == 0:
            base = target.lm_head(slots[:, k:k + chunk].to(target.dtype)).float()
        logits_k, state = head.add_to(base[:, k % chunk], prev_tok, slots[:, k], state)
        if greedy:  # no distribution needed: the greedy rule compares tokens only
            tok = argmax_last(logits_k, keepdim=True)
        else:
            tok, dist = sample(logits_k.unsqueeze(1), sampler)
            dists.append(dist)
        prevs.append(prev_tok)
        if early_stop:
            conf = draft.confidence_from(terms[0][:, k:k + 1], terms[1], prev_tok.unsqueeze(1), first_slot=k)
            confs.append(conf)
            survival = survival * conf[:, 0]
        prev_tok = tok[:, 0]
        toks.append(tok)
        if early_stop and k + 1 < g and bool((survival < min_survival).all()):
            break
    tokens, prev = torch.cat(toks, 1), torch.stack(prevs, 1)
    probs = torch.cat(dists, 1) if dists else None
    if early_stop:
        confidence = torch.cat(confs, 1)
    else:
        confidence = draft.confidence(slots, prev) if draft.confidence_head is not None else None
    return Proposal(tokens, probs, confidence)


def verify_and_commit(target: TargetModel, cache: KVCache, anchors: torch.Tensor, proposal: Proposal | None,
                      sampler: RowSampler, draft: DraftModel | None = None, draft_cache: KVCache | None = None,
                      num_drafts: torch.Tensor | None = None, rule: str = "rejection") -> Verdict:
    """Target forward over [anchor, drafts]; keep the accepted prefix in both caches."""
    start = cache.lengths.clone()
    if proposal is None:
        seq, drafts, probs = anchors.unsqueeze(1), anchors.new_zeros(anchors.shape[0], 0), None
    else:
        seq = torch.cat([anchors.unsqueeze(1), proposal.tokens], dim=1)
        drafts, probs = proposal.tokens, proposal.probs
    capture = tuple(draft.config.target_layer_ids) if draft is not None else ()
    if proposal is None and draft is None:  # plain AR step
        out = TargetOutput(target.decode_step(anchors, cache), None)
    else:
        out = target(seq, cache, capture=capture)
    verdict = verify(out.logits, drafts, probs, sampler, num_drafts, rule)
    # Keep anchor + accepted drafts; the bonus gets its KV when it is the next anchor.
    cache.truncate(start + verdict.accepted + 1)
    if draft is not None:
        assert draft_cache is not None and out.features is not None
        draft.append_context(draft_cache, out.features, verdict.accepted + 1)
    return verdict
