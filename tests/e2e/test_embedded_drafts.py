"""The shipped drafts: they load against the shipped target in their own formats,
speculative greedy output equals AR greedy output on the real model, and they
actually get drafts accepted."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from blockspec import SamplingParams, Tokenizer, embedded, generate, load_draft, load_target
from blockspec import PolicyOptions
from blockspec.config import Eagle3Config, EagleTree
from blockspec.interop import launch_line
from blockspec.loading import load_drafts
from blockspec.models.checkpoint import load_eagle3, save_eagle3
from blockspec.serving.server import add_serve_arguments, build_engine

PROMPTS = ["def fib(n):", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def target64():
    return load_target(embedded.default_target(), dtype="float64")


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
def test_embedded_draft_is_lossless_and_useful(target64, method):
    draft = load_drafts(target64, {}, [method])[method]   # the embedded draft of each kind, float64 as the target
    expected_layout = {"dflash": "zlab", "dspark": "deepspec", "eagle3": "eagle3"}[method]
    assert draft.config.layout == expected_layout
    tok = Tokenizer(embedded.default_target())
    prompts = [tok.encode(p) for p in PROMPTS]
    sp = SamplingParams(max_new_tokens=48)
    ar = generate(target64, prompts, sp)
    spec = generate(target64, prompts, sp, draft=draft, method=method)
    assert [c.tokens for c in spec.completions] == [c.tokens for c in ar.completions]
    assert sum(sum(c.stats.accepted) for c in spec.completions) > 0  # drafts really get accepted


def test_embedded_eagle3_tree_is_lossless_and_accepts_more_than_its_chain(target64):
    """The shipped EAGLE-3 pair drafting SGLang's kind of tree (topk 4, 5 levels, 12 verified
    tokens): AR's greedy output, and more tokens per round than a chain of the same depth
    (5 drafts; a longer chain can out-accept a shallower tree once the draft is good enough)."""
    chain = load_drafts(target64, {}, ["eagle3"])["eagle3"].with_num_drafts(5)
    tok = Tokenizer(embedded.default_target())
    prompts = [tok.encode(p) for p in PROMPTS]
    sp, fixed = SamplingParams(max_new_tokens=48), PolicyOptions(adapt=False)
    ar = generate(target64, prompts, sp)
    by_chain = generate(target64, prompts, sp, draft=chain, policy=fixed)
    by_tree = generate(target64, prompts, sp, draft=chain.with_tree(EagleTree(4, 5, 12)), policy=fixed)
    assert [c.tokens for c in by_tree.completions] == [c.tokens for c in ar.completions]
    assert by_tree.tau > by_chain.tau


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
def test_cli_generate_uses_embedded_draft_by_default(tmp_path, method):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", "generate", "def fib(n):", "--method", method,
                           "--max-new-tokens", "32"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"[{method}]" in proc.stderr and "tau" in proc.stderr


def test_cli_profile_with_the_embedded_draft(tmp_path):
    """`blockspec profile --draft embedded`: verify times, draft round times, and the
    one-slot draft times that price DSpark's early-stopped rounds; the engine loads it."""
    import json

    from blockspec import Engine
    from blockspec.decoding.cost_table import CostTable

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", "profile", "--tokens", "1,4", "--repeats", "1",
                           "--rows", "2", "--context", "8", "--draft", "embedded", "--draft-rows", "1,2",
                           "--out", "t.json"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report["ms"]) == {"1", "4"} and set(report["draft_ms"]) == {"1", "2"}
    assert set(report["draft_ms_by_slots"]) == {"1", "2", "3", "4", "6", "8", "11"}   # shorter blocks, in drafts
    assert all(set(by_rows) == {"1", "2"} for by_rows in report["draft_ms_by_slots"].values())
    table = CostTable.load(tmp_path / "t.json")
    target = load_target(embedded.default_target())
    draft = load_draft(embedded.default_draft("dspark"), target=target)
    assert table.draft_window == draft.config.num_drafts
    engine = Engine(target, draft, "dspark", max_running=2, max_model_len=64,
                    policy=PolicyOptions(scheduled=True, cost_table=table))
    assert engine.metrics()["draft_gate"]


def test_serve_and_launch_line_default_to_the_embedded_eagle3_draft():
    """`serve --method eagle3` (and SGLang's spelling) pairs the embedded target with the embedded
    EAGLE-3 draft, chains of 7; its launch line names that directory."""
    args = argparse.ArgumentParser()
    add_serve_arguments(args)
    for flags in (["--method", "eagle3"], ["--speculative-algorithm", "EAGLE3"]):
        engine, _, _ = build_engine(args.parse_args(flags))
        assert engine.method == "eagle3" and engine.draft.config.num_drafts == 7
    line = launch_line(embedded.default_draft("eagle3"), "blockspec")
    assert line.argv[-2:] == ["--method", "eagle3"] and str(embedded.ASSETS / "eagle3") in line.argv


def test_embedded_eagle3_draft_round_trips_identically(tmp_path):
    """The shipped EAGLE-3 draft, loaded and saved again in bf16, is the same files' content:
    the same config and bit-identical tensors (d2t / t2d included), in the layout vLLM / SGLang
    read (LlamaForCausalLMEagle3 with both auxiliary-layer spellings)."""
    shipped = embedded.default_draft("eagle3")
    target = load_target(embedded.default_target())
    save_eagle3(load_eagle3(shipped, target=target), tmp_path / "again", dtype="bfloat16")
    assert Eagle3Config.load(tmp_path / "again") == Eagle3Config.load(shipped)
    raw = json.loads((shipped / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["torch_dtype"] == "bfloat16"
    aux = raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]   # SGLang's spelling: the layers' outputs
    assert aux == sorted(aux) and 0 <= aux[0] and aux[-1] < target.config.num_hidden_layers
    assert raw["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]   # vLLM's: the same layers' inputs
    with safe_open(shipped / "model.safetensors", "pt") as a, \
            safe_open(tmp_path / "again" / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys()) and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(a.keys())
        for key in a.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert x.dtype == y.dtype and torch.equal(x, y), key
