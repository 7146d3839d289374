"""The OpenAI-compatible server, started for real (uvicorn on a loopback port) on tiny
random models: the official openai client, greedy equality with `generate`, stop
strings, 32 concurrent streams, the bounded queue, KV freed on disconnect, metrics,
the serve flags and a SIGTERM'd subprocess that exits 0."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from blockspec.config import SamplingParams
from blockspec.engine.engine import Engine
from blockspec.decoding.generate import generate
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import load_draft, load_target, save_draft
from blockspec.models.draft import DraftModel
from blockspec.models.tokenizer import Tokenizer
from blockspec.serving.api import create_app
from blockspec.serving.server import build_engine, resolve_speculation
from serving_harness import KEY, MODEL, ServerThread, dflash_engine, metric, serve_args, start, write_models

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(dirs):
    engine, tokenizer, _ = dflash_engine(*dirs)
    ctx, url = start(engine, tokenizer, max_tokens=64)
    yield url
    ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def reference(dirs):
    """Greedy text of plain AR `generate` (float64), the equality every method must meet."""
    target, tokenizer = load_target(dirs[0], dtype="float64"), Tokenizer(dirs[0])

    def run(text: str, max_tokens: int) -> tuple[str, int, str]:
        out = generate(target, [tokenizer.encode(text)], SamplingParams(max_new_tokens=max_tokens)).completions[0]
        return tokenizer.decode(out.tokens), len(out.tokens), out.finish_reason
    return run


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


# -- the official client ------------------------------------------------------------------------

def test_completions_greedy_equals_generate(client, reference):
    text, n, reason = reference("w1 w2 w3", 20)
    out = client.completions.create(model=MODEL, prompt="w1 w2 w3", max_tokens=20, temperature=0)
    assert out.choices[0].text == text and out.choices[0].finish_reason == reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, n, 3 + n)
    assert out.model == MODEL and out.object == "text_completion"

    chunks = list(client.completions.create(model=MODEL, prompt="w1 w2 w3", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_equals_generate(client, reference):
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w4 w5"}]
    text, n, reason = reference("w7 w8 w4 w5 ", 16)  # the tiny template joins contents with spaces
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    assert out.choices[0].message.content == text and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == reason and out.usage.completion_tokens == n
    assert out.object == "chat.completion"

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason and chunks[-1].object == "chat.completion.chunk"


def test_stop_strings_and_seeded_sampling(client, reference):
    text, _, _ = reference("w9 w3", 24)
    stop = text.split()[4]
    out = client.completions.create(model=MODEL, prompt="w9 w3", max_tokens=24, temperature=0, stop=[stop, "zzz"])
    assert out.choices[0].text == text[:text.find(stop)] and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="w9 w3", max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text



def test_seeded_sampling_repeats_with_fixed_windows(dirs):
    """A seed fixes every draw, so with fixed windows (--no-adapt) a seeded request repeats
    token for token. The adaptive default drafts by measured costs, which differ from run
    to run; the distribution stays exact but the draws land elsewhere (as OpenAI's and
    vLLM's seeds, best effort)."""
    engine, tokenizer, _ = dflash_engine(*dirs, no_adapt="")
    ctx, url = start(engine, tokenizer, max_tokens=64)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)

        def sample(seed: int) -> str:
            return client.completions.create(model=MODEL, prompt="w1", max_tokens=12, temperature=1.0, top_p=0.9,
                                             seed=seed, extra_body={"top_k": 20}).choices[0].text
        assert sample(7) == sample(7) and sample(7) != sample(8)
    finally:
        ctx.__exit__(None, None, None)


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as err:   # still unsupported: a 400 naming the field
        client.completions.create(model=MODEL, prompt="w1", max_tokens=4, suffix="w2")
    assert err.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}],
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="w1", max_tokens=4)
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert [m.id for m in client.models.list()] == [MODEL]


def test_32_concurrent_streams(server):
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"w{i} w{i + 1}"}], max_tokens=8 + i % 9,
            temperature=0.0 if i % 2 else 0.8, seed=i, stream=True)
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def main() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32 and all(reason in ("stop", "length") for _, reason in results)
    wait_for(lambda: kv_in_use(server) == 0)  # the engine retires a request just after its last delta


