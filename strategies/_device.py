"""The device layer: the only module that knows CUDA.

Everything above it moves bytes through four verbs: allocate on the device, allocate on
the host, copy a batch of (destination, source) pairs, and wait. Two implementations:

* :class:`CudaDevice` -- pinned host memory, one copy stream per direction, an event per
  batch; the event loop never blocks (the wait happens in a worker thread).
* :class:`CpuDevice` -- CPU tensors stand for the device tier, separate host buffers for the
  host tier, copies in a worker thread. It is real code, not a mock: the same strategies
  drive it and every failure path is exercised on it.

Allocation and copy go through the overridable ``_alloc`` and ``_copy_one`` hooks, so a test
layer can fail the k-th one (see ``lifecycle.testing``).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Protocol

import anyio
import anyio.to_thread
import torch

from ._errors import ResidencyError
from ._fileread import FileRegion, read_regions

__all__ = [
    "CopyHandle",
    "CopyPair",
    "CpuDevice",
    "CudaDevice",
    "DeviceLayer",
    "Tier",
    "UnsupportedCompute",
    "make_device_layer",
    "resolve_device",
]

Tier = Literal["device", "host"]
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


class _EventHandle:  # pragma: no cover - CUDA only
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def wait_host(self) -> None:
        _synchronize_event(self._event, self._device)


def _synchronize_event(event: torch.cuda.Event, device: torch.device) -> None:  # pragma: no cover
    """``event.synchronize()`` with ``device`` current: from a worker thread whose current
    device is another one (or none yet), the runtime could otherwise create a context on
    GPU 0. The event is a blocking one (see ``CudaDevice._event``): the thread sleeps."""
    with torch.cuda.device(device):
        event.synchronize()


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

    # -- allocation ----------------------------------------------------------------
    def alloc(self, nbytes: int, tier: Tier, *, pinned: bool | None = None) -> torch.Tensor:
        """A fresh 1-D uint8 buffer of ``nbytes`` on ``tier``. Host buffers are pinned on
        CUDA unless ``pinned=False`` (transient buffers: pinning costs more than it saves)."""
        with self._count_lock:
            self.allocations += 1
            self.host_allocations += tier == "host"
        # Never an inference tensor, even when called from a hook under inference_mode.
        with torch.inference_mode(False):
            buf = self._alloc(nbytes, tier, self.pinned if pinned is None else pinned)
        if tier == "device":
            self.track(buf)
        return buf

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
        """Give cached, unused device blocks back to the driver (no-op on CPU)."""

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
        ordered (CUDA graph capture, a non-default stream); nothing on the CPU."""

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
        """Stop the layer's own threads (waiting for copies in flight); it starts them again
        if used after."""


