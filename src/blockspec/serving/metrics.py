"""GET /metrics: Prometheus exposition through `prometheus_client`.

A custom collector reads `Engine.metrics()` at scrape time (the engine's own counters
and histograms are the single source; nothing is counted twice) into a registry of
the app's own, so several apps in one process never clash.

Two families of names:
- `blockspec_*` (unchanged from earlier releases): HTTP requests by endpoint and status,
  tokens, engine outcomes, slots, KV bytes and the acceptance-length histogram.
- `blockspec:*`, vLLM's names with blockspec's prefix and a `model_name` label, so a
  vLLM dashboard works after replacing `vllm:` by `blockspec:`: the speculative-decoding
  counters of vllm/v1/spec_decode/metrics.py (SpecDecodingProm: `spec_decode_num_drafts`,
  `spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`,
  `spec_decode_num_accepted_tokens_per_pos{position}`) and the request latency histograms
  of vllm/v1/metrics/loggers.py (PrometheusStatLogger: `time_to_first_token_seconds`,
  `inter_token_latency_seconds`, `e2e_request_latency_seconds`, `request_queue_time_seconds`,
  `request_time_per_output_token_seconds`), plus `request_success_total{finished_reason}`,
  `num_requests_running` / `num_requests_waiting`, `kv_cache_usage_perc`, token counters.
  Mean acceptance length = 1 + rate(accepted_tokens) / rate(num_drafts), as in vLLM.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_DOCS = {
    "time_to_first_token": "Histogram of time to first token in seconds.",
    "inter_token_latency": "Histogram of the time between two tokens of a request in seconds (one sample per "
                           "token after the first: a delivery of n tokens is n samples of its gap / n).",
    "e2e_request_latency": "Histogram of e2e request latency in seconds.",
    "request_queue_time": "Histogram of time spent waiting for a KV slot in seconds.",
    "request_time_per_output_token": "Histogram of (last token - first token) / (tokens - 1) per request.",
}


class EngineCollector(Collector):
    """Prometheus families of `metrics()` (Engine.metrics) and the HTTP request counts."""

    def __init__(self, metrics: Callable[[], dict[str, Any]], requests: Counter, model_name: str,
                 num_drafts: int) -> None:
        self.metrics, self.requests, self.model, self.num_drafts = metrics, requests, model_name, num_drafts

    def collect(self) -> Iterator[Metric]:
        m = self.metrics()
        yield from self.legacy(m)
        yield from self.vllm_style(m)

    def legacy(self, m: dict[str, Any]) -> Iterator[Metric]:
        requests = CounterMetricFamily("blockspec_requests", "HTTP requests by endpoint and status code.",
                                       labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(self.requests.items()):
            requests.add_metric([endpoint, str(status)], n)
        yield requests
        yield CounterMetricFamily("blockspec_prompt_tokens", "Prompt tokens prefilled.", m["prompt_tokens"])
        yield CounterMetricFamily("blockspec_generation_tokens", "Tokens generated.", m["generated_tokens"])
        outcomes = CounterMetricFamily("blockspec_engine_requests", "Engine requests by outcome.", labels=["outcome"])
        for key in ("submitted", "finished", "cancelled", "rejected", "failed"):
            outcomes.add_metric([key], m[key])
        yield outcomes
        yield GaugeMetricFamily("blockspec_num_requests_running", "Requests holding a KV slot.", m["running"])
        yield GaugeMetricFamily("blockspec_num_requests_waiting", "Requests queued for a KV slot.", m["waiting"])
        yield GaugeMetricFamily("blockspec_kv_slots", "KV slots (most requests running at once).", m["slots"])
        yield GaugeMetricFamily("blockspec_kv_cache_bytes_in_use", "KV cache bytes held by running requests.",
                                m["kv_bytes_in_use"])
        yield GaugeMetricFamily("blockspec_kv_cache_bytes_total", "KV cache bytes preallocated.", m["kv_bytes_total"])
        yield self.acceptance_length("blockspec_acceptance_length", m, labels={})

    def acceptance_length(self, name: str, m: dict[str, Any], labels: dict[str, str]) -> Metric:
        """Tokens per drafting request-round (accepted drafts + the bonus token): its mean is vLLM's mean
        acceptance length, 1 + accepted / drafts."""
        hist = {accepted + 1: n for accepted, n in m["accepted_histogram"].items()}
        top = max([self.num_drafts + 1, *hist])
        buckets = [(str(le), sum(n for k, n in hist.items() if k <= le)) for le in range(1, top + 1)]
        buckets.append(("+Inf", sum(hist.values())))
        family = HistogramMetricFamily(name, "Tokens produced per drafting request-round (accepted drafts + 1).",
                                       labels=list(labels))
        family.add_metric(list(labels.values()), buckets, sum(k * n for k, n in hist.items()))
        return family

    def vllm_style(self, m: dict[str, Any]) -> Iterator[Metric]:
        model = [self.model]

        def one(kind: type, name: str, doc: str, value: float) -> Metric:
            family = kind(f"blockspec:{name}", doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        yield one(GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches.",
                  m["running"])
        yield one(GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed.",
                  m["waiting"])
        usage = m["kv_bytes_in_use"] / m["kv_bytes_total"] if m["kv_bytes_total"] else 0.0
        yield one(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield one(CounterMetricFamily, "prompt_tokens", "Number of prefill tokens processed.", m["prompt_tokens"])
        yield one(CounterMetricFamily, "generation_tokens", "Number of generation tokens processed.",
                  m["generated_tokens"])
        success = CounterMetricFamily("blockspec:request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in m["finished_by_reason"].items():
            success.add_metric([self.model, reason], n)
        yield success
        if self.num_drafts:  # as vLLM: the speculative families exist only when speculating
            yield one(CounterMetricFamily, "spec_decode_num_drafts", "Number of spec decoding drafts.", m["drafts"])
            yield one(CounterMetricFamily, "spec_decode_num_draft_tokens", "Number of draft tokens.",
                      m["drafts_verified"])
            yield one(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      m["drafts_accepted"])
            per_pos = CounterMetricFamily("blockspec:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=["model_name", "position"])
            counts = m["accepted_per_position"]
            for pos in range(max([self.num_drafts, *(p + 1 for p in counts)])):
                per_pos.add_metric([self.model, str(pos)], counts.get(pos, 0))
            yield per_pos
            yield self.acceptance_length("blockspec:spec_decode_acceptance_length", m, {"model_name": self.model})
        for name, snap in m["latency"].items():
            family = HistogramMetricFamily(f"blockspec:{name}_seconds", LATENCY_DOCS[name], labels=["model_name"])
            family.add_metric(model, [(floatToGoString(le), n) for le, n in snap["buckets"]], snap["sum"])
            yield family


def metrics_registry(metrics: Callable[[], dict[str, Any]], requests: Counter, model_name: str,
                     num_drafts: int) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(metrics, requests, model_name, num_drafts))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
