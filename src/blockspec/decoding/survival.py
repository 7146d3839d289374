"""The draft gate's survival curves (`gate.DraftGate`): what each temperature band's
drafting rounds showed of their prefix survival, as a decayed mean next to a prior."""

from __future__ import annotations

import itertools
from typing import Any, Protocol


class CurveTuning(Protocol):
    """What the curves read of `gate.GateTuning`."""

    momentum: float
    explore_rows: int
    prior_rounds: float
    prior_decay: float


class SurvivalCurves:
    """Each temperature band's prefix-survival curve (`DraftGate`'s docstring): per slot,
    decayed sums of measured survival and of request-rounds (each request-round weighs
    momentum ** (1 / per_rows) less per later one), next to a prior worth `prior_rounds`
    request-rounds of prefix survival prior_decay ** (j - 1) at slot j. Plain floats: a
    curve is a window's worth of numbers updated every drafting round, and small tensor
    operations cost ~100 us a round on a CPU (1% of a batch-1 drafting round)."""

    def __init__(self, window: int, tuning: CurveTuning) -> None:
        self.window, self.momentum, self.per_rows = window, tuning.momentum, tuning.explore_rows
        self.prior_rounds = tuning.prior_rounds
        self.prior = [tuning.prior_decay ** j for j in range(window)]
        self.means: dict[int, list[float]] = {}      # band -> [window] mean prefix survival
        self._monotone: dict[int, list[float]] = {}   # band -> `curve(band)`, until it changes
        self._sums: dict[int, list[float]] = {}
        self._weights: dict[int, list[float]] = {}

    def curve(self, band: int) -> list[float]:
        """The band's curve as the planner sees it: slots measured in different rounds are
        made a prefix survival again (never rising); unmeasured: all ones."""
        mean = self.means.get(band)
        if mean is None:
            return [1.0] * self.window
        if band not in self._monotone:
            self._monotone[band] = list(itertools.accumulate(mean, min))
        return self._monotone[band]

    def add(self, band: int, rows: list[list[float]], block: int) -> None:
        """The band's rows' measured prefix survival (n lists of g' floats) over a block of
        `block` >= g' slots (slots g'.. count as 0; slots past the block keep their estimate)."""
        n = len(rows)
        total = [sum(col) for col in zip(*rows)][:block]
        total += [0.0] * (block - len(total))
        if band not in self._sums:
            self._sums[band] = [0.0] * self.window
            self._weights[band] = [0.0] * self.window
        decay = self.momentum ** (n / self.per_rows)
        sums, weights = self._sums[band], self._weights[band]
        for j in range(block):
            sums[j] = decay * sums[j] + total[j]
            weights[j] = decay * weights[j] + n
        self._refresh(band)

    def _refresh(self, band: int) -> None:
        self._monotone.pop(band, None)
        self.means[band] = [(self.prior_rounds * p + s) / (self.prior_rounds + w)
                            for p, s, w in zip(self.prior, self._sums[band], self._weights[band])]

    def state(self, band: int) -> dict[str, list[float]]:
        return {"sums": list(self._sums[band]), "weights": list(self._weights[band])}

    def load(self, band: int, state: dict[str, Any]) -> None:
        self._sums[band] = [float(x) for x in state["sums"]]
        self._weights[band] = [float(x) for x in state["weights"]]
        self._refresh(band)
