"""Draft round time against the number of drafted tokens, per draft method (docs/design.md
section 11): the cost structure behind the EAGLE-3 / DFlash comparison. An EAGLE-3 chain of
k drafts runs k one-token draft forwards, so its t_draft grows with k; a DFlash block runs
one forward whatever its length. Measured with the cost table's own timer
(`cost_table.profile_draft`: greedy, batch 1, fastest of `repeats`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from blockspec.bench.plots import plot_draft_time_vs_drafts
from blockspec.decoding.cost_table import profile_draft
from blockspec.models.chain_draft import AnyDraft, Eagle3Drafter
from blockspec.models.target import TargetModel

# Chain lengths an EAGLE-3 draft is timed at when no block draft sets the range.
DEFAULT_CHAIN_RANGE = 16


def draft_time_curves(target: TargetModel, drafts: Mapping[str, AnyDraft], repeats: int = 3
                      ) -> dict[str, tuple[list[int], list[float]]]:
    """{method: (drafted tokens 1..g, t_draft seconds)}: each block draft up to its own window,
    an EAGLE-3 chain over the same range (the widest block draft's, else 1..16)."""
    blocks = [d.config.num_drafts for d in drafts.values() if not isinstance(d, Eagle3Drafter)]
    top = max(blocks) if blocks else DEFAULT_CHAIN_RANGE
    curves = {}
    for method, draft in drafts.items():
        if isinstance(draft, Eagle3Drafter):
            draft = draft.with_num_drafts(top)
        counts = list(range(1, draft.config.num_drafts + 1))
        curves[method] = (counts, [profile_draft(target, draft, [1], repeats, warmup=1, block=g)[0] for g in counts])
    return curves


def draft_time_report(target: TargetModel, drafts: Mapping[str, AnyDraft], out_dir: Path
                      ) -> tuple[dict[str, Any], list[Path]]:
    """The curves (JSON-ready) and their plot, when an EAGLE-3 or block draft is loaded."""
    if not drafts:
        return {}, []
    curves = draft_time_curves(target, drafts)
    plot = plot_draft_time_vs_drafts(curves, out_dir / "draft_time_vs_drafts.png")
    return {m: {"drafts": c[0], "t_draft_s": c[1]} for m, c in curves.items()}, [plot]
