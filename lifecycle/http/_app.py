"""The ASGI app: the reference's control paths over one :class:`LifecycleController`.

Every response, error or not, has a JSON body (clients call ``.json()`` on everything).
Typed refusals are 4xx, never 500: 400 for a refused request (with the reference's message),
401 without the API key, 404/405 for unknown paths and methods, 409 when in-flight work did
not drain in time, 413 for a body over the limit, 503 when a call waited too long for a
transition. 500 is kept for a move that failed and was rolled back (the body says so) and
for a bug. Nothing changes on any refusal.

The routes are a table (:data:`ROUTES`); each handler parses its body against a small schema
(unknown fields are ignored: clients send fields meant for other servers) and calls the
controller, whose admission orders control calls and generations.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import (
    AdmissionTimeout,
    ComponentAsleep,
    DrainTimeout,
    GroupBroken,
    LifecycleController,
    LifecycleError,
    OccupationResult,
    Phase,
    TransitionFailed,
    TransitionRejected,
)
from ..metrics import ControllerMetrics
from ._driver import Driver, Generate, LocalDriver, RanksUnavailable
from ._ranks import OutputsDisagree
from ._transport import TransportError, decode_named_tensors

__all__ = ["ROUTES", "Generate", "create_app", "demo_generate"]

_log = logging.getLogger("lifecycle.http")

MiB = 2**20


class BadRequest(Exception):
    """A refusal of the request itself: ``status`` and a JSON body, nothing changed."""

    def __init__(self, status: int, body: Mapping[str, Any]) -> None:
        super().__init__(body.get("message") or body.get("error"))
        self.status = status
        self.body = dict(body)


def _refused(message: str, status: int = 400, **extra: Any) -> BadRequest:
    return BadRequest(status, {"success": False, "message": message, **extra})


# -- bodies -----------------------------------------------------------------------------
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "boolean": (bool,), "integer": (int,), "list of strings": (list,),
    "object": (dict,)}


def _field(body: Mapping[str, Any], name: str, kind: str, *, required: bool = False,
           default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (see :data:`_TYPES`)."""
    if name not in body or body[name] is None:
        if required:
            raise _refused(f"{name} is required")
        return default
    value = body[name]
    ok = isinstance(value, _TYPES[kind]) and not (kind == "integer" and isinstance(value, bool))
    if ok and kind == "list of strings":
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        raise _refused(f"{name} must be a {kind}, got {type(value).__name__}")
    return value


