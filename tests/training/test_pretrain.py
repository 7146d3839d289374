"""Pretraining survives interruption: stopping and continuing gives the same schedule position,
data order and weights; a committed snapshot (bf16, no optimizer) resumes with a re-warmed lr;
`precision="auto"` times both precisions and takes the faster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from blockspec.errors import BlockspecError
from blockspec.models.weights import read_tensors
from blockspec.training import pretrain as pt
from blockspec.training.corpus import STDLIB

TOKENIZER = Path(pt.__file__).resolve().parents[1] / "assets" / "target"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    code = [f"def f{i}(x, y):\n    return x * {i} + y - {i % 7}\n\n" * 12 for i in range(30)]
    with open(root / "train.jsonl", "w") as f:
        for i, text in enumerate(code[:24]):
            f.write(json.dumps({"path": f"m{i}.py", "package": "lib", "text": text}) + "\n")
    with open(root / "val.jsonl", "w") as f:
        for i, text in enumerate(code[24:]):
            f.write(json.dumps({"path": f"v{i}.py", "package": STDLIB if i % 2 else "held", "text": text}) + "\n")
    (root / "manifest.json").write_text(json.dumps({"sha256": "abc"}))
    return root


def config(corpus: Path, out: Path, **kw) -> pt.PretrainConfig:
    base = dict(corpus=str(corpus), tokenizer=str(TOKENIZER), out=str(out), hidden_size=32, num_layers=2,
                num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=64,
                seq_len=32, batch_size=2, lr=1e-3, schedule="wsd", warmup_steps=2, decay_steps=2, max_steps=6,
                eval_every=2, eval_batches=2, threads=1, device="cpu")
    return pt.PretrainConfig(**{**base, **kw})


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in open(out / "log.jsonl")]


def test_wsd_schedule_warms_holds_and_decays():
    cfg = pt.PretrainConfig(schedule="wsd", lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, decay_steps=20,
                            max_steps=100)
    assert pt.lr_at(0, cfg) == pytest.approx(1e-4) and pt.lr_at(9, cfg) == pytest.approx(1e-3)
    assert pt.lr_at(10, cfg) == pt.lr_at(79, cfg) == pytest.approx(1e-3)   # stable: restarts are harmless
    assert pt.lr_at(90, cfg) == pytest.approx(0.55e-3) and pt.lr_at(100, cfg) == pytest.approx(1e-4)
    assert pt.lr_at(50, cfg, rewarm_from=50) == pytest.approx(1e-3 / (cfg.rewarm_steps + 1))
    assert pt.lr_at(50 + cfg.rewarm_steps, cfg, rewarm_from=50) == pytest.approx(1e-3)


def test_the_data_position_is_the_step():
    stream = torch.arange(10_000, dtype=torch.int32)
    cfg = pt.PretrainConfig(seq_len=16, batch_size=3)
    assert torch.equal(pt.step_batch(stream, cfg, 7, 0), pt.step_batch(stream, cfg, 7, 0))
    assert not torch.equal(pt.step_batch(stream, cfg, 7, 0), pt.step_batch(stream, cfg, 8, 0))


def test_stop_and_continue_equals_one_run(corpus, tmp_path):
    whole = pt.pretrain(config(corpus, tmp_path / "whole"))
    pt.pretrain(config(corpus, tmp_path / "split", stop_at_step=3))  # "interrupted" after 3 steps (no eval)
    split = pt.pretrain(config(corpus, tmp_path / "split"))          # the same command again
    assert split["steps"] == whole["steps"] == 6
    a, b = log(tmp_path / "whole"), log(tmp_path / "split")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [(r["lr"], r["loss"]) for r in a] == [(r["lr"], r["loss"]) for r in b]
    wa, wb = read_tensors(tmp_path / "whole" / "state", "a"), read_tensors(tmp_path / "split" / "state", "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    meta = json.loads((tmp_path / "whole" / "state" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["corpus_sha256"] == "abc" and len(meta["history"][0]) == 3
    assert {"val_loss", "val_stdlib_loss"} <= set(a[-1])
    assert (tmp_path / "whole" / "best" / "config.json").is_file()


def test_snapshot_resumes_without_optimizer_and_rewarms(corpus, tmp_path):
    pt.pretrain(config(corpus, tmp_path / "a", max_steps=4))
    snap = tmp_path / "campaign"
    pt.snapshot_state(tmp_path / "a" / "state", snap)
    assert not (snap / "optimizer.safetensors").exists()
    assert {v.dtype for v in read_tensors(snap, "snap").values()} == {torch.bfloat16}
    pt.pretrain(config(corpus, tmp_path / "b", resume_from=str(snap), rewarm_steps=2))
    records = log(tmp_path / "b")
    assert [r["step"] for r in records] == [5, 6]       # continued at the snapshot's step
    full = config(corpus, tmp_path / "x")
    assert records[0]["lr"] == pytest.approx(pt.lr_at(4, full) / 3)   # re-warming from zero state
    meta = json.loads((tmp_path / "b" / "state" / "meta.json").read_text())
    assert any("without optimizer state" in e["event"] for e in meta["events"])


def test_changed_corpus_is_recorded(corpus, tmp_path):
    pt.pretrain(config(corpus, tmp_path / "a", max_steps=2))
    meta_file = tmp_path / "a" / "state" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["corpus_sha256"] = "old"
    meta_file.write_text(json.dumps(meta))
    pt.pretrain(config(corpus, tmp_path / "a", max_steps=4))
    events = json.loads(meta_file.read_text())["events"]
    assert any("corpus changed: old -> abc" in e["event"] for e in events)


def test_resume_refuses_a_state_of_another_shape(corpus, tmp_path):
    pt.pretrain(config(corpus, tmp_path / "a", max_steps=2))
    with pytest.raises(BlockspecError, match="does not fit this model"):
        pt.pretrain(config(corpus, tmp_path / "b", resume_from=str(tmp_path / "a" / "state"), hidden_size=48,
                           head_dim=24))
    (tmp_path / "a" / "state" / "meta.json").write_text('{"step": "two"}')
    with pytest.raises(BlockspecError, match="not a pretraining state"):
        pt.pretrain(config(corpus, tmp_path / "a", max_steps=4))


def probe_with_step_costs(monkeypatch, corpus, tmp_path, seconds: dict[bool, float]) -> tuple[bool, dict, dict]:
    """choose_precision with training steps that only take `seconds[bf16]` (this machine's real
    bf16 speed would decide otherwise: without native bf16 GEMMs it is ~10x slower)."""
    calls = {True: 0, False: 0}

    def fake_step(model, opt, stream, cfg, step, device, bf16):
        calls[bf16] += 1
        time.sleep(seconds[bf16])
        return 0.0, 0.0

    monkeypatch.setattr(pt, "train_step", fake_step)
    cfg = config(corpus, tmp_path, precision="auto")
    model = pt.build_model(cfg, pt.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")))
    stream = torch.arange(200, dtype=torch.int32)
    bf16, speeds = pt.choose_precision(model, stream, cfg, torch.device("cpu"))
    return bf16, speeds, calls


@pytest.mark.parametrize("slow", ["float32", "bfloat16"])
def test_auto_precision_takes_the_faster(corpus, tmp_path, monkeypatch, slow):
    bf16, speeds, _ = probe_with_step_costs(monkeypatch, corpus, tmp_path,
                                            {slow == "bfloat16": 0.06, slow != "bfloat16": 0.01})
    assert set(speeds) == {"float32", "bfloat16"} and bf16 == (slow == "float32")


def test_auto_precision_stops_timing_bf16_once_it_has_lost(corpus, tmp_path, monkeypatch):
    """A CPU without native bf16 GEMMs: bf16 steps 10x slower stop after two timed steps, once
    they have used float32's whole probe time."""
    bf16, speeds, calls = probe_with_step_costs(monkeypatch, corpus, tmp_path, {True: 0.2, False: 0.02})
    assert not bf16 and speeds["bfloat16"] < speeds["float32"]
    assert calls == {False: 4, True: 3}   # warm-up + 3 timed steps; warm-up + 2


