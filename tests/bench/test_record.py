"""benchmarks/record.py: a bench's plots, linked relative to its --out folder, still show in
docs/results.md once its printed results.md is appended there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("record", REPO / "benchmarks" / "record.py")
record = importlib.util.module_from_spec(spec)
spec.loader.exec_module(record)


def test_plot_links_are_made_relative_to_the_results_file(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "RESULTS", tmp_path / "docs" / "results.md")
    out = tmp_path / "docs" / "bench" / "run1"
    out.mkdir(parents=True)
    (out / "a_plot.png").write_bytes(b"png")
    text = "| x |\n![a_plot](a_plot.png)\n![gone](missing.png)\n![elsewhere](other/b.png)"
    cmd = ["blockspec", "bench", "--out", str(out), "--no-progress"]
    assert record.relink(text, cmd) == ("| x |\n![a_plot](bench/run1/a_plot.png)\n![gone](missing.png)\n"
                                         "![elsewhere](other/b.png)")
    assert record.relink(text, ["python", "benchmarks/round_cost.py"]) == text   # no --out: as printed
    scratch = tmp_path / "runs" / "bench"   # outside docs/: not committed, left as printed
    scratch.mkdir(parents=True)
    (scratch / "a_plot.png").write_bytes(b"png")
    assert record.relink(text, ["blockspec", "bench", "--out", str(scratch)]) == text
