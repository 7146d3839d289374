"""What an AR round costs inside a speculative engine: the AR engine vs the scheduled
DSpark engine with drafting switched off (every round an AR step, but features are still
captured and appended to the draft context) vs the gated engine as shipped. Same 32
HumanEval prompts, 128 new tokens, greedy, interleaved repeats, medians.

    python benchmarks/engine_ar_overhead.py [--concurrency 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockspec import Engine, PolicyOptions, SamplingParams, Tokenizer, embedded, load_draft, load_target
from blockspec.bench.datasets import humaneval
from blockspec.decoding.cost_table import ProfileOptions, profile_cost_table


class NeverDraft:
    """A draft gate that always picks AR rounds."""

    def decide(self, rows: int) -> tuple[int, int]:
        return 0, 0

    def update(self, survival: torch.Tensor, block: int | None = None) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tdir = embedded.default_target()
    target, tok = load_target(tdir), Tokenizer(tdir)
    draft = load_draft(embedded.default_draft("dspark"), target=target)
    table = profile_cost_table(target, [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512], ProfileOptions(repeats=5, rows=16),
                               capture=tuple(draft.config.target_layer_ids), draft=draft,
                               draft_rows=[1, 2, 4, 8, 16, 32])
    prompts = [tok.encode(p.text) for p in humaneval()][:2 * args.concurrency]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)

    def run(kind: str) -> tuple[float, dict[str, float]]:
        if kind == "ar":
            engine = Engine(target, None, method="ar", max_running=args.concurrency, max_model_len=1024)
        else:
            engine = Engine(target, draft, method="dspark", max_running=args.concurrency, max_model_len=1024,
                            policy=PolicyOptions(scheduled=True, cost_table=table))
            if kind == "spec engine, drafting off":
                engine._gate = NeverDraft()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        tps = engine.metrics()["generated_tokens"] / (time.perf_counter() - t0)
        return tps, dict(engine._times)

    kinds = ["ar", "spec engine, drafting off", "gated (as shipped)"]
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for kind in kinds:
            runs[kind].append(run(kind))
    ar = statistics.median(t for t, _ in runs["ar"])
    print(f"concurrency {args.concurrency}, {len(prompts)} HumanEval prompts, 128 new tokens, greedy, "
          f"median of {args.repeats} interleaved runs")
    print("| engine | tok/s | vs AR | prefill s | draft s | verify s |")
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        tps = statistics.median(t for t, _ in runs[kind])
        times = {k: statistics.median(x[k] for _, x in runs[kind]) for k in ("prefill", "draft", "verify")}
        print(f"| {kind} | {tps:.1f} | {tps / ar:.2f}x | {times['prefill']:.2f} | {times['draft']:.2f} | "
              f"{times['verify']:.2f} |")


if __name__ == "__main__":
    main()
