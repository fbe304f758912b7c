"""Work handed to a thread lets go of what it was handed before the caller goes on.

A worker thread of anyio (its asyncio backend) and of ``concurrent.futures`` hands its result
back to the waiting task first and drops its own references to the function, the arguments
and the result after: a moment later, or, on a loaded machine, whenever the scheduler next
runs that thread (trio's threads drop the function first, but keep the result). Meanwhile
a buffer the caller has already let go of is still alive: a wake rolled back has freed its
device buffers, and the allocator still counts one of them held by the thread that read
into it; on a GPU the caching allocator cannot give its block to the next allocation.

:func:`to_thread` (for the event loop) and :func:`released` (for an executor) run the work
as a job that drops its function and arguments before it returns, and hands its result (or
exception) over through itself: the thread's own references end before the caller is woken,
whatever the scheduler does. The caller owns what it gets back, as if it had made the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.to_thread

__all__ = ["released", "to_thread"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class _Job(Generic[T]):
    """``fn(*args)`` once: both dropped before the call returns, the result kept for
    :meth:`take`."""

    __slots__ = ("_args", "_error", "_fn", "_result")

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self._fn: Callable[..., T] | None = fn
        self._args: tuple[Any, ...] | None = args
        self._result: T | None = None
        self._error: BaseException | None = None

    def __call__(self) -> None:
        fn, args = self._fn, self._args
        assert fn is not None and args is not None, "a job runs once"
        self._fn = self._args = None
        try:
            self._result = fn(*args)
        except BaseException as exc:  # (cancellation from the thread too): the caller's to raise
            self._error = exc
        finally:
            # On failure this frame lives on in the traceback: not with the arguments.
            del fn, args

    def take(self) -> T:
        """The result (the job's reference gone with it), or the exception raised."""
        error, result = self._error, self._result
        self._error = self._result = None
        if error is not None:
            try:
                raise error
            finally:
                del error  # (no cycle through this frame)
        return result  # type: ignore[return-value]  # (None only where fn returned None)

    def run_raising(self) -> None:
        """Run, then raise what it raised (an executor's future keeps the exception); the
        result is dropped here."""
        self()
        self.take()


async def to_thread(fn: Callable[[Unpack[Ts]], T], *args: *Ts,
                    limiter: anyio.CapacityLimiter | None = None,
                    abandon_on_cancel: bool = False) -> T:
    """``anyio.to_thread.run_sync(fn, *args)``, with the worker thread holding nothing of
    ``fn``, ``args`` or the result once the caller goes on. Abandoned (``abandon_on_cancel``),
    the job drops all of it when it ends."""
    job: _Job[T] = _Job(fn, args)
    del fn, args  # (this frame outlives the call in a cancelled caller's traceback)
    await anyio.to_thread.run_sync(job, limiter=limiter, abandon_on_cancel=abandon_on_cancel)
    return job.take()


def released(fn: Callable[[Unpack[Ts]], object], *args: *Ts) -> Callable[[], None]:
    """``fn(*args)`` for an executor's ``submit``: the work item holds only a job that has
    dropped ``fn`` and ``args`` (and ``fn``'s result) by the time the future is resolved; an
    exception still reaches the future."""
    return _Job(fn, args).run_raising