async def _body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object body (``{}`` when empty), read at most ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _refused(f"body of {int(declared)} bytes is over the limit of {limit}", 413)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _refused(f"body is over the limit of {limit} bytes", 413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refused(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _refused(f"body must be a JSON object, got {type(body).__name__}")
    return body


# -- the app's state ----------------------------------------------------------------------
@dataclass
class _Service:
    driver: Driver
    metrics: ControllerMetrics
    body_limit: int
    upload_limit: int

    @property
    def ctl(self) -> LifecycleController:
        return self.driver.ctl


def _service(request: Request) -> _Service:
    service: _Service = request.app.state.service
    return service


def _occupation(result: OccupationResult) -> Response:
    # success (and idempotent repeats) 200; a failure result ("pipeline not initialized") 400
    return JSONResponse(result.as_dict(), status_code=200 if result.success else 400)


async def _transition(request: Request, call: Callable[[], Awaitable[OccupationResult]]
                      ) -> Response:
    service = _service(request)
    await _body(request, service.body_limit)  # ignored ({} or {"tags": [...]}), but valid
    sleeping = service.ctl.phase is Phase.SLEEPING
    try:
        return _occupation(await call())
    except DrainTimeout as exc:
        raise _refused(str(exc), 409, sleeping=sleeping) from None
    except TransitionRejected as exc:
        raise _refused(exc.reason, sleeping=sleeping) from None
    except GroupBroken as exc:
        raise _refused(str(exc), 503, sleeping=service.ctl.phase is Phase.SLEEPING) from None
    except RanksUnavailable as exc:
        raise _refused(str(exc), 503, sleeping=sleeping) from None
    except TransitionFailed as exc:
        raise _refused(str(exc), 500, sleeping=service.ctl.phase is Phase.SLEEPING,
                       rolled_back=True,
                       failed_ranks={str(r): w for r, w in exc.failed_ranks.items()}) from None


async def release(request: Request) -> Response:
    return await _transition(request, _service(request).driver.sleep)


async def resume(request: Request) -> Response:
    return await _transition(request, _service(request).driver.wake)


def _update_response(service: _Service, result: Any) -> Response:
    if result.success:
        names = ", ".join(result.updated)
        return JSONResponse({"success": True, "version": result.version,
                             "message": f"Updated {len(result.updated)} modules ({names}).",
                             "bytes_written": result.bytes_written, "seconds": result.seconds})
    status = 500 if result.rolled_back else 400
    return JSONResponse({"success": False, "message": result.message,
                         "version": result.version}, status_code=status)


async def _update(service: _Service, call: Callable[[], Awaitable[Any]]) -> Response:
    try:
        return _update_response(service, await call())
    except DrainTimeout as exc:
        raise _refused(str(exc), 409) from None
    except TransitionRejected as exc:  # while sleeping
        raise _refused(exc.reason) from None
    except (GroupBroken, RanksUnavailable) as exc:
        raise _refused(str(exc), 503) from None


async def update_from_disk(request: Request) -> Response:
    service = _service(request)
    body = await _body(request, service.body_limit)
    path = _field(body, "model_path", "string", required=True)
    targets = _field(body, "target_modules", "list of strings")
    _field(body, "flush_cache", "boolean")  # accepted; nothing to flush in a diffusion server
    return await _update(service, lambda: service.driver.update_from_disk(path, targets))


async def update_from_tensor(request: Request) -> Response:
    service = _service(request)
    body = await _body(request, service.upload_limit)
    payloads = _field(body, "serialized_named_tensors", "list of strings", required=True)
    if len(payloads) != 1:
        raise _refused(f"serialized_named_tensors must hold exactly one entry (one rank), got "
                       f"{len(payloads)}")
    targets = _field(body, "target_modules", "list of strings", default=["transformer"])
    if len(targets) != 1:
        raise _refused(f"target_modules must name exactly one module, got {targets}")
    load_format = _field(body, "load_format", "string")
    try:
        named = await anyio.to_thread.run_sync(decode_named_tensors, payloads[0], load_format)
    except TransportError as exc:
        raise _refused(f"serialized_named_tensors[0]: {exc}") from None
    return await _update(service,
                         lambda: service.driver.update_from_tensors(named, targets[0]))


async def checksum(request: Request) -> Response:
    service = _service(request)
    body = await _body(request, service.body_limit)
    names = _field(body, "module_names", "list of strings")
    wanted = list(service.ctl.components) if names is None else names
    try:
        sums = await service.driver.checksum(wanted)
    except (GroupBroken, RanksUnavailable) as exc:
        raise _refused(str(exc), 503) from None
    return JSONResponse({n: sums.get(n, "not_found") for n in wanted})


async def generate(request: Request) -> Response:
    service = _service(request)
    body = await _body(request, service.body_limit)
    if not service.driver.can_generate:
        raise _refused("this pipeline has no generate function (see residency serve "
                       "--pipeline MODULE:FACTORY)", 404)
    try:
        return JSONResponse(dict(await service.driver.generate(body)))
    except ComponentAsleep as exc:
        raise _refused(str(exc)) from None
    except AdmissionTimeout as exc:
        raise _refused(str(exc), 503) from None
    except TransitionRejected as exc:  # not initialized
        raise _refused(exc.reason, 503) from None
    except RanksUnavailable as exc:
        raise _refused(str(exc), 503) from None
    except OutputsDisagree as exc:
        raise _refused(str(exc), 500) from None


async def health(request: Request) -> Response:
    # 200 while sleeping too (routers mark a server dead otherwise); 503 without a pipeline.
    reason = _service(request).driver.unavailable()
    if reason is not None:
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


async def flush_cache(request: Request) -> Response:
    service = _service(request)
    await _body(request, service.body_limit)
    service.ctl.device_layer.empty_cache()
    return JSONResponse({"success": True})


async def state(request: Request) -> Response:
    try:
        return JSONResponse(await _service(request).driver.state())
    except RanksUnavailable as exc:
        raise _refused(str(exc), 503) from None


async def metrics(request: Request) -> Response:
    m = _service(request).metrics
    return Response(m.render(), media_type=m.content_type)


# path -> (handler, methods, needs the API key)
ROUTES: dict[str, tuple[Callable[[Request], Awaitable[Response]], tuple[str, ...], bool]] = {
    "/release_memory_occupation": (release, ("POST",), True),
    "/resume_memory_occupation": (resume, ("POST",), True),
    "/update_weights_from_disk": (update_from_disk, ("POST",), True),
    "/update_weights_from_tensor": (update_from_tensor, ("POST",), True),
    "/get_weights_checksum": (checksum, ("POST",), True),
    "/generate": (generate, ("POST",), True),
    "/health": (health, ("GET",), False),
    "/health_generate": (health, ("GET",), False),
    "/flush_cache": (flush_cache, ("GET", "POST"), True),
    "/state": (state, ("GET",), True),
    "/metrics": (metrics, ("GET",), False),
}


# -- errors -------------------------------------------------------------------------------
async def _bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    return JSONResponse(exc.body, status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"success": False, "error": exc.detail, "message": exc.detail},
                        status_code=exc.status_code, headers=exc.headers)


async def _library_error(request: Request, exc: Exception) -> Response:
    # A library error no handler expected: a refusal, not a crash.
    return JSONResponse({"success": False, "message": str(exc)}, status_code=400)


async def _internal_error(request: Request, exc: Exception) -> Response:
    _log.error("http.internal_error path=%s error=%s", request.url.path, type(exc).__name__)
    return JSONResponse({"success": False, "message": f"internal error: {type(exc).__name__}"},
                        status_code=500)


# -- middleware ---------------------------------------------------------------------------
class _Gatekeeper:
    """API key check, one log line and one metrics count per request."""

    def __init__(self, app: ASGIApp, service: _Service, api_key: str | None) -> None:
        self.app = app
        self.service = service
        self.api_key = api_key

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

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_status)
            else:
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(
                    scope, receive, send_status)
        finally:
            label = path if path in ROUTES else "other"
            self.service.metrics.count_request(label, status)
            _log.info("%s %s %d %.1f ms", scope["method"], path, status,
                      1e3 * (time.perf_counter() - t0))

    def _authorized(self, scope: Scope) -> bool:
        route = ROUTES.get(scope["path"])
        if self.api_key is None or (route is not None and not route[2]):
            return True
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode())


