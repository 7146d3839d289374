"""Regeneration through any OpenAI-compatible server (vLLM, SGLang, `blockspec serve`): the
target answers each conversation's user turns itself, so the draft learns the target's own
distribution (the in-process path for the embedded model is data.regenerate).

Turns (`--turns`):
- all (default, as SpecForge's regenerate_train_data.py): the conversation is replayed turn by
  turn; the dataset's assistant answers are dropped and each is replaced, in order, by the
  target's answer to the conversation so far (its own earlier answers included), so every
  assistant turn written is the target's and every one is trained on.
- last: one request per row: the dataset's context up to its last user turn, answered by the
  target; the dataset's earlier answers stay as context, marked "train": false (not trained on).

Rows are written as they finish ({"row", "key", "messages", "finish_reasons"}, JSON lines), so a
run can be killed at any point: re-running skips every row already in the output (keyed by row
index and a hash of the input line; a changed input is an error, never a silent mix). A request
is retried with exponential backoff on connection errors, timeouts, 429 and 5xx (Retry-After
honoured); a row that still fails, or that the server rejects (4xx: e.g. a prompt over the
server's context length), is listed with its error in `<out>.failed.jsonl` and in the summary,
and the next run tries it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from blockspec.errors import BlockspecError
from blockspec.training.conversations import chat_messages

TURNS = ("all", "last")
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclass
class EndpointConfig:
    endpoint: str                        # http://host:port (with or without /v1)
    api_key: str | None = None
    model: str | None = None             # None: the server's only model (GET /v1/models)
    concurrency: int = 16
    max_tokens: int = 256                # per answer
    temperature: float = 0.0
    seed: int = 0                        # request seed = seed + row index (servers that honour it)
    turns: str = "all"
    retries: int = 3                     # extra attempts after the first
    backoff_s: float = 1.0               # first retry delay, doubled each time (capped at 30 s)
    timeout_s: float = 600.0
    limit: int | None = None             # the first `limit` rows only
    extra_body: dict[str, Any] = field(default_factory=dict)   # e.g. {"chat_template_kwargs": {...}}

    def validate(self) -> None:
        if not self.endpoint.startswith(("http://", "https://")):
            raise BlockspecError(f"regenerate: --endpoint must be an http(s) URL, got {self.endpoint!r}")
        if self.turns not in TURNS:
            raise BlockspecError(f"regenerate: --turns must be one of {TURNS}, got {self.turns!r}")
        if self.concurrency <= 0 or self.max_tokens <= 0 or self.retries < 0 or self.timeout_s <= 0:
            raise BlockspecError("regenerate: --concurrency and --max-new-tokens must be > 0, --retries >= 0")

    @property
    def base(self) -> str:
        url = self.endpoint.rstrip("/")
        for suffix in ("/chat/completions", "/v1"):
            url = url.removesuffix(suffix)
        return url


class RowError(Exception):
    """A row that cannot be regenerated (after any retries), with the reason to report."""


@dataclass
class Row:
    index: int
    key: str
    id: Any
    messages: list[dict[str, Any]] | None
    error: str | None = None           # the input row itself is unusable


def read_rows(path: Path, limit: int | None = None) -> list[Row]:
    """The input rows: JSON lines (or one JSON array, as ShareGPT V3's .json files) of
    `messages` / ShareGPT `conversations` / `prompt` / `text` objects. A row that cannot be
    used carries its error (reported as failed; the others still run)."""
    if not path.is_file():
        raise BlockspecError(f"regenerate: {path} does not exist")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise BlockspecError(f"regenerate: {path}:{line} is not UTF-8 text (byte {exc.start})") from None
    if text.lstrip().startswith("["):
        try:
            lines = [(n, json.dumps(r)) for n, r in enumerate(json.loads(text), 1)]
        except (json.JSONDecodeError, RecursionError) as exc:
            raise BlockspecError(f"regenerate: {path} is not a valid JSON array ({type(exc).__name__}: {exc})") from None
    else:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for index, (n, line) in enumerate(lines[:limit] if limit else lines):
        key = hashlib.sha256(line.strip().encode()).hexdigest()[:16]
        where = f"{path}:{n} (row {index})"
        try:
            raw = json.loads(line)
            messages = chat_messages(raw, where)
            if messages is None:
                prompt = raw.get("prompt", raw.get("text"))
                if not isinstance(prompt, str) or not prompt:
                    raise BlockspecError(f"{where}: needs 'messages', 'conversations' or a string 'prompt' / 'text'")
                messages = [{"role": "user", "content": prompt}]
            rows.append(Row(index, key, raw.get("id"), messages))
        except json.JSONDecodeError as exc:
            rows.append(Row(index, key, None, None, f"{where}: not valid JSON ({exc})"))
        except RecursionError:
            rows.append(Row(index, key, None, None, f"{where}: JSON nested too deeply"))
        except BlockspecError as exc:
            rows.append(Row(index, key, None, None, str(exc)))
    return rows


def requests_for(messages: list[dict[str, Any]]) -> list[int]:
    """Indices at which the target answers: each assistant turn that follows a non-assistant
    message, and the end when the chat ends on a user / tool turn."""
    points = [i for i, m in enumerate(messages)
              if m["role"] == "assistant" and i > 0 and messages[i - 1]["role"] != "assistant"]
    if messages[-1]["role"] != "assistant":
        points.append(len(messages))
    return points


def read_done(out: Path) -> dict[int, str]:
    """{row index: key} of the rows already written. A last line cut short by a killed run is
    dropped (that row runs again)."""
    done: dict[int, str] = {}
    if not out.is_file():
        return done
    data = out.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] and not data.endswith(b"\n"):   # a partial last line
        out.write_bytes(data[:len(data) - len(lines[-1])])
        lines = lines[:-1]
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            done[int(row["row"])] = str(row["key"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise BlockspecError(f"regenerate: {out}:{n} is not a regenerated row; use a new --out") from None
    return done


class Client:
    """POSTs chat completions with retries; one httpx.AsyncClient for every request."""

    def __init__(self, cfg: EndpointConfig, transport: Any = None) -> None:
        try:  # optional dependency (the `train` extra); imported only for endpoint runs
            import httpx
        except ImportError:
            raise BlockspecError("regenerate --endpoint needs httpx: pip install 'blockspec[train]'") from None

        self.httpx, self.cfg = httpx, cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(base_url=cfg.base, headers=headers, timeout=cfg.timeout_s,
                                      limits=httpx.Limits(max_connections=cfg.concurrency), transport=transport)

    async def model(self) -> str:
        if self.cfg.model:
            return self.cfg.model
        body = await self.call("GET", "/v1/models", None)
        listed = body.get("data")
        if not isinstance(listed, list):
            raise RowError(f"GET /v1/models answered without a 'data' list: {json.dumps(body)[:200]}")
        names = [m.get("id") for m in listed if isinstance(m, dict)]
        if len(names) != 1:
            raise RowError(f"the server lists models {names}; pass --model NAME")
        return names[0]

    async def call(self, method: str, path: str, payload: dict[str, Any] | None) -> dict[str, Any]:
        delay, last = self.cfg.backoff_s, ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)
            try:   # the whole request, not each read: a server trickling bytes is cut off too
                resp = await asyncio.wait_for(self.http.request(method, path, json=payload), self.cfg.timeout_s)
            except self.httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc or 'no response'}"
                continue
            except asyncio.TimeoutError:
                last = f"no complete response in {self.cfg.timeout_s:g} s (--request-timeout)"
                continue
            if resp.status_code == 200:
                try:
                    body = resp.json()
                except (ValueError, RecursionError):
                    raise RowError(f"HTTP 200 with a body that is not JSON: {resp.text[:200]!r}") from None
                if not isinstance(body, dict):
                    raise RowError(f"HTTP 200 with a JSON body that is not an object: {resp.text[:200]!r}")
                return body
            last = f"HTTP {resp.status_code}: {_error_message(resp)}"
            if resp.status_code not in RETRY_STATUS:
                raise RowError(last)   # the server rejects this request: retrying cannot help
            retry_after = resp.headers.get("retry-after", "")
            if retry_after.isdigit():
                delay = max(delay, min(60.0, float(retry_after)))
        raise RowError(f"{last} (after {self.cfg.retries + 1} attempts)")

    async def answer(self, model: str, messages: list[dict[str, Any]], seed: int) -> tuple[dict[str, Any], str]:
        payload = {**self.cfg.extra_body, "model": model, "max_tokens": self.cfg.max_tokens,
                   "temperature": self.cfg.temperature, "seed": seed,
                   "messages": [{k: v for k, v in m.items() if k != "train"} for m in messages]}
        body = await self.call("POST", "/v1/chat/completions", payload)
        return answer_of(body)


def answer_of(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the assistant message to write, the finish reason) of a chat completion, its shape
    checked: a response that is not one is the row's failure, never a written row."""
    def bad(what: str) -> RowError:
        return RowError(f"the response {what}: {json.dumps(body)[:200]}")

    choices = body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise bad("has no choices[0].message object")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise bad("has a message content that is not a string")
    answer = {"role": "assistant", "content": content or ""}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise bad("has reasoning that is not a string")
    if reasoning:   # vLLM / SGLang reasoning parsers split it off
        answer["reasoning_content"] = reasoning
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
        raise bad("has tool_calls that are not a list of {function: {...}} objects")
    if calls:
        answer["tool_calls"] = calls
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise bad("has a finish_reason that is not a string")
    return answer, str(finish)


def _error_message(resp: Any) -> str:
    try:
        error = resp.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)[:500]
    except (ValueError, AttributeError):
        pass
    return resp.text[:500] or resp.reason_phrase