def test_a_pause_during_one_probe_step_does_not_pick_the_precision(corpus, tmp_path, monkeypatch):
    """Each precision is timed by its fastest step: a pause (SIGSTOP) or a busy spell in one
    step picked float32 at 148 tokens/s where bf16 runs 2.4x float32 on that CPU."""
    costs = iter([0.02, 0.02, 0.02, 0.02, 0.01, 0.5, 0.01, 0.01])   # float32: warm-up + 3; bf16: one paused
    calls = []

    def fake_step(model, opt, stream, cfg, step, device, bf16):
        calls.append(bf16)
        time.sleep(next(costs))
        return 0.0, 0.0

    monkeypatch.setattr(pt, "train_step", fake_step)
    cfg = config(corpus, tmp_path, precision="auto")
    model = pt.build_model(cfg, pt.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")))
    bf16, speeds = pt.choose_precision(model, torch.arange(200, dtype=torch.int32), cfg, torch.device("cpu"))
    assert bf16 and speeds["bfloat16"] > speeds["float32"] and calls.count(True) >= 3


def test_the_precision_probe_is_recorded(corpus, tmp_path):
    result = pt.pretrain(config(corpus, tmp_path / "a", precision="auto", max_steps=2))
    assert set(result["precision_probe"]) == {"float32", "bfloat16"}
    meta = json.loads((tmp_path / "a" / "state" / "meta.json").read_text())
    probe = [e for e in meta["events"] if e["event"] == "precision probe"]
    assert probe[0]["chosen"] == result["precision"] and probe[0]["tokens_per_s"] == result["precision_probe"]


def test_sigterm_saves_every_step_done(corpus, tmp_path):
    import signal
    import subprocess
    import sys
    cfg = config(corpus, tmp_path / "a", max_steps=10_000, eval_every=10_000)
    args = [sys.executable, "-c", "import json, sys; from blockspec.training import pretrain as pt; "
            "pt.pretrain(pt.PretrainConfig(**json.loads(sys.argv[1])))", json.dumps(cfg.__dict__)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    logfile = tmp_path / "a" / "log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not logfile.is_file() or len(logfile.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    done = log(tmp_path / "a")[-1]["step"]
    assert json.loads((tmp_path / "a" / "state" / "meta.json").read_text())["step"] == done >= 3


def test_validation_during_the_run_sees_the_current_weights(corpus, tmp_path):
    """Every evaluation equals a fresh model's evaluation of the saved weights: an optimizer
    that updates weights without bumping their versions (fused AdamW) left the no-grad
    forwards on the prepacked weights of the first evaluation."""
    cfg = config(corpus, tmp_path / "a", max_steps=4, eval_every=2, lr=5e-3)
    pt.pretrain(cfg)
    logged = [r["val_loss"] for r in log(tmp_path / "a") if "val_loss" in r]
    tok = pt.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    fresh = pt.build_model(cfg, tok)
    pt.load_state(tmp_path / "a" / "state", fresh, pt.make_optimizer(fresh, cfg))
    val = pt.tokenize_split(corpus, TOKENIZER, "val", tmp_path / "a")
    assert logged[-1] == pytest.approx(pt.evaluate(fresh, val, cfg, torch.device("cpu"), False), abs=1e-4)
    assert logged[0] != logged[-1]
