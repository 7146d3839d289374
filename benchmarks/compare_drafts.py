"""Which draft to ship: for each candidate, greedy tau on the HumanEval prompts
(batched generation: each row accepts what it would alone, up to float rounding) and the cost of
one round at batch 1 (draft forward, verify forward, one AR step; interleaved
across candidates, medians), giving the projected batch-1 speedup
tau * T_ar / (T_draft + T_verify).

    python benchmarks/compare_drafts.py runs/dflash3/draft src/blockspec/assets/dflash [--limit 164]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_cost import measure  # noqa: E402  (one round-timing routine for both scripts)

from blockspec import SamplingParams, Tokenizer, embedded, generate, load_draft, load_target  # noqa: E402
from blockspec.bench.datasets import humaneval  # noqa: E402


def greedy_tau(target, draft, prompts: list[list[int]], new_tokens: int, batch: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    tokens = rounds = 0
    for i in range(0, len(prompts), batch):
        out = generate(target, prompts[i:i + batch], params, draft=draft)
        for c in out.completions:
            rounds += len(c.stats.accepted)
            tokens += sum(c.stats.accepted) + len(c.stats.accepted)
    return tokens / rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafts", nargs="+", help="draft directories (same method, same target)")
    ap.add_argument("--limit", type=int, default=164, help="HumanEval prompts for tau")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds of 10 measurements each")
    args = ap.parse_args()
    torch.manual_seed(0)
    tdir = embedded.default_target()
    target, tok = load_target(tdir), Tokenizer(tdir)
    drafts = {d: load_draft(d, target=target) for d in args.drafts}
    prompts = [tok.encode(p.text) for p in humaneval()][:args.limit]
    taus = {d: greedy_tau(target, draft, prompts, args.new_tokens, args.batch) for d, draft in drafts.items()}
    costs: dict[str, list[dict[str, float]]] = {d: [] for d in drafts}
    for _ in range(args.repeats):
        for d, draft in drafts.items():
            costs[d].append(measure(target, draft, 256, 10))
    print(f"{len(prompts)} HumanEval prompts, greedy, {args.new_tokens} new tokens (tau incl. bonus); "
          f"round costs at batch 1, context 256, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} interleaved x 10")
    print("| draft | layers | drafts/round | tau | T_draft ms | T_verify ms | T_ar ms | projected speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for d, draft in drafts.items():
        med = {k: statistics.median(c[k] for c in costs[d]) for k in ("draft_ms", "verify_ms", "ar_ms")}
        speedup = taus[d] * med["ar_ms"] / (med["draft_ms"] + med["verify_ms"])
        print(f"| {d} | {draft.config.num_hidden_layers} | {draft.config.num_drafts} | {taus[d]:.3f} | "
              f"{med['draft_ms']:.2f} | {med['verify_ms']:.2f} | {med['ar_ms']:.2f} | {speedup:.2f}x |")


if __name__ == "__main__":
    main()
