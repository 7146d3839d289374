"""Engine throughput vs concurrency on HumanEval prompts (128 new tokens) for AR and the
speculative methods as users run them (the adaptive policy, the default), optionally
next to fixed full windows, for greedy, temperature-1 and mixed workloads, measured
side by side in one run; plus the process's peak resident memory.

    python benchmarks/engine_throughput.py [--concurrency 1,4,16,32] [--workloads greedy,t1]
        [--mixed-at 16] [--repeats 3] [--lockstep]
        [--methods ar,dflash,dspark[,eagle3,dflash-fixed,dspark-fixed,eagle3-fixed,eagle3-tree]]
        [--dflash-draft DIR] [--dspark-draft DIR] [--eagle3-draft DIR] [--eagle3-tree 4,5,12]

eagle3-tree: the EAGLE-3 draft drafting EAGLE-2's tree (topk, num_steps, num_draft_tokens as
SGLang spells them) with the fixed policy, as `serve --no-adapt --speculative-eagle-topk ...` runs it.

Drafts: the embedded ones unless a directory is given (e.g. an older draft to compare).

Each (workload, concurrency) cell runs max(8, waves*c) requests per arm through an
engine with max_running = c, so requests join as others finish, as in serving;
tokens/s = generated tokens / wall time. One engine per arm lives through the cell's
repeats, as a running server would (its policy keeps what it learned; the first
repeat includes the learning), and the arms run in turn, repeat after repeat (the
order rotating): each cell is the median, each ratio to AR the median of the repeats'
ratios (arms of one repeat run back to back, in the same spell of the machine). With
--lockstep the arms' engines run each repeat together, one step each in turn, each timed
over its own steps (`run_lockstep`): the arms meet the machine's drift within milliseconds
instead of seconds, for ratios of a few percent on a noisy machine. Beside it, tok/s
under load: the steps begun with every slot busy or requests waiting (the drain at the
end, where the last requests finish with slots idle, left out). The adaptive arms' cost
tables come from the user cache (measured on first use, before any timing). Workloads:
greedy; t1 (temperature 1, seeded); mixed (every other request greedy, the others
temperature 1).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from blockspec import EagleTree, Engine, PolicyOptions, SamplingParams, Tokenizer, embedded, load_target
from blockspec.bench.datasets import humaneval  # the bench's prompts: no bare trailing newline token
from blockspec.bench.measure import paired_ratio
from blockspec.loading import load_drafts

# name -> (method, adaptive policy)
ARMS = {"ar": ("ar", False), "dflash": ("dflash", True), "dspark": ("dspark", True), "eagle3": ("eagle3", True),
        "dflash-fixed": ("dflash", False), "dspark-fixed": ("dspark", False), "eagle3-fixed": ("eagle3", False),
        "eagle3-tree": ("eagle3", False)}
HEADERS = {"ar": "AR", "dflash": "DFlash", "dspark": "DSpark", "eagle3": "EAGLE-3", "dflash-fixed": "DFlash fixed",
           "dspark-fixed": "DSpark fixed", "eagle3-fixed": "EAGLE-3 fixed", "eagle3-tree": "EAGLE-3 tree"}
WORKLOADS = ("greedy", "t1", "mixed")


def request_params(workload: str, count: int, new_tokens: int) -> list[SamplingParams]:
    def one(i: int) -> SamplingParams:
        sampled = workload == "t1" or (workload == "mixed" and i % 2 == 1)
        return SamplingParams(temperature=1.0 if sampled else 0.0, seed=i, max_new_tokens=new_tokens, ignore_eos=True)
    return [one(i) for i in range(count)]


def build(target, drafts, name: str, conc: int, tree: EagleTree | None = None) -> Engine:
    method, adaptive = ARMS[name]
    draft = drafts.get(method)
    if name == "eagle3-tree":
        draft = draft.with_tree(tree)
    return Engine(target, draft, method=method, max_running=conc, max_model_len=1024,
                  policy=PolicyOptions(adapt=adaptive))


class Run:
    """One run of a cell's requests through an engine, a step at a time, timing only its own
    submits and steps (each step with its metrics read): tokens/s over the whole run, and over
    its steps begun with every slot busy or requests waiting ("loaded", as a server under load
    runs; the rest is the drain, where the last requests finish with slots idle)."""

    def __init__(self, engine: Engine, prompts, params) -> None:
        self.engine = engine
        self.before = self.last = engine.metrics()
        t0 = time.perf_counter()
        self.handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        self.elapsed, self.loaded_s, self.loaded_tokens, self.more = time.perf_counter() - t0, 0.0, 0, True

    def step(self) -> None:
        """engine.run_until_done(), one step of it; one metrics read per step, for every arm."""
        t_step = time.perf_counter()
        self.more = self.engine.step()
        now = self.engine.metrics()
        spent = time.perf_counter() - t_step
        last = self.last
        if last is self.before or last["waiting"] or last["running"] >= last["slots"]:   # loaded
            self.loaded_s += spent
            self.loaded_tokens += now["generated_tokens"] - last["generated_tokens"]
        self.elapsed += spent
        self.last = now

    def result(self) -> dict:
        before, after = self.before, self.last
        assert after["kv_bytes_in_use"] == 0 and all(h.done for h in self.handles)
        tokens = after["generated_tokens"] - before["generated_tokens"]
        rounds = after["request_rounds"] - before["request_rounds"]
        drafted = rounds - (after["undrafted_request_rounds"] - before["undrafted_request_rounds"])
        return {"tokens_per_s": tokens / self.elapsed, "tau": tokens / max(rounds, 1), "drafted": drafted / max(rounds, 1),
                "loaded_tokens_per_s": self.loaded_tokens / max(self.loaded_s, 1e-9),
                "drain": 1.0 - self.loaded_s / self.elapsed}


def run_once(engine: Engine, prompts, params) -> dict:
    """One run of the cell's requests through `engine` alone (`Run`)."""
    run = Run(engine, prompts, params)
    while run.more:
        run.step()
    return run.result()


