"""The engine's statistics: request counters, round counters, acceptance histograms
(total and per draft position), request latency histograms and time by phase, kept
under one lock; `snapshot` is what `Engine.metrics()` (and so the server's /metrics)
reports.

The latency histograms use vLLM's bucket bounds (vllm/v1/metrics/loggers.py,
PrometheusStatLogger) so dashboards built for vLLM read them unchanged."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from typing import Any

from blockspec.decoding.round import RoundOutcome
from blockspec.engine.handles import RequestTimes
from blockspec.metrics import tau

REQUEST_OUTCOMES = ("submitted", "finished", "cancelled", "rejected", "failed")
PHASES = ("prefill", "draft", "plan", "verify")
FINISH_REASONS = ("stop", "length")

# Bucket upper bounds in seconds, as vLLM's time_to_first_token / inter_token_latency /
# e2e_request_latency histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
LATENCIES = {"time_to_first_token": TTFT_BUCKETS, "inter_token_latency": ITL_BUCKETS,
             "e2e_request_latency": REQUEST_BUCKETS, "request_queue_time": REQUEST_BUCKETS,
             "request_time_per_output_token": ITL_BUCKETS}


class Histogram:
    """Counts of observations per bucket (upper bounds `bounds`, then +Inf), and their sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times   # le: value <= bound
        self.sum += value * times

    def snapshot(self) -> dict[str, Any]:
        """{"buckets": [(upper bound, cumulative count)...], "sum", "count"}; the last bound is inf."""
        cumulative, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            cumulative.append((bound, total))
        return {"buckets": cumulative, "sum": self.sum, "count": total}


class EngineStats:
    def __init__(self, speculative: bool) -> None:
        self.speculative = speculative
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._accepted: Counter = Counter()
        self._verified: Counter = Counter()
        self._blocks: Counter = Counter()   # drafting rounds by block length (drafts)
        self._accepted_per_pos: Counter = Counter()   # request-rounds whose draft at position p was accepted
        self._latency = {name: Histogram(bounds) for name, bounds in LATENCIES.items()}
        # Keys fixed up front: a snapshot may copy it while the engine thread adds to it.
        self._times = dict.fromkeys(PHASES, 0.0)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def prefill(self, prompt_tokens: int, seconds: float) -> None:
        with self._lock:
            self._counts["prompt_tokens"] += prompt_tokens
            self._counts["prefill_batches"] += 1
        self._times["prefill"] += seconds

    def round(self, outcome: RoundOutcome) -> None:
        rows, k = len(outcome.accepted), outcome.drafting_rows
        with self._lock:
            c = self._counts
            c["rounds"] += 1
            c["request_rounds"] += rows
            c["drafting_rounds"] += int(k > 0)
            if k:
                self._blocks[outcome.block] += 1
            # Request-rounds of a speculative engine without a draft: the draft gate chose AR.
            c["undrafted_request_rounds"] += (rows - k) if self.speculative else 0
            c["verified_tokens"] += sum(outcome.verified) + rows
            c["drafts_verified"] += sum(outcome.verified)
            c["drafts_accepted"] += sum(outcome.accepted)
            # A "draft" as vLLM counts it (spec_decode_num_drafts): a request-round that verified drafts.
            c["drafts"] += sum(1 for v in outcome.verified if v > 0)
            # Acceptance lengths over drafting request-rounds only (vLLM's 1 + accepted / drafts):
            # a round that verified no draft says nothing about the drafter.
            self._accepted.update(a for a, v in zip(outcome.accepted, outcome.verified) if v > 0)
            self._verified.update(outcome.verified)
            for accepted in outcome.accepted:   # drafts are accepted as a prefix: positions 0..accepted-1
                self._accepted_per_pos.update(range(accepted))
        self._times["draft"] += outcome.draft_s
        self._times["plan"] += outcome.plan_s
        self._times["verify"] += outcome.verify_s

    def tokens(self, times: RequestTimes, n: int, now: float) -> None:
        """A request delivered `n` tokens at `now` (counted as generated): its first token (TTFT, queue time) or the
        gap since its previous delivery, shared by the tokens it delivered: n inter-token samples of gap / n, what a
        client timing its tokens sees (one sample of the whole gap per step would be a step time, not a token's)."""
        if n <= 0:
            return
        gap = times.delivered(n, now)
        with self._lock:
            self._counts["generated_tokens"] += n
            if gap is None:
                self._latency["time_to_first_token"].observe(now - times.arrival)
                if n > 1:   # tokens after the first in the same delivery came with no wait
                    self._latency["inter_token_latency"].observe(0.0, n - 1)
            else:
                self._latency["inter_token_latency"].observe(gap / n, n)

    def admitted(self, times: RequestTimes, now: float) -> None:
        times.admitted = now
        with self._lock:
            self._latency["request_queue_time"].observe(now - times.arrival)

    def request_finished(self, times: RequestTimes, reason: str | None, now: float) -> None:
        """End-to-end latency and time per output token of a request that finished by itself."""
        times.finished = now
        if reason not in FINISH_REASONS:   # cancelled / failed requests are counted, not timed
            return
        with self._lock:
            self._counts[f"finished_{reason}"] += 1
            self._latency["e2e_request_latency"].observe(now - times.arrival)
            if times.first_token is not None and times.tokens > 1:
                per_token = (times.last_token - times.first_token) / (times.tokens - 1)
                self._latency["request_time_per_output_token"].observe(per_token)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            c = self._counts
            out: dict[str, Any] = {k: c[k] for k in REQUEST_OUTCOMES}
            for key in ("prompt_tokens", "generated_tokens", "prefill_batches", "rounds", "request_rounds",
                        "drafting_rounds", "undrafted_request_rounds", "verified_tokens", "drafts_verified",
                        "drafts_accepted", "drafts"):
                out[key] = c[key]
            out["finished_by_reason"] = {reason: c[f"finished_{reason}"] for reason in FINISH_REASONS}
            out["accepted_per_position"] = dict(sorted(self._accepted_per_pos.items()))
            out["latency"] = {name: h.snapshot() for name, h in self._latency.items()}
            out["tau"] = tau(c["drafts_accepted"], c["request_rounds"], empty=0.0)
            out["accepted_histogram"] = dict(sorted(self._accepted.items()))
            out["verified_histogram"] = dict(sorted(self._verified.items()))
            out["draft_block_histogram"] = dict(sorted(self._blocks.items()))
            out["time_s"] = dict(self._times)
            return out
