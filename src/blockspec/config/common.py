"""Shared pieces of the configs: names of methods and rules, JSON reading, field checks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from blockspec.errors import BlockspecError

SUPPORTED_TARGET_TYPES = ("qwen3", "llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# Decoding methods: plain AR, DFlash drafts, DSpark drafts, EAGLE-3 chains (docs/design.md sections 3 and 5).
DRAFT_METHODS = ("dflash", "dspark", "eagle3")
METHODS = ("ar", *DRAFT_METHODS)
# Verification rules (docs/design.md section 4): lossless rejection sampling, sample-and-match.
RULES = ("rejection", "match")


# The most a checkpoint's side file (config, tokenizer config, template, ...) may hold: real
# ones are kilobytes (a tokenizer_config.json with a long template: a few MB).
MAX_SIDE_FILE_BYTES = 64 << 20


def allowed_roots(directory: Path) -> list[Path]:
    """Where the files of a checkpoint may live: inside its directory, and for a Hugging Face
    hub cache snapshot (`.../snapshots/<rev>/` whose files are symlinks to `../../blobs/`)
    inside that repository's `blobs` folder."""
    root = directory.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def resolve_inside(directory: Path, path: Path, what: str) -> Path:
    """The real path of `path` if it stays inside the checkpoint `directory` (links into the
    hub cache's blobs allowed); else, or on a link loop, a BlockspecError naming it."""
    try:
        real = path.resolve()
        roots = allowed_roots(directory)
    except (OSError, RuntimeError) as exc:   # a symlink loop (RuntimeError before Python 3.13)
        raise BlockspecError(f"{what}: cannot resolve {path}: {exc}") from None
    if not any(real == r or r in real.parents for r in roots):
        raise BlockspecError(f"{what}: {path.name!r} is a link to {real}, outside the checkpoint directory; "
                             "refusing to read it")
    return real


def side_file(path: Path, what: str, max_bytes: int = MAX_SIDE_FILE_BYTES) -> Path:
    """`path`, a file of a checkpoint, checked: inside its directory and at most `max_bytes`."""
    path = Path(path)
    resolve_inside(path.parent, path, what)
    size = path.stat().st_size
    if size > max_bytes:
        raise BlockspecError(f"{what}: {path} is {size} bytes, over the {max_bytes}-byte limit for this file; "
                             "the checkpoint is corrupt")
    return path


def read_json(path: Path, what: str, in_checkpoint: bool = True) -> dict[str, Any]:
    """Read a JSON object from `path`, raising BlockspecError naming `what` on any failure;
    `in_checkpoint`: the file belongs to a checkpoint directory (`side_file`'s checks)."""
    path = Path(path)
    if not path.is_file():
        raise BlockspecError(f"{what}: {path} does not exist")
    if in_checkpoint:
        side_file(path, what)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BlockspecError(f"{what}: {path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise BlockspecError(f"{what}: {path} is nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise BlockspecError(f"{what}: {path} must hold a JSON object")
    return data


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise BlockspecError(msg)


# Upper bounds far above any released model (Llama-3.1-405B: 126 layers, hidden 16384,
# intermediate 53248; Gemma: 262k vocabulary; Llama 4: 10M context), so a config asking
# for more is corrupt or hostile: refused by name before anything is sized or allocated.
LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
          "num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
          "head_dim": 4096, "max_position_embeddings": 1 << 26, "num_target_layers": 4096,
          "block_size": 1024, "markov_rank": 1 << 16}


def positive_int(name: str, value: Any, where: str) -> int:
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"{where}: '{name}' must be a positive integer, got {value!r}")
    limit = LIMITS.get(name)
    require(limit is None or value <= limit,
             f"{where}: '{name}' = {value} is absurd (the limit is {limit}); the config is corrupt")
    return value


def positive_float(name: str, value: Any, where: str) -> float:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
             f"{where}: '{name}' must be a positive finite number, got {value!r}")
    return float(value)


def check_model_type(model_type: Any, where: str) -> None:
    require(model_type in SUPPORTED_TARGET_TYPES,
             f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TARGET_TYPES)})")
