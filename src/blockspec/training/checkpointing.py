"""Atomic, exactly-resumable training checkpoints.

    <out>/checkpoints/step-000120/  model.safetensors   draft weights (full, fp32)
                                    optimizer.pt        AdamW state (full, keyed by parameter name)
                                    trainer.json        step, LR scheduler, data position, history, time
                                    rng-rank<r>.pt      python / torch / cuda RNG states of each rank
    <out>/checkpoints/latest.json   {"step": 120, "dir": "step-000120"}

Every file is written under a temporary name and renamed (os.replace) once complete, and
`latest.json` is replaced only after every rank has written its part: a run killed at any
instant leaves the previous checkpoint intact and named. Older step directories are removed
after the pointer moves (the newest `keep` stay). Optimizer state never goes to git (runs/
is ignored) and is not part of the saved draft.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from blockspec.errors import BlockspecError

LATEST = "latest.json"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    _atomic(path, lambda p: p.write_text(json.dumps(data, indent=1)))


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save_rank_part(root: Path, step: int, rank: int) -> None:
    """Every rank: its RNG states (before the barrier that precedes `commit`)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    _atomic(d / f"rng-rank{rank}.pt", lambda p: torch.save(rng_state(), p))


def save_main_part(root: Path, step: int, model_sd: dict, optim_sd: dict, trainer: dict) -> None:
    """Rank 0: weights, optimizer and trainer state (full, gathered by the caller)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model_sd.items()}
    _atomic(d / "model.safetensors", lambda p: save_file(tensors, str(p)))
    _atomic(d / "optimizer.pt", lambda p: torch.save(optim_sd, p))
    write_json(d / "trainer.json", trainer)


def commit(root: Path, step: int, keep: int = 1) -> None:
    """Rank 0, after every rank's part is on disk: point `latest.json` at the step, then
    remove older step directories."""
    write_json(root / LATEST, {"step": step, "dir": step_dir(root, step).name})
    olds = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != step_dir(root, step).name)
    for old in olds[:max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def latest_step(root: Path) -> int | None:
    p = root / LATEST
    if not p.is_file():
        return None
    return int(json.loads(p.read_text())["step"])


def load(root: Path, rank: int) -> tuple[dict, dict, dict, dict | None]:
    """(model state, optimizer state, trainer state, this rank's RNG state or None when the
    run had fewer ranks) of the latest committed checkpoint."""
    step = latest_step(root)
    if step is None:
        raise BlockspecError(f"train: --resume: no checkpoint under {root}")
    d = step_dir(root, step)
    try:
        model_sd = load_file(str(d / "model.safetensors"))
        optim_sd = torch.load(d / "optimizer.pt", weights_only=True)
        trainer = json.loads((d / "trainer.json").read_text())
    except (OSError, ValueError, RuntimeError) as exc:
        raise BlockspecError(f"train: --resume: checkpoint {d} is unreadable ({exc})") from None
    rng_path = d / f"rng-rank{rank}.pt"
    rng = torch.load(rng_path, weights_only=False) if rng_path.is_file() else None
    return model_sd, optim_sd, trainer, rng
