"""Changing residency while attached: every pair of modes, only what must move, faults at
every point, while sleeping; and peak tracking against a counting layer (cancellation at
every point: test_cancellation.py)."""

from __future__ import annotations

import gc
import itertools
import weakref
from typing import Any

import anyio
import pytest
import torch

from lifecycle import (
    ComponentResidencyError,
    LifecycleController,
    Phase,
    TransitionFailed,
    TransitionRejected,
)
from lifecycle.demo import DemoPipeline
from lifecycle.testing import InjectedFault
from strategies import CpuDevice, ResidencyMode
from strategies.devices import Tier
from tests.helpers import faulty_device

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

MODES = ["resident", "component-offload", "snapshot-offload", "layerwise-offload"]
SIZE = 2 * 2**20


def _config(mode: str) -> str:
    return f"transformer={mode},text_encoder={mode}"


def _layout(ctl: LifecycleController) -> dict[str, Any]:
    """Everything a failed change must leave exactly as it was."""
    out: dict[str, Any] = {"phase": ctl.phase, "report": ctl.report().components}
    for name, _module in ctl.components.items():
        strategy = ctl.strategy(name)
        out[name] = (strategy.mode, id(strategy), id(strategy.store),
                     getattr(strategy, "tuning", None),
                     [(n, t.data_ptr(), t.device) for n, t in strategy.store.named_tensors()],
                     [(u.key, u.where, u.mirror_current) for u in strategy.store.units])
    return out


async def _attached(mode: str = "resident", layer: Any = None, size: int = SIZE
                    ) -> tuple[LifecycleController, DemoPipeline, torch.Tensor]:
    pipe = DemoPipeline.build(size)
    expected = pipe.forward_sync(steps=3)
    ctl = LifecycleController(device_layer=layer or CpuDevice(), residency=_config(mode))
    await ctl.attach(pipe)
    return ctl, pipe, expected


@pytest.mark.parametrize(("before", "after"), list(itertools.product(MODES, MODES)))
async def test_every_pair_of_modes_switches_while_awake_with_identical_outputs(
        before: str, after: str) -> None:
    """Switching two components from any mode to any mode while awake keeps outputs
    bit-identical and leaves each component placed as its new mode places it."""
    ctl, pipe, expected = await _attached(before)
    async with ctl:
        assert torch.equal(await pipe.generate(ctl=ctl), expected)
        change = await ctl.set_residency(_config(after))
        assert change.success
        for name in ("transformer", "text_encoder"):
            assert ctl.strategy(name).mode is ResidencyMode(after)
            placed = ctl.report().components[name]
            if after == "resident":
                assert placed.device_bytes == placed.total_bytes
            elif after in ("component-offload", "snapshot-offload"):
                assert placed.device_bytes == 0
            else:
                assert 0 < placed.device_bytes < placed.total_bytes
        assert torch.equal(await pipe.generate(ctl=ctl), expected)
        await ctl.sleep()
        await ctl.wake()
        assert torch.equal(await pipe.generate(ctl=ctl), expected)


async def test_a_change_moves_only_what_must_move() -> None:
    """A tuning-only change and a change between the two offload modes copy no byte, and a
    component whose residency stays is not touched at all."""
    ctl, pipe, expected = await _attached("layerwise-offload")
    async with ctl:
        vae_before = _layout(ctl)["vae"]
        change = await ctl.set_residency(ctl.config.parse(
            _config("layerwise-offload"), prefetch="transformer=2", resident_layers="transformer=1"))
        assert change.bytes_copied == 0 and set(change.changed) == {"transformer"}
        assert ctl.strategy("transformer").prefetch == 2  # type: ignore[attr-defined]
        await ctl.set_residency(_config("component-offload"))
        change = await ctl.set_residency(_config("snapshot-offload"))
        assert change.bytes_copied == 0
        assert _layout(ctl)["vae"] == vae_before
        assert torch.equal(await pipe.generate(ctl=ctl), expected)


