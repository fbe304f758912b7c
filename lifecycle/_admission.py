"""Admission control: leases for in-flight work, a gate that transitions close, draining.

A ``use()`` (and a request-level prefetch) holds a *lease*. A transition that moves weights
closes the gate (new uses wait for it to reopen), then waits for the leases to be returned,
at most ``drain_timeout`` seconds; on timeout the gate reopens and nothing has moved.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio

from ._errors import AdmissionTimeout, DrainTimeout
from ._owner import Owner

__all__ = ["Admission"]


class Admission:
    """Leases and the gate. All methods run on the event-loop thread."""

    def __init__(self, drain_timeout: float | None, admission_timeout: float | None) -> None:
        self.drain_timeout = drain_timeout
        self.admission_timeout = admission_timeout
        self._ids = itertools.count(1)
        self._leases: dict[int, str] = {}
        self._closed_by: str | None = None
        self._reopened = anyio.Event()
        self._reopened.set()
        self._returned = anyio.Event()
        self._exempt: frozenset[int] = frozenset()  # leases the drain in progress ignores

    @property
    def in_flight(self) -> int:
        return len(self._leases)

    @property
    def closed_by(self) -> str | None:
        """The trigger holding the gate closed, if any."""
        return self._closed_by

    def held(self) -> list[str]:
        return sorted(self._leases.values())

    def take(self, what: str) -> int:
        lease = next(self._ids)
        self._leases[lease] = what
        return lease

    def _drained(self) -> bool:
        return self._leases.keys() <= self._exempt

    def give(self, lease: int) -> None:
        if self._leases.pop(lease, None) is not None and self._drained():
            self._returned.set()

    async def wait_open(self, component: str) -> None:
        """Wait until no transition holds the gate (at most ``admission_timeout``)."""
        if self._closed_by is None:
            return
        transition = self._closed_by
        try:
            with anyio.fail_after(self.admission_timeout):
                while self._closed_by is not None:
                    await self._reopened.wait()
        except TimeoutError:
            raise AdmissionTimeout(component, self.admission_timeout or 0.0, transition) from None

    @asynccontextmanager
    async def closed(self, trigger: str, owner: Owner,
                     before_drain: Callable[[], Awaitable[None]] | None = None,
                     exempt: frozenset[int] = frozenset()) -> AsyncIterator[None]:
        """Close the gate, drain the leases (but ``exempt``: the caller's own request),
        run the body, reopen (on every exit path)."""
        assert self._closed_by is None, "transitions are serialised by the controller's lock"
        self._closed_by = trigger
        self._reopened = anyio.Event()
        self._exempt = exempt
        try:
            if before_drain is not None:
                await before_drain()
            if not self._drained():
                self._returned = anyio.Event()
                with anyio.move_on_after(self.drain_timeout):
                    await self._returned.wait()
                if not self._drained():
                    held = [w for lease, w in sorted(self._leases.items())
                            if lease not in exempt]
                    raise DrainTimeout(trigger, owner.phase, held, self.drain_timeout or 0.0)
            yield
        finally:
            self._closed_by = None
            self._exempt = frozenset()
            self._reopened.set()
