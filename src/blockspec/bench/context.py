"""Acceptance against context length (issue 34): where in the sequence each round ran.

A request's round i runs with its anchor at position p_i = prompt length + the tokens the
rounds before it produced (sum of accepted + 1), the first token (sampled at prefill) being
the first anchor: p_i is how many positions the draft sees as context. Rounds are grouped by
p_i into the buckets below (tau and per-slot acceptance each, next to the overall figure),
and into equal-width position bins for the plot of tau against context position.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from blockspec.config.draft_attention import SLIDING
from blockspec.metrics import AcceptanceStats
from blockspec.models.checkpoint import load_draft, save_draft
from blockspec.models.draft import DraftModel

# (label, first position, end position or None)
CONTEXT_BUCKETS = (("<512", 0, 512), ("512-2k", 512, 2048), ("2k-8k", 2048, 8192), ("8k+", 8192, None))
PLOT_BINS = 32   # the plot's bins span the longest context seen


def round_positions(prompt_len: int, accepted: Sequence[int]) -> list[int]:
    """The anchor's position (= context length) of each round of one request."""
    out, p = [], prompt_len
    for a in accepted:
        out.append(p)
        p += a + 1
    return out


def bucket_of(position: int) -> str:
    return next(label for label, lo, hi in CONTEXT_BUCKETS if position >= lo and (hi is None or position < hi))


@dataclass
class ContextAcceptance:
    """Rounds by context length: AcceptanceStats per bucket and (position, accepted, verified) for the plot."""

    buckets: dict[str, AcceptanceStats] = field(default_factory=dict)
    rounds: list[tuple[int, int, int]] = field(default_factory=list)

    def add(self, prompt_len: int, accepted: Sequence[int], verified: Sequence[int]) -> None:
        for p, a, n in zip(round_positions(prompt_len, accepted), accepted, verified):
            self.buckets.setdefault(bucket_of(p), AcceptanceStats()).add_round(a, n)
            self.rounds.append((p, a, n))

    def table(self) -> list[dict[str, Any]]:
        """One entry per bucket with rounds, in bucket order: tau and per-slot acceptance."""
        out = []
        for label, _, _ in CONTEXT_BUCKETS:
            stats = self.buckets.get(label)
            if stats is not None and stats.rounds:
                out.append({"context": label, **stats.to_dict()})
        return out

    def tau_by_position(self, bins: int = PLOT_BINS) -> dict[str, list[float]]:
        """Mean tokens per round (tau) over equal-width bins of context position: bin centres,
        tau and rounds per bin (empty bins left out)."""
        if not self.rounds:
            return {"position": [], "tau": [], "rounds": []}
        longest = max(p for p, _, _ in self.rounds) + 1
        width = max(1, math.ceil(longest / bins))
        tokens: dict[int, list[int]] = {}
        for p, a, _ in self.rounds:
            tokens.setdefault(p // width, []).append(a + 1)
        keys = sorted(tokens)
        return {"position": [(k + 0.5) * width for k in keys],
                "tau": [sum(tokens[k]) / len(tokens[k]) for k in keys],
                "rounds": [len(tokens[k]) for k in keys]}


def save_windowed_copy(draft_dir: Path, window: int, out: Path, causal: bool | None = False) -> Path:
    """The draft at `draft_dir` with every layer sliding over `window` positions, same weights,
    saved to `out` (float32): what cutting the context costs a draft not trained with a window.
    causal=False keeps its blocks non-causal as trained (None: the engines' default for
    sliding layers, causal)."""
    draft = load_draft(draft_dir, dtype="float32")
    cfg = dataclasses.replace(draft.config, layer_types=(SLIDING,) * draft.config.num_hidden_layers,
                              sliding_window=window, causal=causal)
    copy = DraftModel(cfg)
    copy.load_state_dict(draft.state_dict())
    save_draft(copy, out)
    return out
