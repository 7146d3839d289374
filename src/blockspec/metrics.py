"""Acceptance and calibration metrics of speculative rounds, shared by training, bench and decoding.

Conventions
-----------
A verify *round* of one request verifies ``num_drafts`` draft tokens, accepts a
prefix of ``accepted`` of them (``0 <= accepted <= num_drafts``) and always emits
one bonus token, so it produces ``accepted + 1`` tokens.  ``tau`` is the mean
number of tokens per round, bonus token included.

A DSpark confidence head outputs a probability ``c_k`` per draft slot; the prefix
survival ``s_k = prod_{j<=k} c_j`` predicts the outcome ``accepted >= k`` (see
:func:`survival` and :func:`prefix_outcomes`).

``tau = (accepted drafts + rounds) / rounds`` (:func:`tau`) is THE tau formula of the
package (docs/design.md section 1); every other tau is computed with it.

The round observer that calibration (bench and STS training) reads its rounds from,
``RoundRecorder``, lives with `generate` (decoding/generate.py); it scores with these.

Everything here is pure Python / numpy; torch is not needed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "tau",
    "AcceptanceStats",
    "calibration",
    "survival",
    "prefix_outcomes",
]


def tau(accepted_drafts: int, rounds: int, empty: float = float("nan")) -> float:
    """Mean tokens per round, bonus token included: ``(accepted drafts + rounds) / rounds``.

    ``accepted_drafts`` is the total over the ``rounds`` rounds; ``empty`` is returned
    when no round was run (``nan`` by default; reports that need a number pass 0.0)."""
    return (accepted_drafts + rounds) / rounds if rounds else empty


def _check_round(accepted: int, num_drafts: int) -> tuple[int, int]:
    if isinstance(accepted, bool) or isinstance(num_drafts, bool):
        raise ValueError("accepted and num_drafts must be integers, not bool")
    try:
        a, n = int(accepted), int(num_drafts)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"accepted/num_drafts must be integers: {accepted!r}, {num_drafts!r}") from exc
    if a != accepted or n != num_drafts:
        raise ValueError(f"accepted/num_drafts must be integers: {accepted!r}, {num_drafts!r}")
    if n < 0:
        raise ValueError(f"num_drafts must be >= 0, got {n}")
    if not 0 <= a <= n:
        raise ValueError(f"accepted must satisfy 0 <= accepted <= num_drafts, got accepted={a}, num_drafts={n}")
    return a, n


@dataclass
class AcceptanceStats:
    """Accumulator of verify rounds.

    ``counts[(num_drafts, accepted)]`` is the number of rounds that verified
    ``num_drafts`` drafts and accepted ``accepted`` of them.
    """

    counts: Counter = field(default_factory=Counter)

    def add_round(self, accepted: int, num_drafts: int) -> None:
        """Record one round; raises ``ValueError`` unless ``0 <= accepted <= num_drafts``."""
        a, n = _check_round(accepted, num_drafts)
        self.counts[(n, a)] += 1

    def add_rounds(self, accepted: Sequence[int], num_drafts: int | Sequence[int]) -> None:
        """Record many rounds; ``num_drafts`` may be a scalar or a per-round sequence."""
        if isinstance(num_drafts, (int, np.integer)):
            nd: Sequence[int] = [int(num_drafts)] * len(accepted)
        else:
            nd = num_drafts
            if len(nd) != len(accepted):
                raise ValueError("accepted and num_drafts must have the same length")
        for a, n in zip(accepted, nd):
            self.add_round(a, n)

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """Add ``other``'s rounds into ``self`` (in place) and return ``self``."""
        if not isinstance(other, AcceptanceStats):
            raise TypeError(f"can only merge AcceptanceStats, got {type(other).__name__}")
        self.counts.update(other.counts)
        return self

    # ------------------------------------------------------------------ summaries
    @property
    def rounds(self) -> int:
        """Number of recorded rounds."""
        return int(sum(self.counts.values()))

    @property
    def accepted(self) -> int:
        """Total accepted drafts over rounds."""
        return int(sum(a * c for (_, a), c in self.counts.items()))

    @property
    def tokens(self) -> int:
        """Total produced tokens, ``sum(accepted + 1)`` over rounds."""
        return self.accepted + self.rounds

    @property
    def drafted_share(self) -> float:
        """Share of rounds that verified at least one draft (the rest were AR rounds); ``nan`` when empty."""
        drafted = sum(c for (n, _), c in self.counts.items() if n > 0)
        return drafted / self.rounds if self.rounds else math.nan

    @property
    def max_drafts(self) -> int:
        """Largest ``num_drafts`` seen (0 when empty)."""
        return max((n for (n, _), c in self.counts.items() if c), default=0)

    @property
    def tau(self) -> float:
        """Mean tokens per round including the bonus token; ``nan`` when empty."""
        return tau(self.accepted, self.rounds)

    def histogram(self) -> list[int]:
        """Counts of rounds by accepted length ``0..max_drafts`` (``[]`` when empty)."""
        if not self.rounds:
            return []
        hist = [0] * (self.max_drafts + 1)
        for (_, a), c in self.counts.items():
            hist[a] += c
        return hist

    def per_slot_acceptance(self) -> list[float]:
        """Conditional acceptance rate per draft slot.

        Entry ``k`` (slot ``k+1``) is ``#(accepted >= k+1) /
        #(num_drafts >= k+1 and accepted >= k)``, i.e. the probability that draft
        ``k+1`` is accepted given that it was verified and drafts ``1..k`` were
        accepted.  ``nan`` where the slot was never reached.
        """
        out: list[float] = []
        for k in range(self.max_drafts):
            num = sum(c for (_, a), c in self.counts.items() if a >= k + 1)
            den = sum(c for (n, a), c in self.counts.items() if n >= k + 1 and a >= k)
            out.append(num / den if den else float("nan"))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary; ``nan`` values are emitted as ``None``."""
        return {
            "rounds": self.rounds,
            "tokens": self.tokens,
            "tau": _json_float(self.tau),
            "histogram": self.histogram(),
            "per_slot": [_json_float(x) for x in self.per_slot_acceptance()],
        }


def _json_float(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


# ---------------------------------------------------------------------- calibration
def _auroc(pred: np.ndarray, y: np.ndarray) -> float:
    """Mann-Whitney AUROC with average ranks (ties count 0.5); ``nan`` for one class."""
    n_pos = int(y.sum())
    n_neg = int(len(y) - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(pred, kind="mergesort")
    sorted_pred = pred[order]
    ranks = np.empty(len(pred), dtype=np.float64)
    i = 0
    n = len(pred)
    while i < n:
        j = i
        while j + 1 < n and sorted_pred[j + 1] == sorted_pred[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0  # average 1-based rank of the tie group
        i = j + 1
    rank_sum_pos = float(ranks[y == 1].sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def calibration(pred: Sequence[float], outcome: Sequence[int | bool], bins: int = 10) -> dict[str, Any]:
    """Calibration of probabilistic predictions against binary outcomes.

    Returns a dict with ``ece`` (equal-width bins on [0, 1], each bin's
    ``|mean_pred - frac_pos|`` weighted by its share of samples; a prediction of
    exactly 1.0 falls in the last bin), ``brier`` (mean squared error), ``auroc``
    (rank-based, ties 0.5, ``nan`` with one class), ``n`` and ``reliability``
    (one dict per bin: ``lo``, ``hi``, ``count``, ``mean_pred``, ``frac_pos``;
    the last two are ``None`` for empty bins).
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    y_raw = np.asarray(outcome).reshape(-1)
    if p.shape != y_raw.shape:
        raise ValueError(f"pred and outcome lengths differ: {p.size} vs {y_raw.size}")
    if p.size == 0:
        raise ValueError("calibration needs at least one sample")
    if not np.all(np.isfinite(p)) or np.any(p < 0.0) or np.any(p > 1.0):
        raise ValueError("predictions must be finite probabilities in [0, 1]")
    y = y_raw.astype(np.float64)
    if not np.all((y == 0.0) | (y == 1.0)):
        raise ValueError("outcomes must be 0/1 or bool")

    n = int(p.size)
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    reliability: list[dict[str, Any]] = []
    ece = 0.0
    for b in range(bins):
        mask = idx == b
        cnt = int(mask.sum())
        entry: dict[str, Any] = {"lo": b / bins, "hi": (b + 1) / bins, "count": cnt,
                                 "mean_pred": None, "frac_pos": None}
        if cnt:
            mp = float(p[mask].mean())
            fp = float(y[mask].mean())
            entry["mean_pred"], entry["frac_pos"] = mp, fp
            ece += cnt / n * abs(mp - fp)
        reliability.append(entry)

    return {
        "ece": float(ece),
        "brier": float(np.mean((p - y) ** 2)),
        "auroc": float(_auroc(p, y)),
        "n": n,
        "reliability": reliability,
    }


def survival(confidences: Sequence[float]) -> list[float]:
    """Prefix survival ``s_k = prod_{j<=k} c_j`` for per-slot confidences in [0, 1]."""
    out: list[float] = []
    s = 1.0
    for c in confidences:
        c = float(c)
        if not (0.0 <= c <= 1.0):
            raise ValueError(f"confidence must be in [0, 1], got {c}")
        s *= c
        out.append(s)
    return out


def prefix_outcomes(accepted: int, num_drafts: int) -> list[int]:
    """For ``k = 1..num_drafts``: 1 if ``accepted >= k`` else 0 (target of ``s_k``)."""
    a, n = _check_round(accepted, num_drafts)
    return [1 if a >= k else 0 for k in range(1, n + 1)]
