"""The device layer: the protocol every placement goes through, and its CPU implementation.

Everything above it moves bytes through four verbs: allocate on the device, allocate on
the host, copy a batch of (destination, source) pairs, and wait. Implementations:

* :class:`~strategies.devices._cuda.CudaDevice` -- pinned host memory, copy streams of its own, an
  event per batch; the event loop never blocks (the wait happens in a worker thread). It is
  the only layer that knows CUDA, through one runtime seam (:mod:`strategies.devices._cudart`) that
  a simulated GPU can stand behind (:mod:`strategies.checking._cudasim`);
* :class:`CpuDevice` -- CPU tensors stand for the device tier, separate host buffers for the
  host tier, copies in a worker thread. It is real code, not a mock: the same strategies
  drive it and every failure path is exercised on it;
* :class:`~strategies.checking._ordering.OrderingDevice` -- the CPU layer with CUDA's ordering made
  strict and visible (tests).

Allocation and copy go through the overridable ``_alloc`` and ``_copy_one`` hooks, so a test
layer can fail the k-th one (see ``lifecycle.testing``).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import anyio
import torch
from torch import nn

from .._errors import ResidencyError
from .._fileread import FileRegion, read_regions
from .._hostmem import HostLedger
from .._threads import released, to_thread

__all__ = [
    "CopyHandle",
    "CopyPair",
    "CpuDevice",
    "DeviceLayer",
    "Tier",
    "UnsupportedCompute",
    "resolve_device",
]

Tier = Literal["device", "host"]
T = TypeVar("T")
CopyPair = tuple[torch.Tensor, torch.Tensor]  # (destination, source), both 1-D uint8


class CopyHandle(Protocol):
    """A copy started from synchronous code (forward hooks): wait before using the bytes."""

    def wait(self) -> None:
        """Order the compute after the copy (CUDA: stream wait; CPU: block until done).

        Re-raises an error the copy hit."""
        ...

    def wait_host(self) -> None:
        """Block the calling thread until the copy has landed (before the host reads or
        writes its buffers)."""
        ...

    def drop(self) -> None:
        """Nobody will wait for the copy (a prefetch not needed after all): its buffers may
        be dropped now, without ordering compute after it (CUDA: the device buffers are
        recorded on the copy stream, so their blocks are not reused before it ran)."""
        ...


class UnsupportedCompute(ResidencyError, RuntimeError):
    """A forward ran where the library cannot order its moves: under CUDA graph capture, or
    on a CUDA stream other than the device's default stream (see the README)."""


class _FutureHandle:
    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def wait_host(self) -> None:
        self._future.result()

    def drop(self) -> None:
        # The copier thread holds the buffers until the copy is done: wait for it, so that
        # they are gone when the caller drops its references (compute is synchronous here:
        # the wait costs what the copy has left). Its failure does not matter any more.
        if self._future.exception() is not None:
            return


class Worker:
    """One thread of a layer's own, started on first need; :meth:`close` stops it after the
    work handed to it (work handed to it after starts it again)."""

    _all: ClassVar[weakref.WeakSet[Worker]] = weakref.WeakSet()

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.closed = False
        Worker._all.add(self)

    def submit(self, fn: Callable[..., object], *args: Any) -> Future[None]:
        """``fn(*args)`` on the thread, after the work handed to it before; the future
        tells when it is done (or what it raised): the thread has let go of ``fn`` and
        ``args`` by then (strategies._threads)."""
        with self._lock:
            self.closed = False
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
            return self._pool.submit(released(fn, *args))

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self.closed = True
        if pool is not None:
            pool.shutdown(wait=True)

    @classmethod
    def drain(cls, name: str, timeout: float = 60.0) -> None:
        """Wait until every running worker called ``name`` has done the work handed to it
        so far (a test's end: the mirror refreshes, ``residency-refresh``, of a controller it
        left attached wait for their own copies before the checking layers look for copies
        nobody waited for). A worker not running is not started."""
        for worker in list(cls._all):
            with worker._lock:
                pool = worker._pool if worker.name == name else None
                done = None if pool is None else pool.submit(lambda: None)
            if done is not None:
                done.result(timeout)

    @classmethod
    def _forget_after_fork(cls) -> None:
        # A forked child inherits no thread: each worker starts a new one on next need.
        for worker in list(cls._all):
            worker._pool = None
            worker._lock = threading.Lock()


os.register_at_fork(after_in_child=Worker._forget_after_fork)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when it is available, else the CPU; ``"cuda"`` means the current GPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"invalid device {device!r}; expected 'cpu', 'cuda', 'cuda:N' "
                         "or a torch.device") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    if dev.type != "cpu":
        raise ValueError(f"unsupported device type {dev.type!r}; expected 'cpu' or 'cuda'")
    return dev


