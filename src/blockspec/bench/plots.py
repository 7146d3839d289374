"""Matplotlib figures for benchmark reports.

matplotlib is imported lazily (with the non-interactive ``Agg`` backend) inside
each function, so importing this module does not require matplotlib.  Every
function writes a PNG to ``path`` (creating parent folders) and returns it as a
:class:`pathlib.Path`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "plot_acceptance_histogram",
    "plot_per_slot",
    "plot_tau_vs_position",
    "plot_speedup_vs_block",
    "plot_throughput_vs_concurrency",
    "plot_reliability",
    "plot_draft_time_vs_drafts",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    plt = _pyplot()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, format="png", dpi=120)
    plt.close(fig)
    return p


def _nan(x: Any) -> float:
    return float("nan") if x is None else float(x)


def plot_acceptance_histogram(hist_by_method: dict[str, list[int]], path: str | Path) -> Path:
    """Grouped bars of the fraction of rounds per accepted length, one group per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    methods = list(hist_by_method)
    max_len = max((len(h) for h in hist_by_method.values()), default=0)
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        h = list(hist_by_method[m])
        total = sum(h)
        frac = [c / total if total else 0.0 for c in h]
        xs = [k - 0.4 + width * (i + 0.5) for k in range(len(h))]
        ax.bar(xs, frac, width=width, label=m)
    ax.set_xticks(list(range(max_len)))
    ax.set_xlabel("accepted draft tokens per round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("Acceptance length distribution")
    if methods:
        ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_per_slot(per_slot_by_method: dict[str, list[float]], path: str | Path) -> Path:
    """Conditional acceptance rate per draft slot (1-based), one line per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, vals in per_slot_by_method.items():
        ys = [_nan(v) for v in vals]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=m)
    ax.set_ylim(0.0, 1.05)
    ax.set_xlabel("draft slot k")
    ax.set_ylabel("P(accept slot k | slots 1..k-1 accepted)")
    ax.set_title("Per-slot conditional acceptance")
    if per_slot_by_method:
        ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_tau_vs_position(series_by_method: dict[str, dict[str, list[float]]], path: str | Path) -> Path:
    """tau (tokens per round, bonus included) against the context position of the round's anchor,
    one line per method (`ContextAcceptance.tau_by_position`: bin centres and tau)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, series in series_by_method.items():
        ax.plot(series["position"], series["tau"], marker=".", label=m)
    ax.set_xlabel("context position of the round (tokens)")
    ax.set_ylabel("tau (tokens per round)")
    ax.set_title("Acceptance vs context length")
    if series_by_method:
        ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_speedup_vs_block(block_sizes: list[int], speedup_by_method: dict[str, list[float]], path: str | Path) -> Path:
    """Speed-up over autoregressive decoding as a function of block size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, vals in speedup_by_method.items():
        if len(vals) != len(block_sizes):
            raise ValueError(f"method {m!r}: {len(vals)} values for {len(block_sizes)} block sizes")
        ax.plot(block_sizes, [_nan(v) for v in vals], marker="o", label=m)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="autoregressive")
    ax.set_xticks(list(block_sizes))
    ax.set_xlabel("block size (draft tokens per round)")
    ax.set_ylabel("speed-up vs autoregressive (x)")
    ax.set_title("Speed-up vs block size")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_throughput_vs_concurrency(concurrency: list[int], tps_by_method: dict[str, list[float]], path: str | Path) -> Path:
    """Aggregate throughput (tokens/s) as a function of concurrent requests."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, vals in tps_by_method.items():
        if len(vals) != len(concurrency):
            raise ValueError(f"method {m!r}: {len(vals)} values for {len(concurrency)} concurrency levels")
        ax.plot(concurrency, [_nan(v) for v in vals], marker="o", label=m)
    if concurrency and all(c > 0 for c in concurrency) and max(concurrency) / min(concurrency) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(concurrency))
    ax.set_xticklabels([str(c) for c in concurrency])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("Throughput vs concurrency")
    if tps_by_method:
        ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_reliability(reliability: list[dict], path: str | Path) -> Path:
    """Reliability diagram from :func:`blockspec.metrics.calibration`'s ``reliability``.

    Bars show the observed positive fraction per bin, dots the mean prediction;
    empty bins are skipped.  The diagonal marks perfect calibration.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    filled = [b for b in reliability if b.get("count") and b.get("mean_pred") is not None]
    if filled:
        los = [float(b["lo"]) for b in filled]
        widths = [float(b["hi"]) - float(b["lo"]) for b in filled]
        frac = [float(b["frac_pos"]) for b in filled]
        mean_pred = [float(b["mean_pred"]) for b in filled]
        ax.bar(los, frac, width=widths, align="edge", alpha=0.6, edgecolor="black", label="observed frequency")
        total = sum(int(b["count"]) for b in filled)
        sizes = [20 + 200 * int(b["count"]) / total for b in filled]
        ax.scatter(mean_pred, frac, s=sizes, color="tab:red", zorder=3, label="bin (size ~ count)")
    ax.plot([0, 1], [0, 1], color="gray", linestyle="--", label="perfect calibration")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("predicted probability")
    ax.set_ylabel("observed frequency of acceptance")
    ax.set_title("Reliability diagram")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_draft_time_vs_drafts(curves: dict[str, tuple[list[int], list[float]]], path: str | Path) -> Path:
    """Draft round time against the number of drafted tokens, one line per method: an
    EAGLE-3 chain pays one draft forward per token, a DFlash block one forward for all."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, (drafts, seconds) in curves.items():
        if len(drafts) != len(seconds):
            raise ValueError(f"method {m!r}: {len(seconds)} times for {len(drafts)} draft counts")
        ax.plot(drafts, [1e3 * _nan(t) for t in seconds], marker="o", label=m)
    ax.set_xlabel("drafted tokens per round")
    ax.set_ylabel("t_draft per round (ms)")
    ax.set_title("Draft time vs drafted tokens (batch 1)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)
