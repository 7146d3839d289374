"""The cost table the adaptive policy needs, measured once per machine and model pair.

`cached_cost_table` returns the table for (machine: CPU model or GPU name, device,
threads, torch, target shape, draft shape, dtypes, row count) from the user's cache
directory, and profiles it the first time, with a progress line on stderr (a few
seconds for the embedded pair at one row, tens of seconds at 32 rows on a small CPU;
the caller keeps that time out of any speed it reports). The key holds everything
that changes the timings, so another model pair, dtype, device or CPU model never
reuses a table. refresh=True (`--remeasure-costs`, `blockspec profile --refresh`)
measures again. Measured round times refine it online (the gate's measured /
predicted ratio, `gate.DraftGate.observe`), and a table that live rounds show to be
off by more than a margin is rescaled and written back (`write_back`, from the
policy's `CostDrift`).

Where: $BLOCKSPEC_CACHE_DIR, else $XDG_CACHE_HOME/blockspec, else ~/.cache/blockspec.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from blockspec.decoding.cost_table import (DRAFT_SLOT_COUNTS, CostTable, ProfileOptions, dtype_name,
                                           machine_signature, model_signature, profile_cost_table)
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import AnyDraft, Eagle3Drafter
from blockspec.models.target import TargetModel

log = logging.getLogger(__name__)

MAX_PROFILED_ROWS = 256
# Tables measured in this process, by key: repeated `generate` calls read no file.
_MEMO: dict[str, CostTable] = {}


def cache_dir() -> Path:
    if os.environ.get("BLOCKSPEC_CACHE_DIR"):
        return Path(os.environ["BLOCKSPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "blockspec"


def draft_signature(draft: AnyDraft) -> str:
    """The draft's shape as far as its cost goes (not its weights)."""
    if isinstance(draft, Eagle3Drafter):
        return f"{draft.config.signature()} dtype={dtype_name(draft.dtype)}"
    c = draft.config
    markov = f"{c.markov_head_type}/{c.markov_rank}" if draft.markov_head is not None else None
    return (f"{c.layout} layers={c.num_hidden_layers} hidden={c.hidden_size} inter={c.intermediate_size} "
            f"heads={c.num_attention_heads}/{c.num_key_value_heads} head_dim={c.head_dim} block={c.block_size} "
            f"drafts={c.num_drafts} taps={list(c.target_layer_ids)} markov={markov} "
            f"confidence={draft.confidence_head is not None} dtype={dtype_name(draft.dtype)}"
            + (f" window={c.sliding_window} sliding={[t == 'sliding_attention' for t in c.layer_types]}"
               if c.is_windowed else ""))


# How tables are measured (`cost_table.profile_cost_table`); a table measured otherwise is measured
# again. 2: interleaved repeats and a monotone fit (1's running maximum kept a busy spell's
# outliers in the cached file for good).
PROFILER_VERSION = 2


def table_key(target: TargetModel, draft: AnyDraft, rows: int) -> dict[str, str | int]:
    """Everything a cost table's timings depend on, and how they were measured."""
    return {"profiler": PROFILER_VERSION, "machine": machine_signature(target.device), "device": str(target.device),
            "threads": torch.get_num_threads(), "target": model_signature(target),
            "target_dtype": dtype_name(target.dtype), "draft": draft_signature(draft), "rows": rows}


def profile_points(rows: int, window: int) -> tuple[list[int], list[int]]:
    """Verify token counts and draft row counts to measure for up to `rows` rows: every
    width of a one-row round, then powers of two up to the widest round."""
    top = rows * (window + 1)
    ns = set(range(1, window + 2)) | {top, rows, rows + 1}
    ns |= {1 << i for i in range(top.bit_length()) if 1 << i <= top}
    draft_rows = {rows} | {1 << i for i in range(rows.bit_length()) if 1 << i <= rows}
    return sorted(ns), sorted(draft_rows)


def table_rows(rows: int) -> int:
    """The row count a table is measured for: a power of two (nearby batch sizes share a
    table), at most MAX_PROFILED_ROWS (past it the table's last slope continues and
    measured round times correct it)."""
    if rows < 1:
        raise BlockspecError(f"rows must be >= 1, got {rows}")
    return min(1 << (rows - 1).bit_length(), MAX_PROFILED_ROWS)


