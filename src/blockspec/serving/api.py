"""OpenAI-compatible HTTP API over the continuous-batching Engine (FastAPI).

    app = create_app(engine, tokenizer, "my-model", api_key=None, limits=ServerLimits())

Endpoints: POST /v1/completions, POST /v1/chat/completions (both `stream` true
or false; logprobs, echo, n and lists of prompts as vLLM answers them), GET /v1/models,
GET /health, GET /metrics (Prometheus text, metrics.py), and vLLM's /tokenize,
/detokenize, /version, /v1/models/{id} and /tokenizer_info (endpoints.py).

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
import logging
import os
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.config import GenerationDefaults
from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError
from blockspec.models.template_sandbox import WORKERS as TEMPLATE_WORKERS
from blockspec.models.tokenizer import Tokenizer
from blockspec.serving.lifecycle import Admission, AdmissionGate, shutting_down
from blockspec.serving.metrics import CONTENT_TYPE, exposition, metrics_registry
from blockspec.serving.protocol import (CLIENT_CLOSED, ENDPOINTS, MAX_CHOICES, ApiError, ChatRequest,
                                        CompletionRequest, SamplingFields, ServerLimits, short_repr, chat_prompt,
                                        chat_text, completion_prompts, parse_request, prompt_byte_limit, read_body,
                                        sampling_params, token_budget)
from blockspec.serving.endpoints import add_operational_routes
from blockspec.serving.responses import (Ask, ChatShape, Choice, CompletionShape, Job, check_finish, choice_piece,
                                         collect_output, merged, sse, usage)
from blockspec.serving.stats_log import log_stats

log = logging.getLogger(__name__)

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
                 admission: Admission, defaults: GenerationDefaults) -> None:
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits
        self.admission, self.defaults = admission, defaults
        self.max_prompt_bytes = prompt_byte_limit(limits, engine)
        # Half the cores at most: huge prompts queue here rather than take every core from
        # the event loop and the engine (the tokenizer releases the GIL but uses the CPU).
        self.cpu = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2), thread_name_prefix="blockspec-cpu")
        # Chat renders wait on a template worker process (bounded by its deadline): in threads of
        # their own, one per worker, so a slow template never holds the parsing pool.
        self.renders = ThreadPoolExecutor(TEMPLATE_WORKERS.size, thread_name_prefix="blockspec-render")

    async def off_loop(self, fn: Callable[..., Any], *args: Any, pool: ThreadPoolExecutor | None = None) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool or self.cpu, fn, *args)

    # CPU work of a request (JSON validation, chat rendering, tokenization): in a worker
    # thread, so a huge prompt never stalls the event loop (/health, other streams).
    def completion_input(self, body: bytes) -> tuple[CompletionRequest, list[list[int]], list[str] | None]:
        req = parse_request(CompletionRequest, body)
        prompts = completion_prompts(req.prompt, self.tokenizer, self.max_prompt_bytes)
        echoes = None
        if req.echo:   # the prompts as text: as given, or decoded from their token ids
            given = ([req.prompt] if isinstance(req.prompt, str) else [None] if isinstance(req.prompt[0], int)
                     else req.prompt)
            echoes = [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(given, prompts)]
        return req, prompts, echoes

    async def chat_input(self, body: bytes) -> tuple[ChatRequest, list[int]]:
        req = await self.off_loop(parse_request, ChatRequest, body)
        try:
            text = await self.off_loop(chat_text, req, self.tokenizer, self.max_prompt_bytes,
                                       pool=self.renders)
        except ApiError:
            if self.admission.draining:   # the drain stopped the render
                raise shutting_down() from None
            raise
        return req, await self.off_loop(chat_prompt, text, self.tokenizer)

    def close(self) -> None:
        """Stop the pools without waiting: a render in flight is killed with its worker."""
        TEMPLATE_WORKERS.close()
        for pool in (self.cpu, self.renders):
            pool.shutdown(wait=False, cancel_futures=True)

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        req, prompts, echoes = await self.off_loop(self.completion_input, body)
        return await self.generate(request, req, Ask(
            prompts, CompletionShape(self.token_text), "prompt", "max_tokens", req.max_tokens, req.logprobs,
            req.logprobs if req.echo else None, echoes, {"prompt_logprobs": "logprobs"}))

    async def chat(self, request: Request) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        req, prompt = await self.chat_input(body)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await self.generate(request, req, Ask([prompt], ChatShape(self.token_text), "messages", max_param,
                                                     requested, logprobs, names={"logprobs": "top_logprobs"}))

    def token_text(self, token: int) -> str:
        return self.tokenizer.token_text(token)

    def choices(self, req: SamplingFields, ask: Ask, job_id: str) -> list[Choice]:
        """prompts x n engine requests, each with its own token budget (max_tokens=0: one token, discarded)."""
        if len(ask.prompts) * req.n > MAX_CHOICES:
            raise ApiError(400, f"{len(ask.prompts)} prompts x n={req.n} is more than the {MAX_CHOICES} choices "
                                "this server generates per request", "n")
        single = len(ask.prompts) * req.n == 1
        out = []
        for i, prompt in enumerate(ask.prompts):
            budget = token_budget(ask.requested, len(prompt), self.engine, self.limits, ask.prompt_param,
                                  ask.max_param)
            params = sampling_params(req, max(budget, 1), self.engine.target.config.vocab_size, ask.max_param,
                                     self.defaults, ask.logprobs, ask.prompt_logprobs, ask.names)
            for j in range(req.n):   # vLLM's n: child j samples with seed + j
                index = i * req.n + j
                seed = None if params.seed is None else (params.seed + j + 2**63) % 2**64 - 2**63
                out.append(Choice(index, job_id if single else f"{job_id}-{index}", prompt,
                                  replace(params, seed=seed), ask.echoes[i] if ask.echoes else None, budget == 0))
        return out

    async def generate(self, request: Request, req: SamplingFields, ask: Ask) -> Response:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"the model '{short_repr(req.model)}' does not exist; this server serves "
                                f"'{self.model_name}'", "model")
        job_id = f"{ask.shape.id_prefix}-{uuid.uuid4().hex}"
        job = Job(job_id, int(time.time()), sum(map(len, ask.prompts)), bool(req.stream),
                  bool(req.stream_options and req.stream_options.include_usage), ask.shape,
                  self.choices(req, ask, job_id), ask.logprobs is not None)
        self.submit(job, ask.prompt_param)

        def cancel() -> None:
            for c in job.choices:
                self.engine.cancel(c.id)
        if job.stream:
            return EngineStream(self.events(job), cancel)
        try:
            return await self.respond(request, job)
        finally:
            cancel()  # client gone or task cancelled: free the slots

    def submit(self, job: Job, prompt_param: str) -> None:
        m = self.engine.metrics()
        # No lock needed: handlers share one event loop and nothing awaits between check and
        # submit; the engine thread only ever lowers the count.
        if m["running"] + m["waiting"] + len(job.choices) > m["slots"] + self.limits.max_queue:
            raise ApiError(429, "the server is busy (request queue full); retry later", headers={"Retry-After": "1"})
        if self.admission.draining:  # arrived before the drain, tokenized during it
            raise shutting_down()
        try:
            for c in job.choices:
                c.handle = self.engine.submit(c.prompt, c.params, request_id=c.id)
        except BlockspecError as exc:
            for c in job.choices:
                self.engine.cancel(c.id)
            if self.engine.failure is not None:
                raise ApiError(503, "the engine has stopped; see the server log") from None
            raise ApiError(400, str(exc), prompt_param) from None

    async def respond(self, request: Request, job: Job) -> Response:
        # Iterate the handles rather than await their futures: cancelling an await on a
        # future would cancel it under the engine, which sets its result later.
        collect = asyncio.ensure_future(asyncio.gather(*(collect_output(c.handle) for c in job.choices)))
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            collect.cancel()  # a no-op once it has finished
        if collect not in done:
            raise ApiError(CLIENT_CLOSED, "the client closed the connection")
        out, tokens = [], 0
        for c, res in zip(job.choices, collect.result()):
            text, logprobs, n = choice_piece(job, c, res.text, res.tokens, res.logprobs, res.prompt_logprobs, True)
            out.append(job.shape.choice(c.index, text, check_finish(res.finish_reason), logprobs))
            tokens += n
        return JSONResponse({"id": job.id, "object": job.shape.object, "created": job.created,
                             "model": self.model_name, "choices": out, "usage": usage(job.prompt_tokens, tokens)})

    async def events(self, job: Job) -> AsyncIterator[str]:
        """Server-sent events as OpenAI clients parse them, ending with `data: [DONE]`."""
        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {"id": job.id, "object": job.shape.chunk_object, "created": job.created,
                    "model": self.model_name, "choices": choices}
            if job.include_usage:
                body["usage"] = None  # every chunk but the last, as OpenAI sends it
            return sse({**body, **extra})

        tokens = 0
        offsets = {c.index: 0 for c in job.choices}   # text streamed per choice (completions' text_offset)
        started: set[int] = set()
        try:
            for c in job.choices:
                opening = job.shape.opening(c.index)
                if opening is not None:
                    yield chunk([opening])
            async for c, out in merged(job.choices):
                first = c.index not in started
                started.add(c.index)
                text, logprobs, n = choice_piece(job, c, out.text or "", out.token_ids, out.logprobs,
                                                 out.prompt_logprobs, first, offsets[c.index])
                tokens += n
                offsets[c.index] += len(text)
                finish = check_finish(out.finish_reason) if out.finished else None
                if text or finish or (logprobs and any(logprobs.values())):
                    yield chunk([job.shape.delta(c.index, text, finish, logprobs)])
            if job.include_usage:
                yield chunk([], usage=usage(job.prompt_tokens, tokens))
        except ApiError as exc:
            yield sse(exc.body())
        except Exception:  # headers are sent: report in-band, never as a broken stream
            log.exception("stream %s failed", job.id)
            yield sse(ApiError(500, "internal error while streaming; see the server log").body())
        yield "data: [DONE]\n\n"


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
               limits: ServerLimits = ServerLimits(), defaults: GenerationDefaults = GenerationDefaults(),
               stats_interval: float = 0.0) -> FastAPI:
    """The OpenAI-compatible app; it starts `engine` at startup and cancels its requests at shutdown.
    defaults: the checkpoint's generation_config.json sampling defaults; stats_interval > 0: log
    vLLM's engine stats line that often (stats_log.py)."""
    if engine.tokenizer is None:
        raise BlockspecError("the Engine needs a tokenizer for text output and stop strings: "
                             "build it with Engine(..., tokenizer=tokenizer)")
    if api_key is not None and not api_key:
        raise BlockspecError("the API key must not be empty")
    admission = Admission(engine)
    service = Service(engine, tokenizer, model_name, limits, admission, defaults)
    counts: Counter = Counter()
    started = int(time.time())
    num_drafts = engine.draft.config.num_drafts if engine.draft is not None else 0
    registry = metrics_registry(engine.metrics, counts, model_name, num_drafts)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        stats = asyncio.ensure_future(log_stats(engine.metrics, stats_interval)) if stats_interval > 0 else None
        try:
            yield
        finally:  # uvicorn has drained (or cancelled) the HTTP requests by now
            if stats is not None:
                stats.cancel()
            await asyncio.to_thread(engine.shutdown, drain=False, timeout=60)
            service.close()

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

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "blockspec",
                "root": model_name, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    add_operational_routes(app, service, model_card)

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
