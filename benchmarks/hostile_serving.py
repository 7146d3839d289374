"""Hostile clients against `blockspec serve` (embedded model), for two source trees side by
side (issue 31):

1. template: the server's chat template loops forever (two nested range(100000)) when the
   first message is "loop", and renders normally otherwise. HOSTILE clients keep posting
   "loop" chats while /health is probed every 0.25 s and a co-tenant posts a plain
   4-token completion every 0.5 s (10 s client timeout), for FLOOD_S seconds. Figures:
   median / max latency of each, co-tenant timeouts, the hostile chats' status codes, and
   the time SIGTERM then takes to end the process (killed after KILL_AFTER_S).
2. stalled bodies: STALLED connections send complete headers (Content-Length: 1000) and 11
   bytes of body, then nothing; then SIGTERM. Figures: seconds until the process exits
   (killed after KILL_AFTER_S), and tracebacks in its log.

    python benchmarks/hostile_serving.py --before /tmp/before/src --after src

Each arm is a fresh server process (PYTHONPATH = the tree's src, --drain-timeout 5); arms
alternate within each repeat; "after, no hostile client" runs the same probes on the after
tree with no hostile client, for scale.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from health_latency import start_server

FLOOD_S = 8.0
HOSTILE = 2
STALLED = 20
KILL_AFTER_S = 60.0
DRAIN_S = "5"
TEMPLATE = ("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% endfor %}{% endfor %}{% else %}{% for m in messages %}{{ m.content }} {% endfor %}{% endif %}")


def start(src: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    return start_server(src, ["--drain-timeout", DRAIN_S, *extra])


def stop(proc: subprocess.Popen) -> tuple[float, bool, str]:
    """SIGTERM: (seconds until the process ended, whether it had to be killed, its log)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(KILL_AFTER_S)
        killed = False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        killed = True
    took = time.monotonic() - t0
    return took, killed, proc.stderr.read()


def timed(fn) -> float | None:
    t0 = time.perf_counter()
    try:
        fn()
    except httpx.HTTPError:
        return None
    return time.perf_counter() - t0


def template_arm(src: str, template: str, hostile_clients: int) -> dict:
    proc, url = start(src, ["--chat-template", template])
    chat = {"messages": [{"role": "user", "content": "loop"}], "max_tokens": 4}
    assert httpx.post(f"{url}/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "hi"}]},
                      timeout=60).status_code == 200   # a worker (after) / the pool (before) is warm
    done = threading.Event()
    codes: dict[str, int] = {}

    def hostile() -> None:
        with httpx.Client(timeout=FLOOD_S + 5) as http:
            while not done.is_set():
                try:
                    key = str(http.post(f"{url}/v1/chat/completions", json=chat).status_code)
                except httpx.HTTPError:
                    key = "no answer"
                codes[key] = codes.get(key, 0) + 1

    def cotenant(out: list) -> None:
        while not done.is_set():
            out.append(timed(lambda: httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                                                timeout=10).raise_for_status()))
            time.sleep(0.5)

    completions: list[float | None] = []
    threads = [threading.Thread(target=hostile, daemon=True) for _ in range(hostile_clients)]
    threads.append(threading.Thread(target=cotenant, args=(completions,), daemon=True))
    for t in threads:
        t.start()
    health = []
    end = time.monotonic() + FLOOD_S
    while time.monotonic() < end:
        health.append(timed(lambda: httpx.get(f"{url}/health", timeout=10).raise_for_status()))
        time.sleep(0.25)
    done.set()
    for t in threads:
        t.join(15)
    took, killed, log = stop(proc)
    return {"health": health, "completions": completions, "codes": codes, "stop": took, "killed": killed,
            "tracebacks": log.count("Traceback")}


def stalled_arm(src: str) -> dict:
    proc, url = start(src, [])
    host, port = url.split("//")[1].split(":")
    socks = []
    for _ in range(STALLED):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        socks.append(s)
    time.sleep(1.0)
    took, killed, log = stop(proc)
    for s in socks:
        s.close()
    return {"stop": took, "killed": killed, "tracebacks": log.count("Traceback")}


def ms(values: list[float | None]) -> str:
    ok = [v for v in values if v is not None]
    if not ok:
        return "- | -"
    return f"{statistics.median(ok) * 1e3:.1f} | {max(ok) * 1e3:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    trees = {"before": args.before, "after": args.after}
    with tempfile.TemporaryDirectory() as tmp:
        template = os.path.join(tmp, "loop.jinja")
        with open(template, "w") as f:
            f.write(TEMPLATE)
        runs: dict[str, list[tuple[dict, dict]]] = {name: [] for name in trees}
        idle: list[dict] = []   # the same probes with no hostile client: what the co-tenant sees normally
        for repeat in range(args.repeats):
            for name in (trees if repeat % 2 == 0 else reversed(list(trees))):
                runs[name].append((template_arm(trees[name], template, HOSTILE), stalled_arm(trees[name])))
            idle.append(template_arm(args.after, template, 0))
    print(f"1. {HOSTILE} clients posting a chat whose template loops forever, {FLOOD_S:.0f} s per arm "
          f"(x {args.repeats}); /health every 0.25 s, a co-tenant 4-token completion every 0.5 s (10 s timeout); "
          f"then SIGTERM (--drain-timeout {DRAIN_S}, killed after {KILL_AFTER_S:.0f} s)\n")
    print("| arm | /health n | /health median ms | max ms | co-tenant n | median ms | max ms | co-tenant timeouts "
          "| hostile chats (status: count) | SIGTERM to exit s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    arms = {**{name: [t for t, _ in pairs] for name, pairs in runs.items()}, "after, no hostile client": idle}
    for name, template_runs in arms.items():
        health = [v for t in template_runs for v in t["health"]]
        comp = [v for t in template_runs for v in t["completions"]]
        codes: dict[str, int] = {}
        for t in template_runs:
            for k, n in t["codes"].items():
                codes[k] = codes.get(k, 0) + n
        stops = ", ".join(f"{t['stop']:.1f}{' (killed)' if t['killed'] else ''}" for t in template_runs)
        print(f"| {name} | {len(health)} | {ms(health)} | {len(comp)} | {ms(comp)} | "
              f"{sum(v is None for v in comp)} | {', '.join(f'{k}: {n}' for k, n in sorted(codes.items())) or '-'} | "
              f"{stops} |")
    print(f"\n2. {STALLED} connections with complete headers and 11 of 1000 body bytes, then SIGTERM "
          f"(--drain-timeout {DRAIN_S})\n")
    print("| arm | SIGTERM to exit s | tracebacks in the log |")
    print("|---|---:|---:|")
    for name, pairs in runs.items():
        stops = ", ".join(f"{s['stop']:.1f}{' (killed)' if s['killed'] else ''}" for _, s in pairs)
        print(f"| {name} | {stops} | {', '.join(str(s['tracebacks']) for _, s in pairs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
