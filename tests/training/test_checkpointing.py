"""Training checkpoints are data, never code: a hostile or corrupt file in a run directory is
refused with one line (exit 2 from the CLI), and nothing in it ever runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from blockspec.cli import main
from blockspec.errors import BlockspecError
from blockspec.training import checkpointing as ckpt
from blockspec.training.trainer import TrainConfig, train
from conftest import write_pattern_data, write_tiny_target_dir

SRC = Path(__file__).resolve().parents[2] / "src"


class Payload:
    """Unpickling this runs os.system: what a hostile checkpoint file carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-step run whose checkpoint each test copies and damages."""
    root = tmp_path_factory.mktemp("ckpt")
    write_tiny_target_dir(root / "target")
    write_pattern_data(root / "data.jsonl", n=16)
    kw = dict(method="dflash", target=str(root / "target"), data=str(root / "data.jsonl"), block_size=4,
              num_anchors=4, batch_size=2, eval_every=100, eval_examples=2, eval_new_tokens=2, threads=1,
              num_layers=1)
    train(TrainConfig(out=str(root / "run"), max_steps=2, save_every=2, **kw))
    return root, kw


def resume(run, tmp_path, damage) -> tuple[int, str]:
    root, kw = run
    out = tmp_path / "run"
    shutil.copytree(root / "run", out)
    step = ckpt.step_dir(out / "checkpoints", ckpt.latest_step(out / "checkpoints"))
    damage(out / "checkpoints", step)
    argv = ["train", "--method", "dflash", "--target", kw["target"], "--data", kw["data"], "--out", str(out),
            "--block-size", "4", "--num-anchors", "4", "--batch-size", "2", "--eval-every", "100",
            "--eval-examples", "2", "--max-steps", "3", "--threads", "1", "--num-layers", "1", "--resume"]
    return main(argv)


def test_nothing_in_the_source_unpickles_arbitrary_objects():
    found = subprocess.run(["grep", "-rn", "weights_only=False", str(SRC)], capture_output=True, text=True).stdout
    assert found == ""


def test_checkpoint_files_are_safetensors_and_json(run):
    root, _ = run
    step = ckpt.step_dir(root / "run" / "checkpoints", 2)
    assert sorted(p.name for p in step.iterdir()) == ["model.safetensors", "optimizer.safetensors",
                                                       "rng-rank0.json", "trainer.json"]


@pytest.mark.parametrize("name", ["rng-rank0.pt", "optimizer.pt"])
def test_a_pickled_payload_is_refused_and_never_runs(run, tmp_path, capsys, name):
    """An earlier version's .pt file carrying a __reduce__ payload: refused, the marker never written."""
    marker = tmp_path / "ran"

    def plant(_, step):
        (step / name.replace(".pt", ".json" if name.startswith("rng") else ".safetensors")).unlink()
        torch.save({"python": Payload(marker), "state": Payload(marker)}, step / name)

    assert resume(run, tmp_path, plant) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert err.startswith("error: train: --resume:") and "refused" in err and err.count("\n") == 1


def _write(name: str, data: bytes | str):
    def damage(_, step):
        path = step / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return damage


def _truncate(name: str):
    def damage(_, step):
        path = step / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return damage


def _wrong_shape(_, step):
    from safetensors.torch import load_file, save_file
    sd = load_file(str(step / "model.safetensors"))
    key = next(iter(sd))
    sd[key] = torch.zeros(3, 3)
    save_file(sd, str(step / "model.safetensors"))


def _latest(text: str):
    def damage(root, _):
        (root / "latest.json").write_text(text)
    return damage


@pytest.mark.parametrize("damage", [
    _write("optimizer.safetensors", b"\x80\x04garbage"), _truncate("optimizer.safetensors"),
    _truncate("model.safetensors"), _wrong_shape, _latest("{not json"), _latest('{"step": "two"}'),
    _latest("[" * 100_000), _write("trainer.json", "{}"), _write("trainer.json", '{"step": "two"}'),
    _write("rng-rank0.json", '{"python": 1}'), _write("rng-rank0.json", b"\xff\xfe"),
], ids=["garbage-optimizer", "truncated-optimizer", "truncated-model", "wrong-shape", "latest-not-json",
        "latest-step-string", "latest-deep", "trainer-empty", "trainer-step-string", "rng-shape", "rng-not-utf8"])
def test_a_corrupt_checkpoint_is_one_line_exit_2(run, tmp_path, capsys, damage):
    assert resume(run, tmp_path, damage) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train: --resume") and err.count("\n") == 1, err


def test_the_json_rng_state_round_trips():
    state = json.loads(json.dumps(ckpt.rng_state()))
    expected = torch.rand(3)
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises(BlockspecError, match="not an RNG state"):
        ckpt.set_rng_state({"python": [3, [1, 2], None], "torch": [0] * 10})
