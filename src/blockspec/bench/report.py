"""The report of a benchmark: one summary row per arm, the Markdown report, JSON and plots
(docs/design.md sections 1 and 11).

tokens/s = output tokens / summed prompt times, and ``speedup = tokens/s / AR
tokens/s`` over the same prompts: with greedy decoding every lossless method
emits AR's tokens, so this is AR time / method time; with sampling, where
lengths can differ, it is the ratio of time per output token.
``efficiency = speedup / tau``.  Next to tau every row carries the degeneracy of
what the arm decoded (``rep8``: share of tokens inside a repeated 8-gram of their
own completion; ``looping``: share of completions more than half covered) and,
on code prompts, ``parse_body`` (see :mod:`blockspec.bench.quality`), so no table
can hide a looping target.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from blockspec.bench import plots
from blockspec.bench.arms import Arm
from blockspec.bench.measure import ArmTotals
from blockspec.bench.metrics import markdown_table, speedup_summary
from blockspec.bench.quality import LOOP_SHARE, REPEAT_N, degeneracy

__all__ = ["TABLE_COLUMNS", "CALIBRATION_COLUMNS", "CONTEXT_COLUMNS", "context_rows", "summarize", "group_plots", "render_markdown", "write_outputs",
           "slug"]


CONTEXT_COLUMNS = ["dataset", "method", "temperature", "context", "rounds", "tau", "per_slot"]
TABLE_COLUMNS = ["dataset", "method", "mode", "temperature", "block_size", "drafts", "drafted", "tau", "rep8",
                 "looping", "parse_body", "tokens_per_s", "speedup", "efficiency", "projected_speedup", "t_draft_ms",
                 "t_verify_ms", "t_ar_ms", "ece", "auroc"]
CALIBRATION_COLUMNS = ["dataset", "method", "temperature", "block_size", "n", "ece", "brier", "auroc"]


def _per(seconds: float, count: int) -> float | None:
    """Milliseconds per event, None when nothing happened (never a made-up number)."""
    return seconds / count * 1e3 if count else None


def _projected(tau: float, t_ar: float | None, t_draft: float | None, t_verify: float | None) -> float | None:
    """docs/design.md section 1: AR latency per token over (T_draft + T_verify) / tau, from per-round
    timings alone (no prefill, no Python loop outside the round)."""
    if t_ar is None or t_draft is None or t_verify is None or t_draft + t_verify <= 0:
        return None
    return tau * t_ar / (t_draft + t_verify)


def summarize(arm: Arm, total: ArmTotals, ar: ArmTotals, group: dict[str, Any]) -> dict[str, Any]:
    """One results row: acceptance, throughput, speed-up and the section-1 cost terms."""
    tau = total.acceptance.tau if total.has_rounds else 1.0   # hf is AR: one token per forward
    tps = total.tokens / total.wall_s if total.wall_s > 0 else 0.0
    ar_tps = ar.tokens / ar.wall_s if ar.wall_s > 0 else 0.0
    speed = speedup_summary(tps, ar_tps, tau) if ar_tps > 0 and tau > 0 else {}
    cfg = arm.draft.config if arm.draft is not None else None
    row = dict(group)
    row.update({
        "method": arm.method, "label": arm.label, "mode": "simulated" if arm.simulated else "lossless",
        "lossless": not arm.simulated, "block_size": arm.block_size,
        "layout": cfg.layout if cfg is not None else None, "drafts": cfg.num_drafts if cfg is not None else 0,
        "prompts": total.runs // max(1, group["repeats"]), "new_tokens": total.tokens,
        "wall_s": total.wall_s, "tokens_per_s": tps, "ar_tokens_per_s": ar_tps or None,
        "speedup": speed.get("speedup"), "efficiency": speed.get("efficiency"),
        "tau": tau, "t_prefill_ms": _per(total.timing.prefill_s, total.runs) if total.has_rounds else None,
        "t_draft_ms": _per(total.timing.draft_s, total.timing.rounds) if arm.draft is not None else None,
        "t_verify_ms": _per(total.timing.verify_s, total.timing.rounds) if arm.draft is not None else None,
        "t_ar_ms": _per(ar.timing.verify_s, ar.timing.rounds),
    })
    row["projected_speedup"] = _projected(tau, row["t_ar_ms"], row["t_draft_ms"], row["t_verify_ms"])
    if total.has_rounds:
        row["acceptance"] = total.acceptance.to_dict()
        row["by_context"] = total.by_context.table()
        row["tau_by_position"] = total.by_context.tau_by_position()
        # Share of rounds that drafted: the adaptive policy runs AR rounds where drafting does not pay.
        row["drafted"] = total.acceptance.drafted_share if arm.draft is not None else None
    row["degeneracy"] = degeneracy(total.outputs)
    row["rep8"], row["looping"] = row["degeneracy"]["share"], row["degeneracy"]["looping_share"]
    return row


def context_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Acceptance by context length (bench/context.py) of the drafting arms: the overall
    figure ("all"), then each context bucket with rounds; per-slot acceptance as a list."""
    out = []
    for r in rows:
        if not r.get("by_context") or not r["drafts"]:
            continue
        for entry in [{"context": "all", **r["acceptance"]}, *r["by_context"]]:
            slots = " ".join("-" if x is None else f"{x:.2f}" for x in entry["per_slot"])
            out.append({"dataset": r["dataset"], "method": r["label"], "temperature": r["temperature"],
                        "context": entry["context"], "rounds": entry["rounds"], "tau": entry["tau"],
                        "per_slot": slots})
    return out


