"""Every library error's HTTP status comes from one table (lifecycle.http._status), and no
answer is chosen by searching a message."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

import lifecycle
import lifecycle.http
import strategies
from lifecycle import (
    AdmissionTimeout,
    DrainTimeout,
    GroupBroken,
    HostBudgetExceeded,
    InvalidRequest,
    LifecycleController,
    Phase,
    StoreError,
    TransitionFailed,
    TransitionRejected,
    WeightsDiscarded,
)
from lifecycle._errors import RankFailure
from lifecycle.http import create_app
from lifecycle.http._driver import LocalDriver, RanksUnavailable
from lifecycle.http._generations import GenerationAborted, GenerationRefused
from lifecycle.http._ranks import OutputsDisagree
from lifecycle.http._status import ROUTE_STATUS, STATUS, status_of
from lifecycle.http._wire import WireRefused
from lifecycle.payload import PayloadModulesMismatch, TransportError

# The policy, class by class: every error class lifecycle and strategies export, and the
# service's own. A new error class fails here until it is given its status.
EXPECTED = {
    "AdmissionTimeout": 503, "CheckpointChanged": 500, "CheckpointMismatch": 400,
    "ComponentAsleep": 400, "ComponentBusy": 400, "ComponentNotPlaced": 400,
    "ComponentResidencyError": 500, "DrainTimeout": 409, "FSDPInferenceUnsupported": 400,
    "GroupBroken": 503, "HandOffExceedsBudget": 400, "HostBudgetExceeded": 507,
    "InfeasibleBudget": 400, "InvalidRequest": 400, "LifecycleError": 400,
    "RanksDisagree": 400, "ResidencyError": 500, "StoreError": 500, "TransitionFailed": 500,
    "TransitionRejected": 400, "UnknownComponent": 400, "UnsupportedCompute": 500,
    "WeightSyncError": 400, "WeightSyncGroupBroken": 400, "WeightSyncGroupMissing": 400,
    "WeightUpdateWhileSleeping": 400, "WeightsDiscarded": 400,
    # the service's
    "RanksUnavailable": 503, "WireRefused": 400, "TransportError": 400,
    "PayloadModulesMismatch": 400, "OutputsDisagree": 500, "GenerationAborted": 503,
    "GenerationRefused": 409,
}
SERVICE_ERRORS = (RanksUnavailable, WireRefused, TransportError, PayloadModulesMismatch,
                  OutputsDisagree, GenerationAborted, GenerationRefused)


def library_errors() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {e.__name__: e for e in SERVICE_ERRORS}
    for package in (lifecycle, strategies):
        for name in package.__all__:
            value = getattr(package, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found[name] = value
    return found


def test_every_library_error_has_its_status_in_the_table() -> None:
    """Walking the table by MRO gives every exported error class (and the service's own) its
    documented status; /generate alone answers a refused transition with 503 (the
    reference's "not initialized"), and every table entry is a status code."""
    errors = library_errors()
    assert set(errors) == set(EXPECTED)
    assert {name: status_of(cls) for name, cls in errors.items()} == EXPECTED
    for name, cls in errors.items():
        on_generate = status_of(cls, "/generate")
        assert on_generate == (503 if issubclass(cls, TransitionRejected)
                               and not issubclass(cls, DrainTimeout) else EXPECTED[name])
    assert all(400 <= s < 600 for s in STATUS.values())
    assert all(400 <= s < 600 for overrides in ROUTE_STATUS.values() for s in overrides.values())
    assert status_of(KeyError) is None  # not a library error: a bug, answered 500


class Raising(LocalDriver):
    """A driver whose /state and /generate raise the error the test sets."""

    error: BaseException = RuntimeError("unset")

    @property
    def can_generate(self) -> bool:
        return True

    async def state(self) -> dict[str, Any]:
        raise self.error

    async def generate(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        raise self.error


CASES: list[tuple[str, BaseException, int, dict[str, Any]]] = [
    ("/state", DrainTimeout("sleep", Phase.AWAKE, ["u"], 1.0), 409, {}),
    ("/state", TransitionRejected("sleep", Phase.AWAKE, "not now"), 400, {}),
    ("/generate", TransitionRejected("generate", Phase.UNINITIALIZED,
                                     "pipeline not initialized"), 503, {}),
    ("/state", TransitionFailed("wake", Phase.SLEEPING, RuntimeError("boom"),
                                {1: RankFailure("RuntimeError", "boom")}), 500,
     {"rolled_back": True, "failed_ranks": {"1": "RuntimeError: boom"}}),
    ("/state", GroupBroken("wake", Phase.SLEEPING, RuntimeError("gone"), "group"), 503, {}),
    ("/state", AdmissionTimeout("transformer", 1.0, "sleep"), 503, {}),
    ("/state", HostBudgetExceeded(10, 5, 8), 507,
     {"needed_bytes": 10, "held_bytes": 5, "host_budget": 8}),
    ("/state", InvalidRequest("tags", "name nothing"), 400, {}),
    ("/generate", WeightsDiscarded({"transformer": ["a.weight"]}), 400,
     {"stale": {"transformer": 1}}),
    ("/state", StoreError("the store is inconsistent"), 500, {}),
    ("/state", RanksUnavailable("rank(s) [1] do not respond"), 503, {}),
    ("/state", WireRefused("no payload for this GPU"), 400, {}),
    ("/state", TransportError("not valid base64 (3 characters)"), 400, {}),
    ("/generate", OutputsDisagree("the ranks' outputs differ"), 500, {}),
    ("/generate", GenerationAborted("7", "paused"), 503,
     {"rid": "7", "finish_reason": {"type": "abort", "message": "paused"}}),
    ("/generate", GenerationRefused("paused with mode abort", 409), 409, {}),
    ("/generate", GenerationRefused("the pause outlasted the admission timeout", 503), 503, {}),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "error", "status", "details"), CASES,
                         ids=[f"{p}-{type(e).__name__}-{s}" for p, e, s, _ in CASES])
async def test_a_library_error_through_a_route_gets_the_tables_status_and_its_message(
        path: str, error: BaseException, status: int, details: dict[str, Any]) -> None:
    """A route that lets a library error through is answered by the one handler: the
    table's status, ``{"success": false, "message": str(error)}`` and the class's details."""
    async with LifecycleController("cpu") as ctl:
        driver = Raising(ctl, None)
        driver.error = error
        app = create_app(ctl, driver=driver)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await (client.get(path) if path == "/state" else client.post(path, json={}))
    assert r.status_code == status, r.text
    assert r.json() == {"success": False, "message": str(error), **details}


# What choosing an answer by a message's text looks like: searching an error's or a
# result's text, or cutting it apart.
_SEARCHES = {
    "a search in an error's text": re.compile(r"\bin\s+str\("),
    "a search in a message or reason": re.compile(
        r"\bin\s+(?:[\w\]\[.]+\.)?(?:message|messages|reason|reasons|why|text)\b"),
    "a class name searched for": re.compile(r"[\"'][A-Z]\w+[\"']\s+in\b"),
    "a message cut apart": re.compile(
        r"(?:message|reason|why|str\([^()]*\))\s*\.\s*(?:split|rsplit|partition|rpartition|"
        r"startswith|endswith|find|rfind|index|count)\("),
    "the stale note parsed": re.compile(r"still stale\""),
}


def test_no_http_answer_is_chosen_by_searching_a_message() -> None:
    """No module of lifecycle.http searches or cuts the text of an error or a result to
    choose an answer: what it needs is a type (the status table) or a field (an update's
    ``causes`` and ``stale_tensors``)."""
    root = Path(lifecycle.http.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            found += [f"{path.name}:{n}: {what}: {line.strip()}"
                      for what, pattern in _SEARCHES.items() if pattern.search(code)]
    assert not found, "\n".join(found)


def test_the_search_patterns_catch_what_they_forbid() -> None:
    """The patterns above find the two answers that once read messages (so the grep can
    fail), and not the ordinary checks of the service."""
    forbidden = ['return result.rolled_back and any("WeightSyncTransferFailed" in r for r in '
                 "reasons)",
                 "_, found, rest = result.message.partition(_STILL_STALE)",
                 'if "LoraMergeNotFinite" in str(exc):', 'ours = "rolled back" in message']
    for line in forbidden:
        assert any(p.search(line) for p in _SEARCHES.values()), line
    for line in ['if "\\0" in path:', 'names = [n.strip() for n in value.split(",")]',
                 "return WeightSyncTransferFailed.__name__ in result.causes"]:
        assert not any(p.search(line) for p in _SEARCHES.values()), line
