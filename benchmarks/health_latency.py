"""/health latency while six ~1 MB text prompts are being refused, on `blockspec serve`
with the embedded model, for two source trees side by side (issue 22: prompts were
tokenized on the event loop before being refused, stalling every other request).

    python benchmarks/health_latency.py --before /work/before/src --after src [--repeats 2]

Arms (each a fresh server process, PYTHONPATH = the tree's src; arms alternate within
each repeat): `before`; `after` (the prompt-byte limit refuses them untokenized);
`after, no byte limit` (--max-prompt-bytes 2000000: tokenized in a worker thread, then
refused for their token count). Each run floods with six concurrent clients posting
999,000-byte prompts for FLOOD_S seconds while /health is probed every 50 ms; the figures
are the median and maximum /health latency over all probes of all repeats.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

FLOOD_S = 6.0
CLIENTS = 6
PROMPT = "def f(x): return x + 1\n" * 43_435   # 999,005 bytes of code-like text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(src: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`blockspec serve` (embedded model) from the tree `src` on a free port, once /health answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.serving.server", "--port", str(port),
                             "--log-level", "warning", "--max-model-len", "1024", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(proc.communicate()[1][-2000:])
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not start")
        time.sleep(0.2)


def run_arm(src: str, extra: list[str]) -> tuple[list[float], dict[int, int]]:
    proc, url = start_server(src, extra)
    try:
        stop = threading.Event()
        codes: dict[int, int] = {}

        def flood() -> None:
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    r = http.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1

        threads = [threading.Thread(target=flood) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(0.5)   # let the flood reach the server
        latencies = []
        end = time.monotonic() + FLOOD_S
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                http.get(f"{url}/health")
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join()
        return latencies, codes
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    arms = {"before": (args.before, []), "after": (args.after, []),
            "after, no byte limit": (args.after, ["--max-prompt-bytes", "2000000"])}
    results: dict[str, tuple[list[float], dict[int, int]]] = {name: ([], {}) for name in arms}
    for repeat in range(args.repeats):
        order = list(arms) if repeat % 2 == 0 else list(reversed(arms))
        for name in order:
            lat, codes = run_arm(*arms[name])
            results[name][0].extend(lat)
            for code, n in codes.items():
                results[name][1][code] = results[name][1].get(code, 0) + n
    print(f"/health latency with {CLIENTS} clients posting {len(PROMPT.encode()):,}-byte prompts "
          f"({args.repeats} x {FLOOD_S:.0f} s per arm, embedded model, --max-model-len 1024)\n")
    print("| arm | /health probes | median ms | max ms | refused prompts (status: count) |")
    print("|---|---:|---:|---:|---|")
    for name, (lat, codes) in results.items():
        status = ", ".join(f"{c}: {n}" for c, n in sorted(codes.items()))
        print(f"| {name} | {len(lat)} | {statistics.median(lat) * 1e3:.1f} | {max(lat) * 1e3:.1f} | {status} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
