"""The CUDA virtual-memory driver and CUDA graphs, simulated on the CPU: :class:`SimVmm` and
:class:`SimGraph`.

:class:`SimVmm` keeps the driver's rules (see :mod:`strategies.devices._vmm`):

* sizes and addresses are multiples of the granularity (``granularity``; 2 MiB as on a GPU);
* a reservation is a CPU byte buffer, kept until freed: its addresses never change;
* memory mapped is not accessible before ``set_access``; unmapped memory holds poison
  (``0xFF``: NaN in float dtypes), and so does memory just mapped (its bytes are undefined);
  :meth:`SimVmm.check_access` (a simulated graph's replay) is fatal on either;
* the context is per thread: a call from a thread where ``make_current`` was not called is
  ``CUDA_ERROR_INVALID_CONTEXT``;
* ``fail_at``: the k-th call (1-based, over the driver's life; ``calls`` counts them) fails
  with ``CUDA_ERROR_OUT_OF_MEMORY``, so a test can enumerate every failure point.

On the simulated GPU (``runtime``: a :class:`~strategies.checking._cudasim.SimCuda`) reservations are
that GPU's device memory (outside its caching allocator, as on a GPU).

:class:`SimGraph` records, at capture, every operand its kernels read (each tensor of the
module, by address) and at replay runs on exactly those addresses: fatal when one is unmapped
(a kernel on unmapped memory kills the CUDA context) and when a tensor was re-homed since (a
graph replays on the memory it captured, not where the tensor lives now).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..devices._vmm import _CAPTURE, VmmError

__all__ = ["GraphReplayFault", "SimGraph", "SimVmm"]

CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_INVALID_CONTEXT = 201
_TEXT = {CUDA_ERROR_OUT_OF_MEMORY: "out of memory", CUDA_ERROR_INVALID_VALUE: "invalid argument",
         CUDA_ERROR_INVALID_CONTEXT: "invalid device context"}
_POISON = 0xFF
_handles = itertools.count(1)


class GraphReplayFault(RuntimeError):
    """A simulated graph replayed on memory it must not touch (fatal on a GPU)."""


@dataclass
class _Reservation:
    va: int
    size: int
    buf: torch.Tensor
    handle: int | None = None  # mapped physical memory
    access: bool = False
    device: Any = None  # the simulated GPU's record of it as device memory (on a runtime)


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    starts: list[int] = field(default_factory=list)
    reservations: dict[int, _Reservation] = field(default_factory=dict)


_S = _State()


class _Context(threading.local):
    current: SimVmm | None = None


_TLS = _Context()


class SimVmm:
    """A simulated :class:`~strategies._vmm.VmmDriver` (see the module doc)."""

    def __init__(self, *, runtime: Any = None, granularity: int = 2 * 2**20,
                 fail_at: int | None = None) -> None:
        self.runtime = runtime
        self.device = torch.device("cpu")
        self._granularity = granularity
        self.fail_at = fail_at
        self.calls = 0
        self.log: list[str] = []  # the calls made, in order (their names)
        self._handles: dict[int, int] = {}  # live physical allocations: handle -> bytes
        self._mine: set[int] = set()

    # -- the rules ---------------------------------------------------------------------
    def _call(self, name: str) -> None:
        if _TLS.current is not self:
            raise VmmError(name, CUDA_ERROR_INVALID_CONTEXT, _TEXT[CUDA_ERROR_INVALID_CONTEXT],
                           f"thread {threading.current_thread().name!r} did not make the "
                           "context current")
        self.calls += 1
        self.log.append(name)
        if self.fail_at is not None and self.calls == self.fail_at:
            raise VmmError(name, CUDA_ERROR_OUT_OF_MEMORY, _TEXT[CUDA_ERROR_OUT_OF_MEMORY],
                           f"injected at call {self.calls}")

    def _aligned(self, name: str, *values: int) -> None:
        if any(v % self._granularity for v in values):
            raise VmmError(name, CUDA_ERROR_INVALID_VALUE, _TEXT[CUDA_ERROR_INVALID_VALUE],
                           f"{values} not multiples of the granularity {self._granularity}")

    def _res(self, name: str, va: int, size: int) -> _Reservation:
        r = _S.reservations.get(va)
        if r is None or va not in self._mine or r.size != size:
            raise VmmError(name, CUDA_ERROR_INVALID_VALUE, _TEXT[CUDA_ERROR_INVALID_VALUE],
                           f"[{va:#x}, +{size}) is not a reservation of this driver")
        return r

    @property
    def physical_bytes(self) -> int:
        """Physical bytes created and not released."""
        return sum(self._handles.values())

    # -- the driver ----------------------------------------------------------------------
    def make_current(self) -> None:
        _TLS.current = self

    def granularity(self) -> int:
        self._call("cuMemGetAllocationGranularity")
        return self._granularity

    def reserve(self, size: int) -> int:
        self._call("cuMemAddressReserve")
        self._aligned("cuMemAddressReserve", size)
        buf = torch.full((size,), _POISON, dtype=torch.uint8)
        va = buf.data_ptr()
        with _S.lock:
            _S.reservations[va] = _Reservation(va, size, buf)
            bisect.insort(_S.starts, va)
        self._mine.add(va)
        if self.runtime is not None:
            _S.reservations[va].device = self._as_device(buf)
        return va

    def _as_device(self, buf: torch.Tensor) -> Any:
        # The simulated GPU's device memory, outside its caching allocator (not counted),
        # until cuMemAddressFree (see _not_device).
        from ._cudasim import _S as SIM
        from ._cudasim import _Storage

        storage = buf.untyped_storage()
        info = _Storage(storage.data_ptr(), int(storage.nbytes()), "adopted", self.runtime,
                        self.runtime.default_stream().sid, owner="a virtual-memory arena")
        with SIM.lock:
            SIM.storages[info.base] = info
        return info

    def _not_device(self, r: _Reservation) -> None:  # (r.device is set)
        # The range freed is no longer the simulated GPU's memory: its record goes, else host
        # memory the CPU allocator hands out at the same address later would pass for device
        # memory with the arena's history (seen: a host copy flagged as racing a kernel long
        # gone). Work still using it unordered is an error, as for any device buffer freed.
        from ._cudasim import _S as SIM
        from ._cudasim import _Storage

        info: _Storage = r.device
        r.device = None
        with SIM.lock:
            if SIM.storages.get(info.base) is info:
                self.runtime._check_free(info)
                del SIM.storages[info.base]

    def free(self, va: int, size: int) -> None:
        self._call("cuMemAddressFree")
        r = self._res("cuMemAddressFree", va, size)
        if r.handle is not None:
            raise VmmError("cuMemAddressFree", CUDA_ERROR_INVALID_VALUE,
                           _TEXT[CUDA_ERROR_INVALID_VALUE], "memory is still mapped in it")
        if r.device is not None:
            self._not_device(r)
        with _S.lock:
            del _S.reservations[va]
            _S.starts.remove(va)
        self._mine.discard(va)

    def create(self, size: int) -> int:
        self._call("cuMemCreate")
        self._aligned("cuMemCreate", size)
        handle = next(_handles)
        self._handles[handle] = size
        return handle

    def map(self, va: int, size: int, handle: int) -> None:
        self._call("cuMemMap")
        r = self._res("cuMemMap", va, size)
        if r.handle is not None or self._handles.get(handle) != size:
            raise VmmError("cuMemMap", CUDA_ERROR_INVALID_VALUE, _TEXT[CUDA_ERROR_INVALID_VALUE],
                           "the range is mapped already, or the handle is not of its size")
        r.handle, r.access = handle, False
        r.buf.fill_(_POISON)  # new physical memory: undefined bytes

    def _mapped(self, name: str, va: int, size: int) -> _Reservation:
        """The reservation at ``va`` for a call that needs memory mapped there."""
        self._call(name)
        r = self._res(name, va, size)
        if r.handle is None:
            raise VmmError(name, CUDA_ERROR_INVALID_VALUE, _TEXT[CUDA_ERROR_INVALID_VALUE],
                           "nothing is mapped there")
        return r

    def set_access(self, va: int, size: int) -> None:
        self._mapped("cuMemSetAccess", va, size).access = True

    def unmap(self, va: int, size: int) -> None:
        r = self._mapped("cuMemUnmap", va, size)
        r.handle, r.access = None, False
        r.buf.fill_(_POISON)  # whatever reads it now reads garbage (on a GPU: a fault)

    def release(self, handle: int) -> None:
        self._call("cuMemRelease")
        if self._handles.pop(handle, None) is None:
            raise VmmError("cuMemRelease", CUDA_ERROR_INVALID_VALUE,
                           _TEXT[CUDA_ERROR_INVALID_VALUE], f"unknown handle {handle}")

    def bytes_at(self, va: int, size: int) -> torch.Tensor:
        r = _S.reservations[va]
        return r.buf[:size]


def check_access(ptr: int, nbytes: int, what: str) -> None:
    """Fatal (:class:`GraphReplayFault`) when ``[ptr, ptr + nbytes)`` is in a simulated
    reservation that is unmapped there or mapped without access. Other memory passes."""
    with _S.lock:
        i = bisect.bisect_right(_S.starts, ptr) - 1
        r = _S.reservations.get(_S.starts[i]) if i >= 0 else None
    if r is None or not r.va <= ptr < r.va + r.size:
        return
    if r.handle is None:
        raise GraphReplayFault(f"{what} at {ptr:#x} (+{nbytes}) is unmapped: a kernel there "
                               "faults and the CUDA context is lost (an illegal address)")
    if not r.access:
        raise GraphReplayFault(f"{what} at {ptr:#x} is mapped without access (cuMemSetAccess "
                               "was not called)")


@dataclass
class _Operand:
    name: str
    live: torch.Tensor  # the module's tensor (whose address may have changed since)
    captured: torch.Tensor  # the memory the graph recorded
    ptr: int


class SimGraph:
    """A simulated CUDA graph of ``module(*args)``: :meth:`capture` runs it once (a forward
    under capture: the controller refuses one of a component whose weights move), recording
    every tensor of the module by address; :meth:`replay` runs it again on exactly those
    addresses (see the module doc), its outputs bit-exact with an eager forward when the
    addresses still hold the weights."""

    def __init__(self, module: nn.Module, runtime: Any = None) -> None:
        self.module = module
        self.runtime = runtime
        self.operands: list[_Operand] = []
        self.args: tuple[Any, ...] = ()
        self.replays = 0

    @contextlib.contextmanager
    def _capturing(self) -> Iterator[None]:
        _CAPTURE.depth += 1
        try:
            if self.runtime is not None and getattr(self.runtime, "simulated", False):
                with self.runtime.capture():
                    yield
            else:
                yield
        finally:
            _CAPTURE.depth -= 1

    def capture(self, *args: Any) -> Any:
        """Capture ``module(*args)`` (the inputs are static: replay reuses them)."""
        with self._capturing(), torch.no_grad():
            out = self.module(*args)
        self.args = args
        seen: set[int] = set()
        self.operands = []
        for name, t in itertools.chain(self.module.named_parameters(remove_duplicate=False),
                                       self.module.named_buffers(remove_duplicate=False)):
            if t is None or id(t) in seen or not t.numel():
                continue
            seen.add(id(t))
            self.operands.append(_Operand(name, t, t.detach(), t.data_ptr()))
        return out

    def replay(self) -> Any:
        """Run the captured kernels again, on the captured addresses."""
        for op in self.operands:
            check_access(op.ptr, int(op.captured.nbytes), f"graph operand {op.name!r}")
            if op.live.data_ptr() != op.ptr:
                raise GraphReplayFault(
                    f"graph operand {op.name!r} was re-homed since capture ({op.ptr:#x} -> "
                    f"{op.live.data_ptr():#x}): the graph reads the old memory")
        captured = {op.name: op.captured for op in self.operands}
        self.replays += 1
        with torch.no_grad():
            return torch.func.functional_call(self.module, captured, self.args)