@pytest.mark.parametrize("before", MODES)
async def test_a_change_while_sleeping_only_changes_what_wake_restores(before: str) -> None:
    """While sleeping nothing reaches the device; wake then places the new residency, with
    identical outputs."""
    after = "layerwise-offload" if before != "layerwise-offload" else "resident"
    ctl, pipe, expected = await _attached(before)
    async with ctl:
        await ctl.sleep()
        await ctl.set_residency(_config(after))
        assert ctl.phase is Phase.SLEEPING and ctl.report().device_bytes == 0
        await ctl.wake()
        assert ctl.strategy("transformer").mode is ResidencyMode(after)
        assert torch.equal(await pipe.generate(ctl=ctl), expected)


async def test_bad_residency_is_refused_before_anything_moves() -> None:
    """An unknown component, layerwise on a module without block lists and a change before
    attach are refused with typed errors, the layout untouched."""
    ctl, _pipe, _expected = await _attached()
    async with ctl:
        before = _layout(ctl)
        with pytest.raises(ValueError, match="matches no component"):
            await ctl.set_residency("transformr=component-offload")
        with pytest.raises(ComponentResidencyError, match="vae"):
            await ctl.set_residency("vae=layerwise-offload")
        assert _layout(ctl) == before
        await ctl.aclose()
        with pytest.raises(TransitionRejected, match="not initialized"):
            await ctl.set_residency("all=resident")


# Every ordered pair of different modes, awake; and every change to or from resident asleep.
CHANGES = [(a, b, False) for a, b in itertools.permutations(MODES, 2)] + \
    [(a, b, True) for a, b in itertools.permutations(MODES, 2) if "resident" in (a, b)]


@pytest.mark.parametrize(("before", "after", "sleeping"), CHANGES)
async def test_a_fault_at_any_allocation_or_copy_leaves_the_old_layout(
        before: str, after: str, sleeping: bool) -> None:
    """A fault injected at every allocation and every copy of a change between any two modes
    (awake, and asleep to or from resident) fails it with TransitionFailed and leaves the old
    layout exactly (strategies, tensors' addresses, report, outputs); the change then
    succeeds on the same controller."""
    layer = faulty_device()
    ctl, pipe, expected = await _attached(before, layer)
    async with ctl:
        if sleeping:
            await ctl.sleep()
        before_layout = _layout(ctl)
        # A probe run on a twin controller counts the change's allocations and copies.
        probe = faulty_device()
        twin, _, _ = await _attached(before, probe)
        async with twin:
            if sleeping:
                await twin.sleep()
            a0, c0 = probe.allocations, probe.copies
            await twin.set_residency(_config(after))
            allocs, copies = probe.allocations - a0, probe.copies - c0
        if {before, after} == {"component-offload", "snapshot-offload"}:
            assert allocs == copies == 0  # the same grouping: nothing moves, nothing can fail
        else:
            assert allocs and copies
        points = [("alloc", k) for k in range(1, allocs + 1)] + \
            [("copy", k) for k in range(1, copies + 1)]
        for i, (kind, k) in enumerate(points):
            if kind == "alloc":
                layer.fail_alloc_at = layer.allocations + k
            else:
                layer.fail_copy_at = layer.copies + k
            with pytest.raises(TransitionFailed) as info:
                await ctl.set_residency(_config(after))
            layer.fail_alloc_at = layer.fail_copy_at = None
            assert isinstance(info.value.cause, InjectedFault), (kind, k)
            assert _layout(ctl) == before_layout, (kind, k)
            if not sleeping and i % 8 == 0:  # the layout check above is exact; outputs too, often
                assert torch.equal(await pipe.generate(ctl=ctl), expected), (kind, k)
                assert _layout(ctl) == before_layout
        await ctl.set_residency(_config(after))
        if sleeping:
            await ctl.wake()
        assert torch.equal(await pipe.generate(ctl=ctl), expected)


async def test_a_change_waits_for_uses_in_flight() -> None:
    """A change drains uses like any transition: a use in progress finishes on the old
    layout, the change lands after it."""
    ctl, pipe, expected = await _attached()
    async with ctl:
        order = []
        async with anyio.create_task_group() as tg:
            async def use() -> None:
                async with ctl.use("transformer"):
                    order.append("use starts")
                    await anyio.sleep(0.05)
                    order.append("use ends")

            tg.start_soon(use)
            await anyio.sleep(0.01)
            await ctl.set_residency(_config("component-offload"))
            order.append("changed")
        assert order == ["use starts", "use ends", "changed"]
        assert torch.equal(await pipe.generate(ctl=ctl), expected)


