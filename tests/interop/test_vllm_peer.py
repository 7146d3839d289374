"""Our drafts in the real vLLM (its CPU build in .venv-vllm, `make vllm-peer`; skipped without it):
the same token-id prompts give the same greedy tokens in both engines, vLLM's DFlash output equals
its AR output, and vLLM's per-position acceptance equals blockspec's once vLLM's context-K norm
runs per layer (its CPU kernel reads a stacked [layers, head_dim] weight as layer 0's: issue 29,
docs/results.md). On the shipped DFlash draft and on a 2-layer draft trained here; and sliding-window
drafts (issue 34): vLLM's CPU attention honours the window as blockspec does (the same tokens, the
same acceptance position by position, where one position more or less in the window changes it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockspec import PolicyOptions, SamplingParams, generate, load_draft, load_target
from blockspec.bench.context import save_windowed_copy
from blockspec.bench.datasets import humaneval
from blockspec.models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "src" / "blockspec" / "assets"
VLLM_PYTHON = Path(os.environ.get("BLOCKSPEC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
NEW_TOKENS = 32

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make vllm-peer)")]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = Tokenizer(ASSETS / "target")
    return [tok.encode(p.text) for p in humaneval()[1::16][:6]]


def vllm_run(tmp: Path, draft: Path, method: str, prompts: list[list[int]], patch: bool) -> dict:
    """One cell of benchmarks/vllm_peer_worker.py (every prompt in one batch): its tokens,
    seconds and spec-decode counters."""
    block = json.loads((draft / "config.json").read_text())["block_size"]
    job = {"target": str(ASSETS / "target"), "draft": str(draft), "window": block - 1, "prompts": prompts,
           "max_new_tokens": NEW_TOKENS, "dtype": "float32", "method": method, "max_batch": len(prompts),
           "patch_rmsnorm": patch}
    (tmp / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_peer_worker.py"), str(tmp / "job.json")],
                          input=json.dumps({"batch": len(prompts)}) + "\n", capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ready, answer = proc.stdout.splitlines()
    assert "ready" in json.loads(ready)
    return json.loads(answer)


def blockspec_run(draft_dir: Path | None, prompts: list[list[int]]) -> tuple[list[list[int]], list[int], int]:
    """(tokens, accepted drafts per position, drafting rounds), fixed full windows as vLLM drafts."""
    target = load_target(ASSETS / "target")
    draft = load_draft(draft_dir, target=target) if draft_dir else None
    out = generate(target, prompts, SamplingParams(max_new_tokens=NEW_TOKENS), draft=draft,
                   method="dflash" if draft else "ar", policy=PolicyOptions(adapt=False))
    per_pos = [0] * (draft.config.num_drafts if draft else 0)
    for c in out.completions:
        for accepted in c.stats.accepted:
            for k in range(accepted):
                per_pos[k] += 1
    return [list(c.tokens) for c in out.completions], per_pos, sum(c.stats.rounds for c in out.completions)


def train_draft(root: Path, prompts: list[list[int]], *flags: str) -> Path:
    """A DFlash draft trained here for a few steps on the target's own continuations."""
    ar, _, _ = blockspec_run(None, prompts)
    with open(root / "data.jsonl", "w") as f:
        for p, t in zip(prompts, ar):
            f.write(json.dumps({"prompt_ids": p, "response_ids": t}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", "train", "--method", "dflash", "--data",
                           str(root / "data.jsonl"), "--out", str(root / "run"), "--block-size", "8", "--max-steps",
                           "4", "--batch-size", "2", "--max-len", "256", "--eval-every", "1000", "--save-every", "1000",
                           "--init-from-target", *flags], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run" / "draft"


@pytest.fixture(scope="module")
def trained_draft(tmp_path_factory, prompts) -> Path:
    """2 layers: their k_norm weights differ, which is what vLLM's CPU norm gets wrong."""
    return train_draft(tmp_path_factory.mktemp("vllm_draft"), prompts, "--num-layers", "2")


@pytest.mark.parametrize("which", ["shipped", "trained"])
def test_vllm_runs_our_draft_as_blockspec_does(tmp_path, prompts, trained_draft, which):
    draft = ASSETS / "dflash" if which == "shipped" else trained_draft
    ar, _, _ = blockspec_run(None, prompts)
    ours, per_pos, rounds = blockspec_run(draft, prompts)
    assert ours == ar
    assert vllm_run(tmp_path, draft, "ar", prompts, patch=False)["tokens"] == ar
    as_installed = vllm_run(tmp_path, draft, "dflash", prompts, patch=False)
    assert as_installed["tokens"] == ar   # lossless either way: only acceptance depends on the draft
    fixed = vllm_run(tmp_path, draft, "dflash", prompts, patch=True)
    assert fixed["tokens"] == ar
    counters = fixed["counters"]
    assert counters["num_drafts"] == rounds and counters["accepted_per_pos"] == per_pos


WINDOWS = (32, 24, 16, 40, 12)   # the prompts are 83..293 tokens: each window cuts every round's context


def window_acceptance(root: Path, window: int, prompts: list[list[int]]) -> tuple[list[int], int]:
    """(accepted drafts per position, rounds) of the shipped draft with this window, in blockspec."""
    return tuple(blockspec_run(save_windowed_copy(ASSETS / "dflash", window, root / f"w{window}"), prompts)[1:])


def pinning_window(root: Path, prompts: list[list[int]]) -> Path:
    """The shipped draft saved with the first of WINDOWS whose acceptance in blockspec differs
    from a window one position narrower, one wider and none: an equal acceptance in vLLM then
    pins its window to the same positions (which window does so depends on the shipped draft)."""
    unwindowed = tuple(blockspec_run(ASSETS / "dflash", prompts)[1:])
    for window in WINDOWS:
        around = [window_acceptance(root, w, prompts) for w in (window - 1, window, window + 1)]
        if around[1] not in (around[0], around[2], unwindowed):
            return root / f"w{window}"
    pytest.fail(f"no window of {WINDOWS} changes the shipped draft's acceptance against its neighbours")


@pytest.mark.parametrize("which", ["shipped, every layer sliding", "trained, one sliding layer"])
def test_vllm_runs_our_windowed_draft_as_blockspec_does(tmp_path, prompts, which):
    """The shipped draft with a sliding window (non-causal blocks, as trained; several layers, so
    with the norm fix) and a 1-layer draft trained here with --draft-sliding-window 16 (causal,
    the engines' default for sliding layers): vLLM's greedy tokens are the target's and its
    acceptance is blockspec's, per position. For the shipped one the window is one where a window
    one position wider or narrower, or none, changes blockspec's acceptance, so the equality pins
    vLLM's window to the same positions (q - W < j)."""
    assert min(len(p) for p in prompts) > max(WINDOWS)
    ar, _, _ = blockspec_run(None, prompts)
    if which.startswith("shipped"):
        draft, patch = pinning_window(tmp_path, prompts), True
    else:
        draft, patch = train_draft(tmp_path, prompts, "--num-layers", "1", "--draft-sliding-window", "16"), False
        assert json.loads((draft / "config.json").read_text())["layer_types"] == ["sliding_attention"]
    ours, per_pos, rounds = blockspec_run(draft, prompts)
    assert ours == ar
    result = vllm_run(tmp_path, draft, "dflash", prompts, patch=patch)
    assert result["tokens"] == ar
    counters = result["counters"]   # tau = 1 + accepted / drafts, as vllm_peer reports it
    assert counters["num_drafts"] == rounds and counters["accepted_per_pos"] == per_pos
    assert counters["num_accepted_tokens"] == sum(per_pos)
