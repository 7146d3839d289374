"""OpenAI-compatible HTTP API over the continuous-batching Engine (FastAPI).

    app = create_app(engine, tokenizer, "my-model", api_key=None, limits=ServerLimits())

Endpoints: POST /v1/completions, POST /v1/chat/completions (both `stream` true
or false), GET /v1/models, GET /health, GET /metrics (Prometheus text).

The app owns the engine's background thread: it starts it at startup and
cancels what is left at shutdown, so pass an engine that is not started.
Every failure is an OpenAI-style JSON error:
`{"error": {"message", "type", "param", "code"}}`; malformed input is 4xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from blockspec.config import SamplingParams
from blockspec.decoding.engine import Engine, RequestHandle
from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GREEDY_EPS = 1e-5       # smaller temperatures are greedy (vLLM's rule): logits / T can overflow float32
MIN_TOP_P = 1e-6        # float32 rounds a smaller top_p to 0, which would drop every token
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
INT64 = (-2**63, 2**63 - 1)   # torch generators take 64-bit seeds
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CLIENT_CLOSED = 499     # nginx's "client closed request": only ever seen in /metrics


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and queue limits of the HTTP layer (the engine has its own)."""

    max_body_bytes: int = 1 << 20
    max_queue: int = 256                  # requests waiting beyond the engine's slots; then 429
    max_prompt_tokens: int | None = None  # None: engine.max_model_len - 1
    max_tokens: int | None = None         # None: engine.max_model_len - 1

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise BlockspecError(f"server limit {name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise BlockspecError(f"server limit max_queue must be an integer >= 0, got {self.max_queue!r}")


# -- errors -------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validation_error(exc: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming the top-level field."""
    err = exc.errors(include_url=False)[0]
    loc = err["loc"]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {err['msg']}")
    if not loc:
        return ApiError(400, f"the request body must be a JSON object: {err['msg']}")
    field, path = str(loc[0]), ".".join(str(part) for part in loc)
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unknown or unsupported field '{path}'", field)
    return ApiError(400, f"invalid '{path}': {err['msg']}", field)


# -- request schemas ------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: "5" is not an int and true is not 1, as in the OpenAI API; unknown fields are errors.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                    # vLLM / SGLang extension; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None     # vLLM extension
    ignore_eos: bool = False                    # vLLM extension
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None                     # bookkeeping only: accepted, ignored
    # OpenAI fields the engine cannot honour: only their no-op values pass (NOOP_VALUES).
    n: Any = None
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    metadata: dict[str, str] | None = None      # bookkeeping only
    parallel_tool_calls: bool | None = None     # meaningless without tools
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None


NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}

M = TypeVar("M", bound=_Strict)


def parse_request(model: type[M], body: bytes) -> M:
    try:
        req = model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None
    for name, allowed in NOOP_VALUES.items():
        value = getattr(req, name, None)
        # Compare types too: True == 1 must not pass as n=1.
        if not any(value == ok and type(value) is type(ok) for ok in allowed):
            raise ApiError(400, f"'{name}' = {_short(value)} is not supported by this server "
                                f"(accepted: {', '.join(map(repr, allowed))})", name)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "'stream_options' is only allowed with stream=true", "stream_options")
    return req


async def read_body(request: Request, limit: int) -> bytes:
    """The raw JSON body, refusing other content types and more than `limit` bytes."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "Content-Type must be application/json")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body exceeds {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # counted as it arrives: chunked bodies have no length
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED, "the client closed the connection") from None
    return b"".join(chunks)


# -- from a request to SamplingParams ---------------------------------------------------

def token_budget(requested: int | None, prompt_len: int, engine: Engine, limits: ServerLimits,
                   prompt_param: str, max_param: str) -> int:
    """The request's token budget: at most the server limit and what fits in max_model_len."""
    model_len = engine.max_model_len
    prompt_limit = min(limits.max_prompt_tokens or model_len - 1, model_len - 1)
    if prompt_len > prompt_limit:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this server accepts at most {prompt_limit}",
                       prompt_param)
    room = model_len - prompt_len
    cap = limits.max_tokens or model_len - 1
    if requested is None:
        return min(cap, room)
    if requested > cap:
        raise ApiError(400, f"'{max_param}' is {requested}; this server allows at most {cap}", max_param)
    if requested > room:
        raise ApiError(400, f"this model's maximum context length is {model_len} tokens; the prompt uses "
                            f"{prompt_len}, so '{max_param}' can be at most {room} (got {requested})", max_param)
    return requested  # <= 0 is left to SamplingParams, which names the problem


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                            "characters", "stop")
    return stops


