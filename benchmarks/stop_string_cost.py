"""Stop-string and detokenisation cost of one request's text tracker, before vs after
(issue 22: the old tracker re-decoded the whole output, and prefixes of it, every push).

    python benchmarks/stop_string_cost.py --before /work/before/src --after src [--repeats 7]

A 1,000-token stream (embedded tokenizer, source text, pushed in rounds of 1-8 tokens like
speculative rounds) goes through the tracker with no stop strings and with 16 long ones that
never match. Each cell runs in a fresh process per tree (PYTHONPATH = that tree's src), trees
alternate from repeat to repeat, figures are medians over the repeats. Only the tracker is
timed; the tokenizer object (tokenizers.Tokenizer on the embedded tokenizer.json) is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "src" / "blockspec" / "assets" / "target" / "tokenizer.json"
STOPS = [f"<|no stop string {i:02d} appears in this text, ever|>" for i in range(16)]


class Decoder:
    def __init__(self) -> None:
        from tokenizers import Tokenizer
        self.backend = Tokenizer.from_file(str(TOKENIZER))

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)


def stream(decoder: Decoder, n_tokens: int) -> list[list[int]]:
    text = "".join(p.read_text() for p in sorted((ROOT / "src" / "blockspec" / "decoding").glob("*.py")))
    ids = decoder.backend.encode(text, add_special_tokens=False).ids[:n_tokens]
    rng, chunks, i = random.Random(0), [], 0
    while i < len(ids):
        n = rng.randint(1, 8)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def worker(n_tokens: int) -> dict:
    try:
        from blockspec.decoding.output import TextTracker
    except ImportError:  # before the refactor the tracker lived in the engine module
        from blockspec.engine.engine import TextTracker
    decoder = Decoder()
    chunks = stream(decoder, n_tokens)
    out = {}
    for name, stops in (("none", []), ("16 long", STOPS)):
        times = []
        for _ in range(3):
            tracker = TextTracker(decoder, stops)
            per_push = []
            for chunk in chunks:
                t0 = time.perf_counter()
                tracker.push(chunk, final=False)
                per_push.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tracker.push([], final=True)
            per_push.append(time.perf_counter() - t0)
            times.append(per_push)
        best = min(times, key=sum)
        tail = len(best) // 10
        out[name] = {"total_ms": sum(best) * 1e3, "first_us": statistics.median(best[:tail]) * 1e6,
                     "last_us": statistics.median(best[-tail:]) * 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=False)
    ap.add_argument("--after", required=False)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.tokens)))
        return
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.repeats):
        for tree in (("before", "after") if r % 2 == 0 else ("after", "before")):
            env = {**os.environ, "PYTHONPATH": str(Path(trees[tree]).resolve()), "OMP_NUM_THREADS": "1"}
            proc = subprocess.run([sys.executable, __file__, "--worker", "--tokens", str(args.tokens)], env=env,
                                  capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(proc.stdout))
    print(f"{args.tokens} tokens in rounds of 1-8, embedded tokenizer; medians of {args.repeats} runs per tree "
          f"(fresh process each, trees interleaved)\n")
    print("| tree | stop strings | tracker total, ms | overhead vs none, ms | per push, first 10%, us | "
          "per push, last 10%, us |")
    print("|---|---|---|---|---|---|")
    med = {}
    for tree in ("before", "after"):
        for name in ("none", "16 long"):
            med[tree, name] = {k: statistics.median(run[name][k] for run in runs[tree])
                               for k in ("total_ms", "first_us", "last_us")}
        for name in ("none", "16 long"):
            m = med[tree, name]
            over = m["total_ms"] - med[tree, "none"]["total_ms"]
            print(f"| {tree} | {name} | {m['total_ms']:.1f} | {over:+.1f} | {m['first_us']:.0f} | {m['last_us']:.0f} |")
    for name in ("none", "16 long"):
        ratio = med["before", name]["total_ms"] / med["after", name]["total_ms"]
        label = "no stop strings" if name == "none" else f"{name} stop strings"
        print(f"\n{label}: tracker time before / after = {ratio:.1f}x")


if __name__ == "__main__":
    main()
