"""``SyncLifecycleController``: the lifecycle for code that is not async.

A serving worker that runs a plain loop (a scheduler thread, a vLLM-style worker) drives a
:class:`~lifecycle.LifecycleController` through an anyio blocking portal: one event loop in
a thread of its own, on which the controller is built and every call runs. Each method
blocks its caller until the answer is in; any number of threads may call at once (the
portal queues their calls onto the one loop, the controller's lock serialises the
transitions); errors arrive in the calling thread exactly as raised (``ComponentAsleep``,
``TransitionFailed``, ...)::

    from lifecycle._sync import SyncLifecycleController

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
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from typing import Any, Literal, TypeVar

import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from torch import nn

from strategies import DeviceLayer, ResidencyStrategy

from ._checksum import ChecksumAlgorithm
from ._controller import LifecycleController
from ._discard import Discard
from ._phase import Phase
from ._results import (
    OccupationResult,
    PlacementReport,
    TensorHashCheck,
    UpdateResult,
    WeightUpdateGroupResult,
    WeightUpdateGroupState,
)
from ._weight_sync import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT

__all__ = ["SyncLifecycleController"]

T = TypeVar("T")

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

    def _run(self, func: Callable[[], Awaitable[T]]) -> T:
        """Await ``func()`` in the loop; block until it is done."""
        portal = self._begin()
        try:
            return _wait(portal.start_task_soon(func))
        finally:
            self._end()

    def _run_sync(self, func: Callable[[], T]) -> T:
        """Call ``func()`` in the loop thread (between the controller's own steps)."""
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

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self._ctl().phase

    @property
    def device(self) -> torch.device:
        """The device the pipeline is served from."""
        return self._ctl().device

    @property
    def device_layer(self) -> DeviceLayer:
        """The device layer that allocates and copies."""
        return self._ctl().device_layer

    @property
    def transition(self) -> str | None:
        """The trigger in progress, if any."""
        return self._ctl().transition

    @property
    def in_flight(self) -> int:
        """Live leases: uses in progress and request-level prefetches."""
        return self._ctl().in_flight

    @property
    def components(self) -> Mapping[str, nn.Module]:
        """The attached components by name (read-only)."""
        return self._ctl().components

    @property
    def weights_version(self) -> int:
        """+1 per successful weight update."""
        return self._ctl().weights_version

    @property
    def weight_version_label(self) -> str | None:
        """The trainer's ``weight_version`` of the weights served, if one was given."""
        return self._ctl().weight_version_label

    @property
    def stale(self) -> Mapping[str, int]:
        """Stale components (discarded weights not updated yet) and how many tensors."""
        return self._ctl().stale

    @property
    def weight_update_groups(self) -> Mapping[str, WeightUpdateGroupState]:
        """This rank's weight update groups by name."""
        return self._ctl().weight_update_groups

    @property
    def auto_wake(self) -> bool:
        """Whether a ``use()`` while sleeping wakes the pipeline."""
        return self._ctl().auto_wake

    @auto_wake.setter
    def auto_wake(self, value: bool) -> None:
        ctl = self._ctl()

        def set_auto_wake() -> None:
            ctl.auto_wake = value

        self._run_sync(set_auto_wake)

    def strategy(self, name: str) -> ResidencyStrategy:
        """Component ``name``'s residency strategy."""
        return self._ctl().strategy(name)

    def report(self) -> PlacementReport:
        """Where every component's bytes are (taken in the loop: a consistent snapshot)."""
        return self._run_sync(self._controller.report)

    def mark_dirty(self, components: list[str] | None = None) -> None:
        """Declare host mirrors stale after writes through ``param.data``."""
        self._run_sync(lambda: self._controller.mark_dirty(components))

    # -- transitions -------------------------------------------------------------------
    def attach(self, pipeline: Any) -> Phase:
        """Take the pipeline's components and place them for serving."""
        return self._run(lambda: self._controller.attach(pipeline))

    def detach(self) -> Phase:
        """Leave every weight on the host, remove hooks, forget the pipeline."""
        return self._run(self._controller.detach)

    def sleep(self, discard: Discard = False) -> OccupationResult:
        """Release every device byte (all or nothing); ``discard``: see
        :meth:`LifecycleController.sleep`."""
        return self._run(lambda: self._controller.sleep(discard))

    def wake(self) -> OccupationResult:
        """Restore every component's awake placement (all or nothing)."""
        return self._run(self._controller.wake)

    def release_memory_occupation(self, discard: Discard = None) -> OccupationResult:
        """The reference system's name for :meth:`sleep` (``discard`` defaults to the
        controller's ``discard_on_release``)."""
        return self._run(lambda: self._controller.release_memory_occupation(discard))

    def resume_memory_occupation(self) -> OccupationResult:
        """The reference system's name for :meth:`wake`."""
        return self._run(self._controller.resume_memory_occupation)

    def update_weights_from_disk(self, model_path: str | os.PathLike[str],
                                 target_modules: Sequence[str] | None = None, *,
                                 weight_version: str | None = None,
                                 flush_cache: bool = False) -> UpdateResult:
        """Load new weights from safetensors files, all or nothing."""
        return self._run(lambda: self._controller.update_weights_from_disk(
            model_path, target_modules, weight_version=weight_version, flush_cache=flush_cache))

    def update_weights_from_tensors(
            self, named_tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
            target_module: str = "transformer", *, weight_update_mode: str | None = None,
            lora_alpha: float | None = None, lora_rank: int | None = None,
            weight_version: str | None = None, flush_cache: bool = False) -> UpdateResult:
        """Write ``named_tensors`` into ``target_module`` (or merge LoRA tensors), all or
        nothing."""
        return self._run(lambda: self._controller.update_weights_from_tensors(
            named_tensors, target_module, weight_update_mode=weight_update_mode,
            lora_alpha=lora_alpha, lora_rank=lora_rank, weight_version=weight_version,
            flush_cache=flush_cache))

    def weights_checksum(self, components: Sequence[str] | None = None, *,
                         algorithm: ChecksumAlgorithm = "reference") -> dict[str, str]:
        """SHA-256 per component, hashed under the controller's lock (no transition races
        it)."""
        return self._run(lambda: self._controller.weights_checksum_async(
            components, algorithm=algorithm))

    def check_tensor_hashes(self, target_module: str, expected: Mapping[str, str]
                            ) -> TensorHashCheck:
        """Compare the clients' per-tensor SHA-256 with ``target_module``'s tensors."""
        return self._run(lambda: self._controller.check_tensor_hashes(target_module, expected))

    # -- weight sync over a trainer's process group ---------------------------------------
    def init_weights_update_group(
            self, master_address: str, master_port: int, rank_offset: int, world_size: int,
            group_name: str = "weight_update_group", backend: str = "nccl", *,
            timeout: float = DEFAULT_TIMEOUT, bucket_bytes: int = DEFAULT_BUCKET_BYTES
            ) -> WeightUpdateGroupResult:
        """Join the trainer's weight update group."""
        return self._run(lambda: self._controller.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend,
            timeout=timeout, bucket_bytes=bucket_bytes))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                     ) -> WeightUpdateGroupResult:
        """Leave the group (an absent group is a success)."""
        return self._run(lambda: self._controller.destroy_weights_update_group(group_name))

    def update_weights_from_distributed(
            self, names: Sequence[str], dtypes: Sequence[str | torch.dtype],
            shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group",
            target_modules: Sequence[str] = ("transformer",), *, flush_cache: bool = False,
            weight_version: str | None = None, weight_update_mode: str | None = None,
            lora_alpha: float | None = None, lora_rank: int | None = None,
            timeout: float = DEFAULT_TIMEOUT, bucket_bytes: int | None = None) -> UpdateResult:
        """Receive the trainer's broadcast into ``target_modules[0]``, all or nothing."""
        return self._run(lambda: self._controller.update_weights_from_distributed(
            names, dtypes, shapes, group_name, target_modules, flush_cache=flush_cache,
            weight_version=weight_version, weight_update_mode=weight_update_mode,
            lora_alpha=lora_alpha, lora_rank=lora_rank, timeout=timeout,
            bucket_bytes=bucket_bytes))

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
