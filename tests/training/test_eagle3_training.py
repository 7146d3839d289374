"""EAGLE-3 training: the draft vocabulary, the training-time test against a direct
step-by-step reference, the loss going down, and `train --method eagle3` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_eagle3, load_target, save_eagle3
from blockspec.training.data import Example, collate, collate_packed, load_examples
from blockspec.training.eagle3 import STEP_DECAY, Eagle3Objective, prepare_eagle3, select_vocabulary
from blockspec.training.trainer import TrainConfig, train
from conftest import make_eagle3, make_target, write_pattern_data, write_tiny_target_dir


def test_select_vocabulary_counts_trained_tokens_only():
    examples = [Example([5, 5, 5, 7, 7, 9], 3), Example([9, 9, 9, 9, 2, 7], 4)]
    # trained: 7 7 9 | 2 7  -> 7 x3, 9 x1, 2 x1 (5 and the leading 9s are prompt tokens)
    assert select_vocabulary(examples, 16, 2).tolist() == [2, 7]            # tie 2 / 9: lower id first
    assert select_vocabulary(examples, 16, 3).tolist() == [2, 7, 9]
    assert select_vocabulary(examples, 16, 5).tolist() == [0, 1, 2, 7, 9]  # topped up with unused ids
    with pytest.raises(BlockspecError, match="draft_vocab_size"):
        select_vocabulary(examples, 16, 17)


def _setup(seed: int = 0):
    target = make_target(seed=seed, layers=4).double()
    draft = make_eagle3(target).double().requires_grad_(False)
    return target, draft


def test_unrolled_steps_equal_chained_inference():
    """Step s of the training-time test at position t is the s-th chained step of inference
    from t (a fresh cache holding positions 0..t), fed the same tokens."""
    target, draft = _setup()
    embed = target.embed_tokens
    t, steps = 10, 3
    ids = torch.randint(0, 64, (1, t))
    feats = torch.randn(1, t, 96, dtype=torch.float64)
    tokens = ids.gather(1, (torch.arange(t).view(1, t) + 1 + torch.arange(steps).view(steps, 1)).clamp(max=t - 1)
                        .flatten().unsqueeze(0)).view(1, steps, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)
    outs = draft.unrolled(feats, tokens, torch.arange(t).view(1, t), mask, embed)
    for p in range(t - steps):
        cache = draft.new_cache(1, 32)
        h = draft.append(cache, feats[:, :p + 1], ids[:, 1:p + 2], p + 1, embed)[:, -1]
        assert torch.allclose(outs[0][0, p], h[0], atol=1e-10)
        for s in range(1, steps):
            h = draft.step(cache, ids[:, p + 1 + s], h, s - 1, embed)
            assert torch.allclose(outs[s][0, p], h[0], atol=1e-10), (p, s)


def _reference_sums(draft, target, examples, steps):
    """The loss written out position by position: soft cross entropy of each chained step
    against the target's distribution over the draft vocabulary, weight 0.8^s."""
    embed, vocab = target.embed_tokens, draft.vocabulary
    total = 0.0
    for e in examples:
        ids = torch.tensor([e.ids])
        out = target(ids, capture=tuple(draft.config.aux_layer_ids(4)))
        mask = e.mask()
        for p in range(len(e.ids) - 2):
            cache = draft.new_cache(1, 64)
            h = draft.append(cache, out.features[:, :p + 1], ids[:, 1:p + 2], p + 1, embed)[:, -1]
            for s in range(steps):
                if p + 2 + s >= len(e.ids):
                    break
                if s:
                    h = draft.step(cache, ids[:, p + 1 + s], h, s - 1, embed)
                if not mask[p + 2 + s]:
                    continue
                z = out.logits[0, p + 1 + s]
                if not bool(draft.t2d[z.argmax()]):
                    continue
                logq = torch.log_softmax(draft.draft_logits(h)[0], -1)
                total += STEP_DECAY ** s * float(-(torch.softmax(z[vocab], -1) * logq).sum())
    return total


@pytest.mark.parametrize("packed, chunk", [(False, 0), (True, 0), (False, 7)])
def test_ttt_loss_equals_the_direct_unrolled_reference(packed, chunk):
    target, draft = _setup()
    examples = [Example([(3 * i + 1) % 64 for i in range(9)], 3), Example([(5 * i + 2) % 64 for i in range(7)], 2)]
    steps = 3
    if packed:
        rows = collate_packed(examples, 0, 32)
        ids, loss_mask = rows.ids, rows.loss_mask
    else:
        rows = None
        ids, loss_mask = collate(examples, 0)
    x = prepare_eagle3(target, draft, ids, loss_mask, steps, packed_rows=rows)
    sums = Eagle3Objective(draft, target, ce_chunk=chunk)(x)
    reference = _reference_sums(draft, target, examples, steps)
    assert float(sums[0]) == pytest.approx(reference, rel=1e-6)   # (logits in float32)
    assert float(sums[5]) == sum(sum(e.mask()[2:]) for e in examples)       # positions trained at step 0