class _Death(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a tracked storage that remembers what it was counted for."""

    __slots__ = ("key", "nbytes")
    key: int
    nbytes: int


class DeviceLayer:
    """Allocation and copies for one device and its host tier.

    Subclasses implement :meth:`copy`; allocation and per-pair copies funnel through
    :meth:`_alloc` and :meth:`_copy_one` so that faults can be injected at each one.
    """

    device: torch.device
    pinned: bool = False
    #: The virtual-memory driver of resident-stable arenas (strategies.devices._vmm.vmm_for makes
    #: it on first need; a test sets one first).
    vmm: Any = None
    # Whether copies run beside compute (CUDA: copy engines) or take the same cores (the CPU
    # stand-in): the planner hides copies behind compute only when they do.
    copies_overlap_compute: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._count_lock = threading.Lock()
        self.copies = 0
        self.allocations = 0
        self.host_allocations = 0
        # Device bytes held by the library: every device buffer this layer allocated and
        # every adopted storage, counted from birth until the storage is really freed (a weak
        # reference to the storage object, which torch keeps unique per storage), so copies
        # in flight and buffers kept alive by stray references count too.
        self._held_lock = threading.Lock()
        self._held: dict[int, int] = {}  # id(storage) -> bytes, while it lives
        self._held_total = 0
        self.peak_bytes = 0
        self._dead: list[_Death] = []  # appended to by the death of a tracked storage
        self._deaths: dict[int, _Death] = {}  # id(storage) -> its live weak reference
        # The thread that refreshes host mirrors in the background after weight updates
        # (strategies._write): one per layer, stopped by close().
        self.refresher = Worker("residency-refresh")
        # Every host buffer allocated here, by kind, and the host and pin budgets
        # (strategies._hostmem): a host allocation past the host budget is refused before it
        # happens, one past the pin budget is made pageable.
        self.host = HostLedger(self.pinned_footprint)
        # Worker threads for what may block and so never runs on the event loop: device
        # allocations, pinned registrations (off_loop). The library's own, so an application
        # holding every token of anyio's default thread limiter does not stall it.
        self._off_loop = anyio.CapacityLimiter(4)

    # -- allocation ----------------------------------------------------------------
    def alloc(self, nbytes: int, tier: Tier, *, pinned: bool | None = None) -> torch.Tensor:
        """A fresh 1-D uint8 buffer of ``nbytes`` on ``tier``. Host buffers are pinned on
        CUDA unless ``pinned=False`` (transient buffers: pinning costs more than it saves) or
        the pin budget is spent; :class:`~strategies.HostBudgetExceeded` before allocating
        one that would pass the host budget."""
        pin = self.pinned if pinned is None else pinned
        if tier == "host":
            pin = self.host.admit(nbytes, pin)
        with self._count_lock:
            self.allocations += 1
            self.host_allocations += tier == "host"
        # Never an inference tensor, even when called from a hook under inference_mode.
        with torch.inference_mode(False):
            buf = self._alloc(nbytes, tier, pin)
        if tier == "device":
            self.track(buf)
        else:
            self.host.track(buf, pin)
        return buf

    def place(self, *modules: nn.Module) -> None:
        """Put ``modules``' parameters and buffers in this layer's device memory before
        they are attached, as ``model.to("cuda")`` does on a GPU: one new device buffer per
        storage (ties and views kept), every tensor re-pointed at its place in it (the same
        ``Parameter`` objects). Attach then adopts them where they are and keeps no host
        copy, so their first sleep copies every byte; a module attached from host memory
        keeps its host tensors as its mirrors, and its first sleep copies nothing. On the
        CPU layers (whose device tier is host memory) a copy where they were."""
        storages: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for module in modules:
                for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values():
                    st = t.untyped_storage()
                    if not st.nbytes():
                        continue
                    if (buf := storages.get(st.data_ptr())) is None:
                        buf = self.alloc(st.nbytes(), "device")[:st.nbytes()]
                        buf.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(st))
                        storages[st.data_ptr()] = buf
                    start = buf.storage_offset()
                    assert start % t.element_size() == 0, "a device buffer misaligned"
                    t.data = torch.empty(0, dtype=t.dtype, device=buf.device).set_(
                        buf.untyped_storage(), start // t.element_size() + t.storage_offset(),
                        t.size(), t.stride())

    async def off_loop(self, fn: Callable[..., T], *args: Any,
                       abandon_on_cancel: bool = False) -> T:
        """``fn(*args)`` in a worker thread of the layer's own (see ``__init__``): for what
        may block the event loop, a device allocation the caching allocator cannot serve from
        its cache (torch frees cached blocks: it waits for their events, and ``cudaFree``
        synchronizes the device), an arena mapped through the driver, page-locking, a wait
        for the layer's refresh thread. ``abandon_on_cancel``: as anyio's (for a wait)."""
        return await to_thread(fn, *args, limiter=self._off_loop,
                               abandon_on_cancel=abandon_on_cancel)

    # -- peak tracking ---------------------------------------------------------------
    # A tracked storage's death costs a C-level list append (its weak reference's callback),
    # not a Python finalizer (about 1 us each, and a clean sleep frees every device
    # storage): deaths are drained into ``held_bytes`` whenever it is read and before every
    # new storage is counted, so every read is exact.
    @property
    def held_bytes(self) -> int:
        """Device bytes held by the library now (see ``__init__``)."""
        with self._held_lock:
            self._drain()
            return self._held_total

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes held now (and the allocator's own)."""
        with self._held_lock:
            self._drain()
            self.peak_bytes = self._held_total

    def _drain(self) -> None:
        """Uncount the storages that died since (under ``_held_lock``)."""
        dead = self._dead
        while dead:
            death = dead.pop()
            if self._deaths.get(death.key) is death:
                del self._deaths[death.key]
                self._held_total -= self._held.pop(death.key, 0)

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as held on the device until it is freed (once per
        storage; host tensors and storages already counted are ignored)."""
        if tensor.device != self.device:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        with self._held_lock:
            self._drain()  # first: a storage that died may have had this id
            if key in self._held:
                return
            nbytes = int(storage.nbytes())
            self._held[key] = nbytes
            self._held_total += nbytes
            self.peak_bytes = max(self.peak_bytes, self._held_total)
            death = _Death(storage, self._dead.append)
            death.key, death.nbytes = key, nbytes
            self._deaths[key] = death

    def allocator_peak(self) -> int | None:
        """The allocator's own high-water mark (CUDA ``max_memory_allocated``); None on CPU."""
        return None

    def reserved(self) -> tuple[int, int] | None:
        """``(reserved, peak reserved)`` bytes the caching allocator holds from the driver
        (its blocks, used or cached), the peak since ``reset_peak``; None without one."""
        return None

    def measure_link(self, nbytes: int = 8 * 2**20, repeats: int = 5) -> tuple[float, float]:
        """``(bytes per second, seconds per copy)`` of host-to-device copies as moves do
        them: a fresh device buffer each time, the copy started on the layer's copy path
        and waited for. The per-copy seconds come from 4 KiB copies (median), the rate from
        ``nbytes`` copies (the best: a stream's steady state) less that. Nothing is counted
        (allocations, copies) or tracked as held. Blocking: call it from a worker thread."""
        host = self._alloc(nbytes, "host", self.pinned)
        small = []
        for _ in range(repeats):
            dev = self._alloc(4096, "device", False)
            small.append(self._timed_copy(dev, host[:4096]))
        # As a layer stream allocates: a fresh buffer per copy, the last two kept alive.
        big: list[float] = []
        window: list[torch.Tensor] = []
        for _ in range(repeats + 2):
            dev = self._alloc(nbytes, "device", False)
            big.append(self._timed_copy(dev, host))
            window = [*window[-1:], dev]
        del window
        # The best copy: the allocator's steady state (a stream re-uses the blocks it
        # frees); the median small copy: the fixed cost every copy pays.
        latency = sorted(small)[len(small) // 2]
        rest = max(min(big) - latency, 1e-9)
        return nbytes / rest, latency

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    def _alloc(self, nbytes: int, tier: Tier, pinned: bool) -> torch.Tensor:
        if tier == "device":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    # -- copies --------------------------------------------------------------------
    def _copy_one(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._count_lock:
            self.copies += 1
        dst.copy_(src, non_blocking=self.pinned)

    def _copy_batch(self, pairs: list[CopyPair]) -> None:
        try:
            for dst, src in pairs:
                self._copy_one(dst, src)
        finally:
            # Worker threads (and a failure's traceback) keep their arguments alive for a
            # while: drop the buffers now, so a released buffer is freed when the move says so.
            pairs.clear()

    def start_copy(self, pairs: Sequence[CopyPair], to: Tier) -> CopyHandle:
        """Start copying every pair in the background; returns at once (forward hooks)."""
        raise NotImplementedError

    async def copy(self, pairs: Sequence[CopyPair], to: Tier) -> None:
        """Copy every pair (``dst.copy_(src)``) and return when all bytes have landed.

        A copy that has started is never abandoned: on cancellation this waits for the
        batch to finish before the cancellation propagates, so callers may free buffers.
        """
        raise NotImplementedError

    async def read_file(self, reads: Sequence[tuple[torch.Tensor, FileRegion]],
                        limiter: anyio.CapacityLimiter | None = None) -> None:
        """Read each file region straight into its tensor (each one the host may write: see
        :meth:`host_writes`), in parallel worker threads; counted as one copy per tensor.
        Returns when every byte is in; on failure or cancellation, once no thread writes."""
        with self._count_lock:
            self.copies += len(reads)
        await read_regions(reads, limiter)

    # -- accounting ----------------------------------------------------------------
    def empty_cache(self) -> None:
        """Give cached, unused device blocks back to the driver (no-op on CPU). Blocking (it
        synchronizes on CUDA): from async code, :meth:`release_cache`."""

    async def release_cache(self, limiter: anyio.CapacityLimiter | None = None) -> None:
        """:meth:`empty_cache` without blocking the event loop (nothing to do on CPU)."""

    def memory_allocated(self) -> int | None:
        """Bytes of live device tensors as the allocator sees them; None where unknown."""
        return None

    def free_bytes(self) -> int | None:
        """Device bytes free for new allocations (driver view); None where unbounded."""
        return None

    def synchronize(self) -> None:
        """Block until all queued device work is done (transitions call it, in a worker
        thread, when :attr:`needs_sync`)."""

    #: Whether a transition must wait for the device's queued work before it moves or
    #: writes any buffer (CUDA: kernels and copies run behind the host).
    needs_sync = False

    def check_compute(self) -> None:
        """Raise :class:`UnsupportedCompute` when a forward runs where moves cannot be
        ordered (CUDA graph capture, a non-default stream); on the CPU, a simulated graph's
        capture (:mod:`strategies.checking._vmmsim`)."""
        from ._vmm import graph_capturing

        if graph_capturing():
            raise UnsupportedCompute(
                "a forward of a component whose weights move ran under (simulated) graph "
                "capture: a captured graph would replay on freed memory; only resident-stable "
                "components may be captured")

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on this layer's device tier: memory of the layer's device (a CPU
        tensor here) that is not one of the layer's own host-tier buffers (a mirror, a
        storage detach gave back). What a module brings that is not is on the host tier:
        attach copies it into mirrors of its own and moves it to the device from there."""
        return t.device == self.device and self.host.kind(t) is None

    def device_memory(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is memory only the device addresses (CUDA memory). Never on the CPU
        layers, whose device tier is host memory."""
        return False

    def for_compute(self, buf: torch.Tensor) -> None:
        """``buf`` (a moved-in device buffer) is read by compute from now on."""

    def host_writes(self, t: torch.Tensor, tier: Tier) -> bool:
        """Whether the host may write ``t`` (placed on ``tier``) itself, now (a file read
        straight into it): memory the host addresses (CPU tensors: the CPU layer's device
        tier, any host tier), with no copy of this layer still touching it. Here that holds
        by construction: a transition waits for the device's queued work before it writes
        (:attr:`needs_sync`: prefetches still reading a mirror have landed), and a write
        lands or supersedes its store's mirror refresh first."""
        return t.device.type == "cpu"

    def label(self, buf: torch.Tensor, component: str, unit: str) -> None:
        """``buf`` (a device buffer or host mirror this layer allocated) holds ``unit`` of
        ``component``: test layers name it in their reports (no-op here)."""

    @staticmethod
    def pinned_footprint(nbytes: int) -> int:
        """Host bytes a pinned buffer of ``nbytes`` really locks (0 where nothing is pinned)."""
        return 0

    def close(self) -> None:
        """Stop the layer's own threads (waiting for the work handed to them: copies in
        flight, background refreshes); they start again if used after."""
        self.refresher.close()


class CpuDevice(DeviceLayer):
    """CPU tensors as the device tier; copies run in one worker thread per layer."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device or torch.device("cpu"))
        self._limiter = anyio.CapacityLimiter(1)
        # The CPU stand-in for a copy stream: one background thread, in submission order.
        self._copier = Worker("residency-copy")

    def start_copy(self, pairs: Sequence[CopyPair], to: Tier) -> CopyHandle:
        return _FutureHandle(self._copier.submit(self._copy_batch, list(pairs)))

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        # Like a layer fetch: handed to the copier thread and waited for.
        t0 = time.perf_counter()
        self._copier.submit(dst.copy_, src).result()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._copier.close()
        super().close()

    async def copy(self, pairs: Sequence[CopyPair], to: Tier) -> None:
        if pairs:
            # abandon_on_cancel=False: a cancelled caller waits for the thread to finish.
            await to_thread(self._copy_batch, list(pairs), limiter=self._limiter)
