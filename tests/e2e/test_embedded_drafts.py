"""The shipped drafts: they load against the shipped target in their own formats,
speculative greedy output equals AR greedy output on the real model, and they
actually get drafts accepted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from blockspec import SamplingParams, Tokenizer, embedded, generate, load_draft, load_target
from blockspec import PolicyOptions

PROMPTS = ["def fib(n):", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def target64():
    return load_target(embedded.default_target(), dtype="float64")


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_embedded_draft_is_lossless_and_useful(target64, method):
    draft = load_draft(embedded.default_draft(method), dtype="float64", target=target64)
    expected_layout = "zlab" if method == "dflash" else "deepspec"
    assert draft.config.layout == expected_layout
    tok = Tokenizer(embedded.default_target())
    prompts = [tok.encode(p) for p in PROMPTS]
    sp = SamplingParams(max_new_tokens=48)
    ar = generate(target64, prompts, sp)
    spec = generate(target64, prompts, sp, draft=draft, method=method)
    assert [c.tokens for c in spec.completions] == [c.tokens for c in ar.completions]
    assert sum(sum(c.stats.accepted) for c in spec.completions) > 0  # drafts really get accepted


@pytest.mark.parametrize("method", ["dflash", "dspark"])
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
