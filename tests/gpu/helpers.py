"""What the GPU tests share: the run's kind and sizes, the recorder, and device helpers that
work the same on the real GPU and on the simulated one (through the layer's runtime seam,
``CudaDevice.runtime``), with the few CUDA-only calls each behind ``run.real``."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import anyio.to_thread
import torch

from lifecycle import LifecycleController
from lifecycle._units import gbps
from lifecycle.demo import DemoPipeline
from strategies import CudaDevice, LayerwiseOffloadStrategy

T = TypeVar("T")
MiB, GiB = 2**20, 2**30
LAYERWISE = "transformer=layerwise-offload"


@dataclass(frozen=True)
class Sizes:
    """Pipeline bytes per test (``DemoPipeline.build``) and timed repeats."""

    bandwidth: int  # the sleep/wake bandwidth pipeline
    memory: int  # memory release, empty_cache
    layerwise: int
    updates: int
    planner: int
    ordering: int
    concurrency: int
    link: int  # one flat copy
    repeats: int

    def capped(self, cap: int) -> Sizes:
        """Every pipeline at most ``cap`` bytes."""
        return Sizes(**{k: v if k == "repeats" else min(v, cap)
                        for k, v in asdict(self).items()})


REAL = Sizes(bandwidth=8 * GiB, memory=2 * GiB, layerwise=2 * GiB, updates=GiB, planner=GiB,
             ordering=GiB, concurrency=256 * MiB, link=GiB, repeats=5)
SIMULATED = Sizes(bandwidth=4 * MiB, memory=4 * MiB, layerwise=4 * MiB, updates=2 * MiB,
                  planner=8 * MiB, ordering=2 * MiB, concurrency=MiB, link=4 * MiB, repeats=2)


@dataclass(frozen=True)
class GpuRun:
    """What kind of CUDA layer this run has, and the sizes its tests use."""

    real: bool  # a GPU (--gpu), else the simulated one
    device: torch.device  # the layers' device: cuda:N, or cpu under the simulator
    name: str
    sizes: Sizes


class Recorder:
    """What one test records: ``record(name=value, ...)`` for numbers, ``record.target`` for
    a number with a target (recorded always; asserted on the real GPU only, and there only
    when ``assert_targets``: ``--gpu-targets=assert``)."""

    def __init__(self, entry: dict[str, Any], real: bool, assert_targets: bool = True) -> None:
        self.entry = entry
        self.real = real
        self.assert_targets = assert_targets

    def __call__(self, **numbers: Any) -> None:
        self.entry["numbers"].update(numbers)

    def target(self, name: str, value: float | None, *, at_least: float | None = None,
               at_most: float | None = None, why_not_asserted: str | None = None) -> bool:
        """Record ``value`` against its target; on the real GPU, fail the test when missed
        (unless targets are recorded only, or this one is never asserted: then
        ``why_not_asserted`` says why, in the JSON)."""
        ok = value is not None and math.isfinite(value) \
            and (at_least is None or value >= at_least) and (at_most is None or value <= at_most)
        asserted = self.real and self.assert_targets and why_not_asserted is None
        self.entry["targets"][name] = {"value": value, "at_least": at_least,
                                       "at_most": at_most, "pass": ok, "asserted": asserted,
                                       **({"not_asserted": why_not_asserted}
                                          if why_not_asserted else {})}
        if asserted:
            bound = f">= {at_least}" if at_least is not None else f"<= {at_most}"
            assert ok, f"target missed: {name} = {value} (target {bound})"
        return ok


# -- pipelines and timing -----------------------------------------------------------------

def params(pipe: DemoPipeline) -> list[torch.nn.Parameter]:
    return [p for m in pipe.modules.values() for p in m.parameters()]


def bump(pipe: DemoPipeline, layer: CudaDevice) -> None:
    """Bump every parameter's and floating buffer's version in place (values unchanged):
    every host mirror is stale, so the next sleep copies every byte."""
    with torch.no_grad():
        for module in pipe.modules.values():
            for t in [*module.parameters(), *module.buffers()]:
                if t.is_floating_point():
                    t.add_(0)
    layer.synchronize()


async def timed(layer: CudaDevice, op: Callable[[], Awaitable[T]]) -> tuple[T, float]:
    """``await op()`` timed from an idle device to an idle device."""
    layer.synchronize()
    t0 = time.perf_counter()
    result = await op()
    layer.synchronize()
    return result, time.perf_counter() - t0


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def sim_conv_workspace(layer: CudaDevice) -> int:
    """The bytes of cuDNN's workspace a convolution's kernel takes on ``layer``'s simulated
    GPU (``SimCuda.conv_workspace_bytes``; 0 on anything else)."""
    return int(getattr(layer.runtime, "conv_workspace_bytes", 0))


def sim_workspaces(layer: CudaDevice) -> int:
    """The bytes the per-thread library workspaces hold on ``layer``'s simulated GPU
    (``SimCuda.workspace_total``; 0 on a GPU, where cuBLAS's are not counted apart)."""
    return int(getattr(layer.runtime, "workspace_total", 0))


def memory(layer: CudaDevice) -> dict[str, int]:
    """The caching allocator's and the driver's view of the layer's device, once its queued
    work is done: ``allocated``, ``reserved``, ``driver_free``."""
    layer.synchronize()
    stats = layer.runtime.memory()
    free, _total = layer.runtime.mem_get_info()
    return {"allocated": stats.allocated, "reserved": stats.reserved, "driver_free": free}


async def empty_cache(layer: CudaDevice) -> None:
    """``torch.cuda.empty_cache()`` as a user would call it, in a worker thread (it
    synchronizes: never on the event loop)."""
    await anyio.to_thread.run_sync(layer.empty_cache)


async def reference_outputs(layer: CudaDevice, pipe: DemoPipeline,
                            update: dict[str, torch.Tensor] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pipeline's output with every component resident on ``layer`` (and, given
    ``update`` for the transformer, the output after it); detached after."""
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        before = await pipe.generate(ctl=ctl)
        after = None
        if update is not None:
            result = await ctl.update_weights_from_tensors(update)
            assert result.success, result.message
            after = await pipe.generate(ctl=ctl)
        layer.synchronize()
    return before, after


def layerwise_strategy(ctl: LifecycleController) -> LayerwiseOffloadStrategy:
    strategy = ctl.strategy("transformer")
    assert isinstance(strategy, LayerwiseOffloadStrategy)
    return strategy


def perturbed(pipe: DemoPipeline, delta: float) -> dict[str, torch.Tensor]:
    """New host values for every floating tensor of the transformer: ``value + delta``."""
    with torch.no_grad():
        return {k: v.detach().to("cpu") + delta for k, v in
                pipe.modules["transformer"].state_dict().items() if v.is_floating_point()}


# -- the compute stream -----------------------------------------------------------------------

_CYCLES_PER_MS: dict[torch.device, float] = {}


def queue_work(layer: CudaDevice, real: bool, ms: float = 100.0) -> None:
    """Queue about ``ms`` of GPU work on the compute stream, so that the work queued after
    it is still pending when the host moves on (real GPU: ``torch.cuda._sleep``; the
    simulated GPU's compute stream lags the host by itself)."""
    if not real:
        return
    with torch.cuda.device(layer.device):
        if layer.device not in _CYCLES_PER_MS:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]
            end.record()
            end.synchronize()
            _CYCLES_PER_MS[layer.device] = 10_000_000 / max(float(start.elapsed_time(end)), 1e-3)
        torch.cuda._sleep(int(ms * _CYCLES_PER_MS[layer.device]))  # type: ignore[no-untyped-call]


def work_pending(layer: CudaDevice) -> bool:
    """Whether the compute (default) stream still has queued work."""
    rt = layer.runtime
    with rt.use_device():
        event = rt.event()
        event.record(rt.default_stream())
        return not event.query()


@contextmanager
def user_stream(layer: CudaDevice, real: bool) -> Iterator[None]:
    """Make a stream of the user's current in this thread (real GPU: a ``torch.cuda.Stream``,
    ordered after the compute stream; simulated: a new stream of the simulator)."""
    rt = layer.runtime
    if real:
        stream: Any = torch.cuda.Stream(layer.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(layer.device))
    else:
        stream = rt.new_stream()
    try:
        with rt.use_device(), rt.use_stream(stream):
            yield
    finally:
        # Whatever ran on it is ordered before the compute stream's next work.
        with rt.use_device():
            rt.default_stream().wait_stream(stream)
        if real:
            stream.synchronize()


# -- flat copies ------------------------------------------------------------------------------

def flat_copies(layer: CudaDevice, host: torch.Tensor, repeats: int) -> dict[str, Any]:
    """One flat copy of ``host`` (a page-locked host buffer) to a device buffer and back, on
    the compute stream, timed with events: median and best of ``repeats`` after a warm-up,
    and whether the bytes arrived exactly. Blocking: call it in a worker thread."""
    rt = layer.runtime
    n = int(host.numel())
    pattern = torch.arange(min(n, 4096), dtype=torch.int64).remainder(251).to(torch.uint8)
    h2d: list[float] = []
    d2h: list[float] = []
    exact = True
    with rt.use_device():
        stream = rt.default_stream()
        dev = rt.empty(n)
        host.fill_(0x5A)
        host[:pattern.numel()].copy_(pattern)
        for times, to_device in ((h2d, True), (d2h, False)):
            if not to_device:
                host.zero_()
            for i in range(repeats + 1):
                start, end = rt.event(timing=True), rt.event(timing=True)
                with rt.use_stream(stream):
                    start.record(stream)
                    if to_device:
                        rt.copy(dev, host)
                    else:
                        rt.copy(host, dev)
                    end.record(stream)
                end.synchronize()
                if i:
                    times.append(float(start.elapsed_time(end)) / 1e3)
            got = dev if to_device else host
            exact = exact and torch.equal(got[:pattern.numel()].to("cpu"), pattern) \
                and int(got[-1].to("cpu")) == 0x5A
        del dev
    return {"bytes": n, "exact": exact,
            "h2d_gbps": gbps(n, statistics.median(h2d)), "d2h_gbps": gbps(n, statistics.median(d2h)),
            "h2d_best_gbps": gbps(n, min(h2d)), "d2h_best_gbps": gbps(n, min(d2h))}


def device_copy_seconds(layer: CudaDevice, nbytes: int) -> float:
    """One flat copy of ``nbytes`` between two device buffers, from an idle device to an idle
    device (after a warm-up copy): the floor of an update from device tensors. Blocking."""
    rt = layer.runtime
    with rt.use_device():
        src, dst = rt.empty(nbytes), rt.empty(nbytes)
        rt.copy(dst, src)  # warm-up
        layer.synchronize()
        t0 = time.perf_counter()
        rt.copy(dst, src)
        layer.synchronize()
        seconds = time.perf_counter() - t0
        del src, dst
    return seconds


async def link(layer: CudaDevice, real: bool, nbytes: int, repeats: int) -> dict[str, Any]:
    """Flat copies between the device and page-locked host memory: a mirror of the library's
    own (``CudaDevice.alloc(..., "host")``) and, on the real GPU, torch's pinned memory
    (``pin_memory=True``, the reference of the bandwidth targets: ``h2d_gbps``/``d2h_gbps``
    are torch's there, the mirror's on the simulator)."""
    mirror = await anyio.to_thread.run_sync(layer.alloc, nbytes, "host")  # pinning blocks
    assert layer.runtime.is_pinned(mirror)
    ours = await anyio.to_thread.run_sync(flat_copies, layer, mirror, repeats)
    del mirror
    out: dict[str, Any] = {f"mirror_{k}": v for k, v in ours.items() if k != "bytes"}
    out["bytes"] = nbytes
    reference = ours
    if real:
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        reference = await anyio.to_thread.run_sync(flat_copies, layer, pinned, repeats)
        del pinned
        out.update({f"torch_pinned_{k}": v for k, v in reference.items() if k != "bytes"})
    out.update(h2d_gbps=reference["h2d_gbps"], d2h_gbps=reference["d2h_gbps"],
               exact=ours["exact"] and reference["exact"])
    return out


async def measure_link(layer: CudaDevice, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """The library's own ``measure_link`` (bytes/s, seconds per copy), in a worker thread."""
    return await anyio.to_thread.run_sync(
        functools.partial(layer.measure_link, nbytes, repeats))
