"""What a round's drafting produces (`Proposal`) and the two ways drafts are proposed
beside the block forward itself (docs/design.md section 4): DSpark's Markov head, which
samples the block slot by slot after its one draft forward (`markov_drafts`), and
EAGLE-3's chain (`chain_proposal`), k one-token draft forwards each fed the draft's own
previous state and token, or its tree (`tree_proposal`), one forward per level of the
best-scored nodes.

Both hand verification the exact distributions their drafts were drawn from. A chain
draws from the draft's reduced vocabulary mapped onto the target's (`Eagle3Draft.
target_logits`: -inf outside it), so its proposal probability of a target token outside
the draft vocabulary is 0 and the rejection rule's residual max(0, p - q) gives such
tokens their full target probability: lossless at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from blockspec.decoding.sampling import RowSampler, argmax_last, sample
from blockspec.decoding.tree import TokenTree
from blockspec.models.chain_draft import Eagle3Cache, Eagle3Drafter
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel

# Maps a block's raw confidences [R, s] of slots first.. to the ones the policy plans with.
ConfidenceMap = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class Proposal:
    tokens: torch.Tensor                 # [R, g] drafted tokens
    probs: torch.Tensor | None           # [R, g, V] the exact distributions they were drawn from
                                         # (None when every row is greedy: verification only compares tokens)
    confidence: torch.Tensor | None      # [R, g] per-slot acceptance probability the policy plans with (DSpark)
    raw_confidence: torch.Tensor | None = None   # [R, g] the confidence head's own output
    tree: TokenTree | None = None        # the drafts' shape when they form a tree (None: a chain)


def proposal_of(tokens: torch.Tensor, probs: torch.Tensor | None, raw: torch.Tensor | None,
              confidence_map: ConfidenceMap | None) -> Proposal:
    planned = raw if raw is None or confidence_map is None else confidence_map(raw, 0)
    return Proposal(tokens, probs, planned, raw)


# With the early stop, the survival is checked every this many drafted slots: the slots'
# confidences in one call, not one per slot (per slot, a dozen small tensor operations made
# DSpark's scheduled rounds at batch 1 on a CPU the slowest part of its drafting after the
# draft forward, more than the Markov steps a stop saves); drafting then runs up to this many
# slots minus one past the first slot every row's survival is below the floor, slots the
# planner never admits.
STOP_CHECK_SLOTS = 4


def markov_drafts(draft: DraftModel, target: TargetModel, slots: torch.Tensor, anchors: torch.Tensor,
                   sampler: RowSampler, g: int, stop_below: float, confidence_map: ConfidenceMap | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Semi-autoregressive drafting: slot k's logits depend on the token drafted at k-1.
    Returns (tokens, probs, raw confidences when computed along the way for the early stop)."""
    rows = anchors.shape[0]
    early_stop = stop_below > 0
    # lm_head in chunks of ~64 rows x slots: one GEMM when all slots are needed anyway,
    # several when drafting may stop early (their logits are then never computed).
    chunk = max(1, 64 // rows) if early_stop else g
    head = draft.markov_head
    assert head is not None
    state = head.initial_state(rows, slots)
    survival = torch.ones(rows, device=anchors.device)
    terms = draft.confidence_terms(slots) if early_stop else None
    prevs, dists, confs = [anchors.unsqueeze(1)], [], []   # prevs[j]: slot j's previous token; [1:] drafted
    checked = 0                                           # slots whose confidences are computed (early stop)
    for k in range(g):
        if k % chunk == 0:
            base = target.lm_head(slots[:, k:k + chunk].to(target.dtype)).float()
        logits_k, state = head.add_to(base[:, k % chunk], prevs[k][:, 0], slots[:, k], state)
        if sampler.all_greedy:  # no distribution needed: the greedy rule compares tokens only
            tok = argmax_last(logits_k, keepdim=True)
        else:
            tok, dist = sample(logits_k.unsqueeze(1), sampler)
            dists.append(dist)
        prevs.append(tok)
        if terms is not None and (k + 1 - checked == STOP_CHECK_SLOTS or k + 1 == g):   # slots checked..k
            prev = torch.cat(prevs[checked:k + 1], 1)
            conf = draft.confidence_from(terms[0][:, checked:k + 1], terms[1], prev, first_slot=checked)
            confs.append(conf)
            planned = conf if confidence_map is None else confidence_map(conf, checked)
            survival = survival * planned.prod(dim=1)
            checked = k + 1
            if k + 1 < g and bool((survival < stop_below).all()):
                break
    probs = torch.cat(dists, 1) if dists else None
    return torch.cat(prevs[1:], 1), probs, torch.cat(confs, 1) if confs else None


def chain_proposal(draft: Eagle3Drafter, cache: Eagle3Cache, sampler: RowSampler, g: int) -> Proposal:
    """EAGLE-3: g drafts per row, each from the draft's own previous output and token
    (`Eagle3Drafter.draft`); greedy rows take the draft vocabulary's argmax, sampled rows
    draw with their own parameters and generators from the draft's distribution over the
    full vocabulary (`sample`), which verification then reads as q."""
    if not 1 <= g:
        raise ValueError(f"a chain of g drafts needs g >= 1, got {g}")
    if sampler.all_greedy:
        tokens, probs = draft.draft(cache, g)
    else:
        tokens, probs = draft.draft(cache, g, lambda logits: sample(logits, sampler))
    return Proposal(tokens, probs, None)


def tree_proposal(draft: Eagle3Drafter, cache: Eagle3Cache, sampler: RowSampler) -> Proposal:
    """EAGLE-3's draft tree (`Eagle3Drafter.draft_tree`): num_draft_tokens - 1 drafts per row
    and the tree they form. The draft chooses them alone (top-k, at any temperature): each
    is a point-mass proposal, which the tree's rule (`sampling.verify_tree`) verifies
    losslessly at any temperature, so the proposal carries no distributions."""
    tokens, parents, depths = draft.draft_tree(cache)
    return Proposal(tokens, None, None, tree=TokenTree(parents, depths))
