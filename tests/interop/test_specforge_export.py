"""SpecForge's DSpark export loads with its heads (issue 17). The export (SpecForge main,
configs/qwen3-8b-dspark.json; specforge/export/to_hf.py = save_pretrained) names the
architecture DSparkDraftModel and nests the heads in `dflash_config`; its trainer labels
block slot k with anchor + k + 1, the DeepSpec layout. The files here are written locally in
that format from a blockspec draft's tensors (same module names)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from blockspec.config import DraftConfig, SamplingParams
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.interop import check_draft, tensor_shapes
from blockspec.models.checkpoint import load_draft, save_draft
from blockspec.models.draft import DraftModel
from conftest import make_draft, make_target


@pytest.fixture(scope="module")
def target():
    return make_target()


def specforge_export(tmp_path, draft: DraftModel, **nested_overrides) -> Path:
    """Write `draft` as SpecForge's HF export of a DSpark draft."""
    save_draft(draft, tmp_path / "ours")
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    cfg = draft.config
    nested = {"attention_mode": "gqa", "confidence_head_alpha": 1.0 if cfg.enable_confidence_head else 0.0,
              "confidence_head_with_markov": cfg.confidence_head_with_markov,
              "enable_confidence_head": cfg.enable_confidence_head, "markov_head_type": cfg.markov_head_type,
              "markov_rank": cfg.markov_rank, "mask_token_id": cfg.mask_token_id, "projector_type": "dspark",
              "target_layer_ids": cfg.target_layer_ids}
    nested.update(nested_overrides)
    nested = {k: v for k, v in nested.items() if v is not None}
    top = {k: v for k, v in ours.items() if k not in (
        "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type", "enable_confidence_head",
        "confidence_head_with_markov", "torch_dtype")}
    top.update(architectures=["DSparkDraftModel"], auto_map={"AutoModel": "dspark.DSparkDraftModel"},
               dflash_config=nested, dtype="bfloat16", use_cache=True, max_window_layers=cfg.num_hidden_layers,
               use_sliding_window=False, transformers_version="4.57.1")
    out = tmp_path / "specforge"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(top, indent=2))
    (out / "model.safetensors").write_bytes((tmp_path / "ours" / "model.safetensors").read_bytes())
    return out


@pytest.mark.parametrize("kind, with_markov", [("vanilla", True), ("gated", True), ("rnn", False)])
def test_specforge_dspark_export_loads_with_its_heads(tmp_path, target, kind, with_markov):
    draft = make_draft(target, "deepspec", 5, markov_rank=8, markov_type=kind, confidence=True)
    if not with_markov:
        draft = DraftModel(dataclasses.replace(draft.config, confidence_head_with_markov=False)).eval()
    loaded = load_draft(specforge_export(tmp_path, draft), target=target)
    cfg = loaded.config
    assert cfg.layout == "deepspec" and cfg.block_size == 5 and cfg.is_dspark
    assert (cfg.markov_rank, cfg.markov_head_type) == (8, kind)
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov is with_markov
    assert loaded.markov_head is not None and loaded.confidence_head is not None
    for (n1, a), (n2, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    assert (generate(target, [[1, 2, 3]], sp, draft=draft, method="dspark").completions[0].tokens
            == generate(target, [[1, 2, 3]], sp, draft=loaded, method="dspark").completions[0].tokens)


def test_specforge_defaults_for_omitted_head_keys(tmp_path, target):
    # SpecForge: enable_confidence_head defaults to confidence_head_alpha > 0,
    # confidence_head_with_markov to false (specforge/modeling/draft/dspark.py)
    draft = make_draft(target, "deepspec", 5, markov_rank=8, confidence=True)
    draft = DraftModel(dataclasses.replace(draft.config, confidence_head_with_markov=False)).eval()
    path = specforge_export(tmp_path, draft, enable_confidence_head=None, confidence_head_with_markov=None)
    cfg = load_draft(path, target=target).config
    assert cfg.enable_confidence_head and not cfg.confidence_head_with_markov


def test_a_head_key_given_twice_differently_is_refused(tmp_path, target):
    path = specforge_export(tmp_path, make_draft(target, "deepspec", 5, markov_rank=8))
    raw = json.loads((path / "config.json").read_text())
    raw["markov_rank"] = 4
    with pytest.raises(BlockspecError, match="markov_rank is 4 at top level but 8 in dflash_config"):
        DraftConfig.from_dict(raw)


def test_converted_export_is_deepspec_files_the_engines_read(tmp_path, target):
    draft = make_draft(target, "deepspec", 5, markov_rank=8, confidence=True)
    path = specforge_export(tmp_path, draft)
    save_draft(load_draft(path, target=target), tmp_path / "converted")
    raw = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["markov_rank"] == 8
    assert raw["confidence_head_with_markov"] is True and raw["mask_token_id"] == draft.config.mask_token_id
    # SpecForge's keys blockspec does not read are kept, nested as they came
    assert raw["dflash_config"] == {"attention_mode": "gqa", "confidence_head_alpha": 1.0, "projector_type": "dspark"}
    assert raw["auto_map"] == {"AutoModel": "dspark.DSparkDraftModel"}
    for engine in ("vllm", "sglang"):
        assert check_draft(raw, tensor_shapes(tmp_path / "converted"), engine).problems == []
    assert (load_draft(tmp_path / "converted", target=target).config.to_dict()
            == load_draft(path, target=target).config.to_dict())
