"""recipes/ship_target.py: the checkpoint's files copied and a RECIPE.md written from the run's own
records, the validation curve merged from a campaign's history and the branch's log."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ship_target", REPO / "recipes" / "ship_target.py")
ship_target = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ship_target)


def fake_run(tmp: Path) -> Path:
    """A finished decay branch (best/ and log.jsonl) as ship_target reads it."""
    run = tmp / "decay"
    (run / "best").mkdir(parents=True)
    for name in ship_target.FILES:
        (run / "best" / name).write_text(f"bytes of {name}")
    config = {"num_layers": 12, "hidden_size": 384, "seed": 35, "schedule": "wsd"}
    (run / "best" / "train_info.json").write_text(json.dumps({
        "step": 30, "tokens": 3000, "val_loss": 2.3, "val_stdlib_loss": 2.4, "val_ppl": 9.97,
        "train_time_s": 12.5, "params": 1000, "config": config}))
    rows = [{"step": 25, "loss": 2.0}, {"step": 25, "val_loss": 2.5}, {"step": 30, "val_loss": 2.3}]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


MANIFEST = {"source": "the stdlib and 2 distributions", "sha256": "ab" * 32,
            "files": {"train": 90, "val": 10}, "bytes": {"train": 9000, "val": 1000},
            "dropped": {"test": 3, "near_duplicate": 1}, "val_percent": 2, "val_package_percent": 6,
            "max_file_bytes": 400000, "near_duplicate_jaccard": 0.8,
            "packages": [{"name": "python-stdlib", "license": "PSF-2.0"}, {"name": "numpy", "license": "BSD-3-Clause"}]}


def test_the_recipe_merges_the_campaigns_curve_and_describes_the_corpus(tmp_path, monkeypatch):
    run = fake_run(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "manifest.json").write_text(json.dumps(MANIFEST))
    state = tmp_path / "state"
    state.mkdir()
    (state / "meta.json").write_text(json.dumps({"history": [[10, 3.1, 3.3], [20, 2.7, 2.9]]}))
    earlier = tmp_path / "main_log.jsonl"   # the main run's log: a later point of the same curve
    earlier.write_text(json.dumps({"step": 20, "val_loss": 2.65}) + "\n" + json.dumps({"step": 5, "loss": 4}) + "\n")
    dest = tmp_path / "assets" / "target"
    monkeypatch.setattr(ship_target, "DEST", dest)
    monkeypatch.setattr("sys.argv", ["ship_target.py", "--run", str(run), "--corpus", str(tmp_path / "corpus"),
                                     "--earlier", str(state / "meta.json"), str(earlier), "--history", "Two runs."])
    ship_target.main()
    assert all((dest / name).read_text() == f"bytes of {name}" for name in ship_target.FILES)
    text = (dest / "RECIPE.md").read_text()
    assert "| 10 | 3.1000 |\n| 20 | 2.6500 |\n| 25 | 2.5000 |\n| 30 | 2.3000 |" in text   # later sources win
    assert "| standard-library validation loss | 2.4000 |" in text and "12 layers x\n384 hidden" in text
    assert "6% of the packages whole" in text and "3 test, 1 near duplicate" in text
    assert "licences: BSD-3-Clause, PSF-2.0" in text and "Two runs." in text
