"""The round policy (docs/design.md section 5): who drafts, how long a block, how many
drafts each row verifies, and what each round teaches.

`plan` is DSpark's prefix scheduler: it admits draft slots in descending order
of prefix survival while the expected throughput tau* / T(n) keeps improving,
and stops at the first slot that does not improve it (the early stop is what
keeps sampling lossless). `DraftGate` picks each round's block length, or a
plain AR round, under load. `ConfidenceCalibration` rescales the confidence
head online from verified outcomes. `RoundPolicy` owns all three and the
DSpark early stop; `FullWindow` is the policy of plain speculative decoding.
"""

from __future__ import annotations

import warnings

import torch

from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.round import ConfidenceMap, Proposal, RoundOutcome
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel

def plan(survival: torch.Tensor, table: CostTable | None, draft_time_s: float = 0.0,
         min_survival: float = 0.0, base_rows: int | None = None) -> torch.Tensor:
    """Drafts to verify per request, [R] long (docs/design.md section 5, DSpark Algorithm 1).

    survival [R, g]: prefix survival a_{r,j} = prod_{i<=j} c_{r,i}, non-increasing in j.
    Start from anchors only (n = R, tau* = R); admit slots in descending survival
    (ties: smaller j, then smaller r) while the round's expected throughput
    tau* / (draft_time_s + T(n)) strictly improves, and stop at the first slot that
    does not improve it. draft_time_s is the round's draft cost, already spent when
    the plan is made: it is part of the round's time, so a costly draft makes
    verifying more of what it proposed worth it (0: the paper's tau* * SPS(n)).
    Slots whose survival is below min_survival are never admitted (a floor that
    depends only on the slot's own survival, so `propose` may skip drafting them).
    base_rows (>= R): rows in the verify forward, when only the first R of them
    drafted this round (the others verify their anchor only). No table: verify
    every draft."""
    r, g = survival.shape
    if table is None or g == 0 or r == 0:
        return torch.full((r,), g, dtype=torch.long, device=survival.device)
    flat = survival.detach().to("cpu", torch.float64).t().reshape(-1)  # index j*R + r
    order = torch.sort(flat, descending=True, stable=True).indices       # stable: ties by (j, r)
    base = r if base_rows is None else base_rows
    admitted, _ = admit(flat[order].tolist(), base, table.times_upto(base + r * g), draft_time_s, min_survival)
    lens = torch.bincount(order[:admitted] % r, minlength=r)
    return lens.to(survival.device)


def admit(survivals: list[float], base_rows: int, times: list[float], draft_time_s: float,
          min_survival: float) -> tuple[int, float]:
    """The planner's admission rule over slots already in admission order (descending
    survival): admit while tau* / (draft time + T(base_rows + admitted)) strictly
    improves and the slot's survival is at least min_survival; stop at the first slot
    that fails (the early stop is a correctness rule: x_j's own admission may not
    depend on x_j, so no global argmax over cut points). times: T(0), T(1), ...
    Returns (admitted slots, expected tokens tau*)."""
    tau = float(base_rows)
    value = tau / (draft_time_s + times[base_rows])
    for n, s in enumerate(survivals):
        nxt = (tau + s) / (draft_time_s + times[base_rows + n + 1])
        if s < min_survival or not nxt > value:
            return n, tau
        tau, value = tau + s, nxt
    return len(survivals), tau


