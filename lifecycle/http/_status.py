"""The HTTP status of every library error: one table, walked by the error's MRO.

Every error a route lets through (the library's, the payload decoder's, the service's own)
is answered by one handler (``lifecycle.http._app``): the status is that of the first class
of the error's MRO found in :data:`STATUS` (after the route's overrides in
:data:`ROUTE_STATUS`, where the reference answers differently), the body
``{"success": false, "message": str(error), ...}`` plus what :data:`DETAILS` adds for that
class. Nothing here reads a message.

The policy (see also the app's module doc): 400 for a refused request, 409 when in-flight
work did not drain in time, 503 when a call waited too long or a rank or the ranks' group is
unavailable, 507 when a move would pass the host budget (refused before allocating), 500 for
a move that failed and was rolled back and for the library's own failures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .. import (
    AdmissionTimeout,
    ComponentAsleep,
    DrainTimeout,
    GroupBroken,
    HostBudgetExceeded,
    LifecycleError,
    ResidencyError,
    TransitionFailed,
    TransitionRejected,
    WeightsDiscarded,
)
from ..payload import TransportError
from ._driver import RanksUnavailable
from ._generations import GenerationAborted, GenerationRefused
from ._ranks import OutputsDisagree
from ._wire import WireRefused

__all__ = ["DETAILS", "ROUTE_STATUS", "STATUS", "answer_of", "status_of"]

#: Library error type -> HTTP status; an error takes the status of the first class of its
#: MRO found here. :class:`GenerationRefused` carries its own (409 or 503).
STATUS: dict[type[BaseException], int] = {
    # the library's base: its own failures (a store's, a configuration's) are ours
    ResidencyError: 500,
    LifecycleError: 400,  # a refusal that no entry below names
    TransitionRejected: 400,  # refused before anything moved
    DrainTimeout: 409,  # in-flight uses held past the drain timeout
    TransitionFailed: 500,  # failed part-way and rolled back: ours
    GroupBroken: 503,  # the ranks' process group failed
    ComponentAsleep: 400,
    WeightsDiscarded: 400,  # stale since a discarding release: update weights first
    AdmissionTimeout: 503,  # waited too long for a transition
    HostBudgetExceeded: 507,  # refused before allocating
    RanksUnavailable: 503,  # a rank does not answer
    OutputsDisagree: 500,
    WireRefused: 400,
    TransportError: 400,  # an upload that does not decode
    GenerationAborted: 503,  # the client learns why, and that nothing came back
    GenerationRefused: 409,  # its own status, see status_of
}

#: Where a route answers differently (path -> overrides, walked first): ``/generate`` while
#: not initialized is the reference's 503, not a 400 refusal.
ROUTE_STATUS: dict[str, Mapping[type[BaseException], int]] = {
    "/generate": {TransitionRejected: 503},
}


def _failed(exc: Any) -> dict[str, Any]:
    return {"rolled_back": True,
            "failed_ranks": {str(r): w for r, w in exc.failed_ranks.items()}}


def _host_budget(exc: Any) -> dict[str, Any]:
    return {"needed_bytes": exc.needed, "held_bytes": exc.held, "host_budget": exc.budget}


def _aborted(exc: Any) -> dict[str, Any]:
    return {"rid": exc.rid, "finish_reason": {"type": "abort", "message": exc.why}}


#: The body's fields besides ``success`` and ``message``, for the class :data:`STATUS`
#: answered with (exactly: :class:`GroupBroken` adds nothing though it is a
#: :class:`TransitionFailed`).
DETAILS: dict[type[BaseException], Callable[[Any], dict[str, Any]]] = {
    TransitionFailed: _failed,
    HostBudgetExceeded: _host_budget,
    WeightsDiscarded: lambda exc: {"stale": exc.components},
    GenerationAborted: _aborted,
}


def _entry(error: type[BaseException], path: str | None) -> tuple[type[BaseException], int] | None:
    overrides = ROUTE_STATUS.get(path or "", {})
    for cls in error.__mro__:
        if cls in overrides:
            return cls, overrides[cls]
        if cls in STATUS:
            return cls, STATUS[cls]
    return None


def status_of(error: type[BaseException], path: str | None = None) -> int | None:
    """The status of an error of type ``error`` on route ``path`` (None: not a library
    error; the app answers 500 for a bug)."""
    found = _entry(error, path)
    return None if found is None else found[1]


def answer_of(exc: BaseException, path: str | None = None, **extra: Any
              ) -> tuple[int, dict[str, Any]] | None:
    """The status and the JSON body answering ``exc`` on route ``path`` (``extra``: fields
    the route adds), or None when ``exc`` is not a library error."""
    found = _entry(type(exc), path)
    if found is None:
        return None
    cls, status = found
    if isinstance(exc, GenerationRefused):
        status = exc.status
    details = DETAILS.get(cls)
    body = {"success": False, "message": str(exc), **extra,
            **(details(exc) if details is not None else {})}
    return status, body
