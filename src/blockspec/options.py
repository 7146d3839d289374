"""Command-line options shared by `blockspec` subcommands, each declared once.

Used by the CLI (blockspec.cli), the server (blockspec.serving.server) and the bench
(blockspec.bench); argparse only, so any layer may declare its flags with it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from blockspec.config import METHODS, RULES, read_json
from blockspec.errors import BlockspecError

TARGET_HELP = "HF-format target directory (default: the embedded model)"
DTYPE_HELP = "float32 | bfloat16 | float16"


def add_target_flag(p: argparse.ArgumentParser, help: str = TARGET_HELP) -> None:
    """--target DIR (default None: the embedded target)."""
    p.add_argument("--target", default=None, help=help)


def add_dtype_flag(p: argparse.ArgumentParser, default: str = "float32") -> None:
    """--dtype NAME: the dtype the models are loaded in."""
    p.add_argument("--dtype", default=default, help=DTYPE_HELP)


def add_device_flag(p: argparse.ArgumentParser) -> None:
    """--device: cpu | cuda | auto (default auto: cuda when available; see models.checkpoint.resolve_device)."""
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (cuda when available)")


def add_rule_flag(p: argparse.ArgumentParser) -> None:
    """--rule: the verification rule when sampling."""
    p.add_argument("--rule", choices=RULES, default="rejection",
                   help="acceptance rule when sampling (both lossless; rejection accepts more)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--target / --draft / --method / --block-size / --dtype: the arguments of loading.load_models."""
    add_target_flag(p)
    p.add_argument("--draft", default=None, help="draft directory (default: the embedded draft for --method)")
    p.add_argument("--method", choices=METHODS, default="ar")
    p.add_argument("--block-size", type=int, default=None, help="run with a shorter block than trained")
    add_dtype_flag(p)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field (--field-name), typed by its default."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None:
            parser.add_argument(flag, default=None)
        else:
            parser.add_argument(flag, type=type(default), default=default)


def dataclass_from_args(cls: type, args: argparse.Namespace, config_file: str | None = None) -> Any:
    """Defaults < JSON config file < flags given on the command line."""
    values: dict[str, Any] = {}
    if config_file:
        data = read_json(Path(config_file), "config file")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise BlockspecError(f"config file {config_file}: unknown keys {sorted(unknown)}")
        values.update(data)
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if value != default or f.name not in values:
            values[f.name] = value
    return cls(**values)