class DraftGate:
    """Which running requests draft this round (all, none, or a few to explore), and
    how long a block they draft.

    Under load a draft forward plus a wider verify can cost more than it returns
    even when the planner trims the window; when a plain AR round (every request
    verifies its anchor only) is expected to produce more tokens per second, the
    round skips the draft. A draft's cost grows with its block (every block slot
    runs through every draft layer), and the first slots are the likeliest to be
    accepted, so under load a shorter block can pay where the full one does not:
    the gate prices each block length the table has draft times for
    (`CostTable.draft_slot_counts`) and drafts the best. Each decision asks `plan`
    itself: with every running request drafting a block of s slots and showing
    the running mean survival curve of past drafting rows (their measured
    acceptance, and the confidences past what they verified), what would the
    planned round deliver per second, counting the draft time? Measuring is
    cheap: until the first measurement, and after
    `explore_every` undrafted rounds in a row, only the first `explore_rows`
    requests draft, a full block (a small draft forward that measures every
    slot); each exploration that does not win the gate back doubles that interval
    (up to 8x), so a load where drafting never pays spends little on it, while
    the estimate still follows the text. The curve is a running mean over
    request-rounds, not rounds: a round moves each slot it drafted by
    1 - momentum ** (drafting rows / explore_rows), so one request's round at
    batch 1 is one noisy sample among many, and even a round of 32 drafting rows
    moves it by a third (about 80 request-rounds of memory: a shorter one lets a
    few unlucky rounds flip the decision); slots a shorter block did not draft
    keep their last estimate. It starts from full survival (an optimistic prior:
    at batch 1 a few hard tokens at the start of a completion must not switch
    drafting off for the easy ones after them).
    Decisions use only past rounds, never the current round's draws,
    and undrafted rows are lossless AR steps, so the output distribution is
    unchanged; the draft context still grows for every row (its features come
    from the verify forward; the engine buffers them until the row drafts).

    full_window: the drafting rows verify every draft of their block (DFlash,
    DSpark unscheduled) instead of the planned lengths (no confidence head needed).

    The table prices forward passes only, profiled apart from the engine. `observe`
    feeds back each finished round's wall time (per-row bookkeeping, sampling and
    context upkeep included); the gate then scales the table's predictions by the
    running ratio measured / predicted, kept apart for drafting and AR rounds and
    per row count, so it compares the rates the engine really achieves."""

    def __init__(self, table: CostTable, window: int, momentum: float = 0.95, explore_every: int = 8,
                 min_survival: float = 0.0, explore_rows: int = 4, full_window: bool = False,
                 cost_momentum: float = 0.9) -> None:
        if explore_every < 1:
            raise BlockspecError("explore_every must be >= 1")
        if window < 1:
            raise BlockspecError("the draft window must be >= 1")
        self.full_window = full_window
        self.table, self.window, self.momentum = table, window, momentum
        self.explore_every, self.min_survival, self.explore_rows = explore_every, min_survival, explore_rows
        self.cost_momentum = cost_momentum
        # Block lengths to price: the table's measured ones below the window, and the window.
        self.block_choices = [s for s in table.draft_slot_counts if s < window] + [window]
        self.survival: torch.Tensor | None = None   # [window] mean prefix survival; None: unmeasured
        self.skipped = 0                         # undrafted rounds since the last drafting round
        self.interval = explore_every            # current exploration interval (backs off)
        self._plans: dict[int, tuple[float, float, int, float]] = {}   # by rows, until the next update
        # Measured / predicted round time: by (drafting, rows) and by drafting alone.
        self._ratio: dict[tuple[bool, int], float] = {}
        self._ratio_any: dict[bool, float] = {}

    def expected_rates(self, rows: int) -> tuple[float, float, int]:
        """(speculative, AR) expected tokens per second for `rows` running requests, and
        the block length (in drafts) of the speculative rate: the table's best plan
        (memoised until the next `update`, so in AR stretches the gate costs a lookup)
        at the round times measured so far."""
        if rows not in self._plans:
            self._plans[rows] = self._plan(rows)
        tokens, t_spec, block, t_ar = self._plans[rows]
        return tokens / (t_spec * self.cost_ratio(True, rows)), rows / (t_ar * self.cost_ratio(False, rows)), block

    def cost_ratio(self, drafting: bool, rows: int) -> float:
        """Measured / table round time for this kind of round (1.0 before any measurement)."""
        return self._ratio.get((drafting, rows), self._ratio_any.get(drafting, 1.0))

    def _plan(self, rows: int) -> tuple[float, float, int, float]:
        """(expected tokens, table time, block length) of the best round where every row
        drafts, and the table time of an AR round."""
        curve = torch.ones(self.window, dtype=torch.float64) if self.survival is None else self.survival
        # Slots measured in different rounds: keep it a prefix survival (never rising).
        survival = torch.cummin(curve, 0).values.tolist()
        times = self.table.times_upto(rows * (self.window + 1))
        best: tuple[float, float, int] | None = None
        for block in self.block_choices:
            t_draft = self.table.draft_time(rows, slots=block)
            if self.full_window:
                tokens, n = rows * (1.0 + sum(survival[:block])), rows * block
            else:   # plan() for rows that all show this curve: slot by slot, row by row
                n, tokens = admit([s for s in survival[:block] for _ in range(rows)], rows, times, t_draft,
                                  self.min_survival)
            t_spec = t_draft + times[rows + n]
            if best is None or tokens / t_spec > best[0] / best[1]:
                best = (tokens, t_spec, block)
        assert best is not None
        return (*best, times[rows])

    def observe(self, rows: int, drafting_rows: int, slots: int, verified_drafts: int, seconds: float) -> None:
        """A finished round's wall time: `rows` running requests, of which the first
        `drafting_rows` drafted a block of `slots` slots, verifying `verified_drafts` drafts in all."""
        predicted = self.table.time(rows + verified_drafts)
        if drafting_rows:
            predicted += self.table.draft_time(drafting_rows, slots=slots)
        ratio = seconds / max(predicted, 1e-9)
        drafting = drafting_rows > 0
        m = self.cost_momentum
        # A drafting round is keyed by its drafting rows: exploration rounds (a few
        # rows) do not stand in for rounds where everyone drafts.
        key = (drafting, drafting_rows if drafting else rows)
        self._ratio[key] = ratio if key not in self._ratio else m * self._ratio[key] + (1 - m) * ratio
        self._ratio_any[drafting] = (ratio if drafting not in self._ratio_any
                                     else m * self._ratio_any[drafting] + (1 - m) * ratio)

    def decide(self, rows: int) -> tuple[int, int]:
        """(requests that draft, block length in drafts): (0, 0) is an AR round, a few
        rows with the full window explore, `rows` with the best block is everyone drafting."""
        if not self.table.has_draft_times or rows == 0:
            return rows, self.window
        explore = (min(rows, self.explore_rows), self.window)
        if self.survival is None:
            return explore
        spec, ar, block = self.expected_rates(rows)
        if spec > ar:
            self.skipped, self.interval = 0, self.explore_every
            return rows, block
        if self.skipped + 1 >= self.interval:   # explore
            self.skipped = 0
            self.interval = min(2 * self.interval, 8 * self.explore_every)
            return explore
        self.skipped += 1
        return 0, 0

    def update(self, survival: torch.Tensor, block: int | None = None) -> None:
        """Record a drafting round's prefix survival [k, g'] over a block of `block`
        >= g' slots (default g'; DSpark may stop sampling before the block's end: its
        slots g'.. count as 0); slots past the block keep their estimate."""
        if survival.numel() == 0:
            return
        self._plans.clear()
        block = min(survival.shape[1] if block is None else block, self.window)
        curve = torch.zeros(block, dtype=torch.float64)
        mean = survival.detach().to("cpu", torch.float64).mean(0)[:block]
        curve[:mean.shape[0]] = mean
        keep = self.momentum ** (survival.shape[0] / self.explore_rows)
        self.survival = (torch.ones(self.window, dtype=torch.float64) if self.survival is None
                         else self.survival.clone())
        self.survival[:block] = keep * self.survival[:block] + (1 - keep) * curve


