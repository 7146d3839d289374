"""Admission and graceful shutdown of the HTTP API (plain ASGI: no server-specific code).

On SIGTERM / SIGINT the server calls `Admission.drain` BEFORE it closes its listener:
1. new generation requests are refused with a 503 JSON error and /health answers 503
   (a load balancer stops sending);
2. requests in flight may finish for up to the drain timeout;
3. what is left is cancelled in the engine: every stream then ends in-band with an
   error event and `data: [DONE]`, every non-streamed request with a 503 JSON body;
4. the server closes its listener and connections only once those responses are written.
A request counts from when its body is complete: clients still sending one are closed by the
server at shutdown (runner.py), never waited for.
Nothing is cancelled under a running response, so no stream is cut mid-chunk and no
traceback is logged (uvicorn's own timeout would cancel the tasks: see runner.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError
from blockspec.models.template_sandbox import WORKERS as TEMPLATE_WORKERS
from blockspec.serving.protocol import ApiError

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
ANSWER_GRACE_S = 10.0   # after the cancel: time for the in-band 503 answers to be written
POLL_S = 0.02


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another replica",
                    headers={"Connection": "close", "Retry-After": "1"})


class Admission:
    """Counts generation requests in flight; refuses new ones while draining."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.active = 0
        self.draining = False

    async def drain(self, timeout: float, force: Callable[[], bool] = lambda: False) -> None:
        """Stop admitting, wait up to `timeout` s for requests in flight, then end the rest
        with in-band 503s and wait for those answers to be written. `force()` true (a second
        Ctrl-C) skips the waiting."""
        self.draining = True
        if self.active:
            log.info("draining %d request(s) for up to %.1f s", self.active, timeout)
        await self._wait(timeout, force)
        if not self.active:
            return
        log.warning("%d request(s) still running after the %.1f s drain timeout: ending them with 503",
                    self.active, timeout)
        TEMPLATE_WORKERS.close()   # a chat still rendering ends now (-> 503)
        try:  # cancelling in the engine ends each request's handle with "cancelled" -> 503 in-band
            await asyncio.to_thread(self.engine.shutdown, drain=False, timeout=60)
        except BlockspecError as exc:
            log.error("stopping the engine: %s", exc)
        await self._wait(ANSWER_GRACE_S, force)
        if self.active:
            log.error("%d request(s) did not finish answering; the server closes their connections", self.active)

    async def _wait(self, timeout: float, force: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline and not force():
            await asyncio.sleep(POLL_S)


class AdmissionGate:
    """Pure ASGI middleware: counts generation requests from the end of their body to their
    last byte out, and answers 503 to new ones once draining. A client still sending its body
    is not counted: the drain never waits on it (the server closes it, runner.py)."""

    def __init__(self, app: Any, admission: Admission) -> None:
        self.app, self.admission = app, admission

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.admission.draining:
            return await shutting_down().response()(scope, receive, send)
        counted = False

        async def receive_counted() -> dict[str, Any]:
            nonlocal counted
            message = await receive()
            if not counted and message["type"] == "http.request" and not message.get("more_body", False):
                counted = True
                self.admission.active += 1
            return message

        try:
            await self.app(scope, receive_counted, send)
        finally:
            if counted:
                self.admission.active -= 1
