"""EAGLE-3 chain against draft trees on the shipped pair, greedy, batch 1: tokens per round
(tau, bonus included), decoding speed and each arm's ratio to AR, every output checked
against AR's.

    python benchmarks/eagle3_tree.py [--limit 4] [--new-tokens 64] [--chain 7]
        [--trees 4x5x12,4x7x16,8x7x32]

A tree is TOPKxSTEPSxTOKENS in SGLang's terms (--speculative-eagle-topk,
--speculative-num-steps, --speculative-num-draft-tokens). Every arm runs with fixed windows
(`PolicyOptions(adapt=False)`: the adaptive policy plans chains only, and fixed chains keep
the comparison like for like). Per prompt the arms take turns in a rotating order, so a slow
spell of the machine falls on all of them; an arm's speed is its generated tokens over the
sum of its calls' wall times (prefill included, as a user sees it). A short run shows the
method works and which way the numbers lean; measure on a quiet machine before recording.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="HumanEval prompts (from the first)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chain", type=int, default=7, help="the chain's drafts per round")
    ap.add_argument("--trees", type=lambda s: [parse_tree(t) for t in s.split(",")],
                    default=[EagleTree(4, 5, 12), EagleTree(4, 7, 16), EagleTree(8, 7, 32)])
    ap.add_argument("--dtype", default=None, help="as every command's --dtype (default float32 on the CPU)")
    args = ap.parse_args()

    target = load_target(embedded.default_target(), dtype=args.dtype)
    chain = load_drafts(target, {}, ["eagle3"])["eagle3"].with_num_drafts(args.chain)
    tok = Tokenizer(embedded.default_target())
    prompts = [tok.encode(p.text) for p in humaneval()[:args.limit]]
    arms = {"ar": None, f"chain k={args.chain}": chain}
    arms.update({f"tree {t.topk}x{t.num_steps}x{t.num_draft_tokens}": chain.with_tree(t) for t in args.trees})
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    fixed = PolicyOptions(adapt=False)
    generate(target, [prompts[0]], SamplingParams(max_new_tokens=4), draft=chain, policy=fixed)   # warm-up
    tokens = dict.fromkeys(arms, 0)
    rounds = dict.fromkeys(arms, 0)
    accepted = dict.fromkeys(arms, 0)
    seconds = dict.fromkeys(arms, 0.0)
    outputs: dict[tuple[str, int], list[int]] = {}
    names = list(arms)
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
    mismatches = {name: sum(outputs[name, i] != outputs["ar", i] for i in range(len(prompts))) for name in names}
    ar_speed = tokens["ar"] / seconds["ar"]
    print(f"{len(prompts)} HumanEval prompts, {args.new_tokens} new tokens each, greedy, batch 1, fixed windows")
    print(f"{'arm':<18} {'tau':>6} {'tok/s':>8} {'vs AR':>6}  output")
    for name in names:
        speed = tokens[name] / seconds[name]
        tau = (accepted[name] + rounds[name]) / rounds[name] if rounds[name] else 1.0
        check = "-" if name == "ar" else ("= AR" if not mismatches[name] else f"{mismatches[name]} differ")
        print(f"{name:<18} {tau:>6.2f} {speed:>8.1f} {speed / ar_speed:>5.2f}x  {check}")


if __name__ == "__main__":
    main()
