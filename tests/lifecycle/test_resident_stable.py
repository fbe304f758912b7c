"""``resident-stable``: a pipeline whose transformer forward is captured (a simulated graph)
replays bit-exact across sleeps, wakes, discards, partial sleeps and in-place updates; a
fault at every driver call, copy and allocation rolls back; capture stays refused for the
modes whose weights move. Runs on the CPU layers and on ``--device-layer=cuda-sim``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lifecycle import (
    ComponentAsleep,
    LifecycleController,
    Phase,
    TransitionFailed,
    UnsupportedCompute,
)
from lifecycle.demo import DemoPipeline
from lifecycle.testing import InjectedFault
from strategies import ComponentResidencyError
from strategies.checking._libcudasim import simulated_cuda_vmm
from strategies.checking._vmmsim import GraphReplayFault, SimGraph, SimVmm
from strategies.devices._vmm import CudaVmm, VmmDriver, VmmError
from tests.helpers import faulty_device

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

STABLE = {"transformer": "resident-stable"}


def inputs(pipe: DemoPipeline) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 4, 8, 8, generator=g), torch.full((1,), 500.0),
            torch.randn(1, pipe.config.text_dim, generator=g))


def eager(module: nn.Module, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = module(*args)
    return out


def addresses(module: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (id(t), t.data_ptr()) for n, t in
            list(module.named_parameters()) + list(module.named_buffers())}


def driver(layer: Any, fail_at: int | None = None) -> SimVmm:
    """A simulated driver for ``layer``, as vmm_for makes it: on the simulated GPU the CUDA
    driver's ctypes code (CudaVmm) over a simulated libcuda of it, else the simulated driver
    itself; returns the simulated driver."""
    runtime = getattr(layer, "runtime", None)
    sim = SimVmm(runtime=runtime, fail_at=fail_at)
    layer.vmm = simulated_cuda_vmm(layer.device, runtime, sim) if runtime is not None else sim
    return sim


def simulated(vmm: VmmDriver) -> SimVmm:
    """The simulated driver behind ``vmm`` (vmm_for's)."""
    return vmm._lib.vmm if isinstance(vmm, CudaVmm) else vmm  # type: ignore[return-value]


def arena_of(ctl: LifecycleController) -> Any:
    return ctl._components["transformer"].strategy.store.arena


async def test_a_captured_forward_replays_bit_exact_over_100_sleeps_wakes_and_updates() -> None:
    pipe = DemoPipeline.build(1)
    tr = pipe.modules["transformer"]
    args = inputs(pipe)
    async with LifecycleController(residency=STABLE) as ctl:
        await ctl.attach(pipe)
        before = addresses(tr)
        graph = SimGraph(tr, getattr(ctl._layer, "runtime", None))
        assert torch.equal(graph.capture(*args), eager(tr, args))
        name = "x_proj.weight"
        state = {k: v.clone() for k, v in tr.state_dict().items()}  # the trainer's weights
        for i in range(100):
            discard = i % 10 == 9
            if i % 3 == 2:
                await ctl.sleep(components=["transformer"])  # a partial sleep
            else:
                await ctl.sleep(discard=["transformer"] if discard else False)
            assert arena_of(ctl).mapped is False
            await ctl.wake()
            state[name].view(-1)[i] += 1.0
            update = state if discard else {name: state[name]}  # discarded: every tensor
            assert (await ctl.update_weights_from_tensors(update, "transformer")).success
            assert addresses(tr) == before  # same tensors at the same addresses
            assert torch.equal(graph.replay(), eager(tr, args))
        assert arena_of(ctl).maps == 101
        assert torch.equal(dict(tr.named_parameters())[name], state[name])


async def test_the_report_counts_the_mapped_arena_and_nothing_while_asleep() -> None:
    pipe = DemoPipeline.build(1)
    async with LifecycleController(residency=STABLE) as ctl:
        await ctl.attach(pipe)
        arena = arena_of(ctl)
        placed = ctl.report().components["transformer"]
        assert placed.mode == "resident-stable"
        assert placed.device_bytes == arena.size >= placed.total_bytes
        assert arena.waste == arena.size - placed.total_bytes < arena.driver.granularity()
        await ctl.sleep()
        assert ctl.report().components["transformer"].device_bytes == 0
        assert simulated(ctl._layer.vmm).physical_bytes == 0


async def test_a_forward_while_asleep_is_refused_and_a_replay_on_unmapped_memory_is_fatal() -> None:
    pipe = DemoPipeline.build(1)
    tr = pipe.modules["transformer"]
    args = inputs(pipe)
    async with LifecycleController(residency=STABLE) as ctl:
        await ctl.attach(pipe)
        graph = SimGraph(tr, getattr(ctl._layer, "runtime", None))
        graph.capture(*args)
        await ctl.sleep()
        with pytest.raises(ComponentAsleep):
            eager(tr, args)
        with pytest.raises(GraphReplayFault, match="unmapped"):
            graph.replay()
        await ctl.wake()
        assert torch.equal(graph.replay(), eager(tr, args))


@pytest.mark.parametrize("mode", ["component-offload", "snapshot-offload"])
async def test_capture_is_refused_for_a_component_whose_weights_move(mode: str) -> None:
    pipe = DemoPipeline.build(1)
    async with LifecycleController(residency={"transformer": mode}) as ctl:
        await ctl.attach(pipe)
        async with ctl.use("transformer") as tr:
            graph = SimGraph(tr, getattr(ctl._layer, "runtime", None))
            with pytest.raises(UnsupportedCompute, match="capture"):
                graph.capture(*inputs(pipe))


async def test_a_graph_of_a_plain_resident_component_fails_its_replay_after_a_wake() -> None:
    """(Why the mode exists: an ordinary wake gives the weights new addresses.)"""
    pipe = DemoPipeline.build(1)
    tr = pipe.modules["transformer"]
    async with LifecycleController() as ctl:
        await ctl.attach(pipe)
        graph = SimGraph(tr, getattr(ctl._layer, "runtime", None))
        graph.capture(*inputs(pipe))
        await ctl.sleep()
        keep = [t.detach() for t in tr.parameters()]  # the old memory is not reused
        await ctl.wake()
        with pytest.raises(GraphReplayFault, match="re-homed"):
            graph.replay()
        del keep


async def test_detach_gives_the_tensors_back_to_ordinary_memory_and_frees_the_range() -> None:
    pipe = DemoPipeline.build(1)
    tr = pipe.modules["transformer"]
    args = inputs(pipe)
    ctl = LifecycleController(residency=STABLE)
    sim = driver(ctl._layer)
    expected = eager(tr, args)
    await ctl.attach(pipe)
    arena = arena_of(ctl)
    va, size = arena.va, arena.size
    assert all(arena.holds(t) for t in tr.parameters())
    await ctl.detach()
    await ctl.aclose()
    assert not any(va <= t.data_ptr() < va + size for t in tr.parameters())
    assert sim.log[-3:] == ["cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]
    assert sim.physical_bytes == 0
    assert torch.equal(eager(tr, args), expected)


async def test_a_residency_change_to_or_from_resident_stable_is_refused() -> None:
    pipe = DemoPipeline.build(1)
    async with LifecycleController(residency=STABLE) as ctl:
        await ctl.attach(pipe)
        with pytest.raises(ComponentResidencyError, match="resident-stable"):
            await ctl.set_residency({"transformer": "resident"})
        with pytest.raises(ComponentResidencyError, match="resident-stable"):
            await ctl.set_residency({"transformer": "resident-stable", "vae": "resident-stable"})
        assert ctl.report().components["transformer"].mode == "resident-stable"


# -- faults ----------------------------------------------------------------------------------
async def _started(target: str, layer: Any, fail_at: int | None
                   ) -> tuple[LifecycleController, DemoPipeline, SimVmm]:
    pipe = DemoPipeline.build(1)
    if target == "sleep":
        # A model built on the host gets its mirrors at attach (its first sleep then copies
        # nothing); one already on the device gets them at its first sleep, the moves faulted.
        layer.place(*pipe.modules.values())
    ctl = LifecycleController(residency=STABLE, device_layer=layer)
    sim = driver(layer)
    if target != "attach":
        await ctl.attach(pipe)
        if target == "wake":
            await ctl.sleep()
    sim.fail_at = None if fail_at is None else sim.calls + fail_at
    return ctl, pipe, sim


async def _run(target: str, ctl: LifecycleController, pipe: DemoPipeline) -> object:
    if target == "attach":
        return await ctl.attach(pipe)
    return await (ctl.wake() if target == "wake" else ctl.sleep())


@pytest.mark.parametrize("target", ["attach", "wake"])
async def test_a_fault_at_every_driver_call_of_a_mapping_rolls_back_and_a_retry_succeeds(
        target: str) -> None:
    probe = faulty_device()
    ctl, pipe, sim = await _started(target, probe, None)
    calls = sim.calls
    await _run(target, ctl, pipe)
    points = sim.calls - calls
    assert points >= 3  # create, map, set access
    await ctl.aclose()
    probe.close()
    args = inputs(pipe)
    expected = eager(pipe.modules["transformer"], args)
    for k in range(1, points + 1):
        layer = faulty_device()
        ctl, pipe, sim = await _started(target, layer, k)
        phase = ctl.phase
        with pytest.raises((TransitionFailed, VmmError)) as info:
            await _run(target, ctl, pipe)
        cause = info.value.cause if isinstance(info.value, TransitionFailed) else info.value
        assert isinstance(cause, VmmError) and cause.code == 2  # CUDA_ERROR_OUT_OF_MEMORY
        assert "out of memory" in str(cause)
        assert ctl.phase is phase
        assert sim.physical_bytes == 0  # nothing left mapped
        sim.fail_at = None
        await _run(target, ctl, pipe)
        assert ctl.phase is Phase.AWAKE
        assert torch.equal(eager(pipe.modules["transformer"], args), expected)
        await ctl.aclose()
        layer.close()


async def test_a_fault_releasing_the_arena_leaves_it_mapped_and_the_next_sleep_releases_it(
        ) -> None:
    layer = faulty_device()
    ctl, pipe, sim = await _started("sleep", layer, 1)  # cuMemUnmap
    tr = pipe.modules["transformer"]
    args = inputs(pipe)
    graph = SimGraph(tr, getattr(layer, "runtime", None))
    expected = graph.capture(*args)
    assert (await ctl.sleep()).success  # the sleep stands: every byte is on the host
    assert arena_of(ctl).mapped and sim.physical_bytes == arena_of(ctl).size
    assert ctl.report().components["transformer"].device_bytes == arena_of(ctl).size
    await ctl.wake()
    assert torch.equal(graph.replay(), expected)
    await ctl.sleep()
    assert sim.physical_bytes == 0
    await ctl.aclose()
    layer.close()


@pytest.mark.parametrize(("target", "kind"), [("wake", "copy"), ("sleep", "copy"),
                                             ("sleep", "alloc")])
async def test_a_fault_at_every_copy_and_allocation_rolls_back(target: str, kind: str) -> None:
    """(The first sleep allocates the host mirrors; a wake allocates nothing: the arena.)"""
    probe = faulty_device()
    ctl, pipe, _ = await _started(target, probe, None)
    copies, allocs = probe.copies, probe.allocations
    await _run(target, ctl, pipe)
    points = probe.copies - copies if kind == "copy" else probe.allocations - allocs
    assert points >= 1
    await ctl.aclose()
    probe.close()
    args = inputs(pipe)
    expected = eager(pipe.modules["transformer"], args)
    # One copy per tensor: the first, the second, one in the middle and the last two (each
    # storage's copy is alike; test_faults.py fails every one for the other modes).
    for k in sorted({1, 2, points // 2, points - 1, points} - {0}):
        layer = faulty_device()
        ctl, pipe, sim = await _started(target, layer, None)
        phase, mapped = ctl.phase, sim.physical_bytes
        graph = SimGraph(pipe.modules["transformer"], getattr(layer, "runtime", None))
        if phase is Phase.AWAKE:
            graph.capture(*args)
        layer.arm(**{f"{kind}_at": k})
        with pytest.raises(TransitionFailed) as info:
            await _run(target, ctl, pipe)
        assert isinstance(info.value.cause, InjectedFault)
        assert (ctl.phase, sim.physical_bytes) == (phase, mapped)
        if phase is Phase.AWAKE:
            assert torch.equal(graph.replay(), expected)
        await _run(target, ctl, pipe)
        await ctl.wake()
        assert torch.equal(eager(pipe.modules["transformer"], args), expected)
        await ctl.aclose()
        layer.close()
