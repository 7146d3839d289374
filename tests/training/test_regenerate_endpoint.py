"""`blockspec regenerate --endpoint` against a real `blockspec serve` on loopback (tiny random
models): every row is written with the target's own answers, a re-run skips finished rows (also
after a run killed mid-line), rows the server rejects are reported (summary, sidecar, exit 2),
never lost; retries with backoff on 5xx; the written rows train."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))

from blockspec.cli import main  # noqa: E402
from blockspec.errors import BlockspecError  # noqa: E402
from blockspec.models.tokenizer import Tokenizer  # noqa: E402
from blockspec.training.data import load_examples  # noqa: E402
from blockspec.training.regenerate import Client, EndpointConfig, RowError, requests_for  # noqa: E402
from serving_harness import KEY, MODEL, dflash_engine, start, write_models  # noqa: E402

ROWS = [
    {"id": "multi", "messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"},
                                 {"role": "user", "content": "w4 w5"}, {"role": "assistant", "content": "w6"}]},
    {"conversations": [{"from": "human", "value": "w7 w8"}, {"from": "gpt", "value": "w9"}]},
    {"prompt": "w10 w11 w12"},
    {"messages": [{"role": "user", "content": " ".join(f"w{i % 50}" for i in range(300))}]},   # > max-model-len
    {"conversations": [{"from": "alien", "value": "w1"}]},                                     # unusable row
    {"messages": [{"role": "system", "content": "w13"}, {"role": "user", "content": "w14"}]},
    {"prompt": "w15 w16"},
]
GOOD, REJECTED, BAD = [0, 1, 2, 5, 6], 3, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    dirs = write_models(tmp_path_factory.mktemp("models"))
    engine, tokenizer, _ = dflash_engine(*dirs)
    ctx, url = start(engine, tokenizer)
    yield url, dirs[0]
    ctx.__exit__(None, None, None)


def run(url: str, src: Path, out: Path, *extra: str) -> int:
    return main(["regenerate", "--endpoint", url, "--api-key", KEY, "--prompts", str(src), "--out", str(out),
                 "--concurrency", "3", "--max-new-tokens", "6", "--retries", "1", *extra])


def rows_of(out: Path) -> dict[int, dict]:
    return {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}


def answer(url: str, messages: list[dict]) -> str:
    body = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}).json()
    return body["choices"][0]["message"]["content"]


def test_every_row_written_rejected_rows_reported_and_rerun_skips(server, tmp_path, capsys):
    url, target_dir = server
    src, out = tmp_path / "sharegpt.jsonl", tmp_path / "regen.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert run(url, src, out) == 2
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary | {"failed_rows": None} == {"rows": 7, "written": 5, "skipped": 0, "failed": 2, "failed_rows": None,
                                               "failed_file": f"{out}.failed.jsonl", "out": str(out)}
    assert summary["failed_rows"] == [REJECTED, BAD]
    failed = {r["row"]: r["error"] for r in map(json.loads, Path(summary["failed_file"]).read_text().splitlines())}
    assert failed[REJECTED].startswith("HTTP 400") and "alien" in failed[BAD]
    written = rows_of(out)
    assert sorted(written) == GOOD
    # Every turn answered in order by the target, with the target's own history.
    multi = written[0]["messages"]
    assert [m["role"] for m in multi] == ["user", "assistant", "user", "assistant"]
    assert multi[1]["content"] == answer(url, multi[:1]) and multi[3]["content"] == answer(url, multi[:3])
    assert multi[1]["content"] != "w3" and written[0]["id"] == "multi" and len(written[0]["finish_reasons"]) == 2
    assert written[2]["messages"][1]["content"] == answer(url, [{"role": "user", "content": "w10 w11 w12"}])
    assert [m["role"] for m in written[5]["messages"]] == ["system", "user", "assistant"]

    # A re-run writes nothing new and reports the same failures; a run killed mid-line resumes.
    assert run(url, src, out) == 2
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (again["written"], again["skipped"], again["failed_rows"]) == (0, 5, [REJECTED, BAD])
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][:10])
    assert run(url, src, out) == 2
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (resumed["written"], resumed["skipped"]) == (1, 4) and rows_of(out) == written

    # Once the rejected rows are fixed, nothing is failed and the sidecar goes.
    fixed = [r for i, r in enumerate(ROWS) if i not in (REJECTED, BAD)]
    src2, out2 = tmp_path / "fixed.jsonl", tmp_path / "fixed-out.jsonl"
    src2.write_text("".join(json.dumps(r) + "\n" for r in fixed))
    assert run(url, src2, out2, "--turns", "last") == 0
    last = rows_of(out2)[0]["messages"]   # the dataset's first answer kept as context, untrained
    assert last[:3] == [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3", "train": False},
                        {"role": "user", "content": "w4 w5"}]
    assert last[3] == {"role": "assistant", "content": answer(url, [last[0], {"role": "assistant", "content": "w3"},
                                                                     last[2]])}
    assert not Path(f"{out2}.failed.jsonl").exists()
    # A changed input is refused, not mixed into the old output.
    src2.write_text(json.dumps({"prompt": "w40"}) + "\n")
    assert run(url, src2, out2) == 2
    assert "was written from a different input" in capsys.readouterr().err

    # The regenerated rows train: loss on the target's answers, nothing else.
    tok = Tokenizer(target_dir)
    examples = load_examples(out, 128, tok, {tok.eos_token_id})
    in_file = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(examples) == len(in_file) == 5
    for e, row in zip(examples, in_file):
        answers = " ".join(m["content"] for m in row["messages"] if m["role"] == "assistant")
        assert tok.decode([t for t, m in zip(e.ids, e.loss_mask) if m]).split() == answers.split()


def test_wrong_key_fails_every_row_clearly(server, tmp_path, capsys):
    url, _ = server
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    src.write_text(json.dumps({"prompt": "w1"}) + "\n")
    assert main(["regenerate", "--endpoint", url, "--api-key", "wrong", "--model", MODEL, "--prompts", str(src),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "1 of 1 rows failed" in err
    assert "HTTP 401" in Path(f"{out}.failed.jsonl").read_text()


def test_retries_with_backoff_then_reports():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) <= 2:
            return httpx.Response(503, json={"error": {"message": "warming up"}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok", "reasoning_content": "hm"},
                                                      "finish_reason": "stop"}]})

    cfg = EndpointConfig(endpoint="http://x/v1", retries=2, backoff_s=0.01)
    client = Client(cfg, transport=httpx.MockTransport(handler))
    got = asyncio.run(client.answer("m", [{"role": "user", "content": "hi"}], 0))
    assert got == ({"role": "assistant", "content": "ok", "reasoning_content": "hm"}, "stop") and len(calls) == 3
    calls.clear()
    client = Client(EndpointConfig(endpoint="http://x", retries=1, backoff_s=0.01), transport=httpx.MockTransport(handler))
    with pytest.raises(RowError, match=r"HTTP 503: warming up \(after 2 attempts\)"):
        asyncio.run(client.answer("m", [{"role": "user", "content": "hi"}], 0))
    with pytest.raises(BlockspecError, match="--turns"):
        EndpointConfig(endpoint="http://x", turns="some").validate()


def test_which_turns_are_answered():
    u, a, s = ({"role": r} for r in ("user", "assistant", "system"))
    assert requests_for([s, u, a, u, a]) == [2, 4]
    assert requests_for([u, a, u]) == [1, 3]
    assert requests_for([a, u, a, a]) == [2]          # a leading / repeated answer has no prompt of its own


def test_readme_recipe_extra_body_reaches_the_template(server, tmp_path):
    """The README's Qwen3 recipe: --extra-body chat_template_kwargs (thinking off) is honoured by our server."""
    url, _ = server
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join(json.dumps(ROWS[i]) for i in (0, 2)) + "\n")
    out = tmp_path / "out.jsonl"
    assert run(url, src, out, "--extra-body", '{"chat_template_kwargs": {"enable_thinking": false}}') == 0
    assert len(rows_of(out)) == 2
