"""Placing components for ``use()``, and moving the next one in ahead of time.

A use holds a lease (see ``_admission``) and places its component per its strategy: the
first concurrent user brings it in, the last one sends it back. Within a ``request()`` the
next component in the declared order is prepared in the background while the current one
runs (a *prefetch*, itself holding a lease): its bytes are copied but nothing is re-pointed
until its ``use()`` commits the move, so dropping an unused prefetch only frees buffers.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from torch import nn

from strategies import DeviceLayer, ResidencyStrategy
from strategies.protocol import ComputeGuard, Move, to_thread

from . import _events as events
from ._admission import Admission
from ._discard import refuse_stale
from ._errors import (
    NOT_INITIALIZED,
    ComponentAsleep,
    TransitionRejected,
    UnknownComponent,
    failures_roll_back,
    forget_locals,
)
from ._phase import Phase

if TYPE_CHECKING:
    from ._components import Components
    from ._owner import Owner

__all__ = ["AttachedComponent", "Recording", "UseRecord", "Uses"]

@dataclass(eq=False)
class _Prefetch:
    """A component's use-placement prepared ahead of its ``use()`` within a request."""

    lease: int
    scope: anyio.CancelScope | None = None
    started: bool = False  # prepare_use was called: dropping it needs finish_use
    ready: bool = False  # prepared successfully: use() commits ``move``
    cancelled: bool = False  # no longer wanted: its task drops it
    dropped: bool = False  # lease returned, buffers released
    move: Move | None = None

    def cancel(self) -> None:
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()


@dataclass(eq=False)
class AttachedComponent:
    """An attached component: its module, strategy, guard and use bookkeeping."""

    name: str
    module: nn.Module
    strategy: ResidencyStrategy
    guard: ComputeGuard | None = None
    users: int = 0
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    fsdp: bool = False
    prefetch: _Prefetch | None = None


@dataclass(frozen=True)
class UseRecord:
    """One use seen while recording (the planner's warm-up): the component, the root
    forwards it ran, the seconds of its body (the use's own time, layer-copy stalls taken
    out), the seconds spent bringing it in and out, and the request it ran in."""

    name: str
    forwards: int
    seconds: float
    placing_seconds: float
    request: int | None  # id of the request, if in one
    order: tuple[str, ...] = ()  # that request's declared order


@dataclass(eq=False)
class Recording:
    """What the planner's warm-up records: every use, and the root forwards per component
    (counted by the planner's forward pre-hooks)."""

    uses: list[UseRecord] = field(default_factory=list)
    forwards: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Request:
    order: tuple[str, ...]
    tg: anyio.abc.TaskGroup
    lease: int
    position: int = -1
    started: set[str] = field(default_factory=set)


def _stalled(c: AttachedComponent) -> float:
    """Seconds ``c``'s forwards have waited for layer copies (layerwise offload), so far."""
    return float(getattr(c.strategy, "stalled", 0.0))


