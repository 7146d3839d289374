"""Measurement: interleaved timed runs, per-arm totals, DSpark calibration and engine
throughput vs concurrency (docs/design.md sections 1, 5 and 11).

- For each prompt every arm runs back to back, and the arm order is rotated from
  one prompt (and repeat) to the next, so thermal / background drift hits every
  arm equally.  One untimed warm-up run per arm comes first.
- A prompt's time is the median wall-clock time of its repeats (same seed, so
  the same tokens).
- T_draft / T_verify per round and T_ar per step come from
  :class:`~blockspec.decoding.generate.Timing` (the engine's scheduler planning
  time counts as verify time for ``dspark-scheduled``).
- DSpark calibration: a separate, untimed batch-1 `generate` pass whose round
  observer (:class:`~blockspec.metrics.RoundRecorder`) records each
  round's confidences; the survival ``s_k = prod c_j`` is scored against the actual
  prefix outcomes with :func:`~blockspec.metrics.calibration`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockspec.bench import plots
from blockspec.bench.arms import Arm, BenchSetup, RunRecord
from blockspec.bench.context import ContextAcceptance
from blockspec.config import SamplingParams
from blockspec.decoding.generate import RoundRecorder
from blockspec.decoding.generate import GenerateOptions, Timing, generate
from blockspec.decoding.policy import PolicyOptions
from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError
from blockspec.metrics import AcceptanceStats, calibration
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel

__all__ = ["paired_ratio", "sync", "rotation", "ArmTotals", "timed_run", "measure", "warm_up", "calibrates", "collect_calibration",
           "throughput_vs_concurrency"]


def paired_ratio(speeds: Sequence[float], base_speeds: Sequence[float]) -> float:
    """The median over repeats of an arm's speed over the base arm's in the same repeat: the
    machine's slow spells last seconds, a repeat's arms take turns, and a ratio within a
    repeat cancels what the spell did to both (a ratio of medians mixes different spells)."""
    return statistics.median(x / base for x, base in zip(speeds, base_speeds, strict=True))


def sync(device: torch.device) -> None:
    """Wall-clock times are only meaningful once queued GPU work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rotation(n: int, shift: int) -> list[int]:
    """Arm order for one prompt/repeat: rotated so no arm always runs first (or last)."""
    return [(shift + j) % n for j in range(n)]


@dataclass
class ArmTotals:
    """Everything one arm produced over one (dataset, temperature) group."""

    runs: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    timing: Timing = field(default_factory=Timing)
    has_rounds: bool = False
    outputs: list[list[int]] = field(default_factory=list)   # per prompt, in prompt order
    by_context: ContextAcceptance = field(default_factory=ContextAcceptance)

    def add(self, records: list[RunRecord], prompt_len: int) -> None:
        """One prompt's repeats: first repeat's tokens/rounds (repeats are identical), median time."""
        first = records[0]
        self.tokens += first.tokens
        self.outputs.append(first.output)
        self.wall_s += statistics.median(r.wall_s for r in records)
        if first.stats is not None:
            self.has_rounds = True
            self.acceptance.add_rounds(first.stats.accepted, first.stats.verified)
            self.by_context.add(prompt_len, first.stats.accepted, first.stats.verified)
        for r in records:
            self.runs += 1
            if r.timing is not None:
                self.timing.prefill_s += r.timing.prefill_s
                self.timing.draft_s += r.timing.draft_s
                self.timing.verify_s += r.timing.verify_s
                self.timing.rounds += r.timing.rounds


def timed_run(arm: Arm, ids: list[int], params: SamplingParams, device: torch.device) -> RunRecord:
    sync(device)
    t0 = time.perf_counter()
    record = arm.run(ids, params)
    sync(device)
    return dataclasses.replace(record, wall_s=time.perf_counter() - t0)


def measure(arms: list[Arm], prompts: list[list[int]], params: list[SamplingParams], repeats: int,
            device: torch.device, tick: Callable[[str], None]) -> list[ArmTotals]:
    """Interleaved measurement: per prompt and repeat, every arm back to back in rotated order."""
    totals = [ArmTotals() for _ in arms]
    for i, (ids, p) in enumerate(zip(prompts, params)):
        records: list[list[RunRecord]] = [[] for _ in arms]
        for rep in range(repeats):
            for k in rotation(len(arms), i * repeats + rep):
                records[k].append(timed_run(arms[k], ids, p, device))
                tick(arms[k].label)
        for total, recs in zip(totals, records):
            total.add(recs, len(ids))
    return totals


