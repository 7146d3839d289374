"""Configs are frozen values validated on construction; tiny temperatures are greedy."""

from __future__ import annotations

import dataclasses

import pytest

from blockspec.config import SAMPLING_EPS, DraftConfig, RopeConfig, SamplingParams, TargetConfig
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from conftest import make_draft, make_target, tiny_target_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def test_configs_are_frozen():
    target = make_target()
    draft = make_draft(target, "deepspec", 4, markov_rank=4, confidence=True)
    values = [(target.config, "hidden_size", 64), (target.config.rope, "theta", 1.0),
              (draft.config, "block_size", 2), (SamplingParams(), "temperature", 1.0)]
    for value, name, new in values:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, new)
    assert dataclasses.replace(draft.config, block_size=2).num_drafts == 2
    assert draft.config.block_size == 4


def test_replace_validates_like_construction():
    cfg = tiny_target_config()
    with pytest.raises(BlockspecError, match="multiple of num_key_value_heads"):
        dataclasses.replace(cfg, num_key_value_heads=3)
    with pytest.raises(BlockspecError, match="head_dim must be even"):
        dataclasses.replace(cfg, head_dim=7)
    with pytest.raises(BlockspecError, match="model_type 'gpt2'"):
        dataclasses.replace(cfg, model_type="gpt2")
    with pytest.raises(BlockspecError, match="rope type 'proportional'"):
        RopeConfig(rope_type="proportional")
    with pytest.raises(BlockspecError, match="dynamic rope needs max_position_embeddings"):
        RopeConfig(rope_type="dynamic", factor=2.0)
    with pytest.raises(BlockspecError, match="sliding window needs the layers"):
        dataclasses.replace(cfg, attention_window=8)
    with pytest.raises(BlockspecError, match="rope_theta"):
        dataclasses.replace(cfg.rope, theta=0.0)
    draft_cfg = make_draft(make_target(), "zlab", 4).config
    with pytest.raises(BlockspecError, match="confidence_temperatures"):
        dataclasses.replace(draft_cfg, confidence_temperatures=[1.0])
    assert isinstance(draft_cfg, DraftConfig) and isinstance(cfg, TargetConfig)


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-6, SAMPLING_EPS / 2])
def test_tiny_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy is True and params.temperature == 0.0


def test_temperature_at_the_floor_samples():
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert SamplingParams(temperature=0.7).temperature == 0.7
    with pytest.raises(BlockspecError, match="temperature"):
        SamplingParams(temperature=-1e-39)


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_subnormal_temperature_decodes_like_greedy(method):
    """1e-39 used to overflow the logits to inf and the probabilities to NaN."""
    target = make_target()
    draft = None if method == "ar" else make_draft(target, "zlab", 4)
    outs = [generate(target, PROMPTS, SamplingParams(temperature=t, seed=3, max_new_tokens=12, ignore_eos=True),
                     draft=draft)
            for t in (0.0, 1e-39)]
    tokens = [[c.tokens for c in out.completions] for out in outs]
    assert tokens[0] == tokens[1] and all(len(t) == 12 for t in tokens[1])
