"""Address-stable device memory: CUDA virtual memory management through ctypes, and the
per-component :class:`Arena` the ``resident-stable`` mode re-homes a component's tensors into.

A CUDA graph (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) records the raw
addresses of its kernels' operands. An ordinary sleep frees the weights' memory and a wake
allocates new memory: new addresses, and a captured graph replays on freed memory. Here the
address range is reserved once (``cuMemAddressReserve``) and kept for the life of the arena;
a sleep only unmaps and releases the physical memory behind it (``cuMemUnmap``,
``cuMemRelease``), a wake creates new physical memory and maps it at the same addresses
(``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``): tensors come back where they were.

Two drivers stand behind an arena, both :class:`VmmDriver`:

* :class:`CudaVmm` -- the CUDA driver API (``libcuda``) through ctypes, no compiled extension.
  It retains the device's primary context (``cuDevicePrimaryCtxRetain``: torch's), and every
  call first makes it current in the calling thread (torch makes it current only in the
  threads it ran in); every error names ``cuGetErrorString``'s text. On the simulated GPU it
  runs over :class:`~strategies.checking._libcudasim.SimLibcuda`, a simulated ``libcuda``
  behind real ctypes calls;
* :class:`~strategies.checking._vmmsim.SimVmm` -- the driver's rules simulated on CPU tensors (the
  CPU layers and the simulated GPU), with fault injection at every call.

An :class:`Arena` packs a component's units (each storage) at aligned offsets (not a
granule each: :data:`ALIGN` bytes), rounded up to the driver's granularity as a whole;
:attr:`Arena.waste` is the rounding.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .._errors import ResidencyError

__all__ = ["ALIGN", "Arena", "CudaVmm", "VmmDriver", "VmmError", "graph_capturing", "vmm_for"]

ALIGN = 512  # bytes between packed tensors (the caching allocator's block rounding)
_log = logging.getLogger("residency.vmm")


class VmmError(ResidencyError, MemoryError):
    """A CUDA virtual-memory call failed: ``call`` (``cuMemCreate``), ``code`` (its CUresult)
    and the driver's description of it."""

    def __init__(self, call: str, code: int, text: str, detail: str = "") -> None:
        self.call, self.code, self.text = call, code, text
        super().__init__(f"{call} failed: CUDA error {code} ({text})"
                         + (f"; {detail}" if detail else ""))


class VmmDriver(Protocol):
    """The virtual-memory calls an :class:`Arena` makes (see the module doc)."""

    #: The device whose memory it maps (tensors over it are on this device).
    device: torch.device

    def make_current(self) -> None:
        """Make the device's context current in the calling thread."""
        ...

    def granularity(self) -> int:
        """The minimum allocation granularity (sizes and addresses are multiples of it)."""
        ...

    def reserve(self, size: int) -> int:
        """``cuMemAddressReserve``: a virtual address range of ``size`` bytes."""
        ...

    def free(self, va: int, size: int) -> None:
        """``cuMemAddressFree`` (nothing may be mapped in it)."""
        ...

    def create(self, size: int) -> int:
        """``cuMemCreate``: ``size`` bytes of physical device memory; returns its handle."""
        ...

    def map(self, va: int, size: int, handle: int) -> None:
        """``cuMemMap``: ``handle``'s memory at ``va`` (not accessible before set_access)."""
        ...

    def set_access(self, va: int, size: int) -> None:
        """``cuMemSetAccess``: read-write access for the device."""
        ...

    def unmap(self, va: int, size: int) -> None:
        """``cuMemUnmap``."""
        ...

    def release(self, handle: int) -> None:
        """``cuMemRelease``: the physical memory goes once it is unmapped."""
        ...

    def bytes_at(self, va: int, size: int) -> torch.Tensor:
        """A 1-D uint8 tensor over ``[va, va + size)`` (valid while the range is reserved;
        touch it only while mapped)."""
        ...


# -- the CUDA driver through ctypes -----------------------------------------------------
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _libcuda() -> Any:  # pragma: no cover - needs a GPU
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return ctypes.CDLL("libcuda.so.1")


class _CudaArray:
    """What ``torch.as_tensor`` needs to see device memory at an address (no copy)."""

    def __init__(self, va: int, size: int) -> None:  # pragma: no cover - needs a GPU
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (va, False), "version": 3, "strides": None}


