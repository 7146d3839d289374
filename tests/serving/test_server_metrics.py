"""/metrics through prometheus_client: the existing blockspec_* names and vLLM's names
(with the blockspec: prefix) for speculative decoding and request latency, agreeing
with the engine's own statistics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving_harness import KEY, MODEL, dflash_engine, start, write_models

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    dirs = write_models(tmp_path_factory.mktemp("models"))
    engine, tokenizer, _ = dflash_engine(*dirs)
    ctx, url = start(engine, tokenizer)
    try:
        for i, stream in enumerate([False, True, False, True]):
            body = {"model": MODEL, "prompt": f"w{i + 1} w2 w3", "max_tokens": 12, "ignore_eos": True,
                    "temperature": 0, "stream": stream}
            r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200
        page = httpx.get(f"{url}/metrics", headers=AUTH).text
        yield page, engine.metrics()
    finally:
        ctx.__exit__(None, None, None)


def samples(page: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a parsed exposition page (also checks it parses)."""
    out = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_vllm_style_speculative_counters_agree_with_the_engine(scraped):
    page, m = scraped
    got = samples(page)
    model = (("model_name", MODEL),)
    assert got[("blockspec:spec_decode_num_drafts_total", model)] == m["drafts"] > 0
    assert got[("blockspec:spec_decode_num_draft_tokens_total", model)] == m["drafts_verified"]
    assert got[("blockspec:spec_decode_num_accepted_tokens_total", model)] == m["drafts_accepted"]
    per_pos = {dict(labels)["position"]: v for (name, labels), v in got.items()
               if name == "blockspec:spec_decode_num_accepted_tokens_per_pos_total"}
    assert sorted(per_pos) == ["0", "1", "2"]   # block 4 (z-lab) = 3 drafts
    assert sum(per_pos.values()) == m["drafts_accepted"]
    assert per_pos["0"] >= per_pos["1"] >= per_pos["2"]   # drafts are accepted as a prefix
    assert got[("blockspec:spec_decode_acceptance_length_count", model)] == m["drafts"]
    assert got[("blockspec:generation_tokens_total", model)] == m["generated_tokens"] == 48
    assert got[("blockspec:request_success_total", (("finished_reason", "length"), *model))] == 4


def test_latency_histograms(scraped):
    page, m = scraped
    got = samples(page)
    model = (("model_name", MODEL),)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert got[(f"blockspec:{name}_seconds_count", model)] == 4
        assert got[(f"blockspec:{name}_seconds_bucket", (("le", "+Inf"), *model))] == 4
    # One inter-token sample per token after each request's first (4 requests).
    itl = got[("blockspec:inter_token_latency_seconds_count", model)]
    assert itl == m["generated_tokens"] - 4
    assert got[("blockspec:e2e_request_latency_seconds_sum", model)] >= \
        got[("blockspec:time_to_first_token_seconds_sum", model)] > 0
    assert ("blockspec:time_to_first_token_seconds_bucket", (("le", "0.001"), *model)) in got   # vLLM's buckets


def test_existing_names_kept(scraped):
    page, m = scraped
    got = samples(page)
    assert got[("blockspec_generation_tokens_total", ())] == m["generated_tokens"]
    assert got[("blockspec_engine_requests_total", (("outcome", "finished"),))] == 4
    assert got[("blockspec_acceptance_length_count", ())] == m["drafts"]
    assert ("blockspec_acceptance_length_bucket", (("le", "4"),)) in got
    assert got[("blockspec_kv_slots", ())] == m["slots"]
