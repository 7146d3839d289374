"""Running the app under uvicorn: graceful drain before the listener closes, and
connection timeouts (imported lazily: uvicorn is the optional `serve` extra).

Timeouts and limits (uvicorn has a keep-alive timeout but no header or body timeout):
- `timeout_keep_alive` (uvicorn's own): an idle keep-alive connection is closed after it;
- `header_timeout` (HeaderTimeoutH11Protocol below): a connection must deliver a request's
  complete headers within this many seconds of opening, or of its previous response,
  else it is closed (slow-header "slowloris" connections are not held);
- `body_timeout`: a request's body must be complete this many seconds after its headers,
  or for as long after as it keeps arriving at MIN_BODY_RATE bytes/s on average; else the
  client gets 408 and the connection is closed (a trickled or never-sent body is not held);
- header size: a request head over MAX_HEAD_BYTES (16 KiB, as h11's incomplete-event limit)
  is answered 400 and closed, whether it arrives in pieces (h11) or in one write (here).
On shutdown a connection whose request body is not complete is closed at once: that request
was never admitted (lifecycle.py counts a request once its body is in), so nothing is owed.
The h11 protocol is chosen explicitly (not "auto", which may pick httptools) because the
timers hook its request parsing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Awaitable, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from blockspec.errors import BlockspecError

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 5.0   # after the drain: uvicorn's wait for connections to finish writing
FORCED_GRACE_S = 2.0   # after a second Ctrl-C: the most the last responses may take
MAX_HEAD_BYTES = 16 * 1024
MIN_BODY_RATE = 16 * 1024   # bytes/s a body still arriving after `body_timeout` must average
Drain = Callable[[float, Callable[[], bool]], Awaitable[None]]


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout (`header_timeout` seconds), a body
    deadline (`body_timeout`, then MIN_BODY_RATE) and a head size limit (MAX_HEAD_BYTES)."""

    header_timeout = 10.0
    body_timeout = 30.0
    _header_timer: asyncio.TimerHandle | None = None
    _timed_cycle: Any = None
    _body_timer: asyncio.TimerHandle | None = None
    _body_started = 0.0
    _body_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._body_timer is not None:
            self._body_bytes += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_large():
            return
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._timed_cycle:
            self._disarm()   # a new request cycle started: its headers are complete
            if self.conn.their_state is h11.SEND_BODY:
                self._arm_body()
        if self._body_timer is not None and self.conn.their_state is not h11.SEND_BODY:
            self._disarm_body()   # the body is complete

    def _head_too_large(self) -> bool:
        """Answer 400 to a request head over MAX_HEAD_BYTES that h11 holds complete (one write)."""
        buffered = self.conn.trailing_data[0]
        end = buffered.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
        if end >= 0 or len(buffered) <= MAX_HEAD_BYTES:
            return False
        message = f"request head over {MAX_HEAD_BYTES} bytes".encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(message), message))
        self.transport.close()
        return True

    def on_response_complete(self) -> None:
        super().on_response_complete()   # may start a pipelined request's cycle
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._arm()   # waiting for the next request's headers

    def shutdown(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and self.cycle is not None and not self.cycle.response_started:
            self.transport.close()   # its body never came: the request was not admitted, nothing is owed
            return
        super().shutdown()

    def _arm(self) -> None:
        self._disarm()
        self._timed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request headers in %.1f s", self.header_timeout)
            self.transport.close()

    def _arm_body(self) -> None:
        self._body_started, self._body_bytes = self.loop.time(), 0
        self._body_timer = self.loop.call_later(self.body_timeout, self._body_check)

    def _disarm_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_check(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self._body_bytes >= MIN_BODY_RATE * (self.loop.time() - self._body_started):
            self._body_timer = self.loop.call_later(1.0, self._body_check)   # slow but steady: keep reading
            return
        log.debug("closing a connection whose request body did not arrive in %.1f s", self.body_timeout)
        if self.cycle is not None and not self.cycle.response_started:
            try:
                message = b"request body not received in time"
                for event in (h11.Response(status_code=408, headers=[(b"content-type", b"text/plain"),
                                                                     (b"connection", b"close"),
                                                                     (b"content-length", b"%d" % len(message))]),
                              h11.Data(data=message), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass
        self.transport.close()


def protocol_with(header_timeout: float, body_timeout: float = 30.0) -> type[HeaderTimeoutH11Protocol]:
    if not header_timeout > 0:
        raise BlockspecError(f"--header-timeout must be > 0 seconds, got {header_timeout}")
    if not body_timeout > 0:
        raise BlockspecError(f"--body-timeout must be > 0 seconds, got {body_timeout}")
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)})


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that runs the app's drain (lifecycle.Admission.drain) before its own
    shutdown closes the listener, so every request ends in-band rather than cancelled."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None, drain_timeout: float) -> None:
        super().__init__(config)
        self.drain, self.drain_timeout = drain, drain_timeout

    async def shutdown(self, sockets: Any = None) -> None:
        if self.drain is not None:
            await self.drain(self.drain_timeout, lambda: self.force_exit)
        await super().shutdown(sockets=sockets)
        if self.force_exit:
            # A second Ctrl-C: uvicorn skips the app's shutdown (engine stop, template workers),
            # and asyncio.run would then cancel it mid-wait, printing a CancelledError traceback.
            # The drain has already ended every request, so both finish at once.
            for connection in list(self.server_state.connections):
                connection.transport.close()
            await self.lifespan.shutdown()
            if self.server_state.tasks:
                await asyncio.wait(list(self.server_state.tasks), timeout=FORCED_GRACE_S)


def server_for(app: Any, host: str, port: int, drain_timeout: float, log_level: str = "info",
               timeout_keep_alive: float = 5.0, header_timeout: float = 10.0,
               body_timeout: float = 30.0) -> DrainingServer:
    if drain_timeout < 0:
        raise BlockspecError(f"--drain-timeout must be >= 0 seconds, got {drain_timeout}")
    if not timeout_keep_alive > 0:
        raise BlockspecError(f"--timeout-keep-alive must be > 0 seconds, got {timeout_keep_alive}")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=protocol_with(header_timeout, body_timeout), timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=CLOSE_GRACE_S)
    drain = getattr(getattr(app, "state", None), "drain", None)
    return DrainingServer(config, drain, drain_timeout)


def _ignore_signal(signum: int, frame: Any) -> None:
    pass


def run_server(app: Any, host: str, port: int, drain_timeout: float, log_level: str = "info",
               timeout_keep_alive: float = 5.0, header_timeout: float = 10.0, body_timeout: float = 30.0) -> None:
    """Serve until SIGINT / SIGTERM, drain for up to `drain_timeout` s, end the rest in-band, return."""
    server = server_for(app, host, port, drain_timeout, log_level, timeout_keep_alive, header_timeout, body_timeout)
    # uvicorn re-raises the signal it caught once it has shut down, through the handlers
    # it found; with Python's defaults that kills the process (SIGTERM) or raises
    # KeyboardInterrupt (SIGINT). Installing ignoring handlers first lets a drained server exit 0.
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _ignore_signal) for sig in handled}
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        raise BlockspecError(f"cannot serve on {host}:{port}; see the log above") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise BlockspecError("the server failed to start; see the log above")
