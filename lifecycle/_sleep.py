"""Sleep and wake, described once: which units each moves, how each component's move is
prepared (a discarding sleep's too: see lifecycle._discard), which bytes a progress bar
counts, and what happens around the move. The controller's ``_move_all`` runs either
through a :class:`Run`, inside its transaction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strategies import ResidencyStrategy
from strategies.protocol import (
    DiscardMove,
    FileSleepMove,
    FileWakeMove,
    Move,
    PreparedMove,
    UndiscardMove,
    Unit,
    covered,
)

from . import _events as events
from ._discard import prepare_sleep, prepare_wake
from ._phase import Phase
from ._results import OccupationResult
from ._units import gbps
from ._uses import AttachedComponent

if TYPE_CHECKING:
    from ._components import Components
    from ._owner import Owner

__all__ = ["DIRECTIONS", "Direction", "Run"]

@dataclass(frozen=True)
class Direction:
    """What sleep or wake does: which units move, how they are prepared, which bytes a
    progress bar counts, and what happens around the move."""

    select: Callable[[ResidencyStrategy], list[Unit]]
    # (component, its selected units, progress, the components a sleep discards)
    prepare: Callable[[AttachedComponent, list[Unit], Callable[[int], None], frozenset[str]],
                      Awaitable[Move | DiscardMove | UndiscardMove | FileSleepMove
                                | FileWakeMove]]
    counts: Callable[[Unit], bool]  # bytes that will really be copied
    resync: bool  # take inventory again first (tensors replaced behind our back)
    empty_cache: bool  # give the freed blocks back to the driver after


DIRECTIONS: dict[str, Direction] = {
    "sleep": Direction(
        select=lambda s: s.store.select("device"),
        prepare=prepare_sleep,
        counts=lambda u: u.dirty(), resync=True, empty_cache=True),
    "wake": Direction(
        select=lambda s: [u for u in s.awake_units() if u.where == "host"],
        prepare=lambda c, units, progress, _: prepare_wake(c, units, progress),
        counts=lambda u: True, resync=False, empty_cache=False),
}


class Run:
    """One sleep or wake of ``components``: prepares every component's move (a debug
    event each), tells ``progress`` ``(trigger, bytes copied so far, bytes to copy)`` as
    copies land, and notes the components a sleep discarded (those in ``discard``, and
    stale ones). ``owner``: the controller (its logger names it in events)."""

    def __init__(self, trigger: str, components: Iterable[AttachedComponent], discard: frozenset[str],
                 progress: Callable[[str, int, int], None] | None, owner: Owner
                 ) -> None:
        self.trigger = trigger
        way = self.way = DIRECTIONS[trigger]
        self._plan = [(c, way.select(c.strategy)) for c in components]
        self._discard = discard
        self._progress = progress
        self._log = owner.log
        self._done = 0
        self._total = 0 if progress is None else sum(
            u.nbytes for _, units in self._plan for u in units if way.counts(u))
        self.moved = tuple(c.name for c, _ in self._plan)  # the components this run moves
        self.discarded: list[str] = []
        self.before = 0  # device bytes before the move (what it released: see start())

    @classmethod
    async def start(cls, trigger: str, components: Components, discard: frozenset[str],
                    progress: Callable[[str, int, int], None] | None, owner: Owner,
                    only: Collection[str] | None = None) -> Run:
        """A run over the attached ``components`` (``only``: those named, a partial sleep
        or wake), once the bookkeeping before it is done: a sleep right after a weight
        update waits for the mirror refresh still in flight (then copies only what it left
        stale), before counting what is dirty and the device bytes held; a sleep takes in
        tensors replaced behind our back."""
        await components.land_refreshes(discard)
        before = components.device_bytes()
        if DIRECTIONS[trigger].resync:
            components.rescan(trigger)
        moved = [c for c in components.values() if only is None or c.name in only]
        run = cls(trigger, moved, discard, progress, owner)
        run.before = before
        return run

    async def prepare(self, moves: list[PreparedMove]) -> None:
        """Append every component's prepared move to ``moves`` (the transaction's)."""
        for c, units in self._plan:
            m0 = time.perf_counter()
            move = await self.way.prepare(c, units, self._copied, self._discard)
            moves.append(move)
            if isinstance(move, DiscardMove):
                self.discarded.append(c.name)
            self._event(c.name, move, time.perf_counter() - m0)

    def mirrors(self) -> list[tuple[AttachedComponent, list[Unit]]]:
        """The units whose bytes this run keeps in host mirrors (a sleep's, but for the
        components it discards or keeps in files; a wake's, the host stores of the units of
        a discarded or file-backed component that live on the host while awake)."""
        if self.trigger != "sleep":
            out = []
            for c, _ in self._plan:
                if c.strategy.store.discarded is not None:
                    awake = {id(u) for u in c.strategy.awake_units()}
                    out.append((c, [u for u in c.strategy.store.units if id(u) not in awake]))
            return out
        return [(c, units) for c, units in self._plan
                if c.name not in self._discard and not c.strategy.store.stale_count
                and not covered(c.strategy.store)]

    def _copied(self, nbytes: int) -> None:
        self._done += nbytes
        if self._progress is not None:
            self._progress(self.trigger, self._done, self._total)

    def _event(self, component: str,
               move: Move | DiscardMove | UndiscardMove | FileSleepMove | FileWakeMove,
               seconds: float) -> None:
        if not events.wanted(self._log, logging.DEBUG):
            return
        self._log.debug(events.MOVE_PREPARED, component=component, to=move.to,
                        units=len(move.units), bytes=move.bytes_copied,
                        seconds=round(seconds, 6), gbps=round(gbps(move.bytes_copied, seconds), 3))

    def result(self, phase: Phase, copied: int, released: int, seconds: float
               ) -> OccupationResult:
        """The committed run's answer, ``phase`` the phase it committed."""
        discarded = self.discarded
        message = f"{self.trigger} succeeded" + (
            f" (discarded {discarded}: no host copy; update their weights after the wake)"
            if discarded else "")
        return OccupationResult(True, phase is Phase.SLEEPING, message, phase, copied, released,
                                seconds, discarded=tuple(discarded), moved=self.moved)
