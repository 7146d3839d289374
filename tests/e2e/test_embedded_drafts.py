"""The shipped drafts: they load against the shipped target in their own formats,
speculative greedy output equals AR greedy output on the real model, and they
actually get drafts accepted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from blockspec import SamplingParams, Tokenizer, embedded, generate, load_draft, load_target

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
