"""Sleep and wake on the CUDA layer: bandwidth against a flat pinned copy (8 GiB on a GPU),
exact outputs in the same ``Parameter`` objects, and memory given back to the allocator and
the driver (``empty_cache`` after a sleep finds nothing more)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from lifecycle import LifecycleController
from lifecycle._units import gbps
from lifecycle.demo import DemoPipeline
from strategies import CudaDevice
from strategies.checking import SimCuda
from tests.gpu.helpers import (
    GpuRun,
    MiB,
    Recorder,
    bump,
    empty_cache,
    link,
    memory,
    params,
    ratio,
    timed,
)

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]

BANDWIDTH_TARGET = 0.8  # sleep and wake at >= this fraction of the pinned copy (GPU)


def slack(gpu: GpuRun, on_device: int, layer: CudaDevice) -> int:
    """Bytes the allocator may keep that are not the weights' (a GPU: a segment shared with
    another tensor, the library's staging; the simulated GPU: the rest of the segments its
    library workspaces sit in, which the weights' small blocks share: torch's rules put a
    block of up to 1 MiB in a 2 MiB segment, one up to 10 MiB in a 20 MiB one)."""
    if gpu.real:
        return max(64 * MiB, on_device // 100)
    sim = layer.runtime
    assert isinstance(sim, SimCuda)
    each = sim.workspace_bytes
    if not each:
        return 0
    segment = 2 * MiB if each <= MiB else 20 * MiB if each <= 10 * MiB else each
    return sim.workspace_total // each * max(segment - each, 0)


async def test_sleep_and_wake_run_at_pinned_copy_bandwidth_exactly_in_the_same_parameters(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """A dirty sleep and a wake of the whole pipeline copy every byte at >= 0.8x a flat
    pinned copy's bandwidth (asserted on a GPU), and after them the outputs are bit-identical
    in the very same ``Parameter`` objects."""
    t0 = time.perf_counter()
    pipe = DemoPipeline.build(gpu.sizes.bandwidth)
    build_s = time.perf_counter() - t0
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        expected = await pipe.generate(ctl=ctl)
        ids = [id(p) for p in params(pipe)]
        first_sleep, first_sleep_s = await timed(layer, ctl.sleep)  # pins the mirrors
        _, first_wake_s = await timed(layer, ctl.wake)
        on_device = ctl.report().device_bytes
        bump(pipe, layer)
        slept, sleep_s = await timed(layer, ctl.sleep)
        woke, wake_s = await timed(layer, ctl.wake)
        same = torch.equal(await pipe.generate(ctl=ctl), expected)
        same_ids = ids == [id(p) for p in params(pipe)]
        copy = await link(layer, gpu.real, min(gpu.sizes.link, on_device), gpu.sizes.repeats)
        sleep_gbps, wake_gbps = gbps(slept.bytes_moved, sleep_s), gbps(woke.bytes_moved, wake_s)
        record(sleep_gbps=sleep_gbps, wake_gbps=wake_gbps,
               pinned_d2h_gbps=copy["d2h_gbps"], pinned_h2d_gbps=copy["h2d_gbps"],
               sleep_s=sleep_s, wake_s=wake_s, sleep_bytes=slept.bytes_moved,
               wake_bytes=woke.bytes_moved, weights=on_device, build_s=build_s,
               first_sleep_s=first_sleep_s, first_sleep_bytes=first_sleep.bytes_moved,
               first_wake_s=first_wake_s, outputs_identical=same, identity_kept=same_ids,
               link=copy)
        assert slept.success and woke.success, (slept.message, woke.message)
        assert slept.bytes_moved == on_device and woke.bytes_moved == on_device
        assert same and same_ids and copy["exact"]
        record.target("sleep_x_pinned_d2h", ratio(sleep_gbps, copy["d2h_gbps"]),
                      at_least=BANDWIDTH_TARGET)
        record.target("wake_x_pinned_h2d", ratio(wake_gbps, copy["h2d_gbps"]),
                      at_least=BANDWIDTH_TARGET)


async def test_sleep_gives_the_weights_bytes_back_to_the_allocator_and_the_driver(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """A sleep lowers the allocator's allocated and reserved bytes and raises the driver's
    free memory by the weights' bytes (the library empties the cache itself); a wake takes
    them again and the output is exact."""
    pipe = DemoPipeline.build(gpu.sizes.memory)
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        expected = await pipe.generate(ctl=ctl)
        await ctl.sleep()  # mirrors exist: the steady state
        await ctl.wake()
        on_device = ctl.report().device_bytes
        before = memory(layer)
        slept = await ctl.sleep()
        after = memory(layer)
        asleep = ctl.report().device_bytes
        woke = await ctl.wake()
        awake = memory(layer)
        same = torch.equal(await pipe.generate(ctl=ctl), expected)
        released = {k: before[k] - after[k] for k in ("allocated", "reserved")}
        gained = after["driver_free"] - before["driver_free"]
        allowed = slack(gpu, on_device, layer)
        record(weights_on_device=on_device, released_allocated=released["allocated"],
               released_reserved=released["reserved"], driver_free_gain=gained, slack=allowed,
               library_bytes_released=slept.bytes_released, report_device_bytes_asleep=asleep,
               before=before, after=after, after_wake=awake, outputs_identical=same)
        assert slept.success and woke.success and asleep == 0
        assert slept.bytes_released >= on_device
        assert released["allocated"] >= on_device
        assert released["reserved"] >= on_device - allowed
        assert gained >= on_device - allowed
        assert awake["allocated"] - after["allocated"] >= on_device
        assert same


async def test_an_explicit_empty_cache_after_a_sleep_finds_nothing_more_to_give_back(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """After a sleep, a user's own ``empty_cache()`` releases no more reserved memory (the
    sleep already did); its cost and the wake after it are recorded, and the output is
    exact."""
    pipe = DemoPipeline.build(gpu.sizes.memory)
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        expected = await pipe.generate(ctl=ctl)
        await ctl.sleep()
        _, wake_s = await timed(layer, ctl.wake)
        on_device = ctl.report().device_bytes
        bump(pipe, layer)
        slept, sleep_s = await timed(layer, ctl.sleep)
        asleep = memory(layer)
        t0 = time.perf_counter()
        await empty_cache(layer)
        layer.synchronize()
        empty_s = time.perf_counter() - t0
        emptied = memory(layer)
        woke, wake_after_s = await timed(layer, ctl.wake)
        same = torch.equal(await pipe.generate(ctl=ctl), expected)
        extra = asleep["reserved"] - emptied["reserved"]
        record(reserved_freed_by_explicit_empty_cache=extra,
               driver_free_gain_explicit=emptied["driver_free"] - asleep["driver_free"],
               sleep_s=sleep_s, empty_cache_s=empty_s, sleep_plus_empty_cache_s=sleep_s + empty_s,
               wake_s=wake_s, wake_s_after_empty_cache=wake_after_s, outputs_identical=same)
        assert slept.success and woke.success and same
        assert extra <= slack(gpu, on_device, layer)
