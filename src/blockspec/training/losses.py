"""Draft training losses (docs/design.md section 7).

DFlash (zlab): cross-entropy at block slot k weighted exp(-(k-1)/lambda), slot 0 unused.
DSpark (deepspec): 0.1*CE + 0.9*L1(p_draft - p_target) + 1.0*BCE(confidence), weights
exp(-k/lambda); the confidence target is the exact acceptance probability
1 - 0.5*||p_draft - p_target||_1 (detached).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def slot_weights(num_drafts: int, decay: float) -> torch.Tensor:
    """Weight of draft slot i (0-based): exp(-i/decay) — same curve for both layouts."""
    return torch.exp(-torch.arange(num_drafts, dtype=torch.float32) / decay)


@dataclass
class LossParts:
    total: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor | None = None
    bce: torch.Tensor | None = None


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=1e-8)


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy, shaped like labels."""
    v = logits.shape[-1]
    return F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1), reduction="none").view(labels.shape)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> LossParts:
    """logits [M, g, V], labels [M, g], weights [M, g] (0 for padded blocks)."""
    loss = weighted_mean(token_ce(logits, labels), weights)
    return LossParts(loss, loss.detach())


def dspark_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, target_probs: torch.Tensor,
                confidence_logits: torch.Tensor | None, ce_w: float = 0.1, l1_w: float = 0.9,
                bce_w: float = 1.0) -> LossParts:
    """target_probs [M, g, V]: the target's next-token distribution at each slot's position."""
    ce = token_ce(logits, labels)
    p_draft = torch.softmax(logits.float(), dim=-1)
    tv2 = (p_draft - target_probs).abs().sum(-1)  # ||p_d - p_t||_1 = 2 * total variation
    ce_l, l1_l = weighted_mean(ce, weights), weighted_mean(tv2, weights)
    total = ce_w * ce_l + l1_w * l1_l
    bce_l = None
    if confidence_logits is not None:
        accept_prob = (1 - 0.5 * tv2).detach().clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept_prob, reduction="none")
        bce_l = weighted_mean(bce, weights)
        total = total + bce_w * bce_l
    return LossParts(total, ce_l.detach(), l1_l.detach(), None if bce_l is None else bce_l.detach())
