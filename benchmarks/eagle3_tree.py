"""EAGLE-3 chain against draft trees on the shipped pair, batch 1: tokens per round (tau,
bonus included), decoding speed and each arm's ratio to AR; greedy outputs checked against AR's.

    python benchmarks/eagle3_tree.py [--limit 4] [--every 1] [--new-tokens 64] [--chain 7]
        [--trees 4x5x12,4x7x16,8x7x32] [--temperature 0] [--runs 1]

A tree is TOPKxSTEPSxTOKENS in SGLang's terms (--speculative-eagle-topk,
--speculative-num-steps, --speculative-num-draft-tokens). Every arm runs with fixed windows
(`PolicyOptions(adapt=False)`: the adaptive policy plans chains only, and fixed chains keep
the comparison like for like). Per prompt the arms take turns in a rotating order, so a slow
spell of the machine falls on all of them; an arm's speed is its generated tokens over the
sum of its calls' wall times (prefill included, as a user sees it), printed as the median
over runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from blockspec import EagleTree, PolicyOptions, SamplingParams, Tokenizer, embedded, generate, load_target
from blockspec.bench.datasets import humaneval
from blockspec.loading import load_drafts


def parse_tree(text: str) -> EagleTree:
    try:
        topk, steps, tokens = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tree is TOPKxSTEPSxTOKENS, e.g. 4x5x12; got {text!r}") from None
    return EagleTree(topk, steps, tokens)


def one_run(target, arms: dict, prompts: list[list[int]], params: SamplingParams, fixed: PolicyOptions
            ) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """One loop over the prompts, the arms taking turns in a rotating order: each arm's tok/s,
    tau (bonus included) and the prompts whose output differs from AR's (greedy only)."""
    names = list(arms)
    tokens, rounds, accepted = dict.fromkeys(names, 0), dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    seconds = dict.fromkeys(names, 0.0)
    outputs: dict[tuple[str, int], list[int]] = {}
    for i, ids in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            out = generate(target, [ids], params, draft=arms[name], policy=fixed if arms[name] else None)
            seconds[name] += time.perf_counter() - t0
            done = out.completions[0]
            tokens[name] += len(done.tokens)
            rounds[name] += done.stats.rounds
            accepted[name] += sum(done.stats.accepted)
            outputs[name, i] = done.tokens
    speed = {name: tokens[name] / seconds[name] for name in names}
    tau = {name: (accepted[name] + rounds[name]) / rounds[name] if rounds[name] else 1.0 for name in names}
    differ = {name: sum(outputs[name, i] != outputs["ar", i] for i in range(len(prompts))) for name in names}
    return speed, tau, differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="at most this many HumanEval prompts")
    ap.add_argument("--every", type=int, default=1, help="every K-th HumanEval prompt")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--runs", type=int, default=1, help="interleaved loops over the prompts (median tok/s)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chain", type=int, default=7, help="the chain's drafts per round")
    ap.add_argument("--trees", type=lambda s: [parse_tree(t) for t in s.split(",")],
                    default=[EagleTree(4, 5, 12), EagleTree(4, 7, 16), EagleTree(8, 7, 32)])
    ap.add_argument("--dtype", default=None, help="as every command's --dtype (default float32 on the CPU)")
    args = ap.parse_args()

    target = load_target(embedded.default_target(), dtype=args.dtype)
    chain = load_drafts(target, {}, ["eagle3"])["eagle3"].with_num_drafts(args.chain)
    tok = Tokenizer(embedded.default_target())
    prompts = [tok.encode(p.text) for p in humaneval()[::args.every][:args.limit]]
    arms = {"ar": None, f"chain k={args.chain}": chain}
    arms.update({f"tree {t.topk}x{t.num_steps}x{t.num_draft_tokens}": chain.with_tree(t) for t in args.trees})
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=args.temperature, seed=0)
    fixed = PolicyOptions(adapt=False)
    generate(target, [prompts[0]], SamplingParams(max_new_tokens=4), draft=chain, policy=fixed)   # warm-up
    runs = [one_run(target, arms, prompts, params, fixed) for _ in range(args.runs)]
    speeds = {name: statistics.median(run[0][name] for run in runs) for name in arms}
    tau, differ = runs[0][1], runs[0][2]
    print(f"{len(prompts)} HumanEval prompts (every {args.every}th), {args.new_tokens} new tokens each, "
          f"temperature {args.temperature:g}, batch 1, fixed windows, median of {args.runs} interleaved runs\n")
    print("| arm | tau | tok/s | x AR | output |")
    print("|---|---|---|---|---|")
    for name in arms:
        check = ("-" if name == "ar" else "sampled" if args.temperature > 0
                 else "= AR" if not differ[name] else f"{differ[name]} differ from AR")
        print(f"| {name} | {tau[name]:.2f} | {speeds[name]:.1f} | {speeds[name] / speeds['ar']:.3f} | {check} |")


if __name__ == "__main__":
    main()