class CountingDevice(CpuDevice):
    """Counts device bytes its own way: at every allocation and copy, the bytes of every
    device buffer it handed out whose storage is still alive (weak references); keeps the
    maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[weakref.ref[torch.UntypedStorage]] = []
        self.max_seen = 0

    def _alloc(self, nbytes: int, tier: Tier, pinned: bool) -> torch.Tensor:
        buf = super()._alloc(nbytes, tier, pinned)
        if tier == "device":
            self.buffers.append(weakref.ref(buf.untyped_storage()))
        self.sample(extra=0)
        return buf

    def _copy_one(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.sample(extra=0)
        super()._copy_one(dst, src)

    def sample(self, extra: int) -> None:
        live = sum(s.nbytes() for r in self.buffers if (s := r()) is not None)
        self.max_seen = max(self.max_seen, live + extra)


@pytest.mark.parametrize("mode", ["component-offload", "layerwise-offload"])
async def test_peak_device_bytes_matches_a_counting_device_layer(mode: str) -> None:
    """report().peak_device_bytes equals the high-water mark a counting layer sees over
    generations, sleeps, wakes and changes (copies in flight included), and reset_peak
    starts it again from what is held now."""
    layer = CountingDevice()
    pipe = DemoPipeline.build(SIZE)
    async with LifecycleController(device_layer=layer, residency=_config(mode)) as ctl:
        await ctl.attach(pipe)
        await ctl.sleep()  # from here on, every device byte is a buffer the layer allocated
        await ctl.wake()
        ctl.reset_peak()
        layer.max_seen = 0
        layer.sample(extra=0)
        assert layer.max_seen == ctl.report().peak_device_bytes
        await pipe.generate(ctl=ctl)
        await ctl.sleep()
        await ctl.wake()
        await pipe.generate(ctl=ctl)
        await ctl.set_residency("all=resident")
        await pipe.generate(ctl=ctl)
        layer.sample(extra=0)
        peak = ctl.report().peak_device_bytes
        assert peak == layer.max_seen
        ctl.reset_peak()
        assert ctl.report().peak_device_bytes == layer.held_bytes == ctl.report().device_bytes


async def test_peak_counts_a_resident_pipeline_and_falls_to_what_is_held_after_sleep() -> None:
    """A resident pipeline's peak is its size from attach; after a sleep and reset_peak the
    peak is zero, and a wake brings it back to the size."""
    pipe = DemoPipeline.build(SIZE)
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        size = ctl.report().device_bytes
        assert ctl.report().peak_device_bytes == size
        await ctl.sleep()
        ctl.reset_peak()
        assert ctl.report().peak_device_bytes == 0
        await ctl.wake()
        assert ctl.report().peak_device_bytes == size
        if ctl.device_layer.memory_allocated() is None:  # the CPU layers: no allocator statistics
            assert ctl.report().allocator_peak_bytes is None
        else:  # the CUDA layer: the allocator's blocks hold the pipeline (rounded up)
            allocator_peak = ctl.report().allocator_peak_bytes
            assert allocator_peak is not None and allocator_peak >= size


@pytest.mark.parametrize("after", ["component-offload", "layerwise-offload"])
async def test_a_change_frees_the_old_store_and_its_guard_notes_the_new_one(after: str) -> None:
    """After a change the old store (and the host mirrors it holds) is garbage: the
    component's forward guard tells the new store of training forwards, not the old one
    (it kept the old store alive, and noted training forwards where nobody looked)."""
    ctl, _, _ = await _attached()
    await ctl.sleep()
    await ctl.wake()  # the resident components now hold host mirrors
    old = weakref.ref(ctl.strategy("transformer").store)
    await ctl.set_residency(f"transformer={after}")
    gc.collect()
    assert old() is None
    guard = ctl._components["transformer"].guard
    assert guard is not None
    assert getattr(guard.on_training_forward, "__self__", None) is ctl.strategy("transformer").store
    await ctl.aclose()
