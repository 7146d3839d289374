"""The draft trainer: loss goes down on a learnable task; torchrun DDP keeps ranks identical;
output drafts load back in their own format."""

from __future__ import annotations

import json
import math

import pytest

from blockspec.config import DraftConfig
from blockspec.models.checkpoint import load_draft, load_target
from blockspec.errors import BlockspecError
from blockspec.training.data import collate_packed
from blockspec.training.trainer import BUDGET_CALIBRATION_STEPS, TrainConfig, fit_to_budget, train
from conftest import write_pattern_data, write_tiny_target_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    write_tiny_target_dir(root / "target")
    write_pattern_data(root / "data.jsonl")
    return root


def curve(out, key):
    return [json.loads(line)[key] for line in open(out / "log.jsonl")]


def mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("method, block, distill", [("dflash", 4, False), ("dspark", 3, False), ("dflash", 4, True)])
def test_loss_decreases_and_draft_saved(setup, method, block, distill):
    out = setup / f"out-{method}-{distill}"
    cfg = TrainConfig(method=method, target=str(setup / "target"), data=str(setup / "data.jsonl"), out=str(out),
                      block_size=block, num_layers=1, markov_rank=8, num_anchors=8, batch_size=4, max_steps=40,
                      lr=3e-3, eval_every=40, eval_examples=4, eval_new_tokens=8, threads=1, distill=distill)
    train(cfg)
    loss, ce = curve(out, "loss"), curve(out, "ce")
    assert mean(loss[-5:]) < 0.8 * mean(loss[:5])   # DSpark's L1 term is bounded by the random target
    if not distill:                                 # distilled: the random target's distribution, not the data's
        assert mean(ce[-5:]) < 0.6 * mean(ce[:5])
    if method == "dspark" or distill:               # the L1 to the target's distribution is trained and logged
        assert mean(curve(out, "l1")[-5:]) < mean(curve(out, "l1")[:5])
    else:
        assert "l1" not in json.loads(open(out / "log.jsonl").readline())
    draft = load_draft(out / "draft", target=load_target(setup / "target"))
    assert draft.config.layout == ("zlab" if method == "dflash" else "deepspec")
    raw = json.loads((out / "draft" / "config.json").read_text())
    if method == "dflash":
        assert raw["architectures"] == ["DFlashDraftModel"] and "dflash_config" in raw
    else:
        assert raw["markov_rank"] == 8 and raw["enable_confidence_head"] is True
    assert DraftConfig.from_dict(raw).num_drafts == (block - 1 if method == "dflash" else block)


def test_time_budget_fits_the_step_count_once_timed():
    cfg = TrainConfig(method="dflash", target="t", data="d", time_budget_s=100.0)
    n = BUDGET_CALIBRATION_STEPS
    assert fit_to_budget(cfg, n - 1, 10_000, 0, 9.0, 9.0) == 10_000      # still timing
    # 20 steps in 10 s -> 0.5 s/step; 85% of the 90 s left -> 153 more steps.
    assert fit_to_budget(cfg, n, 10_000, 0, 10.0, 10.0) == n + 153
    assert fit_to_budget(cfg, n, 50, 0, 10.0, 10.0) == 50                   # never more than asked
    assert fit_to_budget(cfg, 70, 173, 0, 99.0, 100.5) == 70                # spent: stop here
    assert fit_to_budget(TrainConfig(method="dflash", target="t", data="d"), 70, 173, 0, 1e9, 1e9) == 173
    with pytest.raises(BlockspecError, match="time_budget_s"):
        TrainConfig(method="dflash", target="t", data="d", time_budget_s=-1).validate()


def test_time_budget_stops_and_saves(setup):
    out = setup / "out-budget"
    result = train(TrainConfig(method="dflash", target=str(setup / "target"), data=str(setup / "data.jsonl"),
                               out=str(out), block_size=4, num_anchors=4, batch_size=2, max_steps=100_000,
                               eval_every=100_000, eval_examples=2, eval_new_tokens=4, threads=1,
                               time_budget_s=1e-3))
    # The budget is spent after the first step: training ends there, evaluated and saved.
    assert result["steps"] == result["total_steps"] == 1
    last = json.loads(open(out / "log.jsonl").readlines()[-1])
    assert last["total"] == 1 and "eval" in last and (out / "draft" / "config.json").is_file()


