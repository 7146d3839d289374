"""EngineStats: vLLM's speculative counters (drafts, draft tokens, accepted tokens, accepted
per position) and the request latency histograms from RequestTimes."""

from __future__ import annotations

import math

from blockspec.decoding.round import RoundOutcome
from blockspec.engine.handles import RequestTimes
from blockspec.engine.stats import TTFT_BUCKETS, EngineStats, Histogram


def outcome(verified: list[int], accepted: list[int]) -> RoundOutcome:
    drafted = [[7] * v for v in verified]
    return RoundOutcome(drafted, verified, accepted, [1] * len(verified), None, len(verified), max(verified))


def test_per_position_acceptance_and_draft_counters():
    stats = EngineStats(speculative=True)
    stats.round(outcome([3, 3, 3, 0], [3, 0, 1, 0]))   # the last row verified nothing: no draft
    stats.round(outcome([2], [2]))
    s = stats.snapshot()
    assert s["drafts"] == 4 and s["drafts_verified"] == 11 and s["drafts_accepted"] == 6
    assert s["accepted_per_position"] == {0: 3, 1: 2, 2: 1}
    assert sum(s["accepted_per_position"].values()) == s["drafts_accepted"]
    # acceptance lengths over drafting request-rounds: mean 1 + accepted / drafts (vLLM's formula)
    hist = s["accepted_histogram"]
    assert hist == {3: 1, 0: 1, 1: 1, 2: 1} and sum(hist.values()) == s["drafts"]
    assert 1 + sum(k * n for k, n in hist.items()) / sum(hist.values()) == 1 + s["drafts_accepted"] / s["drafts"]


def test_latency_histograms_from_request_times():
    stats = EngineStats(speculative=False)
    times = RequestTimes(arrival=100.0)
    stats.admitted(times, 100.5)
    stats.tokens(times, 1, 101.0)      # first token: TTFT 1.0
    stats.tokens(times, 0, 101.1)      # no tokens: nothing observed
    stats.tokens(times, 3, 101.25)     # one delivery of 3 tokens: three ITL samples of 0.25 / 3
    stats.tokens(times, 1, 101.30)
    stats.request_finished(times, "length", 102.0)
    lat = stats.snapshot()["latency"]
    assert lat["time_to_first_token"]["count"] == 1 and lat["time_to_first_token"]["sum"] == 1.0
    assert lat["request_queue_time"]["sum"] == 0.5
    itl = lat["inter_token_latency"]
    assert itl["count"] == 4 and math.isclose(itl["sum"], 0.30)   # one per token after the first
    assert dict(itl["buckets"])[0.075] == 1 and dict(itl["buckets"])[0.1] == 4   # 0.05, then 3 x 0.0833
    assert lat["e2e_request_latency"]["count"] == 1 and lat["e2e_request_latency"]["sum"] == 2.0
    per_token = lat["request_time_per_output_token"]
    assert per_token["count"] == 1 and math.isclose(per_token["sum"], 0.30 / 4)   # 5 tokens, 4 gaps
    assert stats.snapshot()["finished_by_reason"] == {"stop": 0, "length": 1}
    cancelled = RequestTimes(arrival=0.0)
    stats.request_finished(cancelled, "cancelled", 5.0)   # counted elsewhere, never timed
    assert stats.snapshot()["latency"]["e2e_request_latency"]["count"] == 1


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram(TTFT_BUCKETS)
    for v in (0.001, 0.0011, 3000.0):
        h.observe(v)
    snap = h.snapshot()
    buckets = dict(snap["buckets"])
    assert buckets[0.001] == 1 and buckets[0.005] == 2 and buckets[2560.0] == 2 and buckets[float("inf")] == 3
    assert snap["count"] == 3
