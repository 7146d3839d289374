"""The arms of a benchmark: one runner per (method, block size) (docs/design.md sections 1, 5 and 11).

Methods: ``ar`` (blockspec AR), ``hf`` (transformers ``generate`` on the same
checkpoint), ``dflash`` and ``dspark`` (the adaptive policy by default, as users
run them, and / or fixed full windows) and ``dspark-scheduled`` (the
continuous-batching engine with the confidence scheduler, batch 1).

``simulate_accept=TAU`` replaces each round's verification *outcome* by a
deterministic accepted-length pattern whose mean is ``TAU - 1`` (the real draft
and verify forwards still run), so per-round overhead can be measured on
random-weight models.  Such output is NOT lossless and is labelled so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockspec.config import DRAFT_METHODS, METHODS as GENERATE_METHODS, SamplingParams
from blockspec.decoding.cost_table import CostTable, ProfileOptions, profile_cost_table
from blockspec.decoding.generate import GenerateOptions, Timing, generate
from blockspec.decoding.output import RequestStats
from blockspec.decoding.policy import PolicyOptions, RoundPolicy
from blockspec.decoding.round import Forwards, WrappedForwards
from blockspec.decoding.sampling import RowSampler, Verdict, sample
from blockspec.engine.engine import Engine, EngineOptions
from blockspec.errors import BlockspecError
from blockspec.models.draft import DraftModel
from blockspec.models.target import TargetModel

__all__ = ["METHODS", "RunRecord", "Runner", "Arm", "BenchSetup", "ForcedAcceptance", "accept_pattern", "build_arms"]


METHODS = (*GENERATE_METHODS, "hf", "dspark-scheduled")   # generate's methods plus the bench's own arms


def draft_kind(method: str) -> str | None:
    """The draft a bench method runs: "dflash" / "dspark" (variants such as "dspark-scheduled" included), else None."""
    kind = method.split("-", 1)[0]
    return kind if kind in DRAFT_METHODS else None


@dataclass
class RunRecord:
    """One timed generation: output token count, wall time, (for round-based methods) stats,
    and the output token ids themselves (the report scores their degeneracy and code quality)."""

    tokens: int
    wall_s: float
    stats: RequestStats | None
    timing: Timing | None
    output: list[int]


Runner = Callable[[list[int], SamplingParams], RunRecord]


@dataclass
class Arm:
    """One measured configuration: a method, with its draft at one block size."""

    method: str
    run: Runner
    draft: DraftModel | None = None
    simulated: bool = False
    policy: str = ""          # speculative arms: "adaptive" (the default policy) or "fixed" (full window)

    @property
    def block_size(self) -> int | None:
        return self.draft.config.block_size if self.draft is not None else None

    @property
    def label(self) -> str:
        if self.draft is None:
            return self.method
        return f"{self.method} B={self.block_size}" + (f" {self.policy}" if self.policy else "")


def accept_pattern(tau: float, num_drafts: int, start: int = 0) -> Iterator[int]:
    """Accepted-draft counts for rounds start, start+1, ... of a sequence whose running
    mean is ``tau - 1`` (any n consecutive rounds sum to within 1 of n * (tau - 1)).

    Deterministic (Bresenham-style: every value is floor or ceil of tau-1), so a
    simulated run's tau does not depend on luck, even over a handful of rounds.
    Raises at once (not at the first round) when the window cannot reach tau."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 1.0 <= tau <= num_drafts + 1:
        raise BlockspecError(f"simulated tau must be in [1, {num_drafts + 1}] for a {num_drafts}-draft "
                             f"window (tau counts the bonus token), got {tau!r}")
    mean = float(tau) - 1.0

    def pattern() -> Iterator[int]:
        k = start
        while True:
            yield math.floor((k + 1) * mean + 1e-9) - math.floor(k * mean + 1e-9)
            k += 1
    return pattern()


class ForcedAcceptance(WrappedForwards):
    """Simulated acceptance (benchmarks only, NOT lossless): the round's forwards run as
    `inner`'s, the acceptance rule still runs for its cost, and its verdict is replaced by
    the next of `counts` for every row (clamped to what each row verified), the bonus
    sampled after that prefix. Wraps generate's forwards (`GenerateOptions.forwards`) or
    an engine's (`Engine.forwards`)."""

    def __init__(self, inner: Forwards, counts: Iterator[int]) -> None:
        super().__init__(inner)
        self.counts = counts

    def verdict(self, logits: torch.Tensor, drafts: torch.Tensor, probs: torch.Tensor | None, sampler: RowSampler,
                num_drafts: torch.Tensor | None, rule: str) -> Verdict:
        self.inner.verdict(logits, drafts, probs, sampler, num_drafts, rule)
        rows = logits.shape[0]
        verified = num_drafts if num_drafts is not None else torch.full((rows,), drafts.shape[1], device=logits.device)
        forced = torch.minimum(torch.full((rows,), next(self.counts), device=logits.device), verified)
        index = torch.arange(rows, device=logits.device)
        return Verdict(forced, sample(logits[index, forced].unsqueeze(1), sampler)[0][:, 0])


