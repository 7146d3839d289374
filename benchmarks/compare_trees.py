"""Two source trees of blockspec measured side by side in one run (a refactor must not
cost speed): batch-1 HumanEval tau and tok/s for ar / dflash / dspark at temperatures
0 and 1, and engine throughput at the given concurrencies, on the embedded models.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_trees.py --before /tmp/before/src --after src [--repeats 3] [--limit 40]

Every cell runs in a fresh process per tree (PYTHONPATH = that tree's src), the two
trees alternate in order from cell to cell and repeat to repeat, and each figure is
the median over the repeats; the ratio is after / before of those medians. Only the
public API that both trees share is used (`blockspec.generate`, `blockspec.Engine`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(kind: str, method: str, temperature: float, limit: int, new_tokens: int, concurrency: int) -> dict:
    import torch

    from blockspec import Engine, SamplingParams, Tokenizer, embedded, generate, load_draft, load_target
    from blockspec.bench.datasets import humaneval

    target_dir = embedded.default_target()
    target = load_target(target_dir)
    draft = load_draft(embedded.default_draft(method), target=target) if method != "ar" else None
    tok = Tokenizer(target_dir)
    prompts = [tok.encode(p.text) for p in humaneval()]
    torch.set_grad_enabled(False)
    if kind == "batch1":
        tokens = rounds = accepted = 0
        seconds = 0.0
        params = [SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i) for i in range(limit)]
        warm = SamplingParams(max_new_tokens=16, temperature=temperature, seed=0)
        generate(target, [prompts[0]], warm, draft=draft, method=method)  # warm-up: weights prepacked, paths taken
        for ids, p in zip(prompts[:limit], params):
            t0 = time.perf_counter()
            out = generate(target, [ids], p, draft=draft, method=method)
            seconds += time.perf_counter() - t0
            c = out.completions[0]
            tokens, rounds, accepted = tokens + len(c.tokens), rounds + c.stats.rounds, accepted + sum(c.stats.accepted)
        return {"tok_s": tokens / seconds, "tau": (accepted + rounds) / max(1, rounds), "tokens": tokens}
    n = max(8, 4 * concurrency)
    engine = Engine(target, draft, method=method, max_running=concurrency, max_model_len=1024)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=8, ignore_eos=True))   # warm-up
    before = engine.metrics()["generated_tokens"]
    t0 = time.perf_counter()
    handles = [engine.submit(ids, params) for ids in prompts[:n]]
    engine.run_until_done()
    seconds = time.perf_counter() - t0
    m = engine.metrics()
    assert all(h.done for h in handles)
    return {"tok_s": (m["generated_tokens"] - before) / seconds, "tau": m["tau"], "tokens": m["generated_tokens"]}


def run_cell(src: str, cell: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    cmd = [sys.executable, __file__, "--worker", json.dumps(cell)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed for {src} {cell}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--before", help="src directory of the earlier tree")
    ap.add_argument("--after", help="src directory of the later tree")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=40, help="HumanEval prompts at batch 1")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ar,dflash,dspark")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--log", help="append a progress line per cell to this file")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return 0
    if not (args.before and args.after):
        ap.error("--before and --after are required")
    methods = args.methods.split(",")
    cells = [dict(kind="batch1", method=m, temperature=float(t), limit=args.limit, new_tokens=args.new_tokens,
                  concurrency=1) for t in args.temperatures.split(",") for m in methods]
    cells += [dict(kind="engine", method=m, temperature=0.0, limit=args.limit, new_tokens=args.new_tokens,
                   concurrency=int(c)) for c in args.concurrency.split(",") for m in methods]
    trees = {"before": args.before, "after": args.after}
    runs: dict[tuple[int, str], list[dict]] = {}
    for rep in range(args.repeats):
        for i, cell in enumerate(cells):
            order = ["before", "after"] if (rep + i) % 2 == 0 else ["after", "before"]
            for name in order:
                runs.setdefault((i, name), []).append(run_cell(trees[name], cell))
            line = f"{time.strftime('%H:%M:%S')} repeat {rep + 1}/{args.repeats}, cell {i + 1}/{len(cells)} done"
            print(line, file=sys.stderr, flush=True)
            if args.log:
                with open(args.log, "a") as f:
                    f.write(line + "\n")
    print(f"{args.repeats} repeats per cell, medians; trees alternate in order; batch 1: {args.limit} HumanEval "
          f"prompts, {args.new_tokens} new tokens, seeded; engine: max(8, 4c) HumanEval prompts, greedy, "
          f"{args.new_tokens} new tokens (ignore EOS)\n")
    print("| cell | tau before | tau after | tok/s before | tok/s after | after / before |")
    print("|---|---|---|---|---|---|")
    for i, cell in enumerate(cells):
        med = {name: {k: statistics.median(r[k] for r in runs[(i, name)]) for k in ("tau", "tok_s")}
               for name in trees}
        label = (f"batch 1, T={cell['temperature']:g}, {cell['method']}" if cell["kind"] == "batch1"
                 else f"engine c={cell['concurrency']}, {cell['method']}")
        spread = {name: f"{min(r['tok_s'] for r in runs[(i, name)]):.1f}-{max(r['tok_s'] for r in runs[(i, name)]):.1f}"
                  for name in trees}
        print(f"| {label} | {med['before']['tau']:.3f} | {med['after']['tau']:.3f} | "
              f"{med['before']['tok_s']:.1f} ({spread['before']}) | {med['after']['tok_s']:.1f} ({spread['after']}) | "
              f"{med['after']['tok_s'] / med['before']['tok_s']:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
