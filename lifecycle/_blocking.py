"""``SyncLifecycleController``: the lifecycle for code that is not async.

A serving worker that runs a plain loop (a scheduler thread, a vLLM-style worker) drives a
:class:`~lifecycle.LifecycleController` through an anyio blocking portal: one event loop in
a thread of its own, on which the controller is built and every call runs. Each method
blocks its caller until the answer is in; any number of threads may call at once (the
portal queues their calls onto the one loop, the controller's lock serialises the
transitions); errors arrive in the calling thread exactly as raised (``ComponentAsleep``,
``TransitionFailed``, ...)::

    from lifecycle._blocking import SyncLifecycleController

    with SyncLifecycleController("cuda") as sctl:
        sctl.attach(pipe)
        with sctl.use("transformer") as transformer:
            out = transformer(x)
        sctl.sleep()                      # release the GPU between jobs
        sctl.wake()
        sctl.update_weights_from_tensors(new_weights, target_module="transformer")
    # closed: detached, loop thread stopped

A ``request(order)`` opened by a thread covers that thread's ``use()`` calls inside it
(the next component in the order is prefetched while the current one runs), as a
request covers the uses of its own task in async code.
"""

from __future__ import annotations

import contextvars
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from typing import Any, Concatenate, Generic, Literal, ParamSpec, Self, TypeVar, cast, overload

from anyio.from_thread import BlockingPortal, start_blocking_portal
from torch import nn

from strategies import ResidencyConfig
from strategies.protocol import to_thread

from ._controller import LifecycleController
from ._planner import ResidencyPlan
from ._results import Computed, ResidencyChange

__all__ = ["SyncLifecycleController"]

T = TypeVar("T")
P = ParamSpec("P")

# Context variables a request set in its own task, carried into the same thread's uses.
_Carried = dict[contextvars.ContextVar[Any], Any]

_CLOSED = "SyncLifecycleController is closed"


def _wait(future: Future[T]) -> T:
    """The future's result; if the wait itself is interrupted (KeyboardInterrupt), the task
    in the loop is cancelled (a transition rolls back) before the interruption goes on."""
    try:
        return future.result()
    except BaseException:
        future.cancel()  # no-op when the task finished (its own error is what we re-raise)
        raise


def _apply(carried: _Carried) -> None:
    for var, value in carried.items():
        var.set(value)


class _Blocking(Generic[P, T]):
    """A facade method: the controller's method ``method``, called in the portal's loop (a
    coroutine awaited there) while the caller blocks. It keeps that method's signature and
    docstring, so the two cannot drift apart."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.__wrapped__ = method
        self.__module__, self.__name__ = method.__module__, method.__name__
        self.__doc__ = f"The blocking :meth:`LifecycleController.{method.__name__}`:\n\n" \
            f"{inspect.cleandoc(method.__doc__ or '')}"
        self._method = method
        sig = inspect.signature(method)
        self.__signature__ = sig  # looked up on the class: the method's, ``self`` first
        self._bound = sig.replace(parameters=list(sig.parameters.values())[1:])

    def __set_name__(self, owner: type, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...
    @overload
    def __get__(self, obj: SyncLifecycleController, owner: type) -> Callable[P, T]: ...
    def __get__(self, obj: SyncLifecycleController | None, owner: type) -> Self | Callable[P, T]:
        if obj is None:
            return self
        method, facade = self._method, obj

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return cast(T, facade._call(lambda: method(facade._controller, *args, **kwargs)))

        call.__name__, call.__doc__ = self.__name__, self.__doc__
        call.__signature__ = self._bound  # type: ignore[attr-defined]
        return call

    def __call__(self, facade: SyncLifecycleController, *args: P.args, **kwargs: P.kwargs) -> T:
        """Called on the class (``SyncLifecycleController.sleep(facade)``), as a function."""
        return self.__get__(facade, type(facade))(*args, **kwargs)


def _awaited(method: Callable[Concatenate[LifecycleController, P], Awaitable[T]]
             ) -> _Blocking[P, T]:
    """A facade method over the controller's coroutine method ``method``."""
    return _Blocking(method)


