"""What an AR round costs inside a speculative engine (issue 28, "near-free AR stretches"):
the AR engine vs a speculative engine whose policy never drafts (every round an AR step,
while target features are still captured and buffered for the draft context), the same
with every prompt entering the draft context at prefill (as before the prompts waited for
their rows' first draft), and the engine as shipped (the default adaptive policy). HumanEval prompts, 128 new tokens,
max(8, 2 x concurrency) requests per run through an engine with max_running = concurrency;
the engines take turns (the order rotating from run to run); medians, and ratios to AR as the median of
each run's own (`measure.paired_ratio`; the first run, which includes the learning and
first calls, is left out when there are more than two).

    python benchmarks/engine_ar_overhead.py [--method dflash] [--workload t1] [--concurrency 16] [--repeats 5]
        [--lockstep]   (the engines run together, one step each in turn: `engine_throughput.run_lockstep`)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from blockspec import Tokenizer, embedded, load_target
from blockspec.bench.datasets import humaneval
from blockspec.loading import load_drafts
from blockspec.bench.measure import paired_ratio
from engine_throughput import WORKLOADS, build, request_params, run_repeat, speeds

KINDS = ("ar", "drafting off", "drafting off, eager prompts", "default")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="dflash", choices=("dflash", "dspark", "eagle3"))
    ap.add_argument("--workload", default="t1", choices=WORKLOADS)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lockstep", action="store_true",
                    help="the engines take one step each in turn within every run, each timed over its own steps")
    args = ap.parse_args()
    torch.manual_seed(0)
    tdir = embedded.default_target()
    target, tok = load_target(tdir), Tokenizer(tdir)
    drafts = load_drafts(target, {args.method: None}, {args.method})
    pool = [tok.encode(p.text) for p in humaneval()]
    count = max(8, 2 * args.concurrency)
    prompts = [pool[i % len(pool)] for i in range(count)]
    params = request_params(args.workload, count, 128)
    engines = {"ar": build(target, drafts, "ar", args.concurrency),
               "drafting off": build(target, drafts, args.method, args.concurrency),
               "drafting off, eager prompts": build(target, drafts, args.method, args.concurrency),
               "default": build(target, drafts, args.method, args.concurrency)}
    # Bench-only: the policy's decision is always an AR round; everything else (feature
    # capture, the draft context's buffer, the policy's bookkeeping) runs as shipped.
    # With a prompt capacity of 0 every prompt is longer than what may wait: it enters the
    # draft context at prefill.
    for kind in ("drafting off", "drafting off, eager prompts"):
        engines[kind].policy.decide = lambda bands: (0, 0)
    engines["drafting off, eager prompts"].slots.pending.prompt_capacity = 0
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    for rep in range(args.repeats):
        for kind, result in run_repeat(engines, prompts, params, rep, args.lockstep).items():
            runs[kind].append(result)
    kept = slice(1, None) if args.repeats > 2 else slice(None)
    tps = {k: statistics.median(r["tokens_per_s"] for r in runs[k][kept]) for k in KINDS}
    print(f"{args.method}, {args.workload}, concurrency {args.concurrency}, {count} HumanEval prompts, 128 new tokens, "
          f"{torch.get_num_threads()} threads; median of {len(runs['ar'][kept])} interleaved runs "
          f"{'(in lockstep, one step each in turn) ' if args.lockstep else ''}"
          f"(of {args.repeats}; the first left out when more than two)")
    print("| engine | tok/s | vs AR | drafted request-rounds | per-run tok/s |")
    print("|---|---|---|---|---|")
    for kind in KINDS:
        drafted = statistics.median(r["drafted"] for r in runs[kind][kept]) if kind != "ar" else 0.0
        ratio = paired_ratio(*speeds(runs[kind][kept], runs["ar"][kept], "tokens_per_s"))
        print(f"| {kind} | {tps[kind]:.1f} | {ratio:.3f}x | {drafted:.0%} | "
              + ", ".join(f"{r['tokens_per_s']:.0f}" for r in runs[kind]) + " |")


if __name__ == "__main__":
    main()
