"""Draft training losses (docs/design.md section 7).

DFlash (zlab): cross-entropy at block slot k weighted exp(-(k-1)/lambda), slot 0 unused.
DSpark (deepspec): 0.1*CE + 0.9*L1(p_draft - p_target) + 1.0*BCE(confidence), weights
exp(-k/lambda); the confidence target is the exact acceptance probability
1 - 0.5*||p_draft - p_target||_1 (detached).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint


def slot_weights(num_drafts: int, decay: float) -> torch.Tensor:
    """Weight of draft slot i (0-based): exp(-i/decay) — same curve for both layouts."""
    return torch.exp(-torch.arange(num_drafts, dtype=torch.float32) / decay)


# -- chunked block losses (what the trainer runs) --------------------------------------------
# The vocabulary projection of every trained slot, [N, V] in fp32, is the largest tensor of a
# training step (at Qwen3 scale 512 anchors x 15 slots x 151,936 x 4 bytes = 4.7 GB per sequence,
# twice over for its gradient). The terms below are computed over chunks of blocks, each chunk
# under activation checkpointing: its logits live only while that chunk's sums are formed and
# are recomputed chunk by chunk in backward. Every term is a sum over slots, so the chunked
# sums equal the unchunked ones (tests/training/test_trainer_losses.py).

SUMS = ("total", "ce", "l1", "bce", "accepted", "blocks")  # the layout of `block_sums`' result


@dataclass
class BlockHeads:
    """What turns a draft slot's hidden state into logits and confidence."""
    lm_head: Callable[[torch.Tensor], torch.Tensor]                  # [.., H] -> float logits [.., V]
    markov: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None      # (prev, h) -> bias
    confidence: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (h, prev) -> logit
    ce_w: float = 1.0          # DFlash: CE only; DSpark: 0.1 CE + 0.9 L1 + 1.0 BCE
    l1_w: float = 0.0
    bce_w: float = 0.0


def _chunk_sums(heads: BlockHeads, h: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                prev: torch.Tensor | None, target_hidden: torch.Tensor | None) -> torch.Tensor:
    """Weighted sums of one chunk of blocks (h [m, g, H]): [total, ce, l1, bce, accepted, blocks]."""
    logits = heads.lm_head(h)
    if heads.markov is not None:
        assert prev is not None
        logits = logits + heads.markov(prev, h).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    ce_s = (ce * weights).sum()
    total = heads.ce_w * ce_s
    l1_s = bce_s = torch.zeros((), device=h.device)
    if target_hidden is not None:
        with torch.no_grad():
            t_probs = torch.softmax(heads.lm_head(target_hidden), dim=-1)
        tv2 = (torch.softmax(logits, dim=-1) - t_probs).abs().sum(-1)   # ||p_d - p_t||_1
        l1_s = (tv2 * weights).sum()
        total = total + heads.l1_w * l1_s
        if heads.confidence is not None:
            assert prev is not None
            accept = (1 - 0.5 * tv2).detach().clamp(0, 1)                  # exact acceptance probability
            bce = F.binary_cross_entropy_with_logits(heads.confidence(h, prev).float(), accept, reduction="none")
            bce_s = (bce * weights).sum()
            total = total + heads.bce_w * bce_s
    with torch.no_grad():
        # Greedy acceptance of the training blocks: leading slots whose argmax is the label.
        lead = (logits.argmax(-1) == labels).long().cumprod(-1).sum(-1)
        accepted = lead.sum().float()
    blocks = torch.tensor(float(labels.shape[0]), device=h.device)
    return torch.stack([total, ce_s.detach(), l1_s.detach(), bce_s.detach(), accepted, blocks])


def block_sums(heads: BlockHeads, h: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               prev: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
               chunk_tokens: int = 0) -> torch.Tensor:
    """Loss sums over blocks h [M, g, H] with labels / weights [M, g], the teacher-forced previous
    tokens prev [M, g] (DSpark heads) and the target's final hidden states at each slot's
    position target_hidden [M, g, H] (DSpark's L1 term). Returns [total, ce, l1, bce, accepted,
    blocks]: total carries the gradient (un-normalised: divide by the weight sum), the rest are
    detached. chunk_tokens > 0: chunks of about that many slots (whole blocks: a recurrent
    Markov head runs along the block)."""
    m, g = labels.shape
    per = max(1, chunk_tokens // g) if chunk_tokens > 0 else m
    if m == 0:
        raise ValueError("block_sums needs at least one block (pass a zero-weight one)")
    if per >= m:
        return _chunk_sums(heads, h, labels, weights, prev, target_hidden)
    parts = []
    for s in range(0, m, per):
        sl = slice(s, s + per)
        parts.append(torch.utils.checkpoint.checkpoint(
            _chunk_sums, heads, h[sl], labels[sl], weights[sl], None if prev is None else prev[sl],
            None if target_hidden is None else target_hidden[sl], use_reentrant=False))
    return torch.stack(parts).sum(0)