@dataclass(kw_only=True)
class BenchSetup:
    """The loaded models and every option of one benchmark run."""

    target_dir: Path
    target: TargetModel
    drafts: dict[str, DraftModel]
    methods: list[str]
    block_sizes: list[int] | None
    simulate_accept: float | None
    rule: str
    max_model_len: int
    cost_table: str | Path | None
    temperatures: list[float]
    max_new_tokens: int
    repeats: int
    seed: int
    ignore_eos: bool
    out_dir: Path
    policies: tuple[str, ...] = ("adaptive",)   # speculative arms per draft: "adaptive" and / or "fixed"
    remeasure_costs: bool = False   # adaptive arms measure their cost table again (before any timing)

    def params(self, temperature: float, count: int) -> list[SamplingParams]:
        """Per-prompt sampling settings: one seed per prompt (repeats reuse it and decode the same tokens)."""
        return [SamplingParams(temperature=temperature, max_new_tokens=self.max_new_tokens, seed=self.seed + i,
                               ignore_eos=self.ignore_eos) for i in range(count)]


def _generate_runner(target: TargetModel, draft: DraftModel | None, method: str, rule: str,
                     adaptive: bool = False, remeasure: bool = False) -> Runner:
    """The product path: `generate` exactly as users call it. adaptive: one adaptive
    policy learns across the arm's requests, as in a server (fixed: full windows); it is
    built here, before any timing, so measuring its cost table (remeasure: again) never
    counts in the arm's speed."""
    options = PolicyOptions(adapt=adaptive, remeasure=remeasure and adaptive and draft is not None)
    policy = RoundPolicy.for_method(target, draft, method, options, rows=1)

    def run(ids: list[int], params: SamplingParams) -> RunRecord:
        out = generate(target, [ids], params, draft=draft, method=method, rule=rule, policy=policy)
        completion = out.completions[0]
        return RunRecord(len(completion.tokens), 0.0, completion.stats, out.timing, list(completion.tokens))
    return run


def _simulated_runner(target: TargetModel, draft: DraftModel, method: str, tau: float, rule: str) -> Runner:
    """`generate` with imposed acceptance: real draft and verify forwards (not lossless)."""
    g = draft.config.num_drafts
    accept_pattern(tau, g)  # raises now, not mid-benchmark
    # One pattern runs on across requests (a request's few rounds alone would round tau);
    # a repeat of a request restarts where that request first started, so repeats match.
    starts: dict[tuple[Any, ...], int] = {}
    consumed = 0

    def run(ids: list[int], params: SamplingParams) -> RunRecord:
        nonlocal consumed
        key = (tuple(ids), params.temperature, params.seed, params.max_new_tokens)
        first = key not in starts
        start = starts.setdefault(key, consumed)
        forced = GenerateOptions(forwards=lambda inner: ForcedAcceptance(inner, accept_pattern(tau, g, start)))
        out = generate(target, [ids], params, draft=draft, method=method, rule=rule,
                       policy=PolicyOptions(adapt=False), options=forced)
        completion = out.completions[0]
        if first:
            consumed += completion.stats.rounds
        return RunRecord(len(completion.tokens), 0.0, completion.stats, out.timing, list(completion.tokens))
    return run


def _engine_timing(before: dict[str, Any], after: dict[str, Any]) -> Timing:
    """Engine metrics are cumulative: the difference is one request's timing."""
    t0, t1 = before["time_s"], after["time_s"]
    spent = {k: t1.get(k, 0.0) - t0.get(k, 0.0) for k in ("prefill", "draft", "plan", "verify")}
    return Timing(prefill_s=spent["prefill"], draft_s=spent["draft"], verify_s=spent["verify"] + spent["plan"],
                  rounds=after["rounds"] - before["rounds"])


def _scheduled_runner(target: TargetModel, draft: DraftModel, table: CostTable, max_model_len: int,
                      rule: str) -> Runner:
    """DSpark confidence-scheduled verification through the continuous-batching engine (batch 1)."""
    engine = Engine(target, draft, method="dspark", max_running=1, max_model_len=max_model_len,
                    policy=PolicyOptions(scheduled=True, cost_table=table), options=EngineOptions(rule=rule))

    def run(ids: list[int], params: SamplingParams) -> RunRecord:
        before = engine.metrics()
        completion = engine.generate([ids], params)[0]
        return RunRecord(len(completion.tokens), 0.0, completion.stats, _engine_timing(before, engine.metrics()),
                         list(completion.tokens))
    return run


