"""Drafter training throughput on CPU: tokens/s and peak resident memory of `blockspec train`
with the embedded target (src/blockspec/assets/target) and drafts of the first embedded pair's
shapes (4 layers, features of target layers 1,3,5; DFlash block 16, DSpark gamma 15 with Markov rank
64 and the confidence head), on synthetic sequences of `--max-len` tokens.

Each case runs in its own process (peak RSS is per process). With `--before SRC` the same
cases also run against another source tree (the pre-change trainer), interleaved with the
current one, and only with the options that tree has. `--repeats R` runs every case R times
(interleaved rounds) and reports the median step time with its range: on a shared CPU single
runs vary severalfold.

    python benchmarks/train_throughput.py [--steps 8] [--repeats 3] [--before /work/before/src]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "src" / "blockspec" / "assets" / "target"
SHAPE = dict(num_layers=4, target_layer_ids="1,3,5", intermediate_size=768, num_heads=4, num_kv_heads=2)
CASES = [  # (label, method, block, extra options, runs on the old tree)
    ("DFlash B=16", "dflash", 16, {}, True),
    ("DFlash B=16, --grad-checkpoint", "dflash", 16, {"grad_checkpoint": True}, False),
    ("DSpark gamma=15", "dspark", 15, {}, True),
]

CHILD = """
import json, resource, sys
from blockspec.training.trainer import TrainConfig, train
train(TrainConfig(**json.loads(sys.argv[1])))
print(json.dumps({"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_data(path: Path, n: int, length: int, vocab: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            ids = [rng.randrange(3, vocab) for _ in range(length)]
            f.write(json.dumps({"prompt_ids": ids[:64], "response_ids": ids[64:]}) + "\n")


def run_case(src: Path, work: Path, label: str, method: str, block: int, extra: dict, args) -> dict:
    out = work / f"out-{abs(hash((str(src), label)))}-{run_case.count}"
    run_case.count += 1
    cfg = dict(method=method, target=str(TARGET), data=str(work / "data.jsonl"), out=str(out), block_size=block,
               batch_size=args.batch_size, max_len=args.max_len, max_steps=args.steps, eval_every=10_000,
               eval_examples=1, eval_new_tokens=4, threads=args.threads, device="cpu", **SHAPE, **extra)
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, env=env,
                          cwd=work)
    if proc.returncode != 0:
        raise SystemExit(f"{label} ({src}) failed:\n{proc.stderr[-3000:]}")
    rss = json.loads(proc.stdout.strip().splitlines()[-1])["maxrss_mib"]
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    # Steady state: the steps after the first `warmup`, timed by the run's own cumulative time_s.
    w = args.warmup
    secs = log[-1]["time_s"] - log[w - 1]["time_s"]
    tokens = (len(log) - w) * args.batch_size * args.max_len
    return {"tok_s": tokens / secs, "s_step": secs / (len(log) - w), "rss": rss, "loss": log[-1]["loss"]}


run_case.count = 0  # type: ignore[attr-defined]  # distinct output directories


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--before", default=None, help="another source tree to run the same cases against")
    args = ap.parse_args()
    trees = [("after", ROOT / "src")] + ([("before", Path(args.before))] if args.before else [])
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_data(work / "data.jsonl", n=args.batch_size * args.steps + 1, length=args.max_len, vocab=8192)
        for _ in range(args.repeats):
            for label, method, block, extra, old_ok in CASES:
                for name, src in trees:          # interleaved: each case on both trees back to back
                    if name == "before" and not old_ok:
                        continue
                    r = run_case(src, work, label, method, block, extra, args)
                    results.setdefault((label, name), []).append(r)
    print(f"{args.batch_size} sequences x {args.max_len} tokens per step, {args.steps} steps "
          f"(first {args.warmup} not timed), {args.threads} threads, fp32 target and draft, "
          f"{args.repeats} interleaved run(s) per row (median, range)\n")
    print("| case | tree | tokens/s | s/step (range) | peak RSS (MiB) | last loss |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (label, name), rs in results.items():
        steps = [r["s_step"] for r in rs]
        med = statistics.median(steps)
        print(f"| {label} | {name} | {args.batch_size * args.max_len / med:,.0f} | {med:.2f} "
              f"({min(steps):.2f}-{max(steps):.2f}) | {max(r['rss'] for r in rs):,.0f} | {rs[-1]['loss']:.3f} |")


if __name__ == "__main__":
    main()
