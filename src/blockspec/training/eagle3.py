"""Training an EAGLE-3 draft (docs/design.md section 7.1): the draft vocabulary from the
training data, the training-time test (TTT) unrolled over S steps, and a greedy acceptance
evaluation of the chained drafts.

Step s at position t reads the true token x_{t+1+s} and, for s > 0, the draft's own output
of step s-1 at t (its attention: `Eagle3Draft.unrolled`); it is trained towards the target's
next-token distribution at position t+1+s restricted to the draft vocabulary (soft cross
entropy), where x_{t+2+s} is a trained token of t's own sequence and the target's argmax
lies in the draft vocabulary, weighted 0.8^s (EAGLE-3: 7 steps, weights 0.8^s).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.metrics import AcceptanceStats
from blockspec.models.eagle3 import Eagle3Draft
from blockspec.models.target import TargetModel
from blockspec.training.data import Example, PackedRows

STEP_DECAY = 0.8     # EAGLE-3's weight of unrolled step s: 0.8^s


def select_vocabulary(examples: list[Example], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: the `draft_vocab_size` most frequent trained tokens of the data
    (ties: lower id first), topped up with the lowest unused ids when the data has fewer
    distinct tokens (as SpecForge and the EAGLE-3 trainer pick it), ascending."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise BlockspecError(f"train: draft_vocab_size must be in 1..{vocab_size}, got {draft_vocab_size}")
    counts: Counter[int] = Counter()
    for e in examples:
        counts.update(t for t, m in zip(e.ids, e.mask()) if m)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:draft_vocab_size]]
    taken = set(chosen)
    chosen += [t for t in range(vocab_size) if t not in taken][:draft_vocab_size - len(chosen)]
    return torch.tensor(sorted(chosen))


@dataclass
class Eagle3Inputs:
    features: torch.Tensor        # [B, T, 3*Ht] the target's three auxiliary layers
    tokens: torch.Tensor          # [B, S, T] step s at position t reads x_{t+1+s}
    positions: torch.Tensor       # [B, T] RoPE positions (packed rows restart per sequence)
    mask: torch.Tensor            # [B, 1, T, T] step 0's keys: causal within the sequence
    sel: torch.Tensor             # [M] flat (row * T + t) positions trained at some step
    target_hidden: torch.Tensor   # [M, S, Ht] the target's final states at t+1+s
    weights: torch.Tensor         # [M, S] step weights (0 = not trained)


@torch.no_grad()
def prepare_eagle3(target: TargetModel, draft: Eagle3Draft, ids: torch.Tensor, loss_mask: torch.Tensor,
                   steps: int, zero_weight: bool = False, packed_rows: PackedRows | None = None) -> Eagle3Inputs:
    """The target's features and final states for one micro-batch (one target forward) and the
    unrolled steps' tokens and weights. `packed_rows`: rows holding several sequences, each
    positioned from 0 and seeing only itself."""
    b, t = ids.shape
    dev = ids.device
    layers = tuple(draft.config.aux_layer_ids(target.config.num_hidden_layers))
    if packed_rows is None:
        positions = torch.arange(t, device=dev).expand(b, t)
        seg = torch.zeros(b, t, dtype=torch.long, device=dev)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(b, 1, t, t)
        out = target(ids, capture=layers, output="hidden")
    else:
        positions, seg, mask = packed_rows.positions, packed_rows.seg_start, packed_rows.attention_mask()
        out = target(ids, capture=layers, output="hidden", positions=positions, mask=mask)
    assert out.features is not None and out.hidden is not None
    pos = torch.arange(t, device=dev).view(1, t, 1) + torch.arange(steps, device=dev).view(1, 1, steps)  # t + s
    read = (pos + 1).clamp(max=t - 1)                        # x_{t+1+s}: the token step s reads
    label = pos + 2                                          # x_{t+2+s}: the token it predicts
    ok = label < t
    label = label.clamp(max=t - 1).expand(b, t, steps)
    ok = ok & loss_mask.gather(1, label.flatten(1)).view(b, t, steps) \
        & (seg.gather(1, label.flatten(1)).view(b, t, steps) == seg.unsqueeze(-1))
    weights = STEP_DECAY ** torch.arange(steps, device=dev, dtype=torch.float32) * ok
    if zero_weight:
        weights = weights * 0
    tokens = ids.gather(1, read.expand(b, t, steps).flatten(1)).view(b, t, steps).transpose(1, 2)
    sel = ok.any(-1).flatten().nonzero().flatten()
    if sel.numel() == 0:   # nothing to train: one zero-weight position keeps every parameter in the graph
        sel = torch.zeros(1, dtype=torch.long, device=dev)
    rows = sel // t
    at = (pos[0, sel % t] + 1).clamp(max=t - 1)              # [M, S] the target's position t+1+s
    return Eagle3Inputs(out.features.to(draft.dtype), tokens, positions, mask, sel,
                        out.hidden[rows.unsqueeze(-1), at], weights.flatten(0, 1)[sel])


def _ttt_sums(draft: Eagle3Draft, lm_head: nn.Module, h: torch.Tensor, target_hidden: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """Loss sums of positions h [m, S, H]: [total, ce, 0, 0, accepted, positions] (losses.SUMS)."""
    logp = torch.log_softmax(draft.draft_logits(h), dim=-1)                    # [m, S, Vd]
    vocab = draft.vocabulary
    with torch.no_grad():
        full = lm_head(target_hidden.to(lm_head.weight.dtype)).float()         # [m, S, V]
        best = full.argmax(-1)
        w = weights * draft.t2d[best]                                          # the target's choice is draftable
        p = torch.softmax(full[..., vocab], dim=-1)
    ce = -(p * logp).sum(-1)
    ce_s = (ce * w).sum()
    with torch.no_grad():
        # Greedy acceptance of the unrolled chain: leading steps whose draft argmax is the target's.
        hit = (vocab[logp.argmax(-1)] == best) & (weights > 0)
        lead = hit.long().cumprod(-1).sum(-1)
        trained = (weights[:, 0] > 0).float()
        accepted, count = (lead * trained).sum().float(), trained.sum()
    zero = torch.zeros((), device=h.device)
    return torch.stack([ce_s, ce_s.detach(), zero, zero, accepted, count])


class Eagle3Objective(nn.Module):
    """draft -> [total, ce, l1, bce, accepted, positions] sums (losses.SUMS) of a batch; the
    frozen target is held outside the module tree (DDP / FSDP leave it alone)."""

    def __init__(self, draft: Eagle3Draft, target: TargetModel, ce_chunk: int = 0,
                 grad_checkpoint: bool = False) -> None:
        super().__init__()
        self.draft = draft
        self._frozen = (target,)
        self.ce_chunk, self.grad_checkpoint = ce_chunk, grad_checkpoint

    def forward(self, x: Eagle3Inputs) -> torch.Tensor:
        target = self._frozen[0]
        outs = self.draft.unrolled(x.features, x.tokens, x.positions, x.mask, target.embed_tokens,
                                   checkpoint_steps=self.grad_checkpoint)
        h = torch.stack(outs, dim=2).flatten(0, 1)[x.sel]                      # [M, S, H]
        m, s = x.weights.shape
        per = max(1, self.ce_chunk // s) if self.ce_chunk > 0 else m
        if per >= m:
            return _ttt_sums(self.draft, target.lm_head, h, x.target_hidden, x.weights)
        # Chunks of positions under activation checkpointing: [chunk, S, V] logits one at a time.
        return torch.stack([torch.utils.checkpoint.checkpoint(
            _ttt_sums, self.draft, target.lm_head, h[i:i + per], x.target_hidden[i:i + per], x.weights[i:i + per],
            use_reentrant=False) for i in range(0, m, per)]).sum(0)


@torch.no_grad()
def greedy_acceptance(draft: Eagle3Draft, target: TargetModel, prompts: list[list[int]], new_tokens: int,
                      k: int) -> AcceptanceStats:
    """Greedy speculative decoding with chained drafts of k tokens, counted against the
    target's own greedy continuation: at temperature 0 the output is that continuation
    whatever the draft proposes, so each round accepts the drafts that match it. One target
    forward per prompt gives every position's features."""
    stats = AcceptanceStats()
    out = generate(target, prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    layers = tuple(draft.config.aux_layer_ids(target.config.num_hidden_layers))
    for prompt, completion in zip(prompts, out.completions):
        seq = torch.tensor(prompt + completion.tokens, device=target.device).unsqueeze(0)
        n = seq.shape[1]
        feats = target(seq, capture=layers, output="features").features
        cache = draft.new_cache(1, n + k + 1)
        anchor, done = len(prompt), 0           # the anchor's position; the cache holds positions < done
        while anchor < n - 1:
            g = min(k, n - 1 - anchor)
            drafts, _ = draft.chain(cache, feats[:, done:anchor], seq[:, done + 1:anchor + 1],
                                    torch.tensor([anchor - done], device=seq.device), g, target.embed_tokens)
            truth = seq[0, anchor + 1:anchor + 1 + g]
            accepted = int((drafts[0] == truth).long().cumprod(0).sum())
            stats.add_round(accepted, g)
            # The chained slots after the committed ones are overwritten by the next append.
            done, anchor = anchor, anchor + accepted + 1
    return stats
