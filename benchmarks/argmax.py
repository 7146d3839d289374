"""torch.argmax vs `sampling.argmax_last` (two-level: chunk maxima, then argmax) over the
vocabulary on this CPU, for the shapes the greedy paths see: draft / verify blocks at
batch 1 and 32, and one Markov-head slot. Interleaved, medians; results are checked equal.

    python benchmarks/argmax.py [--vocab 8192] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockspec.decoding.sampling import argmax_last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = [(1, 16), (32, 16), (32, 1), (1, 1)]
    print(f"vocab {args.vocab}, float32, {torch.get_num_threads()} threads, median of {args.repeats} interleaved calls")
    print("| logits shape | torch.argmax us | argmax_last us | ratio |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for rows, slots in shapes:
            x = torch.randn(rows, slots, args.vocab)
            assert torch.equal(x.argmax(-1), argmax_last(x))
            times: dict[str, list[float]] = {"torch": [], "two-level": []}
            for _ in range(args.repeats):
                for name, fn in (("torch", lambda: x.argmax(-1)), ("two-level", lambda: argmax_last(x))):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[k]) * 1e6 for k in ("torch", "two-level"))
            print(f"| [{rows}, {slots}, {args.vocab}] | {a:.0f} | {b:.0f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