def _in_loop(method: Callable[Concatenate[LifecycleController, P], T]) -> _Blocking[P, T]:
    """A facade method over the controller's plain method ``method``, called in the loop
    thread between the controller's own steps (a consistent snapshot, no race with a move)."""
    return _Blocking(method)


def _read(read: Callable[[LifecycleController], T], doc: str
          ) -> Computed[SyncLifecycleController, T]:
    """A facade property: ``read(controller)`` in the calling thread (one attribute read)."""
    return Computed(lambda facade: read(facade._ctl()), doc)


def _in_thread(request: Callable[[], object]) -> Callable[[], Awaitable[object]]:
    """A blocking ``request`` as the async callable the controller awaits: run in a worker
    thread, its calls into the facade go through the portal to the loop (free meanwhile)."""
    async def run() -> object:
        return await to_thread(request)

    return run


class SyncLifecycleController:
    """A :class:`~lifecycle.LifecycleController` with blocking methods, safe to call from
    any number of threads.

    Positional and keyword arguments go to ``LifecycleController`` (built inside the
    portal's loop, so the anyio primitives it makes belong to that loop); ``backend`` picks
    that loop's library (``"asyncio"`` or ``"trio"``). Call :meth:`close` (or use ``with``)
    when done: it detaches and stops the loop thread.
    """

    def __init__(self, *args: Any, backend: Literal["asyncio", "trio"] = "asyncio",
                 **kwargs: Any) -> None:
        self._state = threading.Condition()  # guards _closed and _live
        self._closed = False
        self._live = 0  # facade calls in progress (a use/request: until its with-block ends)
        self._close_lock = threading.Lock()
        self._local = threading.local()  # per thread: open requests, use/request depth
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal(
            backend, name=f"SyncLifecycleController-{backend}-portal-{id(self):x}")
        self._portal = self._portal_cm.__enter__()
        try:
            self._controller = self._portal.call(lambda: LifecycleController(*args, **kwargs))
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    # -- plumbing ----------------------------------------------------------------------
    def _ctl(self) -> LifecycleController:
        if self._closed:
            raise RuntimeError(_CLOSED)
        return self._controller

    def _begin(self) -> BlockingPortal:
        with self._state:
            if self._closed:
                raise RuntimeError(_CLOSED)
            self._live += 1
            return self._portal

    def _end(self) -> None:
        with self._state:
            self._live -= 1
            if not self._live:
                self._state.notify_all()

    def _call(self, func: Callable[[], Awaitable[T]]) -> T:
        """Call ``func()`` in the loop thread and await what it returns (the portal takes a
        plain function's result as it is); block until it is done."""
        portal = self._begin()
        try:
            return _wait(portal.start_task_soon(func))
        finally:
            self._end()

    @contextmanager
    def _hold(self, make: Callable[[], AbstractAsyncContextManager[T]]) -> Iterator[T]:
        """Enter ``make()`` in the loop for the length of the caller's with-block."""
        portal = self._begin()
        try:
            with portal.wrap_async_context_manager(make()) as value:
                self._local.depth = getattr(self._local, "depth", 0) + 1
                try:
                    yield value
                finally:
                    self._local.depth -= 1
        finally:
            self._end()

    def _requests(self) -> list[_Carried]:
        stack: list[_Carried] | None = getattr(self._local, "requests", None)
        if stack is None:
            stack = self._local.requests = []
        return stack

    def _carried(self) -> _Carried:
        stack = self._requests()
        return stack[-1] if stack else {}

    @asynccontextmanager
    async def _use_in_loop(self, name: str, carried: _Carried) -> AsyncIterator[nn.Module]:
        _apply(carried)
        async with self._controller.use(name) as module:
            yield module

    @asynccontextmanager
    async def _request_in_loop(self, order: list[str], carried: _Carried
                               ) -> AsyncIterator[_Carried]:
        _apply(carried)
        before = contextvars.copy_context()
        async with self._controller.request(order):
            after = contextvars.copy_context()
            _missing = object()
            yield {var: value for var, value in after.items()
                   if before.get(var, _missing) is not value}

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Detach (if attached), stop the controller's threads and the loop thread.

        The detach drains uses in progress (as ``aclose`` does); the loop stops once every
        other thread's call in progress has returned. A second call does nothing; any other
        call after it raises ``RuntimeError``."""
        with self._close_lock:
            with self._state:
                if self._closed:
                    return
                if getattr(self._local, "depth", 0):
                    raise RuntimeError("SyncLifecycleController.close() inside a use() or "
                                       "request() of the same thread would wait for itself")
                self._closed = True
            try:
                _wait(self._portal.start_task_soon(self._controller.aclose))
            finally:
                with self._state:
                    self._state.wait_for(lambda: self._live == 0)
                self._portal_cm.__exit__(None, None, None)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> SyncLifecycleController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- introspection -----------------------------------------------------------------
    @property
    def controller(self) -> LifecycleController:
        """The async controller underneath (its coroutines must run on the portal's loop).
        Still readable after :meth:`close`, to inspect the final state."""
        return self._controller

    phase = _read(lambda c: c.phase, "The current phase.")
    world_size = _read(lambda c: c.world_size, "Ranks the transitions span (1 without a group).")
    device = _read(lambda c: c.device, "The device the pipeline is served from.")
    device_layer = _read(lambda c: c.device_layer, "The device layer that allocates and copies.")
    transition = _read(lambda c: c.transition, "The trigger in progress, if any.")
    in_flight = _read(lambda c: c.in_flight,
                      "Live leases: uses in progress and request-level prefetches.")
    components = _read(lambda c: c.components, "The attached components by name (read-only).")
    weights_version = _read(lambda c: c.weights_version, "+1 per successful weight update.")
    weight_version_label = _read(lambda c: c.weight_version_label,
                                 "The trainer's ``weight_version`` of the weights served, if one "
                                 "was given.")
    stale = _read(lambda c: c.stale, "Stale components (discarded weights not updated yet) and "
                                     "how many tensors.")
    weight_update_groups = _read(
        lambda c: c.weight_update_groups, "This rank's weight update groups by name.")
    asleep = _read(lambda c: c.asleep, "The components asleep now (some after a partial sleep).")
    admission_timeout = _read(lambda c: c.admission_timeout,
                              "Seconds a use waits for a transition to end (None: as long as "
                              "it takes).")
    drain_timeout = _read(lambda c: c.drain_timeout,
                          "Seconds a transition waits for the uses in flight to end.")

    @property
    def auto_wake(self) -> bool:
        """Whether a ``use()`` while sleeping wakes the pipeline."""
        return self._ctl().auto_wake

    @auto_wake.setter
    def auto_wake(self, value: bool) -> None:
        ctl = self._ctl()

        async def set_auto_wake() -> None:
            ctl.auto_wake = value

        self._call(set_auto_wake)

    strategy = _in_loop(LifecycleController.strategy)
    report = _in_loop(LifecycleController.report)
    reset_peak = _in_loop(LifecycleController.reset_peak)
    mark_dirty = _in_loop(LifecycleController.mark_dirty)
    set_host_budget = _in_loop(LifecycleController.set_host_budget)
    forget_checkpoint = _in_loop(LifecycleController.forget_checkpoint)
    rebind = _in_loop(LifecycleController.rebind)

    # -- transitions -------------------------------------------------------------------
    attach = _awaited(LifecycleController.attach)
    detach = _awaited(LifecycleController.detach)
    add_component = _awaited(LifecycleController.add_component)
    remove_component = _awaited(LifecycleController.remove_component)
    sleep = _awaited(LifecycleController.sleep)
    wake = _awaited(LifecycleController.wake)
    release_memory_occupation = _awaited(LifecycleController.release_memory_occupation)
    resume_memory_occupation = _awaited(LifecycleController.resume_memory_occupation)
    update_weights_from_disk = _awaited(LifecycleController.update_weights_from_disk)
    update_weights_from_tensors = _awaited(LifecycleController.update_weights_from_tensors)
    weights_checksum = _awaited(LifecycleController.weights_checksum_async)
    weights_checksum_across_ranks = _awaited(LifecycleController.weights_checksum_across_ranks)
    check_tensor_hashes = _awaited(LifecycleController.check_tensor_hashes)
    tensor_hashes = _awaited(LifecycleController.tensor_hashes)
    tensor_copies = _awaited(LifecycleController.tensor_copies)
    update_weights_from_modules = _awaited(LifecycleController.update_weights_from_modules)
    wait_for_mirrors = _awaited(LifecycleController.wait_for_mirrors)

    def set_residency(self, residency: ResidencyConfig | str | Mapping[str, str]
                      | list[str] | ResidencyPlan | None, *,
                      validate: Callable[[], object] | bool | None = None,
                      latency_tolerance: float = 0.10) -> ResidencyChange:
        """Switch residency modes while attached, all or nothing (see
        :meth:`LifecycleController.set_residency`); ``validate``: a blocking request, run in a
        worker thread."""
        check = _in_thread(validate) if callable(validate) else validate
        return self._call(lambda: self._controller.set_residency(
            residency, validate=check, latency_tolerance=latency_tolerance))

    def plan(self, device_budget: int | float | str, warmup: Callable[[], object] | None = None,
             *, uses: Sequence[str | tuple[str, float] | tuple[str, float, int]] | None = None,
             activation_reserve: int | None = None, remeasure: bool = False,
             host_budget: int | float | str | None = None) -> ResidencyPlan:
        """The fastest residency that fits ``device_budget`` (see
        :meth:`LifecycleController.plan`); ``warmup``: a blocking request through this facade
        (``lambda: generate(sctl)``), run once in a worker thread."""
        run = None if warmup is None else _in_thread(warmup)
        return self._call(lambda: self._controller.plan(
            device_budget, run, uses=uses, activation_reserve=activation_reserve,
            remeasure=remeasure, host_budget=host_budget))

    # -- weight sync over a trainer's process group ---------------------------------------
    init_weights_update_group = _awaited(LifecycleController.init_weights_update_group)
    destroy_weights_update_group = _awaited(LifecycleController.destroy_weights_update_group)
    update_weights_from_distributed = _awaited(LifecycleController.update_weights_from_distributed)
    update_from_broadcast = _awaited(LifecycleController.update_from_broadcast)
    stop_weight_sync = _in_loop(LifecycleController.stop_weight_sync)
    receive_from_distributed = _awaited(LifecycleController.receive_from_distributed)

    # -- uses --------------------------------------------------------------------------
    @contextmanager
    def use(self, name: str) -> Iterator[nn.Module]:
        """Hold a lease on component ``name``, placed for use, for the with-block.

        Raises ``ComponentAsleep`` while sleeping (unless ``auto_wake``)."""
        carried = self._carried()
        with self._hold(lambda: self._use_in_loop(name, carried)) as module:
            yield module

    @contextmanager
    def request(self, order: Sequence[str]) -> Iterator[None]:
        """Declare the use order of this thread's next uses, so the next component is
        prefetched while the current one runs."""
        outer, names = self._carried(), list(order)
        with self._hold(lambda: self._request_in_loop(names, outer)) as carried:
            stack = self._requests()
            stack.append(carried)
            try:
                yield
            finally:
                stack.pop()