def run_lockstep(engines: dict[str, Engine], prompts, params, first: int = 0) -> dict[str, dict]:
    """One run of the cell's requests through every engine at once, the engines taking one
    step each in turn (the order rotating from step to step, starting at `first`), each timed
    over its own steps only (`Run`): every arm meets the machine's drift within the same few
    milliseconds, where a whole run of each in turn (`run_once`) spans seconds (AR's round
    time on a shared 2-core VM moved by 30% from one run to the next)."""
    names = list(engines)
    runs = {name: Run(engines[name], prompts, params) for name in names}
    turn = first
    while any(run.more for run in runs.values()):
        for k in range(len(names)):
            run = runs[names[(turn + k) % len(names)]]
            if run.more:
                run.step()
        turn += 1
    return {name: run.result() for name, run in runs.items()}


def run_repeat(engines: dict[str, Engine], prompts, params, repeat: int, lockstep: bool) -> dict[str, dict]:
    """One repeat of a cell for every arm: in lockstep (`run_lockstep`), or each arm's whole run
    in turn (`run_once`); either way the order rotates with `repeat`."""
    if lockstep:
        return run_lockstep(engines, prompts, params, first=repeat)
    names = list(engines)
    order = [names[(repeat + k) % len(names)] for k in range(len(names))]
    return {name: run_once(engines[name], prompts, params) for name in order}


