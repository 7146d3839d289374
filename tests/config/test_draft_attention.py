"""Sliding-window draft configs: every spelling vLLM / SGLang / transformers read, round trips
and one-line refusals (config/draft_attention.py, DraftConfig)."""

from __future__ import annotations

import dataclasses

import pytest

from blockspec.config import DraftConfig
from blockspec.errors import BlockspecError

F, S = "full_attention", "sliding_attention"


def zlab(**top) -> dict:
    raw = {"architectures": ["DFlashDraftModel"], "block_size": 4, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "vocab_size": 64, "num_target_layers": 4,
           "dflash_config": {"mask_token_id": 62, "target_layer_ids": [1, 2]}}
    nested = top.pop("dflash", {})
    raw.update(top)
    raw["dflash_config"].update(nested)
    return raw


@pytest.mark.parametrize("raw, types, window, causal", [
    (zlab(), (F, F, F), None, None),
    (zlab(layer_types=[F, S, S], sliding_window=64), (F, S, S), 64, None),          # transformers / SGLang
    (zlab(layer_types=[S, F, S], dflash={"swa_window_size": 32}), (S, F, S), 32, None),  # vLLM / DFlash
    (zlab(layer_types=[S, S, S], sliding_window=16, dflash={"swa_window_size": 16}), (S, S, S), 16, None),
    (zlab(dflash={"use_swa": True, "swa_window_size": 8}), (S, S, S), 8, None),   # vLLM / MiMo: all layers
    (zlab(use_sliding_window=True, sliding_window=8, max_window_layers=1), (F, S, S), 8, None),  # Qwen3Config
    (zlab(use_sliding_window=False, sliding_window=4096), (F, F, F), None, None),  # a window nobody uses
    (zlab(layer_types=[S, S, S], sliding_window=8, dflash={"causal": False}), (S, S, S), 8, False),
    (zlab(layer_types=[F, F, S], sliding_window=8, is_causal=True), (F, F, S), 8, True),
])
def test_every_spelling_reads_and_round_trips(raw, types, window, causal):
    cfg = DraftConfig.from_dict(raw)
    assert (cfg.layer_types, cfg.sliding_window, cfg.causal) == (types, window, causal)
    out = cfg.to_dict()
    assert DraftConfig.from_dict(out) == cfg
    assert out["layer_types"] == list(types) and out["sliding_window"] == window
    if window is not None:   # both engines' spellings, and transformers keeps the window
        assert out["use_sliding_window"] is True and out["dflash_config"]["swa_window_size"] == window
    else:
        assert "swa_window_size" not in out["dflash_config"] and "use_sliding_window" not in out


def test_deepspec_layout_round_trips_a_window():
    raw = zlab(layer_types=[S, S, F], sliding_window=128)
    cfg = dataclasses.replace(DraftConfig.from_dict(raw), layout="deepspec", markov_rank=4)
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg


def test_per_layer_window_and_causality():
    cfg = DraftConfig.from_dict(zlab(layer_types=[F, S, S], sliding_window=16))
    assert [cfg.layer_window(i) for i in range(3)] == [None, 16, 16]
    assert [cfg.layer_causal(i) for i in range(3)] == [False, True, True]   # the engines' default
    assert cfg.is_windowed
    non_causal = dataclasses.replace(cfg, causal=False)
    assert [non_causal.layer_causal(i) for i in range(3)] == [False, False, False]


@pytest.mark.parametrize("raw, message", [
    (zlab(layer_types=[S, S, S], sliding_window=0), "sliding_window.? must be a positive integer"),
    (zlab(layer_types=[S, S, S], sliding_window=-4), "sliding_window.? must be a positive integer"),
    (zlab(layer_types=[S, S, S], sliding_window=True), "sliding_window.? must be a positive integer"),
    (zlab(layer_types=[S, S, S], dflash={"swa_window_size": 0}), "swa_window_size.? must be a positive"),
    (zlab(layer_types=[S, S, S]), "need a window"),
    (zlab(layer_types=[F, "chunked_attention", S], sliding_window=8), "layer_types entries must be"),
    (zlab(layer_types=[F, S], sliding_window=8), "one entry per draft layer"),
    (zlab(layer_types=[S, S, S], sliding_window=8, dflash={"swa_window_size": 16}), "two different models"),
    (zlab(layer_types=[S, S, S], sliding_window=8, is_causal="yes"), "must be true or false"),
])
def test_bad_values_are_one_line_errors(raw, message):
    with pytest.raises(BlockspecError, match=message) as err:
        DraftConfig.from_dict(raw)
    assert "\n" not in str(err.value)


def test_constructed_configs_are_validated():
    cfg = DraftConfig.from_dict(zlab())
    with pytest.raises(BlockspecError, match="needs sliding_attention layers"):
        dataclasses.replace(cfg, sliding_window=8)
    with pytest.raises(BlockspecError, match="positive integer"):
        dataclasses.replace(cfg, layer_types=(S, S, S))
    with pytest.raises(BlockspecError, match="entries of"):
        dataclasses.replace(cfg, layer_types=(S,), sliding_window=8)