class CudaVmm:
    """:class:`VmmDriver` on the CUDA driver API for ``device`` (a ``cuda:N`` device; on the
    simulated GPU its ``cpu`` device, with ``ordinal`` the simulated index).

    ``lib``: the driver library (default: ``libcuda`` loaded with ctypes). The simulated GPU
    passes a :class:`~strategies.checking._libcudasim.SimLibcuda`, whose entry points are
    ctypes callbacks that read what this class passes from raw memory, so this code runs in CI
    as it would against the real library. The device's primary context (the one torch's
    runtime uses) is retained through the driver API here and made current in the calling
    thread before every call."""

    def __init__(self, device: torch.device, *, lib: Any = None,
                 ordinal: int | None = None) -> None:
        self.device = device
        if ordinal is None:  # pragma: no cover - needs a GPU
            ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.index = ordinal
        self._lib = lib if lib is not None else _libcuda()
        self._check("cuInit", self._lib.cuInit(ctypes.c_uint(0)))
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)),
                    f"device ordinal {ordinal}")
        ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain",
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), f"cuda:{ordinal}")
        self._ctx = ctx
        self._gran: int | None = None

    def _check(self, call: str, code: int, detail: str = "") -> None:
        if code:
            text = ctypes.c_char_p()
            if self._lib.cuGetErrorString(ctypes.c_int(code), ctypes.byref(text)) or not text.value:
                raise VmmError(call, int(code), "an error code the driver does not know", detail)
            raise VmmError(call, int(code), text.value.decode(), detail)

    def make_current(self) -> None:
        now = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self._lib.cuCtxGetCurrent(ctypes.byref(now)))
        if now.value != self._ctx.value:
            self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(self._ctx))

    def _prop(self) -> _AllocProp:
        prop = _AllocProp()
        prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.index)
        return prop

    def granularity(self) -> int:
        if self._gran is None:
            self.make_current()
            gran = ctypes.c_size_t()
            prop = self._prop()
            self._check("cuMemGetAllocationGranularity", self._lib.cuMemGetAllocationGranularity(
                ctypes.byref(gran), ctypes.byref(prop),
                ctypes.c_int(_CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
            self._gran = int(gran.value)
        return self._gran

    def reserve(self, size: int) -> int:
        self.make_current()
        va = ctypes.c_uint64()
        self._check("cuMemAddressReserve", self._lib.cuMemAddressReserve(
            ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(self.granularity()),
            ctypes.c_uint64(0), ctypes.c_ulonglong(0)), f"{size} bytes of address space")
        return int(va.value)

    def free(self, va: int, size: int) -> None:
        self.make_current()
        self._check("cuMemAddressFree", self._lib.cuMemAddressFree(
            ctypes.c_uint64(va), ctypes.c_size_t(size)))

    def create(self, size: int) -> int:
        self.make_current()
        handle = ctypes.c_ulonglong()
        prop = self._prop()
        self._check("cuMemCreate", self._lib.cuMemCreate(
            ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)),
            f"{size} bytes of device memory on cuda:{self.index}")
        return int(handle.value)

    def map(self, va: int, size: int, handle: int) -> None:
        self.make_current()
        self._check("cuMemMap", self._lib.cuMemMap(
            ctypes.c_uint64(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
            ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)))

    def set_access(self, va: int, size: int) -> None:
        self.make_current()
        desc = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.index),
                           _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._check("cuMemSetAccess", self._lib.cuMemSetAccess(
            ctypes.c_uint64(va), ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1)))

    def unmap(self, va: int, size: int) -> None:
        self.make_current()
        self._check("cuMemUnmap", self._lib.cuMemUnmap(ctypes.c_uint64(va), ctypes.c_size_t(size)))

    def release(self, handle: int) -> None:
        self.make_current()
        self._check("cuMemRelease", self._lib.cuMemRelease(ctypes.c_ulonglong(handle)))

    def bytes_at(self, va: int, size: int) -> torch.Tensor:
        self.make_current()
        if self.device.type != "cuda":  # the simulated GPU: its device memory is host memory
            return torch.frombuffer((ctypes.c_ubyte * size).from_address(va), dtype=torch.uint8)
        with torch.cuda.device(self.index):  # pragma: no cover - needs a GPU
            return torch.as_tensor(_CudaArray(va, size), device=self.device)