def test_ttt_loss_decreases_and_the_trained_draft_round_trips(tmp_path):
    target = make_target(layers=4)
    draft = make_eagle3(target).train().requires_grad_(True)
    examples = [Example([(7 * i + k) % 64 for i in range(24)], 6) for k in range(4)]
    ids, loss_mask = collate(examples, 0)
    x = prepare_eagle3(target, draft, ids, loss_mask, 4)
    objective = Eagle3Objective(draft, target)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(30):
        sums = objective(x)
        loss = sums[0] / x.weights.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    floor = _entropy_floor(target, draft, x)
    assert losses[-1] - floor < 0.5 * (losses[0] - floor), (losses[0], losses[-1], floor)
    draft.eval().requires_grad_(False)
    save_eagle3(draft, tmp_path / "d", dtype="float32")
    again = load_eagle3(tmp_path / "d", target=target)
    with torch.no_grad():
        assert torch.equal(objective(x), Eagle3Objective(again, target)(x))
        feats = torch.randn(2, 5, 96)
        runs = [d.chain(d.new_cache(2, 16), feats, ids[:2, 1:6], torch.tensor([5, 4]), 4, target.embed_tokens)[0]
                for d in (draft, again)]
    assert torch.equal(runs[0], runs[1])


def test_recomputed_steps_give_the_same_gradients():
    """--grad-checkpoint: each unrolled step recomputed in backward, same loss and gradients."""
    target = make_target(layers=4)
    examples = [Example([(7 * i + k) % 64 for i in range(16)], 4) for k in range(2)]
    ids, loss_mask = collate(examples, 0)
    grads = []
    for recompute in (False, True):
        draft = make_eagle3(target).train().requires_grad_(True)
        x = prepare_eagle3(target, draft, ids, loss_mask, 3)
        sums = Eagle3Objective(draft, target, grad_checkpoint=recompute)(x)
        sums[0].backward()
        grads.append([p.grad.clone() for p in draft.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _entropy_floor(target, draft, x):
    """The soft cross entropy's minimum: the entropy of the target's draft-vocabulary distributions."""
    with torch.no_grad():
        full = target.lm_head(x.target_hidden).float()
        w = x.weights * draft.t2d[full.argmax(-1)]
        p = torch.softmax(full[..., draft.vocabulary], -1)
        ent = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)
    return float((ent * w).sum() / x.weights.sum())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-eagle3")
    write_tiny_target_dir(root / "target")
    write_pattern_data(root / "data.jsonl")
    return root


def test_train_method_eagle3_end_to_end(setup):
    out = setup / "out"
    kw = dict(method="eagle3", target=str(setup / "target"), data=str(setup / "data.jsonl"), out=str(out),
              target_layer_ids="0,1,2", ttt_steps=3, draft_vocab_size=48, batch_size=4, lr=3e-3, eval_every=6,
              eval_examples=4, eval_new_tokens=8, threads=1, pack=True, max_len=128)
    train(TrainConfig(max_steps=4, **kw))
    result = train(TrainConfig(max_steps=6, resume=True, **kw))
    records = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [r["step"] for r in records] == list(range(1, 7)) and result["steps"] == 6
    assert all(r["loss"] > 0 and 1.0 <= r["tau_est"] <= 4.0 for r in records)
    assert 1.0 <= records[-1]["eval"]["tau"] <= 4.0 and len(records[-1]["eval"]["per_slot"]) == 3
    raw = json.loads((out / "draft" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 48
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    target = load_target(setup / "target")
    draft = load_eagle3(out / "draft", target=target)
    examples = load_examples(Path(setup / "data.jsonl"), 128)[4:]     # the training split (4 held out)
    assert torch.equal(draft.vocabulary, select_vocabulary(examples, 64, 48))
    save_eagle3(draft, setup / "again")
    again = load_eagle3(setup / "again", target=target)
    for (n1, a), (n2, b) in zip(draft.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)


def test_eagle3_options_refused_clearly():
    base = dict(method="eagle3", target="t", data="d")
    with pytest.raises(BlockspecError, match="one decoder layer"):
        TrainConfig(num_layers=2, **base).validate()
    with pytest.raises(BlockspecError, match="init-from-target"):
        TrainConfig(init_from_target=True, **base).validate()
    with pytest.raises(BlockspecError, match="--mask-token-id does not apply"):
        TrainConfig(mask_token_id=5, **base).validate()
    with pytest.raises(BlockspecError, match="method must be one of"):
        TrainConfig(method="medusa", target="t", data="d").validate()


def test_default_aux_layers_need_a_deep_enough_target(setup, tmp_path):
    with pytest.raises(BlockspecError, match="no default auxiliary layers"):
        train(TrainConfig(method="eagle3", target=str(setup / "target"), data=str(setup / "data.jsonl"),
                          out=str(tmp_path / "o"), max_steps=1, threads=1))