def warm_up(arms: list[Arm], ids: list[int], setup: BenchSetup, tick: Callable[[str], None]) -> None:
    """One untimed run per arm: allocations, fused weights and kernel selection stay out of the numbers."""
    params = SamplingParams(max_new_tokens=min(8, setup.max_new_tokens), ignore_eos=True)
    for arm in arms:
        timed_run(arm, ids, params, setup.target.device)
        tick(f"warm-up {arm.label}")


def calibrates(arm: Arm) -> bool:
    """Calibration is a property of the draft: measured once, on the full-window dspark arm."""
    return (arm.method == "dspark" and not arm.simulated and arm.draft is not None
            and arm.draft.confidence_head is not None)


def collect_calibration(target: TargetModel, draft: DraftModel, prompts: Sequence[list[int]],
                        params: Sequence[SamplingParams], rule: str = "rejection",
                        tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Calibration of the confidence head's prefix survival against actual prefix acceptance:
    each prompt decoded alone by `generate`, its rounds recorded by a round observer."""
    if draft.confidence_head is None:
        raise BlockspecError("calibration needs a draft with a confidence head")
    recorder = RoundRecorder()
    for ids, p in zip(prompts, params):
        generate(target, [ids], p, draft=draft, rule=rule, policy=PolicyOptions(adapt=False),
                 options=GenerateOptions(observer=recorder))
        if tick is not None:
            tick()
    pred, outcome = recorder.survival_outcomes()
    if not pred:
        raise BlockspecError("calibration: no verify rounds were run (every request ended at its first token)")
    return calibration(pred, outcome)


def throughput_vs_concurrency(target: TargetModel, drafts: Mapping[str, DraftModel | None],
                              prompts: Sequence[list[int]], levels: Sequence[int], params: SamplingParams,
                              out_path: str | Path | None = None, scheduled_table: Any = None
                              ) -> dict[str, Any]:
    """Aggregate tokens/s of the continuous-batching engine at each concurrency level.

    For each method (`ar` plus every given draft) and level c, a fresh engine with
    max_running = c runs max(4, 2c) requests (prompts cycled) to completion, so the
    pool is refilled at least once (the protocol of benchmarks/engine_throughput.py).
    With `scheduled_table` (a CostTable) and a DSpark draft, "dspark-scheduled" runs
    too. tokens/s = generated tokens / wall time. Returns
    {"concurrency", "tokens_per_s": {method: [...]}} (and writes the plot when
    `out_path` is given)."""
    if not prompts or not levels or any(c < 1 for c in levels):
        raise BlockspecError("throughput_vs_concurrency needs prompts and concurrency levels >= 1")
    max_len = max(len(p) for p in prompts) + params.max_new_tokens
    tps: dict[str, list[float]] = {}
    arms = [("ar", None)] + [(m, d) for m, d in drafts.items() if d is not None]
    dspark = drafts.get("dspark")
    if scheduled_table is not None and dspark is not None and dspark.confidence_head is not None:
        arms.append(("dspark-scheduled", dspark))
    for name, draft in arms:
        tps[name] = []
        method = name.removesuffix("-scheduled")
        for c in levels:
            scheduled = name.endswith("-scheduled")
            policy = PolicyOptions(scheduled=scheduled, cost_table=scheduled_table if scheduled else None)
            engine = Engine(target, draft, method=method, max_running=c, max_model_len=max_len, policy=policy)
            batch = [list(prompts[i % len(prompts)]) for i in range(max(4, 2 * c))]
            sync(target.device)
            t0 = time.perf_counter()
            completions = engine.generate(batch, params)
            sync(target.device)
            tps[name].append(sum(len(x.tokens) for x in completions) / (time.perf_counter() - t0))
    if out_path is not None:
        plots.plot_throughput_vs_concurrency(list(levels), tps, out_path)
    return {"concurrency": list(levels), "tokens_per_s": tps}