def vmm_for(layer: Any) -> VmmDriver:
    """The virtual-memory driver of device layer ``layer`` (made once, kept on the layer as
    ``layer.vmm``; a test sets one first): the CUDA driver on a GPU; on the simulated GPU
    :class:`CudaVmm` too, over a simulated ``libcuda``
    (:mod:`strategies.checking._libcudasim`); the simulated driver on the CPU layers."""
    driver: VmmDriver | None = getattr(layer, "vmm", None)
    if driver is None:
        runtime = getattr(layer, "runtime", None)
        if runtime is not None and not runtime.simulated:  # pragma: no cover - needs a GPU
            driver = CudaVmm(layer.device)
        elif runtime is not None:  # the simulated GPU: the ctypes code over a simulated libcuda
            from ..checking._libcudasim import simulated_cuda_vmm

            driver = simulated_cuda_vmm(layer.device, runtime)
        else:
            from ..checking._vmmsim import SimVmm

            driver = SimVmm(runtime=runtime)
        layer.vmm = driver
    return driver


# -- graph capture (simulated graphs set it; the CPU layers' check_compute reads it) --------
class _Capture(threading.local):
    depth = 0


_CAPTURE = _Capture()


def graph_capturing() -> bool:
    """Whether the calling thread captures a simulated graph (:mod:`strategies.checking._vmmsim`)."""
    return _CAPTURE.depth > 0


# -- the arena ------------------------------------------------------------------------------
class Arena:
    """One component's address-stable device memory: ``sizes`` (``(key, nbytes)`` of each
    unit) packed at :data:`ALIGN`-byte offsets into one reservation of ``size`` bytes (the
    packed bytes rounded up to the granularity). The reservation is made at once and kept
    until :meth:`close`; physical memory is mapped by :meth:`map` and released by
    :meth:`unmap`, always at the same addresses."""

    def __init__(self, driver: VmmDriver, sizes: Sequence[tuple[str, int]], owner: str) -> None:
        self.driver = driver
        self.owner = owner
        self.offsets: dict[str, tuple[int, int]] = {}
        end = 0
        for key, nbytes in sizes:
            self.offsets[key] = (end, nbytes)
            end += -(-nbytes // ALIGN) * ALIGN
        self.used = sum(n for _, n in sizes)
        self.packed = end
        self.size = 0
        self.va = 0
        self.handle: int | None = None
        self.maps = 0  # times mapped (each wake)
        self._bytes: torch.Tensor | None = None
        if end:
            driver.make_current()
            gran = driver.granularity()
            self.size = -(-end // gran) * gran
            self.va = driver.reserve(self.size)

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    @property
    def waste(self) -> int:
        """Bytes mapped that hold no tensor: alignment between tensors and the rounding to
        the granularity."""
        return self.size - self.used

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes are in this arena."""
        return bool(self.size) and self.va <= t.data_ptr() < self.va + self.size

    def view(self, key: str) -> torch.Tensor:
        """Unit ``key``'s bytes (a 1-D uint8 view at its offset); maps the arena first if
        it is not (:meth:`map`)."""
        offset, nbytes = self.offsets[key]
        self.map()
        assert self._bytes is not None
        return self._bytes[offset:offset + nbytes]

    def map(self) -> bool:
        """Create the physical memory, map it at the arena's addresses and give the device
        access; True when it was mapped now. A failure part way undoes the calls before it."""
        if self.handle is not None or not self.size:
            return False
        d = self.driver
        d.make_current()
        handle = d.create(self.size)
        try:
            d.map(self.va, self.size, handle)
            try:
                d.set_access(self.va, self.size)
            except BaseException:
                d.unmap(self.va, self.size)
                raise
        except BaseException:
            d.release(handle)
            raise
        self.handle = handle
        self.maps += 1
        if self._bytes is None:
            self._bytes = d.bytes_at(self.va, self.size)
        return True

    def unmap(self) -> None:
        """Unmap and release the physical memory; the addresses stay reserved. (The device
        has done everything queued on it: the caller synchronized.)"""
        if self.handle is None:
            return
        d = self.driver
        d.make_current()
        d.unmap(self.va, self.size)
        handle, self.handle = self.handle, None
        d.release(handle)

    def close(self) -> None:
        """Unmap if mapped and give the address range back (detach). Errors are logged: the
        tensors left the arena already."""
        try:
            self.unmap()
            if self.size:
                self.driver.make_current()
                self.driver.free(self.va, self.size)
        except VmmError as exc:
            _log.warning("residency: freeing the arena of %s failed: %s", self.owner, exc)
        self.size = 0
        self._bytes = None
