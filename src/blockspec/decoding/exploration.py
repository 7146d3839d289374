"""When the draft gate (`gate.DraftGate`) explores: each temperature band's wait between
explorations, backed off while they find nothing, and the credit they spend."""

from __future__ import annotations

import random
from typing import Any

# A fruitless exploration doubles the band's interval, up to this many times explore_every
# (512 rounds: four requests of 128 tokens at batch 1, the wait carried across calls by the
# policy's memory): where drafting never pays (sampling at batch 1 on a CPU) exploring costs
# ~0.3% of its rounds; at 16x explorations were 1% of the rounds of a CPU loop of calls at
# temperature 1 (HumanEval 164), each a drafting round that lost to AR. A band whose exploration
# finds drafting pays drafts every round from then on, measured by every round.
MAX_BACKOFF = 64
# ... and for the greedy band, up to this many: greedy acceptance changes with the text
# (a novel start, then repetition where the draft is accepted whole), so it is checked
# several times per request (128 rounds between explorations is a whole request at batch 1:
# measured, every exploration of a loop of requests fell in their novel starts).
GREEDY_MAX_BACKOFF = 4
GREEDY_BAND = 0   # `config.temperature_band` of greedy rows
# A sampled band's exploration drafts up to one slot past the last whose survival is at
# least this (at least EXPLORE_MIN_SLOTS): sampled acceptance is low and steady, a slot few
# rounds reach is rarely measured by verifying it, and verifying it costs every exploration
# (at temperature 1 at batch 1 on a CPU, full 16-slot explorations were most of what the
# adaptive policy lost to AR). The greedy band explores the full window (its tail is
# reached whole once the text repeats).
EXPLORE_FLOOR = 0.05
EXPLORE_MIN_SLOTS = 2
# Explorations spend credit that every round adds EXPLORE_BUDGET of (up to EXPLORE_CREDIT):
# an exploration costs the rounds it takes beyond the round chosen, divided by what it could
# win at most (`gate.DraftGate.exploration_cost`: the explored rows accepting at least
# `GateTuning.best_case_share` of their drafts; below 1x, as where drafting rarely pays), so it
# takes at most a tenth of the time where it could win a lot (the greedy band at batch 1) and
# much less where it could win little: at 16 rows, half of them greedy, on a CPU, each greedy
# exploration took 6 AR rounds' time, and they took half of the wall time.
# What an exploration could win at most is divided by its band's
# backoff level, at most MAX_LEVEL (`ExplorationSchedule.level`: each fruitless exploration
# makes a win that large less likely; 1 while the band is due, its rows having accepted a
# whole block). At batch 1 that bound is several times the cost and nothing changes; at 32 greedy rows on a
# CPU, where every exploration lost (4 rows drafting the full window: 3 AR rounds' time, a
# 1.8x win at best by the gate's own prices), the credit let one run every ~30 rounds, ~7%
# of the time, and the rows they sped ahead left their slots early, so the batch drained
# unevenly at the end.
EXPLORE_BUDGET = 0.1
EXPLORE_CREDIT = 4.0
MAX_LEVEL = 4


def sampled_explore_block(curve: list[float], block_choices: list[int]) -> int:
    """The block a sampled band's exploration drafts: the shortest of `block_choices` (the
    last: the window) reaching one slot past the last slot of `curve` whose survival is at
    least EXPLORE_FLOOR, and at least EXPLORE_MIN_SLOTS."""
    reached = next((j for j, x in enumerate(curve) if x < EXPLORE_FLOOR), len(curve))
    want = max(EXPLORE_MIN_SLOTS, reached + 1)
    return next((s for s in block_choices if s >= want), block_choices[-1])


def credit_cost(trial_s: float, chosen_s: float, gain: float, level: int) -> float | None:
    """What an exploration round of `trial_s` seconds, instead of the chosen round of
    `chosen_s`, costs in credit: the chosen rounds its time exceeds them by, over the most it
    could win (`gain`: its best case's rate over the chosen one's, less 1) divided by the
    band's backoff `level`, at best 1x; None where `gain` <= 0: exploring could not change
    what is chosen."""
    if gain <= 0.0:
        return None
    return max(0.0, trial_s / chosen_s - 1.0) / min(1.0, gain / level)


