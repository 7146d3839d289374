"""lm-evaluation-harness against `blockspec serve`, AR vs speculative: the same tasks through
`local-completions` (remote tokenizer: /tokenize, /tokenizer_info), and whether every
sample's responses (log-likelihoods of the multiple-choice task, texts of the generation
task) are identical between the servers.

    python benchmarks/lm_eval_compare.py --lm-eval /path/to/venv/bin/lm_eval --limit 20

Each server is `blockspec serve --served-model-name tiny --dtype float32 ARGS` on a free
loopback port (the embedded pair by default); lm-eval runs in its own environment
(`pip install "lm-eval[api]"`); tasks are the local ones in benchmarks/lm_eval (no download).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVERS = {"ar": ["--method", "ar"], "dflash": ["--method", "dflash"],
           "dflash --no-adapt": ["--method", "dflash", "--no-adapt"]}
TASKS = "blockspec_code_mc,blockspec_code_gen"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "blockspec.cli", "serve", "--port", str(port), "--served-model-name", "tiny",
           "--dtype", "float32", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server {args} exited with {proc.returncode}")
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"server {args} did not start")


def run_lm_eval(lm_eval: str, port: int, out: Path, limit: int, batch_size: int) -> list[str]:
    cmd = [lm_eval, "--model", "local-completions", "--model_args",
           f"model=tiny,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=remote,"
           "tokenized_requests=True,num_concurrent=1,max_retries=1",
           "--tasks", TASKS, "--include_path", "benchmarks/lm_eval", "--batch_size", str(batch_size),
           "--limit", str(limit), "--output_path", str(out), "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"lm_eval failed:\n{proc.stderr[-2000:]}")
    print("$ " + shlex.join(cmd).replace(f":{port}/", ":PORT/"))
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    print("\n".join(table))
    return table


def samples(out: Path, task: str) -> list:
    path = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)[0]
    return [json.loads(line)["resps"] for line in open(path)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval", required=True, help="the lm_eval executable")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()
    version = subprocess.run([str(Path(args.lm_eval).with_name("python")), "-c",
                              "import lm_eval; print(lm_eval.__version__)"], capture_output=True, text=True)
    print(f"lm-eval {version.stdout.strip() or '(version unknown)'}; tasks in benchmarks/lm_eval, --limit {args.limit}")
    outputs, tables = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in SERVERS.items():
            port = free_port()
            proc = serve(flags, port)
            try:
                print(f"\n### blockspec serve {shlex.join(flags)}")
                outputs[name] = Path(tmp) / name.replace(" ", "_")
                tables[name] = run_lm_eval(args.lm_eval, port, outputs[name], args.limit, args.batch_size)
                metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
                spec = [line for line in metrics.splitlines()
                        if line.startswith(("blockspec:spec_decode_num_drafts_total",
                                            "blockspec:spec_decode_num_accepted_tokens_total"))]
                print("\n".join(spec) if spec else "(no drafts: AR)")
            finally:
                proc.terminate()
                proc.wait(60)
        print("\n### identical to AR, sample by sample")
        for name in list(SERVERS)[1:]:
            for task in TASKS.split(","):
                same = samples(outputs["ar"], task) == samples(outputs[name], task)
                print(f"{name}: {task}: {'identical' if same else 'DIFFERENT'} "
                      f"({len(samples(outputs['ar'], task))} samples)")
            print(f"{name}: score table {'identical' if tables[name] == tables['ar'] else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