def speeds(runs: list[dict], ar_runs: list[dict], key: str) -> tuple[list[float], list[float]]:
    """An arm's and AR's speeds (`key`) repeat by repeat, for `measure.paired_ratio`."""
    return [x[key] for x in runs], [a[key] for a in ar_runs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--workloads", default="greedy,t1", help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--mixed-at", default="16", help="concurrency levels of the mixed workload ('' for none)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ar,dflash,dspark", help=f"comma list of {','.join(ARMS)} including ar")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs per cell (median)")
    ap.add_argument("--waves", type=int, default=4, help="requests per cell = max(8, waves x concurrency)")
    ap.add_argument("--lockstep", action="store_true",
                    help="the arms' engines take one step each in turn within every repeat, each timed over its own steps")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--eagle3-tree", default="4,5,12",
                    help="the eagle3-tree arm's topk,num_steps,num_draft_tokens (default: generate's fastest tree)")
    for kind in ("dflash", "dspark", "eagle3"):
        ap.add_argument(f"--{kind}-draft", default=None, help=f"{kind} draft directory (default: the embedded one)")
    args = ap.parse_args()
    names = args.methods.split(",")
    workloads = [w for w in args.workloads.split(",") if w]
    if "ar" not in names or any(n not in ARMS for n in names) or any(w not in WORKLOADS for w in workloads):
        ap.error(f"--methods: a comma list of {', '.join(ARMS)} including ar; --workloads from {WORKLOADS}")
    try:
        tree = EagleTree(*(int(x) for x in args.eagle3_tree.split(",")))
    except (TypeError, ValueError) as exc:
        ap.error(f"--eagle3-tree: topk,num_steps,num_draft_tokens ({exc})")
    levels = [int(c) for c in args.concurrency.split(",")]
    cells_to_run = [(w, c) for w in workloads if w != "mixed" for c in levels]
    cells_to_run += [("mixed", int(c)) for c in args.mixed_at.split(",") if c] if args.mixed_at else []
    torch.manual_seed(0)
    tdir = embedded.default_target()
    target, tok = load_target(tdir), Tokenizer(tdir)
    kinds = {ARMS[n][0] for n in names} - {"ar"}
    drafts = load_drafts(target, {k: getattr(args, f"{k}_draft") for k in kinds}, kinds)
    pool = [tok.encode(p.text) for p in humaneval()]
    rows = []
    for workload, conc in cells_to_run:
        count = max(8, args.waves * conc)
        prompts, params = [pool[i % len(pool)] for i in range(count)], request_params(workload, count, args.new_tokens)
        engines = {name: build(target, drafts, name, conc, tree) for name in names}   # tables measured here, untimed
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for repeat in range(args.repeats):  # side by side for this cell, interleaved; the order rotates
            for name, result in run_repeat(engines, prompts, params, repeat, args.lockstep).items():
                runs[name].append(result)
        del engines
        cell = {}
        for name, r in runs.items():
            tps = statistics.median(x["tokens_per_s"] for x in r)
            cell[name] = {"tokens_per_s": tps, "all": [round(x["tokens_per_s"], 1) for x in r],
                          "vs_ar": paired_ratio(*speeds(r, runs["ar"], "tokens_per_s")),
                          "loaded_vs_ar": paired_ratio(*speeds(r, runs["ar"], "loaded_tokens_per_s")),
                          "tau": statistics.median(x["tau"] for x in r),
                          "drafted": statistics.median(x["drafted"] for x in r),
                          "loaded_tokens_per_s": statistics.median(x["loaded_tokens_per_s"] for x in r),
                          "drain": statistics.median(x["drain"] for x in r)}
            fixed = f"{name}-fixed"
            if fixed in runs and ARMS[name][1]:   # the default against its own fixed window, paired too
                cell[name]["vs_fixed"] = paired_ratio(*speeds(r, runs[fixed], "tokens_per_s"))
        rows.append((workload, conc, cell))
        print(f"done {workload} c={conc}: " + ", ".join(f"{n} {cell[n]['tokens_per_s']:.1f}" for n in names),
              flush=True, file=sys.stderr)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"HumanEval prompts, {args.new_tokens} new tokens (ignore EOS), float32, {torch.get_num_threads()} "
          "threads; tok/s, median of the repeats (tau incl. bonus; share of request-rounds that drafted); "
          "DFlash / DSpark / EAGLE-3 = the default adaptive policy (draft gate per temperature band, DSpark "
          f"scheduled), fixed = every round drafts and verifies the full window; EAGLE-3 tree = topk "
          f"{tree.topk}, {tree.num_steps} levels, {tree.num_draft_tokens} tokens verified, fixed policy")
    interleaving = ("the arms' engines in lockstep, one step each in turn (the order rotating from step to step), "
                    "each timed over its own steps" if args.lockstep
                    else "the arms' order rotating from repeat to repeat")
    print(f"median of {args.repeats} interleaved run(s) per cell ({interleaving}); "
          "X / AR (X / fixed): the median over repeats of X's tok/s over AR's (its fixed window's) in the same repeat; "
          f"max(8, {args.waves} x concurrency) requests per "
          "cell; one engine per arm for the cell's repeats (the first repeat includes the policy's learning)")
    spec = [n for n in names if n != "ar"]
    ratio_cols = [n for n in spec if ARMS[n][1]]
    both = "dflash" in names and "dspark" in names
    fixed_cols = [n for n in ratio_cols if f"{n}-fixed" in names]
    headers = [HEADERS[n] for n in names] + [f"{HEADERS[n]} / AR" for n in ratio_cols] + ["DSpark / DFlash"] * both
    print("| workload | concurrency | " + " | ".join(headers + [f"{HEADERS[n]} / fixed" for n in fixed_cols]) + " |")
    print("|---" * (2 + len(headers) + len(fixed_cols)) + "|")
    for workload, conc, c in rows:
        tps = {n: c[n]["tokens_per_s"] for n in names}
        cells = [f"{tps['ar']:.1f}"] + [f"{tps[n]:.1f} ({c[n]['tau']:.2f}; {c[n]['drafted']:.0%})" for n in spec]
        cells += [f"{c[n]['vs_ar']:.2f}x" for n in ratio_cols]
        if both:
            cells.append(f"{tps['dspark'] / tps['dflash']:.2f}x")
        cells += [f"{c[n]['vs_fixed']:.2f}x" for n in fixed_cols]
        print(f"| {workload} | {conc} | " + " | ".join(cells) + " |")
    print("\nUnder load: tok/s over the steps begun with every slot busy or requests waiting (the drain, where "
          "the last requests finish with slots idle, left out); in brackets, the drain's share of the wall time")
    print("| workload | concurrency | " + " | ".join(headers) + " |")
    print("|---" * (2 + len(headers)) + "|")
    for workload, conc, c in rows:
        tps = {n: c[n]["loaded_tokens_per_s"] for n in names}
        cells = [f"{tps[n]:.1f} ({c[n]['drain']:.0%})" for n in names] + [f"{c[n]['loaded_vs_ar']:.2f}x"
                                                                           for n in ratio_cols]
        if both:
            cells.append(f"{tps['dspark'] / tps['dflash']:.2f}x")
        print(f"| {workload} | {conc} | " + " | ".join(cells) + " |")
    print("\nper-run tok/s (in run order): " + "; ".join(
        f"{w} c={conc} " + ", ".join(f"{n} {c[n]['all']}" for n in names) for w, conc, c in rows))
    print(f"\npeak resident memory of this process (all engines, models, cost tables): {peak_mb:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "peak_rss_mib": peak_mb}, indent=1, default=str))


if __name__ == "__main__":
    main()
