"""benchmarks/gpu.sh: the GPU run rehearsed end to end on the CPU (--smoke), and the
one-line exit 2 where no CUDA GPU exists."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHON": sys.executable}   # the interpreter running the tests, whatever PATH holds
SECTIONS = ("**Round costs, captured steps**", "**Engine throughput with SIMULATED acceptance**", "**AR decode**",
            "peak memory:")


def test_smoke_runs_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run(["bash", "benchmarks/gpu.sh", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert out.read_text().strip() == text.strip()          # the file record.py's output matches
    assert [text.index(section) for section in SECTIONS] == sorted(text.index(section) for section in SECTIONS)
    assert "skipped" not in text and "failed" not in text
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \| [\d.]+", line)]
    # round costs: 2 contexts x 2 batches; engine: 2 concurrency levels; AR: 2 cells
    assert len(rows) == 4 + 2 + 2
    ar = [r for r in rows if "of 12 tokens" in r]
    assert len(ar) == 2 and all("12 of 12 tokens" in r for r in ar)   # the twin really shares the weights
    engine = rows[4:6]
    assert all("(6.50)" in r for r in engine)                        # DFlash under the imposed tau
    # every section reports its time against its budget
    assert all(f"{name}: " in text and "budget" in text for name in ("round costs", "engine", "AR decode"))


def test_a_failing_section_is_reported_and_the_run_goes_on(monkeypatch, capsys):
    """First contact with new hardware: one section's exception becomes one Markdown line, the
    section's budget is its share of the global one, and the next section runs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_bench
    finally:
        sys.path.pop(0)
    report = gpu_bench.Report(None, 165.0, torch.device("cpu"))   # half the default: half of every share
    ran = []
    with report.section("round costs"):
        assert report.time_left()
        assert report.section_end - report.t0 == pytest.approx(gpu_bench.SECTION_BUDGETS_S["round costs"] / 2,
                                                               abs=1.0)
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    with report.section("engine"):
        ran.append("engine")
    assert ran == ["engine"] and report.section_end == float("inf")
    failed = [line for line in report.lines if "failed" in line]
    assert failed == ["**round costs failed** after 0s: `RuntimeError: CUDA error: an illegal memory access was "
                      "encountered`"]
    assert len(report.section_notes) == 2 and "Traceback" in capsys.readouterr().err


def test_the_global_deadline_leaves_partial_results(tmp_path):
    """gpu.sh's `timeout` sends SIGTERM: the report says it was stopped, and what was measured stays in --out."""
    out = tmp_path / "gpu.md"
    proc = subprocess.Popen(["bash", "benchmarks/gpu.sh", "--smoke", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 480   # a busy 2-core machine takes minutes to reach the first section
    while proc.poll() is None and time.monotonic() < deadline and not (out.exists()
                                                                       and "**Round costs" in out.read_text()):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)   # exec'd: the Python process itself, as timeout would signal it
    proc.communicate(timeout=120)
    assert proc.returncode == 3
    text = out.read_text()
    assert "**Round costs, captured steps**" in text and "**stopped by the global deadline**" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_without_a_gpu_it_fails_fast_with_one_line():
    proc = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "CUDA GPU" in lines[0]
