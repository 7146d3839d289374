"""Where the shipped models live (package data, found from any working directory)."""

from __future__ import annotations

from pathlib import Path

from blockspec.errors import BlockspecError

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_TARGET = ASSETS / "target"
DEFAULT_DRAFTS = {"dflash": ASSETS / "dflash", "dspark": ASSETS / "dspark", "eagle3": ASSETS / "eagle3"}


def default_target() -> Path:
    if not (DEFAULT_TARGET / "config.json").is_file():
        raise BlockspecError(f"the embedded target is missing from {DEFAULT_TARGET}; pass --target DIR")
    return DEFAULT_TARGET


def default_draft(method: str) -> Path:
    path = DEFAULT_DRAFTS.get(method)
    if path is None or not (path / "config.json").is_file():
        raise BlockspecError(f"no embedded {method} draft is shipped in {ASSETS}; pass --draft DIR")
    return path
