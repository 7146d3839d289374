"""A loop of one `generate` call per prompt, as a script or an evaluation harness runs it:
the default path (no `policy=`: the adaptive policy, recalling what the previous calls
with the same models learned) against AR and fixed full windows, at batch 1.

    python benchmarks/generate_loop.py [--temperature 0] [--every 1] [--limit 164]
        [--new-tokens 128] [--runs 3] [--arms ar,dflash,dspark,dflash-fixed,dspark-fixed]

Each run is the whole loop over the prompts, starting from a policy that knows nothing
(its first call uses `PolicyOptions(fresh=True)`): what a new process pays. Per prompt
the arms take turns (the order rotates from prompt to prompt), so a slow spell of the
machine falls on every arm alike. A run's speed per arm is its generated tokens over
the sum of its calls' wall times; printed: the median over runs, each arm's ratio to
AR and to its method's fixed window (the median over runs of the two arms' ratio in the
same run: `measure.paired_ratio`), and the share of its rounds that drafted (at
temperature 1, where drafting does not pay on a CPU, what exploring costs). Cost tables are measured (or read from the
cache) before the first run, so no measurement is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from blockspec import PolicyOptions, SamplingParams, Tokenizer, embedded, generate, load_draft, load_target
from blockspec.bench.datasets import humaneval  # the bench's prompts: no bare trailing newline token
from blockspec.bench.measure import paired_ratio
from blockspec.decoding.policy import RoundPolicy

# name -> (method, policy options of every call but a run's first, of its first)
ARMS = {"ar": ("ar", None, None),
        "dflash": ("dflash", None, PolicyOptions(fresh=True)),
        "dspark": ("dspark", None, PolicyOptions(fresh=True)),
        "dflash-fixed": ("dflash", PolicyOptions(adapt=False), PolicyOptions(adapt=False)),
        "dspark-fixed": ("dspark", PolicyOptions(adapt=False), PolicyOptions(adapt=False)),
        # the gate alone, every drafted slot verified (DSpark's scheduled verify lengths off)
        "dspark-unscheduled": ("dspark", PolicyOptions(scheduled=False), PolicyOptions(scheduled=False, fresh=True))}


def one_run(target, drafts, arms: list[str], prompts: list[list[int]], params: SamplingParams
            ) -> tuple[dict[str, float], dict[str, float]]:
    """Tokens per second of each arm over one loop of the prompts, and the share of its
    rounds that drafted (where drafting does not pay: what exploring costs)."""
    tokens = dict.fromkeys(arms, 0)
    seconds = dict.fromkeys(arms, 0.0)
    rounds = dict.fromkeys(arms, 0)
    drafted = dict.fromkeys(arms, 0)
    for i, ids in enumerate(prompts):
        for k in range(len(arms)):
            name = arms[(i + k) % len(arms)]
            method, options, first = ARMS[name]
            t0 = time.perf_counter()
            out = generate(target, [ids], params, draft=drafts.get(method), method=method,
                           policy=first if i == 0 else options)
            seconds[name] += time.perf_counter() - t0
            tokens[name] += out.new_tokens
            stats = out.completions[0].stats
            rounds[name] += stats.rounds
            drafted[name] += sum(v > 0 for v in stats.verified)
    return ({name: tokens[name] / seconds[name] for name in arms},
            {name: drafted[name] / max(rounds[name], 1) for name in arms})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--every", type=int, default=1, help="every K-th HumanEval prompt")
    ap.add_argument("--limit", type=int, default=164, help="at most this many prompts")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="interleaved loops over the prompts (median)")
    ap.add_argument("--arms", default="ar,dflash,dspark,dflash-fixed,dspark-fixed",
                    help=f"comma list of {','.join(ARMS)}")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if any(a not in ARMS for a in arms) or "ar" not in arms:
        sys.exit(f"--arms: a comma list of {', '.join(ARMS)} that includes ar")
    torch.manual_seed(0)
    target = load_target(embedded.default_target())
    tokenizer = Tokenizer(embedded.default_target())
    drafts = {m: load_draft(embedded.default_draft(m), target=target) for m in ("dflash", "dspark")
              if any(ARMS[a][0] == m for a in arms)}
    prompts = [tokenizer.encode(p.text) for p in humaneval()][::args.every][:args.limit]
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    for method, draft in drafts.items():   # cost tables measured (or read) now, never inside a timed call
        RoundPolicy.for_method(target, draft, method, PolicyOptions(memory="off"))
    runs, shares = [], []
    for r in range(args.runs):
        speed, share = one_run(target, drafts, arms, prompts, params)
        runs.append(speed)
        shares.append(share)
        print(f"run {r + 1}: " + ", ".join(f"{a} {speed[a]:.1f}" for a in arms) + " tok/s", file=sys.stderr)
    median = {a: statistics.median(run[a] for run in runs) for a in arms}

    def speeds(arm: str) -> list[float]:
        return [run[arm] for run in runs]
    result = {"temperature": args.temperature, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "runs": runs, "median_tok_s": median, "drafted_share": shares,
              "vs_ar": {a: paired_ratio(speeds(a), speeds("ar")) for a in arms},
              "vs_fixed": {a: paired_ratio(speeds(a), speeds(f"{ARMS[a][0]}-fixed")) for a in arms
                           if not a.endswith("-fixed") and f"{ARMS[a][0]}-fixed" in median}}
    print(f"x AR, x fixed: the median over runs of the ratio within a run\n"
          f"| arm | tok/s (median of {args.runs}) | x AR | x fixed | rounds drafted |\n|---|---|---|---|---|")
    for a in arms:
        fixed = result["vs_fixed"].get(a)
        share = statistics.median(s[a] for s in shares)
        print(f"| {a} | {median[a]:.1f} | {result['vs_ar'][a]:.3f} | {'-' if fixed is None else f'{fixed:.3f}'} "
              f"| {share:.0%} |")
    print("per-run tok/s (in run order): " + "; ".join(f"{a} {[round(x, 1) for x in speeds(a)]}" for a in arms))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