class Uses:
    """Leases, placement around uses, and request-level prefetch for one controller.

    ``components``: the controller's registry (read here, changed only by the controller);
    ``owner``: the controller (its phase now; its rank and id named in events)."""

    def __init__(self, admission: Admission, layer: DeviceLayer, components: Components,
                 owner: Owner, wake: Callable[[], Awaitable[object]],
                 threads: anyio.CapacityLimiter | None = None, *, auto_wake: bool = False,
                 prefetch_components: bool = True, prefetch_headroom: int = 2**30) -> None:
        self.admission = admission
        self.layer = layer
        self.components = components
        self.owner = owner
        self.wake = wake
        self.threads = threads  # the controller's worker threads (None: anyio's default)
        self.auto_wake = auto_wake
        self.prefetch_components = prefetch_components
        self.prefetch_headroom = prefetch_headroom  # bytes a prefetch leaves free (_prefetch_next)
        # The request this task is in, *for this controller*: one variable per controller,
        # so a use of another controller inside our request is none of our business.
        self._request: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
            f"residency_request_{id(self):x}", default=None)
        self._recording: Recording | None = None  # the planner's warm-up, while it runs

    @contextmanager
    def recording(self, into: Recording) -> Iterator[Recording]:
        """Record every use into ``into`` for the length of the with-block."""
        self._recording = into
        try:
            yield into
        finally:
            self._recording = None

    # -- use ---------------------------------------------------------------------------
    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[nn.Module]:
        await self._admit(name)
        c = self.components.component(name)
        refuse_stale([c])  # discarded weights not updated yet serve nothing
        lease = self.admission.take(name)
        t0 = time.perf_counter()
        try:
            await self._acquire(c)
            try:
                self._prefetch_next(name)
                t1, stalled, forwards = time.perf_counter(), _stalled(c), self._forwards(name)
                yield c.module
                t2 = time.perf_counter()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._release(c)
            if self._recording is not None:
                req = self._request.get()
                self._recording.uses.append(UseRecord(
                    name, self._forwards(name) - forwards,
                    max(0.0, t2 - t1 - (_stalled(c) - stalled)),
                    (t1 - t0) + (time.perf_counter() - t2) + (_stalled(c) - stalled),
                    None if req is None else id(req), () if req is None else req.order))
        finally:
            self.admission.give(lease)

    def _forwards(self, name: str) -> int:
        return 0 if self._recording is None else self._recording.forwards.get(name, 0)

    async def _admit(self, name: str) -> None:
        if self._request.get() is not None:
            # A use inside a request of ours: the request holds a lease, so a transition is
            # draining it, not starting; its uses go on (waiting would deadlock the drain).
            if self.owner.phase is Phase.SLEEPING or name in self.components.asleep:
                raise ComponentAsleep(name)
            return
        while True:
            await self.admission.wait_open(name)
            if self.owner.phase is Phase.SLEEPING or name in self.components.asleep:
                if not self.auto_wake:
                    raise ComponentAsleep(name)
                await self.wake()  # many waiters: the first moves, the rest see "already awake"
                continue
            if self.owner.phase is Phase.UNINITIALIZED:
                raise TransitionRejected("use", self.owner.phase, NOT_INITIALIZED)
            if self.admission.closed_by is None:
                return

    async def _acquire(self, c: AttachedComponent) -> None:
        async with c.lock:
            if not c.users:
                # Moved by hand since (``module.to(torch.float64)``): taken as it is if
                # resident, else refused naming the change, as transitions do; never
                # silently put back the way it was by this move-in.
                self.components.rescan("use", [c.name])
            c.users += 1
            if c.users > 1:
                return
            with failures_roll_back("use", self.owner):
                try:
                    pf = c.prefetch
                    if pf is not None and pf.ready:
                        c.prefetch = None
                        self.admission.give(pf.lease)
                        move = pf.move
                    else:
                        move = await c.strategy.prepare_use()
                    if move is not None:
                        move.commit()
                except BaseException as exc:
                    # The frames the error passed through held the move-in's buffers (its
                    # copy pairs): forgotten, as sleep, wake and updates do, or they stay
                    # allocated for as long as the caller holds the error.
                    forget_locals(exc)
                    c.users -= 1
                    with anyio.CancelScope(shield=True):
                        await c.strategy.finish_use()
                    raise

    async def _release(self, c: AttachedComponent) -> None:
        async with c.lock:
            c.users -= 1
            if c.users:
                return
            if self._keep_for_next(c):
                return
            try:
                await c.strategy.finish_use()
            except Exception as exc:
                # The component stays where it is (consistent, mirror not current); the
                # next sleep copies it. Reported, not raised over the user's own result.
                self.owner.log.warning(events.USE_RELEASE_FAILED, component=c.name,
                                       error=f"{type(exc).__name__}: {exc}")

    def _keep_for_next(self, c: AttachedComponent) -> bool:
        """Within a request whose next use is ``c`` again (``["text_encoder",
        "text_encoder", "transformer"]``), leave ``c`` placed for it: it is held like a
        prepared prefetch (a lease of its own; a drain or the request's end releases it), so
        the adjacent uses share one move in and one move out."""
        req = self._request.get()
        if req is None or req.position < 0 or c.prefetch is not None \
                or req.order[req.position] != c.name \
                or req.position + 1 >= len(req.order) or req.order[req.position + 1] != c.name \
                or self.owner.phase is not Phase.AWAKE or self.admission.closed_by is not None:
            return False
        c.prefetch = _Prefetch(self.admission.take(f"{c.name} (kept for the next use)"),
                               started=True, ready=True)
        req.started.add(c.name)
        return True

    # -- request and prefetch ----------------------------------------------------------
    @asynccontextmanager
    async def request(self, order: Sequence[str]) -> AsyncIterator[None]:
        unknown = [n for n in order if n not in self.components]
        if unknown:
            raise UnknownComponent(unknown[0], list(self.components))
        # The whole request holds a lease: a sleep or an update that comes while it runs
        # waits for all of it (drains it), not just for the use in progress, so a generation
        # is never cut between two of its components.
        await self._admit(order[0] if order else "request")
        asleep = [n for n in dict.fromkeys(order) if n in self.components.asleep]
        if asleep:  # a request is never cut at a component asleep
            raise ComponentAsleep(asleep[0])
        refuse_stale(self.components[n] for n in dict.fromkeys(order))
        lease = self.admission.take(f"request {list(order)}")
        try:
            async with anyio.create_task_group() as tg:
                req = _Request(tuple(order), tg, lease)
                token = self._request.set(req)
                try:
                    yield
                finally:
                    self._request.reset(token)
                    with anyio.CancelScope(shield=True):
                        await self._stop_prefetches(req.started)
        except BaseExceptionGroup as group:
            # Prefetch tasks never raise, so this is the body's own error: hand it back as
            # raised, not wrapped (callers write `except ComponentAsleep`).
            if len(group.exceptions) == 1:
                raise group.exceptions[0]  # noqa: B904
            raise
        finally:
            self.admission.give(lease)

    @asynccontextmanager
    async def drained(self, trigger: str) -> AsyncIterator[None]:
        """A transition's gate: close admission, drop unused prefetches, drain leases (but
        those of the requests the calling task is in); reopen afterwards."""
        async with self.admission.closed(trigger, self.owner, self.stop_prefetches,
                                         exempt=self.own_leases()):
            for c in self.components.values():
                c.strategy.quiesce()
            if self.layer.needs_sync:
                # Uses drained, but their kernels and copies may still run behind the host
                # (CUDA): no move may free, and no host write may touch, a buffer they read.
                await to_thread(self.layer.synchronize, limiter=self.threads)
            yield

    def own_leases(self) -> frozenset[int]:
        """The leases of the requests the calling task is in: a transition it starts must
        not wait for them (it would wait for itself)."""
        req = self._request.get()
        return frozenset() if req is None else frozenset({req.lease})

    def _prefetch_next(self, name: str) -> None:
        req = self._request.get()
        if req is None:
            return
        try:
            req.position = req.order.index(name, req.position + 1)
        except ValueError:
            return
        if req.position + 1 >= len(req.order) or not self.prefetch_components:
            return
        nxt = self.components[req.order[req.position + 1]]
        if nxt.users or nxt.prefetch is not None or nxt is self.components[name]:
            return
        store = nxt.strategy.store
        free = self.layer.free_bytes()
        # The running component's activations come out of the same free memory: keep
        # ``prefetch_headroom`` bytes for them, or the prefetch could starve the forward.
        if free is not None and free < store.nbytes - store.device_bytes + self.prefetch_headroom:
            return
        nxt.prefetch = _Prefetch(self.admission.take(f"{nxt.name} (prefetch)"))
        req.started.add(nxt.name)
        req.tg.start_soon(self._run_prefetch, nxt, nxt.prefetch)

    def _may_prefetch(self, c: AttachedComponent, pf: _Prefetch) -> bool:
        return c.users == 0 and c.prefetch is pf and not pf.cancelled \
            and self.owner.phase is Phase.AWAKE and self.admission.closed_by is None

    async def _run_prefetch(self, c: AttachedComponent, pf: _Prefetch) -> None:
        try:
            with anyio.CancelScope() as pf.scope:
                try:
                    async with c.lock:
                        if self._may_prefetch(c, pf):
                            pf.started = True
                            pf.move = await c.strategy.prepare_use()
                            # A copy is not abandoned when cancelled: it completes, so look
                            # again.
                            if self._may_prefetch(c, pf):
                                pf.ready = True
                                return
                except Exception as exc:
                    self.owner.log.warning(events.PREFETCH_FAILED, component=c.name,
                                           error=f"{type(exc).__name__}: {exc}")
        finally:
            # Also when the request's task group cancelled this task (its body raised) before
            # or while it ran: the lease must come back, or a later drain waits forever.
            if not pf.ready:
                with anyio.CancelScope(shield=True):
                    await self._drop_prefetch(c, pf)

    async def _drop_prefetch(self, c: AttachedComponent, pf: _Prefetch) -> None:
        """Undo a prefetch that will not be used and return its lease (once)."""
        if pf.dropped:
            return
        pf.dropped = True
        if c.prefetch is pf:
            c.prefetch = None
        if pf.move is not None:
            pf.move.rollback()
        if pf.started and c.users == 0:
            await c.strategy.finish_use()
        self.admission.give(pf.lease)

    async def _stop_prefetches(self, names: Iterable[str]) -> None:
        for name in names:
            c = self.components[name]
            pf = c.prefetch
            if pf is None:
                continue
            if pf.ready:
                await self._drop_prefetch(c, pf)
            else:
                pf.cancel()  # its task drops it when the copy in flight has landed

    async def stop_prefetches(self) -> None:
        """Before a drain: drop prepared prefetches, cancel those still copying (their
        tasks drop them and return the leases)."""
        await self._stop_prefetches(list(self.components))
