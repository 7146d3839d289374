"""Request handles of the engine: a thread-safe view of one request's stream.

The engine thread `publish`es each delta; clients iterate over the deltas
(sync or async), block on `result()`, or `await` the handle for the final
Completion.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

from blockspec.decoding.logprobs import TokenLogprob
from blockspec.decoding.output import Completion

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """One streamed delta of a request."""

    request_id: str
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None   # "stop" | "length" | "cancelled" | "error" once finished
    logprobs: list[TokenLogprob] | None = None                # of token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first delta, when asked


@dataclass
class RequestTimes:
    """When a request reached each stage of its life (time.monotonic() seconds): what the
    engine's latency histograms (TTFT, inter-token, end-to-end) are computed from."""

    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None       # prefilled into a KV slot
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    tokens: int = 0                     # tokens delivered so far

    def delivered(self, n: int, now: float) -> float | None:
        """Record `n` tokens delivered at `now`; the gap since the previous delivery (None: the first)."""
        gap = None if self.last_token is None else now - self.last_token
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens += n
        return gap


class RequestHandle:
    """Thread-safe view of one request: iterate (sync or async) over deltas,
    block on `result()` or `await handle` for the final Completion."""

    def __init__(self, request_id: str, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        self.request_id = request_id
        self.times = RequestTimes()   # written by the engine thread only
        self._on_output = on_output
        self._lock = threading.Lock()
        self._deltas: queue.Queue[RequestOutput] = queue.Queue()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None
        self._future: concurrent.futures.Future[Completion] = concurrent.futures.Future()
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._future.done()

    def publish(self, out: RequestOutput, completion: Completion | None = None) -> None:
        """Deliver a delta (the engine thread); with `completion`, the request's end."""
        with self._lock:
            if self._async is not None:
                loop, aq = self._async
                loop.call_soon_threadsafe(aq.put_nowait, out)
            else:
                self._deltas.put(out)
        if self._on_output is not None:
            try:
                self._on_output(out)
            except Exception as exc:  # a client's callback must not take the engine down
                self.error = exc
                log.exception("on_output callback of request %s failed", self.request_id)
        if completion is not None and not self._future.done():  # an awaiting task may have been cancelled
            self._future.set_result(completion)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._deltas.get()
            yield out
            if out.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        aq: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:  # move what was already produced, then receive directly
            while not self._deltas.empty():
                aq.put_nowait(self._deltas.get_nowait())
            self._async = (asyncio.get_running_loop(), aq)
        while True:
            out = await aq.get()
            yield out
            if out.finished:
                return

    def result(self, timeout: float | None = None) -> Completion:
        return self._future.result(timeout)

    def __await__(self):
        # Shielded: cancelling the awaiting task must not cancel the request's future.
        return asyncio.shield(asyncio.wrap_future(self._future)).__await__()
