"""The contract with vLLM's and SGLang's draft loaders (src/blockspec/interop_engines.json,
taken from vLLM 0.33.0 / SGLang 0.5.23): every layout x head type that `save_draft` writes is
checked, config keys and tensor names and shapes, against what each loader reads; a change in
the writer that would break an engine fails here. Mutations of a good checkpoint show the
checks catch each trap (issue 23)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from blockspec.config import DraftConfig
from blockspec.errors import BlockspecError
from blockspec.interop import (LOADERS, EngineCompatibilityWarning, check_draft, engine_source, engine_table,
                               tensor_shapes)
from blockspec.models.checkpoint import load_draft, save_draft
from blockspec.models.draft import DraftModel
from conftest import make_draft, make_target

# (layout, markov_rank, markov_head_type, confidence head, confidence_head_with_markov)
CASES = [
    ("zlab", 0, "vanilla", False, True),        # z-lab DFlash
    ("deepspec", 8, "vanilla", False, True),    # DSpark, Markov head only
    ("deepspec", 8, "gated", False, True),
    ("deepspec", 8, "rnn", False, True),
    ("deepspec", 8, "vanilla", True, True),     # confidence over [h; w1[prev]]
    ("deepspec", 8, "vanilla", True, False),    # confidence over h only
    ("deepspec", 8, "gated", True, True),
    ("deepspec", 8, "rnn", True, False),
    ("deepspec", 0, "vanilla", True, False),    # confidence head, no Markov head
    ("deepspec", 0, "vanilla", False, True),    # DeepSpec block, no heads
    ("zlab", 8, "vanilla", True, True),         # heads on a z-lab block (blockspec only)
]


def loads_in(engine: str, layout: str, rank: int, kind: str) -> bool:
    """What the engines' loaders accept (the facts of issue 23 / design.md section 10)."""
    if layout == "zlab":
        return rank == 0
    return rank > 0 and (kind == "vanilla" or engine == "sglang")


@pytest.fixture(scope="module")
def target():
    return make_target()


def build(target, layout, rank, kind, conf, with_markov) -> DraftModel:
    draft = make_draft(target, layout, 4, markov_rank=rank, markov_type=kind, confidence=conf)
    if not with_markov:  # a head over h only: rebuild with that config
        draft = DraftModel(dataclasses.replace(draft.config, confidence_head_with_markov=False)).eval()
    return draft