def sampling_params(req: _SamplingFields, max_new: int, vocab_size: int, max_param: str) -> SamplingParams:
    """Map OpenAI fields onto SamplingParams, whose own validation names the bad field."""
    temperature = 1.0 if req.temperature is None else req.temperature  # the OpenAI default
    if 0 <= temperature < GREEDY_EPS:
        temperature = 0.0
    top_k = req.top_k or 0
    if top_k == -1 or top_k >= vocab_size:  # vLLM's "off"; k >= vocab keeps everything anyway
        top_k = 0
    top_p = 1.0 if req.top_p is None else req.top_p
    if 0 < top_p < MIN_TOP_P:  # same result: the top token always holds more than 1e-6 of the mass
        top_p = MIN_TOP_P
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1]:
        raise ApiError(400, "'seed' must fit in a signed 64-bit integer", "seed")
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=req.seed,
                              max_new_tokens=max_new, stop=stop_strings(req.stop),
                              stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos)
    except BlockspecError as exc:
        field = str(exc).split(" ", 1)[0]  # SamplingParams messages start with the field name
        raise ApiError(400, str(exc).replace("max_new_tokens", max_param),
                       max_param if field == "max_new_tokens" else field) from None


def completion_prompt(prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Tokenizer) -> list[int]:
    if prompt and isinstance(prompt, list) and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported; send one request per prompt", "prompt")
        prompt = prompt[0]
    return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def chat_prompt(messages: list[ChatMessage], tokenizer: Tokenizer) -> list[int]:
    plain = [{"role": "system" if m.role == "developer" else m.role,  # "developer" is OpenAI's new "system"
              "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
             for m in messages]
    try:
        return tokenizer.encode(tokenizer.apply_chat_template(plain))
    except BlockspecError as exc:
        raise ApiError(400, str(exc), "messages") from None


# -- response shapes ------------------------------------------------------------------

class CompletionShape:
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    delta = choice

    def opening(self) -> dict[str, Any] | None:
        return None


class ChatShape:
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def delta(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}

    def opening(self) -> dict[str, Any] | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


Shape = CompletionShape | ChatShape


@dataclass
class Job:
    """One admitted request."""

    id: str
    created: int
    prompt_tokens: int
    stream: bool
    include_usage: bool
    shape: Shape


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def check_finish(reason: str | None) -> str:
    """Engine finish reasons a client can see; anything else is the server's failure."""
    if reason in ("stop", "length"):
        return reason
    if reason == "cancelled":
        raise ApiError(503, "the request was cancelled: the server is shutting down")
    raise ApiError(500, "the engine failed while generating; see the server log")


class EngineStream(StreamingResponse):
    """An SSE response that cancels its engine request however it ends: finished,
    client gone (before or while streaming), server shutdown or error."""

    def __init__(self, events: AsyncIterator[str], cancel: Callable[[], object]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cancel = cancel

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cancel()  # frees the KV slot now; a no-op for a finished request


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- the service ----------------------------------------------------------------------

class Service:
    """Request handling shared by both generation endpoints."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, limits: ServerLimits) -> None:
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits

    async def completions(self, request: Request) -> Response:
        req = parse_request(CompletionRequest, await read_body(request, self.limits.max_body_bytes))
        prompt = completion_prompt(req.prompt, self.tokenizer)
        return await self.generate(request, req, prompt, CompletionShape(), "prompt", "max_tokens", req.max_tokens)

    async def chat(self, request: Request) -> Response:
        req = parse_request(ChatRequest, await read_body(request, self.limits.max_body_bytes))
        prompt = chat_prompt(req.messages, self.tokenizer)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self.generate(request, req, prompt, ChatShape(), "messages", max_param, requested)

    async def generate(self, request: Request, req: _SamplingFields, prompt: list[int], shape: Shape,
                       prompt_param: str, max_param: str, requested: int | None) -> Response:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"the model '{_short(req.model)}' does not exist; this server serves "
                                f"'{self.model_name}'", "model")
        budget = token_budget(requested, len(prompt), self.engine, self.limits, prompt_param, max_param)
        params = sampling_params(req, budget, self.engine.target.config.vocab_size, max_param)
        job = Job(f"{shape.id_prefix}-{uuid.uuid4().hex}", int(time.time()), len(prompt), bool(req.stream),
                  bool(req.stream_options and req.stream_options.include_usage), shape)
        handle = self.submit(job, prompt, params, prompt_param)
        if job.stream:
            return EngineStream(self.events(job, handle), lambda: self.engine.cancel(job.id))
        try:
            return await self.respond(request, job, handle)
        finally:
            self.engine.cancel(job.id)  # client gone or task cancelled: free the slot

    def submit(self, job: Job, prompt: list[int], params: SamplingParams, prompt_param: str) -> RequestHandle:
        m = self.engine.metrics()
        # No lock needed: handlers share one event loop and nothing awaits between check and
        # submit; the engine thread only ever lowers the count.
        if m["running"] + m["waiting"] >= m["slots"] + self.limits.max_queue:
            raise ApiError(429, "the server is busy (request queue full); retry later", headers={"Retry-After": "1"})
        try:
            return self.engine.submit(prompt, params, request_id=job.id)
        except BlockspecError as exc:
            if self.engine.failure is not None:
                raise ApiError(503, "the engine has stopped; see the server log") from None
            raise ApiError(400, str(exc), prompt_param) from None

    async def respond(self, request: Request, job: Job, handle: RequestHandle) -> Response:
        # Iterate the handle rather than await its future: cancelling an await on the
        # future would cancel it under the engine, which sets its result later.
        collect = asyncio.ensure_future(collect_output(handle))
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            collect.cancel()  # a no-op once it has finished
        if collect not in done:
            raise ApiError(CLIENT_CLOSED, "the client closed the connection")
        text, tokens, reason = collect.result()
        return JSONResponse({"id": job.id, "object": job.shape.object, "created": job.created,
                             "model": self.model_name, "choices": [job.shape.choice(text, check_finish(reason))],
                             "usage": usage(job.prompt_tokens, tokens)})

    async def events(self, job: Job, handle: RequestHandle) -> AsyncIterator[str]:
        """Server-sent events as OpenAI clients parse them, ending with `data: [DONE]`."""
        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {"id": job.id, "object": job.shape.chunk_object, "created": job.created,
                    "model": self.model_name, "choices": choices}
            if job.include_usage:
                body["usage"] = None  # every chunk but the last, as OpenAI sends it
            return sse({**body, **extra})

        tokens = 0
        try:
            opening = job.shape.opening()
            if opening is not None:
                yield chunk([opening])
            async for out in handle:
                tokens += len(out.token_ids)
                finish = check_finish(out.finish_reason) if out.finished else None
                if out.text or finish:
                    yield chunk([job.shape.delta(out.text or "", finish)])
            if job.include_usage:
                yield chunk([], usage=usage(job.prompt_tokens, tokens))
        except ApiError as exc:
            yield sse(exc.body())
        except Exception:  # headers are sent: report in-band, never as a broken stream
            log.exception("stream %s failed", job.id)
            yield sse(ApiError(500, "internal error while streaming; see the server log").body())
        yield "data: [DONE]\n\n"


async def collect_output(handle: RequestHandle) -> tuple[str, int, str | None]:
    """(text, completion tokens, finish reason) of a request, from its stream of deltas."""
    parts, tokens, reason = [], 0, None
    async for out in handle:
        parts.append(out.text or "")
        tokens += len(out.token_ids)
        reason = out.finish_reason
    return "".join(parts), tokens, reason


# -- metrics ----------------------------------------------------------------------------

def prometheus_text(m: dict[str, Any], requests: Counter, num_drafts: int) -> str:
    """Prometheus exposition text of the server counters and `Engine.metrics()`."""
    lines: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    metric("blockspec_requests_total", "counter", "HTTP requests by endpoint and status code.",
           [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(requests.items())])
    metric("blockspec_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", m["prompt_tokens"])])
    metric("blockspec_generation_tokens_total", "counter", "Tokens generated.", [("", m["generated_tokens"])])
    metric("blockspec_engine_requests_total", "counter", "Engine requests by outcome.",
           [(f'{{outcome="{k}"}}', m[k]) for k in ("submitted", "finished", "cancelled", "rejected", "failed")])
    metric("blockspec_num_requests_running", "gauge", "Requests holding a KV slot.", [("", m["running"])])
    metric("blockspec_num_requests_waiting", "gauge", "Requests queued for a KV slot.", [("", m["waiting"])])
    metric("blockspec_kv_slots", "gauge", "KV slots (most requests running at once).", [("", m["slots"])])
    metric("blockspec_kv_cache_bytes_in_use", "gauge", "KV cache bytes held by running requests.",
           [("", m["kv_bytes_in_use"])])
    metric("blockspec_kv_cache_bytes_total", "gauge", "KV cache bytes preallocated.", [("", m["kv_bytes_total"])])
    # Acceptance length = accepted drafts + the bonus token, per request per round (tau's samples).
    hist = {accepted + 1: n for accepted, n in m["accepted_histogram"].items()}
    top = max([num_drafts + 1, *hist])
    buckets = [(f'{{le="{le}"}}', sum(n for k, n in hist.items() if k <= le)) for le in range(1, top + 1)]
    buckets.append(('{le="+Inf"}', sum(hist.values())))
    name = "blockspec_acceptance_length"
    lines.extend([f"# HELP {name} Tokens produced per request per round (accepted drafts + 1).",
                  f"# TYPE {name} histogram"])
    lines.extend(f"{name}_bucket{labels} {n}" for labels, n in buckets)
    lines.extend([f"{name}_sum {sum(k * n for k, n in hist.items())}", f"{name}_count {sum(hist.values())}"])
    return "\n".join(lines) + "\n"


# -- middleware and app ---------------------------------------------------------------------

class Guard:
    """Pure ASGI middleware: the bearer key on every path but /health, and request counts."""

    def __init__(self, app: Any, api_key: str | None, counts: Counter) -> None:
        self.app, self.counts = app, counts
        self.key = api_key.encode() if api_key is not None else None

    def authorized(self, scope: dict[str, Any]) -> bool:
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        # Bytes, not str: compare_digest refuses non-ASCII strings, and headers can hold any byte.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # if nothing is sent, the error middleware outside us answers 500

        async def counted(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.key is not None and scope["path"] != "/health" and not self.authorized(scope):
                error = ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, counted)
                return
            await self.app(scope, receive, counted)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"  # bounded label set
            self.counts[(endpoint, status)] += 1


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:  # routing: 404, 405
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def internal(_: Request, exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc)
        return ApiError(500, "internal server error; see the server log").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, api_key: str | None = None,
               limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The OpenAI-compatible app; it starts `engine` at startup and cancels its requests at shutdown."""
    if engine.tokenizer is None:
        raise BlockspecError("the Engine needs a tokenizer for text output and stop strings: "
                             "build it with Engine(..., tokenizer=tokenizer)")
    if api_key is not None and not api_key:
        raise BlockspecError("the API key must not be empty")
    service = Service(engine, tokenizer, model_name, limits)
    counts: Counter = Counter()
    started = int(time.time())
    num_drafts = engine.draft.config.num_drafts if engine.draft is not None else 0

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:  # uvicorn has drained (or cancelled) the HTTP requests by now
            await asyncio.to_thread(engine.shutdown, drain=False, timeout=60)

    app = FastAPI(title="blockspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False  # a JSON API answers 404, not a redirect
    app.add_middleware(Guard, api_key=api_key, counts=counts)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.chat(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": started, "owned_by": "blockspec",
             "max_model_len": engine.max_model_len}]})

    @app.get("/health")
    async def health() -> Response:
        if engine.failure is not None:
            return ApiError(503, "the engine has stopped; see the server log").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = prometheus_text(engine.metrics(), counts, num_drafts)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
