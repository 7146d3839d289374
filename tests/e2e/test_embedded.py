"""End-to-end checks on the shipped (embedded) models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from blockspec import SamplingParams, Tokenizer, embedded, generate, load_target


def test_embedded_target_matches_transformers():
    transformers = pytest.importorskip("transformers")
    path = embedded.default_target()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path)
    tok = Tokenizer(path)
    ids = torch.tensor([tok.encode("def fib(n):\n    if n < 2:\n        return n\n")])
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


def test_embedded_tokenizer_has_special_tokens():
    tok = Tokenizer(embedded.default_target())
    assert tok.vocab_size == 8192
    assert tok.eos_token_id is not None and tok.pad_token_id is not None and tok.mask_token_id is not None
    text = "def f(x):\n    return x ** 2  # ünïcode\n"
    assert tok.decode(tok.encode(text)) == text


def test_cli_generate_with_no_flags_from_any_directory(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", "generate", "def fib(n):", "--max-new-tokens", "24"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def fib(n):") and len(proc.stdout) > len("def fib(n):") + 10
    assert "tok/s" in proc.stderr


def test_cli_errors_are_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", "generate", "x", "--target", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_embedded_greedy_generation_is_deterministic():
    path = embedded.default_target()
    target, tok = load_target(path), Tokenizer(path)
    sp = SamplingParams(max_new_tokens=16)
    a = generate(target, [tok.encode("import os\n")], sp).completions[0].tokens
    b = generate(target, [tok.encode("import os\n")], sp).completions[0].tokens
    assert a == b and len(a) > 0
