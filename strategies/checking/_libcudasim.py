"""The CUDA driver library simulated behind real ctypes calls: :class:`SimLibcuda`, what
:class:`~strategies.devices._vmm.CudaVmm` gets instead of ``ctypes.CDLL("libcuda.so.1")`` on the
simulated GPU, so that CudaVmm's own ctypes code (struct layouts, argument order, out-parameters,
error decoding, the context per thread) runs in CI.

Each entry point is a C function pointer of the kind ``ctypes.CDLL`` hands out (C calling
convention, ``int`` result, no ``argtypes``), over a ``CFUNCTYPE`` callback declared with the
driver's own C signature (``cuda.h``): ctypes marshals the caller's arguments exactly as it
would for the real library (a bare Python ``int`` where the driver takes a 64-bit address is
cut to a C ``int``, as there). The callback reads structs and writes out-parameters through the
raw addresses it is given (``ctypes.string_at``, ``from_address``), decoding the structs with
the driver's layout written out here (:data:`ALLOCATION_PROP`, :data:`ACCESS_DESC`), never with
the caller's classes, and returns the driver's ``CUresult`` codes.

The semantics are :class:`~strategies.checking._vmmsim.SimVmm`'s (granularity, access required
after a map, unmapped memory fatal to a simulated graph), with the driver's own checks in front:

* ``cuInit`` first (else ``CUDA_ERROR_NOT_INITIALIZED``); devices ``0 .. ordinal`` exist, only
  ``cuda:ordinal``'s memory is simulated (another device's is ``CUDA_ERROR_NOT_SUPPORTED``);
* a context per thread: ``cuDevicePrimaryCtxRetain`` gives the device's primary context,
  ``cuCtxSetCurrent`` makes it current in the calling thread only; a memory call from a thread
  with none current is ``CUDA_ERROR_INVALID_CONTEXT``;
* the fields of ``CUmemAllocationProp`` and ``CUmemAccessDesc`` checked as the driver checks
  them (allocation type, handle types, location, the allocation flags, access flags); flags and
  offsets the library does not use must be 0; read-only access is not modelled (it grants none);
* ``cuGetErrorString`` with the driver's texts (:data:`ERROR_TEXT`); an unknown code gives
  ``CUDA_ERROR_INVALID_VALUE`` and a NULL string;
* :meth:`SimLibcuda.fail`: the next call(s) of an entry point return a given code, changing
  nothing (``vmm.fail_at`` still injects out of memory at the k-th memory call).

:attr:`SimLibcuda.log` records every call with its decoded arguments and its result.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..devices._vmm import CudaVmm, VmmError
from ._vmmsim import SimVmm

__all__ = ["ACCESS_DESC", "ALLOCATION_PROP", "ERROR_TEXT", "Call", "SimLibcuda",
           "simulated_cuda_vmm"]

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_UNKNOWN = 999

#: cuGetErrorString's texts (CUDA 12).
ERROR_TEXT = {
    CUDA_SUCCESS: "no error",
    CUDA_ERROR_INVALID_VALUE: "invalid argument",
    CUDA_ERROR_OUT_OF_MEMORY: "out of memory",
    CUDA_ERROR_NOT_INITIALIZED: "initialization error",
    CUDA_ERROR_INVALID_DEVICE: "invalid device ordinal",
    CUDA_ERROR_INVALID_CONTEXT: "invalid device context",
    CUDA_ERROR_ILLEGAL_ADDRESS: "an illegal memory access was encountered",
    CUDA_ERROR_NOT_SUPPORTED: "operation not supported",
    CUDA_ERROR_UNKNOWN: "unknown error",
}
_STRINGS = {code: ctypes.create_string_buffer(text.encode()) for code, text in ERROR_TEXT.items()}

#: ``CUmemAllocationProp`` (32 bytes, x86-64): type, requestedHandleTypes, location {type, id},
#: win32HandleMetaData, allocFlags {compressionType, gpuDirectRDMACapable, usage, reserved[4]}.
ALLOCATION_PROP = struct.Struct("<iiiiQBBH4s")
#: ``CUmemAccessDesc`` (12 bytes): location {type, id}, flags.
ACCESS_DESC = struct.Struct("<iii")

_ALLOCATION_TYPE_PINNED = 1
_LOCATION_DEVICE = 1
_LOCATION_TYPES = {0: "invalid", 1: "device", 2: "host", 3: "host NUMA", 4: "host NUMA current"}
_HANDLE_TYPES = {0: "none", 1: "POSIX file descriptor", 2: "win32", 4: "win32 KMT", 8: "fabric"}
_ACCESS_FLAGS = {0: "none", 1: "read", 3: "read-write"}
_READWRITE = 3

_vp, _int, _uint, _size, _u64 = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t,
                                 ctypes.c_ulonglong)
#: The C signature of each entry point (cuda.h; CUdeviceptr, the handle and the flags are
#: 64-bit, CUdevice an int, every pointer a void pointer here).
SIGNATURES: dict[str, tuple[type[Any], ...]] = {
    "cuInit": (_uint,),
    "cuDeviceGet": (_vp, _int),
    "cuDevicePrimaryCtxRetain": (_vp, _int),
    "cuCtxGetCurrent": (_vp,),
    "cuCtxSetCurrent": (_vp,),
    "cuGetErrorString": (_int, _vp),
    "cuMemGetAllocationGranularity": (_vp, _vp, _int),
    "cuMemAddressReserve": (_vp, _size, _size, _u64, _u64),
    "cuMemAddressFree": (_u64, _size),
    "cuMemCreate": (_vp, _size, _vp, _u64),
    "cuMemMap": (_u64, _size, _size, _u64, _u64),
    "cuMemSetAccess": (_u64, _size, _vp, _size),
    "cuMemUnmap": (_u64, _size),
    "cuMemRelease": (_u64,),
}
_CONTEXT_FREE = {"cuInit", "cuGetErrorString", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                 "cuCtxGetCurrent", "cuCtxSetCurrent"}
_CTX_BASE = 0x7C7C_0000_0000  # primary context handles: _CTX_BASE + 0x1000 * (ordinal + 1)
#: Allocation handles are 64-bit values, as the driver's are (a handle cut to 32 bits is
#: unknown): SimVmm's handle + _HANDLE_BASE.
_HANDLE_BASE = 0x7E57 << 48
_FuncPtr: Any = ctypes.CDLL(None)._FuncPtr  # what ctypes.CDLL's attributes are made of


class _Refused(Exception):
    """A driver check failed: the call returns ``code``."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


