"""The ASGI app: the reference's control paths over one :class:`LifecycleController`.

Every response, error or not, has a JSON body (clients call ``.json()`` on everything).
Typed refusals are 4xx, never 500: 400 for a refused request (with the reference's message),
401 without the API key, 403 for the weight update group routes on a server that did not
opt in to them, 404/405 for unknown paths and methods, 408 when a body stops
arriving, 409 when in-flight work did not drain in time, 413 for a body over the limit, 503
when a call waited too long for a transition, 507 when a move would pass the host budget
(refused before allocating). 500 is kept for a move that failed and was rolled back (the
body says so) and for a bug; an update over a trainer's process group that was rolled back
because the trainer's broadcast failed (it died or stalled) is the client's failure: 400, as
the reference answers failed updates (the update's ``causes`` say so, not its message).
Nothing changes on any refusal. A library error a route lets through is answered by one
handler from one table of error type to status (``lifecycle.http._status``); routes raise,
they do not choose statuses for library errors.

Bodies are bounded in memory as well as size: an upload's base64 strings are not parsed as
JSON but left in the body's buffer and decoded there (see lifecycle.http._bodies), and
everything slow (scanning a large body, decoding, checking weight files) runs in worker
threads, so that ``/health`` answers whatever an update is doing.

The routes are a table (lifecycle.http._routes.ROUTES); each handler parses its body against
a small schema (unknown fields are ignored: clients send fields meant for other servers) and
calls the controller, whose admission orders control calls and generations.

The package by concern, each importing only those after it: this module (the error
handlers, the gatekeeper, :func:`create_app`, :func:`demo_generate`); ``_routes`` (the route
handlers and the table, gathering ``_control``'s and ``_transfer``'s); ``_answers`` (the
answers the route modules share); ``_state`` (the per-app service); ``_bodies`` (reading,
parsing and decoding bodies into typed requests).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import LifecycleController
from ..metrics import ControllerMetrics
from ..payload import FD_TIMEOUT
from . import _transfer
from ._bodies import BadRequest, MiB, field, refused
from ._driver import Driver, Generate, LocalDriver
from ._generations import Generations
from ._routes import ROUTES
from ._state import Service
from ._status import STATUS, answer_of

__all__ = ["Generate", "create_app", "demo_generate"]

_log = logging.getLogger("lifecycle.http")


# -- errors -------------------------------------------------------------------------------
async def _bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"success": False, "error": exc.detail, "message": exc.detail},
                        status_code=exc.status_code, headers=exc.headers)


async def _library_error(request: Request, exc: Exception) -> Response:
    """Every library error a route lets through: its status from the one table
    (lifecycle.http._status), with the fields the route adds (``request.state.answer_extra``)."""
    extra = getattr(request.state, "answer_extra", None)
    answer = answer_of(exc, request.url.path, **(extra() if extra is not None else {}))
    assert answer is not None  # registered for the table's classes only
    status, body = answer
    return JSONResponse(body, status_code=status)


async def _gone(request: Request, exc: Exception) -> Response:
    # The client went away mid-body: nobody reads this answer; not our bug either.
    return JSONResponse({"success": False, "message": "the client disconnected"}, status_code=400)


async def _internal_error(request: Request, exc: Exception) -> Response:
    _log.error("http.internal_error path=%s error=%s", request.url.path, type(exc).__name__)
    return JSONResponse({"success": False, "message": f"internal error: {type(exc).__name__}"},
                        status_code=500)


# -- middleware ---------------------------------------------------------------------------
def _timed_receive(receive: Receive, timeout: float) -> Receive:
    """``receive`` that raises a 408 :class:`BadRequest` when the next piece of the request
    body does not come within ``timeout`` seconds (a client that declared more than it sends
    would otherwise hold the request forever); untimed once the body is complete."""
    complete = False

    async def timed() -> Message:
        nonlocal complete
        if complete:
            return await receive()
        try:
            with anyio.fail_after(timeout):
                message = await receive()
        except TimeoutError:
            raise BadRequest(408, {"success": False, "message": f"the request body stopped "
                                   f"arriving ({timeout:g} s without a byte)"},
                             {"connection": "close"}) from None
        complete = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return timed


class _Gatekeeper:
    """API key check, the body read timeout, one log line and one metrics count per request."""

    def __init__(self, app: ASGIApp, service: Service, api_key: str | None,
                 body_timeout: float | None) -> None:
        self.app = app
        self.service = service
        self.api_key = api_key
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        path = scope["path"]
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if self.body_timeout is not None:
            receive = _timed_receive(receive, self.body_timeout)
        try:
            refusal = self._refusal(scope)
            if refusal is None:
                await self.app(scope, receive, send_status)
            else:
                await refusal(scope, receive, send_status)
        finally:
            label = path if path in ROUTES else "other"
            self.service.metrics.count_request(label, status)
            _log.info("%s %s %d %.1f ms", scope["method"], path, status,
                      1e3 * (time.perf_counter() - t0))

    def _refusal(self, scope: Scope) -> Response | None:
        """None when the request may go on; else its answer: 401 without the key, 400 with
        more than one ``Authorization`` header (which one would count?)."""
        route = ROUTES.get(scope["path"])
        if self.api_key is None or (route is not None and not route[2]):
            return None
        headers = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        if len(headers) > 1:
            message = f"the request has {len(headers)} Authorization headers; send one"
            return JSONResponse({"success": False, "error": message, "message": message},
                                status_code=400)
        scheme, _, token = (headers[0] if headers else b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"),
                                                              self.api_key.encode()):
            return None
        return JSONResponse({"error": "Unauthorized"}, status_code=401)


def create_app(ctl: LifecycleController, *, generate: Generate | None = None,
               api_key: str | None = None, metrics: ControllerMetrics | None = None,
               driver: Driver | None = None,
               body_limit: int = MiB, upload_limit: int = 1024 * MiB,
               body_timeout: float | None = 30.0, fd_timeout: float = FD_TIMEOUT,
               file_check_timeout: float = 10.0, process_groups: bool | None = None,
               on_startup: Callable[[], Awaitable[None]] | None = None,
               on_shutdown: Callable[[], Awaitable[None]] | None = None) -> ASGIApp:
    """The ASGI app serving ``ctl``: the routes of :data:`ROUTES`, JSON everywhere.

    ``generate`` serves ``/generate`` (see :func:`demo_generate`); ``api_key`` protects every
    path but ``/health*`` and ``/metrics`` (an empty key is refused: it would admit an empty
    token); ``metrics`` defaults to a fresh :class:`~lifecycle.metrics.ControllerMetrics`;
    ``body_limit`` / ``upload_limit`` bound request bodies (the tensor upload gets the larger
    one); ``body_timeout``: seconds without a byte of a body being read before a 408 (None:
    wait forever); ``fd_timeout``: seconds each step of a ``file_descriptor`` handshake of a
    pickled upload may take; ``file_check_timeout``: seconds a disk update's look at its weight
    files may take (a hung file system) before a 400. ``process_groups``: serve the weight
    update group routes (they make the server connect to a trainer the client names); None:
    only with an ``api_key`` (else they answer 403). ``on_startup`` / ``on_shutdown`` run in
    the server's lifespan (``residency serve`` attaches and detaches there); ``driver``
    replaces the direct calls to ``ctl`` (several ranks: every call on every rank).

    Header read timeouts and a connection limit belong to the HTTP server: see
    :func:`lifecycle.http.uvicorn_config`."""
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: it would admit 'Authorization: Bearer ' with no "
                         "token; give a key, or None to serve without one")
    service = Service(driver or LocalDriver(ctl, generate), metrics or ControllerMetrics(ctl),
                      body_limit, upload_limit, fd_timeout, file_check_timeout,
                      api_key is not None if process_groups is None else process_groups,
                      Generations(ctl.admission_timeout, ctl.drain_timeout))

    service.transfer = _transfer.WeightTransfer()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        try:
            async with anyio.create_task_group() as tg:
                # Rolls back a weight transfer its trainer abandoned (lifecycle.http._transfer).
                tg.start_soon(_transfer.abandon_after, service)
                yield
                tg.cancel_scope.cancel()
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    app = Starlette(
        routes=[Route(path, handler, methods=list(methods))
                for path, (handler, methods, _) in ROUTES.items()],
        exception_handlers={**dict.fromkeys(STATUS, _library_error),
                            BadRequest: _bad_request, HTTPException: _http_error,
                            ClientDisconnect: _gone, Exception: _internal_error},
        lifespan=lifespan)
    app.state.service = service
    return _Gatekeeper(app, service, api_key, body_timeout)


# -- the demo pipeline's generation ---------------------------------------------------------
def demo_generate(pipe: Any) -> Generate:
    """``/generate`` for :class:`lifecycle.demo.DemoPipeline`: body ``{"seed": int, "steps":
    int}``; answers the image's shape, dtype and the SHA-256 of its bytes."""

    async def run(ctl: LifecycleController, body: Mapping[str, Any]) -> Mapping[str, Any]:
        # torch.Generator.manual_seed's range
        seed = field(body, "seed", "integer", default=0, bounds=(-(2**63), 2**64 - 1))
        steps = field(body, "steps", "integer", default=3)
        if not 1 <= steps <= 100:
            raise refused(f"steps must be between 1 and 100, got {steps}")
        image: torch.Tensor = await pipe.generate(ctl=ctl, seed=seed, steps=steps)
        data = image.detach().to("cpu").contiguous()
        digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        return {"success": True, "shape": list(data.shape),
                "dtype": str(data.dtype).removeprefix("torch."), "sha256": digest,
                "weights_version": ctl.weights_version}

    return run

