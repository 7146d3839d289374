"""Report helpers of the benchmark: speed-up summary and Markdown tables.

The acceptance and calibration metrics (tau, AcceptanceStats, calibration,
survival, prefix outcomes) live in :mod:`blockspec.metrics`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["speedup_summary", "markdown_table"]


def speedup_summary(tokens_per_s: float, ar_tokens_per_s: float, tau: float) -> dict[str, float]:
    """Speed-up over autoregressive decoding and ``efficiency = speedup / tau``.

    Efficiency is the fraction of the ideal (overhead-free) speed-up ``tau``
    that was realised.
    """
    if ar_tokens_per_s <= 0:
        raise ValueError(f"ar_tokens_per_s must be > 0, got {ar_tokens_per_s}")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    speedup = float(tokens_per_s) / float(ar_tokens_per_s)
    return {
        "tokens_per_s": float(tokens_per_s),
        "ar_tokens_per_s": float(ar_tokens_per_s),
        "tau": float(tau),
        "speedup": speedup,
        "efficiency": speedup / float(tau),
    }


def _fmt_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if math.isnan(f):
            return "nan"
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return f"{f:.2f}" if abs(f) >= 10 else f"{f:.3f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """GitHub markdown table of ``rows`` restricted to ``columns``.

    Floats get 3 decimals, or 2 decimals when ``abs(x) >= 10``; ints and strings
    are printed as is (``|`` escaped); missing keys and ``None`` give empty cells.
    The result ends without a trailing newline.
    """
    if not columns:
        raise ValueError("columns must be non-empty")
    lines = [
        "| " + " | ".join(_fmt_cell(c) for c in columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)
