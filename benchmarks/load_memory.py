"""Host memory of loading, two source trees side by side (issues 17 and 22).

    python benchmarks/load_memory.py --before /work/before/src --after src [--repeats 2]

1. Peak RSS of `blockspec generate` on the embedded DSpark draft whose config asks for
   64 layers of intermediate_size 1e6 (the issue's absurd draft): exit status, stderr
   lines, wall time. Each process runs under an address-space cap (--cap-gib, default
   6) so a tree that allocates for the config cannot take the machine; a run that hits
   the cap is reported as such.
2. Peak RSS while loading a ~1 GiB random bfloat16 Qwen3 checkpoint written by
   transformers (sharded at 500 MB), in bfloat16 and in float32: the process's peak
   RSS (ru_maxrss) minus its RSS after imports, and the weights' size for scale.

Every measurement is a fresh process (PYTHONPATH = that tree's src); the trees
alternate within each repeat; figures are the maxima over repeats (peaks).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = float(1 << 30)

LOAD = r"""
import json, resource, sys, time
import torch
from blockspec.models.checkpoint import load_target
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
model = load_target(sys.argv[1], dtype=sys.argv[2])
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
print(json.dumps({"base": base * 1024, "peak": peak * 1024, "seconds": seconds, "weights": weights,
                  "dtype": str(model.dtype)}))
"""

CLI = r"""
import resource, sys
try:
    from blockspec.cli import main
    rc = main(sys.argv[1:])
except BaseException as exc:  # a crash (or the cap) ends the run: report it
    import traceback
    traceback.print_exc()
    rc = 1
finally:
    print("MAXRSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr)
sys.exit(rc)
"""


def run(tree: str, code: str, args: list[str], cap_gib: float | None = None, timeout: float = 900) -> tuple:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "2"}

    def limit() -> None:
        if cap_gib:
            cap = int(cap_gib * GIB)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, preexec_fn=limit)
    return proc, time.perf_counter() - t0


def write_checkpoint(path: Path) -> None:
    """A ~1 GiB random bfloat16 Qwen3 written by transformers (in a child process, so its
    memory is gone before anything is measured)."""
    code = r"""
import sys, torch, transformers
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
cfg = transformers.Qwen3Config(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=9,
                               num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                               max_position_embeddings=4096, tie_word_embeddings=False)
model = transformers.Qwen3ForCausalLM(cfg)
model.save_pretrained(sys.argv[1], max_shard_size="500MB")
"""
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)


def absurd_draft(path: Path, tree: str) -> None:
    src = Path(tree) / "blockspec" / "assets" / "dspark"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(intermediate_size=10**6, num_hidden_layers=64)
    (path / "config.json").write_text(json.dumps(cfg))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cap-gib", type=float, default=6.0)
    args = ap.parse_args()
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    work = Path(tempfile.mkdtemp(prefix="blockspec-load-"))
    try:
        # 1. the absurd draft
        draft = work / "absurd"
        absurd_draft(draft, trees["after"])
        absurd: dict[str, dict] = {}
        for r in range(args.repeats):
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                proc, wall = run(trees[name], CLI, ["generate", "hi", "--method", "dspark", "--draft", str(draft),
                                                    "--max-new-tokens", "4"], cap_gib=args.cap_gib)
                lines = [l for l in proc.stderr.splitlines() if not l.startswith("MAXRSS")]
                rss = int(next(l for l in proc.stderr.splitlines() if l.startswith("MAXRSS")).split()[1])
                capped = any(s in proc.stderr for s in ("MemoryError", "allocate memory", "not enough memory"))
                prev = absurd.get(name)
                if prev is None or rss > prev["rss"]:
                    absurd[name] = {"rss": rss, "rc": proc.returncode, "lines": len(lines), "wall": wall,
                                    "capped": capped, "last": lines[-1][:110] if lines else ""}
        print(f"### Absurd draft config (intermediate_size 1e6 x 64 layers), `blockspec generate --method dspark`, "
              f"address space capped at {args.cap_gib:g} GiB\n")
        print("| tree | exit | stderr lines | peak RSS (GiB) | wall (s) | hit the cap | last stderr line |")
        print("|---|---|---|---|---|---|---|")
        for name in ("before", "after"):
            a = absurd[name]
            print(f"| {name} | {a['rc']} | {a['lines']} | {a['rss'] / GIB:.2f} | {a['wall']:.1f} | "
                  f"{'yes' if a['capped'] else 'no'} | `{a['last'].replace('|', '/')}` |")

        # 2. loading a ~1 GiB bf16 checkpoint
        ckpt = work / "qwen3-1gib"
        write_checkpoint(ckpt)
        files = sorted(ckpt.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        loads: dict[tuple[str, str], dict] = {}
        for r in range(args.repeats):
            for dtype in ("bfloat16", "float32"):
                for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    proc, _ = run(trees[name], LOAD, [str(ckpt), dtype])
                    if proc.returncode != 0:
                        print(proc.stderr[-2000:], file=sys.stderr)
                        return 1
                    m = json.loads(proc.stdout.strip().splitlines()[-1])
                    key = (name, dtype)
                    prev = loads.get(key)
                    if prev is None or m["peak"] - m["base"] > prev["peak"] - prev["base"]:
                        loads[key] = {**m, "best_seconds": min(m["seconds"], (prev or m)["seconds"])}
                    else:
                        prev["best_seconds"] = min(prev["best_seconds"], m["seconds"])
        print(f"\n### Loading a random bfloat16 Qwen3 checkpoint written by transformers: {size / GIB:.2f} GiB "
              f"in {len(files)} shards, CPU\n")
        print("| tree | load dtype | weights (GiB) | peak RSS - RSS after imports (GiB) | x weights | "
              "peak RSS (GiB) | load time (s, best) |")
        print("|---|---|---|---|---|---|---|")
        for dtype in ("bfloat16", "float32"):
            for name in ("before", "after"):
                m = loads[(name, dtype)]
                grow = m["peak"] - m["base"]
                print(f"| {name} | {dtype} | {m['weights'] / GIB:.2f} | {grow / GIB:.2f} | "
                      f"{grow / m['weights']:.2f} | {m['peak'] / GIB:.2f} | {m['best_seconds']:.1f} |")
        print(f"\n{args.repeats} repeats per cell, trees alternating; peaks are the maxima over repeats.")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
