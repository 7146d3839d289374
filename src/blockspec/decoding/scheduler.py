"""DSpark confidence-scheduled verification (design section 5).

`CostTable`: the measured time T(n) of one packed target verify forward over
n tokens on this machine (saved as JSON with the model / dtype / machine it was
measured on). `plan` decides how many drafts each running request verifies
this round: it admits draft slots in descending order of prefix survival while
the expected throughput `tau* * SPS(n)` keeps improving, and stops at the first
slot that does not improve it (the early stop is what keeps sampling lossless).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from blockspec.config import read_json
from blockspec.errors import BlockspecError
from blockspec.models.target import TargetModel

if TYPE_CHECKING:
    from blockspec.models.draft import DraftModel

TABLE_FORMAT = "blockspec-cost-table"
TABLE_VERSION = 1
# Block lengths (in drafts) whose draft time `profile_cost_table` measures besides the full block.
DRAFT_SLOT_COUNTS = (1, 2, 3, 4, 6, 8, 11)


def model_signature(target: TargetModel) -> str:
    """What a cost table was measured for: the target's shape, not its weights."""
    c = target.config
    return (f"{c.model_type} layers={c.num_hidden_layers} hidden={c.hidden_size} inter={c.intermediate_size} "
            f"heads={c.num_attention_heads}/{c.num_key_value_heads} head_dim={c.head_dim} vocab={c.vocab_size}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def machine_signature(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)} torch {torch.__version__}"
    return f"{device.type} {platform.machine()} {os.cpu_count()} cpus torch {torch.__version__}"


def check_points(xs: Any, ys: Any, x_name: str, y_name: str, where: str = "cost table") -> None:
    """xs: strictly increasing positive ints; ys: as many positive finite seconds."""
    if not isinstance(xs, list) or not isinstance(ys, list) or not xs:
        raise BlockspecError(f"{where}: '{x_name}' and '{y_name}' must be non-empty lists")
    if len(xs) != len(ys):
        raise BlockspecError(f"{where}: '{x_name}' has {len(xs)} entries but '{y_name}' has {len(ys)}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in xs):
        raise BlockspecError(f"{where}: every {x_name} must be a positive integer, got {xs}")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise BlockspecError(f"{where}: {x_name} must be strictly increasing, got {xs}")
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in ys):
        raise BlockspecError(f"{where}: every {y_name} must be a positive finite number, got {ys}")


def interpolate(xs: list[int], ys: list[float], n: torch.Tensor | int) -> torch.Tensor:
    """Piecewise-linear y(n), float64: y(xs[0]) below the first point; past the last
    point the last segment's slope continues, never falling (no free tokens)."""
    if isinstance(n, (int, float)):  # one point (the gate, every round): plain floats, no tensor ops
        return torch.tensor(_interpolate_one(xs, ys, float(n)), dtype=torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    x = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    if len(x) == 1:
        return torch.full_like(n, float(y[0]))
    i = torch.searchsorted(x, n.clamp(min=x[0]).contiguous()).clamp(1, len(x) - 1)
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    slope = (y1 - y0) / (x1 - x0)
    inside = y0 + slope * (n.clamp(min=x[0]) - x0)
    beyond = y1 + slope.clamp(min=0) * (n - x1)
    return torch.where(n > x[-1], beyond, inside)


def _interpolate_one(xs: list[int], ys: list[float], n: float) -> float:
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_left(xs, max(n, xs[0])), 1), len(xs) - 1)
    slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    if n > xs[-1]:
        return ys[i] + max(slope, 0.0) * (n - xs[i])
    return ys[i - 1] + slope * (max(n, xs[0]) - xs[i - 1])


