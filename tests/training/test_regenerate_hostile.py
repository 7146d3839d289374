"""`regenerate --endpoint` against a hostile or broken server and hostile input: a whole-request
deadline, response shapes checked (a bad answer is the row's failure, never a written row),
non-UTF-8 and deeply nested input refused with its line number."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from blockspec.cli import main
from blockspec.training.regenerate import Client, EndpointConfig, RowError, read_rows

CHAT = [{"role": "user", "content": "hi"}]


def client_for(handler, **kw) -> Client:
    return Client(EndpointConfig(endpoint="http://x", retries=0, backoff_s=0.01, **kw),
                  transport=httpx.MockTransport(handler))


class Trickle(httpx.AsyncByteStream):
    """A body sent one byte a second, forever: every single read is quick."""

    async def __aiter__(self):
        while True:
            yield b" "
            await asyncio.sleep(0.2)


def test_a_trickling_server_is_cut_off_at_the_whole_request_deadline():
    client = client_for(lambda request: httpx.Response(200, stream=Trickle()), timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RowError, match=r"no complete response in 1 s"):
        asyncio.run(asyncio.wait_for(client.answer("m", CHAT, 0), 20))
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("message", [
    "a string", {"content": {"a": 1}}, {"content": "ok", "tool_calls": "rm -rf"},
    {"content": "ok", "tool_calls": [1]}, {"content": "ok", "reasoning_content": ["x"]}, None,
])
def test_a_malformed_answer_is_the_rows_failure(message):
    client = client_for(lambda request: httpx.Response(200, json={"choices": [{"message": message,
                                                                               "finish_reason": "stop"}]}))
    with pytest.raises(RowError, match="the response has"):
        asyncio.run(client.answer("m", CHAT, 0))


@pytest.mark.parametrize("body", [[{"choices": []}], "text", {"choices": "x"}, {"choices": [{"message": {
    "content": "ok"}, "finish_reason": 3}]}])
def test_a_response_that_is_no_chat_completion_is_the_rows_failure(body):
    client = client_for(lambda request: httpx.Response(200, json=body))
    with pytest.raises(RowError, match="response|not an object"):
        asyncio.run(client.answer("m", CHAT, 0))


@pytest.mark.parametrize("body", [[{"id": "m"}], {"data": "m"}, {"data": {"id": "m"}}])
def test_a_malformed_model_list_is_an_error_not_a_traceback(body):
    client = client_for(lambda request: httpx.Response(200, json=body))
    with pytest.raises(RowError):
        asyncio.run(client.model())


def test_non_utf8_input_is_refused_with_its_line(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_bytes(b'{"prompt": "w1"}\n{"prompt": "\xff\xfe"}\n')
    assert main(["regenerate", "--endpoint", "http://127.0.0.1:9", "--prompts", str(src),
                 "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: regenerate:") and f"{src}:2 is not UTF-8" in err and err.count("\n") == 1


def test_deeply_nested_json_is_a_failed_row_naming_its_line(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "w1"}) + "\n\n" + "[" * 100_000 + "\n")
    rows = read_rows(src)
    assert rows[0].error is None and rows[1].messages is None
    assert rows[1].error == f"{src}:3 (row 1): JSON nested too deeply"
    src.write_text("[" * 100_000)
    with pytest.raises(Exception, match="not a valid JSON array"):
        read_rows(src)