def _hf_runner(target_dir: Path, target: TargetModel) -> Runner:
    """transformers' own `generate` on the same checkpoint, dtype and device (the AR reference)."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise BlockspecError("method 'hf' needs transformers: pip install transformers") from None
    hf_logging.disable_progress_bar()  # one progress bar (ours) at a time
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=target.dtype).to(target.device).eval()
    eos = list(target.config.eos_token_id)

    def run(ids: list[int], params: SamplingParams) -> RunRecord:
        x = torch.tensor([ids], device=target.device)
        kwargs: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "do_sample": not params.greedy,
                                  "pad_token_id": eos[0] if eos else 0}
        if params.ignore_eos:
            kwargs["min_new_tokens"] = params.max_new_tokens
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
            torch.manual_seed(params.seed if params.seed is not None else 0)
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        new = out[0, len(ids):].tolist()
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        kept = next((i for i, t in enumerate(new) if t in stops), len(new))
        return RunRecord(kept, 0.0, None, None, new[:kept])
    return run


def _resized(draft: DraftModel, block_size: int | None) -> DraftModel:
    """`draft` running `block_size` (the trained size when None); the weights are shared (a
    block-size sweep of an 8B-scale draft must not hold one weight copy per size)."""
    if block_size is None or block_size == draft.config.block_size:
        return draft
    return draft.with_block_size(block_size)


def _draft_variants(draft: DraftModel, block_sizes: list[int] | None, method: str,
                    notes: list[str]) -> list[DraftModel]:
    """The draft at every requested block size it can run (larger than trained is skipped)."""
    if block_sizes is None:
        return [draft]
    out = []
    for bs in block_sizes:
        try:
            out.append(_resized(draft, bs))
        except BlockspecError as exc:
            notes.append(f"{method}: block size {bs} skipped ({exc})")
    return out


def _cost_table(target: TargetModel, drafts: Sequence[DraftModel], path: str | Path | None,
                notes: list[str]) -> CostTable:
    """The scheduler's verify cost table: loaded, or profiled now for windows 1..max(g)+1 at batch 1."""
    if path is not None:
        table = CostTable.load(path)
        table.check_target(target)
        notes.append(f"dspark-scheduled: cost table {path}")
        return table
    window = max(d.config.num_drafts for d in drafts) + 1
    capture = tuple(drafts[0].config.target_layer_ids)
    table = profile_cost_table(target, list(range(1, window + 1)), ProfileOptions(repeats=3, rows=1), capture=capture,
                               draft=drafts[0], draft_rows=[1])
    notes.append(f"dspark-scheduled: cost table profiled at start (n = 1..{window}, full and one-slot draft rounds, "
                 "batch 1, fastest of 3)")
    return table


def build_arms(setup: BenchSetup, notes: list[str]) -> list[Arm]:
    """One arm per (method, block size); dspark and dspark-scheduled share their draft copies."""
    target = setup.target
    arms = [Arm("ar", _generate_runner(target, None, "ar", "rejection"))]
    variants = {key: _draft_variants(d, setup.block_sizes, key, notes) for key, d in setup.drafts.items()}
    for method in setup.methods:
        if method == "ar":
            continue
        if method == "hf":
            arms.append(Arm("hf", _hf_runner(setup.target_dir, target)))
            continue
        drafts = variants[draft_kind(method)]
        if method == "dspark-scheduled":
            arms.extend(_scheduled_arms(setup, drafts, notes))
            continue
        for d in drafts:
            if setup.simulate_accept is None:
                for policy in setup.policies:
                    runner = _generate_runner(target, d, method, setup.rule, adaptive=policy == "adaptive",
                                              remeasure=setup.remeasure_costs)
                    arms.append(Arm(method, runner, d, policy=policy))
                continue
            try:
                runner = _simulated_runner(target, d, method, setup.simulate_accept, setup.rule)
                arms.append(Arm(method, runner, d, simulated=True))
            except BlockspecError as exc:
                if setup.block_sizes is None or len(drafts) == 1:
                    raise
                notes.append(f"{method} B={d.config.block_size} skipped: {exc}")
    return arms


def _scheduled_arms(setup: BenchSetup, drafts: list[DraftModel], notes: list[str]) -> list[Arm]:
    if setup.simulate_accept is not None:
        notes.append("dspark-scheduled skipped: simulated acceptance cannot drive the engine's scheduler")
        return []
    if not drafts or drafts[0].confidence_head is None:
        notes.append("dspark-scheduled skipped: the dspark draft has no confidence head")
        return []
    table = _cost_table(setup.target, drafts, setup.cost_table, notes)
    return [Arm("dspark-scheduled", _scheduled_runner(setup.target, d, table, setup.max_model_len, setup.rule), d)
            for d in drafts]
