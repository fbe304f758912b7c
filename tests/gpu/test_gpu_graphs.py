"""CUDA graphs across sleep and wake (``resident-stable``): a real ``torch.cuda.graph`` (a
simulated graph on the simulated GPU) and ``torch.compile(mode="reduce-overhead")`` (GPU
only) captured on the transformer replay after sleeps, wakes and in-place updates; the
wake's time (map + copy) against the pinned link, and the arena's granularity waste."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from strategies import CudaDevice
from strategies.checking._vmmsim import SimGraph
from tests.gpu.helpers import GpuRun, Recorder, link, ratio, timed

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]

STABLE = {"transformer": "resident-stable"}
CYCLES = 5


def inputs(pipe: DemoPipeline, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 4, 8, 8, generator=g).to(device), torch.full((1,), 500.0).to(device),
            torch.randn(1, pipe.config.text_dim, generator=g).to(device))


def eager(module: nn.Module, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = module(*args)
    return out


def captured(module: nn.Module, args: tuple[torch.Tensor, ...], layer: CudaDevice,
             real: bool) -> Callable[[], torch.Tensor]:
    """A graph of ``module(*args)``: its replay, returning a copy of the static output."""
    if not real:
        graph = SimGraph(module, layer.runtime)
        graph.capture(*args)
        return lambda: graph.replay()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            module(*args)
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph), torch.no_grad():
        static: torch.Tensor = module(*args)

    def replay() -> torch.Tensor:
        cuda_graph.replay()
        torch.cuda.synchronize()
        out: torch.Tensor = static.clone()
        return out

    return replay


def bumped(module: nn.Module, name: str, i: int) -> torch.Tensor:
    value = dict(module.named_parameters())[name].detach().clone()
    value.view(-1)[i] += 0.5
    return value


async def test_a_cuda_graph_of_a_resident_stable_transformer_replays_after_sleep_wake_and_update(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    pipe = DemoPipeline.build(gpu.sizes.updates)
    tr = pipe.modules["transformer"]
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer, residency=STABLE) as ctl:
        await ctl.attach(pipe)
        args = inputs(pipe, gpu.device)
        store = ctl._components["transformer"].strategy.store
        arena = store.arena
        assert arena is not None
        ptrs = {n: p.data_ptr() for n, p in tr.named_parameters()}
        replay = captured(tr, args, layer, gpu.real)
        assert torch.equal(replay(), eager(tr, args))
        wakes, exact = [], True
        for i in range(CYCLES):
            await ctl.sleep()
            _, seconds = await timed(layer, ctl.wake)
            wakes.append(seconds)
            value = bumped(tr, "x_proj.weight", i)
            assert (await ctl.update_weights_from_tensors({"x_proj.weight": value},
                                                          "transformer")).success
            layer.synchronize()
            exact &= torch.equal(replay(), eager(tr, args))
            assert {n: p.data_ptr() for n, p in tr.named_parameters()} == ptrs
        assert exact
        # The map alone (no bytes): asleep, the arena mapped and released by hand.
        await ctl.sleep()
        t0 = time.perf_counter()
        arena.map()
        map_s = time.perf_counter() - t0
        arena.unmap()
        await ctl.wake()
        flat = await link(layer, gpu.real, arena.used, gpu.sizes.repeats)
        wake_s = sorted(wakes)[len(wakes) // 2]
        wake_gbps = arena.used / wake_s / 1e9
        record(arena_bytes=arena.size, tensor_bytes=arena.used, waste_bytes=arena.waste,
               waste_fraction=arena.waste / arena.size, granularity=arena.driver.granularity(),
               wake_s=wake_s, map_s=map_s, wake_gbps=wake_gbps, link_h2d_gbps=flat["h2d_gbps"],
               cycles=CYCLES)
        record.target("wake_vs_pinned_link", ratio(wake_gbps, flat["h2d_gbps"]), at_least=0.7)


async def test_torch_compile_reduce_overhead_survives_sleep_wake_and_update(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    if not gpu.real:
        pytest.skip("torch.compile(mode='reduce-overhead') records real CUDA graphs: a GPU only")
    pipe = DemoPipeline.build(gpu.sizes.updates)
    tr = pipe.modules["transformer"]
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer, residency=STABLE) as ctl:
        await ctl.attach(pipe)
        args = inputs(pipe, gpu.device)
        compiled: Any = torch.compile(tr, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):  # warm up, then record
                before = compiled(*args).clone()
        t0 = time.perf_counter()
        for i in range(CYCLES):
            await ctl.sleep()
            await ctl.wake()
            with torch.no_grad():
                again = compiled(*args).clone()
            assert torch.equal(again, before)  # the same weights, replayed where they were
            value = bumped(tr, "x_proj.weight", i)
            assert (await ctl.update_weights_from_tensors({"x_proj.weight": value},
                                                          "transformer")).success
            with torch.no_grad():
                before = compiled(*args).clone()
            torch.testing.assert_close(before, eager(tr, args), rtol=1e-3, atol=1e-3)
        record(cycles=CYCLES, cycle_s=(time.perf_counter() - t0) / CYCLES)
