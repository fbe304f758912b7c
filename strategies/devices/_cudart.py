"""The CUDA runtime seam: every call :class:`~strategies.devices._cuda.CudaDevice` makes into CUDA.

:class:`CudaRuntime` is the interface, for one device. Two implementations:

* :class:`TorchCuda` -- the real one: each method forwards to ``torch.cuda`` (or the tensor
  method of the same name) and holds no logic. It is the only code of the CUDA layer that
  cannot run without a GPU, so it is kept this thin;
* :class:`~strategies.checking._cudasim.SimCuda` -- a simulated GPU on the CPU (CPU tensors as device
  memory): streams whose work lands late, a compute stream that lags the host, torch's
  caching-allocator rules, pinned registration, poison. ``CudaDevice``'s own logic runs on it
  in CI (``RESIDENCY_DEVICE_LAYER=cuda-sim``).

Streams and events are whatever the runtime returns (``torch.cuda.Stream`` / ``Event``, or the
simulator's): both offer the methods of :class:`Stream` and :class:`Event`.
"""

from __future__ import annotations

import ctypes
import functools
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["CudaRuntime", "Event", "MemoryStats", "Stream", "TorchCuda"]


class Event(Protocol):
    """What the CUDA layer uses of ``torch.cuda.Event``."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class Stream(Protocol):
    """What the CUDA layer uses of ``torch.cuda.Stream``."""

    def wait_event(self, event: Any) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class MemoryStats:
    """The caching allocator's counters for one device, in bytes: ``allocated`` (live
    tensors' blocks), ``active`` (those plus blocks freed while a stream recorded on them
    has not passed the free: not reusable yet), ``reserved`` (segments held from the
    driver) and the peaks of allocated and reserved since the last reset."""

    allocated: int
    active: int
    reserved: int
    peak_allocated: int
    peak_reserved: int


class CudaRuntime(Protocol):
    """The calls into CUDA for one device (see the module doc)."""

    #: The device's ordinal (what ``torch.cuda.current_device()`` says inside ``use_device``).
    index: int
    #: True for the simulator: nothing is on a real GPU.
    simulated: bool

    def own_stream(self) -> Stream | None:
        """A stream of the library's own (never one of torch's pooled streams, which NCCL and
        other libraries share), non-blocking, at the lowest priority, in the context torch
        uses; None where it cannot be made (the calling thread's last error then says why:
        :meth:`clear_error`)."""
        ...

    def new_stream(self) -> Stream:
        """One of torch's pooled streams (``torch.cuda.Stream()``: a user's side stream; the
        fallback when :meth:`own_stream` fails)."""
        ...

    def destroy_stream(self, stream: Any) -> None:
        """Destroy a stream :meth:`own_stream` made (work queued on it still completes)."""
        ...

    def clear_error(self) -> int:
        """Return and clear the calling thread's last CUDA error (``cudaGetLastError``; 0:
        none): a failed call leaves it set, and the next kernel launch on the thread would
        raise it."""
        ...

    def error_name(self, err: int) -> str:
        """The name of CUDA error code ``err`` (``cudaErrorMemoryAllocation``)."""
        ...

    def default_stream(self) -> Stream: ...

    def current_stream(self) -> Stream:
        """The calling thread's current stream on this device."""
        ...

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def use_device(self) -> AbstractContextManager[Any]:
        """Make this device current in the calling thread (calls that act on "the current
        device" would otherwise create a context on another GPU)."""
        ...

    def event(self, timing: bool = False) -> Event:
        """A blocking event (a host thread waiting on it sleeps instead of spinning)."""
        ...

    def is_capturing(self) -> bool:
        """Whether the calling thread's current stream on this device is capturing a graph."""
        ...

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uint8 device memory from the caching allocator, on the current stream."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` on the current stream (one side on the device)."""
        ...

    def host_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A copy by the host between two host tensors (a plain memcpy)."""
        ...

    def host_write(self, t: torch.Tensor) -> None:
        """The host is about to write host tensor ``t`` itself (a file read into it)."""
        ...

    def record_stream(self, t: torch.Tensor, stream: Any) -> None: ...

    def discard(self, event: Any) -> None:
        """The copies ``event`` was recorded after are not wanted any more (a dropped
        prefetch; its buffers were recorded on the stream): nothing on CUDA."""
        ...

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is this device's (not another GPU's, not the host's)."""
        ...

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether a tensor a module brings is this device's memory (a CUDA tensor of this
        GPU), as opposed to host memory the layer must copy in."""
        ...

    def is_pinned(self, t: torch.Tensor) -> bool: ...

    def adopt(self, t: torch.Tensor) -> None:
        """``t`` (a tensor the module came with, or one compute made) is device memory."""
        ...

    def label(self, t: torch.Tensor, owner: str) -> None:
        """Name whose bytes ``t`` holds, for reports (the simulator's)."""
        ...

    def host_register(self, ptr: int, nbytes: int) -> int:
        """``cudaHostRegister``: page-lock host memory; returns the CUDA error code."""
        ...

    def host_unregister(self, ptr: int) -> int: ...

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None:
        """Give the allocator's cached segments back to the driver: this device's where the
        runtime can scope it (torch cannot: ``torch.cuda.empty_cache`` empties every GPU's
        cache of the process, synchronizing each)."""
        ...

    def memory(self) -> MemoryStats: ...

    def reset_peak(self) -> None: ...

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device, as the driver sees them."""
        ...


class TorchCuda:  # pragma: no cover - the real runtime: needs a GPU (tests/gpu runs it)
    """:class:`CudaRuntime` on ``torch.cuda`` for ``device`` (a ``cuda:N`` device)."""

    simulated = False

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)

    def own_stream(self) -> Stream | None:
        lib = _torch_cudart()
        if lib is None:
            return None
        handle = ctypes.c_void_p()
        torch.cuda.init()  # type: ignore[no-untyped-call]  # torch's context exists
        with torch.cuda.device(self.device):  # and is current: the stream is made in it
            # cudaStreamNonBlocking (1): no implicit sync with the legacy default stream;
            # priority 0: the lowest (copies do not compete with compute for SMs).
            err = lib.cudaStreamCreateWithPriority(ctypes.byref(handle), 1, 0)
        if err != 0 or not handle.value:
            return None
        return torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
            handle.value, device=self.device)

    def new_stream(self) -> Stream:
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def destroy_stream(self, stream: Any) -> None:
        lib = _torch_cudart()
        if lib is not None:
            with torch.cuda.device(self.device):
                lib.cudaStreamDestroy(ctypes.c_void_p(int(stream.cuda_stream)))

    def clear_error(self) -> int:
        lib = _torch_cudart()
        return 0 if lib is None else int(lib.cudaGetLastError())

    def error_name(self, err: int) -> str:
        lib = _torch_cudart()
        if lib is None:
            return f"CUDA error {err}"
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        return str(lib.cudaGetErrorName(err).decode())

    def default_stream(self) -> Stream:
        return torch.cuda.default_stream(self.device)

    def current_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def use_device(self) -> AbstractContextManager[Any]:
        return torch.cuda.device(self.device)

    def event(self, timing: bool = False) -> Event:
        return torch.cuda.Event(blocking=True, enable_timing=timing)  # type: ignore[no-untyped-call]

    def is_capturing(self) -> bool:
        with torch.cuda.device(self.device):
            return torch.cuda.is_current_stream_capturing()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def host_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def host_write(self, t: torch.Tensor) -> None:
        pass

    def record_stream(self, t: torch.Tensor, stream: Stream) -> None:
        t.record_stream(stream)  # type: ignore[arg-type]

    def discard(self, event: Event) -> None:
        pass

    def is_device(self, t: torch.Tensor) -> bool:
        return t.device == self.device

    def on_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda and t.device == self.device

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def adopt(self, t: torch.Tensor) -> None:
        pass

    def label(self, t: torch.Tensor, owner: str) -> None:
        pass

    def host_register(self, ptr: int, nbytes: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))  # type: ignore[no-untyped-call]

    def host_unregister(self, ptr: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()  # every GPU's cache: torch has no per-device call

    def memory(self) -> MemoryStats:
        s = torch.cuda.memory_stats(self.device)
        return MemoryStats(s.get("allocated_bytes.all.current", 0), s.get("active_bytes.all.current", 0),
                           s.get("reserved_bytes.all.current", 0), s.get("allocated_bytes.all.peak", 0),
                           s.get("reserved_bytes.all.peak", 0))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)


@functools.cache
def _torch_cudart() -> Any:  # pragma: no cover - needs a GPU
    """torch's own CUDA runtime library, for the calls torch does not bind
    (``cudaStreamCreateWithPriority``, ``cudaGetLastError``): the one already loaded under the
    soname of torch's CUDA major version (``libcudart.so.13`` for +cu130), never another
    libcudart the process loaded (its own context, its own per-thread last error). None where
    there is none (a static build): then streams come from torch's pool."""
    major = (torch.version.cuda or "").split(".")[0]
    if not major:
        return None
    try:
        lib = ctypes.CDLL(f"libcudart.so.{major}", mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    lib.cudaGetLastError.restype = ctypes.c_int
    return lib
