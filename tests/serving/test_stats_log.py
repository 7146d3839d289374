"""The periodic engine stats line (vLLM's LoggingStatLogger format) from two snapshots."""

from __future__ import annotations

import asyncio
import logging

from blockspec.serving.stats_log import log_stats, stats_lines


def snapshot(prompt=0, generated=0, drafts=0, verified=0, accepted=0, per_pos=None, running=0, waiting=0):
    return {"prompt_tokens": prompt, "generated_tokens": generated, "drafts": drafts, "drafts_verified": verified,
            "drafts_accepted": accepted, "accepted_per_position": per_pos or {}, "running": running,
            "waiting": waiting, "kv_bytes_in_use": 25, "kv_bytes_total": 100}


def test_line_reports_throughputs_and_vllm_acceptance_length():
    prev = snapshot(prompt=10, generated=5, drafts=2, verified=6, accepted=3, per_pos={0: 2, 1: 1})
    now = snapshot(prompt=110, generated=205, drafts=12, verified=36, accepted=23, per_pos={0: 9, 1: 8, 2: 6},
                   running=3, waiting=1)
    engine, spec = stats_lines(prev, now, 10.0)
    assert engine == ("Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
                      "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%")
    # 1 + accepted / drafts = 1 + 20 / 10; per position: accepted at p / drafts
    assert spec.startswith("SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 2.00 tokens/s, "
                           "Drafted throughput: 3.00 tokens/s, Accepted: 20 tokens, Drafted: 30 tokens")
    assert spec.endswith("Per-position acceptance rate: 0.700, 0.700, 0.600, Avg Draft acceptance rate: 66.7%")
    assert stats_lines(now, {**now, "running": 0, "waiting": 0}, 10.0) == []   # idle: silent
    assert len(stats_lines(now, {**now, "generated_tokens": 206}, 10.0)) == 1   # no drafts: no spec line


def test_log_stats_logs_every_interval(caplog):
    counter = iter(range(0, 10**6, 7))

    def metrics():
        return snapshot(generated=next(counter), running=1)

    async def run():
        task = asyncio.ensure_future(log_stats(metrics, 0.02))
        await asyncio.sleep(0.1)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="blockspec.stats"):
        asyncio.run(run())
    assert sum("Avg generation throughput" in r.message for r in caplog.records) >= 2
