"""Running the app under uvicorn: graceful drain before the listener closes, and
connection timeouts (imported lazily: uvicorn is the optional `serve` extra).

Timeouts (uvicorn has a keep-alive timeout but no header-read timeout):
- `timeout_keep_alive` (uvicorn's own): an idle keep-alive connection is closed after it;
- `header_timeout` (HeaderTimeoutH11Protocol below): a connection must deliver a request's
  complete headers within this many seconds of opening, or of its previous response,
  else it is closed (slow-header "slowloris" connections are not held);
- header size: h11's `h11_max_incomplete_event_size` (uvicorn default 16 KiB) answers 400
  to larger request heads.
The h11 protocol is chosen explicitly (not "auto", which may pick httptools) because the
header timer hooks its request parsing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Awaitable, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from blockspec.errors import BlockspecError

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 5.0   # after the drain: uvicorn's wait for connections to finish writing
Drain = Callable[[float, Callable[[], bool]], Awaitable[None]]


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout (`header_timeout` seconds)."""

    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _timed_cycle: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._timed_cycle:
            self._disarm()   # a new request cycle started: its headers are complete

    def on_response_complete(self) -> None:
        super().on_response_complete()   # may start a pipelined request's cycle
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._arm()   # waiting for the next request's headers

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


def protocol_with(header_timeout: float) -> type[HeaderTimeoutH11Protocol]:
    if not header_timeout > 0:
        raise BlockspecError(f"--header-timeout must be > 0 seconds, got {header_timeout}")
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": float(header_timeout)})


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


def server_for(app: Any, host: str, port: int, drain_timeout: float, log_level: str = "info",
               timeout_keep_alive: float = 5.0, header_timeout: float = 10.0) -> DrainingServer:
    if drain_timeout < 0:
        raise BlockspecError(f"--drain-timeout must be >= 0 seconds, got {drain_timeout}")
    if not timeout_keep_alive > 0:
        raise BlockspecError(f"--timeout-keep-alive must be > 0 seconds, got {timeout_keep_alive}")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=protocol_with(header_timeout), timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=CLOSE_GRACE_S)
    drain = getattr(getattr(app, "state", None), "drain", None)
    return DrainingServer(config, drain, drain_timeout)


def _ignore_signal(signum: int, frame: Any) -> None:
    pass


def run_server(app: Any, host: str, port: int, drain_timeout: float, log_level: str = "info",
               timeout_keep_alive: float = 5.0, header_timeout: float = 10.0) -> None:
    """Serve until SIGINT / SIGTERM, drain for up to `drain_timeout` s, end the rest in-band, return."""
    server = server_for(app, host, port, drain_timeout, log_level, timeout_keep_alive, header_timeout)
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
