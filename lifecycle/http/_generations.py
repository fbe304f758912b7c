"""Generation control on the wire: the generations in flight, pausing, continuing, aborting.

Every ``/generate`` runs inside :meth:`Generations.running`, under an id (the body's ``rid``,
or one made up) and a cancel scope of its own. :meth:`Generations.pause` in mode ``abort``
cancels every generation in flight (its client gets a 503 saying it was aborted, and why)
and refuses new ones until :meth:`Generations.resume`; in the other modes (SGLang's
``in_place`` and ``retract``, vLLM's ``wait`` and ``keep``) generations in flight run to
their end (a diffusion pipeline has no step boundary the server could hold them at) and new
ones wait for the resume, at most ``admission_timeout`` seconds (then a 503); ``wait`` also
waits, at most ``drain_timeout``, for those in flight to finish before answering. A weight
update or a release while paused finds no generation in flight: it has nothing left to
drain. :meth:`Generations.abort` ends one generation by id, or all, without pausing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

__all__ = ["ABORT_MODES", "MODES", "GenerationAborted", "GenerationRefused", "Generations"]

#: Every pause mode served: SGLang's (``abort``, ``in_place``, ``retract``), vLLM's (``abort``,
#: ``wait``, ``keep``).
MODES: tuple[str, ...] = ("abort", "in_place", "retract", "wait", "keep")
#: The modes that end the generations in flight.
ABORT_MODES = frozenset({"abort"})


class GenerationAborted(Exception):
    """A generation was ended by an abort (answered 503 with this message)."""

    def __init__(self, rid: str, why: str) -> None:
        super().__init__(f"generation {rid!r} was aborted ({why}); nothing was returned")
        self.rid = rid
        self.why = why


class GenerationRefused(Exception):
    """A generation refused (paused with mode abort; a pause that outlasted the admission
    timeout; a duplicate id): answered with ``status`` and this message."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Generations:
    """The generations in flight and the pause state of one server (event-loop thread only)."""

    def __init__(self, admission_timeout: float | None, drain_timeout: float | None) -> None:
        self.admission_timeout = admission_timeout
        self.drain_timeout = drain_timeout
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._why: dict[str, str] = {}  # rid -> why it was aborted
        self._ids = itertools.count(1)
        self.mode: str | None = None  # the pause mode while paused
        self._resumed = anyio.Event()
        self._resumed.set()
        self._idle = anyio.Event()
        self._idle.set()

    @property
    def paused(self) -> bool:
        return self.mode is not None

    @property
    def in_flight(self) -> list[str]:
        return sorted(self._scopes)

    @asynccontextmanager
    async def running(self, rid: object = None) -> AsyncIterator[str]:
        """Run one generation (its id given): waits while paused (not in mode abort: then
        refused), at most the admission timeout; raises :class:`GenerationAborted` when an
        abort cancelled it."""
        if rid is not None and not isinstance(rid, str):
            raise GenerationRefused(f"rid must be a string, got {type(rid).__name__}", 400)
        if rid is None:
            rid = f"generation-{next(self._ids)}"
        if rid in self._scopes:
            raise GenerationRefused(f"a generation with rid {rid[:80]!r} is in flight; ids "
                                    "must be unique", 400)
        await self._admit()
        scope = anyio.CancelScope()
        self._scopes[rid] = scope
        self._idle = anyio.Event()
        try:
            with scope:
                yield rid
        finally:
            del self._scopes[rid]
            if not self._scopes:
                self._idle.set()
        why = self._why.pop(rid, None)
        if scope.cancelled_caught and why is not None:
            raise GenerationAborted(rid, why)

    async def _admit(self) -> None:
        if self.mode in ABORT_MODES:
            raise GenerationRefused("generation is paused (mode 'abort'); call "
                                    "/continue_generation (or /resume) first", 503)
        if self.mode is None:
            return
        timeout = math.inf if self.admission_timeout is None else self.admission_timeout
        with anyio.move_on_after(timeout):
            while self.mode is not None and self.mode not in ABORT_MODES:
                await self._resumed.wait()
            if self.mode in ABORT_MODES:  # paused again, to abort, while this one waited
                raise GenerationRefused("generation is paused (mode 'abort'); call "
                                        "/continue_generation (or /resume) first", 503)
            return
        raise GenerationRefused(f"generation is paused (mode {self.mode!r}) and was not "
                                f"continued within {timeout:g} s; call /continue_generation "
                                "(or /resume)", 503)

    def abort(self, rid: str | None, why: str) -> int:
        """End generation ``rid`` (None: every one) in flight; how many were ended."""
        targets = self.in_flight if rid is None else [r for r in self.in_flight if r == rid]
        for r in targets:
            self._why[r] = why
            self._scopes[r].cancel()
        return len(targets)

    async def pause(self, mode: str) -> int:
        """Pause in ``mode`` (see the module doc); returns how many generations it aborted.
        ``wait`` answers once none is in flight; past ``drain_timeout`` it raises
        :class:`GenerationRefused` (409) and the pause is undone."""
        assert mode in MODES, mode
        before = self.mode
        self.mode = mode
        # Waiters look at the mode again (a pause to abort refuses those queued by another).
        waiting, self._resumed = self._resumed, anyio.Event()
        waiting.set()
        aborted = self.abort(None, f"paused with mode {mode!r}") if mode in ABORT_MODES else 0
        if mode in ABORT_MODES or mode == "wait":
            timeout = math.inf if self.drain_timeout is None else self.drain_timeout
            with anyio.move_on_after(timeout):
                await self._idle.wait()
            if self._scopes and mode == "wait":
                held = self.in_flight
                if before is None:
                    self.resume()
                else:
                    self.mode = before
                raise GenerationRefused(f"generations {held[:8]} were still running after "
                                        f"{timeout:g} s; not paused", 409)
        return aborted

    def resume(self) -> bool:
        """Continue; whether it was paused."""
        was = self.mode is not None
        self.mode = None
        self._resumed.set()
        return was