def _finite(obj: Any) -> Any:
    """JSON has no NaN: undefined values (e.g. AUROC with one class) become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "dataset"


def group_plots(rows: list[dict[str, Any]], block_sizes: list[int] | None, out_dir: Path,
                 stem: str) -> list[Path]:
    """Acceptance histogram, per-slot acceptance, speed-up vs block size, reliability diagrams."""
    spec = [r for r in rows if r.get("acceptance") and r["drafts"] > 0]
    files = []
    if spec:
        files.append(plots.plot_acceptance_histogram({r["label"]: r["acceptance"]["histogram"] for r in spec},
                                                     out_dir / f"{stem}_acceptance.png"))
        files.append(plots.plot_per_slot({r["label"]: r["acceptance"]["per_slot"] for r in spec},
                                         out_dir / f"{stem}_per_slot.png"))
        files.append(plots.plot_tau_vs_position({r["label"]: r["tau_by_position"] for r in spec},
                                                out_dir / f"{stem}_tau_vs_position.png"))
    if block_sizes is not None and len(block_sizes) > 1 and spec:
        by_method: dict[str, list[float | None]] = {}
        for method in dict.fromkeys(r["method"] for r in spec):
            found = {r["block_size"]: r["speedup"] for r in spec if r["method"] == method}
            by_method[method] = [found.get(b) for b in block_sizes]
        files.append(plots.plot_speedup_vs_block(list(block_sizes), by_method,
                                                 out_dir / f"{stem}_speedup_vs_block.png"))
    for r in rows:
        if r.get("calibration") and r["method"] == "dspark":
            files.append(plots.plot_reliability(r["calibration"]["reliability"],
                                                out_dir / f"{stem}_{slug(r['label'])}_reliability.png"))
    return files


def _table_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: row.get(k) for k in TABLE_COLUMNS}
    out["method"] = row["label"]
    cal = row.get("calibration") or {}
    out["ece"], out["auroc"] = cal.get("ece"), cal.get("auroc")
    return out


def render_markdown(results: dict[str, Any]) -> str:
    """The human-readable report: setup, warnings, results table, calibration, plots."""
    meta = results["meta"]
    lines = ["# blockspec benchmark", ""]
    if meta["simulate_accept"] is not None:
        lines += [f"> **SIMULATED ACCEPTANCE (tau = {meta['simulate_accept']}): speculative rows are NOT lossless.** "
                  "Their outputs are not the target's; only tau-normalised timing (T_draft, T_verify, "
                  "projected speed-up) is meaningful.", ""]
    lines += [f"target `{meta['target']}` ({meta['dtype']}, {meta['device']}), {meta['machine']}; "
              f"max_new_tokens {meta['max_new_tokens']}, repeats {meta['repeats']} (median), "
              "interleaved arms; tau includes the bonus token; block_size in each draft's own layout "
              "convention (zlab: incl. anchor, drafts = B-1; deepspec: drafts = gamma); adaptive = the default "
              "policy (drafts only where it pays), fixed = every round drafts the full window; drafted = share "
              "of rounds that drafted. Times (averages over all rounds, AR rounds included): t_draft / t_verify per round, t_ar per AR step, in ms; projected_speedup = "
              "tau * t_ar / (t_draft + t_verify).", "",
              f"Degeneracy of the decoded text, next to tau: rep{REPEAT_N} = share of generated tokens inside "
              f"a repeated {REPEAT_N}-gram of their own completion (token i counts when some {REPEAT_N}-token "
              f"window containing i occurs at least twice in that completion); looping = share of completions "
              f"with rep{REPEAT_N} > {LOOP_SHARE:g}; parse_body = share of code prompts whose completion, cut at "
              "the function's end, parses with a body beyond docstring / pass (blank: no code prompts). "
              "A high rep8 means tau measures a loop, not the method.", ""]
    lines += [markdown_table([_table_row(r) for r in results["rows"]], TABLE_COLUMNS), ""]
    # One row per draft: its adaptive and fixed arms share one calibration pass.
    cal_rows = list({(r["dataset"], r["method"], r["temperature"], r["block_size"]): dict(
        r["calibration"], dataset=r["dataset"], method=r["method"], temperature=r["temperature"],
        block_size=r["block_size"]) for r in results["rows"] if r.get("calibration")}.values())
    if cal_rows:
        lines += ["## Confidence-head calibration (survival s_k vs prefix acceptance)", "",
                  markdown_table(cal_rows, CALIBRATION_COLUMNS), ""]
    by_context = context_rows(results["rows"])
    if by_context:
        lines += ["## Acceptance by context length", "",
                  "Rounds grouped by the anchor's position (the context the draft sees: prompt + tokens so "
                  "far); tau includes the bonus token; per_slot = P(accept slot k | slots 1..k-1 accepted), "
                  "'-' where no round reached the slot; 'all' is the overall figure.", "",
                  markdown_table(by_context, CONTEXT_COLUMNS), ""]
    conc = results.get("concurrency")
    if conc:
        methods = list(conc["tokens_per_s"])
        rows = [{"concurrency": c, **{m: conc["tokens_per_s"][m][i] for m in methods}}
                for i, c in enumerate(conc["concurrency"])]
        lines += ["## Engine throughput vs concurrency (output tokens/s)", "",
                  markdown_table(rows, ["concurrency"] + methods), ""]
    if meta["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in meta["notes"]] + [""]
    if results["plots"]:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in results["plots"]] + [""]
    return "\n".join(lines)


def write_outputs(results: dict[str, Any], out_dir: Path) -> None:
    """results.json (everything) and results.md (the report); plots are already in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(_finite(results), indent=2, allow_nan=False) + "\n")
    (out_dir / "results.md").write_text(render_markdown(results))
