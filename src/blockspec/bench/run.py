"""`run_bench`: load, build the arms, measure every dataset x temperature, report
(docs/design.md sections 1, 5 and 11).

Every method is judged by the section-1 cost model: tau (tokens per round,
bonus included), T_draft and T_verify per round, against T_ar per AR step.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import platform
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockspec.bench.arms import METHODS, Arm, BenchSetup, build_arms, draft_kind
from blockspec.bench.datasets import BenchPrompt, load_dataset
from blockspec.bench.draft_cost import draft_time_report
from blockspec.bench.measure import (ArmTotals, calibrates, collect_calibration, measure, throughput_vs_concurrency,
                                     warm_up)
from blockspec.bench.quality import code_quality
from blockspec.bench.report import group_plots, slug, summarize, write_outputs
from blockspec.config import DRAFT_METHODS, RULES
from blockspec.decoding.cost_table import ProfileOptions, profile_cost_table
from blockspec.errors import BlockspecError
from blockspec.loading import load_drafts
from blockspec.models.checkpoint import load_target, resolve_device
from blockspec.models.target import TargetModel
from blockspec.models.tokenizer import Tokenizer
from blockspec.training.data import keep_end

__all__ = ["BenchOptions", "run_bench"]

EncodedSets = dict[str, tuple[list[BenchPrompt], list[list[int]]]]   # dataset -> (prompts kept, token ids)


def _check_args(temperatures: Sequence[float], max_new_tokens: int, limit: int | None, repeats: int,
                block_sizes: Sequence[int] | None, rule: str, every: int = 1) -> None:
    if not temperatures or any(not math.isfinite(t) or t < 0 for t in temperatures):
        raise BlockspecError(f"temperatures must be a non-empty list of values >= 0, got {list(temperatures)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BlockspecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise BlockspecError(f"limit must be a positive integer, got {limit!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise BlockspecError(f"every must be a positive integer, got {every!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise BlockspecError(f"repeats must be a positive integer, got {repeats!r}")
    if block_sizes is not None and (not block_sizes or any(not isinstance(b, int) or b < 1 for b in block_sizes)):
        raise BlockspecError(f"block sizes must be positive integers, got {block_sizes!r}")
    if rule not in RULES:
        raise BlockspecError(f"unknown verification rule {rule!r} (choose rejection or match)")


def _resolve_methods(methods: Sequence[str] | None, drafts: Mapping[str, Any], notes: list[str]) -> list[str]:
    """Validate methods; AR is always measured (it is the speed-up baseline)."""
    if methods is None:
        methods = ["ar"] + [m for m in DRAFT_METHODS if drafts.get(m) is not None]
    methods = list(dict.fromkeys(methods))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise BlockspecError(f"unknown bench method(s) {unknown} (choose from {', '.join(METHODS)})")
    for m in methods:
        kind = draft_kind(m)
        if kind is not None and drafts.get(kind) is None:
            raise BlockspecError(f"method {m!r} needs a {kind} draft (--{kind}-draft DIR)")
    if "ar" not in methods:
        notes.append("ar added: it is the baseline of every speed-up")
        methods.insert(0, "ar")
    return methods


def _encode(prompts: Sequence[BenchPrompt], tokenizer: Any, budget: int, notes: list[str],
            name: str) -> tuple[list[BenchPrompt], list[list[int]]]:
    """Token ids per prompt, left-truncated to `budget` (the end is what the model continues)."""
    ids_out: list[list[int]] = []
    kept: list[BenchPrompt] = []
    cut = 0
    for p in prompts:
        ids = tokenizer.encode(p.text)
        if not ids:
            notes.append(f"{name}: prompt {p.id} encodes to no tokens; skipped")
            continue
        if len(ids) > budget:   # as training cuts prompts: the end, keeping a leading BOS
            ids, cut = keep_end(ids, budget, tokenizer.bos_token_id), cut + 1
        ids_out.append(ids)
        kept.append(p)
    if cut:
        notes.append(f"{name}: {cut} prompt(s) left-truncated to {budget} tokens to fit the context")
    if not ids_out:
        raise BlockspecError(f"dataset {name}: no usable prompts")
    return kept, ids_out


def _datasets(specs: Sequence[str] | Mapping[str, Sequence[BenchPrompt]], tokenizer: Any,
              limit: int | None, every: int = 1) -> dict[str, list[BenchPrompt]]:
    """{name: prompts}: every `every`-th prompt of each dataset (from the first), then the first `limit`."""
    items = specs.items() if isinstance(specs, Mapping) else (load_dataset(s, tokenizer) for s in specs)
    out: dict[str, list[BenchPrompt]] = {}
    for name, prompts in items:
        key, n = name, 2
        while key in out:  # two files with the same stem
            key, n = f"{name}-{n}", n + 1
        out[key] = list(prompts)[::every][:limit]
    if not out:
        raise BlockspecError("no datasets given")
    return out


def _encode_sets(datasets: Sequence[str] | Mapping[str, Sequence[BenchPrompt]], tokenizer: Any, limit: int | None,
                 target: TargetModel, max_new_tokens: int, notes: list[str], every: int = 1) -> EncodedSets:
    """{dataset: (prompts kept, token ids)}, every prompt fitting the model with max_new_tokens after it."""
    budget = target.config.supported_length - max_new_tokens
    if budget < 1:
        raise BlockspecError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                             f"{target.config.supported_length} positions")
    return {name: _encode(prompts, tokenizer, budget, notes, name)
            for name, prompts in _datasets(datasets, tokenizer, limit, every).items()}


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def _meta(setup: BenchSetup, drafts: Mapping[str, str | Path | None], sets: EncodedSets,
          limit: int | None, every: int, notes: list[str]) -> dict[str, Any]:
    """What was run, on what, so a result file can be trusted (or reproduced) later."""
    device = setup.target.device
    return {
        "target": str(setup.target_dir), "drafts": {k: str(v) for k, v in drafts.items() if v is not None},
        "draft_layouts": {k: d.config.layout for k, d in setup.drafts.items()},
        "methods": setup.methods, "temperatures": setup.temperatures, "max_new_tokens": setup.max_new_tokens,
        "limit": limit, "every": every, "repeats": setup.repeats, "block_sizes": setup.block_sizes,
        "simulate_accept": setup.simulate_accept, "lossless": setup.simulate_accept is None,
        "dtype": str(setup.target.dtype).removeprefix("torch."), "device": str(device),
        "machine": _machine(device), "seed": setup.seed, "ignore_eos": setup.ignore_eos, "rule": setup.rule,
        "prompts": {name: [p.id for p in prompts] for name, (prompts, _) in sets.items()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "notes": notes,
    }


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (stdout stays clean for the table); a no-op when disabled."""
    if not enabled:
        yield lambda label: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    columns = (TextColumn("[bold]bench[/] {task.description:<28}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=total)
        yield lambda label: bar.update(task, advance=1, description=label)


def _code_quality(row: dict[str, Any], total: ArmTotals, prompts: list[BenchPrompt], tokenizer: Any) -> None:
    """Parse / parse-with-body rates of the arm's completions on prompts that name a function."""
    if all(p.entry_point is None for p in prompts):
        row["code"], row["parse_body"] = None, None
        return
    texts = [tokenizer.decode(out) for out in total.outputs]
    row["code"] = code_quality([p.text for p in prompts], texts, [p.entry_point for p in prompts])
    row["parse_body"] = row["code"]["body_rate"] if row["code"] is not None else None


def _run_group(arms: list[Arm], prompts: list[BenchPrompt], prompt_ids: list[list[int]], group: dict[str, Any],
               setup: BenchSetup, tokenizer: Any, tick: Callable[[str], None]) -> list[dict[str, Any]]:
    """One (dataset, temperature): interleaved timing of every arm, quality of what each decoded,
    then DSpark calibration."""
    params = setup.params(group["temperature"], len(prompt_ids))
    totals = measure(arms, prompt_ids, params, setup.repeats, setup.target.device, tick)
    rows = [summarize(a, t, totals[0], group) for a, t in zip(arms, totals)]
    for row, total in zip(rows, totals):
        _code_quality(row, total, prompts, tokenizer)
    by_draft: dict[int, dict[str, Any]] = {}   # adaptive and fixed arms of one draft share its calibration
    for row, arm in zip(rows, arms):
        if calibrates(arm):
            assert arm.draft is not None
            if id(arm.draft) not in by_draft:
                label = f"calibration {arm.method} B={arm.block_size}"
                by_draft[id(arm.draft)] = collect_calibration(setup.target, arm.draft, prompt_ids, params, setup.rule,
                                                              tick=lambda: tick(label))
            row["calibration"] = by_draft[id(arm.draft)]
    return rows


def row_line(row: dict[str, Any]) -> str:
    """One finished row, as it is streamed to stdout (the full table comes at the end)."""
    speedup = f"{row['speedup']:.2f}x" if row.get("speedup") is not None else "-"
    return (f"row: {row['dataset']} T={row['temperature']:g} {row['label']}: tau {row['tau']:.2f}, "
            f"{row['tokens_per_s']:.1f} tok/s, speed-up vs AR {speedup}")


def _run_all(arms: list[Arm], sets: EncodedSets, setup: BenchSetup, tokenizer: Any,
             progress: bool, rows: list[dict[str, Any]]) -> list[Path]:
    """Every dataset x temperature group, under one progress bar: rows are appended to `rows`
    (and streamed to stdout) as each group finishes, so an interrupted run keeps them; the plots
    written are returned."""
    n_prompts = sum(len(ids) for _, ids in sets.values())
    calibrated = len({id(a.draft) for a in arms if calibrates(a)})
    total = len(arms) + len(setup.temperatures) * n_prompts * (len(arms) * setup.repeats + calibrated)
    plot_files: list[Path] = []
    with _progress(progress, total) as tick:
        warm_up(arms, next(iter(sets.values()))[1][0], setup, tick)
        for name, (prompts, prompt_ids) in sets.items():
            for temp in setup.temperatures:
                group = {"dataset": name, "temperature": temp, "repeats": setup.repeats}
                group_rows = _run_group(arms, prompts, prompt_ids, group, setup, tokenizer, tick)
                rows += group_rows
                for row in group_rows:
                    print(row_line(row), flush=True)
                plot_files += group_plots(group_rows, setup.block_sizes, setup.out_dir, f"{slug(name)}_t{temp:g}")
    return plot_files


def _concurrency(setup: BenchSetup, prompt_ids: list[list[int]], levels: Sequence[int] | None,
                 notes: list[str]) -> tuple[dict[str, Any] | None, list[Path]]:
    if not levels:
        return None, []
    path = setup.out_dir / "throughput_vs_concurrency.png"
    params = setup.params(setup.temperatures[0], 1)[0]
    table = None
    dspark = setup.drafts.get("dspark")
    if "dspark-scheduled" in setup.methods and dspark is not None and dspark.confidence_head is not None:
        window = max(levels) * (dspark.config.num_drafts + 1)
        ns = sorted({1, window} | {2 ** i for i in range(window.bit_length()) if 2 ** i < window})
        table = profile_cost_table(setup.target, ns, ProfileOptions(repeats=3, rows=min(16, max(levels))),
                                   capture=tuple(dspark.config.target_layer_ids), draft=dspark,
                                   draft_rows=sorted(set(levels)))
        notes.append(f"throughput vs concurrency: dspark-scheduled plans with a cost table profiled at start "
                     f"(n = {ns[0]}..{ns[-1]}, draft rounds at {sorted(set(levels))} requests)")
    result = throughput_vs_concurrency(setup.target, setup.drafts, prompt_ids, list(levels), params, path,
                                       scheduled_table=table)
    return result, [path]


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """Every option of `run_bench`.

    methods: subset of METHODS (default: ar + every method with a draft).
    every: take every `every`-th prompt of each dataset (then the first `limit` of those).
    block_sizes: draft block sizes to sweep, each in its draft's own layout convention
    (default: as trained). simulate_accept: impose this tau (NOT lossless). policies: how
    each speculative method runs, "adaptive" (the default policy) and / or "fixed" (full
    windows). concurrency: engine throughput at these numbers of requests.
    remeasure_costs: the adaptive arms measure this machine's cost table again."""

    methods: Sequence[str] | None = None
    temperatures: Sequence[float] = (0.0,)
    max_new_tokens: int = 128
    limit: int | None = None
    every: int = 1
    block_sizes: Sequence[int] | None = None
    repeats: int = 1
    out_dir: str | Path = "runs/bench"
    simulate_accept: float | None = None
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0
    ignore_eos: bool = False
    rule: str = "rejection"
    cost_table: str | Path | None = None
    concurrency: Sequence[int] | None = None
    progress: bool = True
    policies: Sequence[str] = ("adaptive",)
    remeasure_costs: bool = False


def run_bench(target_dir: str | Path, drafts: Mapping[str, str | Path | None],
              datasets: Sequence[str] | Mapping[str, Sequence[BenchPrompt]],
              options: BenchOptions | None = None) -> dict[str, Any]:
    """Benchmark every method on every dataset and temperature; write JSON, Markdown and PNGs.

    drafts: {"dflash": DIR, "dspark": DIR, "eagle3": DIR} (any may be absent / None).
    datasets: specs for `datasets.load_dataset`, or {name: [BenchPrompt]}.
    options: `BenchOptions`. Returns the results dict (also in out_dir/results.json)."""
    o = options or BenchOptions()
    temperatures, max_new_tokens, limit, every, rule = o.temperatures, o.max_new_tokens, o.limit, o.every, o.rule
    block_sizes, repeats, policies, simulate_accept = o.block_sizes, o.repeats, o.policies, o.simulate_accept
    _check_args(temperatures, max_new_tokens, limit, repeats, block_sizes, rule, every)
    if not policies or any(p not in ("adaptive", "fixed") for p in policies):
        raise BlockspecError(f"policies must be 'adaptive' and / or 'fixed', got {list(policies)}")
    notes: list[str] = []
    method_list = _resolve_methods(o.methods, drafts, notes)
    dev = resolve_device(o.device)
    target = load_target(Path(target_dir), dtype=o.dtype, device=dev)
    loaded = load_drafts(target, drafts, [k for k in map(draft_kind, method_list) if k is not None], o.dtype, dev)
    tokenizer = Tokenizer(Path(target_dir))
    tokenizer.check_fits(target.config.vocab_size)
    sets = _encode_sets(datasets, tokenizer, limit, target, max_new_tokens, notes, every)
    max_model_len = max(len(ids) for _, prompt_ids in sets.values() for ids in prompt_ids) + max_new_tokens
    setup = BenchSetup(target_dir=Path(target_dir), target=target, drafts=loaded, methods=method_list,
                       block_sizes=list(block_sizes) if block_sizes else None, simulate_accept=simulate_accept,
                       rule=rule, max_model_len=max_model_len, cost_table=o.cost_table,
                       temperatures=[float(t) for t in temperatures], max_new_tokens=max_new_tokens,
                       repeats=repeats, seed=o.seed, ignore_eos=o.ignore_eos, out_dir=Path(o.out_dir),
                       policies=tuple(policies), remeasure_costs=o.remeasure_costs)
    arms = build_arms(setup, notes)
    if simulate_accept is not None:
        notes.append(f"simulated acceptance: tau forced to {simulate_accept} per round; outputs are NOT lossless")
    rows: list[dict[str, Any]] = []
    try:
        plot_files = _run_all(arms, sets, setup, tokenizer, o.progress, rows)
    except KeyboardInterrupt:   # keep what finished: the rows of every completed group
        notes.append(f"interrupted: {len(rows)} row(s) of the finished groups only")
        write_outputs({"meta": _meta(setup, drafts, sets, limit, every, notes), "rows": rows, "concurrency": None,
                       "plots": []}, setup.out_dir)
        print(f"interrupted: partial results in {setup.out_dir / 'results.json'}", file=sys.stderr)
        raise
    conc, conc_plots = _concurrency(setup, next(iter(sets.values()))[1], o.concurrency, notes)
    draft_time, draft_plots = draft_time_report(target, loaded, setup.out_dir)
    results = {"meta": _meta(setup, drafts, sets, limit, every, notes), "rows": rows, "concurrency": conc,
               "draft_time": draft_time, "plots": [str(p) for p in plot_files + conc_plots + draft_plots]}
    write_outputs(results, setup.out_dir)
    return results
