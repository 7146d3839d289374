"""The draft gate (docs/design.md section 5): which running requests draft this round,
and how long a block, from measured costs and measured acceptance.

Rows come ordered by temperature band (greedy first: `config.temperature_band`), so
a round's drafting rows are always the first k: the gate weighs "the first b bands
draft a block of s slots" against a plain AR round and picks the best expected
tokens per second.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.exploration import GREEDY_BAND, ExplorationSchedule, credit_cost, sampled_explore_block
from blockspec.decoding.planner import admit
from blockspec.decoding.round_costs import RoundCosts
from blockspec.decoding.survival import SurvivalCurves
from blockspec.errors import BlockspecError

Groups = tuple[tuple[int, int], ...]   # (band, rows) runs in row order
# The best option is priced again after this many rounds (or at once when a curve or the
# table changed): new round times move a median of 64 samples only slowly, and pricing
# every option every round cost ~1% of a batch-1 AR round on a CPU.
RECHOOSE_ROUNDS = 8
# A drafting round's measurement moves its band's curve a little (a decayed mean over ~80
# request-rounds); the options are priced again at once only when the curve's expected
# tokens moved by this share since they were priced (a new curve, a run of misses), else at
# the next RECHOOSE_ROUNDS: pricing them after every drafting round cost ~0.5% of one.
REPRICE_SHIFT = 0.025
# While rows draft every round, AR rounds are not timed, and the AR price is the one learned
# before, against the machine's pace of then. Where drafting wins by less than PROBE_MARGIN,
# one round in PROBE_EVERY is an AR round (a probe, lossless like every AR round), timed
# beside the drafting rounds and counted for the PROBE_EVERY rounds it stands for. Without
# it, a CPU loop of calls at temperature 1 drafted every round for a third of its calls at
# tau 1.5, its AR price 1.1-1.6x what its AR rounds then took, 0.85x AR in all.
# Where drafting seems to win by more, a probe still runs once in PROBE_STALE drafting rounds:
# the prices of kinds are relative to the machine's pace, and while one kind runs alone the
# pace is read from that kind only, so an error in the pace when drafting took over (the
# machine sped up or slowed between the last AR rounds and the first drafting ones: on a
# shared 2-core VM, 0.6-1.6x within seconds) stays in AR's price for as long as rows draft,
# and is kept across calls; past PROBE_MARGIN it is never corrected. Measured: an engine at
# temperature 1 and 1 row, started with what greedy engines of the process had learned,
# drafted every round at 0.92x AR through 9 runs. One AR round in 64 costs ~0.5% where
# drafting wins 3x.
PROBE_EVERY = 16
PROBE_MARGIN = 0.25
PROBE_STALE = 64


@dataclass(frozen=True)
class Option:
    """One way to run the next round: the first `rows` rows draft `block` slots (0, 0: AR)."""

    rows: int
    block: int
    tokens: float        # expected committed tokens
    table_s: float       # the table's price of the round


def band_groups(bands: Sequence[int]) -> Groups:
    """Runs of equal bands in row order: [0, 0, 2] -> ((0, 2), (2, 1))."""
    out: list[list[int]] = []
    for band in bands:
        if out and out[-1][0] == band:
            out[-1][1] += 1
        else:
            out.append([band, 1])
    return tuple((b, n) for b, n in out)


class ArProbes:
    """AR probes while rows draft (PROBE_EVERY, PROBE_MARGIN, PROBE_STALE): the drafting
    rounds counted per batch make-up since its last AR round, and whether the round decided
    last is a probe (its time is weighed as the PROBE_EVERY rounds it stands for)."""

    def __init__(self) -> None:
        self.drafted: dict[Groups, int] = {}   # drafting rounds since the last AR round
        self.probing = False

    def due(self, groups: Groups, drafting: bool, wins_by_margin: Callable[[], bool]) -> bool:
        """Whether this round is an AR probe instead of the chosen option (`drafting`: it drafts);
        wins_by_margin (asked only when needed): drafting beats AR by more than PROBE_MARGIN."""
        self.probing = False
        if not drafting:
            self.drafted[groups] = 0
            return False
        drafted = self.drafted[groups] = self.drafted.get(groups, 0) + 1
        if drafted % PROBE_EVERY or (drafted < PROBE_STALE and wins_by_margin()):
            return False
        self.drafted[groups] = 0
        self.probing = True
        return True

    def forget(self) -> None:
        """Drop every batch make-up's count (the gate's make-up cache was reset)."""
        self.drafted.clear()

    def take(self, drafting_rows: int) -> bool:
        """Whether the round just finished is the probe decided last (an AR round); clears it."""
        probe, self.probing = self.probing and drafting_rows == 0, False
        return probe


@dataclass(frozen=True, kw_only=True)
class GateTuning:
    """The draft gate's learning and exploration constants (`DraftGate`'s docstring):
    curve momentum per request-round group, exploration interval and rows, the share
    of its drafts an exploration's best case has its rows accept (`exploration_cost`: the
    fixed windows of the shipped drafts accept a third to a half of theirs on greedy text;
    priced with every draft accepted, explorations ran at 16 and 32 greedy rows on a CPU,
    where drafting only ties AR, and the default trailed AR: 0.89x and 0.94-0.96x), hysteresis,
    the weight of the prior in request-rounds and its per-slot decay (the prior's prefix
    survival at slot j is prior_decay ** (j - 1): full survival at every slot made one
    fruitless round look like survival 1/3 at all 15 slots, 6 expected tokens, and a
    fresh policy drafted several rounds more where nothing was accepted); jitter: each
    wait between explorations is drawn from its interval's upper half (a gate-owned
    generator seeded by `seed`), so explorations do not fall at the same point of
    requests as long as the interval (they measured the same phase every time)."""

    momentum: float = 0.95
    explore_every: int = 8
    explore_rows: int = 4
    best_case_share: float = 0.5
    hysteresis: float = 0.05
    prior_rounds: float = 0.5
    prior_decay: float = 0.8
    jitter: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.explore_every < 1:
            raise BlockspecError("explore_every must be >= 1")
        if not 0.0 <= self.hysteresis < 1.0:
            raise BlockspecError(f"hysteresis must be in [0, 1), got {self.hysteresis!r}")
        if not 0.0 < self.best_case_share <= 1.0:
            raise BlockspecError(f"best_case_share must be in (0, 1], got {self.best_case_share!r}")
        if not 0.0 < self.prior_decay <= 1.0:
            raise BlockspecError(f"prior_decay must be in (0, 1], got {self.prior_decay!r}")


class DraftGate:
    """Which running requests draft this round (all, none, the first bands, or a few to
    explore), and how long a block they draft (docs/design.md section 5.4).

    Options: a plain AR round (every request verifies its anchor only) or "the first b bands
    draft a block of s slots", for every block length the table has draft times for
    (`CostTable.draft_slot_counts`; a shorter block costs less and keeps the likeliest
    slots), each priced by `admit` (the planner's rule) with every drafting row showing its
    band's survival curve, draft time counted; the best expected tokens per second wins.
    Hysteresis: the option chosen last keeps winning unless another is `hysteresis` faster,
    so equal loads do not flap between AR and drafting.

    Acceptance is learned per temperature band (`survival.SurvivalCurves`), since greedy rows
    accept far more than sampled ones. Exploration (`exploration.ExplorationSchedule`): an
    unmeasured band drafts first (its first `explore_rows` rows, the full block, the bands
    before it drafting too); a band that does not draft, or drafts a shorter block, now and
    then drafts its exploration block (`explore_block`), paying credit by its cost over what
    it could win at most (`exploration_cost`); none runs where it could not win.

    The table prices forward passes only; `observe` feeds back each round's wall time, and
    each option's price is scaled by what its kind of round measured against the table,
    relative to the machine's pace (`round_costs.RoundCosts`). warm_ar_rounds: AR rounds run
    before the first decision, so AR is priced by measurement; while rows draft every round,
    AR is timed again now and then by a probe (`ArProbes`).

    Decisions use only past rounds, never the current round's draws, and undrafted rows are
    lossless AR steps, so the output distribution is unchanged. full_window: the drafting
    rows verify every draft of their block (DFlash, DSpark unscheduled), not planned lengths."""

    def __init__(self, table: CostTable, window: int, *, min_survival: float = 0.0, full_window: bool = False,
                 warm_ar_rounds: int = 0, tuning: GateTuning | None = None) -> None:
        if window < 1:
            raise BlockspecError("the draft window must be >= 1")
        tuning = tuning or GateTuning()
        self.full_window, self.hysteresis = full_window, tuning.hysteresis
        self.warm_ar_rounds = warm_ar_rounds
        self.table, self.window = table, window
        self.explore_rows, self.best_case_share = tuning.explore_rows, tuning.best_case_share
        self.survival = SurvivalCurves(window, tuning)
        self.exploration = ExplorationSchedule(tuning.explore_every, jitter=tuning.jitter, seed=tuning.seed)
        self.min_survival = min_survival
        # Block lengths to price: the table's measured ones below the window, and the window.
        self.block_choices = [s for s in table.draft_slot_counts if s < window] + [window]
        self._explore: dict[int, int] = {}            # band -> `explore_block(band)`, until the curve changes
        self._options: dict[Groups, list[Option]] = {}   # until a curve or the costs change
        self._priced: dict[int, float] = {}   # band -> its curve's expected tokens when options were priced
        self._stale = False   # curves moved (less than REPRICE_SHIFT) since the options were priced
        self._last: dict[Groups, tuple[int, int]] = {}   # the option chosen last, per batch make-up
        self._groups: dict[tuple[int, ...], Groups] = {}   # band_groups of the bands seen
        self._age: dict[Groups, int] = {}   # rounds since that choice was priced (RECHOOSE_ROUNDS)
        self.probes = ArProbes()
        self.costs = RoundCosts(table.scale)   # measured / predicted round times by kind of round

    # -- pricing --------------------------------------------------------------------
    def cost_ratio(self, drafting: bool, rows: int, block: int | None = None) -> float:
        """Measured / table round time for this kind of round (`RoundCosts.ratio`)."""
        self.follow_table()
        return self.costs.ratio(drafting, rows, block)

    def rate(self, option: Option, rows: int) -> float:
        """Expected tokens per second of `option` for a batch of `rows` rows."""
        drafting = option.rows > 0
        ratio = self.cost_ratio(drafting, option.rows if drafting else rows, option.block if drafting else None)
        return option.tokens / (option.table_s * ratio)

    @property
    def curves(self) -> dict[int, torch.Tensor]:
        """band -> [window] mean prefix survival (float64), for the bands measured so far."""
        return {band: torch.tensor(mean, dtype=torch.float64) for band, mean in self.survival.means.items()}

    def curve(self, band: int) -> list[float]:
        """The band's survival curve as the planner sees it (`SurvivalCurves.curve`)."""
        return self.survival.curve(band)

    def options(self, groups: Groups) -> list[Option]:
        """AR first, then every (first b bands draft, block length) option, priced by the
        table (memoised until a curve moved by REPRICE_SHIFT, or at the next regular pricing)."""
        if groups in self._options:
            return self._options[groups]
        for band, _ in groups:
            self._priced.setdefault(band, 1.0 + sum(self.curve(band)))
        rows = sum(n for _, n in groups)
        times = self.table.times_upto(rows * (self.window + 1))
        out = [Option(0, 0, float(rows), times[rows])]
        drafting, curves = 0, []
        for band, n in groups:
            drafting += n
            curves.append((self.curve(band), n))
            for block in self.block_choices:
                t_draft = self.table.draft_time(drafting, block=block)
                if self.full_window:
                    tokens = rows + sum(n_ * sum(c[:block]) for c, n_ in curves)
                    verified = drafting * block
                else:   # plan() for these rows: slots in descending survival (each curve is already)
                    runs = [[x for x in c[:block] for _ in range(n_)] for c, n_ in curves]
                    slots = runs[0] if len(runs) == 1 else list(heapq.merge(*runs, reverse=True))
                    verified, tokens = admit(slots, rows, times, t_draft, self.min_survival)
                out.append(Option(drafting, block, tokens, t_draft + times[rows + verified]))
        self._options[groups] = out
        return out

    # -- deciding -------------------------------------------------------------------
    def decide(self, bands: int | Sequence[int]) -> tuple[int, int]:
        """(first k rows that draft, block length in drafts) for rows of these temperature
        bands (an int: that many greedy rows); (0, 0) is an AR round."""
        bands = (0,) * bands if isinstance(bands, int) else tuple(bands)
        rows = len(bands)
        self.follow_table()
        if not self.table.has_draft_times or rows == 0:
            return rows, self.window
        groups = self._groups.get(bands)
        if groups is None:
            if len(self._groups) >= 1024:   # an engine's batch make-ups come and go
                self._groups.clear()
                self.probes.forget()
            groups = self._groups[bands] = band_groups(bands)
        start = 0
        for band, n in groups:
            if band not in self.survival.means:   # measure it first
                return start + min(n, self.explore_rows), self.window
            start += n
        if self.costs.count((False,)) < self.warm_ar_rounds:   # price AR rounds before trusting the table
            return 0, 0
        choice = self._choose(groups, rows)
        k, block = choice
        self.exploration.refill()
        if self.probes.due(groups, k > 0, lambda: self._wins_by_margin(groups, rows, choice)):
            return 0, 0
        start = 0
        for band, n in groups:
            drafting = start < k
            explore = self.explore_block(band)
            if drafting and block >= explore:   # its curve is being measured as far as exploring would
                self.exploration.measured(band)
                start += n
                continue
            # A band drafting a shorter block, or the first band that does not draft:
            # now and then it drafts its exploration block, so the slots it does not
            # draft (or all of them) are measured again.
            if self.exploration.tick(band):
                trial = (k, max(block, explore)) if drafting else (start + min(n, self.explore_rows), explore)
                cost = self.exploration_cost(groups, choice, trial, start + n, self.exploration.level(band), band)
                self.exploration.explored(band, 0.0 if cost is None else cost)
                if cost is not None:
                    return trial
            if not drafting:
                break
            start += n
        return choice

    def _wins_by_margin(self, groups: Groups, rows: int, choice: tuple[int, int]) -> bool:
        """Whether `choice` (a drafting option) is priced PROBE_MARGIN faster than AR."""
        options = self.options(groups)
        chosen = next(o for o in options if (o.rows, o.block) == choice)
        return self.rate(chosen, rows) >= (1.0 + PROBE_MARGIN) * self.rate(options[0], rows)

    def exploration_cost(self, groups: Groups, choice: tuple[int, int], trial: tuple[int, int],
                         prefix: int, level: int = 1, band: int = GREEDY_BAND) -> float | None:
        """What exploring `trial` (k rows drafting a block) instead of `choice` costs, in credit
        (`exploration.credit_cost`), its best case being the trial rows, or the bands up to
        `prefix` rows, drafting `trial`'s block, each slot surviving as `band`'s curve says or
        with `best_case_share`, whichever is more; None where even that would not beat `choice`."""
        rows = sum(n for _, n in groups)
        block = trial[1]
        row_tokens = sum(max(x, self.best_case_share) for x in self.curve(band)[:block])   # each drafting row's
        chosen = next(o for o in self.options(groups) if (o.rows, o.block) == choice)
        chosen_s = chosen.table_s * self.cost_ratio(chosen.rows > 0, chosen.rows or rows,
                                                    chosen.block if chosen.rows else None)

        def best_case(k: int) -> tuple[float, float]:   # (tokens/s, round seconds) with k rows drafting
            seconds = ((self.table.draft_time(k, block=block) + self.table.time(rows + k * block))
                       * self.cost_ratio(True, k, block))
            return (rows + k * row_tokens) / seconds, seconds

        trial_rate, trial_s = best_case(trial[0])
        best = max(trial_rate, best_case(prefix)[0])
        return credit_cost(trial_s, chosen_s, best * chosen_s / chosen.tokens - 1.0, level)

    def explore_block(self, band: int) -> int:
        """The block a band's exploration drafts: the full window for the greedy band (and
        an unmeasured one), else as far as its curve reaches (`exploration.sampled_explore_block`)."""
        if band == GREEDY_BAND or band not in self.survival.means:
            return self.window
        if band not in self._explore:
            self._explore[band] = sampled_explore_block(self.curve(band), self.block_choices)
        return self._explore[band]

    def _choose(self, groups: Groups, rows: int) -> tuple[int, int]:
        """The best option (hysteresis: the last one unless another is clearly faster),
        priced again every RECHOOSE_ROUNDS rounds of this batch make-up."""
        last = self._last.get(groups)
        if last is not None and groups in self._age and self._age[groups] + 1 < RECHOOSE_ROUNDS:
            self._age[groups] += 1
            return last
        if self._stale:   # the curves moved a little since the options were priced
            self._forget_prices()
        self._age[groups] = 0
        options = self.options(groups)
        rates = {(o.rows, o.block): self.rate(o, rows) for o in options}
        best = max(rates, key=lambda key: rates[key])
        if last is not None and last in rates and rates[last] * (1 + self.hysteresis) >= rates[best]:
            best = last
        self._last[groups] = best
        return best

    # -- learning -------------------------------------------------------------------
    def observe(self, rows: int, drafting_rows: int, block: int, verified_drafts: int, seconds: float, *,
                cold: bool = False) -> float:
        """A finished round's wall time: `rows` running requests, of which the first
        `drafting_rows` drafted a block of `block` drafts, verifying `verified_drafts` drafts in all.
        Returns the round's measured / predicted time; cold: a round that paid one-time
        costs (the first of its kind in a process or call), returned but not learned."""
        self.follow_table()
        predicted = self.table.time(rows + verified_drafts)
        ratio_sample = seconds / max(predicted + (self.table.draft_time(drafting_rows, block=block)
                                                  if drafting_rows else 0.0), 1e-9)
        probe = self.probes.take(drafting_rows)
        if not cold:
            self.costs.learn(drafting_rows > 0, drafting_rows or rows, block, ratio_sample,
                             weight=PROBE_EVERY if probe else 1)
        return ratio_sample

    def times_every_ar_round(self) -> bool:
        """Whether the next AR round's time is needed: an AR probe's (weighed against the
        drafting rounds around it), or AR rounds' while they warm the prices up."""
        return self.probes.probing or self.costs.count((False,)) < self.warm_ar_rounds

    def follow_table(self) -> None:
        """The table was rescaled (by any policy of it: a process's engines and `generate`
        calls share a cached table): the ratios follow it and options are priced again."""
        if self.costs.follow(self.table.scale):
            self._forget_prices()

    def _forget_prices(self) -> None:
        """Curves or costs changed: options are priced (and chosen) again."""
        self._options.clear()
        self._age.clear()
        self._priced.clear()
        self._stale = False

    def _curve_moved(self, band: int) -> None:
        """The band's curve changed: price the options again now if its expected tokens moved
        by REPRICE_SHIFT since they were priced (or it was not priced), else at the next
        regular pricing (RECHOOSE_ROUNDS)."""
        priced = self._priced.get(band)
        if priced is None or abs(1.0 + sum(self.curve(band)) - priced) > REPRICE_SHIFT * priced:
            self._forget_prices()
        else:
            self._stale = True

    def update(self, survival: torch.Tensor | list[list[float]], block: int | None = None,
               bands: Sequence[int] | None = None) -> None:
        """Record a drafting round's prefix survival [k, g'] (a tensor or k lists) over a
        block of `block` >= g' slots (default g'; DSpark may stop sampling before the block's
        end: its slots g'.. count as 0) for rows of these bands (default greedy); slots past
        the block keep their estimate."""
        rows = survival.tolist() if isinstance(survival, torch.Tensor) else survival
        if not rows or not rows[0]:
            return
        g = len(rows[0])
        block = min(g if block is None else block, self.window)
        band_of = list(bands[:len(rows)]) if bands is not None else [0] * len(rows)
        for band in sorted(set(band_of)):
            own = [row for row, b in zip(rows, band_of) if b == band]
            self.survival.add(band, own, block)
            self._explore.pop(band, None)
            self._curve_moved(band)
            # A row that accepted its whole block (greedy text that turned repetitive,
            # after a start where the draft missed) explores again next round instead of
            # after a backed-off interval (up to 128 rounds: a whole request at batch 1).
            # The interval stays: at temperature 1 a short block is now and then accepted
            # whole, and a reset interval cost five more explorations each time.
            if g >= block and max(row[block - 1] for row in own) >= 0.5:
                self.exploration.due.add(band)
            else:
                self.exploration.due.discard(band)

    # -- what it learned, kept across calls (decoding/policy_memory.py) ---------------
    def state(self, with_costs: bool = True) -> dict[str, Any]:
        """Plain JSON-able state: each band's survival sums and exploration schedule, the
        exploration credit, and (with_costs) the measured / predicted round-time samples,
        relative to the table as it is now (a rescale in the call's last round is followed
        first: the state is kept with the rescaled table's signature)."""
        self.follow_table()
        bands = {str(b): {**self.survival.state(b), **self.exploration.state(b)} for b in self.survival.means}
        ratios = self.costs.state() if with_costs else []
        return {"bands": bands, "ratios": ratios, "exploration": self.exploration.shared_state()}

    def load_state(self, state: dict[str, Any], with_costs: bool = True) -> None:
        """Take what `state` learned (a checked `state()`; with_costs: its round-time samples too)."""
        self._forget_prices()
        for name, band in state["bands"].items():
            self.survival.load(int(name), band)
            self._explore.pop(int(name), None)
            self.exploration.load(int(name), band)
        if "exploration" in state:   # absent from states saved before it was kept
            self.exploration.load_shared(state["exploration"])
        if with_costs:
            self.costs.load(state["ratios"])
