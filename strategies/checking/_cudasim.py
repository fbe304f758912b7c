"""A simulated CUDA device on the CPU: :class:`SimCuda`, a :class:`~strategies.devices._cudart.CudaRuntime`
that runs :class:`~strategies.devices._cuda.CudaDevice`'s own code in CI and reports what would go
wrong on a GPU.

CPU tensors stand for device memory; the simulator models what matters for correctness:

* **Streams and events.** Work queued on a stream (copies, and the kernels of every module
  forward that reads device tensors) lands late: after a seeded random lag, in order per
  stream, and never before the work it waits for (``wait_event`` / ``wait_stream``). The
  compute stream lags the host as on a GPU, where Python runs ahead of the kernels. A blocking
  wait (``Event.synchronize``, ``Stream.synchronize``, ``synchronize``) lands what it covers.
  Ordering is tracked with vector clocks: each stream knows how far into every other stream its
  next work is ordered, and so does the host (what it has seen complete). An event recorded on
  another device's stream is an error; a stream the layer destroyed (``destroy_stream``) takes
  no more work, no ``record_stream``, and no free of a block recorded on it.
* **Kernels.** A module forward's kernels read its own parameters and buffers, and write those
  it changed in place (a version counter that moved, ``p.add_()``; every buffer of a module in
  training: batch-norm statistics bump no version). The first kernel of each host thread on
  each stream takes a library workspace from the allocator (``workspace_bytes``: cuBLAS takes
  32 MiB on Hopper; :data:`WORKSPACE_BYTES` on the checking layers ``RESIDENCY_DEVICE_LAYER``
  makes and the tests' fixtures, none for a bare ``SimCuda``), never given back
  (``workspace_total``); a new thread with an exited one's id has its workspace, as torch's
  handle pool hands an exited thread's cuBLAS handle (and workspace) to the next thread.
* **A caching allocator with torch's rules.** Device memory comes in segments (2 MiB for
  requests up to 1 MiB, 20 MiB up to 10 MiB, else rounded to 2 MiB), carved into blocks rounded
  to 512 bytes. A block belongs to the stream it was allocated on and is reused only by
  allocations on that stream; a block freed while ``record_stream`` uses are pending returns to
  the pool only when those streams pass the point of the free, and the allocator notices only
  when it next runs (an allocation, ``empty_cache``): ``memory()`` reports the counters as it
  left them (allocated, active: allocated plus those pending blocks, reserved, and the peaks).
  **A reused block carries its history**: the work its earlier tenants queued on its stream,
  which the host has not seen complete, stays a use of the new tenant, so a copy on another
  stream into it must be ordered after that stream. An allocation that does not fit waits for
  every stream (torch waits for the pending blocks' events, and ``cudaFree`` synchronizes),
  then gives back idle segments and retries; ``empty_cache`` synchronizes the device the same
  way, under the allocator's lock; ``mem_get_info`` sees reserved memory as taken. Freed
  blocks hold poison.
* **Memory outside the caching allocator** (:meth:`SimCuda.take_foreign`): NCCL's buffers
  when a communicator is made, another process on the same GPU, a library's own
  ``cudaMalloc``: ``mem_get_info`` sees it taken, the allocator's counters do not, and a
  segment that does not fit beside it fails as out of memory. A convolution's kernel takes
  cuDNN's workspace from the allocator on its stream for its own time
  (``conv_workspace_bytes``): the forward's peak holds it, and its block carries the kernel
  to the next tenant.
* **Pinned host memory.** ``host_register`` / ``host_unregister`` of address ranges (``is_pinned``
  sees them), up to a locked-memory limit (then ``cudaErrorMemoryAllocation``); registering
  takes time (``register_rate`` bytes a second: the driver pins every page) and blocks.
* **Errors stay set.** A failed call (``cudaHostRegister``, ``cudaHostUnregister``, a stream
  creation: ``stream_error`` / ``register_error`` inject one) leaves the calling thread's last
  error set, as CUDA does; the thread's next launch (a copy, a kernel, an allocation) raises it
  unless ``clear_error`` (``cudaGetLastError``) was called.
* **The current device is per thread** (0 until set; a simulated device is ``cuda:1`` by
  default): a registration, an unregistration or a host wait from a thread whose current device
  is another one would create a context on that GPU, and is recorded.
* **Graph capture** (:meth:`SimCuda.capture`): while a stream of the device captures, a
  synchronizing call (a host wait, ``synchronize``, ``empty_cache``, ``cudaHostRegister``,
  ``cudaHostUnregister``) is an error.
* **Poison.** A copy's destination holds poison (``0xFF``: NaN in float dtypes) until the copy
  lands. Raised at once (:class:`CudaSimViolation`), naming the buffers' owners (see
  :meth:`SimCuda.label`): a kernel reading a buffer whose copy it is not ordered after; a copy
  writing a buffer another stream's pending work (a kernel of an earlier tenant of its block
  included) reads or writes, or reading one it writes; a host write into (or read of) a buffer
  a copy it has not waited for writes or reads.
  Recorded (and raised at the next call): a device buffer freed while work on a stream other
  than its own uses it, unprotected by ``record_stream`` or a wait; a host buffer freed or
  unregistered while a copy not waited for uses it; a blocking call (a host wait,
  ``empty_cache``, ``cudaHostRegister``, ``cudaHostUnregister``, an allocation under memory
  pressure) on a thread running an event loop.
* **Device memory that arrives from the host** (``host_modules``, or
  ``RESIDENCY_SIM_HOST_MODULES=1`` for every simulated GPU made without it): only the
  simulator's own allocations (and storages the layer adopts, weights compute made) are
  device memory; every other CPU tensor, a model built on the CPU among them, is host memory,
  so attaching it takes the path a GPU takes (host units, mirrors registered, copies to the
  device). Off by default: the simulated device is ``cpu``, and then every CPU tensor a module
  brings (but the layer's own host buffers and pinned ranges) is device memory, adopted as is.

:func:`check_cuda_sim` (a test's teardown) returns what was recorded since the last check and
the copies nobody ever waited for, then lands everything, so the next test starts clean.

Not modelled: device memory distinct from host memory by default (see ``host_modules``;
tensors a forward makes are host memory even then: compute runs on the CPU), NCCL's
collectives themselves (a communicator's memory only, taken by hand), kernels other
than module forwards (functional calls on weights outside a module, an optimizer's in-place
step), torch's pinned host allocator (``pin_memory=True`` needs an accelerator build of torch:
a CPU build refuses it), graph capture beyond the flag :meth:`SimCuda.capture` sets, several
host threads' own views of completion (one host vector for the process), the driver's
pageable staging beyond its blocking rules (a device-to-pageable copy returns only once
landed; a pageable-to-device one once its source was read).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import contextlib
import itertools
import mmap
import os
import random
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..devices import MemoryStats
from ._ordering import POISON, OrderingViolation, Violations, poison

__all__ = ["CONV_WORKSPACE_BYTES", "HOST_MODULES_ENV", "POISON", "WORKSPACE_BYTES",
           "CudaSimViolation", "SimCuda", "SimEvent", "SimStream", "check_cuda_sim",
           "checking_sim"]

#: Environment variable: ``1`` makes every simulated GPU built without ``host_modules`` keep
#: device memory distinct from host memory (see the module doc).
HOST_MODULES_ENV = "RESIDENCY_SIM_HOST_MODULES"

_MIN_BLOCK = 512
#: The library workspace the simulated GPUs of the checking layers (and the tests' fixtures)
#: take per host thread and stream at its first kernel and keep (see the module doc). A GPU's
#: cuBLAS takes 32 MiB a handle on Hopper; 1 MiB here: a fresh segment is filled with poison,
#: and 32 MiB a thread costs a suite with many worker threads gigabytes. So a workspace sits in
#: a 2 MiB small segment the weights' small blocks may share (on a GPU, mostly its own). The
#: planner's measured activation reserve leaves out bytes kept after the warm-up
#: (lifecycle/_measure.py), and tests compare the library's bytes, or warm their threads first.
WORKSPACE_BYTES = 1 << 20
#: cuDNN's workspace a convolution's kernel takes for its own time on the simulated GPUs of
#: :func:`checking_sim` (a GPU's: megabytes to hundreds of them, by algorithm; small here
#: for the poison fill's sake). It raises a forward's peak, as activations do.
CONV_WORKSPACE_BYTES = 1 << 20
_SMALL_REQUEST = 1 << 20
_SMALL_SEGMENT = 2 << 20
_LARGE_SEGMENT = 20 << 20
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_ERROR_NAMES = {CUDA_ERROR_INVALID_VALUE: "cudaErrorInvalidValue",
                CUDA_ERROR_MEMORY_ALLOCATION: "cudaErrorMemoryAllocation",
                CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: "cudaErrorHostMemoryAlreadyRegistered"}


class CudaSimViolation(OrderingViolation):
    """Work on the simulated GPU was not ordered as CUDA needs (see the module doc)."""


# -- process-wide state: one CUDA runtime per process, several simulated devices ----------

class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.tls = threading.local()
        self.devices: weakref.WeakSet[SimCuda] = weakref.WeakSet()
        self.streams: weakref.WeakValueDictionary[int, SimStream] = weakref.WeakValueDictionary()
        self.busy: set[SimStream] = set()  # streams with work not landed
        self.host: dict[int, int] = {}  # stream id -> position the host has seen complete
        self.storages: dict[int, _Storage] = {}  # storage data_ptr -> what the simulator knows
        self.violations = Violations(self.lock, CudaSimViolation)
        self.hooked = False

    def device_of_thread(self) -> int:
        return int(getattr(self.tls, "device", 0))


_S = _State()
# The simulator's one log of violations (see strategies.checking._ordering.Violations).
_record = _S.violations.record
_fail = _S.violations.fail
_raise_recorded = _S.violations.raise_recorded
_sids = itertools.count(1)


def _merge(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


def _on_event_loop() -> bool:
    """Whether the calling thread runs an event loop (asyncio or trio), outside a module's
    forward (a forward run on the loop's thread blocks it anyway: the caller chose so)."""
    if getattr(_S.tls, "forwards", 0):
        return False
    if asyncio._get_running_loop() is not None:
        return True
    trio = sys.modules.get("trio")
    return bool(trio is not None and trio.lowlevel.in_trio_run())


# -- work on streams --------------------------------------------------------------------

@dataclass(eq=False)
class _Use:
    """A range of memory an item reads or writes."""

    item: _Item
    base: int  # the storage's data_ptr
    start: int  # absolute byte range
    end: int
    write: bool
    what: str
    earlier: bool = False  # queued for an earlier tenant of the block (``what`` names it)

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


@dataclass(eq=False)
class _Item:
    stream: SimStream
    pos: int
    due: float
    deps: dict[int, int]
    kind: str  # "copy", "kernel", "marker"
    what: str
    land: Callable[[], None] | None = None
    dst: weakref.ref[torch.UntypedStorage] | None = None  # a copy's destination
    uses: list[_Use] = field(default_factory=list)
    landed: bool = False
    landed_at: float = 0.0
    discarded: bool = False  # its result is not wanted (a dropped prefetch)
    batch: list[_Item] = field(default_factory=list)  # a marker's: the copies queued before it
    finalizers: list[weakref.finalize[Any, Any]] = field(default_factory=list)

    @property
    def vector(self) -> dict[int, int]:
        return {**self.deps, self.stream.sid: self.pos}

    def describe(self) -> str:
        return f"{self.what} (#{self.pos} on {self.stream.name})"


class SimStream:
    """A simulated CUDA stream (see the module doc)."""

    def __init__(self, sim: SimCuda, name: str, own: bool) -> None:
        self.sim = sim
        self.sid = next(_sids)
        self.name = f"{name} stream of {sim.name}"
        self.own = own  # made by new_stream (not torch's shared pool, not the default)
        self.priority = 0
        self.destroyed = False  # by destroy_stream: nothing may be queued on it any more
        self.items: deque[_Item] = deque()
        self.tail = 0  # position of the last item queued
        self.done = 0  # position of the last item landed
        self.knows: dict[int, int] = {}  # waits: how far into other streams its next work waits
        self.last_due = 0.0
        self.batch: list[_Item] = []  # copies queued since the last marker (an event's batch)
        _S.streams[self.sid] = self

    def __repr__(self) -> str:
        return f"<SimStream {self.name}>"

    def wait_event(self, event: SimEvent) -> None:
        with _S.lock:
            if event.item is not None:
                self._wait(event.item)
                if self is self.sim._default and event.item.batch:
                    self.sim.compute_waits += 1

    def wait_stream(self, stream: SimStream) -> None:
        with _S.lock:
            self._wait(stream._marker("wait_stream"))

    def _wait(self, item: _Item) -> None:
        # Everything this stream runs from now on is ordered after ``item``. The simulator
        # lands it now: kernels run on the CPU as soon as they are called, and work ordered
        # after a copy must see its bytes (races are found by ordering, not by timing).
        self.knows = _merge(self.knows, item.vector)
        item.stream._complete(item.pos)

    def synchronize(self) -> None:
        self.sim._host_wait("Stream.synchronize")
        with _S.lock:
            self._complete(self.tail)
            if self.tail:
                _S.host = _merge(_S.host, {**self.knows, self.sid: self.tail})
            _retire()
        _raise_recorded()

    def query(self) -> bool:
        with _S.lock:
            _tick()
            return self.done >= self.tail

    # internals (under the lock)
    def _queue(self, kind: str, what: str, lag: float, land: Callable[[], None] | None = None
               ) -> _Item:
        if self.destroyed:
            _fail(f"{what} was queued on {self.name}, which was destroyed")
        self.tail += 1
        due = max(time.monotonic() + lag, self.last_due)
        self.last_due = due
        item = _Item(self, self.tail, due, _merge(self.knows, _S.host), kind, what, land)
        self.items.append(item)
        if kind == "copy":
            self.batch.append(item)
        _S.busy.add(self)
        return item

    def _marker(self, what: str) -> _Item:
        item = self._queue("marker", what, 0.0)
        item.batch, self.batch = self.batch, []
        return item

    def _complete(self, pos: int) -> None:
        """Land every item up to ``pos`` (and what each waits for): a blocking wait."""
        while self.done < pos and self.items:
            item = self.items[0]
            for sid, p in item.deps.items():
                other = _S.streams.get(sid)
                if other is not None and other is not self:
                    other._complete(p)
            self._land_head()

    def _land_head(self) -> None:
        item = self.items.popleft()
        item.landed = True
        item.landed_at = max(item.due, time.monotonic())
        self.done = item.pos
        if item.land is not None:
            land, item.land = item.land, None
            land()
        if not self.items:
            _S.busy.discard(self)

    def _ready(self, now: float) -> bool:
        item = self.items[0]
        if item.due > now:
            return False
        for sid, p in item.deps.items():
            other = _S.streams.get(sid)
            if other is not None and other is not self and other.done < p:
                return False
        return True


def _tick() -> None:
    """Land what is due (in order per stream, after what it waits for). Under the lock."""
    now = time.monotonic()
    progress = True
    while progress:
        progress = False
        for stream in list(_S.busy):
            while stream.items and stream._ready(now):
                stream._land_head()
                progress = True


def _retire() -> None:
    """Forget the uses of items the host has seen complete: nothing can race with them."""
    for info in list(_S.storages.values()):
        info.uses = [u for u in info.uses if _S.host.get(u.item.stream.sid, 0) < u.item.pos]
        if not info.uses and info.kind == "host" and info.owner is None:
            for fin in info.finalizers:
                fin.detach()
            _S.storages.pop(info.base, None)


class SimEvent:
    """A simulated CUDA event: a marker queued on a stream when recorded."""

    def __init__(self, sim: SimCuda, timing: bool) -> None:
        self.sim = sim
        self.timing = timing
        self.item: _Item | None = None

    def record(self, stream: SimStream | None = None) -> None:
        with _S.lock:
            target = stream if stream is not None else self.sim.current_stream()
            if target.sim is not self.sim:
                _fail(f"an event of {self.sim.name} was recorded on {target.name}, a stream of "
                      "another device (cudaErrorInvalidResourceHandle: an event belongs to "
                      "the device it was first recorded on)")
            self.item = target._marker("event")

    def query(self) -> bool:
        with _S.lock:
            _tick()
            if self.item is None or self.item.landed:
                if self.item is not None:
                    _S.host = _merge(_S.host, self.item.vector)
                return True
            return False

    def synchronize(self) -> None:
        self.sim._host_wait("Event.synchronize")
        with _S.lock:
            if self.item is not None:
                self.item.stream._complete(self.item.pos)
                _S.host = _merge(_S.host, self.item.vector)
                _retire()
        _raise_recorded()

    def wait(self, stream: SimStream | None = None) -> None:
        (stream or self.sim.current_stream()).wait_event(self)

    def elapsed_time(self, end_event: SimEvent) -> float:
        assert self.item is not None and end_event.item is not None
        return (end_event.item.landed_at - self.item.landed_at) * 1e3


# -- memory -----------------------------------------------------------------------------

@dataclass(eq=False)
class _Segment:
    """A segment the simulated allocator reserved (as ``cudaMalloc``), owned by one stream's
    pool, small or large, and cut into blocks."""

    mem: mmap.mmap
    size: int
    stream: int
    small: bool
    blocks: list[_Block] = field(default_factory=list)
    addr: int = 0  # the address of its first byte

    @property
    def idle(self) -> bool:
        """Every block free: ``empty_cache`` gives the segment back."""
        return all(b.state == "free" for b in self.blocks)


@dataclass(eq=False)
class _Block:
    """A piece of a segment: free, used by a tensor, or freed while streams that recorded a
    use of it (``record_stream``) have not passed the positions in ``waits`` (``pending``)."""

    segment: _Segment
    offset: int
    size: int
    state: str = "free"  # "free", "used", "pending"
    waits: list[tuple[int, int]] = field(default_factory=list)  # (stream, position) to pass
    # Uses by earlier tenants on the block's own stream the host has not seen complete: the
    # next tenant inherits them (a copy into it must be ordered after that stream's work).
    history: list[_Use] = field(default_factory=list)

    @property
    def stream(self) -> int:
        return self.segment.stream

    def prune(self, uses: list[_Use]) -> None:
        """Keep as its history those of ``uses`` that touch its bytes and that the host has not
        seen complete (once each)."""
        start = self.segment.addr + self.offset
        end = start + self.size
        seen: set[int] = set()
        live = []
        for u in uses:
            if id(u) not in seen and u.overlaps(start, end) and not _host_knows(u.item):
                seen.add(id(u))
                live.append(u)
        # They are all work of the block's own stream: a copy ordered after a later use is
        # ordered after every earlier one it covers, so those are dropped (else a block
        # reused again and again, a convolution's workspace, keeps every tenant's use).
        kept: list[_Use] = []
        for u in sorted(live, key=lambda u: u.item.pos, reverse=True):
            if not any(v.start <= u.start and u.end <= v.end for v in kept):
                kept.append(u)
        self.history = kept


@dataclass(eq=False)
class _Storage:
    """What the simulator knows of one storage (by its data_ptr)."""

    base: int
    nbytes: int
    kind: str  # "block" (allocated here), "adopted" (device memory made elsewhere), "host"
    sim: SimCuda | None = None
    stream: int = 0  # the stream a device storage belongs to
    recorded: set[int] = field(default_factory=set)  # record_stream uses
    owner: str | None = None
    uses: list[_Use] = field(default_factory=list)
    # 2 x stream id (+1 for a write) -> that stream's last kernel reading (writing) it
    kernels: dict[int, _Use] = field(default_factory=dict)
    finalizers: list[weakref.finalize[Any, Any]] = field(default_factory=list)

    def describe(self, start: int | None = None, end: int | None = None) -> str:
        kind = {"block": "device buffer", "adopted": "device buffer", "host": "host buffer"}
        what = f"{kind[self.kind]} of {self.owner}" if self.owner else kind[self.kind]
        part = "" if start is None or (start, end) == (self.base, self.base + self.nbytes) \
            else f" bytes [{start - self.base}, {(end or 0) - self.base})"
        return f"{what} ({self.nbytes} bytes{part})"


def _range(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage data_ptr, first byte, end byte)`` of what ``t`` addresses."""
    base = t.untyped_storage().data_ptr()
    if not t.numel():
        return base, t.data_ptr(), t.data_ptr()
    span = 1 + sum((int(n) - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride(), strict=True))
    return base, t.data_ptr(), t.data_ptr() + span * t.element_size()


class SimCuda:
    """One simulated GPU (see the module doc). ``index``: the ordinal it pretends to have
    (1 by default, so that calls made with another device current are seen); ``capacity``:
    its memory; ``locked_limit``: host bytes that may be page-locked; ``max_lag``: seconds
    of random delay (``seed``) before queued work lands; ``host_modules``: only its own
    allocations are device memory, not every CPU tensor (None: :data:`HOST_MODULES_ENV`)."""

    simulated = True

    def __init__(self, *, index: int = 1, capacity: int = 80 * 2**30,
                 locked_limit: int = 64 * 2**30, max_lag: float = 0.002, seed: int = 0,
                 name: str | None = None, exact_segments: bool = False,
                 stream_error: int = 0, register_error: int = 0,
                 register_rate: float = 64 * 2**30, workspace_bytes: int = 0,
                 conv_workspace_bytes: int = 0, host_modules: bool | None = None) -> None:
        self.index = index
        # Whether device memory is only what the simulator allocated (and the layer adopted):
        # a CPU tensor a module brings is then host memory, as on a GPU.
        self.host_modules = os.environ.get(HOST_MODULES_ENV) == "1" if host_modules is None \
            else host_modules
        # Every block a segment of its own, of its rounded size: reserved bytes are then the
        # blocks' (cached ones included), without torch's segment rounding (tests of a bound).
        self.exact_segments = exact_segments
        self.name = name or f"simulated cuda:{index}"
        self.capacity = capacity
        self.locked_limit = locked_limit
        # Injected failures: new_stream / host_register fail with this CUDA error (0: never),
        # leaving it as the calling thread's last error, as CUDA does.
        self.stream_error = stream_error
        self.register_error = register_error
        self.register_rate = register_rate  # bytes per second cudaHostRegister pins
        # A library workspace (cuBLAS's: 32 MiB on Hopper) the first kernel of each host thread
        # on each stream takes from the allocator and never gives back.
        self.workspace_bytes = workspace_bytes
        self._workspaces: dict[tuple[int, int], torch.Tensor] = {}
        # cuDNN's workspace: each convolution's kernel takes this many bytes from the
        # allocator on its stream for its own time (freed once queued: stream-ordered).
        self.conv_workspace_bytes = conv_workspace_bytes
        # Device memory taken outside the caching allocator (take_foreign): key -> bytes.
        self._foreign: dict[int, tuple[int, str]] = {}
        self._foreign_keys = itertools.count(1)
        self.max_lag = max_lag
        self._random = random.Random(seed)
        self._segments: list[_Segment] = []
        self._pending: list[_Block] = []
        self._allocated = self._active = self._reserved = 0
        self._peak_allocated = self._peak_reserved = 0
        self._pinned: dict[int, int] = {}  # registered host ranges: start -> bytes
        self._pinned_starts: list[int] = []
        self._capturing: set[int] = set()  # stream ids capturing a graph
        self.mallocs = 0  # segments allocated from the "driver"
        self.compute_waits = 0  # times the compute stream waited for a batch of copies
        self._default = SimStream(self, "default", own=False)
        with _S.lock:
            _S.devices.add(self)
            if not _S.hooked:
                torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)
                torch.nn.modules.module.register_module_forward_hook(_after_forward,
                                                                     always_call=True)
                _S.hooked = True

    def __repr__(self) -> str:
        return f"<SimCuda {self.name}>"

    # -- streams, events, devices --------------------------------------------------------
    def own_stream(self) -> SimStream | None:
        if self.stream_error:
            _S.tls.error = (self.stream_error, "cudaStreamCreateWithPriority")
            return None
        return SimStream(self, f"copy {next(_sids)}", own=True)

    def new_stream(self) -> SimStream:
        return SimStream(self, f"pooled {next(_sids)}", own=False)

    def destroy_stream(self, stream: SimStream) -> None:
        with _S.lock:
            if stream.destroyed or not stream.own:
                _fail(f"{stream.name} was destroyed twice, or is not one new_stream made")
            stream.destroyed = True

    def clear_error(self) -> int:
        error = getattr(_S.tls, "error", None)
        _S.tls.error = None
        return 0 if error is None else int(error[0])

    def error_name(self, err: int) -> str:
        return _ERROR_NAMES.get(err, f"cudaError {err}")

    def _launch(self, what: str) -> None:
        """A launch (a copy, a kernel, an allocation) checks the thread's last error, as
        torch's C10_CUDA_CHECK after a launch does: one a failed call left raises here."""
        error = getattr(_S.tls, "error", None)
        if error is not None:
            _S.tls.error = None
            _fail(f"{what} on thread {threading.current_thread().name!r} raised "
                  f"{self.error_name(error[0])}, left by an earlier failed {error[1]} that "
                  "nobody cleared (cudaGetLastError)")

    def default_stream(self) -> SimStream:
        return self._default

    def current_stream(self) -> SimStream:
        streams: dict[int, SimStream] = getattr(_S.tls, "streams", {})
        return streams.get(id(self), self._default)

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[None]:
        if not hasattr(_S.tls, "streams"):
            _S.tls.streams = {}
        before = _S.tls.streams.get(id(self))
        device = _S.device_of_thread()
        _S.tls.streams[id(self)] = stream
        _S.tls.device = self.index  # as torch.cuda.stream: the stream's device is current
        try:
            yield
        finally:
            _S.tls.device = device
            if before is None:
                _S.tls.streams.pop(id(self), None)
            else:
                _S.tls.streams[id(self)] = before

    @contextlib.contextmanager
    def use_device(self) -> Iterator[None]:
        device = _S.device_of_thread()
        _S.tls.device = self.index
        try:
            yield
        finally:
            _S.tls.device = device

    def event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self, timing)

    def is_capturing(self) -> bool:
        return self.current_stream().sid in self._capturing

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Pretend the calling thread's current stream captures a CUDA graph meanwhile."""
        sid = self.current_stream().sid
        self._capturing.add(sid)
        try:
            yield
        finally:
            self._capturing.discard(sid)

    def _context(self, what: str) -> None:
        current = _S.device_of_thread()
        if current != self.index:
            _record(f"{what} ran on thread {threading.current_thread().name!r} whose current "
                    f"device is cuda:{current}, not {self.name}'s cuda:{self.index}: CUDA "
                    f"would create a context on cuda:{current} (set the device first)")

    def _host_wait(self, what: str) -> None:
        self._context(what)
        self._not_capturing(what)
        if _on_event_loop():
            _record(f"{what} (a synchronizing call) ran on the event loop's thread "
                    f"{threading.current_thread().name!r}: the loop stops serving meanwhile")

    def _not_capturing(self, what: str) -> None:
        if self._capturing:
            _fail(f"{what} (a synchronizing call) ran while a stream of {self.name} captures "
                  "a CUDA graph: the capture is invalidated (cudaErrorStreamCaptureUnsupported)")

    def synchronize(self) -> None:
        # (Not checked for the event loop: programs call it there on purpose, a benchmark
        # before it reads the clock; the library calls it in worker threads.)
        self._not_capturing("synchronize")
        with _S.lock:
            self._land_all()
        _raise_recorded()

    def _land_all(self) -> None:
        """Every stream of this device lands what it queued, and the host knows (under the
        lock). The allocator's pending blocks are not processed: torch does that at its next
        allocation or empty_cache."""
        for stream in [s for s in _S.streams.values() if s.sim is self]:
            stream._complete(stream.tail)
            if stream.tail:
                _S.host = _merge(_S.host, {**stream.knows, stream.sid: stream.tail})
        _retire()

    # -- which memory is whose -----------------------------------------------------------
    def is_device(self, t: torch.Tensor) -> bool:
        info = _S.storages.get(t.untyped_storage().data_ptr())
        return info is not None and info.sim is self

    def on_device(self, t: torch.Tensor) -> bool:
        if self.host_modules:
            return self.is_device(t)
        # Every CPU tensor stands for device memory, but registered (pinned) host memory.
        return t.device.type == "cpu" and (self.is_device(t) or not self.is_pinned(t))

    def is_pinned(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        i = bisect.bisect_right(self._pinned_starts, ptr) - 1
        return i >= 0 and ptr < self._pinned_starts[i] + self._pinned[self._pinned_starts[i]]

    def adopt(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        base = storage.data_ptr()
        with _S.lock:
            info = _S.storages.get(base)
            if info is not None and info.sim is self:
                return
            if info is not None:  # host buffer the simulator saw before: now device memory
                for fin in info.finalizers:
                    fin.detach()
            nbytes = int(storage.nbytes())
            info = _Storage(base, nbytes, "adopted", self, self._default.sid)
            _S.storages[base] = info
            self._count(nbytes, nbytes, nbytes)
            info.finalizers.append(weakref.finalize(storage, self._adopted_died, info))

    def label(self, t: torch.Tensor, owner: str) -> None:
        base = t.untyped_storage().data_ptr()
        with _S.lock:
            info = _S.storages.get(base)
            if info is None:
                info = self._host_info(t)
            info.owner = owner

    def _host_info(self, t: torch.Tensor) -> _Storage:
        storage = t.untyped_storage()
        base = storage.data_ptr()
        info = _S.storages.get(base)
        if info is None:
            info = _Storage(base, int(storage.nbytes()), "host")
            _S.storages[base] = info
            info.finalizers.append(weakref.finalize(storage, _host_died, info))
        return info

    def _info(self, t: torch.Tensor) -> _Storage:
        info = _S.storages.get(t.untyped_storage().data_ptr())
        return info if info is not None else self._host_info(t)

    # -- the allocator -------------------------------------------------------------------
    def _count(self, allocated: int, active: int, reserved: int) -> None:
        self._allocated += allocated
        self._active += active
        self._reserved += reserved
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        self._peak_reserved = max(self._peak_reserved, self._reserved)

    def empty(self, nbytes: int) -> torch.Tensor:
        return self._empty(nbytes)

    def _empty(self, nbytes: int) -> torch.Tensor:
        self._launch("an allocation")
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        size = max(_MIN_BLOCK, -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK)
        with _S.lock:
            _tick()
            stream = self.current_stream()
            self._process_pending()
            block = self._find(size, stream.sid) or self._grow(size, stream.sid)
            block.state = "used"
            self._count(block.size, block.size, 0)
            t = torch.frombuffer(block.segment.mem, dtype=torch.uint8, count=nbytes,
                                 offset=block.offset)
            storage = t.untyped_storage()
            info = _Storage(storage.data_ptr(), nbytes, "block", self, stream.sid)
            info.uses = [u for u in block.history if not _host_knows(u.item)]
            block.history = []
            _S.storages[info.base] = info
            info.finalizers.append(weakref.finalize(storage, self._block_died, info, block))
        _raise_recorded()  # (a wait under memory pressure on the event loop)
        return t

    def _find(self, size: int, stream: int) -> _Block | None:
        small = size <= _SMALL_REQUEST
        best: _Block | None = None
        for seg in self._segments:
            if seg.stream != stream or seg.small != small:
                continue
            for b in seg.blocks:
                if b.state == "free" and b.size >= size and (best is None or b.size < best.size):
                    best = b
        if best is None:
            return None
        rest = best.size - size
        if rest >= (_MIN_BLOCK if small else _SMALL_REQUEST + 1):
            seg = best.segment
            tail = _Block(seg, best.offset + size, rest)
            seg.blocks.insert(seg.blocks.index(best) + 1, tail)
            best.size = size
            tail.prune(best.history)
            best.prune(best.history)
        return best

    def _grow(self, size: int, stream: int) -> _Block:
        small = size <= _SMALL_REQUEST
        seg_size = size if self.exact_segments else _SMALL_SEGMENT if small \
            else _LARGE_SEGMENT if size < _MIN_LARGE_ALLOC \
            else -(-size // _ROUND_LARGE) * _ROUND_LARGE
        if self._reserved + seg_size + self.foreign_bytes > self.capacity:
            # torch frees its cached blocks and retries: it first waits for the events of
            # blocks freed while recorded, and cudaFree synchronizes the device.
            if _on_event_loop():
                _record(f"an allocation of {size} bytes under memory pressure (it synchronizes "
                        f"{self.name} to free cached blocks) ran on the event loop's thread "
                        f"{threading.current_thread().name!r}: the loop stops serving meanwhile")
            self._land_all()
            self._release_free()
            if self._reserved + seg_size + self.foreign_bytes > self.capacity:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (simulated): tried to allocate {size} bytes on "
                    f"{self.name}; {self.capacity} bytes total, {self._reserved} reserved, "
                    f"{self._allocated} allocated, {self.foreign_bytes} taken outside the "
                    "caching allocator")
        mem = mmap.mmap(-1, seg_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mem.write(bytes([POISON]) * seg_size) if seg_size <= _SMALL_SEGMENT else \
            torch.frombuffer(mem, dtype=torch.uint8).fill_(POISON)
        seg = _Segment(mem, seg_size, stream, small,
                       addr=torch.frombuffer(mem, dtype=torch.uint8, count=1).data_ptr())
        self._segments.append(seg)
        self.mallocs += 1
        self._count(0, 0, seg_size)
        block = _Block(seg, 0, seg_size)
        seg.blocks.append(block)
        found = self._find(size, stream)
        assert found is block
        return block

    def _block_died(self, info: _Storage, block: _Block) -> None:
        """A device buffer's storage died: torch's ``free``: back to its stream's pool, or
        pending until the streams that recorded a use pass this point."""
        with _S.lock:
            self._check_free(info)
            _S.storages.pop(info.base, None)
            self._allocated -= block.size
            block.prune([
                _Use(u.item, u.base, u.start, u.end, u.write,
                     u.what if u.earlier else info.describe(u.start, u.end), earlier=True)
                for u in [*info.uses, *info.kernels.values()]
                if u.item.stream.sid == info.stream and not _host_knows(u.item)])
            waits = []
            for sid in info.recorded:
                other = _S.streams.get(sid)
                if other is not None and other.destroyed:
                    _record(f"{info.describe()} was freed after {other.name}, recorded on it "
                            "(record_stream), was destroyed: the allocator records an event "
                            "on a destroyed stream")
                if other is not None and other.tail > other.done:
                    waits.append((sid, other.tail))
            if waits:
                block.state, block.waits = "pending", waits
                self._pending.append(block)
            else:
                self._free_block(block)

    def _adopted_died(self, info: _Storage) -> None:
        with _S.lock:
            self._check_free(info)
            if _S.storages.get(info.base) is info:
                del _S.storages[info.base]
            self._count(-info.nbytes, -info.nbytes, -info.nbytes)

    def _check_free(self, info: _Storage) -> None:
        """Work still using a freed device buffer must be ordered before its block's reuse:
        by stream order (its own stream), a wait its own stream or the host did, or a
        ``record_stream`` (the free then waits for that stream)."""
        own = _S.streams.get(info.stream)
        knows = _merge(_S.host, own.knows if own is not None else {})
        for use in [*info.uses, *info.kernels.values()]:
            sid = use.item.stream.sid
            if sid == info.stream or knows.get(sid, 0) >= use.item.pos or sid in info.recorded:
                continue
            _record(f"{info.describe()} was freed while {use.item.describe()} on another "
                    f"stream still {'writes' if use.write else 'reads'} it, unordered (no "
                    "record_stream, no wait): its block can be reused before that is done")

    def _free_block(self, block: _Block) -> None:
        seg = block.segment
        block.state, block.waits = "free", []
        self._active -= block.size
        # Poison: whoever reads a freed block (or a reused one before writing it) sees NaN.
        torch.frombuffer(seg.mem, dtype=torch.uint8, count=block.size,
                         offset=block.offset).fill_(POISON)
        i = seg.blocks.index(block)
        if i + 1 < len(seg.blocks) and seg.blocks[i + 1].state == "free":
            after = seg.blocks.pop(i + 1)
            block.size += after.size
            block.prune(block.history + after.history)
        if i > 0 and seg.blocks[i - 1].state == "free":
            prev = seg.blocks[i - 1]
            prev.size += seg.blocks.pop(i).size
            prev.prune(prev.history + block.history)

    def _process_pending(self) -> None:
        keep = []
        for block in self._pending:
            if all((s := _S.streams.get(sid)) is None or s.done >= pos for sid, pos in block.waits):
                self._free_block(block)
            else:
                keep.append(block)
        self._pending = keep

    def _release_free(self) -> None:
        self._process_pending()
        for seg in list(self._segments):
            if seg.idle:
                self._segments.remove(seg)
                self._reserved -= seg.size
                seg.blocks.clear()
                with contextlib.suppress(BufferError):
                    seg.mem.close()

    def empty_cache(self) -> None:
        # Under the allocator's lock (allocations in other threads wait), after waiting for
        # the device: cudaFree synchronizes it.
        self._not_capturing("empty_cache")
        if _on_event_loop():
            _record("empty_cache (a synchronizing call) ran on the event loop's thread "
                    f"{threading.current_thread().name!r}: the loop stops serving meanwhile")
        with _S.lock:
            self._land_all()
            self._release_free()
        _raise_recorded()

    def memory(self) -> MemoryStats:
        # The counters as the allocator left them at its last call: a block whose recorded
        # stream has since passed its free is still active until the next allocation.
        with _S.lock:
            return MemoryStats(self._allocated, self._active, self._reserved,
                               self._peak_allocated, self._peak_reserved)

    @property
    def workspace_total(self) -> int:
        """Bytes the library workspaces (see ``workspace_bytes``) hold from the allocator."""
        return sum(-(-int(w.numel()) // _MIN_BLOCK) * _MIN_BLOCK
                   for w in self._workspaces.values())

    def reset_peak(self) -> None:
        with _S.lock:
            self._peak_allocated, self._peak_reserved = self._allocated, self._reserved

    def mem_get_info(self) -> tuple[int, int]:
        with _S.lock:
            return self.capacity - self._reserved - self.foreign_bytes, self.capacity

    # -- memory outside the caching allocator --------------------------------------------
    @property
    def foreign_bytes(self) -> int:
        """Device bytes taken outside this process's caching allocator (:meth:`take_foreign`)."""
        return sum(n for n, _ in self._foreign.values())

    def take_foreign(self, nbytes: int, what: str) -> int:
        """``nbytes`` of this GPU taken outside the caching allocator: NCCL's buffers when a
        communicator is made (``NCCL_BUFFSIZE``, 4 MiB, per channel and peer: tens to
        hundreds of MiB), the CUDA context of a process beside this one, a library's own
        ``cudaMalloc``. ``mem_get_info`` sees them taken, the allocator's counters do not, and
        a segment that would not fit beside them fails as out of memory (after the cached
        blocks are given back). ``torch.OutOfMemoryError`` when they do not fit themselves
        (the cache is not emptied for them: another process cannot). Returns the key that
        :meth:`release_foreign` takes."""
        with _S.lock:
            if nbytes > self.capacity - self._reserved - self.foreign_bytes:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (simulated): {what} could not take {nbytes} bytes "
                    f"on {self.name}: {self._reserved} reserved by the caching allocator, "
                    f"{self.foreign_bytes} outside it, {self.capacity} total")
            key = next(self._foreign_keys)
            self._foreign[key] = (nbytes, what)
            return key

    def release_foreign(self, key: int) -> None:
        """Give back what :meth:`take_foreign` took (a communicator destroyed)."""
        with _S.lock:
            del self._foreign[key]

    def discard(self, event: SimEvent) -> None:
        """The copies ``event`` was recorded after are not wanted (a dropped prefetch)."""
        with _S.lock:
            if event.item is not None:
                for item in event.item.batch:
                    item.discarded = True

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        with _S.lock:
            if stream.destroyed:
                _fail(f"record_stream on {stream.name}, which was destroyed")
            info = _S.storages.get(t.untyped_storage().data_ptr())
            if info is not None and info.sim is self and stream.sid != info.stream:
                info.recorded.add(stream.sid)

    # -- pinned memory -------------------------------------------------------------------
    def host_register(self, ptr: int, nbytes: int) -> int:
        self._context("cudaHostRegister")
        self._not_capturing("cudaHostRegister")
        if _on_event_loop():
            _record(f"cudaHostRegister of {nbytes} bytes (it pins every page, blocking) ran on "
                    f"the event loop's thread {threading.current_thread().name!r}: the loop "
                    "stops serving meanwhile")
        time.sleep(nbytes / self.register_rate)
        with _S.lock:
            error = self.register_error
            if not error and sum(self._pinned.values()) + nbytes > self.locked_limit:
                error = CUDA_ERROR_MEMORY_ALLOCATION
            if error:
                _S.tls.error = (error, "cudaHostRegister")
                return error
            self._pinned[ptr] = nbytes
            bisect.insort(self._pinned_starts, ptr)
        return 0

    def host_unregister(self, ptr: int) -> int:
        self._host_wait("cudaHostUnregister")
        with _S.lock:
            nbytes = self._pinned.pop(ptr, None)
            if nbytes is None:
                _S.tls.error = (CUDA_ERROR_INVALID_VALUE, "cudaHostUnregister")
                return CUDA_ERROR_INVALID_VALUE
            self._pinned_starts.remove(ptr)
            for info in list(_S.storages.values()):
                for use in info.uses:
                    if use.overlaps(ptr, ptr + nbytes) and not _host_knows(use.item):
                        _record(f"pinned {info.describe(use.start, use.end)} was unregistered "
                                f"while {use.item.describe()} still "
                                f"{'writes' if use.write else 'reads'} it (never waited for)")
        return 0

    # -- copies and host access ----------------------------------------------------------
    def host_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with _S.lock:
            _tick()
            self._order(None, _S.host, [(dst, True), (src, False)], "a host copy")
        dst.copy_(src)

    def host_write(self, t: torch.Tensor) -> None:
        with _S.lock:
            _tick()
            self._order(None, _S.host, [(t, True)], "a host write")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._launch("a copy")
        if not dst.numel():
            return
        to_device, from_device = self.is_device(dst), self.is_device(src)
        if not to_device and not from_device:
            self.host_copy(dst, src)
            return
        stream = self.current_stream()
        with _S.lock:
            _tick()
            knows = _merge(stream.knows, _S.host)
            what = f"copy {self._info(src).describe()} -> {self._info(dst).describe()}"
            self._order(stream, knows, [(dst, True), (src, False)], what)
            with torch.no_grad(), torch.inference_mode(False):
                snapshot = torch.empty_like(src, memory_format=torch.contiguous_format)
                snapshot.copy_(src)
                poison(dst)
            item = stream._queue("copy", what, self._random.uniform(0.0, self.max_lag))
            item.land = _lander(item, dst, src, snapshot)
            item.dst = weakref.ref(dst.untyped_storage())
            self._use(item, dst, True)
            if from_device or self.is_pinned(src):
                # (From pageable host memory the driver stages the bytes before returning:
                # the source may be reused at once.)
                self._use(item, src, False)
            if from_device and not to_device and not self.is_pinned(dst):
                # Into pageable host memory: cudaMemcpyAsync returns once the copy is done.
                stream._complete(item.pos)
                _S.host = _merge(_S.host, item.vector)
        _raise_recorded()

    def _use(self, item: _Item, t: torch.Tensor, write: bool) -> None:
        info = self._info(t)
        base, start, end = _range(t)
        use = _Use(item, base, start, end, write, info.describe(start, end))
        info.uses.append(use)
        item.uses.append(use)

    def _order(self, stream: SimStream | None, knows: dict[int, int],
               access: list[tuple[torch.Tensor, bool]], what: str) -> None:
        """Check new work (on ``stream``, or the host when None, ordered after ``knows``)
        touching ``access`` (tensor, writes) against the work in flight: land what it is
        ordered after and touches; raise for what it races with."""
        for t, write in access:
            base, start, end = _range(t)
            info = _S.storages.get(base)
            if info is None or start == end:
                continue
            for use in [*info.uses, *info.kernels.values()]:
                item = use.item
                if (item.landed and _host_knows(item)) or not use.overlaps(start, end):
                    continue
                if not write and not use.write:
                    continue  # two reads never race
                ordered = (stream is not None and item.stream is stream) \
                    or knows.get(item.stream.sid, 0) >= item.pos
                if ordered:
                    item.stream._complete(item.pos)  # it has run when this runs
                    continue
                where = info.describe(start, end)
                if use.earlier:
                    where += f", a block that held {use.what} (freed, its work still queued)"
                if stream is None:
                    verb = "writes" if write else "reads"
                    _fail(f"{what} by the host {verb} {where} while "
                          f"{item.describe()} still {'writes' if use.write else 'reads'} it "
                          "(the host never waited for it)")
                if write:
                    _fail(f"{what} {'overwrites' if not use.write else 'writes'} "
                          f"{where} while {item.describe()} still "
                          f"{'writes' if use.write else 'reads'} it (not ordered after it)")
                _fail(f"{what} reads {where} before {item.describe()} "
                      "into it landed (not ordered after it)")

    def _kernel(self, module: torch.nn.Module, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """The kernels of ``module``'s forward read ``tensors`` (device memory of this GPU),
        and write those flagged (updated in place: batch-norm statistics)."""
        stream = self.current_stream()
        what = f"a kernel of {type(module).__name__}"
        self._launch(what)
        key = (threading.get_ident(), stream.sid)
        if self.workspace_bytes and key not in self._workspaces:
            with self.use_stream(stream):
                workspace = self._empty(self.workspace_bytes)
            self.label(workspace, f"a library workspace (thread "
                                  f"{threading.current_thread().name!r})")
            self._workspaces[key] = workspace
        scratch = None
        if self.conv_workspace_bytes and isinstance(module, _CONVOLUTIONS):
            with self.use_stream(stream):  # (an out-of-memory here fails the forward)
                scratch = self._empty(self.conv_workspace_bytes)
            self.label(scratch, f"cuDNN's workspace of {what}")
        with _S.lock:
            _tick()
            knows = _merge(stream.knows, _S.host)
            self._order(stream, knows, tensors, what)
            item = stream._queue("kernel", what, self._random.uniform(0.0, self.max_lag))
            if scratch is not None:
                self._use(item, scratch, True)
            for t, write in tensors:
                info = _S.storages[t.untyped_storage().data_ptr()]
                base, start, end = _range(t)
                # The last read and the last write of each stream (a later read on the same
                # stream must not hide an earlier write from a copy that only reads).
                info.kernels[stream.sid * 2 + write] = _Use(item, base, start, end, write, "")
        del scratch  # freed once queued: its block is reused after the kernel, on its stream
        _raise_recorded()


# The modules whose kernels take cuDNN's workspace (``conv_workspace_bytes``).
_CONVOLUTIONS = (torch.nn.modules.conv._ConvNd,)


def _host_knows(item: _Item) -> bool:
    return _S.host.get(item.stream.sid, 0) >= item.pos


def _lander(item: _Item, dst: torch.Tensor, src: torch.Tensor, snapshot: torch.Tensor
            ) -> Callable[[], None]:
    """What landing the copy does: its bytes into the destination (if it still lives)."""
    dst_ref = weakref.ref(dst.untyped_storage())
    dst_geometry = (dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()), dst.dtype)

    def land() -> None:
        storage = dst_ref()
        if storage is None:
            return
        offset, shape, stride, dtype = dst_geometry
        with torch.no_grad(), torch.inference_mode(False):
            target = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
            target.copy_(snapshot)

    del src
    return land


def _host_died(info: _Storage) -> None:
    with _S.lock:
        for use in info.uses:
            if not _host_knows(use.item) and not use.item.discarded:
                _record(f"{info.describe(use.start, use.end)} was freed while "
                        f"{use.item.describe()} still {'writes' if use.write else 'reads'} it "
                        "(never waited for): its memory can be reused before the copy is done")
        if _S.storages.get(info.base) is info:
            del _S.storages[info.base]


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    _S.tls.forwards = getattr(_S.tls, "forwards", 0) + 1
    # The version counters of its own tensors: one that changed was written in place.
    if not hasattr(_S.tls, "versions"):
        _S.tls.versions = []
    _S.tls.versions.append({id(t): t._version for table in (module._parameters, module._buffers)
                            for t in table.values() if t is not None})


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    """A global forward hook (called even when the forward raised): the module's forward
    queued kernels reading its own tensors."""
    _S.tls.forwards = max(0, getattr(_S.tls, "forwards", 0) - 1)
    stack = getattr(_S.tls, "versions", None)
    versions: dict[int, int] = stack.pop() if stack else {}
    if not _S.devices or (output is None and sys.exc_info()[0] is not None):
        return
    found: dict[int, tuple[SimCuda, list[tuple[torch.Tensor, bool]]]] = {}
    for table in (module._parameters, module._buffers):
        for t in table.values():
            if t is None or not t.numel():
                continue
            info = _S.storages.get(t.untyped_storage().data_ptr())
            if info is not None and info.sim is not None:
                # Written in place: its version moved (``p.add_()``), or a buffer of a module
                # in training (batch-norm statistics: the kernel bumps no version).
                written = versions.get(id(t), t._version) != t._version or \
                    (module.training and table is module._buffers)
                found.setdefault(id(info.sim), (info.sim, []))[1].append((t, written))
    for sim, tensors in found.values():
        sim._kernel(module, tensors)


def checking_sim(**sim: Any) -> SimCuda:
    """The simulated GPU of the checking layers and the tests' fixtures: ``SimCuda(**sim)``,
    seeded from :func:`~strategies.devices.layer_seed`, with the libraries' workspaces
    (:data:`WORKSPACE_BYTES` a thread and stream, :data:`CONV_WORKSPACE_BYTES` a
    convolution) unless ``sim`` names them."""
    from ..devices import layer_seed

    sim.setdefault("seed", layer_seed())
    sim.setdefault("workspace_bytes", WORKSPACE_BYTES)
    sim.setdefault("conv_workspace_bytes", CONV_WORKSPACE_BYTES)
    return SimCuda(**sim)


def check_cuda_sim() -> list[str]:
    """What a test fails for: the violations recorded since the last check, and every copy
    nobody waited for (neither the host nor another stream, nor dropped on purpose). Then
    everything in flight lands and is forgotten, so the next test starts clean."""
    with _S.lock:
        problems = _S.violations.take_unreported()
        _S.violations.raised = _S.violations.checked
        waited: dict[int, int] = dict(_S.host)
        for stream in list(_S.streams.values()):
            waited = _merge(waited, stream.knows)
        for stream in list(_S.busy):
            for item in stream.items:
                if item.kind == "copy" and not item.discarded \
                        and waited.get(stream.sid, 0) < item.pos \
                        and item.dst is not None and item.dst() is not None:  # (freed: reported)
                    problems.append(f"{item.describe()} was never waited for")
        for stream in list(_S.streams.values()):
            stream._complete(stream.tail)
            if stream.tail:
                _S.host = _merge(_S.host, {stream.sid: stream.tail})
        _retire()
        for sim in list(_S.devices):
            sim._process_pending()
        _S.violations.checked = _S.violations.raised = len(_S.violations.found)
    return problems


def _report_at_exit() -> None:
    """A program run on the simulated GPU (``RESIDENCY_DEVICE_LAYER=cuda-sim``) names, on
    stderr as it exits, what it recorded that nobody reported (raised ones failed their call)."""
    if not _S.devices and _S.violations.checked == len(_S.violations.found):
        return
    problems = check_cuda_sim()
    if problems:
        print("residency: cuda-sim violations:\n- " + "\n- ".join(problems), file=sys.stderr)


atexit.register(_report_at_exit)
