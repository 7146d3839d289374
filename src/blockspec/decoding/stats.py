"""The engine's statistics: request counters, round counters, acceptance histograms
and time by phase, kept under one lock; `snapshot` is what `Engine.metrics()` (and
so the server's /metrics) reports."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from blockspec.decoding.acceptance import tau
from blockspec.decoding.round import RoundOutcome

REQUEST_OUTCOMES = ("submitted", "finished", "cancelled", "rejected", "failed")
PHASES = ("prefill", "draft", "plan", "verify")


class EngineStats:
    def __init__(self, speculative: bool) -> None:
        self.speculative = speculative
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._accepted: Counter = Counter()
        self._verified: Counter = Counter()
        self._blocks: Counter = Counter()   # drafting rounds by block length (drafts)
        # Keys fixed up front: a snapshot may copy it while the engine thread adds to it.
        self._times = dict.fromkeys(PHASES, 0.0)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def add_time(self, phase: str, seconds: float) -> None:
        self._times[phase] += seconds

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
            self._accepted.update(outcome.accepted)
            self._verified.update(outcome.verified)
        self._times["draft"] += outcome.draft_s
        self._times["plan"] += outcome.plan_s
        self._times["verify"] += outcome.verify_s

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            c = self._counts
            out: dict[str, Any] = {k: c[k] for k in REQUEST_OUTCOMES}
            for key in ("prompt_tokens", "generated_tokens", "prefill_batches", "rounds", "request_rounds",
                        "drafting_rounds", "undrafted_request_rounds", "verified_tokens", "drafts_verified",
                        "drafts_accepted"):
                out[key] = c[key]
            out["tau"] = tau(c["drafts_accepted"], c["request_rounds"], empty=0.0)
            out["accepted_histogram"] = dict(sorted(self._accepted.items()))
            out["verified_histogram"] = dict(sorted(self._verified.items()))
            out["draft_block_histogram"] = dict(sorted(self._blocks.items()))
            out["time_s"] = dict(self._times)
            return out
