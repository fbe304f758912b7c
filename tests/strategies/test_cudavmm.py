"""CudaVmm's own ctypes code (strategies.devices._vmm) against a simulated libcuda
(strategies.checking._libcudasim): the structs as the driver reads them from memory, the
arguments in the driver's order, every error code with cuGetErrorString's text, rollback at a
failed create, map and set-access, a failed unmap retried, and the context made current in
every thread. The first GPU run must not be where a ctypes mistake shows."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from strategies.checking import SimCuda
from strategies.checking._libcudasim import (
    ACCESS_DESC,
    ALLOCATION_PROP,
    ERROR_TEXT,
    SimLibcuda,
)
from strategies.checking._vmmsim import GraphReplayFault, check_access
from strategies.devices._cuda import CudaDevice
from strategies.devices._vmm import (
    Arena,
    CudaVmm,
    VmmError,
    _AccessDesc,
    _AllocProp,
    _Location,
    vmm_for,
)

MiB = 2**20
ORDINAL = 2  # the simulated machine has cuda:0 .. cuda:2; cuda:2's memory is simulated
# (not 1: CU_MEM_LOCATION_TYPE_DEVICE is 1 too, and a swap of the two would not show)
PROP = {"type": 1, "requestedHandleTypes": 0, "location": (1, ORDINAL), "win32HandleMetaData": 0,
        "compressionType": 0, "gpuDirectRDMACapable": 0, "usage": 0, "reserved": bytes(4)}


@pytest.fixture
def lib() -> SimLibcuda:
    return SimLibcuda(ordinal=ORDINAL)


@pytest.fixture
def cuda(lib: SimLibcuda) -> Iterator[CudaVmm]:
    vmm = CudaVmm(torch.device("cpu"), lib=lib, ordinal=ORDINAL)
    yield vmm
    # Reservations a test left are given back (the simulated address space is process-wide).
    for call in lib.calls("cuMemAddressReserve"):
        if call.result == 0:
            lib.vmm.make_current()
            with contextlib.suppress(VmmError):  # freed by the test
                lib.vmm.free(call.args["va"], call.args["size"])


def args(lib: SimLibcuda, name: str, i: int = -1) -> dict[str, Any]:
    calls = [c for c in lib.calls(name) if c.result == 0]
    return calls[i].args


def test_the_structs_have_the_driver_layout() -> None:
    assert ctypes.sizeof(_AllocProp) == ALLOCATION_PROP.size == 32
    assert ctypes.sizeof(_AccessDesc) == ACCESS_DESC.size == 12
    assert ctypes.sizeof(_Location) == 8


def test_the_allocation_properties_reach_the_driver_as_it_reads_them(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    assert cuda.granularity() == 2 * MiB
    assert args(lib, "cuMemGetAllocationGranularity") == {"prop": PROP, "option": 0}  # minimum
    handle = cuda.create(4 * MiB)
    assert handle > 2**32  # a 64-bit handle, as the driver's: none of its bits lost
    assert args(lib, "cuMemCreate") == {"size": 4 * MiB, "prop": PROP, "flags": 0,
                                        "handle": handle}
    cuda.release(handle)
    assert lib.vmm.physical_bytes == 0


def test_access_is_read_write_for_the_device_and_arguments_come_in_the_driver_order(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    size = 4 * MiB
    va = cuda.reserve(size)
    assert args(lib, "cuMemAddressReserve") == {"size": size, "alignment": 2 * MiB, "addr": 0,
                                                "flags": 0, "va": va}
    handle = cuda.create(size)
    cuda.map(va, size, handle)
    assert args(lib, "cuMemMap") == {"va": va, "size": size, "offset": 0, "handle": handle,
                                     "flags": 0}
    with pytest.raises(GraphReplayFault, match="without access"):
        check_access(va, 4, "a read")
    cuda.set_access(va, size)
    assert args(lib, "cuMemSetAccess") == {"va": va, "size": size, "count": 1,
                                           "desc": [{"location": (1, ORDINAL), "flags": 3}]}
    check_access(va, 4, "a read")
    mem = cuda.bytes_at(va, size)
    assert (mem.data_ptr(), mem.numel(), mem.dtype) == (va, size, torch.uint8)
    mem.fill_(7)
    assert int(lib.vmm.bytes_at(va, size).min()) == 7  # the simulated memory itself
    cuda.unmap(va, size)
    assert args(lib, "cuMemUnmap") == {"va": va, "size": size}
    cuda.release(handle)
    assert args(lib, "cuMemRelease") == {"handle": handle}
    cuda.free(va, size)
    assert args(lib, "cuMemAddressFree") == {"va": va, "size": size}
    assert lib.vmm.physical_bytes == 0


def test_the_context_is_the_devices_primary_context_retained_through_the_driver(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    assert [c.name for c in lib.log] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert args(lib, "cuDeviceGet") == {"ordinal": ORDINAL}
    assert lib.retained == {lib.context_of(ORDINAL): 1}
    cuda.make_current()
    cuda.make_current()  # already current: not set again
    assert [c.name for c in lib.log[3:]] == ["cuCtxGetCurrent", "cuCtxSetCurrent",
                                             "cuCtxGetCurrent"]
    assert args(lib, "cuCtxSetCurrent") == {"ctx": lib.context_of(ORDINAL)}


@pytest.mark.parametrize("code", sorted(set(ERROR_TEXT) - {0}))
def test_every_error_code_is_raised_with_the_drivers_text(lib: SimLibcuda, cuda: CudaVmm,
                                                          code: int) -> None:
    lib.fail("cuMemCreate", code)
    with pytest.raises(VmmError) as info:
        cuda.create(2 * MiB)
    err = info.value
    assert (err.call, err.code, err.text) == ("cuMemCreate", code, ERROR_TEXT[code])
    assert f"CUDA error {code} ({ERROR_TEXT[code]})" in str(err)
    assert args(lib, "cuGetErrorString") == {"error": code}
    assert lib.vmm.physical_bytes == 0


def test_an_error_code_the_driver_does_not_know_is_named_so(lib: SimLibcuda,
                                                            cuda: CudaVmm) -> None:
    lib.fail("cuMemMap", 12345)
    with pytest.raises(VmmError, match=re.escape("12345 (an error code the driver does not know)")):
        cuda.map(0, 2 * MiB, 1)
    text = ctypes.c_char_p(b"stale")
    assert lib.cuGetErrorString(ctypes.c_int(12345), ctypes.byref(text)) == 1
    assert text.value is None  # NULL, as the driver writes


def test_a_driver_refusing_init_or_the_device_fails_the_construction_by_name() -> None:
    lib = SimLibcuda(ordinal=0)
    lib.fail("cuInit", 3)
    with pytest.raises(VmmError, match=re.escape("cuInit failed: CUDA error 3 (initialization error)")):
        CudaVmm(torch.device("cpu"), lib=lib, ordinal=0)
    with pytest.raises(VmmError, match=re.escape(
            "cuDeviceGet failed: CUDA error 101 (invalid device ordinal); device ordinal 2")):
        CudaVmm(torch.device("cpu"), lib=SimLibcuda(ordinal=1), ordinal=2)


def arena(cuda: CudaVmm) -> Arena:
    return Arena(cuda, [("a", 4096), ("b", 100)], "test")


@pytest.mark.parametrize(("failing", "undo"), [("cuMemCreate", []),
                                               ("cuMemMap", ["cuMemRelease"]),
                                               ("cuMemSetAccess", ["cuMemUnmap", "cuMemRelease"])])
def test_a_failed_mapping_call_undoes_the_calls_before_it(
        lib: SimLibcuda, cuda: CudaVmm, failing: str, undo: list[str]) -> None:
    a = arena(cuda)
    lib.fail(failing, 2)
    start = len(lib.log)
    with pytest.raises(VmmError) as info:
        a.map()
    assert (info.value.call, info.value.code) == (failing, 2)
    memory = [c.name for c in lib.log[start:] if c.name.startswith("cuMem")]
    assert memory[memory.index(failing) + 1:] == undo
    assert not a.mapped and lib.vmm.physical_bytes == 0
    assert a.map() and a.view("a").data_ptr() == a.va  # a retry maps at the same addresses
    a.close()


def test_a_failed_unmap_keeps_the_memory_and_the_next_unmap_releases_it(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    a = arena(cuda)
    a.map()
    lib.fail("cuMemUnmap", 700)
    with pytest.raises(VmmError, match="illegal memory access"):
        a.unmap()
    assert a.mapped and lib.vmm.physical_bytes == a.size and not lib.calls("cuMemRelease")
    a.unmap()
    assert [c.name for c in lib.log[-4:] if c.name.startswith("cuMem")] == ["cuMemUnmap",
                                                                             "cuMemRelease"]
    assert not a.mapped and lib.vmm.physical_bytes == 0
    a.close()
    assert args(lib, "cuMemAddressFree") == {"va": a.va, "size": 2 * MiB}


def test_a_failed_set_access_whose_unmap_fails_still_releases_the_memory(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    a = arena(cuda)
    lib.fail("cuMemSetAccess", 2)
    lib.fail("cuMemUnmap", 999)
    with pytest.raises(VmmError, match="cuMemUnmap"):
        a.map()
    assert [c.result for c in lib.calls("cuMemRelease")] == [0]
    assert lib.vmm.physical_bytes == 0 and not a.mapped


def test_a_failed_free_at_close_is_logged_and_the_arena_is_closed(
        lib: SimLibcuda, cuda: CudaVmm, caplog: pytest.LogCaptureFixture) -> None:
    a = arena(cuda)
    a.map()
    lib.fail("cuMemAddressFree", 1)
    with caplog.at_level(logging.WARNING, logger="residency.vmm"):
        a.close()
    assert "cuMemAddressFree failed: CUDA error 1 (invalid argument)" in caplog.text
    assert a.size == 0 and lib.vmm.physical_bytes == 0


def in_new_thread(fn: Callable[[], Any]) -> tuple[str, Any]:
    """``fn()`` in a thread of its own: the thread's name and what it returned or raised."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=run, name="fresh")
    thread.start()
    thread.join()
    return thread.name, result[0]


