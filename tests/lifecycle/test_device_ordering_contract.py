"""The contract between the controller and a device layer that runs behind the host (CUDA),
checked on CPU with layers that record what they are asked: every transition waits for the
device after draining and before moving; every moved-in buffer is handed to compute; a
dirty evict waits on its own copy only; forwards where moves cannot be ordered are refused;
a request prefetch leaves headroom for the running component."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

from lifecycle import LifecycleController, UnsupportedCompute
from lifecycle.demo import DemoPipeline
from strategies import CopyHandle, CpuDevice
from strategies.devices import CopyPair, Tier

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


class RecordingDevice(CpuDevice):
    """A CPU layer that says it runs behind the host, and records the calls it gets."""

    needs_sync = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.refuse = False
        self.free: int | None = None
        self.handles: list[Any] = []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def for_compute(self, buf: torch.Tensor) -> None:
        self.calls.append("for_compute")

    def check_compute(self) -> None:
        self.calls.append("check_compute")
        if self.refuse:
            raise UnsupportedCompute("refused by the test layer")

    def free_bytes(self) -> int | None:
        return self.free

    async def copy(self, pairs: Sequence[CopyPair], to: Tier) -> None:
        self.calls.append(f"copy to {to}")
        await super().copy(pairs, to)

    def start_copy(self, pairs: Sequence[CopyPair], to: Tier) -> CopyHandle:
        handle = super().start_copy(pairs, to)
        layer = self

        class Recorded:
            def wait(self) -> None:
                layer.calls.append(f"wait {to}")
                handle.wait()

            def wait_host(self) -> None:
                layer.calls.append(f"wait_host {to}")
                handle.wait_host()

            def drop(self) -> None:
                layer.calls.append(f"drop {to}")
                handle.drop()

        return Recorded()


async def _attached(residency: str, layer: RecordingDevice
                    ) -> tuple[LifecycleController, DemoPipeline, torch.Tensor]:
    pipe = DemoPipeline.build(2**20)
    expected = pipe.forward_sync(steps=3)
    ctl = LifecycleController(device_layer=layer, residency=residency)
    await ctl.attach(pipe)
    return ctl, pipe, expected


async def test_every_transition_waits_for_the_device_before_it_moves() -> None:
    """Sleep, wake, an update, a residency change and detach each synchronize the device
    after draining and before their first copy."""
    layer = RecordingDevice()
    ctl, _, _ = await _attached("transformer=component-offload", layer)
    async with ctl:
        name, tensor = ctl.strategy("vae").store.named_tensors()[0]
        for call in (ctl.sleep, ctl.wake,
                     lambda: ctl.update_weights_from_tensors({name: tensor.detach().clone()}, "vae"),
                     lambda: ctl.set_residency("transformer=resident"), ctl.detach):
            layer.calls.clear()
            await call()
            moves = [c for c in layer.calls if c.startswith("copy")]
            assert layer.calls.count("synchronize") == 1, layer.calls
            if moves:
                assert layer.calls.index("synchronize") < layer.calls.index(moves[0])


async def test_every_buffer_moved_in_is_handed_to_compute() -> None:
    """Each unit a wake or a use brings to the device is handed to compute (CUDA: recorded
    on the compute stream) once per placement."""
    layer = RecordingDevice()
    ctl, pipe, expected = await _attached("transformer=layerwise-offload", layer)
    async with ctl:
        await ctl.sleep()
        layer.calls.clear()
        await ctl.wake()
        placed = sum(1 for u in ctl.strategy("text_encoder").store.units) + \
            sum(1 for u in ctl.strategy("vae").store.units) + \
            len(ctl.strategy("transformer").awake_units())
        assert layer.calls.count("for_compute") == placed
        layer.calls.clear()
        assert torch.equal(await pipe.generate(ctl=ctl), expected)
        fetched = ctl.strategy("transformer").fetched  # type: ignore[attr-defined]
        assert layer.calls.count("for_compute") >= fetched > 0


async def test_a_dirty_evict_waits_on_its_own_copy_not_the_device() -> None:
    """A layer changed during a use is copied back on eviction with a host wait on that
    copy alone; the device is not synchronized in the hook."""
    layer = RecordingDevice()
    ctl, _, _ = await _attached("transformer=layerwise-offload", layer)
    async with ctl:
        layer.calls.clear()
        async with ctl.use("transformer") as dit:
            block = dit.get_submodule("blocks.0")
            with torch.no_grad():
                next(block.parameters()).add_(1.0)  # tracked by the version counter: dirty
        assert "wait_host host" in layer.calls
        assert "synchronize" not in layer.calls


@pytest.mark.parametrize("mode", ["snapshot-offload", "layerwise-offload", "component-offload"])
async def test_a_forward_where_moves_cannot_be_ordered_is_refused_and_changes_nothing(
        mode: str) -> None:
    """When the layer refuses compute (CUDA graph capture, a non-default stream), a forward
    of a component whose weights move around its forwards raises UnsupportedCompute before
    any layer moves, and the next forward that may run computes exactly (a resident one is
    not refused: tests/strategies/test_cuda_layer.py)."""
    layer = RecordingDevice()
    ctl, pipe, expected = await _attached(f"transformer={mode}", layer)
    async with ctl:
        before = ctl.report()
        layer.refuse = True
        with pytest.raises(UnsupportedCompute):
            await pipe.generate(ctl=ctl)
        assert ctl.report() == before
        layer.refuse = False
        assert torch.equal(await pipe.generate(ctl=ctl), expected)


async def test_a_request_prefetch_leaves_headroom_for_the_running_component() -> None:
    """The next component is prefetched only when the device has its bytes plus the
    headroom free; with less, it is moved in at its own use instead."""
    for free, prefetched in ((None, True), (2**40, True), (2**20, False)):
        layer = RecordingDevice()
        pipe = DemoPipeline.build(2**20)
        async with LifecycleController(device_layer=layer, residency="all=component-offload",
                                       prefetch_headroom=2**30) as ctl:
            await ctl.attach(pipe)
            layer.free = free
            moved_early = []
            async with ctl.request(["text_encoder", "vae"]):
                async with ctl.use("text_encoder"):
                    for _ in range(50):
                        await anyio.sleep(0.001)
                    moved_early.append(ctl.report().components["vae"].device_bytes > 0)
                async with ctl.use("vae"):
                    pass
            assert moved_early == [prefetched], free


async def test_a_request_whose_body_raises_returns_every_prefetch_lease() -> None:
    """When a use inside a request raises while the next component's prefetch is scheduled
    or copying, the prefetch is dropped and its lease returned: a later drain does not wait."""
    for delay in (0.0, 0.002, 0.02):
        pipe = DemoPipeline.build(2**20)
        async with LifecycleController("cpu", residency="all=component-offload", drain_timeout=2.0) as ctl:
            await ctl.attach(pipe)
            with pytest.raises(RuntimeError, match="boom"):
                async with ctl.request(["text_encoder", "transformer"]), ctl.use("text_encoder"):
                    await anyio.sleep(delay)
                    raise RuntimeError("boom")
            assert ctl.in_flight == 0
            await ctl.sleep()  # drains at once


async def test_writes_into_device_placed_tensors_travel_the_device_stream() -> None:
    """An update's copies into tensors placed on the device are device-stream copies, and
    an offloaded component's update makes none, as on CUDA, although the CPU stand-in's
    device tier is CPU memory too."""
    layer = RecordingDevice()
    ctl, _, _ = await _attached("transformer=component-offload", layer)
    async with ctl:
        for name, on_device in (("vae", True), ("transformer", False)):
            state = {n: t.detach().clone() for n, t in ctl.strategy(name).store.named_tensors()}
            layer.calls.clear()
            assert (await ctl.update_weights_from_tensors(state, name)).success
            assert ("copy to device" in layer.calls) is on_device, (name, layer.calls)
