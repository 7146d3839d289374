"""Hostile input against the real server: hundreds of malformed requests (bad JSON,
wrong types, huge / negative numbers, unknown fields, invalid UTF-8, oversize and
deeply nested bodies, bad keys, content types, methods, paths) each get a 4xx
OpenAI-style JSON error, never a 5xx; then the server still serves normally."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving_harness import KEY, MODEL, dflash_engine, start, write_models

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
LIMIT = 64 * 1024
COMPLETION = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
HUGE = 10**40

# field -> values each of which must be refused, on both endpoints
BAD_COMMON: dict[str, list[Any]] = {
    "max_tokens": [-1, "2", 2.5, HUGE, -HUGE, True, [], {}, 9, 10**6],
    "temperature": [-0.1, -1e300, "0.5", True, [], {"t": 1}],
    "top_p": [0, -0.5, 1.5, 1e300, "1", True, [1]],
    "top_k": [-2, -HUGE, 1.5, "3", True, {}],
    "seed": [2**64, -2**63 - 1, HUGE, 1.5, "1", True],
    "n": [0, 129, HUGE, "1", True, 1.0, -1],
    "stop": [1, [1], [None], ["a"] * 17, "x" * 2000, {"a": 1}, [["a"]]],
    "stream": ["true", 1, [], {}],
    "stream_options": [{"include_usage": "yes"}, {"bogus": True}, [], "x", {"include_usage": True}],
    "presence_penalty": [2.5, -2.01, "0", HUGE],
    "frequency_penalty": [3, "0", [0]],
    "repetition_penalty": [0, -1, 101, "1"],
    "min_p": [-0.1, 1.5, "0"],
    "logit_bias": [{"1": 101}, {"x": 1}, {"-1": 1}, {"100000": 1}, {"1": "x"}, [], "x"],
    "model": [1, "gpt-4", ["tiny"], {}, ""],
    "user": [1, {}, []],
    "ignore_eos": ["yes", 1, None],
    "stop_token_ids": ["1", [1.5], 1, [True], [None]],
}
BAD_COMPLETION = {
    "prompt": [None, 1, [], [-1], [HUGE], [10**6], [1.5], [[1], []], ["w1", "w1 " * 200], "w1 " * 200, {"a": 1},
               "", [True], [["w1"]], ["w1"] * 129],
    "echo": ["x", 1], "best_of": [2, 0, True], "suffix": ["x", 1], "logprobs": [True, "x", -1, 21, 1.5],
}
BAD_CHAT = {
    "messages": [[], [{}], [{"role": "user"}], [{"role": "tool", "content": "x"}], [{"role": "user", "content": 1}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], "hi",
                 [{"role": "user", "content": "x", "extra": 1}], None, [{"role": "user", "content": "w1 " * 200}],
                 [{"role": 5, "content": "x"}], [{"role": "user", "content": None}]],
    "max_completion_tokens": [-1, "5", 10**9, 9],
    "tools": [[{"type": "function", "function": {"name": "f"}}]], "top_logprobs": [3],
    "logprobs": [1, "x"], "chat_template_kwargs": [{"messages": []}, "x", [1]],
    "continue_final_message": [1], "add_generation_prompt": ["yes"],
    "tool_choice": ["required"], "response_format": [{"type": "json_object"}], "functions": [[{"name": "f"}]],
    "metadata": [{"a": 1}, "x"], "parallel_tool_calls": ["yes"],
}
UNKNOWN_FIELDS = ["foo", "Prompt", "max_token", "temperature ", "__proto__", "", "prompt\u0000", "bést",
                  "top_a", "min_tokens"]
BAD_JSON = [b"", b"{", b"}", b"{]", b'{"prompt": "w1",}', b"{'prompt': 'w1'}", b'{"prompt": w1}', b"null", b"[]",
            b"123", b'"str"', b"true", b'{"prompt": NaN}', b'{"prompt": "w1", "max_tokens": Infinity}',
            b'{"prompt": "w1", "temperature": -Infinity}', b'{"prompt" "w1"}', b'{"prompt": "w1"} {}',
            b'{"prompt": "\\ud800"}', b'{"prompt": "\\x"}', b"\x00\x00\x00", b"{\"prompt\": \"w1\"" + b" " * 1000]
INVALID_UTF8 = [b'{"prompt": "\xff\xfe"}', b"\xff", b'{"prompt": "w1 \xc3"}', b'{"model": "\xed\xa0\x80"}',
                '{"prompt": "w1"}'.encode("utf-16"), b'\xef\xbb\xbf{"prompt": "w1", "max_tokens": "\x80"}']


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine, tokenizer, _ = dflash_engine(*write_models(tmp_path_factory.mktemp("models")), max_running="4")
    ctx, url = start(engine, tokenizer, max_body_bytes=LIMIT, max_tokens=8)
    yield url
    ctx.__exit__(None, None, None)


def hostile_requests() -> Iterator[tuple[str, str, dict[str, str], Any]]:
    """(method, path, headers, body) cases that must all be refused with a 4xx."""
    endpoints = (("/v1/completions", COMPLETION, BAD_COMPLETION), ("/v1/chat/completions", CHAT, BAD_CHAT))
    for path, base, extra in endpoints:
        for field, values in {**BAD_COMMON, **extra}.items():
            for value in values:
                yield "POST", path, AUTH, json.dumps({**base, field: value}).encode()
        for field in UNKNOWN_FIELDS:
            yield "POST", path, AUTH, json.dumps({**base, field: 1}).encode()
        for body in BAD_JSON + INVALID_UTF8:
            yield "POST", path, AUTH, body
        for depth in (100, 5000, 100_000 // 2):
            yield "POST", path, AUTH, nested(depth)
            yield "POST", path, AUTH, json.dumps(base).encode()[:-1] + b', "logit_bias": ' + nested(depth) + b"}"
        for size in (LIMIT + 1, 3 * LIMIT, 16 * LIMIT):  # oversize: declared, and chunked without a length
            yield "POST", path, AUTH, json.dumps({**base, "user": "x" * size}).encode()
            yield "POST", path, AUTH, iter([b'{"user": "', b"x" * size, b'"}'])
        for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                      "application/jsonx", "json"):
            headers = {"Authorization": AUTH["Authorization"]} | ({"Content-Type": ctype} if ctype else {})
            yield "POST", path, headers, json.dumps(base).encode()
        for auth in (None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", f"Bearer {KEY.upper()}",
                     f"{KEY}", "Bearer \u00e9t\u00e9".encode("latin-1")):
            headers = {"Content-Type": "application/json"} | ({"Authorization": auth} if auth else {})
            yield "POST", path, headers, json.dumps(base).encode()
        for method in ("GET", "PUT", "DELETE", "PATCH"):
            yield method, path, AUTH, json.dumps(base).encode()
    for path in ("/v1/completions/", "/v1/unknown", "/v1", "/", "/v1/../etc/passwd", "/v1/models/x", "/docs",
                 "/openapi.json", "/v2/chat/completions", "/%ff"):
        yield "GET", path, AUTH, None
    for path in ("/v1/models", "/metrics"):
        yield "GET", path, {}, None


def check_refused(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error" and "param" in error and error["code"] is None


def test_hostile_requests_get_4xx_json_and_server_survives(server):
    cases = list(hostile_requests())
    assert len(cases) >= 200
    with httpx.Client(base_url=server, timeout=60) as http:
        for method, path, headers, body in cases:
            check_refused(http.request(method, path, headers=headers, content=body))
        ok = http.post("/v1/completions", headers=AUTH, json=COMPLETION)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
        page = http.get("/metrics", headers=AUTH).text
    assert 'status="5' not in page and 'endpoint="/v1/completions",status="200"} 1' in page


@pytest.mark.parametrize("field,value,status", [
    ("unknown_field", 1, 400), ("n", 300, 400), ("logprobs", 30, 400), ("max_tokens", 9, 400), ("top_p", 0, 400),
    ("temperature", -1, 400), ("seed", 2**64, 400), ("stop", ["a"] * 17, 400), ("model", "gpt-4", 404),
    ("prompt", [HUGE], 400), ("prompt", "w1 " * 200, 400), ("stream_options", {"include_usage": True}, 400)])
def test_errors_name_the_field(server, field, value, status):
    response = httpx.post(f"{server}/v1/completions", headers=AUTH, json={**COMPLETION, field: value})
    assert response.status_code == status and response.json()["error"]["param"] == field


def test_auth_errors_are_401_and_health_is_open(server):
    response = httpx.post(f"{server}/v1/completions", json=COMPLETION)
    assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{server}/health").status_code == 200


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                      max_size=3), max_leaves=6)
FIELDS = sorted({*BAD_COMMON, *BAD_COMPLETION, *BAD_CHAT})


@settings(max_examples=80, deadline=None, database=None)  # database=None: no .hypothesis/ in the repo
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       changes=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=3))
def test_random_fields_never_5xx(server, path, changes):
    base = COMPLETION if path == "/v1/completions" else CHAT
    response = httpx.post(f"{server}{path}", headers=AUTH, content=json.dumps({**base, **changes}), timeout=60)
    if response.status_code == 200:
        body = response.json() if not changes.get("stream") is True else None
        assert body is None or body["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        check_refused(response)