def test_every_call_makes_the_context_current_in_a_new_thread(lib: SimLibcuda,
                                                              cuda: CudaVmm) -> None:
    size = 2 * MiB
    _, gran = in_new_thread(cuda.granularity)
    _, va = in_new_thread(lambda: cuda.reserve(size))
    _, handle = in_new_thread(lambda: cuda.create(size))
    steps: list[Callable[[], Any]] = [
        lambda: cuda.map(va, size, handle), lambda: cuda.set_access(va, size),
        lambda: cuda.bytes_at(va, size).fill_(1), lambda: cuda.unmap(va, size),
        lambda: cuda.release(handle), lambda: cuda.free(va, size)]
    raised = [r for r in [gran, va, handle] + [in_new_thread(s)[1] for s in steps]
              if isinstance(r, Exception)]
    failed = [c for c in lib.log if c.result]
    assert gran == size and not raised and not failed, (raised, failed)
    fresh = [c for c in lib.log if c.thread == "fresh"]
    sets = [c for c in fresh if c.name == "cuCtxSetCurrent"]
    assert len(sets) == 9 and all(c.args["ctx"] == lib.context_of(ORDINAL) for c in sets)
    assert lib.vmm.physical_bytes == 0


def test_a_memory_call_from_a_thread_without_a_context_is_an_invalid_context(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    cuda.make_current()
    name, code = in_new_thread(lambda: lib.cuMemRelease(ctypes.c_ulonglong(1)))
    assert code == 201 and lib.log[-1].why == f"no context is current in thread {name!r}"
    assert lib.cuCtxSetCurrent(ctypes.c_void_p(0x1234)) == 201  # not a context


def test_the_driver_needs_init_first() -> None:
    lib = SimLibcuda()
    dev = ctypes.c_int()
    assert lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(0)) == 3  # CUDA_ERROR_NOT_INITIALIZED
    assert lib.cuInit(ctypes.c_uint(0)) == 0
    assert lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(0)) == 0 and dev.value == 0
    with pytest.raises(AttributeError, match="no symbol 'cuMemAlloc_v2'"):
        lib.cuMemAlloc_v2  # noqa: B018


