"""recipes/ship_drafts.py: a RECIPE.md written from the runs' own records, including a second
stage that continued the draft already shipped (whose first stage's run directory is gone)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ship_drafts", REPO / "recipes" / "ship_drafts.py")
ship_drafts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ship_drafts)


def fake_run(run: Path, init_from: str | None, lr: float, taus: list[float]) -> Path:
    """A finished `blockspec train --method eagle3` run as ship_drafts reads it."""
    (run / "draft").mkdir(parents=True)
    (run / "draft" / "config.json").write_text(json.dumps({
        "num_hidden_layers": 1, "draft_vocab_size": 32, "vocab_size": 64,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}))
    (run / "draft" / "model.safetensors").write_bytes(b"weights of " + run.name.encode())
    (run / "train_config.json").write_text(json.dumps({
        "method": "eagle3", "init_from": init_from, "device": "cpu", "lr": lr, "seed": 0, "ttt_steps": 7,
        "eval_examples": 16, "eval_new_tokens": 64}))
    rows = [{"step": 10 * (i + 1), "loss": 3.0 - i, "time_s": 5.0 * (i + 1), "eval": {"tau": tau}}
            for i, tau in enumerate(taus)]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_a_stage_continuing_the_shipped_draft_keeps_its_recorded_stage(tmp_path):
    assets, runs = tmp_path / "assets", tmp_path / "runs"
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n" * 7)
    ship_drafts.ship(fake_run(runs / "eagle3", None, 1e-3, [1.5, 2.1]), "eagle3", data, assets=assets)
    first = (assets / "eagle3" / "RECIPE.md").read_text()
    assert "Trained in 1 stage(s)" in first and "| eagle3 | cpu | random init | 20 |" in first

    # The first run's directory is gone; the second stage continued the shipped copy.
    second = fake_run(runs / "eagle3b", str(assets / "eagle3"), 5e-4, [2.2, 2.4])
    (runs / "eagle3").rename(tmp_path / "gone")
    ship_drafts.ship(second, "eagle3", data, history="two stages", assets=assets)
    text = (assets / "eagle3" / "RECIPE.md").read_text()
    assert "Trained in 2 stage(s)" in text
    table = text.split(ship_drafts.STAGE_HEADER, 1)[1].split("\n\n", 1)[0].splitlines()
    assert table[1].startswith("| eagle3 | cpu | random init | 20 | 10.0 | 0.001 |")
    assert table[2].startswith(f"| eagle3b | cpu | `{assets / 'eagle3'}` | 20 | 10.0 | 0.0005 |")
    assert "- eagle3: 10: 1.500, 20: 2.100\n- eagle3b: 10: 2.200, 20: 2.400" in text
    configs = text.split("## Exact training configs", 1)[1]
    assert configs.index("eagle3:\n```json") < configs.index("eagle3b:\n```json")
    assert (assets / "eagle3" / "model.safetensors").read_bytes() == b"weights of eagle3b"
    assert not (assets / ".eagle3.new").exists()
    # Shipping the same run again would record its stage twice: refused, the shipped draft kept.
    with pytest.raises(SystemExit, match="already records eagle3b"):
        ship_drafts.ship(second, "eagle3", data, assets=assets)
    assert (assets / "eagle3" / "RECIPE.md").read_text() == text and not (assets / ".eagle3.new").exists()


def test_a_shipped_recipe_without_its_records_is_refused(tmp_path):
    shipped = tmp_path / "assets" / "eagle3"
    shipped.mkdir(parents=True)
    (shipped / "RECIPE.md").write_text("# hand-written, no stage table\n")
    with pytest.raises(SystemExit, match="no stage table"):
        ship_drafts.shipped_record(str(shipped))
    assert ship_drafts.shipped_record(None) == {"rows": [], "curves": [], "configs": []}


def test_summary_prints_each_stages_table_and_tau_curve(tmp_path, monkeypatch, capsys):
    """`--summary RUN`: the stage table and the held-out tau at every evaluation, per run (what
    a record of an unshipped run, or of two runs side by side, reads)."""
    first = fake_run(tmp_path / "runs" / "eagle3", None, 1e-3, [1.5, 2.1])
    fake_run(tmp_path / "runs" / "eagle3b", str(first / "draft"), 5e-4, [2.2, 2.4])
    monkeypatch.setattr("sys.argv", ["ship_drafts.py", "--summary", str(tmp_path / "runs" / "eagle3b")])
    ship_drafts.main()
    out = capsys.readouterr().out
    assert "| eagle3b | cpu |" in out and "Held-out greedy tau by step:" in out
    assert "- eagle3b: 10: 2.200, 20: 2.400" in out


def test_a_run_continuing_committed_campaign_stages_records_every_stage(tmp_path):
    """A run started from a committed campaign draft (`recipes/campaign/PAIR/NAME`, weights, log and
    config) traces back through those stages, names them by pair, and points to the campaign's README."""
    campaign = tmp_path / "recipes" / "campaign" / "pair9"
    first = fake_run(campaign / "eagle3", None, 1e-3, [1.5, 2.1])
    second = fake_run(campaign / "eagle3_b", str(first), 5e-4, [2.2, 2.4])
    last = fake_run(tmp_path / "runs" / "pair9" / "eagle3c", str(second), 3e-4, [2.5, 2.6])
    assert ship_drafts.stages(last) == [first, second, last]
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n" * 5)
    ship_drafts.ship(last, "eagle3", data, assets=tmp_path / "assets")
    text = (tmp_path / "assets" / "eagle3" / "RECIPE.md").read_text()
    assert "Trained in 3 stage(s)" in text
    table = text.split(ship_drafts.STAGE_HEADER, 1)[1].split("\n\n", 1)[0].splitlines()
    assert [row.split(" | ")[0] for row in table[1:]] == ["| pair9/eagle3", "| pair9/eagle3_b", "| eagle3c"]
    assert "- pair9/eagle3: 10: 1.500, 20: 2.100\n- pair9/eagle3_b: 10: 2.200, 20: 2.400\n- eagle3c:" in text
    assert f"`{campaign}/README.md`" in text and "recipes/train_drafts.sh" not in text
