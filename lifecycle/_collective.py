"""Transitions over several ranks: agree on the phase, vote on the outcome, all or nothing.

Every rank calls the same transition in the same order. A collective transition does:

1. *agree*: one ``all_reduce`` of ``(phase, -phase)`` with MIN gives the lowest and highest
   phase over the ranks; if they differ, every rank raises :class:`RanksDisagree` (the
   phases are gathered only then);
2. local work (checks, drain, prepare: nothing re-pointed);
3. *vote*: one ``all_reduce`` MIN of a 0/1 flag; on a 0 anywhere, the reasons are gathered
   (``all_gather_object``, each a :class:`RankFailure`: the error's class name and its
   text) and every rank drops what it prepared;
4. commit on every rank, or on none.

Every rank votes exactly once per stage, whatever happened locally (an exception before the
vote votes 0 on its way out), so the ranks stay in lock step. Collectives run in a worker
thread (the event loop keeps serving) with ``collective_timeout``: a rank that died or hung
makes the others roll back and raise :class:`GroupBroken`; the group is then unusable (gloo
cannot reuse a failed group) until :meth:`LifecycleController.rebind`.

:class:`RankGroup` runs the collectives, :class:`Section` holds one transition's votes, and
:class:`Collective` is a controller's side of both (its errors are the library's).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar

import anyio
import torch
import torch.distributed as dist

from strategies.protocol import to_thread

from ._errors import DrainTimeout, GroupBroken, RankFailure, RanksDisagree, TransitionFailed
from ._owner import Owner
from ._phase import Phase
from ._results import RankChecksums

__all__ = ["Collective", "GroupFailure", "RankGroup", "Section", "describe"]

T = TypeVar("T")
_CODES = {p: i for i, p in enumerate(Phase)}
_ALONE: AbstractAsyncContextManager[None] = contextlib.nullcontext()  # stateless: shared


def describe(failures: Mapping[int, RankFailure]) -> str:
    """``rank r: why`` for every failed rank, in rank order."""
    return "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))


class GroupFailure(RuntimeError):
    """A collective failed or timed out (a peer died or hung)."""


class RankGroup:
    """A torch.distributed process group used for votes, with a timeout per collective."""

    def __init__(self, group: Any, timeout: float) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group needs torch.distributed initialised "
                             "(init_process_group) with a CPU-capable backend such as gloo")
        self.group = group
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.broken: str | None = None
        self._limiter = anyio.CapacityLimiter(1)  # one collective at a time, in order

    def describe(self) -> str:
        return f"group of {self.world_size} rank(s) (this is rank {self.rank})"

    async def _run(self, fn: Callable[[], T]) -> T:
        if self.broken is not None:
            raise GroupFailure(self.broken)
        try:
            with anyio.CancelScope(shield=True):  # a collective is never abandoned midway
                result = await to_thread(fn, limiter=self._limiter)
        except (RuntimeError, ValueError) as exc:  # gloo: peer closed, timed out
            self.broken = f"{type(exc).__name__}: {exc}"
            raise GroupFailure(self.broken) from exc
        return result

    def _all_reduce_min(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        assert work is not None
        if not work.wait(timeout=timedelta(seconds=self.timeout)):
            raise RuntimeError(f"collective timed out after {self.timeout:g} s")
        return [int(v) for v in t.tolist()]

    def _gather(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    async def gather(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order."""
        return await self._run(lambda: self._gather(obj))

    async def phases(self, phase: Phase) -> dict[int, str] | None:
        """None when every rank is in ``phase``'s phase; else every rank's phase."""
        code = _CODES[phase]
        low, neg_high = await self._run(lambda: self._all_reduce_min([code, -code]))
        if low == -neg_high:
            return None
        gathered = await self._run(lambda: self._gather(phase.value))
        return {r: str(p) for r, p in enumerate(gathered)}

    async def vote(self, failure: RankFailure | None) -> dict[int, RankFailure]:
        """Every rank's failure (none: this rank votes ok), empty when every rank voted ok."""
        (all_ok,) = await self._run(lambda: self._all_reduce_min([int(failure is None)]))
        if all_ok:
            return {}
        gathered = await self._run(lambda: self._gather(failure))
        return {r: why for r, why in enumerate(gathered) if isinstance(why, RankFailure)}


