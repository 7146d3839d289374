"""Hostile clients against the real server (uvicorn on loopback): a looping or giant chat
template is a 400 naming it while other requests are answered; trickled or never-sent bodies
get 408 and are closed; shutdown never waits on them or on a stuck render; request heads
over 16 KiB are refused however they arrive."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest

from serving_harness import KEY, MODEL, ServerThread, dflash_engine, write_models
from blockspec.models import template_sandbox
from blockspec.serving.api import create_app

AUTH = {"Authorization": f"Bearer {KEY}"}
# Renders normally, except for the two hostile contents: a loop that never ends, 1 GB of output.
TEMPLATE = ("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% endfor %}{% endfor %}{% elif messages[0].content == 'big' %}{{ 'x' * 10**9 }}"
            "{% else %}{% for m in messages %}{{ m.content }} {% endfor %}{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    (root / "template.jinja").write_text(TEMPLATE)
    return (*write_models(root), root / "template.jinja")


def app_for(models):
    target_dir, draft_dir, template = models
    engine, tokenizer, _ = dflash_engine(target_dir, draft_dir, chat_template=str(template))
    return create_app(engine, tokenizer, MODEL, api_key=KEY)


@pytest.fixture(scope="module")
def served(models):
    with ServerThread(app_for(models), body_timeout=1.0) as url:
        yield url


def chat(url: str, content: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=timeout,
                      json={"messages": [{"role": "user", "content": content}], "max_tokens": 2})


@pytest.mark.slow
def test_hostile_templates_are_400s_naming_the_template_while_others_are_answered(served, models, monkeypatch):
    monkeypatch.setattr(template_sandbox, "RENDER_TIMEOUT_S", 1.5)
    url = served
    assert chat(url, "w1 w2").status_code == 200   # warm: a worker has started
    answers: dict[str, httpx.Response] = {}
    hostile = [threading.Thread(target=lambda c=c: answers.__setitem__(c, chat(url, c))) for c in ("loop", "big")]
    for t in hostile:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    health = httpx.get(f"{url}/health", timeout=10)
    plain = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "w1 w2", "max_tokens": 2}, timeout=10)
    cotenant = time.monotonic() - t0
    for t in hostile:
        t.join(60)
    assert health.status_code == 200 and plain.status_code == 200 and cotenant < 1.0
    for content in ("loop", "big"):
        error = answers[content].json()["error"]
        assert answers[content].status_code == 400 and error["param"] == "messages", answers[content].text
        assert "chat template failed" in error["message"] and str(models[2]) in error["message"]
    assert "took longer than 1.5 s" in answers["loop"].json()["error"]["message"]
    assert chat(url, "w1").status_code == 200   # the server renders on


def _connect(url: str) -> socket.socket:
    host, port = url.split("//")[1].split(":")
    return socket.create_connection((host, int(port)))


def _head(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % length)


def _answer(sock: socket.socket, seconds: float) -> bytes:
    """Everything the server sends until it closes (b'' if it only closes); raises on timeout."""
    sock.settimeout(seconds)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_trickled_and_missing_bodies_get_408_and_are_closed(served):
    never = _connect(served)
    never.sendall(_head(100))
    trickle = _connect(served)
    trickle.sendall(_head(100))
    t0 = time.monotonic()
    try:
        for _ in range(10):   # one byte every 0.3 s: far under 16 KiB/s
            trickle.sendall(b" ")
            time.sleep(0.3)
    except OSError:   # closed by the server
        pass
    assert _answer(trickle, 5).startswith(b"HTTP/1.1 408")
    assert _answer(never, 5).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - t0 < 5   # body_timeout 1 s


def test_a_request_head_over_16_kib_in_one_write_is_refused(served):
    """h11 refuses an incomplete head over 16 KiB; a complete one in one write was accepted."""
    sock = _connect(served)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    assert _answer(sock, 5).startswith(b"HTTP/1.1 400")
    ok = _connect(served)   # a head under the limit is served
    ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: " + b"a" * 15_000 + b"\r\n\r\n")
    assert _answer(ok, 5).startswith(b"HTTP/1.1 200")


@pytest.mark.slow
def test_shutdown_with_stalled_bodies_and_a_stuck_render_is_prompt_and_quiet(models, monkeypatch, caplog):
    monkeypatch.setattr(template_sandbox, "RENDER_TIMEOUT_S", 120.0)
    server = ServerThread(app_for(models), drain_timeout=2.0, body_timeout=60.0)
    url = server.__enter__()
    stalled = []
    for _ in range(20):
        sock = _connect(url)
        sock.sendall(_head(1000) + b'{"prompt": ')
        stalled.append(sock)
    stuck = threading.Thread(target=chat, args=(url, "loop"), daemon=True)
    stuck.start()
    time.sleep(1.0)
    caplog.set_level(logging.ERROR)
    t0 = time.monotonic()
    server.__exit__(None, None, None)
    took = time.monotonic() - t0
    assert not server.thread.is_alive() and took < 2.0 + 3.0, took   # the drain timeout + a few seconds
    assert all(_answer(s, 5) == b"" for s in stalled)   # closed: those requests were never admitted
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