class CpuDevice(DeviceLayer):
    """CPU tensors as the device tier; copies run in one worker thread per layer."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device or torch.device("cpu"))
        self._limiter = anyio.CapacityLimiter(1)
        self._copier: ThreadPoolExecutor | None = None

    def start_copy(self, pairs: Sequence[CopyPair], to: Tier) -> CopyHandle:
        # The CPU stand-in for a copy stream: one background thread, in submission order.
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="residency-copy")
        return _FutureHandle(self._copier.submit(self._copy_batch, list(pairs)))

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        # Like a layer fetch: handed to the copier thread and waited for.
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="residency-copy")
        t0 = time.perf_counter()
        self._copier.submit(dst.copy_, src).result()
        return time.perf_counter() - t0

    def close(self) -> None:
        copier, self._copier = self._copier, None
        if copier is not None:
            copier.shutdown(wait=True)

    async def copy(self, pairs: Sequence[CopyPair], to: Tier) -> None:
        if pairs:
            # abandon_on_cancel=False: a cancelled caller waits for the thread to finish.
            await anyio.to_thread.run_sync(self._copy_batch, list(pairs), limiter=self._limiter)


class CudaDevice(DeviceLayer):  # pragma: no cover - exercised by scripts/gpu_check.py
    """Pinned host tier, a copy stream per direction, events waited on in a worker thread.

    Buffer lifetimes, and the wait that makes each one safe:

    * a device buffer a move copies *into* is allocated on the copy stream (``_alloc``), so
      the caching allocator can only have handed it a block whose earlier users on that
      stream are done; compute reads it only after the host saw the copy's event (``copy``)
      or the compute stream waited on it (``_EventHandle.wait``), and ``point_to_device``
      records the compute stream on it (``for_compute``), so when it is freed the block is
      not reused before the compute stream's kernels that read it are done;
    * a device buffer a move copies *out of* (sleep, a dirty evict) was written by compute:
      the copy stream waits for the compute stream first (``_enqueue``, ``to="host"``) and the
      buffer is recorded on the copy stream, so dropping it after cannot free it early;
    * host mirrors are written by the host only after every copy that reads them has landed:
      transitions first synchronize the device (``needs_sync``: the controller's gate), and
      a dirty evict waits on its own copy's event on the host (``wait_host``), not on the
      whole device;
    * forwards run on the default stream and never under graph capture (``check_compute``),
      so "the compute stream" above is one known stream.
    """

    pinned = True
    copies_overlap_compute = True
    needs_sync = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        with torch.cuda.device(device):
            self._streams: dict[Tier, torch.cuda.Stream] = {
                "device": torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
                "host": torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
            }
        self._limiter = anyio.CapacityLimiter(2)
        self._default = torch.cuda.default_stream(device)
        self._stage: list[torch.Tensor] | None = None  # two pinned staging buffers, on need

    def _alloc(self, nbytes: int, tier: Tier, pinned: bool) -> torch.Tensor:
        if tier == "device":
            # On the copy stream that fills it: no wait on compute is needed before the copy
            # (the block's earlier users were on this stream), so a prefetch overlaps the
            # running forward instead of queueing behind it.
            with torch.cuda.device(self.device), torch.cuda.stream(self._streams["device"]):
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if pinned and nbytes:
            return _pinned_arena(nbytes)
        return super()._alloc(nbytes, tier, pinned)

    @staticmethod
    def pinned_footprint(nbytes: int) -> int:
        return (nbytes + _PAGE - 1) // _PAGE * _PAGE

    def for_compute(self, buf: torch.Tensor) -> None:
        # Compute on the default stream reads ``buf`` from now on: freeing it must not let the
        # copy stream's pool reuse the block before those kernels are done.
        buf.record_stream(self._default)

    def check_compute(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise UnsupportedCompute(
                "a forward of a component placed by residency ran under CUDA graph capture: "
                "its weights move (new addresses after wake, every layer under layerwise "
                "offload), so a captured graph would replay on freed memory; capture outside "
                "residency or keep the component resident and never sleep it while captured")
        if torch.cuda.current_stream(self.device) != self._default:
            raise UnsupportedCompute(
                f"a forward ran on a non-default CUDA stream of {self.device}: residency "
                "orders its copies and frees against the default stream; run forwards on it")

    def _event(self) -> torch.cuda.Event:
        # blocking=True: a host thread waiting on it sleeps instead of spinning a core.
        return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

    def _enqueue(self, pairs: Sequence[CopyPair], to: Tier) -> torch.cuda.Event:
        stream = self._streams[to]
        with torch.cuda.device(self.device):
            if to == "host" or any(src.is_cuda for _, src in pairs):
                # The sources are device buffers written by compute: read them after it.
                stream.wait_stream(self._default)
            with torch.cuda.stream(stream):
                try:
                    for dst, src in pairs:
                        self._copy_one(dst, src)
                        for t in (dst, src):
                            if t.is_cuda:
                                # Freed while the copy is queued: not reused before it ran.
                                t.record_stream(stream)
                except BaseException:
                    # Copies already queued must land before the caller frees their buffers.
                    stream.synchronize()
                    raise
                event = self._event()
                event.record(stream)
        return event

    def start_copy(self, pairs: Sequence[CopyPair], to: Tier) -> CopyHandle:
        return _EventHandle(self._enqueue(pairs, to), self.device)

    async def copy(self, pairs: Sequence[CopyPair], to: Tier) -> None:
        # Host-to-host pairs (adopting host-loaded weights, update backups) are plain memcpy:
        # a worker thread does them, so the event loop never blocks on them.
        on_host = [p for p in pairs if p[0].device.type == "cpu" and p[1].device.type == "cpu"]
        if on_host:
            await anyio.to_thread.run_sync(self._copy_batch, on_host, limiter=self._limiter)
            pairs = [p for p in pairs if not (p[0].device.type == "cpu" and
                                              p[1].device.type == "cpu")]
        # A pageable host side (update sources: user tensors, memory-mapped safetensors;
        # host backups): copy_ from it would run synchronously on the event loop at about half
        # the pinned rate, taking its page faults (disk reads) there. Staged instead.
        pageable = [p for p in pairs if _pageable_side(p)]
        if pageable:
            with anyio.CancelScope(shield=True):  # a started copy is never abandoned
                await anyio.to_thread.run_sync(self._staged, pageable, limiter=self._limiter)
            pairs = [p for p in pairs if not _pageable_side(p)]
        if not pairs:
            return
        event = self._enqueue(pairs, to)
        # The host waits (in a worker thread, the loop keeps serving): the caller re-points
        # tensors or frees buffers only after the bytes landed, so no stream wait is queued
        # on compute (it would stall a running forward behind a prefetch).
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_synchronize_event, event, self.device,
                                           limiter=self._limiter)

    def _staged(self, pairs: Sequence[CopyPair]) -> None:
        """Copy pairs with one pageable host side through two reusable pinned buffers, in
        this worker thread: the host copy of one chunk (page faults, disk reads) overlaps
        the device copy of the previous one. Returns when every byte has landed."""
        with torch.cuda.device(self.device):
            if self._stage is None:
                self._stage = [_pinned_arena(_STAGE), _pinned_arena(_STAGE)]
            stages = self._stage
            pending: list[torch.cuda.Event | None] = [None, None]
            turn = 0
            # Device sources were written by compute; device destinations may be read by
            # it until now (a restore overwrites live weights): order after both.
            for stream in self._streams.values():
                stream.wait_stream(self._default)
            try:
                for dst, src in pairs:
                    to_device = dst.is_cuda
                    stream = self._streams["device" if to_device else "host"]
                    for start in range(0, int(dst.nbytes), _STAGE):
                        end = min(start + _STAGE, int(dst.nbytes))
                        slot = stages[turn][:end - start]
                        event = pending[turn]
                        if event is not None:
                            event.synchronize()  # the slot's previous copy has landed
                        with torch.cuda.stream(stream):
                            if to_device:
                                slot.copy_(src[start:end])  # host memcpy, faults here
                                self._copy_one(dst[start:end], slot)
                                dst.record_stream(stream)
                            else:
                                self._copy_one(slot, src[start:end])
                                src.record_stream(stream)
                            done = self._event()
                            done.record(stream)
                        if not to_device:
                            done.synchronize()
                            dst[start:end].copy_(slot)
                        pending[turn] = done
                        turn ^= 1
            finally:
                # Every copy that was queued lands before the caller may free a buffer.
                for event in pending:
                    if event is not None:
                        event.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device))

    def allocator_peak(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def measure_link(self, nbytes: int = 256 * 2**20, repeats: int = 5) -> tuple[float, float]:
        with torch.cuda.device(self.device):
            return super().measure_link(nbytes, repeats)

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        # On the copy stream, as moves run; events time the copy itself.
        stream = self._streams["device"]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()  # the host waits: the buffers are freed when this returns
        return float(start.elapsed_time(end)) / 1e3

    def reset_peak(self) -> None:
        super().reset_peak()
        torch.cuda.reset_peak_memory_stats(self.device)

    def free_bytes(self) -> int | None:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free) + int(torch.cuda.memory_reserved(self.device)) - \
            int(torch.cuda.memory_allocated(self.device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


_PAGE = mmap.PAGESIZE
_STAGE = 64 * 2**20  # bytes per pinned staging buffer (two of them per CUDA layer)


def _pageable_side(pair: CopyPair) -> bool:  # pragma: no cover - CUDA only
    """A host<->device pair whose host side is not page-locked."""
    dst, src = pair
    if dst.is_cuda == src.is_cuda:
        return False
    host = src if dst.is_cuda else dst
    return not host.is_pinned()


def _pinned_arena(nbytes: int) -> torch.Tensor:  # pragma: no cover - CUDA only
    """``nbytes`` of page-locked host memory of our own: anonymous pages registered with the
    driver (``cudaHostRegister``), not torch's caching host allocator, which rounds every
    block up to a power of two (a 33 GB mirror would pin 64 GiB) and never gives a block
    back. The footprint is the size rounded to a page; when the tensor's storage dies the
    pages are unregistered, then unmapped: returned to the system (a detach frees them)."""
    arena = mmap.mmap(-1, nbytes)
    view = torch.frombuffer(arena, dtype=torch.uint8)  # keeps ``arena`` alive while it lives
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(view.data_ptr(), nbytes, 0)
    if int(err) != 0:
        del view
        arena.close()
        raise MemoryError(f"cudaHostRegister of {nbytes} bytes failed (error {int(err)}); "
                          "the system may limit locked memory (ulimit -l)")
    weakref.finalize(view.untyped_storage(), _release_arena, arena, view.data_ptr())
    return view


def _release_arena(arena: mmap.mmap, ptr: int) -> None:  # pragma: no cover - CUDA only
    # The storage died (its deleter dropped its reference; the finalizer holds the last):
    # unpin, then unmap.
    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
    arena.close()


#: Environment variable naming the layer for a CPU device: ``cpu`` (default) or ``ordering``
#: (:class:`~strategies.testing.OrderingDevice`: copies land late, only when waited for, and
#: ordering mistakes raise), so that a whole program (``residency serve``, a drill) runs its
#: moves as CUDA orders them, on a machine without a GPU.
DEVICE_LAYER_ENV = "RESIDENCY_DEVICE_LAYER"


def cpu_layer_kind() -> str:
    """``"cpu"`` or ``"ordering"``: the layer :data:`DEVICE_LAYER_ENV` asks for on a CPU
    device (ValueError for anything else)."""
    kind = os.environ.get(DEVICE_LAYER_ENV, "cpu")
    if kind not in ("cpu", "ordering"):
        raise ValueError(f"{DEVICE_LAYER_ENV}={kind!r}: valid values are 'cpu' and 'ordering'")
    return kind


def make_device_layer(device: str | torch.device | None) -> DeviceLayer:
    """The device layer for ``device`` (see :func:`resolve_device`; a CPU device's layer is
    chosen by :data:`DEVICE_LAYER_ENV`)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return CudaDevice(dev)
    if cpu_layer_kind() == "ordering":
        from ._ordering import OrderingDevice

        return OrderingDevice(dev)
    return CpuDevice(dev)
