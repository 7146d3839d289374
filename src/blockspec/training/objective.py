"""One training step's inputs and the module that turns them into loss sums.

`prepare` runs the frozen target (no gradients): the captured layers' features only for
DFlash (the target stops at its deepest captured layer, no lm_head), plus its final hidden
states at each trained slot's position for DSpark and distilled DFlash (projected to
probabilities later, chunk by chunk). `DraftObjective` is what DistributedDataParallel /
FSDP2 wrap: the draft and its heads all run inside its forward, and the target is held
outside the module tree, so neither wrapper replicates, shards or synchronises it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel
from blockspec.training.anchors import PackedBlocks, pack_blocks, sample_anchors, sample_packed_anchors
from blockspec.training.data import PackedRows
from blockspec.training.losses import BlockHeads, block_sums, slot_weights


@dataclass
class StepInputs:
    features: torch.Tensor               # [B, T, F] the target's captured layers
    packed: PackedBlocks
    sel: torch.Tensor                    # [M] flat (row * A + anchor) indices of the trained blocks
    labels: torch.Tensor                 # [M, g]
    weights: torch.Tensor                # [M, g] slot weights (0 = not trained)
    prev: torch.Tensor | None            # [M, g] teacher-forced previous tokens (DSpark heads)
    target_hidden: torch.Tensor | None   # [M, g, H] the target's final states at each slot's position
    context_positions: torch.Tensor | None = None   # [B, T] packed rows: positions within each sequence


def uses_target_probs(draft: DraftModel, distill: bool = False) -> bool:
    """DSpark's loss (L1 to the target's distribution, confidence BCE) vs DFlash's CE alone;
    `distill`: a DFlash draft learns the target's distribution too (DSpark's loss, no heads)."""
    return distill or draft.markov_head is not None or draft.confidence_head is not None


def anchor_generators(seed: int, epoch: int, indices: list[int]) -> list[torch.Generator]:
    """One generator per example, seeded by (seed, epoch, example): its anchors do not depend on
    the rank, micro-batch or process count it is trained in."""
    return [torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 10_000_019 + i) for i in indices]


@dataclass(frozen=True)
class AnchorSpec:
    """Anchors sampled per sequence, the decay of the per-slot loss weights (`slot_weights`),
    and whether a DFlash draft's slots learn the target's distribution (`uses_target_probs`)."""

    num_anchors: int
    decay: float
    distill: bool = False


@torch.no_grad()
def prepare(target: TargetModel, draft: DraftModel, ids: torch.Tensor, loss_mask: torch.Tensor,
            gens: list[torch.Generator], spec: AnchorSpec, zero_weight: bool = False,
            packed_rows: PackedRows | None = None) -> StepInputs:
    """Anchors, the target's features and the labels of one micro-batch. `zero_weight`: a
    stand-in batch for a rank without data this micro-step (it runs for the collectives
    and trains nothing). `packed_rows` (`collate_packed`, on ids' device): rows hold several
    sequences; gens are then per example (gens[k] for example k of the batch), each sequence
    is positioned from 0 and sees only itself, in the target and in the draft."""
    cfg = draft.config
    g = cfg.num_drafts
    b, t = ids.shape
    num_anchors, decay = spec.num_anchors, spec.decay
    extra: dict = {}
    if packed_rows is None:
        anchors, valid = sample_anchors(loss_mask.cpu(), g, num_anchors, gens)
    else:
        anchors, valid = sample_packed_anchors(loss_mask.cpu(), packed_rows.segments, g, num_anchors, gens)
        extra = {"positions": packed_rows.positions, "mask": packed_rows.attention_mask()}
    anchors, valid = anchors.to(ids.device), valid.to(ids.device)
    # Padded anchors (0) may point past a short row: their labels are never trained (weight 0).
    label_pos = (anchors.unsqueeze(-1) + 1 + torch.arange(g, device=ids.device)).clamp(max=t - 1)
    labels = ids.gather(1, label_pos.flatten(1)).view(b, -1, g)
    weights = slot_weights(g, decay).to(ids.device).view(1, 1, g) * valid.unsqueeze(-1)
    if zero_weight:
        weights = weights * 0
    capture = tuple(cfg.target_layer_ids)
    prev = t_hidden = None
    if uses_target_probs(draft, spec.distill):
        # The target's distribution for token a+k+1 is its output at position a+k.
        out = target(ids, capture=capture, output="hidden", logits_at=(label_pos - 1).flatten(1), **extra)
        assert out.hidden is not None
        t_hidden = out.hidden.view(b, -1, g, out.hidden.shape[-1])
        prev = torch.cat([ids.gather(1, anchors).unsqueeze(-1), labels[..., :-1]], dim=-1)
    else:
        out = target(ids, capture=capture, output="features", **extra)
    assert out.features is not None
    packed = pack_blocks(ids, anchors, valid, cfg.block_size, cfg.mask_token_id,
                         None if packed_rows is None else packed_rows.seg_start,
                         tuple((cfg.layer_window(i), cfg.layer_causal(i)) for i in range(cfg.num_hidden_layers)))
    sel = valid.flatten().nonzero().flatten()
    if sel.numel() == 0:   # no trainable block: one zero-weight block keeps every parameter in the graph
        sel = torch.zeros(1, dtype=torch.long, device=ids.device)

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1)[sel]

    return StepInputs(out.features.to(draft.dtype), packed, sel, flat(labels), flat(weights),
                      None if prev is None else flat(prev), None if t_hidden is None else flat(t_hidden),
                      None if packed_rows is None else packed_rows.positions)


class DraftObjective(nn.Module):
    """draft + heads -> [total, ce, l1, bce, accepted, blocks] sums (losses.SUMS) of a batch."""

    def __init__(self, draft: DraftModel, target: TargetModel, ce_chunk: int = 0,
                 grad_checkpoint: bool = False, distill: bool = False) -> None:
        super().__init__()
        self.draft = draft
        self._frozen = (target,)   # a tuple: not a submodule, so DDP / FSDP leave it alone
        self.ce_chunk, self.grad_checkpoint, self.distill = ce_chunk, grad_checkpoint, distill

    def heads(self) -> BlockHeads:
        target, d = self._frozen[0], self.draft

        def lm_head(h: torch.Tensor) -> torch.Tensor:
            return target.lm_head(h.to(target.dtype)).float()

        if not uses_target_probs(d, self.distill):
            return BlockHeads(lm_head)
        return BlockHeads(lm_head, markov=d.markov_head.teacher_forced if d.markov_head is not None else None,
                          confidence=d.confidence_logit if d.confidence_head is not None else None,
                          ce_w=0.1, l1_w=0.9, bce_w=1.0)

    def forward(self, x: StepInputs) -> torch.Tensor:
        target, cfg = self._frozen[0], self.draft.config
        hidden = self.draft(x.features, x.packed.block_ids, x.packed.positions, x.packed.mask,
                            target.embed_tokens, checkpoint_layers=self.grad_checkpoint,
                            context_positions=x.context_positions)
        b, a = x.packed.anchors.shape
        first, g = cfg.first_draft_slot, cfg.num_drafts
        h = hidden.view(b, a, cfg.block_size, -1)[:, :, first:first + g].flatten(0, 1)[x.sel]
        return block_sums(self.heads(), h, x.labels, x.weights, x.prev, x.target_hidden, self.ce_chunk)
