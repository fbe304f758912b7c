"""The answers every route module shares (lifecycle.http._routes, _control, _transfer):
an occupation result's, an update's, a group call's, and the road of a release or resume."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import OccupationResult, Phase, UpdateResult
from .._discard import stale_note
from ._bodies import json_body
from ._state import Service, service_of
from ._wire import client_fault, trainer_failed

__all__ = ["Handler", "Routes", "group_result", "occupation", "transition", "update",
           "update_response"]

Handler = Callable[[Request], Awaitable[Response]]
#: path -> (handler, methods, needs the API key)
Routes = dict[str, tuple[Handler, tuple[str, ...], bool]]


def occupation(result: OccupationResult) -> Response:
    # success (and idempotent repeats) 200; a failure result ("pipeline not initialized") 400
    return JSONResponse(result.as_dict(), status_code=200 if result.success else 400)


async def transition(request: Request,
                     call: Callable[[Mapping[str, Any]], Awaitable[OccupationResult]]
                     ) -> Response:
    """A release or resume; ``call`` gets the body (clients send ``{}`` or ``{"tags": [...]}``:
    see lifecycle.http._control.components_of), which must be valid JSON."""
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    # A refusal says whether the pipeline sleeps (see lifecycle.http._app._library_error).
    request.state.answer_extra = lambda: {"sleeping": service.ctl.phase is Phase.SLEEPING}
    return occupation(await call(body))


def update_response(result: UpdateResult, *, trainer: bool = False) -> Response:
    """An update's answer: 200, or 400 for a refusal. A rollback is a 500 (our failure),
    except, with ``trainer``, one caused by the trainer's broadcast (it died or stalled: the
    client's side), a 400 like the reference's failed updates. ``stale``: the components
    still stale after it (discarded tensors no update wrote yet: how many); a success says so
    in its message too, with a few names, so that a trainer sees a partial update."""
    stale = dict(result.stale)
    if result.success:
        names = ", ".join(result.updated)
        # The stale components' tensors (a few names), else their counts at least.
        note = stale_note(result.stale_tensors) if result.stale_tensors else \
            "; still stale: " + ", ".join(f"{n} ({k} tensor(s))" for n, k in stale.items())
        return JSONResponse({"success": True, "version": result.version,
                             "message": f"Updated {len(result.updated)} modules ({names})."
                                        + (note if stale else ""),
                             "bytes_written": result.bytes_written, "seconds": result.seconds,
                             "weight_version": result.weight_version, "stale": stale})
    ours = result.rolled_back and not (trainer and trainer_failed(result)) \
        and not client_fault(result)
    return JSONResponse({"success": False, "message": result.message, "version": result.version,
                         "rolled_back": result.rolled_back,
                         "weight_version": result.weight_version, "stale": stale},
                        status_code=500 if ours else 400)


async def update(service: Service, call: Callable[[], Awaitable[UpdateResult]], *,
                 trainer: bool = False) -> Response:
    return update_response(await call(), trainer=trainer)


async def group_result(call: Callable[[], Awaitable[Any]]) -> Response:
    result = await call()
    return JSONResponse(result.as_dict(), status_code=200 if result.success else 400)

