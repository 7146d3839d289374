"""The round policy (docs/design.md section 5): who drafts, how long a block, how many
drafts each row verifies, and what each round teaches.

`RoundPolicy` owns DSpark's planner (`planner.plan`), the draft gate
(`gate.DraftGate`: draft or not, which temperature bands, how long a block),
online recalibration of the confidence head (`ConfidenceCalibration`) and the
DSpark early stop. Every decoding path (generate, the engine, the server, the bench)
builds its policy from one `PolicyOptions` with one factory (`RoundPolicy.for_method`):
adaptive by default, recalling what earlier calls with the same models learned
(`policy_memory.PolicyMemory`); the table's cost drift is corrected online
(`table_cache.CostDrift`); `PolicyOptions(adapt=False)` is plain speculative decoding (every
row drafts and verifies the full window: `--no-adapt`).
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockspec.decoding.cost_table import CostTable
from blockspec.decoding.gate import DraftGate
from blockspec.decoding.planner import plan
from blockspec.decoding.round import ConfidenceMap, Proposal, RoundOutcome
from blockspec.decoding.policy_memory import MEMORY_MODES, PolicyMemory, table_signature
from blockspec.decoding.table_cache import CostDrift, cached_cost_table, drift_of, table_rows, write_back
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import AnyDraft, Eagle3Drafter
from blockspec.models.target import TargetModel

log = logging.getLogger(__name__)


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
        """Raw confidences [k, g] of a round's drafting rows, the drafts each verified and accepted [k]
        (summed on the host in plain floats: a few values per row, every drafting round)."""
        g = confidence.shape[1]
        hit, expected = [0.0] * g, [0.0] * g
        for conf, v, a in zip(confidence.double().tolist(), verified.tolist(), accepted.tolist()):
            for j in range(min(g, v, a + 1)):   # the rows at risk at j: verified j, all before it accepted
                expected[j] += conf[j]
                hit[j] += j < a
        self.accepted *= self.momentum
        self.expected *= self.momentum
        self.accepted[:g] += torch.tensor(hit, dtype=torch.float64)
        self.expected[:g] += torch.tensor(expected, dtype=torch.float64)

    def state(self) -> dict[str, list[float]]:
        return {"accepted": self.accepted.tolist(), "expected": self.expected.tolist()}

    def load_state(self, state: dict[str, list[float]]) -> None:
        self.accepted = torch.tensor(state["accepted"], dtype=torch.float64)
        self.expected = torch.tensor(state["expected"], dtype=torch.float64)




@dataclass(frozen=True, kw_only=True, eq=False)
class PolicyOptions:
    """How a decoding loop chooses its drafts (`RoundPolicy.for_method`), for every path.

    adapt (the default): without a cost table, the one of this machine and model pair
    comes from the cache (measured the first time: `table_cache.cached_cost_table`);
    scheduled (None) is then on for DSpark with a confidence head and draft_gate (None)
    for every speculative method. adapt off: fixed windows unless scheduled /
    draft_gate say otherwise. cost_table: the verify / draft costs to plan with (or its
    JSON file, `blockspec profile`, read when the policy is built);
    min_survival: DSpark's planner floor; gate_feedback: the gate scales the table by
    measured round times; calibrate: rescale confidences online (scheduled only).
    memory: where what the policy learns is kept for the next policy of the same models
    and options (`policy_memory`): "process" (the default: later calls in this process
    start from it), "disk" (also a JSON file next to the cost tables, for later
    processes) or "off" (every policy starts from zero); fresh: forget what was kept and
    start from zero (then keep learning); remeasure: measure the cached cost table again
    (`--remeasure-costs`)."""

    adapt: bool = True
    scheduled: bool | None = None
    draft_gate: bool | None = None
    cost_table: CostTable | str | Path | None = None
    min_survival: float = 0.02
    gate_feedback: bool = True
    calibrate: bool = True
    memory: str = "process"
    fresh: bool = False
    remeasure: bool = False

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_MODES:
            raise BlockspecError(f"policy memory must be one of {', '.join(MEMORY_MODES)}, got {self.memory!r}")
        if self.remeasure and (self.cost_table is not None or not self.adapt):
            raise BlockspecError("--remeasure-costs measures the cached cost table of the adaptive policy; it does "
                                 "nothing with --cost-table or --no-adapt")
        if self.cost_table is not None and not self.plans:
            raise BlockspecError("a cost table is used by the adaptive policy, scheduled verification and the "
                                 "draft gate only; drop --no-adapt or add --scheduled / --draft-gate")
        if self.draft_gate and self.cost_table is None and not self.adapt:
            raise BlockspecError("draft_gate needs a cost table when adapt is off (--draft-gate with --no-adapt "
                                 "needs --cost-table: blockspec profile --draft ...)")

    @property
    def plans(self) -> bool:
        """Whether anything decides per round (adaptive, scheduled or gated): not the fixed policy."""
        return bool(self.adapt or self.scheduled or self.draft_gate)


TREE_NEEDS_FIXED_POLICY = ("EAGLE-3 tree drafting (topk > 1) verifies its whole tree every round; the adaptive "
                           "policy, scheduled verification and the draft gate plan chains only: use the fixed "
                           "policy (--no-adapt, without --scheduled / --draft-gate)")


def is_tree(draft: AnyDraft | None) -> bool:
    """Whether `draft` drafts an EAGLE-3 tree (`ChainDraftConfig.tree`) rather than a chain or block."""
    return isinstance(draft, Eagle3Drafter) and draft.config.tree is not None


# DSpark's early stop pays only for a few rows: with this many or more, all of them
# rarely fall below the floor together, and slot-by-slot lm_head calls and checks
# cost more than one lm_head call for the block (`plan` applies the floor anyway).
EARLY_STOP_ROWS = 8
# AR rounds the gate measures before its first decision (with round times fed back).
WARM_AR_ROUNDS = 3
# Past its warm-up, about one AR round per this many seconds of them is timed: the
# machine's pace moves over seconds, and at batch 1 on a CPU (rounds of 5-8 ms) timing
# every round was about half of an AR round's upkeep in a speculative call (~40 of ~80 us
# a round, timed in place). Which rounds are timed is drawn by count, never by their own
# length: timing the round that completes 20 ms favours long rounds (a slow round is more
# likely to cross the mark), and AR was priced dearer than it runs.
AR_TIMING_S = 0.02


class RoundPolicy:
    """Drafting decisions in one object: the draft gate (who drafts, how long a block:
    `DraftGate`), DSpark's planner (how many drafts each row verifies: `plan`, with
    the cost table), online recalibration of the confidence head per temperature band
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
        self.gate = (DraftGate(table, window, min_survival=self.min_survival, full_window=not scheduled,
                               warm_ar_rounds=WARM_AR_ROUNDS if gate_feedback else 0)
                     if gate and table is not None else None)
        self.gate_feedback = gate_feedback
        self.calibrate = calibrate and self.table is not None and window > 0
        self.calibrations: dict[int, ConfidenceCalibration] = {}   # by temperature band
        self._bands: list[int] = []   # the bands of the rows of the round in progress
        self.memory: PolicyMemory | None = None   # where `remember` keeps what it learned
        self.drift = drift_of(table) if table is not None else CostDrift()
        self._timed: set[bool] = set()   # kinds of round (drafting or not) timed so far
        self._untimed_s = 0.0             # seconds of the AR rounds since one was last timed (AR_TIMING_S)
        self._skip_ar = 0                 # AR rounds to leave untimed before the next timed one
        self._timing_draw = random.Random(0)

    @classmethod
    def for_method(cls, target: TargetModel, draft: AnyDraft | None, method: str,
                   options: PolicyOptions | None = None, *, rows: int = 1) -> "RoundPolicy":
        """The one factory: the policy of a decoding loop running `method` (draft None for
        AR) over up to `rows` rows, as `options` say (`PolicyOptions`; default: adaptive).
        Checks that the table was measured for this target."""
        options = options or PolicyOptions()
        if is_tree(draft) and options.plans:
            raise BlockspecError(TREE_NEEDS_FIXED_POLICY)
        table, scheduled, draft_gate = options.cost_table, options.scheduled, options.draft_gate
        if isinstance(table, (str, Path)):
            table = CostTable.load(table)
        speculative = draft is not None and method != "ar"
        if options.adapt and speculative and table is None:
            assert draft is not None
            table = cached_cost_table(target, draft, rows, refresh=options.remeasure)
        if scheduled is None:
            scheduled = (options.adapt and speculative and method == "dspark" and draft is not None
                         and draft.confidence_head is not None and table is not None)
        if scheduled:
            if method != "dspark" or draft is None or draft.confidence_head is None:
                raise BlockspecError("scheduled verification needs method 'dspark' and a draft with a "
                                     "confidence head")
            if table is None:
                warnings.warn("scheduled=True without a cost table: every draft is verified", stacklevel=4)
        if draft_gate is None:
            draft_gate = ((options.adapt or scheduled) and speculative and table is not None
                          and table.has_draft_times)
        if table is not None and (scheduled or draft_gate):
            table.check_target(target)
        window = draft.config.num_drafts if speculative and draft is not None else 0
        policy = cls(window, table, scheduled=scheduled, gate=draft_gate, min_survival=options.min_survival,
                     gate_feedback=options.gate_feedback, calibrate=options.calibrate)
        if options.memory != "off" and draft is not None and (policy.gate is not None or policy.calibrate):
            policy.memory = PolicyMemory.of(target, draft, method, table_rows(rows), options_signature(options),
                                            options.memory)
            if options.fresh:
                policy.memory.forget()
            else:
                state = policy.memory.recall(window)
                if state is not None:
                    policy.load_state(state)
        return policy

    @classmethod
    def of(cls, policy: "RoundPolicy | PolicyOptions | None", target: TargetModel, draft: AnyDraft | None,
           method: str, rows: int = 1) -> "RoundPolicy":
        """`policy` itself (one that keeps learning across calls), or the one `for_method`
        builds from these options (None: the defaults)."""
        if isinstance(policy, RoundPolicy):
            return policy
        if policy is not None and not isinstance(policy, PolicyOptions):
            raise BlockspecError(f"policy must be a RoundPolicy or PolicyOptions, got {type(policy).__name__}")
        return cls.for_method(target, draft, method, policy, rows=rows)

    @property
    def scheduled(self) -> bool:
        return self.table is not None

    @property
    def adaptive(self) -> bool:
        return self.gate is not None

    @property
    def fixed(self) -> bool:
        """Plain speculative decoding: every row drafts and verifies the whole window."""
        return self.gate is None and self.table is None

    def metrics(self) -> dict[str, bool]:
        """What this policy runs, for an engine's metrics."""
        return {"scheduled": self.scheduled, "draft_gate": self.gate is not None}

    def decide(self, bands: Sequence[int]) -> tuple[int, int]:
        """(first k rows that draft, block length): rows come ordered by temperature band."""
        self._bands = list(bands)
        if self.window == 0:
            return 0, 0
        return (len(bands), self.window) if self.gate is None else self.gate.decide(self._bands)

    def stop_below(self, rows: int) -> float:
        return self.min_survival if self.scheduled and rows < EARLY_STOP_ROWS else 0.0

    def confidence_map(self) -> ConfidenceMap | None:
        return self._calibrated if self.calibrate else None

    def _calibration(self, band: int) -> ConfidenceCalibration:
        if band not in self.calibrations:
            self.calibrations[band] = ConfidenceCalibration(self.window)
        return self.calibrations[band]

    def _calibrated(self, confidence: torch.Tensor, first_slot: int) -> torch.Tensor:
        """Each drafting row's confidences rescaled by its own band's calibration."""
        bands = self._bands[:confidence.shape[0]] or [0]
        if len(set(bands)) == 1:
            return self._calibration(bands[0]).apply(confidence, first_slot)
        s = confidence.shape[1]
        scale = torch.stack([self._calibration(b).scale[first_slot:first_slot + s] for b in bands])
        return (confidence.double() * scale.to(confidence.device)).clamp(max=1.0)

    def verify_lengths(self, proposal: Proposal | None, rows: int, block: int) -> torch.Tensor | None:
        """Drafts each of the `rows` running requests verifies (zero for those that did
        not draft; None in an AR round), on the host (the planner's own result: the round
        sizes its verify from it without reading the device); `block`: the drafted
        block's length (its draft time is spent)."""
        if proposal is None or self.fixed:   # fixed: every row verifies its whole proposal
            return None
        k, g = proposal.tokens.shape
        lens = torch.zeros(rows, dtype=torch.long)
        table = self.table
        if table is None or proposal.confidence is None:
            lens[:k] = g
            return lens
        draft_s = table.draft_time(k, block=block) if table.has_draft_times else 0.0
        survival = torch.cumprod(proposal.confidence, dim=1)
        lens[:k] = plan(survival, table, draft_s, self.min_survival, base_rows=rows)
        return lens

    def observe(self, outcome: RoundOutcome, proposal: Proposal | None, lens: torch.Tensor | None) -> None:
        """Learn from a finished round: confidences against what was verified and
        accepted (recalibration, per band), and the drafting rows' survival (the gate)."""
        k = outcome.drafting_rows
        if proposal is None or lens is None or k == 0:   # lens is None exactly when nobody drafted
            return
        bands = self._bands[:k] if len(self._bands) >= k else [0] * k
        if self.calibrate and outcome.raw_confidence is not None:
            raw, verified = outcome.raw_confidence.cpu(), lens[:k]   # lens: on the host (verify_lengths)
            accepted, band_of = torch.tensor(outcome.accepted[:k]), torch.tensor(bands)
            for band in sorted(set(bands)):
                rows = band_of == band
                self._calibration(band).observe(raw[rows], verified[rows], accepted[rows])
        if self.gate is not None:
            confidence = proposal.confidence[:k].cpu() if proposal.confidence is not None else None
            survival = measured_survival(proposal.tokens.shape[1], confidence, lens[:k].tolist(),
                                         outcome.accepted[:k])
            self.gate.update(survival, outcome.block, bands)

    def observe_time(self, rows: int, outcome: RoundOutcome, seconds: float) -> None:
        """A finished round's wall time, bookkeeping included (the gate's cost feedback).
        The first drafting round after AR rounds also appends their buffered draft context;
        that is counted, as it is what drafting after an AR stretch costs (where drafting
        rounds are isolated, at temperature 1, each pays it: left out, DSpark's rounds were
        priced about a third below what they took and the gate drafted where it lost).
        A table that rounds show to be off by more than a margin is rescaled and written
        back to the cache (`CostDrift`). In an AR stretch only some rounds are timed
        (AR_TIMING_S); the drift check still counts all of their seconds."""
        if self.gate is not None and self.gate_feedback:
            # The first round of each kind (AR, drafting) a policy times runs cold: the
            # draft's first forward in a process, a call's fresh caches. Learned, it would
            # price drafting out for many rounds (and, remembered, for later calls).
            kind = outcome.drafting_rows > 0
            cold = kind not in self._timed
            if self._skip_ar and not (kind or cold or self.gate.times_every_ar_round()):
                self._skip_ar -= 1
                self._untimed_s += seconds
                return
            span, self._untimed_s = seconds + self._untimed_s, 0.0   # the wall time since the last timed round
            if not kind:   # one in `every` AR rounds on average, whatever their own lengths
                every = max(1, math.ceil(AR_TIMING_S / max(seconds, 1e-9)))
                self._skip_ar = self._timing_draw.randrange(2 * every - 1)
            self._timed.add(kind)
            ratio = self.gate.observe(rows, outcome.drafting_rows, outcome.block, sum(outcome.verified), seconds,
                                      cold=cold)
            factor = None if cold else self.drift.observe(ratio, span)
            if factor is not None:
                log.warning("blockspec: live rounds take %.2fx the cost table's times; rescaling the table "
                            "(and its cached copy)", factor)
                self.gate.table.rescale(factor)   # every gate of the table follows it (`follow_table`)
                write_back(self.gate.table)

    # -- what it learned, kept across calls ------------------------------------------
    def state(self) -> dict[str, Any]:
        """What this policy learned, as plain JSON-able numbers (`policy_memory.check_state`)."""
        table = self.gate.table if self.gate is not None else self.table
        return {"window": self.window, "table": table_signature(table),
                "gate": self.gate.state() if self.gate is not None else None,
                "calibrations": {str(b): c.state() for b, c in self.calibrations.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Start from what an earlier policy of these models learned (a checked `state()`);
        its round-time ratios only when they were learned against this very table."""
        if self.gate is not None and state["gate"] is not None:
            self.gate.load_state(state["gate"], with_costs=state["table"] == table_signature(self.gate.table))
        if self.calibrate:
            for band, cal in state["calibrations"].items():
                self._calibration(int(band)).load_state(cal)

    def remember(self) -> None:
        """Keep what this policy learned for the next one of these models (a call ended)."""
        if self.memory is not None:
            self.memory.keep(self.state())


def options_signature(options: PolicyOptions) -> str:
    """The options that make two policies learn the same thing (their memory slot)."""
    table = options.cost_table
    source = (f"file {Path(table).resolve()}" if isinstance(table, (str, Path))
              else f"object {id(table)}" if table is not None else "cached")
    return (f"adapt={options.adapt} scheduled={options.scheduled} gate={options.draft_gate} table={source} "
            f"min_survival={options.min_survival} feedback={options.gate_feedback} calibrate={options.calibrate}")


def measured_survival(g: int, confidence: torch.Tensor | None, verified: Sequence[int],
                      accepted: Sequence[int]) -> list[list[float]]:
    """What the drafting rows [k, g] showed of their prefix survival, for the gate:
    1 / 0 for each verified slot (accepted or not), and past a row's verified
    length, when all of it was accepted, the confidences' survival from there on
    (never verified, so never measured). Measured outcomes, not the confidences,
    decide the block: a head trained for sampled acceptance under-rates greedy.
    Plain floats: it runs every drafting round (`SurvivalCurves`)."""
    g = g if confidence is None else confidence.shape[1]
    conf = confidence.double().tolist() if confidence is not None else None
    out = []
    for r, (v, a) in enumerate(zip(verified, accepted)):
        row = [1.0 if j < a else 0.0 for j in range(min(v, g))]
        if conf is None or a != v:
            row += [0.0] * (g - len(row))
        else:
            survival = 1.0
            for c in conf[r][len(row):]:
                survival *= c
                row.append(survival)
        out.append(row)
    return out