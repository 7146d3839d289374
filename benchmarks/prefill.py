"""Prefill of a batch of HumanEval prompts: one right-padded forward
(`prefill._prefill_rows`) vs `prefill.prefill`, which runs contiguous groups of
similar length (`padding_groups`). Interleaved, medians; the sampled first tokens are
checked equal.

    python benchmarks/prefill.py [--batch 32] [--repeats 5] [--draft]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockspec import SamplingParams, Tokenizer, embedded, load_draft, load_target
from blockspec.bench.datasets import humaneval
from blockspec.decoding.sampling import RowSampler
from blockspec.decoding.prefill import ContextSink, _prefill_rows, padding_groups, prefill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draft", action="store_true", help="also seed the embedded DFlash draft's context")
    args = ap.parse_args()
    tdir = embedded.default_target()
    target, tok = load_target(tdir), Tokenizer(tdir)
    draft = load_draft(embedded.default_draft("dflash"), target=target) if args.draft else None
    prompts = [tok.encode(p.text) for p in humaneval()][:args.batch]
    lengths = [len(p) for p in prompts]
    sampler = RowSampler.from_params([SamplingParams()] * len(prompts))
    cap = max(lengths) + 8
    cache = target.new_cache(len(prompts), cap)
    dcache = draft.new_cache(len(prompts), cap + 32) if draft is not None else None
    tops = [-1] * len(prompts)
    arms = {"one padded batch": lambda *a: _prefill_rows(*a, tops), "grouped": prefill}
    times: dict[str, list[float]] = {k: [] for k in arms}
    firsts = {}
    with torch.inference_mode():
        for _ in range(args.repeats + 1):   # the first pass warms up
            for name, fn in arms.items():
                cache.lengths.zero_()
                if dcache is not None:
                    dcache.lengths.zero_()
                t0 = time.perf_counter()
                firsts[name] = fn(target, cache, prompts, sampler, ContextSink(draft, dcache)).anchors
                times[name].append(time.perf_counter() - t0)
    assert torch.equal(firsts["one padded batch"], firsts["grouped"])
    real, padded = sum(lengths), max(lengths) * len(lengths)
    print(f"{len(prompts)} HumanEval prompts, {real} tokens ({padded} padded to the longest), "
          f"{len(padding_groups(lengths))} groups; draft context: {'yes' if draft else 'no'}; "
          f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved")
    print("| prefill | seconds |")
    print("|---|---|")
    for name in arms:
        print(f"| {name} | {statistics.median(times[name][1:]):.3f} |")


if __name__ == "__main__":
    main()