class ConfidenceCalibration:
    """Online per-slot rescaling of the confidence head from verified outcomes.

    A head trained on sampled acceptance (docs/design.md section 5) under-rates greedy
    verification, where a draft is accepted whenever it is the target's argmax;
    a mis-rated head trims windows the text would have accepted. Per slot j the
    scale is (accepted drafts) / (sum of their confidences) over past rows that
    verified slot j with every earlier draft accepted (the rows at risk at j:
    both sums run over the same rows, so the planner's choice of which rows
    verify far does not bias it), as running sums that decay by `momentum` per
    round, starting from 1 (the head as trained). c'_j = min(1, scale_j * c_j).
    Only past rounds set the scale and c_j still depends on x_{j-1} alone, so
    scheduling stays lossless."""

    def __init__(self, window: int, momentum: float = 0.9, prior: float = 1.0) -> None:
        self.momentum, self.prior = momentum, prior
        self.accepted = torch.zeros(window, dtype=torch.float64)
        self.expected = torch.zeros(window, dtype=torch.float64)

    @property
    def scale(self) -> torch.Tensor:
        return (self.accepted + self.prior) / (self.expected + self.prior)

    def apply(self, confidence: torch.Tensor, first_slot: int = 0) -> torch.Tensor:
        """Rescaled confidences [R, s] of slots first_slot.. (float64)."""
        scale = self.scale[first_slot:first_slot + confidence.shape[1]]
        return (confidence.double() * scale.to(confidence.device)).clamp(max=1.0)

    def observe(self, confidence: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """Raw confidences [k, g] of a round's drafting rows, the drafts each verified and accepted [k]."""
        g = confidence.shape[1]
        slot = torch.arange(g, device=confidence.device).unsqueeze(0)
        at_risk = ((slot < verified.unsqueeze(1)) & (slot <= accepted.unsqueeze(1))).double()
        hit = (slot < accepted.unsqueeze(1)).double() * at_risk
        self.accepted *= self.momentum
        self.expected *= self.momentum
        self.accepted[:g] += hit.sum(0).cpu()
        self.expected[:g] += (confidence.double() * at_risk).sum(0).cpu()




# DSpark's early stop pays only for a few rows: with this many or more, all of them
# rarely fall below the floor together, and slot-by-slot lm_head calls and checks
# cost more than one lm_head call for the block (`plan` applies the floor anyway).
EARLY_STOP_ROWS = 8


class FullWindow:
    """Plain speculative decoding: every row drafts the whole block and verifies all of it."""

    def __init__(self, window: int) -> None:
        self.window = window

    def decide(self, rows: int) -> tuple[int, int]:
        return rows, self.window

    def stop_below(self, rows: int) -> float:
        return 0.0

    def confidence_map(self) -> ConfidenceMap | None:
        return None

    def plan(self, proposal: Proposal | None, rows: int, block: int) -> torch.Tensor | None:
        return None

    def observe(self, outcome: RoundOutcome, proposal: Proposal | None, lens: torch.Tensor | None) -> None:
        pass


class RoundPolicy:
    """The engine's drafting decisions, in one object: the draft gate (who drafts, how
    long a block: `DraftGate`), DSpark's planner (how many drafts each row verifies:
    `plan`, with the cost table), online recalibration of the confidence head
    (`ConfidenceCalibration`) and the early stop of drafting, which applies the
    planner's floor to the same recalibrated survival the planner uses.

    window: the draft's drafts per round (0 for AR); table: the cost table (None:
    no planning, no gate); scheduled: plan each row's verify length (DSpark with
    a confidence head); gate: run the draft gate (needs draft times in the table);
    gate_feedback: the gate scales the table by measured round times;
    calibrate: rescale confidences online (scheduled only)."""

    def __init__(self, window: int, table: CostTable | None = None, *, scheduled: bool = False, gate: bool = False,
                 min_survival: float = 0.02, gate_feedback: bool = True, calibrate: bool = True) -> None:
        if not 0.0 <= min_survival < 1.0:
            raise BlockspecError(f"min_survival must be in [0, 1), got {min_survival!r}")
        if gate and (window == 0 or table is None or not table.has_draft_times):
            raise BlockspecError("draft_gate needs a speculative method and a cost table with draft times "
                                 "(blockspec profile --draft ...)")
        self.window, self.min_survival = window, float(min_survival)
        self.table = table if scheduled else None
        self.gate = (DraftGate(table, window, min_survival=self.min_survival, full_window=not scheduled)
                     if gate and table is not None else None)
        self.gate_feedback = gate_feedback
        self.calibration = (ConfidenceCalibration(window) if calibrate and self.table is not None and window
                            else None)

    @classmethod
    def for_engine(cls, target: TargetModel, draft: DraftModel | None, method: str, table: CostTable | None, *,
                   scheduled: bool, draft_gate: bool | None, min_survival: float, gate_feedback: bool,
                   calibrate: bool) -> "RoundPolicy":
        """The policy of an engine running `method` (draft None for AR); draft_gate None:
        on for scheduled DSpark given a table with draft times. Checks that the table
        was measured for this target."""
        if scheduled:
            if method != "dspark" or draft is None or draft.confidence_head is None:
                raise BlockspecError("scheduled verification needs method 'dspark' and a draft with a "
                                     "confidence head")
            if table is None:
                warnings.warn("scheduled=True without a cost table: every draft is verified", stacklevel=4)
        if draft_gate is None:
            draft_gate = scheduled and table is not None and table.has_draft_times
        if table is not None and (scheduled or draft_gate):
            table.check_target(target)
        window = draft.config.num_drafts if draft is not None else 0
        return cls(window, table, scheduled=scheduled, gate=draft_gate, min_survival=min_survival,
                   gate_feedback=gate_feedback, calibrate=calibrate)

    @property
    def scheduled(self) -> bool:
        return self.table is not None

    def decide(self, rows: int) -> tuple[int, int]:
        if self.window == 0:
            return 0, 0
        return (rows, self.window) if self.gate is None else self.gate.decide(rows)

    def stop_below(self, rows: int) -> float:
        return self.min_survival if self.scheduled and rows < EARLY_STOP_ROWS else 0.0

    def confidence_map(self) -> ConfidenceMap | None:
        return self.calibration.apply if self.calibration is not None else None

    def plan(self, proposal: Proposal | None, rows: int, block: int) -> torch.Tensor | None:
        """Drafts each of the `rows` running requests verifies (zero for those that did
        not draft; None in an AR round); `block`: the drafted block's length (its draft
        time is spent)."""
        if proposal is None:
            return None
        k, g = proposal.tokens.shape
        lens = torch.zeros(rows, dtype=torch.long, device=proposal.tokens.device)
        table = self.table
        if table is None or proposal.confidence is None:
            lens[:k] = g
            return lens
        draft_s = table.draft_time(k, slots=block) if table.has_draft_times else 0.0
        survival = torch.cumprod(proposal.confidence, dim=1)
        lens[:k] = plan(survival, table, draft_s, self.min_survival, base_rows=rows).to(lens.device)
        return lens

    def observe(self, outcome: RoundOutcome, proposal: Proposal | None, lens: torch.Tensor | None) -> None:
        """Learn from a finished round: confidences against what was verified and
        accepted (recalibration), and the drafting rows' survival (the gate)."""
        k = outcome.drafting_rows
        if proposal is None or lens is None or k == 0:   # lens is None exactly when nobody drafted
            return
        accepted = torch.tensor(outcome.accepted[:k])
        verified = lens[:k].cpu()
        if self.calibration is not None and outcome.raw_confidence is not None:
            self.calibration.observe(outcome.raw_confidence.cpu(), verified, accepted)
        if self.gate is not None:
            confidence = proposal.confidence[:k].cpu() if proposal.confidence is not None else None
            self.gate.update(measured_survival(proposal.tokens.shape[1], confidence, verified, accepted), outcome.block)

    def observe_time(self, rows: int, outcome: RoundOutcome, seconds: float) -> None:
        """A finished round's wall time, bookkeeping included (the gate's cost feedback)."""
        if self.gate is not None and self.gate_feedback:
            self.gate.observe(rows, outcome.drafting_rows, outcome.block, sum(outcome.verified), seconds)


def measured_survival(g: int, confidence: torch.Tensor | None, verified: torch.Tensor,
                      accepted: torch.Tensor) -> torch.Tensor:
    """What the drafting rows [k, g] showed of their prefix survival, for the gate:
    1 / 0 for each verified slot (accepted or not), and past a row's verified
    length, when all of it was accepted, the confidences' survival from there on
    (never verified, so never measured). Measured outcomes, not the confidences,
    decide the block: a head trained for sampled acceptance under-rates greedy."""
    g = g if confidence is None else confidence.shape[1]
    slot = torch.arange(g).unsqueeze(0)
    verified, accepted = verified.unsqueeze(1), accepted.unsqueeze(1)
    measured = (slot < accepted).double()
    if confidence is None:
        return measured
    beyond = torch.cumprod(torch.where(slot < verified, 1.0, confidence.double()), dim=1)
    return torch.where(slot < verified, measured, beyond * (accepted == verified))
