"""What rounds really cost against the cost table's prices (docs/design.md section 5.4),
learned from their wall times for the draft gate (`gate.DraftGate`).

The table prices forward passes only, profiled apart from the decoding loop; a round
also pays bookkeeping, sampling and context upkeep, and its kinds pay them differently.
Each kind of round (AR by rows; drafting by drafting rows, and by block length) gets
the median of its latest measured / predicted ratios. On a shared CPU the machine's
speed itself swings (measured on a 2-core virtual machine: stretches of seconds at
0.6x-1.6x the median), and a kind the gate seldom runs (drafting at temperature 1) is
measured at other times than the kind it runs every round: AR rounds timed in a slow
spell then looked dearer than drafting rounds timed in a quiet one, and the gate
drafted where drafting loses, up to every round. So every ratio is kept relative to
the machine's pace at the time (`RoundCosts.pace`: the median of the latest rounds'
ratios over their own kind's), and prices compare kinds as if timed together.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

# Each kind's ratio is the median of this many latest samples: enough that a few slow
# rounds (another process, a page fault) do not tip a decision.
RATIO_SAMPLES = 64
# A kind of round by rows (and block) is priced by its own ratio once this many of its rounds
# were timed, before that by its kind's: a block length drafted once in a quiet (or a busy)
# spell would otherwise look cheap (or dear) on one sample and be chosen (or never tried) for good.
KEY_SAMPLES = 4
# The pace is the median over this many latest rounds: a few tens of milliseconds at batch 1
# on a CPU, shorter than the machine's spells, long enough that one slow round does not move it.
PACE_ROUNDS = 16
# Medians are computed again after this many new samples (or when first asked for), not
# every round: options are priced every few rounds, so a median per round is work that no
# decision reads.
REMEDIAN_SAMPLES = 4

Key = tuple   # (False, rows) | (True, drafting rows) | (True, drafting rows, block) | (kind,)


class RoundCosts:
    """Measured / predicted round-time ratios by kind of round, relative to the machine's
    pace (module docstring). `ratio` is what a kind costs now against the table;
    `learn` takes one timed round; `follow` follows the table being rescaled."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale   # the table's scale the ratios are relative to (`follow`)
        self._samples: dict[Key, deque[float]] = {}   # relative ratios, the latest of each key
        self._median: dict[Key, float] = {}
        self._newer: dict[Key, int] = {}               # samples added since the key's median
        self._pace: deque[float] = deque(maxlen=PACE_ROUNDS)
        self._pace_median = 1.0
        self._pace_newer = 0

    def count(self, key: Key) -> int:
        return len(self._samples.get(key, ()))

    @property
    def pace(self) -> float:
        """The machine's speed now against when the kinds were measured (1: as then)."""
        if self._pace_newer >= REMEDIAN_SAMPLES or (self._pace_newer and len(self._pace) < PACE_ROUNDS):
            self._pace_median = statistics.median(self._pace)
            self._pace_newer = 0
        return self._pace_median

    def ratio(self, drafting: bool, rows: int, block: int | None = None) -> float:
        """Measured / table round time of this kind of round now: its relative ratio by
        drafting rows (or rows) and block, else by rows (each once KEY_SAMPLES of its
        rounds were timed), else by kind (1.0 before any measurement), times the pace."""
        for key in ((drafting, rows, block), (drafting, rows)):
            if self.count(key) >= KEY_SAMPLES:
                return self._relative(key) * self.pace
        for key in ((drafting,), (not drafting,)):
            if key in self._samples:
                return self._relative(key) * self.pace
        return self.pace

    def learn(self, drafting: bool, rows: int, block: int, sample: float, weight: int = 1) -> None:
        """One timed round's measured / predicted ratio (`rows`: drafting rows when drafting);
        weight: how many rounds of its kind it stands for (an AR probe among drafting rounds:
        `gate.PROBE_EVERY`), its relative ratio counted that many times."""
        own: Key = (True, rows, block) if drafting else (False, rows)
        if self.count(own) >= KEY_SAMPLES:   # a kind measured well enough shows the pace
            self._pace.append(sample / self._relative(own))
            self._pace_newer += 1
        relative = sample / self.pace
        # By drafting rows (exploration rounds of a few rows do not stand in for rounds
        # where everyone drafts), and by block length too: their overheads differ.
        for key in ((True, rows), own, (True,)) if drafting else (own, (False,)):
            samples = self._samples.get(key)
            if samples is None:
                samples = self._samples[key] = deque(maxlen=RATIO_SAMPLES)
            samples.extend([relative] * weight)
            self._newer[key] = self._newer.get(key, 0) + weight

    def follow(self, scale: float) -> bool:
        """The table is now rescaled by `scale` in all (`CostTable.scale`): every ratio learned
        against it before is divided by the change, so prices stay as measured. Whether it changed."""
        if scale == self.scale:
            return False
        factor, self.scale = scale / self.scale, scale
        for key, samples in self._samples.items():
            self._samples[key] = deque((x / factor for x in samples), maxlen=RATIO_SAMPLES)
            self._median.pop(key, None)
        return True

    def _relative(self, key: Key) -> float:
        """The median of key's samples, computed when first asked for and again once
        REMEDIAN_SAMPLES samples were added (or while it has fewer than RATIO_SAMPLES / 4)."""
        newer = self._newer.get(key, 0)
        if key not in self._median or newer >= REMEDIAN_SAMPLES or (newer and self.count(key) < RATIO_SAMPLES // 4):
            self._median[key] = statistics.median(self._samples[key])
            self._newer[key] = 0
        return self._median[key]

    def state(self) -> list[list[Any]]:
        return [[list(key), list(samples)] for key, samples in self._samples.items()]

    def load(self, ratios: list[list[Any]]) -> None:
        for key, samples in ratios:
            self._samples[tuple(key)] = deque(samples, maxlen=RATIO_SAMPLES)
            self._median.pop(tuple(key), None)