def test_resume_continues_from_state(setup):
    out = setup / "out-resume"
    kw = dict(method="dflash", target=str(setup / "target"), data=str(setup / "data.jsonl"), out=str(out),
              block_size=4, num_anchors=4, batch_size=2, eval_every=5, eval_examples=2, eval_new_tokens=4, threads=1)
    train(TrainConfig(max_steps=5, **kw))
    with pytest.raises(BlockspecError, match="--resume"):    # never silently continued or overwritten
        train(TrainConfig(max_steps=8, **kw))
    result = train(TrainConfig(max_steps=8, resume=True, **kw))
    steps = [json.loads(line)["step"] for line in open(out / "log.jsonl")]
    assert steps == list(range(1, 9)) and result["steps"] == 8


def test_logs_tensorboard_events_and_a_progress_record(setup, tmp_path):
    """--logdir: TensorBoard event files with the step records (loss, tau estimate, tokens/s)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logdir = tmp_path / "tb-run", tmp_path / "tb"
    train(TrainConfig(method="dflash", target=str(setup / "target"), data=str(setup / "data.jsonl"), out=str(out),
                      block_size=4, num_anchors=4, batch_size=2, max_steps=3, eval_every=3, eval_examples=2,
                      eval_new_tokens=4, threads=1, logdir=str(logdir)))
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("train/loss", "train/tau_est", "train/tokens_per_s", "train/lr", "eval/tau"):
        assert tag in tags, tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    last = json.loads(open(out / "log.jsonl").readlines()[-1])
    assert events.Scalars("train/loss")[-1].value == pytest.approx(last["loss"])
    assert last["tokens_per_s"] > 0 and 1.0 <= last["tau_est"] <= 4.0


def test_wandb_and_fsdp_refused_clearly_when_unavailable(setup, tmp_path):
    import importlib.util

    kw = dict(method="dflash", target=str(setup / "target"), data=str(setup / "data.jsonl"), block_size=4,
              num_anchors=4, batch_size=2, max_steps=1, eval_examples=2, eval_new_tokens=4, threads=1)
    with pytest.raises(BlockspecError, match="--fsdp needs several processes"):
        train(TrainConfig(out=str(tmp_path / "a"), fsdp=True, **kw))
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(BlockspecError, match="--wandb needs the wandb package"):
            train(TrainConfig(out=str(tmp_path / "b"), wandb=True, **kw))


def test_warm_start_copies_the_targets_top_layer(setup):
    """--init-from-target: the draft's context K/V equal what the copied target layer
    computes from the deepest captured feature (same norm, same projections)."""
    import torch

    from blockspec.models.draft import DraftModel
    from blockspec.training.trainer import draft_config_for, warm_start

    target = load_target(setup / "target")
    cfg = TrainConfig(method="dflash", target="t", data="d", block_size=4, num_layers=1)
    draft = DraftModel(draft_config_for(cfg, target, mask_token_id=2))
    warm_start(draft, target)
    top = target.layers[-1]
    for name, p in top.state_dict().items():
        assert torch.equal(draft.layers[0].state_dict()[name], p), name
    ids = torch.randint(0, target.config.vocab_size, (1, 7))
    with torch.no_grad():
        feats = target(ids, capture=tuple(draft.config.target_layer_ids)).features
        deepest = max(draft.config.target_layer_ids)
        h = target(ids, capture=(deepest,)).features
        pos = torch.arange(7).unsqueeze(0)
        k, v = draft.context_kv(feats, pos)[0]
        cos, sin = target.rotary(pos, h.dtype)
        k_ref, v_ref = top.self_attn.project_kv(top.input_layernorm(h), cos, sin)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref)


def test_warm_start_refuses_a_differently_shaped_draft(setup):
    from blockspec.errors import BlockspecError
    from blockspec.models.draft import DraftModel
    from blockspec.training.trainer import draft_config_for, warm_start

    target = load_target(setup / "target")
    cfg = TrainConfig(method="dflash", target="t", data="d", block_size=4, num_layers=1,
                      intermediate_size=target.config.intermediate_size + 8)
    with pytest.raises(BlockspecError, match="layer shape"):
        warm_start(DraftModel(draft_config_for(cfg, target, mask_token_id=2)), target)


def test_a_continued_draft_refuses_a_warm_start_too():
    """--init-from and --init-from-target both set the initial weights: one would be ignored."""
    from blockspec.errors import BlockspecError

    with pytest.raises(BlockspecError, match="drop --init-from-target"):
        TrainConfig(method="dflash", target="t", data="d", init_from="runs/x/draft", init_from_target=True).validate()
    TrainConfig(method="dflash", target="t", data="d", init_from="runs/x/draft").validate()


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_distill_is_for_dflash_drafts(method):
    """DSpark always learns the target's distribution and EAGLE-3 has its own loss: --distill
    there would change nothing, so it is refused rather than silently ignored."""
    with pytest.raises(BlockspecError, match="--distill is for DFlash"):
        TrainConfig(method=method, target="t", data="d", distill=True, num_layers=1).validate()


@pytest.mark.parametrize("method, block", [("dflash", 4), ("dspark", 3)])
def test_bf16_target_the_gpu_default_trains_an_fp32_draft(setup, tmp_path, method, block):
    """On a GPU the frozen target runs in bf16 by default: its features and final states feed the
    fp32 draft and its bf16 lm_head projects the draft's states (run here on CPU with --dtype
    bfloat16): training runs and learns."""
    import torch

    cfg = TrainConfig(method=method, target=str(setup / "target"), data=str(setup / "data.jsonl"),
                      out=str(tmp_path / "bf16"), block_size=block, markov_rank=8, num_anchors=8, batch_size=4,
                      max_steps=12, lr=3e-3, eval_every=100, eval_examples=2, eval_new_tokens=4, threads=1,
                      dtype="bfloat16", ce_chunk=7)
    assert cfg.target_dtype(torch.device("cuda")) == "bfloat16"
    assert TrainConfig().target_dtype(torch.device("cpu")) == "float32"
    train(cfg)
    loss = curve(tmp_path / "bf16", "loss")
    assert all(math.isfinite(x) for x in loss) and mean(loss[-3:]) < mean(loss[:3])


@pytest.mark.parametrize("method, block", [("dflash", 4), ("dspark", 3)])
def test_packed_training_follows_the_unpacked_run(setup, method, block, monkeypatch):
    """--pack: the same examples, several per row, train to the same losses step by step."""
    from blockspec.training import trainer

    rows = []
    monkeypatch.setattr(trainer, "collate_packed", lambda *a: rows.append(collate_packed(*a)) or rows[-1])
    kw = dict(method=method, target=str(setup / "target"), data=str(setup / "data.jsonl"), block_size=block,
              markov_rank=8, num_anchors=4, batch_size=4, max_steps=4, max_len=256, eval_every=100,
              eval_examples=2, eval_new_tokens=4, threads=1)
    train(TrainConfig(out=str(setup / f"out-unpacked-{method}"), **kw))
    train(TrainConfig(out=str(setup / f"out-packed-{method}"), pack=True, **kw))
    ref, got = curve(setup / f"out-unpacked-{method}", "loss"), curve(setup / f"out-packed-{method}", "loss")
    assert len(got) == len(ref) == 4
    assert len(rows) == 4 and all(r.ids.shape == (1, 160) and len(r.segments[0]) == 4 for r in rows)
    assert got == pytest.approx(ref, rel=1e-4)


def test_small_data_default_target_and_distinct_layers(setup, tmp_path, capsys, monkeypatch):
    """6 examples with the default --eval-examples 16: a fifth is held out (one), the rest trains; a 4-layer
    target with 2 draft layers captures two distinct layers (the design formula alone gives [1, 1])."""
    from blockspec.training import trainer as trainer_module

    rows = (setup / "data.jsonl").read_text().splitlines()[:6]
    (tmp_path / "small.jsonl").write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(trainer_module, "default_target", lambda: setup / "target")   # the embedded stand-in
    cfg = TrainConfig(method="dflash", data=str(tmp_path / "small.jsonl"), out=str(tmp_path / "out"), block_size=4,
                      num_layers=2, num_anchors=4, batch_size=2, max_steps=2, eval_new_tokens=4, threads=1)
    train(cfg)   # no --target: the embedded target
    assert "holding out 1 for evaluation" in capsys.readouterr().out
    raw = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())
    ids = raw["dflash_config"]["target_layer_ids"]
    assert len(set(ids)) == 2 and all(0 <= i < 4 for i in ids)
    with pytest.raises(BlockspecError, match="distinct layers"):
        train(TrainConfig(method="dflash", data=str(tmp_path / "small.jsonl"), out=str(tmp_path / "o2"),
                          target_layer_ids="1,1", max_steps=1, threads=1))
    with pytest.raises(BlockspecError, match="only 4"):
        train(TrainConfig(method="dflash", data=str(tmp_path / "small.jsonl"), out=str(tmp_path / "o3"),
                          num_layers=5, max_steps=1, threads=1))


def test_evaluation_sees_the_weights_as_trained(setup):
    """The eval tau follows the draft's current weights: after in-place optimizer updates it equals a
    fresh copy's (no stale fused-weight cache), and differs from the weights before."""
    import torch

    from blockspec.models.draft import DraftModel
    from blockspec.training.data import load_examples
    from blockspec.training.trainer import evaluate_acceptance
    from conftest import make_draft
    from blockspec.models.tokenizer import Tokenizer

    target = load_target(setup / "target")
    tok = Tokenizer(setup / "target")
    examples = load_examples(setup / "data.jsonl", 64, tok, [], target.config.vocab_size, [])[:6]
    draft = make_draft(target, "zlab", 4)
    before = evaluate_acceptance(draft, target, examples, 12)
    opt = torch.optim.AdamW(draft.parameters(), lr=0.5)
    for p in draft.parameters():
        p.grad = torch.randn_like(p)
    opt.step()   # in place, as training does
    after = evaluate_acceptance(draft, target, examples, 12)
    fresh = DraftModel(draft.config).to(draft.dtype).eval().requires_grad_(False)
    fresh.load_state_dict(draft.state_dict())
    assert after == evaluate_acceptance(fresh, target, examples, 12)
    assert after != before