class ExplorationSchedule:
    """When each temperature band explores: a band that does not draft, or drafts a
    shorter block, drafts its exploration block (`gate.DraftGate.explore_block`: the full
    window for the greedy band, as far as the curve reaches for a sampled one) again after
    `every` rounds, each fruitless exploration doubling its interval up to MAX_BACKOFF x
    (GREEDY_MAX_BACKOFF x for the greedy band), so a load where drafting never pays spends
    little on it; each wait is jittered (the draw numbered by the schedule's explorations:
    a generator seeded anew by each call of a loop made every wait its first draw). A band
    whose rows accepted a whole block is due at once: acceptance changes within a request
    (greedy text turning repetitive after a novel start), and a backed-off interval of 128
    rounds is a whole request. Explorations spend credit (EXPLORE_BUDGET per round, up to EXPLORE_CREDIT) by
    their cost over what they could win at most divided by the band's `level`.

    State per band: rounds since it last measured its exploration block (`skipped`), its
    current interval (`interval`), bands due at once (`due`); in all: the credit left and
    the jitter draws made (`draws`), kept across calls too (`shared_state` / `load_shared`):
    a call that started with full credit let an exploration run whatever the last one cost,
    so a loop of short calls never met the budget."""

    def __init__(self, every: int, *, jitter: bool = True, seed: int = 0) -> None:
        self.every, self.jitter, self.seed = every, jitter, seed
        self.skipped: dict[int, int] = {}
        self.interval: dict[int, int] = {}
        self.due: set[int] = set()
        self.credit = EXPLORE_CREDIT
        self.draws = 0

    def measured(self, band: int) -> None:
        """The band drafts at least its exploration block this round: nothing to explore."""
        self.skipped[band], self.interval[band] = 0, self.every
        self.due.discard(band)

    def tick(self, band: int) -> bool:
        """Another round without the band's exploration block: whether it is to explore
        (its wait ran out, or it is due) and there is credit for it."""
        self.skipped[band] = self.skipped.get(band, 0) + 1
        waited = self.skipped[band] >= self.interval.get(band, self.every) or band in self.due
        return waited and self.credit >= 0.0

    def explored(self, band: int, cost: float) -> None:
        """The band explores now (or was found not worth exploring, at cost 0): a wait that ran
        out doubles the next, which starts up to half counted (jitter)."""
        interval = self.interval.get(band, self.every)
        if band not in self.due:
            cap = GREEDY_MAX_BACKOFF if band == GREEDY_BAND else MAX_BACKOFF
            interval = self.interval[band] = min(2 * interval, cap * self.every)
        self.skipped[band] = self._jitter(interval // 2 + 1) if self.jitter else 0
        self.due.discard(band)
        self.credit -= cost

    def level(self, band: int) -> int:
        """How far the band's explorations backed off (its interval over `every`, at most
        MAX_LEVEL); 1 while it is due (its rows accepted a whole block)."""
        if band in self.due:
            return 1
        return min(self.interval.get(band, self.every) // self.every, MAX_LEVEL)

    def refill(self) -> None:
        """A round passed."""
        self.credit = min(EXPLORE_CREDIT, self.credit + EXPLORE_BUDGET)

    def _jitter(self, n: int) -> int:
        """The next jitter draw, in [0, n): the `draws`-th of this seed's sequence."""
        self.draws += 1
        return random.Random(f"{self.seed}:{self.draws}").randrange(n)

    def state(self, band: int) -> dict[str, int]:
        return {"skipped": self.skipped.get(band, 0), "interval": self.interval.get(band, self.every)}

    def load(self, band: int, state: dict[str, Any]) -> None:
        self.skipped[band], self.interval[band] = int(state["skipped"]), int(state["interval"])

    def shared_state(self) -> dict[str, float]:
        """What is not per band: the credit left and the jitter draws made."""
        return {"credit": self.credit, "draws": self.draws}

    def load_shared(self, state: dict[str, Any]) -> None:
        self.credit, self.draws = min(EXPLORE_CREDIT, float(state["credit"])), int(state["draws"])
