"""The periodic engine stats log line of `blockspec serve`, as vLLM's LoggingStatLogger
prints it (every 10 s by default; `--disable-log-stats` turns it off), from the
differences between two `Engine.metrics()` snapshots:

    Engine 000: Avg prompt throughput: 12.0 tokens/s, Avg generation throughput: 31.5 tokens/s,
    Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 4.2%
    SpecDecoding metrics: Mean acceptance length: 2.99, Accepted throughput: 21.00 tokens/s,
    Drafted throughput: 45.00 tokens/s, Accepted: 210 tokens, Drafted: 450 tokens,
    Per-position acceptance rate: 0.700, 0.470, 0.290, Avg Draft acceptance rate: 46.7%

Mean acceptance length is vLLM's 1 + accepted / drafts (drafts: request-rounds that verified drafts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

log = logging.getLogger("blockspec.stats")

INTERVAL_S = 10.0


def stats_lines(prev: dict[str, Any], now: dict[str, Any], seconds: float) -> list[str]:
    """The log lines for the `seconds` between snapshots `prev` and `now` (none when idle)."""
    def delta(key: str) -> int:
        return now[key] - prev[key]
    if not (delta("prompt_tokens") or delta("generated_tokens") or now["running"] or now["waiting"]):
        return []
    seconds = max(seconds, 1e-9)
    usage = 100 * now["kv_bytes_in_use"] / now["kv_bytes_total"] if now["kv_bytes_total"] else 0.0
    lines = [f"Engine 000: Avg prompt throughput: {delta('prompt_tokens') / seconds:.1f} tokens/s, "
             f"Avg generation throughput: {delta('generated_tokens') / seconds:.1f} tokens/s, "
             f"Running: {now['running']} reqs, Waiting: {now['waiting']} reqs, KV cache usage: {usage:.1f}%"]
    drafts, drafted, accepted = delta("drafts"), delta("drafts_verified"), delta("drafts_accepted")
    if drafts:
        before = prev["accepted_per_position"]
        per_pos = [(n - before.get(p, 0)) / drafts for p, n in sorted(now["accepted_per_position"].items())]
        lines.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                     f"Accepted throughput: {accepted / seconds:.2f} tokens/s, "
                     f"Drafted throughput: {drafted / seconds:.2f} tokens/s, Accepted: {accepted} tokens, "
                     f"Drafted: {drafted} tokens, Per-position acceptance rate: "
                     f"{', '.join(f'{r:.3f}' for r in per_pos)}, "
                     f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%")
    return lines


async def log_stats(metrics: Callable[[], dict[str, Any]], interval: float = INTERVAL_S) -> None:
    """Log `stats_lines` every `interval` seconds until cancelled."""
    prev, t_prev = metrics(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, t_now = metrics(), time.monotonic()
        for line in stats_lines(prev, now, t_now - t_prev):
            log.info("%s", line)
        prev, t_prev = now, t_now