async def regenerate_row(client: Client, model: str, row: Row, cfg: EndpointConfig) -> dict[str, Any]:
    assert row.messages is not None
    messages, points = row.messages, requests_for(row.messages)
    if not points:
        raise RowError("the conversation has no user turn to answer")
    seed = cfg.seed + row.index
    if cfg.turns == "last":
        context = [m if m["role"] != "assistant" else {**m, "train": False} for m in messages[:points[-1]]]
        answer, reason = await client.answer(model, context, seed)
        return {"messages": context + [answer], "finish_reasons": [reason]}
    written: list[dict[str, Any]] = []
    reasons = []
    previous = 0
    for point in points:
        # The dataset's context up to this turn, its own answers replaced by the target's.
        written += [m for m in messages[previous:point] if m["role"] != "assistant"]
        answer, reason = await client.answer(model, written, seed)
        written.append(answer)
        reasons.append(reason)
        previous = point
    return {"messages": written, "finish_reasons": reasons}


async def _run(cfg: EndpointConfig, rows: list[Row], out: Path, done: dict[int, str],
               failed: list[dict[str, Any]]) -> int:
    todo = [r for r in rows if r.index not in done]
    client = Client(cfg)
    written = 0
    columns = (TextColumn("regenerate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
               TimeElapsedColumn(), TimeRemainingColumn())
    try:
        model = await client.model() if any(r.error is None for r in todo) else ""
        with out.open("a", encoding="utf-8") as f, Progress(*columns) as bar:
            task = bar.add_task("rows", total=len(rows), completed=len(rows) - len(todo), failed=0)
            queue: asyncio.Queue[Row] = asyncio.Queue()
            for row in todo:
                queue.put_nowait(row)

            async def worker() -> None:
                nonlocal written
                while not queue.empty():
                    row = queue.get_nowait()
                    try:
                        if row.error is not None:
                            raise RowError(row.error)
                        result = await regenerate_row(client, model, row, cfg)
                        # One write per row from the event loop's thread: lines never interleave.
                        f.write(json.dumps({"row": row.index, "key": row.key, "id": row.id, **result}) + "\n")
                        f.flush()
                        written += 1
                    except RowError as exc:
                        failed.append({"row": row.index, "key": row.key, "id": row.id, "error": str(exc)})
                    bar.update(task, advance=1, failed=len(failed))

            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, max(1, len(todo))))))
    except RowError as exc:   # the server itself is unusable (model listing failed)
        raise BlockspecError(f"regenerate: {cfg.base}: {exc}") from None
    finally:
        await client.http.aclose()
    return written