def test_a_sliding_window_draft_trains_saves_and_loads(setup):
    """Issue 34: --draft-sliding-window / --draft-layer-types train a windowed draft (the mask of
    training/anchors.layer_masks), which learns, is saved with the window in the engines'
    spellings and loads back windowed; a full draft fine-tunes into a window (--init-from)."""
    out = setup / "out-window"
    cfg = TrainConfig(method="dflash", target=str(setup / "target"), data=str(setup / "data.jsonl"), out=str(out),
                      block_size=4, num_layers=2, num_anchors=8, batch_size=4, max_steps=30, lr=3e-3,
                      eval_every=30, eval_examples=4, eval_new_tokens=8, threads=1, draft_sliding_window=4,
                      draft_layer_types="sliding_attention,full_attention")
    train(cfg)
    ce = curve(out, "ce")
    assert mean(ce[-5:]) < 0.6 * mean(ce[:5])
    raw = json.loads((out / "draft" / "config.json").read_text())
    assert raw["layer_types"] == ["sliding_attention", "full_attention"] and raw["sliding_window"] == 4
    assert raw["use_sliding_window"] is True and raw["dflash_config"]["swa_window_size"] == 4
    draft = load_draft(out / "draft", target=load_target(setup / "target"))
    assert draft.config.layer_window(0) == 4 and draft.config.layer_causal(0)
    again = TrainConfig(**{**cfg.__dict__, "out": str(setup / "out-window2"), "init_from": str(out / "draft"),
                           "draft_layer_types": "", "draft_sliding_window": 2, "max_steps": 2})
    train(again)
    assert load_draft(setup / "out-window2" / "draft").config.layer_types == ("sliding_attention",) * 2


@pytest.mark.parametrize("change, message", [
    (dict(draft_sliding_window=-1), "must be > 0"),
    (dict(draft_layer_types="sliding_attention"), "need --draft-sliding-window"),
    (dict(draft_sliding_window=8, draft_layer_types="full_attention"), "needs sliding_attention"),
    (dict(draft_sliding_window=8, draft_layer_types="sliding_attention,full_attention"), "lists 2 layers"),
    (dict(draft_sliding_window=8, draft_layer_types="local_attention"), "entries must be"),
])
def test_bad_window_flags_are_one_line_errors(setup, change, message):
    cfg = TrainConfig(method="dflash", target=str(setup / "target"), data=str(setup / "data.jsonl"),
                      out=str(setup / "out-bad"), block_size=4, num_layers=1, max_steps=1, threads=1, **change)
    with pytest.raises(BlockspecError, match=message):
        train(cfg)
