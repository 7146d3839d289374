"""The cost table the adaptive policy needs, measured once per machine and model pair.

`cached_cost_table` returns the table for (machine, device, threads, torch, target
shape, draft shape, dtypes, row count) from the user's cache directory, and
profiles it the first time (a few seconds for the embedded pair at one row, tens
of seconds at 32 rows on a small CPU). The key holds everything that changes the
timings, so another model pair, dtype or device never reuses a table. Measured
round times refine it online (the gate's measured / predicted ratio,
`gate.DraftGate.observe`).

Where: $BLOCKSPEC_CACHE_DIR, else $XDG_CACHE_HOME/blockspec, else ~/.cache/blockspec.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

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


def table_key(target: TargetModel, draft: AnyDraft, rows: int) -> dict[str, str | int]:
    """Everything a cost table's timings depend on."""
    return {"machine": machine_signature(target.device), "device": str(target.device),
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


def cached_cost_table(target: TargetModel, draft: AnyDraft, rows: int = 1, *, directory: Path | None = None,
                      repeats: int = 5) -> CostTable:
    """The cost table for this machine, model pair and up to `rows` rows (rounded up to a
    power of two): from the cache,
    else measured now and saved there (an unwritable cache only logs a warning)."""
    if rows < 1:
        raise BlockspecError(f"rows must be >= 1, got {rows}")
    # A power of two (nearby batch sizes share a table), at most MAX_PROFILED_ROWS: past
    # it the table's last slope continues and measured round times correct it.
    rows = min(1 << (rows - 1).bit_length(), MAX_PROFILED_ROWS)
    key = table_key(target, draft, rows)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    if digest in _MEMO:
        return _MEMO[digest]
    path = (directory or cache_dir()) / "cost_tables" / f"{digest}.json"
    table = _load(path, key)
    if table is None:
        ns, draft_rows = profile_points(rows, draft.config.num_drafts)
        log.warning("blockspec: measuring the verify / draft cost table for this machine and model pair "
                    "(once; cached at %s)", path)
        options = ProfileOptions(repeats=repeats, rows=rows, warmup=1, draft_slots=list(DRAFT_SLOT_COUNTS))
        table = profile_cost_table(target, ns, options, capture=tuple(draft.config.target_layer_ids), draft=draft,
                                   draft_rows=draft_rows)
        table.meta["key"] = key
        _save(table, path)
    _MEMO[digest] = table
    return table


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
    """Write atomically (a concurrent reader sees the old file or the new one, never half)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False,
                                         encoding="utf-8") as f:
            f.write(json.dumps(table.to_dict(), indent=2) + "\n")
        os.replace(f.name, path)
    except OSError as exc:
        log.warning("blockspec: could not cache the cost table at %s (%s); it lives in memory only", path, exc)
