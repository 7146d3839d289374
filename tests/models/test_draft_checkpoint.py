"""Draft checkpoints: z-lab and DeepSpec round trips, foreign files, and refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.config import SamplingParams
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_draft, save_draft
from conftest import make_draft, make_target


@pytest.fixture
def target():
    return make_target()


@pytest.mark.parametrize("layout, rank, kind, conf", [
    ("zlab", 0, "vanilla", False), ("deepspec", 8, "vanilla", True),
    ("deepspec", 8, "gated", True), ("deepspec", 8, "rnn", False)])
def test_roundtrip_bit_exact_and_same_tokens(tmp_path, target, layout, rank, kind, conf):
    draft = make_draft(target, layout, 4, markov_rank=rank, markov_type=kind, confidence=conf)
    save_draft(draft, tmp_path / "d")
    again = load_draft(tmp_path / "d", target=target)
    assert again.config == draft.config
    for (n1, a), (n2, b) in zip(draft.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    first = generate(target, [[1, 2, 3]], sp, draft=draft)
    second = generate(target, [[1, 2, 3]], sp, draft=again)
    assert first.completions[0].tokens == second.completions[0].tokens
    assert [c.stats.accepted for c in first.completions] == [c.stats.accepted for c in second.completions]


def test_zlab_file_layout_matches_reference(tmp_path, target):
    save_draft(make_draft(target, "zlab", 4), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert "fc.weight" in names and "hidden_norm.weight" in names and "layers.0.self_attn.q_norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_deepspec_file_layout(tmp_path, target):
    save_draft(make_draft(target, "deepspec", 3, markov_rank=8, confidence=True), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in cfg
    assert cfg["markov_rank"] == 8 and cfg["mask_token_id"] == 62 and cfg["block_size"] == 3
    shapes = {k: tuple(v.shape) for k, v in load_file(str(tmp_path / "d" / "model.safetensors")).items()}
    assert shapes["markov_head.markov_w1.weight"] == (64, 8)
    assert shapes["markov_head.markov_w2.weight"] == (64, 8)
    assert shapes["confidence_head.proj.weight"] == (1, 32 + 8)


def test_foreign_zlab_file_loads(tmp_path, target):
    """Newer z-lab files: block_size inside dflash_config, `model.` prefix, extra keys,
    and an exported embedding that belongs to the target."""
    draft = make_draft(target, "zlab", 4)
    save_draft(draft, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    cfg["some_future_key"] = {"x": 1}
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    tensors = {f"model.{k}": v for k, v in load_file(str(tmp_path / "d" / "model.safetensors")).items()}
    tensors["embed_tokens.weight"] = torch.zeros(64, 32)
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    loaded = load_draft(tmp_path / "d", target=target)
    assert loaded.config.block_size == 4 and loaded.config.extra["some_future_key"] == {"x": 1}
    save_draft(loaded, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["some_future_key"] == {"x": 1}


def _edit(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(speculators_model_type="dspark"), "speculators"),
    (lambda c: c.update(hidden_size=48), "hidden_size"),
    (lambda c: c.update(vocab_size=80), "vocab_size"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), "target_layer_ids"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c: c.update(layer_types=["sliding_attention"]), "need a window"),
    (lambda c: c.update(layer_types=["sliding_attention"], sliding_window=0), "positive integer"),
    (lambda c: (c.pop("dflash_config"), c.pop("architectures")), "cannot tell the block layout"),
    (lambda c: c.update(block_size=1), "block_size"),
])
def test_bad_draft_configs_are_refused(tmp_path, target, edit, message):
    save_draft(make_draft(target, "zlab", 4), tmp_path / "d")
    _edit(tmp_path / "d", edit)
    with pytest.raises(BlockspecError, match=message):
        load_draft(tmp_path / "d", target=target)


def test_wrong_tensor_shapes_refused(tmp_path, target):
    save_draft(make_draft(target, "zlab", 4), tmp_path / "d")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(32, 32)
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(BlockspecError, match="fc.weight"):
        load_draft(tmp_path / "d", target=target)


def test_shorter_block_at_inference(target):
    draft = make_draft(target, "zlab", 8)
    draft = draft.with_block_size(4)
    assert draft.config.num_drafts == 3
    with pytest.raises(BlockspecError, match="exceeds"):
        draft.with_block_size(16)


def test_shorter_block_is_a_new_draft_sharing_the_weights(target):
    draft = make_draft(target, "deepspec", 5, markov_rank=4, confidence=True)
    draft = draft.with_config(dataclasses.replace(draft.config, confidence_temperatures=[0.5, 1.0, 2.0, 1.5, 0.8]))
    short = draft.with_block_size(3)
    assert short is not draft and short.config.block_size == 3 and draft.config.block_size == 5
    assert short.config.confidence_temperatures == [0.5, 1.0, 2.0]
    assert draft.config.confidence_temperatures == [0.5, 1.0, 2.0, 1.5, 0.8]
    assert all(a is b for a, b in zip(short.parameters(), draft.parameters()))
    assert len(list(short.parameters())) == len(list(draft.parameters()))
    with pytest.raises(BlockspecError, match="too small"):
        make_draft(target, "zlab", 4).with_block_size(1)
    with pytest.raises(BlockspecError, match="only block_size"):
        draft.with_config(dataclasses.replace(draft.config, markov_rank=8))


def test_training_context_equals_the_cached_block(target):
    """The draft's training forward (explicit context K/V, all visible) gives the hidden
    states of the inference path (context in the cache, then the block)."""
    draft = make_draft(target, "zlab", 4, layers=2)
    torch.manual_seed(0)
    t, s = 6, draft.config.block_size
    feats = torch.randn(1, t, len(draft.config.target_layer_ids) * draft.config.hidden_size)
    block = torch.tensor([[5] + [draft.config.mask_token_id] * (s - 1)])
    with torch.no_grad():
        want = draft(feats, block, torch.arange(t, t + s).unsqueeze(0), torch.ones(1, 1, s, t + s, dtype=torch.bool),
                     target.embed_tokens)
        cache = draft.new_cache(1, 16)
        draft.append_context(cache, feats, t)
        got = draft.block_hidden(block, cache, target.embed_tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