class Section:
    """One collective transition's votes on this rank (see the module docstring)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.closed = False  # the deciding vote happened

    async def vote(self, error: BaseException | None) -> dict[int, RankFailure]:
        """Vote (ok when ``error`` is None); returns the failures of every rank."""
        return await self.group.vote(None if error is None else RankFailure.of(error))


class Collective:
    """A controller's transitions over its process group (none: one rank, nothing to agree
    on): the phase agreed before each, this rank's votes during it, the group replaced by
    :meth:`rebind`. ``owner``: the controller (its phase now is named in errors)."""

    def __init__(self, process_group: Any, timeout: float, owner: Owner) -> None:
        self.group = None if process_group is None else RankGroup(process_group, timeout)
        self._owner = owner
        self._section: Section | None = None  # the collective transition in progress

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.world_size

    def rebind(self, process_group: Any, timeout: float | None) -> int:
        """Make transitions collective over ``process_group`` (``timeout``: the old group's,
        else 30 s); returns this rank's rank in it."""
        if timeout is None:
            timeout = self.group.timeout if self.group is not None else 30.0
        self.group = RankGroup(process_group, timeout)
        return self.group.rank

    def section(self, trigger: str) -> AbstractAsyncContextManager[None]:
        """Around a transition on every rank: agree on the phase first; an error before the
        deciding vote still votes (no on its way out), so the ranks stay in lock step. One
        rank: nothing to agree on (no generator made: a clean sleep enters this)."""
        return _ALONE if self.group is None else self._section_of(trigger, self.group)

    @asynccontextmanager
    async def _section_of(self, trigger: str, group: RankGroup) -> AsyncIterator[None]:
        if group.broken is not None:
            raise GroupBroken(trigger, self._owner.phase, GroupFailure(group.broken),
                              group.describe())
        try:
            phases = await group.phases(self._owner.phase)
        except GroupFailure as exc:
            raise GroupBroken(trigger, self._owner.phase, exc, group.describe()) from exc
        if phases is not None:
            raise RanksDisagree(trigger, self._owner.phase, phases)
        section = self._section = Section(group)
        try:
            yield
        except BaseException as exc:
            if not section.closed:
                section.closed = True
                try:
                    failures = await section.vote(exc)
                except GroupFailure as broken:
                    raise GroupBroken(trigger, self._owner.phase, broken, group.describe()) from exc
                if isinstance(exc, DrainTimeout):
                    exc.failed_causes = failures
            raise
        finally:
            self._section = None

    async def vote(self, trigger: str, error: BaseException | None, *, final: bool
                   ) -> dict[int, RankFailure]:
        """This rank's vote in the collective transition in progress; returns every rank's
        failure (none outside a collective transition: one rank votes nothing). ``final``:
        the deciding vote."""
        section = self._section
        if section is None:
            return {}
        if final:
            section.closed = True
        try:
            failures = await section.vote(error)
        except GroupFailure as broken:
            section.closed = True
            raise GroupBroken(trigger, self._owner.phase, broken, section.group.describe()) \
                from error
        if failures and not final:
            section.closed = True
        return failures

    async def decide(self, trigger: str, error: BaseException | None
                     ) -> tuple[BaseException | None, dict[int, RankFailure]]:
        """A transaction's deciding vote (all commit or none; one rank: no vote, and no
        failures): this rank's error, if any, and every rank's failures. A group that breaks
        now is this rank's error (it rolls back alone)."""
        try:
            return error, await self.vote(trigger, error, final=True)
        except BaseException as exc:
            return exc, {}

    def failure(self, trigger: str, error: BaseException, failures: dict[int, RankFailure], *,
                own: bool, drain_timeout: float | None) -> BaseException:
        """What a transaction rolled back for ``error`` raises here: other ranks' failures
        wrap it in :class:`TransitionFailed`; when they alone failed (``own`` false: ``error``
        only reports them) and none of them could drain, the same refusal as theirs."""
        if not own and all(f.cause == DrainTimeout.__name__ for f in failures.values()):
            # Other ranks could not drain: the same refusal as theirs, on every rank.
            held = [f"rank {r}" for r in sorted(failures)]
            return DrainTimeout(trigger, self._owner.phase, held, drain_timeout or 0.0, failures)
        if failures and isinstance(error, Exception) and not isinstance(error, TransitionFailed):
            failed = TransitionFailed(trigger, self._owner.phase, error, failures)
            failed.__cause__ = error  # as ``raise failed from error``
            return failed
        return error

    async def checksums(self, local: dict[str, str], rank: int) -> RankChecksums:
        """Every rank's ``local`` checksums by component and rank (collective: every rank
        calls it); a component a rank lacks reads ``"not_found"``."""
        if self.group is None:
            return RankChecksums({n: {rank: s} for n, s in local.items()})
        try:
            gathered = await self.group.gather(local)
        except GroupFailure as exc:
            raise GroupBroken("checksum", self._owner.phase, exc, self.group.describe()) from exc
        names = sorted({n for g in gathered if isinstance(g, dict) for n in g})
        return RankChecksums({n: {r: g.get(n, "not_found") if isinstance(g, dict)
                                  else "not_found" for r, g in enumerate(gathered)}
                              for n in names})
