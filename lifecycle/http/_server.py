"""What the HTTP server itself bounds: how long a request's headers may take, how many
connections may be open, and how a refused connection is closed.

uvicorn has a keep-alive idle timeout (``timeout_keep_alive``, between requests), a bound on
the size of a request's headers (``h11_max_incomplete_event_size``) and ``limit_concurrency``
(a plain-text 503 once that many connections *or tasks* exist), but no header read timeout: a
connection that sends nothing, or half a request line, stays open forever, and so does one that
stops sending a body after the app answered (uvicorn reads and drops the rest of a body the app
did not read, with no bound). :class:`GuardedH11Protocol`, uvicorn's h11 protocol with:

- a header timeout: from the connection's start, or from the first byte of a later request,
  the request line and headers must be complete within ``header_timeout`` seconds, else a 408
  (JSON) and the connection is closed;
- after the app answered while the client is still sending the body (a 413, a 404): the rest is
  read and dropped as long as it keeps coming (``body_timeout`` seconds at most without a byte)
  and up to ``max_drain`` bytes, so that a client that sends its whole body before reading gets
  the answer instead of a connection reset; past either bound the connection is closed;
- a connection limit: past ``max_connections`` open connections, a new one is answered 503
  (JSON) and closed at once;
- a clean close for what it refuses: the answer is written, the sending side shut down, and
  whatever the client still sends is dropped until it closes (at most ``linger`` seconds), so
  that the answer is not destroyed by a reset;
- JSON instead of uvicorn's plain text for a malformed request's 400;
- TCP_NODELAY on every connection (see :func:`_no_delay`).

The body read timeout while the app reads a body is the app's (``create_app(body_timeout=)``:
a 408 from the app). :func:`uvicorn_config` wires it all into a ``uvicorn.Config``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "ServerLimits", "uvicorn_config"]

_log = logging.getLogger("lifecycle.http")


@dataclass(frozen=True)
class ServerLimits:
    """The bounds of :class:`GuardedH11Protocol` (seconds, a count, bytes); None: no bound."""

    header_timeout: float | None = 10.0
    body_timeout: float | None = 30.0
    max_connections: int | None = 256
    max_drain: int = 2**30
    linger: float = 2.0


def _answer(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response with a JSON body, closing the connection."""
    body = json.dumps({"success": False, "message": message}).encode()
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


def _no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on the connection. asyncio sets it only on sockets made with
    ``proto=IPPROTO_TCP``; on one made with ``socket.socket()`` (proto 0) uvicorn's separate
    writes of headers and body meet Nagle's algorithm and the client's delayed ACK: 40 ms a
    response."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds of :class:`ServerLimits` (see the module doc).
    Make a subclass with ``limits`` set (:func:`uvicorn_config` does)."""

    limits: ClassVar[ServerLimits] = ServerLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: str | None = None  # "headers" or "body" while the timer runs
        self._closing = False
        self._refused = False
        self._drained = 0

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        limit = self.limits.max_connections
        if limit is not None and len(self.connections) >= limit:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport
            self._refused = True
            _log.warning("http.connection_refused open=%d limit=%d", len(self.connections), limit)
            transport.write(_answer(503, f"the server has its limit of {limit} connections open; "
                                         "retry later"))
            self._linger()
            return
        super().connection_made(transport)  # type: ignore[arg-type]
        _no_delay(transport)
        self._watch(data=False)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # dropped: the connection is being closed
        if self._draining():
            self._drained += len(data)
            if self._drained > self.limits.max_drain:
                self._linger()
                return
        super().data_received(data)
        self._watch(data=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._refused:
            return  # never registered with the server
        super().connection_lost(exc)

    # -- uvicorn's hooks -------------------------------------------------------------------
    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._drained = 0
        self._watch(data=False)

    def send_400_response(self, msg: str) -> None:
        # A request h11 cannot parse: JSON like every other answer, then a clean close.
        if self.transport.is_closing():
            return
        self.transport.write(_answer(400, f"invalid HTTP request: {msg}"))
        self._linger()

    # -- the timer -------------------------------------------------------------------------
    def _draining(self) -> bool:
        """The app answered, the client is still sending the body: uvicorn drops it."""
        return (self.cycle is not None and self.cycle.response_complete
                and self.conn.their_state is h11.SEND_BODY)

    def _watch(self, *, data: bool) -> None:
        """(Re)arm the timer for what the connection waits for now: the headers of a request
        (from the connection's start or the request's first byte; once per request), or the
        rest of a body the app did not read (re-armed at every byte). Otherwise uvicorn's own
        keep-alive timer, or the app, is in charge."""
        if self._closing:
            return
        state = self.conn.their_state
        if state is h11.IDLE and (self.cycle is None or data):
            if self._waiting != "headers":
                self._arm("headers", self.limits.header_timeout)
        elif self._draining():
            self._arm("body", self.limits.body_timeout)
        else:
            self._cancel()

    def _arm(self, waiting: str, seconds: float | None) -> None:
        self._cancel()
        if seconds is not None:
            self._waiting = waiting
            self._timer = self.loop.call_later(seconds, self._expired)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._waiting = None, None

    def _expired(self) -> None:
        waiting, self._timer = self._waiting, None
        if self.transport.is_closing():
            return
        if waiting == "headers":
            seconds = self.limits.header_timeout
            _log.info("http.header_timeout client=%s seconds=%s", self.client, seconds)
            self.transport.write(_answer(408, f"the request's headers did not arrive within "
                                              f"{seconds:g} s"))
        self._linger()

    def _linger(self) -> None:
        """Close cleanly: stop reading requests, shut down the sending side once the answer is
        written, drop what still comes until the client closes or ``linger`` seconds pass."""
        self._cancel()
        self._closing = True
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        if self.transport.can_write_eof():
            try:
                self.transport.write_eof()
            except (OSError, RuntimeError):  # the peer is gone already
                self.transport.close()
                return
        self.loop.call_later(self.limits.linger, self.transport.close)


def uvicorn_config(app: Callable[..., Any], *, limits: ServerLimits | None = None,
                   **options: Any) -> uvicorn.Config:
    """A ``uvicorn.Config`` serving ``app`` with :class:`GuardedH11Protocol` bounded by
    ``limits``; ``options`` go to ``uvicorn.Config`` (``log_level``, ...)."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,),
                    {"limits": limits or ServerLimits()})
    return uvicorn.Config(app, http=protocol, **options)