def table_path(key: dict[str, str | int], directory: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (directory or cache_dir()) / "cost_tables" / f"{digest}.json"


def cached_cost_table(target: TargetModel, draft: AnyDraft, rows: int = 1, *, directory: Path | None = None,
                      repeats: int = 5, refresh: bool = False) -> CostTable:
    """The cost table for this machine, model pair and up to `rows` rows (rounded up:
    `table_rows`): from this process's memory or the cache, else (or with refresh)
    measured now, announced on stderr, and saved there (an unwritable cache only logs a
    warning)."""
    rows = table_rows(rows)
    key = table_key(target, draft, rows)
    path = table_path(key, directory)
    memo = str(path)
    if memo in _MEMO and not refresh:
        return _MEMO[memo]
    table = None if refresh else _load(path, key)
    if table is None:
        ns, draft_rows = profile_points(rows, draft.config.num_drafts)
        options = ProfileOptions(repeats=repeats, rows=rows, warmup=1, draft_slots=list(DRAFT_SLOT_COUNTS))
        with announced(path, refresh) as progress:
            table = profile_cost_table(target, ns, options, capture=tuple(draft.config.target_layer_ids),
                                       draft=draft, draft_rows=draft_rows, progress=progress)
        table.meta["key"] = key
        _save(table, path)
    _MEMO[memo] = table
    return table


def write_back(table: CostTable) -> None:
    """Save a cached table corrected online (`CostTable.rescale`) where it was cached, so
    the next process starts from the corrected one; a table not from the cache (a user's
    file, a test's) is left alone."""
    key = table.meta.get("key")
    if isinstance(key, dict):
        path = table_path(key)
        if _MEMO.get(str(path)) is table:
            _save(table, path)


def cached_keys(directory: Path | None = None) -> list[dict[str, str | int]]:
    """The keys of the valid tables in the cache (`blockspec profile --refresh` measures
    again those of its model pair)."""
    keys = []
    for path in sorted(((directory or cache_dir()) / "cost_tables").glob("*.json")):
        try:
            key = CostTable.load(path).meta.get("key")
        except BlockspecError:
            continue
        if isinstance(key, dict) and table_path(key, directory) == path:
            keys.append(key)
    return keys


@contextmanager
def announced(path: Path, refresh: bool) -> Iterator[Callable[[int, int], None]]:
    """Tell the user, on stderr, that the cost table is being measured (a rich progress bar
    on a terminal, two plain lines otherwise) and how long it took."""
    what = "re-measuring" if refresh else "measuring (once per machine and model pair)"
    print(f"blockspec: {what} the verify / draft costs the adaptive policy plans with; cached at {path}",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if sys.stderr.isatty():
        with Progress(TextColumn("blockspec: cost table"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("", total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
    else:
        yield lambda done, total: None
    print(f"blockspec: cost table measured in {time.perf_counter() - t0:.1f} s (not counted in any reported speed)",
          file=sys.stderr, flush=True)


def _load(path: Path, key: dict[str, str | int]) -> CostTable | None:
    """The cached table, or None when absent, unreadable or measured for another key
    (a hash collision or a hand-edited file is re-measured, never trusted)."""
    if not path.is_file():
        return None
    try:
        table = CostTable.load(path)
    except BlockspecError as exc:
        log.warning("blockspec: ignoring the cached cost table %s (%s)", path, exc)
        return None
    return table if table.meta.get("key") == key else None


def _save(table: CostTable, path: Path) -> None:
    save_json(table.to_dict(), path, "the cost table")


def save_json(data: dict, path: Path, what: str) -> None:
    """Write atomically (a concurrent reader sees the old file or the new one, never half);
    an unwritable cache only logs a warning (`what` then lives in memory only)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False,
                                         encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.replace(f.name, path)
    except OSError as exc:
        log.warning("blockspec: could not cache %s at %s (%s); it lives in memory only", what, path, exc)


# Live rounds correct a table that is off by more than this (measured / predicted, median)...
DRIFT_BAND = (0.67, 1.5)
# ...over windows of at least this many rounds and this many seconds of them, two in a row:
# a shared CPU runs for seconds at 0.6x-1.6x its median speed (windows of 32 rounds alone,
# a third of a second at batch 1, rescaled the table 1.9x and back every few seconds).
DRIFT_ROUNDS = 32
DRIFT_SECONDS = 5.0


class CostDrift:
    """Whether a table still prices this machine: the median measured / predicted round
    time over each window of DRIFT_ROUNDS rounds and DRIFT_SECONDS seconds (every kind of
    round). When two windows in a row fall outside DRIFT_BAND on the same side (a table
    measured while the machine was busy, or a machine now busier for good), the table
    is rescaled (`CostTable.rescale`, then `write_back`) by the factor of the two nearer
    1, never a silently wrong table reused for good. A load that comes and goes (busy,
    then quiet) leaves it alone: the rescaled table would be wrong in the next window
    and the cached file would flip with it. The gate's own per-kind ratios and the
    machine's pace keep pricing rounds in between (`round_costs.RoundCosts`). One check
    per cached table in a process (`drift_of`), so a loop of short calls adds up to
    the windows one call is too short for."""

    def __init__(self, rounds: int = DRIFT_ROUNDS, band: tuple[float, float] = DRIFT_BAND,
                 seconds: float | None = None) -> None:
        self.rounds, self.band = rounds, band
        self.seconds = DRIFT_SECONDS if seconds is None else seconds
        self.samples: list[float] = []
        self.elapsed = 0.0                   # seconds of the window's rounds
        self.previous: float | None = None   # the last window's median, when it was outside the band

    def observe(self, ratio: float, seconds: float = 0.0) -> float | None:
        """One round's measured / predicted time (and wall time); the factor to rescale by,
        when it is due."""
        self.samples.append(ratio)
        self.elapsed += seconds
        if len(self.samples) < self.rounds or self.elapsed < self.seconds:
            return None
        median = statistics.median(self.samples)
        self.samples.clear()
        self.elapsed = 0.0
        low, high = self.band
        previous, self.previous = self.previous, (None if low <= median <= high else median)
        if self.previous is None or previous is None or (median > high) != (previous > high):
            return None
        self.previous = None   # the next rescale needs two fresh windows
        return min(median, previous) if median > high else max(median, previous)


_DRIFTS: dict[int, tuple[CostTable, CostDrift]] = {}   # id of a cached table -> (it, its check)


def drift_of(table: CostTable) -> CostDrift:
    """The drift check of `table`: shared by every policy of a table from the cache (they
    live for the process), its own for any other table."""
    if not any(t is table for t in _MEMO.values()):
        return CostDrift()
    entry = _DRIFTS.get(id(table))
    if entry is None or entry[0] is not table:
        entry = _DRIFTS[id(table)] = (table, CostDrift())
    return entry[1]