@dataclass
class CostTable:
    """Verify forward time `times_s[i]` (seconds) for `ns[i]` packed tokens; n strictly increasing.

    Optionally also the draft round time `draft_times_s[i]` (one draft forward plus
    its sampling) for `draft_rows[i]` requests, which lets the engine skip drafting
    when a plain AR round is expected to be faster (see `DraftGate`). Between
    measured points times are interpolated linearly (see `interpolate`).

    A round may draft a shorter block than the draft was trained with (the gate
    picks the block length under load: `DraftGate`), and its cost falls with the
    block: `draft_slot_times[s]` holds, per draft row count, the time of rounds
    that draft s < `draft_window` slots (`draft_window`: the slots drafted in
    `draft_times_s`); `draft_time(rows, slots)` interpolates between them."""

    ns: list[int]
    times_s: list[float]
    model: str = ""
    dtype: str = ""
    machine: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    draft_rows: list[int] = field(default_factory=list)
    draft_times_s: list[float] = field(default_factory=list)
    draft_slot_times: dict[int, list[float]] = field(default_factory=dict)
    draft_window: int = 0
    # T at 0, 1, 2, ... tokens, filled on demand: planning looks up integer counts every round.
    _dense: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_points(self.ns, self.times_s, "n", "time_s")
        if self.draft_rows or self.draft_times_s:
            check_points(self.draft_rows, self.draft_times_s, "draft_rows", "draft_time_s")
        if self.draft_slot_times:
            if not isinstance(self.draft_window, int) or isinstance(self.draft_window, bool) or self.draft_window < 2:
                raise BlockspecError(f"cost table: draft_window must be an integer >= 2 with draft times by "
                                     f"slots, got {self.draft_window!r}")
            for slots, times in self.draft_slot_times.items():
                if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots < self.draft_window:
                    raise BlockspecError(f"cost table: draft times by slots need slot counts in "
                                         f"1..{self.draft_window - 1} (below draft_window), got {slots!r}")
                check_points(self.draft_rows, times, "draft_rows", f"draft_time_by_slots_s[{slots}]")
            self.draft_slot_times = {s: [float(t) for t in self.draft_slot_times[s]]
                                     for s in sorted(self.draft_slot_times)}
        for name in ("model", "dtype", "machine"):
            if not isinstance(getattr(self, name), str):
                raise BlockspecError(f"cost table: '{name}' must be a string")
        self.times_s = [float(t) for t in self.times_s]
        self.draft_times_s = [float(t) for t in self.draft_times_s]

    def time(self, n: torch.Tensor | int) -> torch.Tensor:
        """Interpolated verify time T(n) in seconds, float64, same shape as n."""
        if isinstance(n, torch.Tensor) and not n.is_floating_point() and n.numel() and n.device.type == "cpu":
            return self._dense_upto(int(n.max()))[n.clamp(min=0)]
        return interpolate(self.ns, self.times_s, n)

    def _dense_upto(self, top: int) -> torch.Tensor:
        if self._dense is None or top >= len(self._dense):
            self._dense = interpolate(self.ns, self.times_s, torch.arange(2 * top + 64))
        return self._dense

    def times_upto(self, top: int) -> list[float]:
        """[T(0), T(1), ..., T(top)] as plain floats (the gate's planning loop)."""
        return self._dense_upto(top)[:top + 1].tolist()

    @property
    def has_draft_times(self) -> bool:
        return bool(self.draft_rows)

    @property
    def draft_slot_counts(self) -> list[int]:
        """Slot counts (block lengths in drafts) with measured draft times; the full
        window last. Empty without draft times."""
        if not self.draft_rows:
            return []
        return [*self.draft_slot_times, self.draft_window] if self.draft_slot_times else []

    def time_at(self, n: int) -> float:
        """T(n) in seconds for one token count, in plain floats (the gate prices every round)."""
        return _interpolate_one(self.ns, self.times_s, float(n))

    def draft_time(self, rows: int, slots: float | None = None) -> float:
        """Interpolated draft round time in seconds for `rows` requests (needs draft times);
        with `slots` and times by slots, for a round that drafts a block of that many slots."""
        if not self.draft_rows:
            raise BlockspecError("this cost table has no draft times (profile it with a draft)")
        full = _interpolate_one(self.draft_rows, self.draft_times_s, float(rows))
        if slots is None or not self.draft_slot_times:
            return full
        counts = self.draft_slot_counts
        times = [_interpolate_one(self.draft_rows, self.draft_slot_times[s], float(rows)) for s in counts[:-1]]
        times = [min(t, full) for t in times] + [full]   # never dearer than the full block
        at = min(max(float(slots), float(counts[0])), float(counts[-1]))
        return _interpolate_one(counts, times, at)

    def sps(self, n: torch.Tensor | int) -> torch.Tensor:
        """Verify steps per second, 1 / T(n)."""
        return 1.0 / self.time(n)

    def check_target(self, target: TargetModel) -> None:
        """Refuse a table measured for another model shape or dtype (empty fields are not checked)."""
        if self.model and self.model != model_signature(target):
            raise BlockspecError(f"cost table was measured for '{self.model}', not for this target "
                                 f"('{model_signature(target)}'); profile it again")
        if self.dtype and self.dtype != dtype_name(target.dtype):
            raise BlockspecError(f"cost table was measured in {self.dtype}, the target runs in "
                                 f"{dtype_name(target.dtype)}; profile it again")

    # -- JSON ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "model": self.model, "dtype": self.dtype,
               "machine": self.machine, "n": self.ns, "time_s": self.times_s, "meta": self.meta}
        if self.draft_rows:
            out.update(draft_rows=self.draft_rows, draft_time_s=self.draft_times_s)
        if self.draft_slot_times:
            out.update(draft_time_by_slots_s={str(k): v for k, v in self.draft_slot_times.items()},
                       draft_window=self.draft_window)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "cost table") -> "CostTable":
        if raw.get("format") != TABLE_FORMAT:
            raise BlockspecError(f"{where}: not a blockspec cost table (format {raw.get('format')!r}, "
                                 f"expected {TABLE_FORMAT!r})")
        if raw.get("version") != TABLE_VERSION:
            raise BlockspecError(f"{where}: unsupported version {raw.get('version')!r} (expected {TABLE_VERSION})")
        for key in ("model", "dtype", "machine", "n", "time_s"):
            if key not in raw:
                raise BlockspecError(f"{where}: missing required key '{key}'")
        meta = raw.get("meta", {})
        if not isinstance(meta, dict):
            raise BlockspecError(f"{where}: 'meta' must be an object")
        by_slots = raw.get("draft_time_by_slots_s", {})
        if not isinstance(by_slots, dict) or not all(isinstance(k, str) and k.isdigit() for k in by_slots):
            raise BlockspecError(f"{where}: 'draft_time_by_slots_s' must map slot counts to lists of seconds")
        slot_times = {int(k): v for k, v in by_slots.items()}
        if "draft_time_1slot_s" in raw and not slot_times:   # version-1 files of an earlier release
            slot_times = {1: raw["draft_time_1slot_s"]}
        try:
            return cls(raw["n"], raw["time_s"], raw["model"], raw["dtype"], raw["machine"], meta,
                       raw.get("draft_rows", []), raw.get("draft_time_s", []),
                       slot_times, raw.get("draft_window", 0))
        except BlockspecError as exc:
            raise BlockspecError(f"{where}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        return cls.from_dict(read_json(Path(path), "cost table"), where=str(path))


def plan(survival: torch.Tensor, table: CostTable | None, draft_time_s: float = 0.0,
         min_survival: float = 0.0, base_rows: int | None = None) -> torch.Tensor:
    """Drafts to verify per request, [R] long (design section 5, DSpark Algorithm 1).

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
    steps = torch.arange(r * g + 1)
    tau = base + torch.cat([torch.zeros(1, dtype=torch.float64), flat[order].cumsum(0)])
    value = tau / (draft_time_s + table.time(base + steps))
    # Admit until the first non-improving slot: the early stop is a correctness rule
    # (x_j's own admission may not depend on x_j), not a global argmax over cut points.
    admit = (value[1:] > value[:-1]) & (flat[order] >= min_survival)
    admitted = int(admit.long().cumprod(0).sum())
    lens = torch.bincount(order[:admitted] % r, minlength=r)
    return lens.to(survival.device)


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
            else:
                tokens, n = self._uniform_plan(survival[:block], rows, t_draft, times)
            t_spec = t_draft + times[rows + n]
            if best is None or tokens / t_spec > best[0] / best[1]:
                best = (tokens, t_spec, block)
        assert best is not None
        return (*best, times[rows])

    def _uniform_plan(self, survival: list[float], rows: int, t_draft: float, times: list[float]
                      ) -> tuple[float, int]:
        """`plan` for `rows` requests that all show the same non-increasing survival:
        slots are admitted slot by slot, row by row, while the expected rate improves.
        Returns (expected tokens, admitted drafts), in plain floats (the gate runs it for
        every block length each time the curve moves)."""
        tau, n = float(rows), 0
        value = tau / (t_draft + times[rows])
        for s in survival:
            if s < self.min_survival:
                break
            for _ in range(rows):
                nxt = (tau + s) / (t_draft + times[rows + n + 1])
                if not nxt > value:
                    return tau, n
                tau, n, value = tau + s, n + 1, nxt
        return tau, n

    def observe(self, rows: int, drafting_rows: int, slots: int, verified_drafts: int, seconds: float) -> None:
        """A finished round's wall time: `rows` running requests, of which the first
        `drafting_rows` drafted a block of `slots` slots, verifying `verified_drafts` drafts in all."""
        predicted = self.table.time_at(rows + verified_drafts)
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

    A head trained on sampled acceptance (design section 5) under-rates greedy
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

    def apply(self, confidence: torch.Tensor) -> torch.Tensor:
        """Rescaled confidences [R, g] (float64)."""
        g = confidence.shape[1]
        return (confidence.double() * self.scale[:g].to(confidence.device)).clamp(max=1.0)

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


def _split(n: int, rows: int) -> torch.Tensor:
    """n tokens over `rows` rows as evenly as possible (each row >= 1)."""
    base = torch.full((rows,), n // rows, dtype=torch.long)
    base[: n % rows] += 1
    return base


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def profile_cost_table(target: TargetModel, ns: list[int], repeats: int = 5, *, rows: int = 8,
                       context: int = 128, capture: tuple[int, ...] = (), warmup: int = 2,
                       seed: int = 0, draft: "DraftModel | None" = None,
                       draft_rows: list[int] | None = None, draft_slots: list[int] | None = None) -> CostTable:
    """Measure the packed verify forward (`TargetModel.forward_packed`) for each n.

    n tokens are spread over min(n, rows) rows, each already holding `context`
    cached positions. Each time is the fastest of `repeats` runs (on a shared machine
    noise only ever adds time) and times never fall as n grows (a running maximum),
    so one noisy point cannot make the planner see free tokens. With a draft, also
    the draft round for each of `draft_rows`, over the full block and over shorter
    blocks of `draft_slots` drafts (default `DRAFT_SLOT_COUNTS` below the window)."""
    if not ns or repeats < 1 or rows < 1 or context < 0:
        raise BlockspecError("profile_cost_table needs ns, repeats >= 1, rows >= 1, context >= 0")
    ns = sorted(set(int(n) for n in ns))
    if ns[0] < 1:
        raise BlockspecError("profile_cost_table: every n must be >= 1")
    device = target.device
    cache = target.new_cache(rows, context + ns[-1] + 1)
    gen = torch.Generator().manual_seed(seed)
    times = []
    for n in ns:
        counts = _split(n, min(n, rows)).to(device)
        view = cache.slice_rows(0, counts.shape[0])
        tokens = torch.randint(0, target.config.vocab_size, (n,), generator=gen).to(device)
        samples = []
        for i in range(warmup + repeats):
            view.lengths.fill_(context)
            _sync(device)
            t0 = time.perf_counter()
            target.forward_packed(tokens, counts, view, capture=capture)
            _sync(device)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        times.append(max(min(samples), times[-1] if times else 0.0))
    d_rows: list[int] = []
    d_times: list[float] = []
    by_slots: dict[int, list[float]] = {}
    window = 0
    if draft is not None:
        d_rows = sorted(set(int(r) for r in (draft_rows or [1, 2, 4, 8, 16, 32])))
        d_times = profile_draft(target, draft, d_rows, repeats=repeats, context=context, warmup=warmup, seed=seed)
        window = draft.config.num_drafts
        for s in sorted(set(int(s) for s in (draft_slots or DRAFT_SLOT_COUNTS) if 1 <= int(s) < window)):
            measured = profile_draft(target, draft, d_rows, repeats=repeats, context=context, warmup=warmup,
                                     seed=seed, slots=s)
            by_slots[s] = [min(a, b) for a, b in zip(measured, d_times)]   # never dearer than the full block
    return CostTable(ns, times, model=model_signature(target), dtype=dtype_name(target.dtype),
                     machine=machine_signature(device),
                     meta={"rows": rows, "context": context, "repeats": repeats, "capture": list(capture)},
                     draft_rows=d_rows, draft_times_s=d_times, draft_slot_times=by_slots,
                     draft_window=window if by_slots else 0)


@torch.inference_mode()
def profile_draft(target: TargetModel, draft: "DraftModel", rows_list: list[int], repeats: int = 5, *,
                  context: int = 128, warmup: int = 2, seed: int = 0, slots: int | None = None) -> list[float]:
    """Time of one draft round (`speculate.propose`, greedy, a block of `slots` drafts;
    default the full block) for each number of rows: the fastest of `repeats`, never falling as rows grow."""
    from blockspec.config import SamplingParams
    from blockspec.decoding.sampling import RowSampler
    from blockspec.decoding.speculate import propose

    device = target.device
    gen = torch.Generator().manual_seed(seed)
    feat_dim = len(draft.config.target_layer_ids) * draft.config.hidden_size
    times = []
    for r in rows_list:
        if r < 1:
            raise BlockspecError("profile_draft: every row count must be >= 1")
        cache = draft.new_cache(r, context + draft.config.block_size + 1)
        feats = torch.randn(r, context, feat_dim, generator=gen).to(device=device, dtype=draft.dtype)
        draft.append_context(cache, feats, context)
        anchors = torch.randint(0, target.config.vocab_size, (r,), generator=gen).to(device)
        sampler = RowSampler.from_params([SamplingParams()] * r, device)
        samples = []
        for i in range(warmup + repeats):
            _sync(device)
            t0 = time.perf_counter()
            propose(draft, target, cache, anchors, sampler, num_drafts=slots)
            _sync(device)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        times.append(max(min(samples), times[-1] if times else 0.0))
    return times