def saved(tmp_path, draft, **kw) -> tuple[dict, dict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_draft(draft, tmp_path / "d", **kw)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    engine_warnings = [str(w.message) for w in caught if issubclass(w.category, EngineCompatibilityWarning)]
    return raw, tensor_shapes(tmp_path / "d"), engine_warnings


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_saved_files_match_each_engine_loader(tmp_path, target, case):
    layout, rank, kind, conf, with_markov = case
    draft = build(target, *case)
    raw, tensors, engine_warnings = saved(tmp_path, draft, mask_token="<|mask|>")
    problems = []
    for engine in LOADERS:
        report = check_draft(raw, tensors, engine)
        assert (report.problems == []) == loads_in(engine, layout, rank, kind), (engine, report.problems)
        problems += report.problems
    # save_draft warned exactly for what an engine cannot load
    assert len(engine_warnings) == len(problems)
    assert all(any(p in w for w in engine_warnings) for p in problems)
    # and blockspec itself loads every case back unchanged
    again = load_draft(tmp_path / "d", target=target)
    assert again.config.to_dict() == dataclasses.replace(draft.config, mask_token="<|mask|>").to_dict()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_writer_always_writes_the_keys_engines_read(tmp_path, target, case):
    layout, rank, kind, conf, with_markov = case
    draft = build(target, *case)
    raw, tensors, _ = saved(tmp_path, draft, mask_token="<|mask|>")
    cfg = draft.config
    assert raw["block_size"] == cfg.block_size               # SGLang runs 16 without it
    # target_layer_ids are written as blockspec reads them: the engines' +1 is theirs to add
    ids = raw["target_layer_ids"] if layout == "deepspec" else raw["dflash_config"]["target_layer_ids"]
    assert ids == cfg.target_layer_ids
    assert "eagle_aux_hidden_state_layer_ids" not in raw    # would win over target_layer_ids in vLLM, no +1
    if layout == "zlab":
        assert raw["dflash_config"]["mask_token_id"] == cfg.mask_token_id
        assert raw["dflash_config"]["mask_token"] == "<|mask|>"
    else:
        assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["model_type"] == "qwen3"
        assert raw["mask_token_id"] == cfg.mask_token_id and raw["mask_token"] == "<|mask|>"
    if layout == "deepspec" or cfg.is_dspark:
        # vLLM defaults confidence_head_with_markov to false, SGLang to markov_rank > 0
        assert raw["confidence_head_with_markov"] is with_markov
        assert raw["markov_head_type"] == kind and raw["markov_rank"] == rank
        assert raw["enable_confidence_head"] is conf
    if conf:
        want = cfg.hidden_size + (rank if with_markov and rank else 0)
        assert tensors["confidence_head.proj.weight"] == (1, want)
    assert not any(name.startswith("model.") for name in tensors)  # vLLM prefixes every name itself


def test_no_mask_token_is_written_when_unknown(tmp_path, target):
    raw, _, _ = saved(tmp_path, make_draft(target, "zlab", 4))
    assert "mask_token" not in raw["dflash_config"] and "mask_token" not in raw


def mutate(tmp_path, target, change) -> tuple[dict, dict]:
    raw, tensors, _ = saved(tmp_path, build(target, "deepspec", 8, "vanilla", True, True))
    change(raw, tensors)
    return raw, tensors


def problems_of(raw, tensors, engine) -> str:
    return " | ".join(check_draft(raw, tensors, engine).problems)


def test_missing_confidence_with_markov_breaks_vllm_only(tmp_path, target):
    raw, tensors = mutate(tmp_path, target, lambda r, t: r.pop("confidence_head_with_markov"))
    assert "confidence_head.proj.weight with shape [1, 32]" in problems_of(raw, tensors, "vllm")
    assert problems_of(raw, tensors, "sglang") == ""  # SGLang's default is markov_rank > 0


def test_a_renamed_head_tensor_breaks_both(tmp_path, target):
    def rename(raw, tensors):
        tensors["markov_head.w1.weight"] = tensors.pop("markov_head.markov_w1.weight")
    raw, tensors = mutate(tmp_path, target, rename)
    for engine in LOADERS:
        text = problems_of(raw, tensors, engine)
        assert "lacks: markov_head.markov_w1.weight" in text and "markov_head.w1.weight" in text


def test_a_wrong_markov_shape_is_caught(tmp_path, target):
    raw, tensors = mutate(tmp_path, target, lambda r, t: t.update({"markov_head.markov_w2.weight": (8, 64)}))
    assert "markov_head.markov_w2.weight with shape [64, 8]" in problems_of(raw, tensors, "sglang")


@pytest.mark.parametrize("key, value, engines", [
    ("eagle_aux_hidden_state_layer_ids", [2, 3], ["vllm"]),
    ("architectures", ["DSparkDraftModel"], ["sglang"]),  # vLLM maps it (qwen3) to Qwen3DSparkModel
    ("layer_types", ["sliding_attention"], ["vllm", "sglang"]),
    ("markov_head_type", None, ["sglang"]),
    ("head_dim", None, ["vllm", "sglang"]),
])
def test_config_traps_are_caught(tmp_path, target, key, value, engines):
    def change(raw, tensors):
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    raw, tensors = mutate(tmp_path, target, change)
    if key == "layer_types":  # sliding layers without a window: blockspec refuses them too
        with pytest.raises(BlockspecError, match="need a window"):
            DraftConfig.from_dict(raw)
        return
    for engine in LOADERS:
        assert (problems_of(raw, tensors, engine) != "") == (engine in engines), engine


def test_window_rules_and_sources_are_recorded_with_versions():
    table = engine_table()
    assert table["formats"]["vllm"]["zlab"]["window"]["equals"] == "block_size - 1"
    assert table["formats"]["vllm"]["deepspec"]["window"]["equals"] == "block_size"
    assert table["formats"]["sglang"]["zlab"]["window"]["equals"] == "block_size"
    assert table["formats"]["sglang"]["deepspec"]["window"]["equals"] == "block_size + 1"
    for engine in LOADERS:
        assert engine_source(engine) in ("vllm 0.33.0", "sglang 0.5.23")
        files = table["engines"][engine]["files"]
        assert files and all(f["path"] and len(f["commit"]) == 40 for f in files)
        for fmt in table["formats"][engine].values():
            assert fmt["source"].startswith(engine_source(engine) + " ")
            # every source file a format cites is one of the engine's recorded files
            cited = [p.strip() for p in fmt["source"].split(" ", 2)[2].split(",")]
            assert set(cited) <= {f["path"] for f in files}


@pytest.mark.parametrize("types, causal, broken_in", [
    (("sliding_attention",), None, []),                                  # the engines' own reading
    (("sliding_attention",), False, ["sglang"]),                         # SGLang ignores dflash_config.causal
])
def test_a_windowed_zlab_draft_is_what_both_engines_read(tmp_path, target, types, causal, broken_in):
    draft = make_draft(target, "zlab", 4)
    draft = DraftModel(dataclasses.replace(draft.config, layer_types=types, sliding_window=8, causal=causal)).eval()
    raw, tensors, _ = saved(tmp_path, draft)
    assert raw["use_sliding_window"] is True and raw["sliding_window"] == 8
    assert raw["dflash_config"]["swa_window_size"] == 8 and raw["layer_types"] == list(types)
    for engine in LOADERS:
        assert (problems_of(raw, tensors, engine) != "") == (engine in broken_in), engine
    raw.pop("use_sliding_window")   # transformers would drop the window: both engines fail to load it
    for engine in LOADERS:
        assert "use_sliding_window" in problems_of(raw, tensors, engine)
