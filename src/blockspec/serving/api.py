"""OpenAI-compatible HTTP API over the continuous-batching Engine (FastAPI).

    app = create_app(engine, tokenizer, "my-model", api_key=None, limits=ServerLimits())

Endpoints: POST /v1/completions, POST /v1/chat/completions (both `stream` true
or false), GET /v1/models, GET /health, GET /metrics (Prometheus text, metrics.py).

The app owns the engine's background thread: it starts it at startup and
cancels what is left at shutdown, so pass an engine that is not started.
`app.state.drain` is the graceful drain (lifecycle.py) a server runs on SIGTERM
before closing its listener (runner.DrainingServer does). Request parsing, chat
rendering and tokenization run in worker threads, never on the event loop.
Every failure is an OpenAI-style JSON error:
`{"error": {"message", "type", "param", "code"}}`; malformed input is 4xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.config import SamplingParams
from blockspec.decoding.engine import Engine, RequestHandle
from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import Tokenizer
from blockspec.serving.lifecycle import Admission, AdmissionGate, shutting_down
from blockspec.serving.metrics import CONTENT_TYPE, exposition, metrics_registry
from blockspec.serving.protocol import (CLIENT_CLOSED, ENDPOINTS, ApiError, ChatRequest, CompletionRequest,
                                        SamplingFields, ServerLimits, short_repr, chat_prompt, completion_prompt,
                                        parse_request, prompt_byte_limit, read_body, sampling_params, token_budget)

log = logging.getLogger(__name__)

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

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, limits: ServerLimits,
                 admission: Admission) -> None:
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits
        self.admission = admission
        self.max_prompt_bytes = prompt_byte_limit(limits, engine)
        # Half the cores at most: huge prompts queue here rather than take every core from
        # the event loop and the engine (the tokenizer releases the GIL but uses the CPU).
        self.cpu = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2), thread_name_prefix="blockspec-cpu")

    async def off_loop(self, fn: Callable[[bytes], Any], body: bytes) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.cpu, fn, body)

    # CPU work of a request (JSON validation, chat rendering, tokenization): in a worker
    # thread, so a huge prompt never stalls the event loop (/health, other streams).
    def completion_input(self, body: bytes) -> tuple[CompletionRequest, list[int]]:
        req = parse_request(CompletionRequest, body)
        return req, completion_prompt(req.prompt, self.tokenizer, self.max_prompt_bytes)

    def chat_input(self, body: bytes) -> tuple[ChatRequest, list[int]]:
        req = parse_request(ChatRequest, body)
        return req, chat_prompt(req.messages, self.tokenizer, self.max_prompt_bytes)

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        req, prompt = await self.off_loop(self.completion_input, body)
        return await self.generate(request, req, prompt, CompletionShape(), "prompt", "max_tokens", req.max_tokens)

    async def chat(self, request: Request) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        req, prompt = await self.off_loop(self.chat_input, body)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self.generate(request, req, prompt, ChatShape(), "messages", max_param, requested)

    async def generate(self, request: Request, req: SamplingFields, prompt: list[int], shape: Shape,
                       prompt_param: str, max_param: str, requested: int | None) -> Response:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"the model '{short_repr(req.model)}' does not exist; this server serves "
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
        if self.admission.draining:  # arrived before the drain, tokenized during it
            raise shutting_down()
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
    admission = Admission(engine)
    service = Service(engine, tokenizer, model_name, limits, admission)
    counts: Counter = Counter()
    started = int(time.time())
    num_drafts = engine.draft.config.num_drafts if engine.draft is not None else 0
    registry = metrics_registry(engine.metrics, counts, model_name, num_drafts)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:  # uvicorn has drained (or cancelled) the HTTP requests by now
            await asyncio.to_thread(engine.shutdown, drain=False, timeout=60)
            service.cpu.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="blockspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False  # a JSON API answers 404, not a redirect
    app.state.drain = admission.drain
    app.add_middleware(AdmissionGate, admission=admission)
    app.add_middleware(Guard, api_key=api_key, counts=counts)  # added last: outside the gate
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
        if admission.draining:  # load balancers stop sending here
            return shutting_down().response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(exposition(registry), media_type=CONTENT_TYPE)

    return app
