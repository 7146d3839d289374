"""The verify cost table T(n) (docs/design.md section 5) and how it is measured.

`CostTable`: the measured time T(n) of one packed target verify forward over
n tokens on this machine (saved as JSON with the model / dtype / machine it was
measured on), plus, optionally, draft round times by row count and block
length. `profile_cost_table` measures one (`blockspec profile`).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from blockspec.config import SamplingParams, read_json
from blockspec.decoding.round import propose
from blockspec.decoding.sampling import RowSampler
from blockspec.errors import BlockspecError
from blockspec.models.chain_draft import AnyDraft, Eagle3Drafter
from blockspec.models.target import TargetModel

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


# Flags of the matrix units that change which precision and shapes run fastest.
MATRIX_UNIT_FLAGS = ("avx512_bf16", "amx_bf16", "amx_int8")


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name with its family / model numbers and bf16 matrix units, from
    /proc/cpuinfo's first processor (else what `platform` says): two CPUs with as many
    cores time differently, so cost tables name it, and a virtual machine's "AMD EPYC"
    is the same name for CPUs with and without bf16 units."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip() and fields:   # the first processor's block ends
            break
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine() or "unknown cpu"
    units = [f for f in MATRIX_UNIT_FLAGS if f in fields.get("flags", "").split()]
    detail = [f"family {fields['cpu family']} model {fields['model']}"] if "cpu family" in fields and "model" in fields else []
    detail += units
    return f"{name} ({'; '.join(detail)})" if detail else name


def machine_signature(device: torch.device | str) -> str:
    """What a cost table's timings were measured on: the GPU's name, or the CPU's model,
    architecture and core count (and torch's version)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)} torch {torch.__version__}"
    return f"{device.type} {cpu_model()} {platform.machine()} {os.cpu_count()} cpus torch {torch.__version__}"


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
    _dense_list: list[float] | None = field(default=None, init=False, repr=False, compare=False)
    # draft_time by (rows, block): the gate prices every finished round with it.
    _draft_memo: dict[tuple[int, float | None], float] = field(default_factory=dict, init=False, repr=False,
                                                                compare=False)

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

    def time(self, n: torch.Tensor | int) -> torch.Tensor | float:
        """T(n) in seconds: a float for one token count (the gate prices every round in
        plain floats), else float64 of n's shape. Integer counts are looked up in a
        dense table of T(0), T(1), ... (planning reads it every round)."""
        if isinstance(n, int):
            return self.times_upto(max(n, 0))[max(n, 0)]
        if isinstance(n, torch.Tensor) and not n.is_floating_point() and n.numel() and n.device.type == "cpu":
            return self._dense_upto(int(n.max()))[n.clamp(min=0)]
        return interpolate(self.ns, self.times_s, n)

    def times_upto(self, top: int) -> list[float]:
        """[T(0), T(1), ..., T(top)] as plain floats."""
        self._dense_upto(top)
        assert self._dense_list is not None
        return self._dense_list

    def _dense_upto(self, top: int) -> torch.Tensor:
        if self._dense is None or top >= len(self._dense):
            self._dense = interpolate(self.ns, self.times_s, torch.arange(2 * top + 64))
            self._dense_list = self._dense.tolist()
        return self._dense

    def rescale(self, factor: float) -> None:
        """Every time (verify and draft) times `factor`, in place: live rounds showed the
        machine runs this much slower (> 1) or faster than when the table was measured."""
        if not (math.isfinite(factor) and factor > 0):
            raise BlockspecError(f"cost table: a rescale factor must be positive and finite, got {factor!r}")
        self.times_s = [t * factor for t in self.times_s]
        self.draft_times_s = [t * factor for t in self.draft_times_s]
        self.draft_slot_times = {s: [t * factor for t in ts] for s, ts in self.draft_slot_times.items()}
        self.meta["rescaled"] = self.scale * factor
        self._dense, self._dense_list = None, None
        self._draft_memo.clear()

    @property
    def scale(self) -> float:
        """How much the times were rescaled since they were measured (`rescale`), in all."""
        return float(self.meta.get("rescaled", 1.0))

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

    def draft_time(self, rows: int, block: float | None = None) -> float:
        """Interpolated draft round time in seconds for `rows` requests (needs draft times);
        with `block` and times by block length, for a round that drafts a block of that many drafts."""
        memo = self._draft_memo.get((rows, block))
        if memo is not None:
            return memo
        if not self.draft_rows:
            raise BlockspecError("this cost table has no draft times (profile it with a draft)")
        if len(self._draft_memo) >= 4096:   # an engine's row counts come and go
            self._draft_memo.clear()
        seconds = self._draft_memo[(rows, block)] = self._draft_time(rows, block)
        return seconds

    def _draft_time(self, rows: int, block: float | None) -> float:
        full = _interpolate_one(self.draft_rows, self.draft_times_s, float(rows))
        if block is None or not self.draft_slot_times:
            return full
        counts = self.draft_slot_counts
        times = [_interpolate_one(self.draft_rows, self.draft_slot_times[s], float(rows)) for s in counts[:-1]]
        times = [min(t, full) for t in times] + [full]   # never dearer than the full block
        at = min(max(float(block), float(counts[0])), float(counts[-1]))
        return _interpolate_one(counts, times, at)

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
        return cls.from_dict(read_json(Path(path), "cost table", in_checkpoint=False), where=str(path))



def _split(n: int, rows: int) -> torch.Tensor:
    """n tokens over `rows` rows as evenly as possible (each row >= 1)."""
    base = torch.full((rows,), n // rows, dtype=torch.long)
    base[: n % rows] += 1
    return base


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """How `profile_cost_table` measures: the fastest of `repeats` timed runs after `warmup`
    untimed ones, over up to `rows` rows each holding `context` cached positions, random
    tokens from `seed`; shorter draft blocks of `draft_slots` drafts (default
    `DRAFT_SLOT_COUNTS` below the window)."""

    repeats: int = 5
    rows: int = 8
    context: int = 128
    warmup: int = 2
    seed: int = 0
    draft_slots: Sequence[int] | None = None


# Told (done, total) after each measured point: a caller's progress line.
Progress = Callable[[int, int], None]


def monotone(ys: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ys (pool adjacent violators): a forward over
    more tokens (rows, drafted slots) never costs less. Unlike a running maximum, one point
    a busy spell inflated does not raise every point after it; it is averaged with its
    neighbours instead."""
    blocks: list[list[float]] = []   # [sum, count] of pooled runs, each run's mean above the last's
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _timed(run: Callable[[], None], device: torch.device) -> float:
    """One timed run of `run` (seconds), the device synchronised around it."""
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - t0


def interleaved_minimum(runs: Sequence[Callable[[], None]], repeats: int, warmup: int, device: torch.device,
                        tick: Callable[[], None] | None = None) -> list[float]:
    """The fastest of `repeats` timed runs of each of `runs`, after `warmup` untimed sweeps.
    The runs take turns (every sweep times each once), so a busy spell of a shared machine
    lands on a few samples of many points, never on every sample of one point (which the
    minimum cannot undo). tick(): after each timed run (progress)."""
    best = [math.inf] * len(runs)
    for sweep in range(warmup + repeats):
        for i, run in enumerate(runs):
            seconds = _timed(run, device)
            if sweep >= warmup:
                best[i] = min(best[i], seconds)
                if tick is not None:
                    tick()
    return best


@torch.inference_mode()
def profile_cost_table(target: TargetModel, ns: list[int], options: ProfileOptions | None = None, *,
                       capture: tuple[int, ...] = (), draft: AnyDraft | None = None,
                       draft_rows: list[int] | None = None, progress: Progress | None = None) -> CostTable:
    """Measure the packed verify forward (`TargetModel.forward_packed`) for each n.

    n tokens are spread over min(n, rows) rows, each already holding `context`
    cached positions (`ProfileOptions`). Each time is the fastest of `repeats` runs, the
    points taking turns (`interleaved_minimum`: on a shared machine noise only ever adds
    time), and the times are fitted non-decreasing in n (`monotone`), so one noisy point
    can neither make the planner see free tokens nor price every wider round out. With a
    draft, also the draft round for each of `draft_rows`, over the full block and over
    shorter blocks (`profile_drafts`). progress(done, total): told after each timed run."""
    o = options or ProfileOptions()
    repeats, rows, context, warmup, seed, draft_slots = o.repeats, o.rows, o.context, o.warmup, o.seed, o.draft_slots
    if not ns or repeats < 1 or rows < 1 or context < 0:
        raise BlockspecError("profile_cost_table needs ns, repeats >= 1, rows >= 1, context >= 0")
    ns = sorted(set(int(n) for n in ns))
    if ns[0] < 1:
        raise BlockspecError("profile_cost_table: every n must be >= 1")
    device = target.device
    d_rows = sorted(set(int(r) for r in (draft_rows or [1, 2, 4, 8, 16, 32]))) if draft is not None else []
    window = draft.config.num_drafts if draft is not None else 0
    slot_counts = sorted(set(int(s) for s in (draft_slots or DRAFT_SLOT_COUNTS) if 1 <= int(s) < window))
    total = repeats * (len(ns) + len(d_rows) * (1 + len(slot_counts)))
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)
    per_row = max(-(-n // min(n, rows)) for n in ns)   # the most tokens one row receives
    cache = target.new_cache(rows, context + per_row + 1)
    gen = torch.Generator().manual_seed(seed)

    def verify_run(n: int) -> Callable[[], None]:
        counts = _split(n, min(n, rows)).to(device)
        view = cache.slice_rows(0, counts.shape[0])
        tokens = torch.randint(0, target.config.vocab_size, (n,), generator=gen).to(device)

        def run() -> None:
            view.lengths.fill_(context)
            target.forward_packed(tokens, counts, view, capture=capture)
        return run
    times = monotone(interleaved_minimum([verify_run(n) for n in ns], repeats, warmup, device, tick))
    d_times: list[float] = []
    by_slots: dict[int, list[float]] = {}
    if draft is not None:
        blocks = [*slot_counts, window]
        by_block = profile_drafts(target, draft, d_rows, blocks, repeats=repeats, context=context, warmup=warmup,
                                  seed=seed, tick=tick)
        for r in range(len(d_rows)):   # a longer block never drafts for less
            fitted = monotone([by_block[b][r] for b in blocks])
            for b, t in zip(blocks, fitted):
                by_block[b][r] = t
        d_times = by_block[window]
        by_slots = {s: by_block[s] for s in slot_counts}
    return CostTable(ns, times, model=model_signature(target), dtype=dtype_name(target.dtype),
                     machine=machine_signature(device),
                     meta={"rows": rows, "context": context, "repeats": repeats, "capture": list(capture)},
                     draft_rows=d_rows, draft_times_s=d_times, draft_slot_times=by_slots,
                     draft_window=window if by_slots else 0)


@torch.inference_mode()
def profile_drafts(target: TargetModel, draft: AnyDraft, rows_list: list[int], blocks: Sequence[int | None], *,
                   repeats: int = 5, context: int = 128, warmup: int = 2, seed: int = 0,
                   tick: Callable[[], None] | None = None) -> dict[int | None, list[float]]:
    """Time of one draft round (`round.propose`, greedy) per block length in `blocks`
    (None: the full block) and number of rows: {block: [time per row count]}, each the
    fastest of `repeats` with every (rows, block) taking turns (`interleaved_minimum`),
    fitted non-decreasing in rows (`monotone`). An EAGLE-3 round is a chain of `block`
    one-token forwards, so its time grows with the block where DFlash's one forward
    barely does; the table holds both as measured."""
    device = target.device
    gen = torch.Generator().manual_seed(seed)
    feat_dim = len(draft.config.target_layer_ids) * draft.config.hidden_size
    runs = []
    for r in rows_list:
        if r < 1:
            raise BlockspecError("profile_draft: every row count must be >= 1")
        cache = draft.new_cache(r, context + draft.config.block_size + 1)
        feats = torch.randn(r, context, feat_dim, generator=gen).to(device=device, dtype=draft.dtype)
        if isinstance(draft, Eagle3Drafter):   # its context also reads the token after each position
            tokens = torch.randint(0, target.config.vocab_size, (r, context), generator=gen).to(device)
            draft.append_context(cache, feats, context, tokens)
        else:
            draft.append_context(cache, feats, context)
        anchors = torch.randint(0, target.config.vocab_size, (r,), generator=gen).to(device)
        sampler = RowSampler.from_params([SamplingParams()] * r, device)
        for block in blocks:
            runs.append(lambda cache=cache, anchors=anchors, sampler=sampler, block=block:
                        propose(draft, target, cache, anchors, sampler, block))
    best = interleaved_minimum(runs, repeats, warmup, device, tick)
    return {block: monotone([best[i * len(blocks) + j] for i in range(len(rows_list))])
            for j, block in enumerate(blocks)}


def profile_draft(target: TargetModel, draft: AnyDraft, rows_list: list[int], repeats: int = 5, *,
                  context: int = 128, warmup: int = 2, seed: int = 0, block: int | None = None) -> list[float]:
    """`profile_drafts` for one block length (None: the full block)."""
    return profile_drafts(target, draft, rows_list, [block], repeats=repeats, context=context, warmup=warmup,
                          seed=seed)[block]
