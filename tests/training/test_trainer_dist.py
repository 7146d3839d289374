"""Scale-out and resumption are exact: a 2-process torchrun (gloo, CPU; DDP or FSDP2) ends with
the parameters of a 1-process run over the same global batches; a run stopped mid-way (as if
killed) and resumed ends with the parameters of an uninterrupted run; a save that dies half-way
leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from blockspec.errors import BlockspecError
from blockspec.training import checkpointing
from blockspec.training.trainer import TrainConfig, train
from conftest import write_pattern_data, write_tiny_target_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-dist")
    write_tiny_target_dir(root / "target")
    write_pattern_data(root / "data.jsonl")
    return root


def config(setup, out, **kw) -> TrainConfig:
    base = dict(method="dspark", target=str(setup / "target"), data=str(setup / "data.jsonl"), out=str(out),
                block_size=3, markov_rank=8, num_anchors=6, batch_size=4, max_steps=6, lr=3e-3, eval_every=1000,
                save_every=1000, eval_examples=2, eval_new_tokens=4, threads=1, ce_chunk=5)
    base.update(kw)
    return TrainConfig(**base)


# The loss in one chunk: per-position chunks sum in another order on 1 and 2 processes, and
# AdamW's normalisation lifts that float32 noise past the tolerance on lm_head rows.
EAGLE3 = dict(method="eagle3", target_layer_ids="0,1,2", ttt_steps=3, draft_vocab_size=48, ce_chunk=0)


def final_params(out) -> dict[str, torch.Tensor]:
    root = out / "checkpoints"
    return load_file(str(checkpointing.step_dir(root, checkpointing.latest_step(root)) / "model.safetensors"))


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def torchrun(tmp_path, cfg: TrainConfig, nproc: int = 2):
    script = tmp_path / "run.py"
    script.write_text(
        "import json, os, sys\n"
        "from blockspec.training.trainer import TrainConfig, train\n"
        "r = train(TrainConfig(**json.loads(sys.argv[1])))\n"
        "open(sys.argv[2] + '/rank' + os.environ['RANK'] + '.json', 'w').write(json.dumps(r))\n")
    from dataclasses import asdict
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Its own session: on a timeout the launcher and every rank it started are killed together.
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                             "--standalone", str(script), json.dumps(asdict(cfg)), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in 300 s: {err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("fsdp, method", [(False, "dspark"), (True, "dspark"), (False, "eagle3"), (True, "eagle3")])
def test_two_processes_equal_one_process(setup, tmp_path, fsdp, method):
    """Global batch 4: one process x 4 examples, or two x 2 (DDP / FSDP2). Same examples, same
    anchors (seeded per example), loss normalised over the global batch: same parameters."""
    kw = EAGLE3 if method == "eagle3" else {}
    one = tmp_path / "one"
    train(config(setup, one, grad_accum=2, batch_size=2, **kw))
    two = tmp_path / "two"
    results = torchrun(tmp_path, config(setup, two, batch_size=2, fsdp=fsdp, **kw))
    assert [r["world"] for r in results] == [2, 2]
    assert results[0]["param_checksum"] == results[1]["param_checksum"]
    assert_same_params(final_params(one), final_params(two))
    # The logged curves agree too (global loss, not rank 0's share).
    log1 = [json.loads(x) for x in open(one / "log.jsonl")]
    log2 = [json.loads(x) for x in open(two / "log.jsonl")]
    assert [r["loss"] for r in log1] == pytest.approx([r["loss"] for r in log2], rel=1e-4)


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
def test_stopped_and_resumed_run_equals_an_uninterrupted_one(setup, tmp_path, method):
    kw = dict(method=method, block_size=4 if method == "dflash" else 3, max_steps=7, save_every=3,
              **({k: v for k, v in EAGLE3.items() if k != "method"} if method == "eagle3" else {}))
    whole = tmp_path / "whole"
    train(config(setup, whole, **kw))
    cut = tmp_path / "cut"
    r = train(config(setup, cut, halt_at_step=5, **kw))      # dies after step 5: steps 4-5 are lost
    assert r["steps"] == 5 and checkpointing.latest_step(cut / "checkpoints") == 3
    r = train(config(setup, cut, resume=True, **kw))
    assert r["steps"] == 7
    assert_same_params(final_params(whole), final_params(cut))
    assert [json.loads(x)["step"] for x in open(cut / "log.jsonl")] == list(range(1, 8))
    saved = checkpointing.step_dir(whole / "checkpoints", 7)
    assert sorted(p.name for p in saved.iterdir()) == ["model.safetensors", "optimizer.safetensors",
                                                       "rng-rank0.json", "trainer.json"]
    state = json.loads((saved / "trainer.json").read_text())
    assert state["step"] == 7 and state["scheduler"]["last_epoch"] == 7 and "data_position" in state


def test_a_save_that_dies_leaves_the_previous_checkpoint(setup, tmp_path, monkeypatch):
    out = tmp_path / "crash"
    train(config(setup, out, method="dflash", block_size=4, max_steps=4, save_every=2, halt_at_step=3))
    assert checkpointing.latest_step(out / "checkpoints") == 2

    def dies(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpointing, "save_file", dies)
    with pytest.raises(OSError):
        train(config(setup, out, method="dflash", block_size=4, max_steps=4, save_every=2, resume=True))
    monkeypatch.undo()
    assert checkpointing.latest_step(out / "checkpoints") == 2
    assert not list((out / "checkpoints").rglob(".*.tmp-*"))
    r = train(config(setup, out, method="dflash", block_size=4, max_steps=4, save_every=2, resume=True))
    assert r["steps"] == 4


def test_resume_refuses_a_different_global_batch(setup, tmp_path):
    out = tmp_path / "gb"
    train(config(setup, out, method="dflash", block_size=4, max_steps=2, save_every=2))
    with pytest.raises(BlockspecError, match="global batches of 4"):
        train(config(setup, out, method="dflash", block_size=4, max_steps=4, batch_size=2, resume=True))


@pytest.mark.slow
def test_a_killed_process_resumes_to_the_same_parameters(setup, tmp_path):
    """SIGKILL a real training process between checkpoints, resume it: the parameters of an
    uninterrupted run (the steps after its last checkpoint are trained again)."""
    import time
    from dataclasses import asdict

    kw = dict(method="dflash", block_size=4, max_steps=60, save_every=3, batch_size=2)
    killed = tmp_path / "killed"
    script = tmp_path / "run.py"
    script.write_text("import json, sys\nfrom blockspec.training.trainer import TrainConfig, train\n"
                      "train(TrainConfig(**json.loads(sys.argv[1])))\n")
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(asdict(config(setup, killed, **kw)))],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while (checkpointing.latest_step(killed / "checkpoints") or 0) < 6 and time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    stopped_at = checkpointing.latest_step(killed / "checkpoints")
    assert 6 <= stopped_at < 60
    r = train(config(setup, killed, resume=True, **kw))
    assert r["steps"] == 60
    whole = tmp_path / "whole"
    train(config(setup, whole, **kw))
    assert_same_params(final_params(whole), final_params(killed))


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_two_process_run_stopped_and_resumed_equals_one_process(setup, tmp_path, fsdp):
    """torchrun (DDP / FSDP2) stopped after step 5 (last checkpoint: 3), resumed under torchrun:
    the parameters of one uninterrupted process over the same global batches."""
    kw = dict(max_steps=7, save_every=3, batch_size=2)
    whole = tmp_path / "whole"
    train(config(setup, whole, grad_accum=2, **kw))
    two = tmp_path / "two"
    torchrun(tmp_path, config(setup, two, fsdp=fsdp, halt_at_step=5, **kw))
    assert checkpointing.latest_step(two / "checkpoints") == 3
    assert sorted(p.name for p in checkpointing.step_dir(two / "checkpoints", 3).glob("rng-rank*")) == [
        "rng-rank0.json", "rng-rank1.json"]
    results = torchrun(tmp_path, config(setup, two, fsdp=fsdp, resume=True, **kw))
    assert [r["steps"] for r in results] == [7, 7]
    assert_same_params(final_params(whole), final_params(two))
