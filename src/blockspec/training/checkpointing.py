"""Atomic, exactly-resumable training checkpoints.

    <out>/checkpoints/step-000120/  model.safetensors      draft weights (full, fp32)
                                    optimizer.safetensors  AdamW state (full, keyed by parameter name;
                                                           param groups as JSON in the metadata)
                                    trainer.json           step, LR scheduler, data position, history, time
                                    rng-rank<r>.json       python / torch / cuda RNG states of each rank
    <out>/checkpoints/latest.json   {"step": 120, "dir": "step-000120"}

Every file is written under a temporary name and renamed (os.replace) once complete, and
`latest.json` is replaced only after every rank has written its part: a run killed at any
instant leaves the previous checkpoint intact and named. Older step directories are removed
after the pointer moves (the newest `keep` stay). Optimizer state never goes to git (runs/
is ignored) and is not part of the saved draft.

A run directory is data, never code: nothing here is unpickled (checkpoints of earlier
versions, `optimizer.pt` / `rng-rank<r>.pt`, are read with torch's tensors-only loader), and
every file is checked before use, so a corrupt or hostile one is a one-line error.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from blockspec.errors import BlockspecError

LATEST = "latest.json"
OPTIMIZER = "optimizer.safetensors"
_OPTIM_META = "blockspec_optimizer"
# trainer.json: the fields a resume reads, with their JSON types.
TRAINER_FIELDS = {"step": int, "elapsed": (int, float), "history": list, "scheduler": dict,
                  "global_batch": int, "examples": int}


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    _atomic(path, lambda p: p.write_text(json.dumps(data, indent=1)))


def rng_state() -> dict:
    """This process's RNG states as JSON-able data (the torch states are byte tensors: lists of ints)."""
    version, words, gauss = random.getstate()
    state = {"python": [version, list(words), gauss], "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _byte_tensor(value: Any) -> torch.Tensor:
    if not (isinstance(value, list) and all(isinstance(b, int) and 0 <= b < 256 for b in value)):
        raise ValueError("an RNG state must be a list of bytes")
    return torch.tensor(value, dtype=torch.uint8)


def set_rng_state(state: Any, where: str = "RNG state") -> None:
    """Restore `rng_state()`'s data (or an earlier version's tensors); a malformed state is refused."""
    try:
        version, words, gauss = state["python"]
        random.setstate((version, tuple(words), gauss))
        torch.set_rng_state(state["torch"] if isinstance(state["torch"], torch.Tensor) else _byte_tensor(state["torch"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s if isinstance(s, torch.Tensor) else _byte_tensor(s) for s in state["cuda"]])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise BlockspecError(f"train: --resume: {where} is not an RNG state ({type(exc).__name__}: {exc})") from None


def optimizer_tensors(optim_sd: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An optimizer state dict as safetensors: its tensors as `state/<param>/<key>`, everything
    else (param groups, scalar state) as JSON in the metadata."""
    tensors, scalars = {}, {}
    for name, entries in optim_sd["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{name}/{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(name, {})[key] = value
    meta = {"param_groups": optim_sd["param_groups"], "scalars": scalars}
    return tensors, {_OPTIM_META: json.dumps(meta)}


def optimizer_state(path: Path) -> dict:
    """`optimizer_tensors`' file read back as an optimizer state dict."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})[_OPTIM_META])
    state: dict[str, dict[str, Any]] = {name: dict(v) for name, v in meta["scalars"].items()}
    for key, tensor in load_file(str(path)).items():
        name, _, field = key.removeprefix("state/").rpartition("/")
        state.setdefault(name, {})[field] = tensor
    if not isinstance(meta["param_groups"], list):
        raise ValueError("param_groups must be a list")
    return {"state": state, "param_groups": meta["param_groups"]}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save_rank_part(root: Path, step: int, rank: int) -> None:
    """Every rank: its RNG states (before the barrier that precedes `commit`)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    write_json(d / f"rng-rank{rank}.json", rng_state())


def save_main_part(root: Path, step: int, model_sd: dict, optim_sd: dict, trainer: dict) -> None:
    """Rank 0: weights, optimizer and trainer state (full, gathered by the caller)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model_sd.items()}
    _atomic(d / "model.safetensors", lambda p: save_file(tensors, str(p)))
    optim_tensors, optim_meta = optimizer_tensors(optim_sd)
    _atomic(d / OPTIMIZER, lambda p: save_file(optim_tensors, str(p), metadata=optim_meta))
    write_json(d / "trainer.json", trainer)


def commit(root: Path, step: int, keep: int = 1) -> None:
    """Rank 0, after every rank's part is on disk: point `latest.json` at the step, then
    remove older step directories."""
    write_json(root / LATEST, {"step": step, "dir": step_dir(root, step).name})
    olds = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != step_dir(root, step).name)
    for old in olds[:max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BlockspecError(f"train: --resume: {path} is unreadable ({type(exc).__name__}: {exc})") from None


def latest_step(root: Path) -> int | None:
    p = root / LATEST
    if not p.is_file():
        return None
    pointer = _read_json(p)
    step = pointer.get("step") if isinstance(pointer, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise BlockspecError(f"train: --resume: {p} does not name a checkpoint step (expected "
                             '{"step": N, ...}); delete it to start over')
    return step


def check_trainer_state(state: Any, step: int, path: Path) -> dict:
    """trainer.json as written by the trainer, or a one-line error naming the bad field."""
    if not isinstance(state, dict):
        raise BlockspecError(f"train: --resume: {path} must hold a JSON object")
    for name, kind in TRAINER_FIELDS.items():
        value = state.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BlockspecError(f"train: --resume: {path}: '{name}' is {value!r}, not a trainer state "
                                 "(the checkpoint is corrupt)")
    if state["step"] != step:
        raise BlockspecError(f"train: --resume: {path} holds step {state['step']}, latest.json names {step}")
    return state


def _load_rng(d: Path, rank: int) -> Any:
    path = d / f"rng-rank{rank}.json"
    if path.is_file():
        return _read_json(path)
    legacy = d / f"rng-rank{rank}.pt"   # checkpoints of earlier versions: tensors and tuples only
    return _tensors_only(legacy) if legacy.is_file() else None


def _tensors_only(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise BlockspecError(f"train: --resume: {path} is refused: it is not plain tensor data "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def load(root: Path, rank: int) -> tuple[dict, dict, dict, Any]:
    """(model state, optimizer state, trainer state, this rank's RNG state or None when the
    run had fewer ranks) of the latest committed checkpoint."""
    step = latest_step(root)
    if step is None:
        raise BlockspecError(f"train: --resume: no checkpoint under {root}")
    d = step_dir(root, step)
    try:
        model_sd = load_file(str(d / "model.safetensors"))
        legacy = not (d / OPTIMIZER).is_file() and (d / "optimizer.pt").is_file()
        optim_sd = _tensors_only(d / "optimizer.pt") if legacy else optimizer_state(d / OPTIMIZER)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, SafetensorError) as exc:
        raise BlockspecError(f"train: --resume: checkpoint {d} is unreadable ({type(exc).__name__}: {exc})") from None
    trainer = check_trainer_state(_read_json(d / "trainer.json"), step, d / "trainer.json")
    return model_sd, optim_sd, trainer, _load_rng(d, rank)