def test_metrics_health_and_auth(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # no key needed
    denied = httpx.get(f"{server}/metrics")
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "invalid_request_error"
    page = httpx.get(f"{server}/metrics", headers=AUTH).text
    for name in ("blockspec_requests_total", "blockspec_prompt_tokens_total", "blockspec_generation_tokens_total",
                 "blockspec_acceptance_length_bucket", "blockspec_num_requests_waiting",
                 "blockspec_kv_cache_bytes_total"):
        assert f"# TYPE {name.removesuffix('_bucket')} " in page
    assert 'blockspec_requests_total{endpoint="/metrics",status="401"}' in page
    assert metric(page, "blockspec_acceptance_length_count") > 0
    assert 'blockspec_acceptance_length_bucket{le="4"}' in page  # block 4 = 3 drafts + bonus


# -- queue bound and disconnects, on an engine whose steps the test releases -------------------------

class GatedEngine(Engine):
    """Runs one step per released permit (or freely once `free`): deterministic timing."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.permits = threading.Semaphore(0)
        self.free = False
        self.explode = False

    def step(self) -> bool:
        while not (self.free or self._stopping or self.permits.acquire(timeout=0.02)):
            pass
        if self.explode:
            raise RuntimeError("boom")
        return super().step()


@pytest.fixture
def gated(dirs):
    engine, tokenizer, _ = dflash_engine(*dirs, engine_cls=GatedEngine, max_running="1")
    ctx, url = start(engine, tokenizer, max_queue=1)
    yield engine, url
    engine.free = True
    ctx.__exit__(None, None, None)


def stream_request(http: httpx.Client, url: str, max_tokens: int = 60):
    body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": max_tokens, "stream": True, "temperature": 0}
    return http.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH)


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_full_queue_answers_429_then_recovers(gated):
    engine, url = gated
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b, \
            stream_request(a, url, 6) as first, stream_request(b, url, 6) as second:
        assert first.status_code == second.status_code == 200  # one slot + one queue place, no step yet
        busy = httpx.post(f"{url}/v1/completions", json={"prompt": "w1", "max_tokens": 2}, headers=AUTH)
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["message"]
        engine.free = True
        for r in (first, second):
            lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "w1", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200


def kv_in_use(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics", headers=AUTH).text, "blockspec_kv_cache_bytes_in_use")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_and_frees_kv(gated, stream):
    engine, url = gated
    body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 60, "stream": stream, "temperature": 0}
    sock = socket.create_connection((url.split("//")[1].split(":")[0], int(url.rsplit(":", 1)[1])))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    wait_for(lambda: engine.metrics()["waiting"] == 1)
    engine.permits.release()  # prefill + one round: the request now holds a KV slot
    wait_for(lambda: kv_in_use(url) > 0)
    if stream:
        assert b"data: {" in sock.recv(65536)  # tokens are flowing
    sock.close()
    wait_for(lambda: kv_in_use(url) == 0)
    m = engine.metrics()
    assert m["running"] == m["waiting"] == 0 and m["cancelled"] == 1 and m["generated_tokens"] < 60


def test_engine_failure_is_a_json_error(gated):
    engine, url = gated
    with httpx.Client(timeout=60) as http, stream_request(http, url) as r:
        engine.explode = True
        engine.permits.release()
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["type"] == "server_error"
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["error"]["message"]
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "w1", "max_tokens": 2}, headers=AUTH)
    assert refused.status_code == 503 and "Traceback" not in refused.text


def test_shutdown_cancels_what_does_not_drain(dirs):
    engine, tokenizer, _ = dflash_engine(*dirs, engine_cls=GatedEngine, max_running="1")
    ctx = ServerThread(create_app(engine, tokenizer, MODEL), drain_timeout=0.5)
    url = ctx.__enter__()
    with httpx.Client(timeout=60) as http, stream_request(http, url) as r:
        assert r.status_code == 200
        ctx.__exit__(None, None, None)  # the engine never steps: the drain times out
    assert not ctx.thread.is_alive()
    m = engine.metrics()
    assert m["cancelled"] == 1 and m["waiting"] == m["running"] == 0


# -- flags -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ['{"method": "dflash"', '{"method": "medusa"}', '[1]', '{"draft": "x"}',
                                   '{"num_speculative_tokens": 0}'])
def test_bad_speculative_config_exits_2(value, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_args("--speculative-config", value)
    assert exc.value.code == 2 and "--speculative-config" in capsys.readouterr().err


def test_speculation_aliases(dirs):
    target_dir, draft_dir = map(str, dirs)
    spec = resolve_speculation(serve_args("--speculative-algorithm", "dflash", "--speculative-draft-model-path",
                                          draft_dir, "--speculative-dflash-block-size", "3"))
    assert (spec.method, spec.draft, spec.block_size) == ("dflash", draft_dir, 3)
    assert resolve_speculation(serve_args("--draft", draft_dir)).method == "dflash"  # inferred from the draft
    assert resolve_speculation(serve_args()).method == "ar"
    for argv in (["--method", "dspark", "--speculative-algorithm", "DFLASH"],
                 ["--method", "dflash", "--speculative-dspark-block-size", "2"],
                 ["--draft", draft_dir, "--speculative-config", '{"model": "elsewhere"}'],
                 ["--method", "ar", "--draft", draft_dir]):
        with pytest.raises(BlockspecError):
            resolve_speculation(serve_args(*argv))
    config = json.dumps({"method": "dflash", "model": draft_dir, "num_speculative_tokens": 2})
    engine, _, name = build_engine(serve_args("--target", target_dir, "--speculative-config", config,
                                              "--max-model-len", "64", "--max-running", "2"))
    assert engine.draft.config.block_size == 3 and engine.draft.config.num_drafts == 2  # z-lab: N + 1
    assert (engine.method, engine.rows, engine.max_model_len, name) == ("dflash", 2, 64, target_dir)
    with pytest.raises(BlockspecError, match="speculative method"):
        build_engine(serve_args("--target", target_dir, "--cost-table", "t.json"))   # AR: nothing to price
    with pytest.raises(BlockspecError, match="scheduled"):
        build_engine(serve_args("--target", target_dir, "--draft", draft_dir, "--no-adapt", "--cost-table", "t.json"))
    with pytest.raises(BlockspecError, match="--draft-gate with --no-adapt needs --cost-table"):
        build_engine(serve_args("--target", target_dir, "--draft", draft_dir, "--draft-gate", "--no-adapt"))
    # The default is adaptive: the gate runs on this machine's measured (cached) table.
    engine, _, _ = build_engine(serve_args("--target", target_dir, "--draft", draft_dir, "--max-model-len", "64",
                                           "--max-running", "2"))
    assert engine.metrics()["draft_gate"]
    fixed, _, _ = build_engine(serve_args("--target", target_dir, "--draft", draft_dir, "--max-model-len", "64",
                                          "--max-running", "2", "--no-adapt"))
    assert not fixed.metrics()["draft_gate"]


def test_draft_gate_flag_gates_any_speculative_method(dirs, tmp_path):
    from blockspec.decoding.cost_table import ProfileOptions, profile_cost_table
    from blockspec.models.checkpoint import load_draft

    target_dir, draft_dir = map(str, dirs)
    target = load_target(target_dir)
    table = profile_cost_table(target, [1, 2, 4], ProfileOptions(repeats=1, rows=2, context=4, warmup=0),
                               draft=load_draft(draft_dir, target=target), draft_rows=[1, 2])
    table.save(tmp_path / "table.json")
    engine, _, _ = build_engine(serve_args("--target", target_dir, "--draft", draft_dir, "--draft-gate",
                                           "--cost-table", str(tmp_path / "table.json"), "--max-model-len", "64"))
    m = engine.metrics()
    assert (m["method"], m["draft_gate"], m["scheduled"]) == ("dflash", True, False)


# -- SIGTERM on a real `blockspec serve` process ------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_and_exits_0(dirs):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.serving.server", "--target", str(dirs[0]),
                             "--port", str(port), "--max-model-len", "128", "--served-model-name", MODEL,
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(lambda: _up(url, proc), timeout=240)
        lines: list[str] = []
        with httpx.Client(timeout=60) as http, \
                http.stream("POST", f"{url}/v1/completions", json={"prompt": "w1", "max_tokens": 100,
                                                                    "stream": True, "ignore_eos": True}) as r:
            stream = r.iter_lines()
            lines.append(next(stream))  # in flight when the signal arrives
            proc.send_signal(signal.SIGTERM)
            lines.extend(stream)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate()
    assert "Traceback" not in err
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"  # drained: the request finished
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def _up(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_sliding_window_draft_serves_greedy_equal_to_generate(dirs, reference, tmp_path):
    """Issue 34: a windowed draft saved to disk loads through `blockspec serve`'s flags and the
    server's greedy output equals AR (a window of 2, so the draft's ring wraps)."""
    full = load_draft(dirs[1])
    windowed = DraftModel(dataclasses.replace(full.config, layer_types=("sliding_attention",), sliding_window=2))
    windowed.load_state_dict(full.state_dict())
    save_draft(windowed, tmp_path / "windowed")
    engine, tokenizer, _ = dflash_engine(dirs[0], tmp_path / "windowed")
    assert engine.draft.config.sliding_window == 2
    ctx, url = start(engine, tokenizer, max_tokens=64)
    try:
        text, _, reason = reference("w1 w2 w3", 24)
        out = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                         json={"model": MODEL, "prompt": "w1 w2 w3", "max_tokens": 24, "temperature": 0}).json()
        assert out["choices"][0]["text"] == text and out["choices"][0]["finish_reason"] == reason
    finally:
        ctx.__exit__(None, None, None)
