"""Graceful shutdown of a real `run_server` process: on SIGTERM / SIGINT new requests get
503, requests still running after --drain-timeout end in-band (an error event and
`data: [DONE]` for streams, a 503 JSON body otherwise) before the listener closes, the
process exits 0 and logs no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from serving_harness import write_models
from test_api import _up, free_port, wait_for

SCRIPT = Path(__file__).with_name("slow_server.py")
STREAMS = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("models"))[0]


def start(target_dir: Path, drain: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(target_dir), str(port), str(drain)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _up(url, proc), timeout=240)
    return proc, url


BODY = {"prompt": "w1 w2", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_long_streams_end_in_band_when_the_drain_times_out(target_dir, sig):
    proc, url = start(target_dir, drain=1.0)
    events: list[list[str]] = [[] for _ in range(STREAMS)]
    plain: list[httpx.Response] = []
    try:
        with httpx.Client(timeout=120) as http:
            streams = [http.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True})
                       for _ in range(STREAMS)]
            responses = [s.__enter__() for s in streams]
            lines = [r.iter_lines() for r in responses]
            for i, it in enumerate(lines):
                events[i].append(next(it))   # every stream is running: 100 tokens take ~10 s
            blocking = threading.Thread(target=lambda: plain.append(
                httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)))
            blocking.start()
            wait_for(lambda: _running(url) == STREAMS + 1)
            proc.send_signal(sig)
            # Draining: not admitting, yet still answering on the open listener.
            wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, timeout=10)
            refused = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            for i, it in enumerate(lines):
                events[i].extend(it)           # ends without httpx.RemoteProtocolError: not cut
            for s in streams:
                s.__exit__(None, None, None)
            blocking.join(60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate()
    assert "Traceback" not in err and "Cancel" not in err, err[-3000:]
    assert "ending them with 503" in err
    for stream in events:
        data = [line for line in stream if line]
        assert data[-1] == "data: [DONE]"
        error = json.loads(data[-2][6:])["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"]
        assert any('"text"' in line for line in data[:-2])   # tokens had been streamed
    assert plain[0].status_code == 503 and "shutting down" in plain[0].json()["error"]["message"]


def _running(url: str) -> float:
    page = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(("blockspec_num_requests_running ", "blockspec_num_requests_waiting ")))


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_without_a_traceback(target_dir):
    """SIGINT twice: the drain is skipped, the app's own shutdown still runs (it was cancelled
    mid-wait, printing a CancelledError traceback), and the process exits 0."""
    proc, url = start(target_dir, drain=30.0)
    try:
        with httpx.Client(timeout=120) as http:
            streams = [http.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True})
                       for _ in range(2)]
            lines = [s.__enter__().iter_lines() for s in streams]
            for it in lines:
                next(it)
            proc.send_signal(signal.SIGINT)
            wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, timeout=10)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate()
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