@dataclass
class Call:
    """One call the library answered: its entry point, its arguments as the driver decoded
    them, its CUresult, why it failed (when it did) and the calling thread's name."""

    name: str
    args: dict[str, Any]
    result: int = CUDA_SUCCESS
    why: str = ""
    thread: str = field(default_factory=lambda: threading.current_thread().name)


class _Current(threading.local):
    ctx = 0


class SimLibcuda:
    """A simulated ``libcuda`` (see the module doc) over ``vmm`` (default: a new
    :class:`SimVmm` of ``runtime``, the simulated GPU whose memory it is, with
    ``granularity``); ``ordinal``: that GPU's index (default: the runtime's, else 0);
    ``recommended``: the recommended granularity (a multiple of the minimum)."""

    def __init__(self, *, runtime: Any = None, vmm: SimVmm | None = None,
                 ordinal: int | None = None, granularity: int = 2 * 2**20,
                 recommended: int | None = None) -> None:
        self.vmm = vmm if vmm is not None else SimVmm(runtime=runtime, granularity=granularity)
        self.ordinal = ordinal if ordinal is not None else int(getattr(runtime, "index", 0))
        self.minimum = self.vmm._granularity
        self.recommended = recommended if recommended is not None else 2 * self.minimum
        self.log: list[Call] = []
        self.initialized = False
        self.retained: dict[int, int] = {}  # primary context handle -> retain count
        self._current = _Current()
        self._faults: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._callbacks: list[Any] = []  # kept alive as long as the library
        for name, argtypes in SIGNATURES.items():
            impl: Callable[..., dict[str, Any]] = getattr(self, "_" + name)
            callback = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(self._entry(name, impl))
            self._callbacks.append(callback)
            setattr(self, name, _FuncPtr(ctypes.cast(callback, ctypes.c_void_p).value))

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the simulated libcuda has no symbol {name!r} (it has "
                             f"{', '.join(SIGNATURES)})")

    # -- what tests read and set ---------------------------------------------------------
    def fail(self, name: str, code: int, times: int = 1) -> None:
        """The next ``times`` calls of entry point ``name`` return ``code`` and do nothing."""
        if name not in SIGNATURES:
            raise ValueError(f"{name!r} is not an entry point of the simulated libcuda: valid "
                             f"names are {', '.join(SIGNATURES)}")
        self._faults.setdefault(name, []).extend([code] * times)

    def calls(self, name: str) -> list[Call]:
        """The logged calls of entry point ``name``, in order."""
        return [c for c in self.log if c.name == name]

    def context_of(self, ordinal: int) -> int:
        """The handle of ``cuda:ordinal``'s primary context."""
        return _CTX_BASE + 0x1000 * (ordinal + 1)

    # -- the machinery -------------------------------------------------------------------
    def _entry(self, name: str, impl: Callable[..., dict[str, Any]]) -> Callable[..., int]:
        def entry(*raw: Any) -> int:
            call = Call(name, {"raw": raw})
            with self._lock:
                self.log.append(call)
            try:
                if name != "cuGetErrorString" and not (self.initialized or name == "cuInit"):
                    raise _Refused(CUDA_ERROR_NOT_INITIALIZED, "cuInit was not called")
                if name not in _CONTEXT_FREE:
                    if not self._current.ctx:
                        raise _Refused(CUDA_ERROR_INVALID_CONTEXT,
                                       f"no context is current in thread {call.thread!r}")
                    self.vmm.make_current()
                with self._lock:
                    faults = self._faults.get(name)
                    code = faults.pop(0) if faults else CUDA_SUCCESS
                if code:
                    raise _Refused(code, "injected")
                call.args = impl(*raw)
            except _Refused as exc:
                call.result, call.why = exc.code, str(exc)
            except VmmError as exc:  # the simulated driver's rules
                call.result, call.why = exc.code, str(exc)
            except Exception as exc:  # a bug here: a callback must not raise through ctypes
                call.result, call.why = CUDA_ERROR_UNKNOWN, f"{type(exc).__name__}: {exc}"
            return call.result

        return entry

    @staticmethod
    def _pointer(ptr: int | None, what: str) -> int:
        """``ptr`` checked before it is read or written: NULL is the driver's
        CUDA_ERROR_INVALID_VALUE; an address in the first 64 KiB (an integer passed where
        the driver takes a pointer) would crash the process on a GPU: refused here."""
        if not ptr:
            raise _Refused(CUDA_ERROR_INVALID_VALUE, f"{what} is NULL")
        if ptr < 0x10000:
            raise _Refused(CUDA_ERROR_INVALID_VALUE, f"{what} at {ptr:#x} is not an address (a "
                           "value passed where the driver takes a pointer: a crash on a GPU)")
        return ptr

    def _out(self, ptr: int | None, ctype: type[Any], value: int) -> None:
        ctype.from_address(self._pointer(ptr, "an out-parameter")).value = value

    def _device(self, ordinal: int) -> None:
        if not 0 <= ordinal <= self.ordinal:
            raise _Refused(CUDA_ERROR_INVALID_DEVICE,
                           f"device {ordinal}: the devices are 0 .. {self.ordinal}")

    def _prop(self, ptr: int | None) -> dict[str, Any]:
        address = self._pointer(ptr, "CUmemAllocationProp")
        (kind, handles, ltype, lid, win32, compression, rdma, usage,
         reserved) = ALLOCATION_PROP.unpack(ctypes.string_at(address, ALLOCATION_PROP.size))
        prop = {"type": kind, "requestedHandleTypes": handles, "location": (ltype, lid),
                "win32HandleMetaData": win32, "compressionType": compression,
                "gpuDirectRDMACapable": rdma, "usage": usage, "reserved": reserved}
        if kind != _ALLOCATION_TYPE_PINNED:
            raise _Refused(CUDA_ERROR_INVALID_VALUE, f"allocation type {kind}: valid is 1 (pinned)")
        if handles not in _HANDLE_TYPES:
            raise _Refused(CUDA_ERROR_INVALID_VALUE, f"requested handle types {handles}")
        if handles not in (0, 1):
            raise _Refused(CUDA_ERROR_NOT_SUPPORTED,
                           f"{_HANDLE_TYPES[handles]} handles on this (Linux) machine")
        self._location(ltype, lid, "CUmemAllocationProp")
        if compression:
            raise _Refused(CUDA_ERROR_NOT_SUPPORTED, "compressible memory is not simulated")
        if rdma not in (0, 1) or usage or reserved != bytes(4):
            raise _Refused(CUDA_ERROR_INVALID_VALUE,
                           f"allocFlags: gpuDirectRDMACapable {rdma}, usage {usage}, reserved "
                           f"{reserved!r} (valid: 0 or 1, 0, zeros)")
        return prop

    def _location(self, ltype: int, lid: int, what: str) -> None:
        if ltype not in _LOCATION_TYPES or ltype == 0:
            raise _Refused(CUDA_ERROR_INVALID_VALUE, f"{what}: location type {ltype}")
        if ltype != _LOCATION_DEVICE:
            raise _Refused(CUDA_ERROR_NOT_SUPPORTED, f"{what}: {_LOCATION_TYPES[ltype]} memory "
                           "is not simulated")
        self._device(lid)
        if lid != self.ordinal:
            raise _Refused(CUDA_ERROR_NOT_SUPPORTED,
                           f"{what}: cuda:{lid}'s memory is not simulated (cuda:{self.ordinal}'s is)")

    @staticmethod
    def _zero(**values: int) -> None:
        for name, value in values.items():
            if value:
                raise _Refused(CUDA_ERROR_INVALID_VALUE, f"{name} {value}: must be 0")

    # -- the entry points (arguments as the C signature delivers them) ---------------------
    def _cuInit(self, flags: int) -> dict[str, Any]:
        self._zero(flags=flags)
        self.initialized = True
        return {"flags": flags}

    def _cuDeviceGet(self, out: int | None, ordinal: int) -> dict[str, Any]:
        self._device(ordinal)
        self._out(out, ctypes.c_int, ordinal)
        return {"ordinal": ordinal}

    def _cuDevicePrimaryCtxRetain(self, out: int | None, dev: int) -> dict[str, Any]:
        self._device(dev)
        ctx = self.context_of(dev)
        self._out(out, ctypes.c_void_p, ctx)
        with self._lock:
            self.retained[ctx] = self.retained.get(ctx, 0) + 1
        return {"dev": dev}

    def _cuCtxGetCurrent(self, out: int | None) -> dict[str, Any]:
        self._out(out, ctypes.c_void_p, self._current.ctx)
        return {"current": self._current.ctx}

    def _cuCtxSetCurrent(self, ctx: int | None) -> dict[str, Any]:
        if ctx and ctx not in self.retained:
            raise _Refused(CUDA_ERROR_INVALID_CONTEXT, f"{ctx:#x} is not a context")
        self._current.ctx = ctx or 0
        return {"ctx": ctx or 0}

    def _cuGetErrorString(self, code: int, out: int | None) -> dict[str, Any]:
        text = _STRINGS.get(code)
        self._out(out, ctypes.c_void_p, ctypes.addressof(text) if text is not None else 0)
        if text is None:
            raise _Refused(CUDA_ERROR_INVALID_VALUE, f"unknown CUresult {code}")
        return {"error": code}

    def _cuMemGetAllocationGranularity(self, out: int | None, prop: int | None,
                                       option: int) -> dict[str, Any]:
        decoded = self._prop(prop)
        if option not in (0, 1):
            raise _Refused(CUDA_ERROR_INVALID_VALUE,
                           f"granularity option {option}: valid are 0 (minimum), 1 (recommended)")
        self._out(out, ctypes.c_size_t, self.minimum if option == 0 else self.recommended)
        return {"prop": decoded, "option": option}

    def _cuMemAddressReserve(self, out: int | None, size: int, alignment: int, addr: int,
                             flags: int) -> dict[str, Any]:
        self._zero(flags=flags)
        if alignment and (alignment & (alignment - 1) or alignment % self.minimum):
            raise _Refused(CUDA_ERROR_INVALID_VALUE, f"alignment {alignment}: 0 or a power of "
                           f"two multiple of the granularity {self.minimum}")
        if not size:
            raise _Refused(CUDA_ERROR_INVALID_VALUE, "size 0")
        self._pointer(out, "an out-parameter")
        va = self.vmm.reserve(size)
        self._out(out, ctypes.c_uint64, va)
        return {"size": size, "alignment": alignment, "addr": addr, "flags": flags, "va": va}

    def _cuMemAddressFree(self, va: int, size: int) -> dict[str, Any]:
        self.vmm.free(va, size)
        return {"va": va, "size": size}

    def _cuMemCreate(self, out: int | None, size: int, prop: int | None,
                     flags: int) -> dict[str, Any]:
        decoded = self._prop(prop)
        self._zero(flags=flags)
        self._pointer(out, "an out-parameter")
        handle = _HANDLE_BASE + self.vmm.create(size)
        self._out(out, ctypes.c_ulonglong, handle)
        return {"size": size, "prop": decoded, "flags": flags, "handle": handle}

    def _cuMemMap(self, va: int, size: int, offset: int, handle: int,
                  flags: int) -> dict[str, Any]:
        self._zero(offset=offset, flags=flags)
        self.vmm.map(va, size, handle - _HANDLE_BASE)
        return {"va": va, "size": size, "offset": offset, "handle": handle, "flags": flags}

    def _cuMemSetAccess(self, va: int, size: int, desc: int | None, count: int) -> dict[str, Any]:
        desc = self._pointer(desc, "CUmemAccessDesc")
        if not count:
            raise _Refused(CUDA_ERROR_INVALID_VALUE, "CUmemAccessDesc count 0")
        descs = [ACCESS_DESC.unpack(ctypes.string_at(desc + i * ACCESS_DESC.size,
                                                     ACCESS_DESC.size)) for i in range(count)]
        for ltype, lid, flags in descs:
            self._location(ltype, lid, "CUmemAccessDesc")
            if flags not in _ACCESS_FLAGS:
                raise _Refused(CUDA_ERROR_INVALID_VALUE, f"access flags {flags}: valid are "
                               f"{', '.join(f'{k} ({v})' for k, v in _ACCESS_FLAGS.items())}")
        if any(flags == _READWRITE for _, _, flags in descs):
            self.vmm.set_access(va, size)
        return {"va": va, "size": size, "count": count,
                "desc": [{"location": (t, i), "flags": f} for t, i, f in descs]}

    def _cuMemUnmap(self, va: int, size: int) -> dict[str, Any]:
        self.vmm.unmap(va, size)
        return {"va": va, "size": size}

    def _cuMemRelease(self, handle: int) -> dict[str, Any]:
        self.vmm.release(handle - _HANDLE_BASE)
        return {"handle": handle}


def simulated_cuda_vmm(device: torch.device, runtime: Any, vmm: SimVmm | None = None
                       ) -> CudaVmm:
    """:class:`CudaVmm` for the simulated GPU ``runtime`` (``device``: its ``cpu`` device),
    over a :class:`SimLibcuda` of ``vmm`` (default: a new :class:`SimVmm` of the runtime)."""
    lib = SimLibcuda(runtime=runtime, vmm=vmm)
    return CudaVmm(device, lib=lib, ordinal=lib.ordinal)
