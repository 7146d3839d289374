"""The trainer's memory savers change nothing: chunked vocabulary projection = one projection
(and = the reference losses), activation-checkpointed draft layers = plain ones (gradients),
the target's features-only / hidden-only forwards = its full forward."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from blockspec.training.losses import SUMS
from blockspec.training.objective import AnchorSpec, DraftObjective, anchor_generators, prepare
from conftest import make_draft, make_target


# -- the reference losses over full [.., V] tensors (docs/design.md section 7) ------------

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


def batch(vocab: int, rows: int = 3, t: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 2, (rows, t), generator=g)
    loss_mask = torch.zeros(rows, t, dtype=torch.bool)
    loss_mask[:, 6:] = True
    loss_mask[2, 14:] = False          # a shorter row: fewer anchors, padded ones
    return ids, loss_mask


def objective_sums(layout, markov, confidence, ce_chunk, grad_checkpoint=False, distill=False):
    target = make_target(dtype=torch.float64)
    draft = make_draft(target, layout, 4, markov_rank=8 if markov else 0, markov_type=markov or "vanilla",
                       confidence=confidence, layers=2, dtype=torch.float64).train().requires_grad_(True)
    ids, mask = batch(target.config.vocab_size)
    x = prepare(target, draft, ids, mask, anchor_generators(0, 0, [0, 1, 2]), AnchorSpec(5, 4.0, distill))
    obj = DraftObjective(draft, target, ce_chunk=ce_chunk, grad_checkpoint=grad_checkpoint, distill=distill)
    sums = obj(x)
    sums[0].backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return sums.detach(), grads, (target, draft, x)


def trained_slot_states(target, draft, x):
    """The draft's final states at the trained blocks' draft slots, [M, g, H], in one plain forward."""
    cfg = draft.config
    hidden = draft(x.features, x.packed.block_ids, x.packed.positions, x.packed.mask, target.embed_tokens)
    b, a = x.packed.anchors.shape
    h = hidden.view(b, a, cfg.block_size, -1)[:, :, cfg.first_draft_slot:][:, :, :cfg.num_drafts]
    return h.flatten(0, 1)[x.sel]


CASES = [("zlab", None, False), ("deepspec", "vanilla", True), ("deepspec", "rnn", True), ("deepspec", "gated", False)]


@pytest.mark.parametrize("layout, markov, confidence", CASES)
@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_projection_equals_one_projection(layout, markov, confidence, chunk):
    ref, ref_grads, _ = objective_sums(layout, markov, confidence, ce_chunk=0)
    got, grads, _ = objective_sums(layout, markov, confidence, ce_chunk=chunk)
    assert ref[SUMS.index("blocks")] > 2          # several chunks really ran
    torch.testing.assert_close(got, ref)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=name)


@pytest.mark.parametrize("layout, markov, confidence", CASES)
def test_sums_equal_the_reference_losses(layout, markov, confidence):
    """The chunked sums / weight sum = the reference dflash_loss / dspark_loss over full [.., V] tensors."""
    sums, _, (target, draft, x) = objective_sums(layout, markov, confidence, ce_chunk=3)
    with torch.no_grad():
        h = trained_slot_states(target, draft, x)
        logits = target.lm_head(h).float()
        if markov:
            logits = logits + draft.markov_head.teacher_forced(x.prev, h).float()
            conf = draft.confidence_logit(h, x.prev) if confidence else None
            ref = dspark_loss(logits, x.labels, x.weights, torch.softmax(target.lm_head(x.target_hidden).float(), -1),
                              conf)
        else:
            ref = dflash_loss(logits, x.labels, x.weights)
    w = x.weights.sum()
    torch.testing.assert_close(sums[0] / w, ref.total.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums[1] / w, ref.ce.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 3])
def test_a_distilled_dflash_draft_learns_the_targets_distribution(chunk):
    """`--distill`: a DFlash draft's sums = DSpark's loss without heads (0.1 CE + 0.9 L1 to
    the target's distribution at each slot), not the CE on the data's tokens alone."""
    sums, grads, (target, draft, x) = objective_sums("zlab", None, False, ce_chunk=chunk, distill=True)
    plain, plain_grads, _ = objective_sums("zlab", None, False, ce_chunk=chunk)
    with torch.no_grad():
        ref = dspark_loss(target.lm_head(trained_slot_states(target, draft, x)).float(), x.labels, x.weights,
                          torch.softmax(target.lm_head(x.target_hidden).float(), -1), None)
    w = x.weights.sum()
    torch.testing.assert_close(sums[0] / w, ref.total.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums[SUMS.index("l1")] / w, ref.l1.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums[SUMS.index("ce")], plain[SUMS.index("ce")])   # the same blocks and labels
    assert plain[SUMS.index("l1")] == 0 and sums[SUMS.index("l1")] > 0
    assert any(not torch.allclose(grads[n], plain_grads[n]) for n in grads)


@pytest.mark.parametrize("layout, markov, confidence", [CASES[0], CASES[2]])
def test_grad_checkpointing_gives_equal_gradients(layout, markov, confidence):
    ref, ref_grads, _ = objective_sums(layout, markov, confidence, ce_chunk=0)
    got, grads, _ = objective_sums(layout, markov, confidence, ce_chunk=0, grad_checkpoint=True)
    torch.testing.assert_close(got, ref)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=name)


def test_features_only_forward_equals_the_full_forward():
    target = make_target(dtype=torch.float64)
    ids = torch.randint(0, 60, (2, 11))
    capture = (0, 2)                     # deepest captured: layer 2 of 4 -> layer 3 never runs
    full = target(ids, capture=capture)
    ran = []
    hook = target.layers[3].register_forward_hook(lambda *a: ran.append(1))
    feats = target(ids, capture=capture, output="features")
    hook.remove()
    assert feats.logits is None and ran == []
    torch.testing.assert_close(feats.features, full.features, rtol=0, atol=0)
    at = torch.tensor([[0, 3, 10], [5, 5, 1]])
    hid = target(ids, capture=capture, output="hidden", logits_at=at)
    assert hid.logits is None
    torch.testing.assert_close(hid.features, full.features, rtol=0, atol=0)
    expected = full.logits.gather(1, at.unsqueeze(-1).expand(-1, -1, full.logits.shape[-1]))
    torch.testing.assert_close(target.lm_head(hid.hidden), expected)
    with pytest.raises(ValueError):
        target(ids, output="features")   # nothing captured: nothing to return
