"""Resident, component-offload and snapshot-offload: where a component is around its
uses, what is copied back, forwards outside a use (concurrent uses: test_concurrent_uses.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lifecycle import ComponentNotPlaced, LifecycleController
from tests.helpers import faulty_device, small_pipeline
from tests.modes.strategy_suite import (
    OFFLOADED_TRANSFORMER_BYTES,
    Counting,
    _one_intra_op_thread,  # noqa: F401 (an autouse fixture)
    x_in,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


async def test_resident_stays_on_device_and_nothing_moves_around_a_use() -> None:
    """A resident component is wholly on the device while awake; a use copies nothing."""
    layer = faulty_device()
    model = Counting()
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach({"transformer": model})
    placed = ctl.report().components["transformer"]
    assert (placed.mode, placed.device_bytes, placed.total_bytes) == ("resident", 2176, 2176)
    before = (layer.copies, layer.allocations)
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert ctl.report().components["transformer"] == placed
            model(x_in())
    assert ctl.report().components["transformer"] == placed
    assert (layer.copies, layer.allocations) == before


@pytest.mark.parametrize("mode", ["component-offload", "snapshot-offload"])
async def test_offload_places_the_component_only_for_the_duration_of_a_use(mode: str) -> None:
    """Between uses no byte is on the device; during a use every byte is."""
    torch.manual_seed(0)
    pipe = small_pipeline()
    reference = copy.deepcopy(pipe["transformer"])
    ctl = LifecycleController(device_layer=faulty_device(), residency=f"transformer={mode}")
    await ctl.attach(pipe)

    def device() -> int:
        return ctl.report().components["transformer"].device_bytes

    assert device() == 0
    for _ in range(2):
        async with ctl.use("transformer") as module:
            assert device() == OFFLOADED_TRANSFORMER_BYTES
            with torch.no_grad():
                assert torch.equal(module(x_in(2)), reference(x_in(2)))
        assert device() == 0
    assert ctl.report().components["transformer"].mode == mode


async def test_component_offload_repeated_use_copies_nothing_back_when_unchanged() -> None:
    """A use cycle of unchanged weights copies each tensor in once and nothing out."""
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer, residency="transformer=component-offload")
    await ctl.attach(small_pipeline())
    for _ in range(3):
        start = layer.copies
        async with ctl.use("transformer") as module:
            moved_in = layer.copies - start
            with torch.no_grad():
                module(x_in(2))
            inside = layer.copies
        assert (moved_in, layer.copies - inside) == (1, 0)  # one buffer, one copy


async def test_component_offload_copies_back_a_weight_changed_during_a_use() -> None:
    """An in-place change made during a use is copied back (that tensor only) and persists."""
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer, residency="transformer=component-offload")
    pipe = small_pipeline()
    await ctl.attach(pipe)
    weight = pipe["transformer"].get_parameter("0.weight")
    expected = weight.detach().clone() + 1.0
    async with ctl.use("transformer"):
        with torch.no_grad():
            weight.add_(1.0)
        inside = layer.copies
    assert layer.copies - inside == 1
    assert ctl.report().components["transformer"].device_bytes == 0
    assert torch.equal(weight.detach(), expected)
    async with ctl.use("transformer"):
        assert torch.equal(weight.detach(), expected)
    assert torch.equal(weight.detach(), expected)


async def test_snapshot_offload_discards_changes_made_during_a_use() -> None:
    """The kept host copy is the truth: in-place changes vanish at the end of the use,
    without any copy back, and the next use computes with the original weights."""
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer, residency="transformer=snapshot-offload")
    pipe = small_pipeline()
    reference = copy.deepcopy(pipe["transformer"])
    await ctl.attach(pipe)
    weight = pipe["transformer"].get_parameter("0.weight")
    original = weight.detach().clone()
    async with ctl.use("transformer"):
        with torch.no_grad():
            weight.add_(1.0)
        assert torch.equal(weight.detach(), original + 1.0)
        inside = layer.copies
    assert layer.copies - inside == 0
    assert torch.equal(weight.detach(), original)
    async with ctl.use("transformer") as module:
        assert torch.equal(weight.detach(), original)
        with torch.no_grad():
            assert torch.equal(module(x_in(2)), reference(x_in(2)))


async def test_component_offload_keeps_batch_norm_statistics_updated_during_a_use() -> None:
    """Running statistics a training-mode forward writes during a use survive the move out."""
    torch.manual_seed(0)
    vae = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)).train()
    reference = copy.deepcopy(vae)
    ctl = LifecycleController(device_layer=faulty_device(), residency="vae=component-offload")
    await ctl.attach({"vae": vae})
    z = torch.linspace(-1, 1, 2 * 4 * 25).reshape(2, 4, 5, 5)
    with torch.no_grad():
        for _ in range(2):
            async with ctl.use("vae"):
                vae(z)
            reference(z)
    assert ctl.report().components["vae"].device_bytes == 0
    for name in ("1.running_mean", "1.running_var"):
        assert torch.equal(vae.get_buffer(name), reference.get_buffer(name))
    assert int(vae.get_buffer("1.num_batches_tracked")) == 2


@pytest.mark.parametrize("mode", ["component-offload", "snapshot-offload"])
async def test_forward_of_an_offloaded_component_outside_use_is_refused_and_never_runs(
        mode: str) -> None:
    """Outside use() the weights are on the host: the forward raises, naming the component."""
    model = Counting()
    ctl = LifecycleController(device_layer=faulty_device(), residency=f"text_encoder={mode}")
    await ctl.attach({"text_encoder": model})
    with pytest.raises(ComponentNotPlaced) as info:
        model(x_in())
    assert info.value.component == "text_encoder"
    assert info.value.mode == mode
    assert str(info.value) == (f"component 'text_encoder' is {mode}: its weights are on the host "
                               "between uses; run it inside `async with ctl.use('text_encoder')`")
    assert model.calls == 0
    async with ctl.use("text_encoder"):
        model(x_in())
    assert model.calls == 1
