"""The CUDA device layer: pinned mirrors, copy streams of its own, events, staging.

Every call into CUDA goes through one :class:`~strategies.devices._cudart.CudaRuntime`: the real one
(``torch.cuda``) on a GPU, or the simulated GPU of :mod:`strategies.checking._cudasim`, on which this
module's code runs in CI (``RESIDENCY_DEVICE_LAYER=cuda-sim``). "Device memory" below is what
the runtime says is the device's (``is_device``): CUDA tensors on a GPU, the simulator's
blocks and adopted storages on the CPU.
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import anyio
import torch

from .._threads import to_thread
from ._cudart import CudaRuntime, Event, Stream, TorchCuda
from ._device import CopyHandle, CopyPair, DeviceLayer, Tier, UnsupportedCompute, Worker

__all__ = ["CudaDevice"]

_PAGE = mmap.PAGESIZE
_STAGE = 64 * 2**20  # bytes per pinned staging buffer (two of them per CUDA layer)
_HUGE = 2 * 2**20  # mirrors at least this large ask for transparent huge pages
_ERROR_ALLOCATION = 2  # cudaErrorMemoryAllocation: a registration over the locked-memory limit
_log = logging.getLogger("residency.cuda")


class _EventHandle:
    """A batch of copies queued on a copy stream, and the event recorded after it."""

    def __init__(self, layer: CudaDevice, event: Event, stream: Stream,
                 device_tensors: list[torch.Tensor]) -> None:
        self._layer = layer
        self._event = event
        self._stream = stream
        self._tensors = device_tensors  # only until waited for or dropped

    def wait(self) -> None:
        # The compute stream waits (on the GPU): kernels queued after read the landed bytes.
        # The default stream by name, not the current one: prepare_use calls this on the event
        # loop's thread, where a user stream may be current (forwards run on the default one).
        self._layer._rt.default_stream().wait_event(self._event)
        self._tensors = []

    def wait_host(self) -> None:
        self._layer._host_wait(self._event)
        self._tensors = []

    def drop(self) -> None:
        # Nobody waits: the buffers are recorded on the copy stream, so that when they are
        # freed the allocator does not reuse their blocks before the copy ran.
        for t in self._tensors:
            self._layer._record_on(t, self._stream)
        self._tensors = []
        self._layer._rt.discard(self._event)


class CudaDevice(DeviceLayer):
    """Pinned host tier, a copy stream per direction, events waited on in worker threads.

    Buffer lifetimes, and the wait that makes each one safe:

    * every device buffer is allocated on the **compute stream** (``_alloc``), the stream that
      reads it last. A buffer compute is done with is freed in stream order and its block is
      reused at once by the next allocation (a layer streaming in reuses the block of the one
      that left): reserved memory stays at the buffers alive. A copy into it is safe because
      **every copy first waits for the compute stream** (``_enqueue``: the work queued before
      it, which may still read that block, or write a source the copy reads); a prefetch
      queued in a layer's pre-hook so waits for the layers before, and still overlaps the
      current one;
    * compute reads a buffer a copy filled only after the compute stream waited for the
      copy's event (``_EventHandle.wait``) or the host did (``copy``, ``wait_host``); a copy
      nobody will wait for (a prefetch dropped, ``_EventHandle.drop``) has its device buffers
      recorded on its stream, so freeing them cannot hand the block to new work early;
    * host mirrors are written by the host only after every copy that reads them has landed:
      transitions first synchronize the device (``needs_sync``: the controller's gate), and
      a dirty evict waits on its own copy's event on the host (``wait_host``), not on the
      whole device;
    * forwards of components whose weights move around them run on the default stream and
      never under graph capture (``check_compute``, asked by the controller for every
      component but a resident one), so "the compute stream" above is one known stream; a
      resident component's forwards may run anywhere: its weights stay put while awake, and a
      transition synchronizes the device before it moves them.
    """

    pinned = True
    copies_overlap_compute = True
    needs_sync = True

    def __init__(self, device: torch.device, runtime: CudaRuntime | None = None) -> None:
        super().__init__(device)
        self._rt: CudaRuntime = runtime if runtime is not None else TorchCuda(device)
        #: Whether the copy streams are the layer's own (else torch's pooled ones: logged).
        self.own_streams = True
        # Storages recorded on a copy stream (record_stream) still alive: the allocator records
        # an event on that stream when it frees them, so the streams outlive them.
        self._recorded = 0
        self._recorded_lock = threading.Lock()
        with self._rt.use_device():
            self._stream_map: dict[Tier, Stream] = self._new_streams()
            self._default = self._rt.default_stream()
        self._limiter = anyio.CapacityLimiter(2)
        self.stage_bytes = _STAGE  # bytes per pinned staging buffer
        self._stage: list[torch.Tensor] | None = None  # two pinned staging buffers, on need
        self._stage_lock = threading.Lock()  # the staging buffers serve one batch at a time
        # Pinned memory is unregistered (a synchronizing call) in a thread of the layer's
        # own, never in the thread that dropped the last reference (often the event loop).
        self._unpin = Worker("residency-unpin")

    def _new_streams(self) -> dict[Tier, Stream]:
        return {"device": self._new_stream(), "host": self._new_stream()}

    @property
    def _streams(self) -> dict[Tier, Stream]:
        """The copy streams; made again when the layer is used after :meth:`close` destroyed
        them (a controller closed and attached again: its threads start again too)."""
        streams = self._stream_map
        if not streams:
            with self._recorded_lock:
                if not self._stream_map:
                    with self._rt.use_device():
                        self._stream_map = self._new_streams()
                streams = self._stream_map
        return streams

    def _new_stream(self) -> Stream:
        stream = self._rt.own_stream()
        if stream is not None:
            return stream
        # The failed call left the thread's last error set: the next kernel launch on this
        # thread would raise it. Cleared here, and named.
        err = self._rt.clear_error()
        self.own_streams = False
        _log.warning("residency: the CUDA layer of %s could not create a stream of its own "
                     "(%s): its copies use torch's pooled streams (shared with other libraries, "
                     "default priority)", self.device,
                     self._rt.error_name(err) if err else "torch's CUDA runtime library not found")
        return self._rt.new_stream()

    def _record_on(self, t: torch.Tensor, stream: Stream) -> None:
        self._rt.record_stream(t, stream)
        with self._recorded_lock:
            self._recorded += 1
        weakref.finalize(t.untyped_storage(), self._unrecorded)

    def _unrecorded(self) -> None:
        with self._recorded_lock:
            self._recorded -= 1

    @property
    def runtime(self) -> CudaRuntime:
        return self._rt

    @property
    def streams(self) -> Mapping[Tier, Stream]:
        """The copy streams: into the device (``"device"``) and out of it (``"host"``)."""
        return MappingProxyType(self._streams)

    # -- memory ----------------------------------------------------------------------------
    def _alloc(self, nbytes: int, tier: Tier, pinned: bool) -> torch.Tensor:
        if tier == "device":
            with self._rt.use_device(), self._rt.use_stream(self._default):
                return self._rt.empty(nbytes)
        if pinned and nbytes:
            return _pinned_arena(nbytes, self)
        return torch.empty(nbytes, dtype=torch.uint8)

    def track(self, tensor: torch.Tensor) -> None:
        if tensor.device == self.device:
            self._rt.adopt(tensor)  # the module's own storages, weights compute made
        super().track(tensor)

    def label(self, buf: torch.Tensor, component: str, unit: str) -> None:
        self._rt.label(buf, f"component {component!r} unit {unit!r}")

    @staticmethod
    def pinned_footprint(nbytes: int) -> int:
        return (nbytes + _PAGE - 1) // _PAGE * _PAGE

    def on_device(self, t: torch.Tensor) -> bool:
        return self._rt.on_device(t) and self.host.kind(t) is None

    def device_memory(self, t: torch.Tensor) -> bool:
        return self._rt.is_device(t)

    def host_writes(self, t: torch.Tensor, tier: Tier) -> bool:
        if self._rt.is_device(t):
            return False
        self._rt.host_write(t)  # the simulator raises if a copy not waited for touches it
        return True

    def for_compute(self, buf: torch.Tensor) -> None:
        # Nothing to record: the buffer was allocated on the compute stream (see the class doc).
        pass

    def check_compute(self) -> None:
        if self._rt.is_capturing():
            raise UnsupportedCompute(
                "a forward of a component placed by residency ran under CUDA graph capture: "
                "its weights move (new addresses after wake, every layer under layerwise "
                "offload), so a captured graph would replay on freed memory; capture outside "
                "residency or keep the component resident and never sleep it while captured")
        if self._rt.current_stream() != self._default:
            raise UnsupportedCompute(
                f"a forward ran on a non-default CUDA stream of {self.device}: residency "
                "orders its copies and frees against the default stream; run forwards on it")

    # -- copies ----------------------------------------------------------------------------
    def _copy_one(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._count_lock:
            self.copies += 1
        if self._rt.is_device(dst) or self._rt.is_device(src):
            self._rt.copy(dst, src)  # queued on the current stream
        else:
            self._rt.host_copy(dst, src)

    def _enqueue(self, pairs: Sequence[CopyPair], to: Tier
                 ) -> tuple[Event, Stream, BaseException | None]:
        """Queue ``pairs`` on the ``to`` stream, after the compute work queued so far (see
        the class doc), and record an event after them. A failure part way (a fault) is
        returned, not raised: the copies queued before it must land before anyone frees their
        buffers, and the caller waits for the event first."""
        stream = self._streams[to]
        error: BaseException | None = None
        with self._rt.use_device():
            stream.wait_stream(self._default)
            with self._rt.use_stream(stream):
                try:
                    for dst, src in pairs:
                        self._copy_one(dst, src)
                except Exception as exc:
                    error = exc
                event = self._rt.event()
                event.record(stream)
        return event, stream, error

    def _host_wait(self, event: Event) -> None:
        """Block this thread until ``event`` has landed (a blocking event: the thread sleeps),
        with the layer's device current: from a thread whose current device is another one,
        CUDA would create a context there."""
        with self._rt.use_device():
            event.synchronize()

    def start_copy(self, pairs: Sequence[CopyPair], to: Tier) -> CopyHandle:
        event, stream, error = self._enqueue(pairs, to)
        if error is not None:
            self._host_wait(event)
            raise error
        return _EventHandle(self, event, stream,
                            [t for pair in pairs for t in pair if self._rt.is_device(t)])

    async def copy(self, pairs: Sequence[CopyPair], to: Tier) -> None:
        on_host: list[CopyPair] = []
        pageable: list[CopyPair] = []
        direct: list[CopyPair] = []
        for pair in pairs:
            dst_device, src_device = self._rt.is_device(pair[0]), self._rt.is_device(pair[1])
            if not dst_device and not src_device:
                on_host.append(pair)
            elif dst_device != src_device and \
                    not self._rt.is_pinned(pair[1] if dst_device else pair[0]):
                pageable.append(pair)
            else:
                direct.append(pair)
        # Host-to-host pairs (update backups, restores of host-placed tensors) are a plain
        # memcpy: a worker thread does them, so the event loop never blocks on them.
        if on_host:
            await to_thread(self._copy_batch, on_host, limiter=self._limiter)
        # A pageable host side (update sources: user tensors, memory-mapped safetensors;
        # host backups): copy_ from it would run synchronously on the event loop at about half
        # the pinned rate, taking its page faults (disk reads) there. Staged instead.
        if pageable:
            with anyio.CancelScope(shield=True):  # a started copy is never abandoned
                await to_thread(self._staged, pageable, limiter=self._limiter)
        if not direct:
            return
        event, _, error = self._enqueue(direct, to)
        # The host waits (in a worker thread, the loop keeps serving): the caller re-points
        # tensors or frees buffers only after the bytes landed, so no stream wait is queued
        # on compute (it would stall a running forward behind a prefetch).
        with anyio.CancelScope(shield=True):
            await to_thread(self._host_wait, event, limiter=self._limiter)
        if error is not None:
            raise error

    def _staged(self, pairs: Sequence[CopyPair]) -> None:
        """Copy pairs with one pageable host side through two reusable pinned buffers, in
        this worker thread: the host copy of one chunk (page faults, disk reads) overlaps
        the device copy of the other. Pairs are typed tensors of one shape and dtype (an
        update's value and its target), any layout: each side is taken as its bytes (a
        contiguous temporary where it is strided). Returns when every byte has landed."""
        with self._stage_lock, self._rt.use_device():
            if self._stage is None:
                self._stage = [_pinned_arena(self.stage_bytes, self),
                               _pinned_arena(self.stage_bytes, self)]
            # Device sources were written by compute; device destinations may be read by it
            # until now (a restore overwrites live weights): order after both.
            for stream in self._streams.values():
                stream.wait_stream(self._default)
            slots = _Slots(self, self._stage)
            try:
                for dst, src in pairs:
                    if self._rt.is_device(dst):
                        self._stage_in(dst, src, slots)
                    else:
                        self._stage_out(dst, src, slots)
            finally:
                slots.drain()  # every copy queued lands before the caller may free a buffer

    def _stage_in(self, dst: torch.Tensor, src: torch.Tensor, slots: _Slots) -> None:
        stream = self._streams["device"]
        host = _bytes(src if src.is_contiguous() else src.contiguous())
        target = dst if dst.is_contiguous() else self._alloc(int(dst.nbytes), "device", False)
        if target is not dst:
            # The temporary's block may have been freed by compute work queued since the
            # batch's wait: the copies into it are ordered after that work too.
            stream.wait_stream(self._default)
        device = _bytes(target)
        step = int(self._stage_bytes())
        for start in range(0, int(device.numel()), step):
            end = min(start + step, int(device.numel()))
            slot = slots.take()[:end - start]
            self._rt.host_copy(slot, host[start:end])  # host memcpy: page faults here
            with self._rt.use_stream(stream):
                self._copy_one(device[start:end], slot)
            slots.put(stream)
        if target is not dst:
            # The bytes into the strided target: a copy kernel on the same stream, after them.
            with self._rt.use_stream(stream):
                self._copy_one(dst, target.view(dst.dtype).view(dst.shape))
            slots.later(stream, lambda: None, target)

    def _stage_out(self, dst: torch.Tensor, src: torch.Tensor, slots: _Slots) -> None:
        stream = self._streams["host"]
        source = src
        if not src.is_contiguous():
            source = self._alloc(int(src.nbytes), "device", False).view(src.dtype).view(src.shape)
            # Its block may have been freed by compute work queued since the batch's wait:
            # the gather into it is ordered after that work too.
            stream.wait_stream(self._default)
            with self._rt.use_stream(stream):
                self._copy_one(source, src)  # gathered on the device first
        device = _bytes(source)
        target = dst if dst.is_contiguous() else torch.empty_like(
            dst, memory_format=torch.contiguous_format)
        host = _bytes(target)
        step = int(self._stage_bytes())
        for start in range(0, int(device.numel()), step):
            end = min(start + step, int(device.numel()))
            slot = slots.take()[:end - start]
            with self._rt.use_stream(stream):
                self._copy_one(slot, device[start:end])
            slots.put(stream, functools.partial(self._rt.host_copy, host[start:end], slot), source)
        if target is not dst:
            slots.later(stream, lambda: self._rt.host_copy(dst, target), source)

    def _stage_bytes(self) -> int:
        assert self._stage is not None
        return int(self._stage[0].numel())

    # -- waits, accounting ---------------------------------------------------------------
    def empty_cache(self) -> None:
        with self._rt.use_device():
            self._rt.empty_cache()

    async def release_cache(self, limiter: anyio.CapacityLimiter | None = None) -> None:
        # empty_cache synchronizes the device: a worker thread waits, the loop keeps serving.
        await to_thread(self.empty_cache, limiter=limiter)

    def memory_allocated(self) -> int | None:
        return self._rt.memory().allocated

    def allocator_peak(self) -> int | None:
        return self._rt.memory().peak_allocated

    def reserved(self) -> tuple[int, int] | None:
        stats = self._rt.memory()
        return stats.reserved, stats.peak_reserved

    def reset_peak(self) -> None:
        super().reset_peak()
        self._rt.reset_peak()

    def free_bytes(self) -> int | None:
        free, _ = self._rt.mem_get_info()
        stats = self._rt.memory()
        # Cached blocks are free for us too; blocks freed while a stream recorded on them has
        # not passed the free are not (active, not allocated): not reusable yet.
        return free + stats.reserved - stats.active

    def synchronize(self) -> None:
        with self._rt.use_device():
            self._rt.synchronize()

    def measure_link(self, nbytes: int = 256 * 2**20, repeats: int = 5) -> tuple[float, float]:
        with self._rt.use_device():
            return super().measure_link(nbytes, repeats)

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        # On the copy stream, as moves run; events time the copy itself.
        stream = self._streams["device"]
        start, end = self._rt.event(timing=True), self._rt.event(timing=True)
        stream.wait_stream(self._default)  # dst was allocated on the compute stream
        with self._rt.use_stream(stream):
            start.record(stream)
            self._rt.copy(dst, src)
            end.record(stream)
        end.synchronize()  # the host waits: the buffers are freed when this returns
        return float(start.elapsed_time(end)) / 1e3

    def close(self) -> None:
        stage, self._stage = self._stage, None
        del stage  # its pages are unpinned by the worker, before it stops
        self._unpin.close()
        self._destroy_streams()
        super().close()

    def _destroy_streams(self) -> None:
        """The layer's own streams are destroyed, unless a storage recorded on one still lives
        (a dropped prefetch's buffer kept by someone): its free records an event on the
        stream, so they are kept for the process then (two streams)."""
        with self._recorded_lock:
            if not self.own_streams or self._recorded or not self._stream_map:
                return
            streams, self._stream_map = list(self._stream_map.values()), {}
        with self._rt.use_device():
            for stream in streams:
                self._rt.destroy_stream(stream)  # what is queued on it still completes


class _Slots:
    """The two pinned staging buffers of one staged batch, taken in turn. A slot is reused
    only after its copy landed and the host work that follows it (a device-to-host chunk's
    memcpy out of the slot) is done."""

    def __init__(self, layer: CudaDevice, stages: list[torch.Tensor]) -> None:
        self._layer = layer
        self._stages = stages
        self._pending: list[tuple[Event, Callable[[], None], torch.Tensor | None] | None] = \
            [None, None]
        self._later: list[tuple[Event, Callable[[], None], torch.Tensor | None]] = []
        self._turn = 0

    def take(self) -> torch.Tensor:
        """The next slot, free: its previous copy landed and its host work is done."""
        self._finish(self._turn)
        return self._stages[self._turn]

    def put(self, stream: Stream, then: Callable[[], None] = lambda: None,
            keep: torch.Tensor | None = None) -> None:
        """The slot just taken has a copy queued on ``stream``: record it; ``then`` runs on
        the host once it landed (``keep`` lives until then)."""
        event = self._layer._rt.event()
        event.record(stream)
        self._pending[self._turn] = (event, then, keep)
        self._turn ^= 1

    def later(self, stream: Stream, then: Callable[[], None], keep: torch.Tensor | None) -> None:
        """Work queued on ``stream`` outside the slots; ``then`` runs once it landed."""
        event = self._layer._rt.event()
        event.record(stream)
        self._later.append((event, then, keep))

    def _finish(self, i: int) -> None:
        entry, self._pending[i] = self._pending[i], None
        if entry is not None:
            self._layer._host_wait(entry[0])
            entry[1]()

    def drain(self) -> None:
        """Wait for everything queued, in order, and run the host work after it."""
        for _ in range(2):
            self._finish(self._turn)
            self._turn ^= 1
        later, self._later = self._later, []
        for event, then, _ in later:
            self._layer._host_wait(event)
            then()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a 1-D uint8 view (0-d tensors too)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _pinned_arena(nbytes: int, layer: CudaDevice) -> torch.Tensor:
    """``nbytes`` of page-locked host memory of our own: private anonymous pages (left out
    of a forked child; transparent huge pages asked for where the system offers them)
    registered with the driver (``cudaHostRegister``), not torch's caching host allocator,
    which rounds every block up to a power of two (a 33 GB mirror would pin 64 GiB) and never
    gives a block back. The footprint is the size rounded to a page; when the tensor's
    storage dies the pages are unregistered, then unmapped, in the layer's unpin thread."""
    arena = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_DONTFORK"):
        # Left out of forked children (data loaders, multiprocessing): a private mapping is
        # otherwise copied into every child (and page-locked memory is not the child's anyway).
        arena.madvise(mmap.MADV_DONTFORK)
    if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        arena.madvise(mmap.MADV_HUGEPAGE)
    view = torch.frombuffer(arena, dtype=torch.uint8)  # keeps ``arena`` alive while it lives
    rt = layer.runtime
    with rt.use_device():  # from any thread: the layer's device, never GPU 0 by default
        err = rt.host_register(view.data_ptr(), nbytes)
    if err != 0:
        # The failed call left the thread's last error set: the next kernel launch on this
        # thread would raise it (an unrelated forward failing). Cleared, and named.
        rt.clear_error()
        del view
        arena.close()
        hint = "; the system may limit locked memory (ulimit -l)" if err == _ERROR_ALLOCATION \
            else ""
        raise MemoryError(f"cudaHostRegister of {nbytes} bytes failed with "
                          f"{rt.error_name(err)} (error {err}){hint}")
    fin = weakref.finalize(view.untyped_storage(), _release_arena, weakref.ref(layer), rt,
                           arena, view.data_ptr())
    # Not at interpreter exit: an atexit handler or a daemon thread may still read a weight
    # that points into it (the process's memory goes with it anyway).
    fin.atexit = False
    return view


def _release_arena(layer_ref: weakref.ref[CudaDevice], rt: CudaRuntime, arena: mmap.mmap,
                   ptr: int) -> None:
    """The arena's storage died (its deleter released the mapping; we hold the last
    reference): unpin, then unmap, off the thread that dropped it."""
    def release() -> None:
        with rt.use_device():
            if rt.host_unregister(ptr) != 0:
                rt.clear_error()  # (not this thread's next launch's to raise)
        arena.close()

    layer = layer_ref()
    if layer is None or layer._unpin.closed:
        # The layer is closed, or being collected with it: a thread of its own, still never
        # the caller's (the collector may run on the event loop).
        threading.Thread(target=release, name="residency-unpin", daemon=True).start()
    else:
        layer._unpin.submit(release)