def test_a_bare_python_int_for_a_64_bit_address_is_cut_as_ctypes_cuts_it(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    """(Without argtypes ctypes passes a Python int as a C int, against libcuda as here.)"""
    va = cuda.reserve(2 * MiB)
    assert va >= 2**32
    assert lib.cuMemAddressFree(va, ctypes.c_size_t(2 * MiB)) == 1  # CUDA_ERROR_INVALID_VALUE
    assert lib.log[-1].args["raw"][0] != va
    cuda.free(va, 2 * MiB)


def granularity_of(lib: SimLibcuda, prop: _AllocProp, option: int = 0) -> tuple[int, int]:
    gran = ctypes.c_size_t()
    code = lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                             ctypes.c_int(option))
    return code, gran.value


def prop_with(**fields: Any) -> _AllocProp:
    prop = _AllocProp()
    prop.type, prop.location = 1, _Location(1, ORDINAL)
    for name, value in fields.items():
        target: Any = prop.allocFlags if name in ("compressionType", "usage") else prop
        if name == "location":
            value = _Location(*value)
        setattr(target, name, value)
    return prop


@pytest.mark.parametrize(("fields", "code"), [
    ({"type": 0}, 1), ({"requestedHandleTypes": 3}, 1), ({"requestedHandleTypes": 2}, 801),
    ({"location": (0, ORDINAL)}, 1), ({"location": (2, 0)}, 801), ({"location": (1, 5)}, 101),
    ({"location": (1, 0)}, 801), ({"compressionType": 1}, 801), ({"usage": 1}, 1)])