def regenerate_endpoint(cfg: EndpointConfig, source: Path, out: Path) -> dict[str, Any]:
    """Regenerate every row of `source` not yet in `out` through the server; returns the summary
    ({rows, written, skipped, failed, failed_rows, failed_file, out}). Failed rows are never
    dropped: they are in the summary and in `<out>.failed.jsonl` (rewritten by each run)."""
    cfg.validate()
    rows = read_rows(source, cfg.limit)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    changed = [r.index for r in rows if r.index in done and done[r.index] != r.key]
    if changed:
        raise BlockspecError(f"regenerate: {out} was written from a different input (rows {changed[:5]} changed); "
                             "use a new --out")
    failed: list[dict[str, Any]] = []
    written = asyncio.run(_run(cfg, rows, out, done, failed))
    sidecar = out.with_name(out.name + ".failed.jsonl")
    failed.sort(key=lambda r: r["row"])
    if failed:
        sidecar.write_text("".join(json.dumps(r) + "\n" for r in failed), encoding="utf-8")
    elif sidecar.exists():   # an earlier run's failures have all been written now
        sidecar.unlink()
    return {"rows": len(rows), "written": written, "skipped": sum(r.index in done for r in rows),
            "failed": len(failed), "failed_rows": [r["row"] for r in failed[:20]],
            "failed_file": str(sidecar) if failed else None, "out": str(out)}
