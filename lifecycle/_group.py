"""Transitions over several ranks: agree on the phase, vote on the outcome, all or nothing.

Every rank calls the same transition in the same order. A collective transition does:

1. *agree*: one ``all_reduce`` of ``(phase, -phase)`` with MIN gives the lowest and highest
   phase over the ranks; if they differ, every rank raises :class:`RanksDisagree` (the
   phases are gathered only then);
2. local work (checks, drain, prepare: nothing re-pointed);
3. *vote*: one ``all_reduce`` MIN of a 0/1 flag; on a 0 anywhere, the reasons are gathered
   (``all_gather_object``) and every rank drops what it prepared;
4. commit on every rank, or on none.

Every rank votes exactly once per stage, whatever happened locally (an exception before the
vote votes 0 on its way out), so the ranks stay in lock step. Collectives run in a worker
thread (the event loop keeps serving) with ``collective_timeout``: a rank that died or hung
makes the others roll back and raise :class:`GroupBroken`; the group is then unusable (gloo
cannot reuse a failed group) until :meth:`LifecycleController.rebind`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from ._phase import Phase

__all__ = ["GroupFailure", "RankGroup", "Section"]

T = TypeVar("T")
_CODES = {p: i for i, p in enumerate(Phase)}


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
                result = await anyio.to_thread.run_sync(fn, limiter=self._limiter)
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

    async def vote(self, ok: bool, reason: str | None) -> dict[int, str]:
        """Every rank's failure reason, empty when every rank voted ok."""
        (all_ok,) = await self._run(lambda: self._all_reduce_min([1 if ok else 0]))
        if all_ok:
            return {}
        gathered = await self._run(lambda: self._gather(None if ok else (reason or "failed")))
        return {r: str(why) for r, why in enumerate(gathered) if why is not None}


class Section:
    """One collective transition's votes on this rank (see the module docstring)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.closed = False  # the deciding vote happened

    async def vote(self, error: BaseException | None) -> dict[int, str]:
        """Vote (ok when ``error`` is None); returns the failures of every rank."""
        reason = None if error is None else f"{type(error).__name__}: {error}"
        return await self.group.vote(error is None, reason)