def test_the_driver_checks_every_field_of_the_allocation_properties(
        lib: SimLibcuda, cuda: CudaVmm, fields: dict[str, Any], code: int) -> None:
    cuda.make_current()
    assert granularity_of(lib, prop_with(**fields))[0] == code, lib.log[-1].why
    assert granularity_of(lib, prop_with()) == (0, 2 * MiB)


def test_a_value_passed_where_the_driver_takes_a_pointer_is_refused_not_a_crash(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    cuda.make_current()
    gran = ctypes.c_size_t()
    assert lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.c_void_p(8),
                                             ctypes.c_int(0)) == 1
    assert "at 0x8 is not an address" in lib.log[-1].why
    assert lib.cuGetErrorString(ctypes.c_int(2), ctypes.c_void_p(0)) == 1  # NULL


def test_the_granularity_options_are_the_minimum_and_the_recommended(
        lib: SimLibcuda, cuda: CudaVmm) -> None:
    cuda.make_current()
    assert granularity_of(lib, prop_with(), 1) == (0, 4 * MiB)
    assert granularity_of(lib, prop_with(), 2)[0] == 1


@pytest.mark.parametrize(("flags", "code", "access"), [(3, 0, True), (1, 0, False),
                                                       (2, 1, False)])
def test_only_read_write_access_makes_mapped_memory_accessible(
        lib: SimLibcuda, cuda: CudaVmm, flags: int, code: int, access: bool) -> None:
    va = cuda.reserve(2 * MiB)
    handle = cuda.create(2 * MiB)
    cuda.map(va, 2 * MiB, handle)
    desc = _AccessDesc(_Location(1, ORDINAL), flags)
    assert lib.cuMemSetAccess(ctypes.c_uint64(va), ctypes.c_size_t(2 * MiB), ctypes.byref(desc),
                              ctypes.c_size_t(1)) == code
    if access:
        check_access(va, 4, "a read")
    else:
        with pytest.raises(GraphReplayFault, match="without access"):
            check_access(va, 4, "a read")
    cuda.unmap(va, 2 * MiB)
    cuda.release(handle)
    cuda.free(va, 2 * MiB)


def test_the_simulated_gpu_gets_the_cuda_driver_over_a_simulated_libcuda() -> None:
    runtime = SimCuda()
    layer = CudaDevice(torch.device("cpu"), runtime=runtime)
    vmm = vmm_for(layer)
    assert isinstance(vmm, CudaVmm) and isinstance(vmm._lib, SimLibcuda)
    assert vmm.index == runtime.index and vmm_for(layer) is vmm
    a = Arena(vmm, [("w", 1000)], "test")
    view = a.view("w")
    assert runtime.is_device(view)  # the arena is the simulated GPU's device memory
    a.close()
    assert vmm._lib.vmm.physical_bytes == 0
    layer.close()


def test_a_freed_arena_range_is_no_longer_the_simulated_gpus_memory() -> None:
    # The CPU allocator may hand the freed range's bytes to a host tensor later: it must not
    # pass for device memory carrying the arena's history (a stale record once flagged a
    # host copy as racing a kernel long gone).
    runtime = SimCuda(host_modules=True)
    layer = CudaDevice(torch.device("cpu"), runtime=runtime)
    a = Arena(vmm_for(layer), [("w", 1000)], "test")
    view = a.view("w")  # (its bytes are freed with the range: only its address is used below)
    assert runtime.on_device(view)
    a.close()
    device_after = [runtime.on_device(view), runtime.is_device(view)]
    del view
    assert device_after == [False, False]
    layer.close()
