"""What only the device itself can show about the CUDA layer: its copy streams are its own (not
torch's pooled streams, which NCCL and other libraries share) at the lowest priority, and its
host mirrors are page-locked. On the simulated GPU the same tests check what the simulator
models of these (streams made by the layer, registered host ranges)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from strategies import CudaDevice
from tests.gpu.helpers import GpuRun, Recorder

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]


def test_copy_streams_are_the_layers_own_at_the_lowest_priority(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """The two copy streams are neither the default stream nor any stream of torch's pools
    (64 streams of each priority level drawn from them on a GPU), and run at the lowest
    priority."""
    layer = cuda_layer()
    streams = list(layer.streams.values())
    default = layer.runtime.default_stream()
    assert len(streams) == 2 and streams[0] is not streams[1]
    assert all(s is not default for s in streams)
    if gpu.real:
        probe = torch.cuda.Stream(gpu.device)  # type: ignore[no-untyped-call]
        least, greatest = probe.priority_range()  # (0, -5): a lower number runs first
        # Twice each pool of every priority (torch keeps 32 streams per priority level).
        pool = [torch.cuda.Stream(gpu.device, priority=p)  # type: ignore[no-untyped-call]
                for p in range(least, greatest - 1, -1) for _ in range(64)]
        pooled = {int(s.cuda_stream) for s in pool}
        ours = [int(s.cuda_stream) for s in streams]  # type: ignore[attr-defined]
        priorities = [int(s.priority) for s in streams]  # type: ignore[attr-defined]
        record(stream_handles=[hex(h) for h in ours], priorities=priorities,
               priority_range=[least, greatest], pool_streams_seen=len(pooled),
               default_stream=hex(int(torch.cuda.default_stream(gpu.device).cuda_stream)))
        assert not set(ours) & pooled, "a copy stream is one of torch's pooled streams"
        assert int(torch.cuda.default_stream(gpu.device).cuda_stream) not in ours
        assert len(set(ours)) == 2
        assert priorities == [least, least]
    else:
        own = [bool(getattr(s, "own", False)) for s in streams]
        priorities = [int(getattr(s, "priority", -1)) for s in streams]
        record(own=own, priorities=priorities)
        assert own == [True, True] and priorities == [0, 0]


async def test_host_mirrors_are_page_locked_and_counted(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """An offloaded component's host store and a resident component's sleep mirrors are
    page-locked (``Tensor.is_pinned()`` on a GPU), and ``report().pinned_bytes`` counts them
    at their page-rounded size."""
    layer = cuda_layer()
    offloaded = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
    resident = nn.Linear(128, 128)
    async with LifecycleController(device_layer=layer, residency="off=component-offload") as ctl:
        await ctl.attach({"off": offloaded, "res": resident})
        store = ctl.strategy("off").store
        hosts = [u.host for u in store.units if u.host is not None]
        assert hosts and all(layer.runtime.is_pinned(h) for h in hosts)
        await ctl.sleep()
        mirrors = [u.host for u in ctl.strategy("res").store.units if u.host is not None]
        assert mirrors and all(layer.runtime.is_pinned(m) for m in mirrors)
        if gpu.real:
            assert all(t.is_pinned() for t in [*hosts, *mirrors])
        report = ctl.report()
        pinned = sum(CudaDevice.pinned_footprint(int(t.nbytes)) for t in [*hosts, *mirrors])
        record(pinned_bytes=report.pinned_bytes, host_bytes=report.host_bytes,
               mirrors=len(hosts) + len(mirrors))
        assert report.pinned_bytes >= report.host_bytes > 0
        assert report.pinned_bytes == pinned
        await ctl.wake()