def create_app(ctl: LifecycleController, *, generate: Generate | None = None,
               api_key: str | None = None, metrics: ControllerMetrics | None = None,
               driver: Driver | None = None,
               body_limit: int = MiB, upload_limit: int = 1024 * MiB,
               on_startup: Callable[[], Awaitable[None]] | None = None,
               on_shutdown: Callable[[], Awaitable[None]] | None = None) -> ASGIApp:
    """The ASGI app serving ``ctl``: the routes of :data:`ROUTES`, JSON everywhere.

    ``generate`` serves ``/generate`` (see :func:`demo_generate`); ``api_key`` protects every
    path but ``/health*`` and ``/metrics``; ``metrics`` defaults to a fresh
    :class:`~lifecycle.metrics.ControllerMetrics`; ``body_limit`` / ``upload_limit`` bound
    request bodies (the tensor upload gets the larger one). ``on_startup`` / ``on_shutdown``
    run in the server's lifespan (``residency serve`` attaches and detaches there);
    ``driver`` replaces the direct calls to ``ctl`` (several ranks: every call on every rank)."""
    service = _Service(driver or LocalDriver(ctl, generate), metrics or ControllerMetrics(ctl),
                       body_limit, upload_limit)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    app = Starlette(
        routes=[Route(path, handler, methods=list(methods))
                for path, (handler, methods, _) in ROUTES.items()],
        exception_handlers={BadRequest: _bad_request, HTTPException: _http_error,
                            LifecycleError: _library_error, Exception: _internal_error},
        lifespan=lifespan)
    app.state.service = service
    return _Gatekeeper(app, service, api_key)


# -- the demo pipeline's generation ---------------------------------------------------------
def demo_generate(pipe: Any) -> Generate:
    """``/generate`` for :class:`lifecycle.demo.DemoPipeline`: body ``{"seed": int, "steps":
    int}``; answers the image's shape, dtype and the SHA-256 of its bytes."""

    async def run(ctl: LifecycleController, body: Mapping[str, Any]) -> Mapping[str, Any]:
        seed = _field(body, "seed", "integer", default=0)
        steps = _field(body, "steps", "integer", default=3)
        if not 1 <= steps <= 100:
            raise _refused(f"steps must be between 1 and 100, got {steps}")
        image: torch.Tensor = await pipe.generate(ctl=ctl, seed=seed, steps=steps)
        data = image.detach().to("cpu").contiguous()
        digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        return {"success": True, "shape": list(data.shape),
                "dtype": str(data.dtype).removeprefix("torch."), "sha256": digest,
                "weights_version": ctl.weights_version}

    return run
