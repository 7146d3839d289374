"""benchmarks/gpu.sh: the GPU run rehearsed end to end on the CPU (--smoke), and the
one-line exit 2 where no CUDA GPU exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("**AR decode at batch 1**", "**Round costs, captured steps**",
            "**Engine throughput with SIMULATED acceptance**", "peak memory:")


def test_smoke_runs_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run(["bash", "benchmarks/gpu.sh", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert out.read_text().strip() == text.strip()          # the file record.py's output matches
    for section in SECTIONS:
        assert section in text
    assert "skipped" not in text
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \| [\d.]+", line)]
    # AR: 2 contexts; round costs: 2 contexts x 2 batches; engine: 2 concurrency levels
    assert len(rows) == 2 + 4 + 2
    ar = [r for r in rows if "of 12 tokens" in r]
    assert len(ar) == 2 and all("12 of 12 tokens" in r for r in ar)   # the twin really shares the weights
    engine = rows[-2:]
    assert all("(6.50)" in r for r in engine)                        # DFlash under the imposed tau


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_without_a_gpu_it_fails_fast_with_one_line():
    proc = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "CUDA GPU" in lines[0]
