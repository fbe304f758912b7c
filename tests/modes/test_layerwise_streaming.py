"""Layerwise offload: bit-identical outputs within the device-byte bound, blocks run
out of order or skipped, resident layers, faults while streaming."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController, TransitionFailed
from lifecycle.testing import InjectedFault
from strategies import (
    enable_layerwise_offload,
)
from tests.helpers import faulty_device
from tests.modes.strategy_suite import (
    DIM,
    LAYER_BYTES,
    NONLAYER_BYTES,
    TrackingDevice,
    TwoLists,
    _one_intra_op_thread,  # noqa: F401 (an autouse fixture)
    attach_layerwise,
    copied_in_bytes,
    device_layers,
    layerwise_config,
    sample_device_bytes,
    x_in,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


# (prefetch, resident_layers, policy) -> (resolved prefetch count, resident indices) for 6 layers
TUNINGS: dict[tuple[float, float, str], tuple[int, tuple[int, ...]]] = {
    (0.0, 0.0, "leading"): (0, ()),  # no read-ahead: one layer at a time
    (0.0, 2.0, "first_last"): (0, (0, 5)),
    (1.0, 0.0, "first_last"): (1, (0, 5)),
    (2.0, 3.0, "first_last"): (2, (0, 1, 5)),
    (1.0, 0.0, "leading"): (1, ()),
    (2.0, 0.0, "strided"): (2, ()),
    (3.0, 0.25, "leading"): (3, (0, 1)),
    (0.2, 0.25, "strided"): (2, (1, 5)),
    (1.0, 2.0, "leading"): (1, (0, 1)),
    (2.0, 3.0, "strided"): (2, (1, 3, 5)),
}


@pytest.mark.parametrize(("tuning", "resolved"), list(TUNINGS.items()), ids=str)
async def test_layerwise_outputs_are_bit_identical_to_resident_and_peak_is_bounded(
        tuning: tuple[float, float, str], resolved: tuple[int, tuple[int, ...]]) -> None:
    """Under no_grad and inference_mode, inside and outside use(), every output equals the
    resident copy's and the device never holds more than non-layer + (r + p + 1) layers."""
    ctl, model, reference, strategy = await attach_layerwise(layerwise_config(*tuning))
    prefetch, resident = resolved
    assert (strategy.prefetch, tuple(sorted(strategy.resident))) == resolved
    bound = NONLAYER_BYTES + (len(resident) + prefetch + 1) * LAYER_BYTES
    assert strategy.peak_bound() == bound
    assert ctl.report().components["transformer"].device_bytes == NONLAYER_BYTES
    samples = sample_device_bytes(ctl, model)
    x = x_in()
    for grad_mode in (torch.no_grad, torch.inference_mode):
        with grad_mode():
            expected = reference(x)
            assert torch.equal(model(x), expected)
            async with ctl.use("transformer"):
                for _ in range(3):
                    assert torch.equal(model(x), expected)
            assert torch.equal(model(x), expected)
        assert ctl.report().components["transformer"].device_bytes == NONLAYER_BYTES
    assert len(samples) == 2 * 5 * 6
    assert NONLAYER_BYTES + LAYER_BYTES <= max(samples) <= bound


@pytest.mark.parametrize(("tuning", "resolved"), list(TUNINGS.items()), ids=str)
async def test_layerwise_allocated_device_bytes_stay_within_the_bound(
        tuning: tuple[float, float, str], resolved: tuple[int, tuple[int, ...]]) -> None:
    """Counting every device buffer the layer allocates (prefetches in flight included), at
    most resident + prefetch + 1 layers are alive at once beside the non-layer weights it
    holds, and none after a use, whatever order the blocks run in."""
    layer = TrackingDevice()
    ctl, model, reference, _ = await attach_layerwise(layerwise_config(*tuning), n=6, layer=layer)
    # The non-layer weights, in buffers of the layer's when the model was in host memory.
    held = copied_in_bytes(layer, reference.inp, reference.out)
    assert held in (0, NONLAYER_BYTES)
    prefetch, resident = resolved
    x = x_in()
    with torch.inference_mode():
        for call in range(3):
            assert torch.equal(model(x, permuted_order(6, call)), reference(x, permuted_order(6, call)))
        async with ctl.use("transformer"):
            for call in range(3):
                assert torch.equal(model(x), reference(x))
                assert torch.equal(model(x, even_order(6, call)), reference(x, even_order(6, call)))
    assert layer.live == held
    assert held + LAYER_BYTES <= layer.peak <= held + (len(resident) + prefetch + 1) * LAYER_BYTES


def reversed_order(n: int, call: int) -> list[int]:
    return list(range(n - 1, -1, -1))


def even_order(n: int, call: int) -> list[int]:
    return list(range(0, n, 2))


def permuted_order(n: int, call: int) -> list[int]:
    order = list(range(n))
    random.Random(call).shuffle(order)
    return order


@pytest.mark.parametrize("order", [reversed_order, even_order, permuted_order])
@pytest.mark.parametrize("tuning", [(1.0, 0.0, "leading"), (2.0, 0.25, "strided"), (2.0, 2.0, "leading")],
                         ids=str)
async def test_layerwise_handles_blocks_run_out_of_order_or_skipped(
        order: Callable[[int, int], list[int]], tuning: tuple[float, float, str]) -> None:
    """Reversed, skipped or shuffled blocks still give the resident outputs within the bound."""
    ctl, model, reference, strategy = await attach_layerwise(layerwise_config(*tuning), n=8)
    samples = sample_device_bytes(ctl, model)
    x = x_in()
    with torch.inference_mode():
        for call in range(4):
            blocks = order(8, call)
            assert torch.equal(model(x, blocks), reference(x, blocks))
        async with ctl.use("transformer"):
            for call in range(4, 10):
                blocks = order(8, call)
                assert torch.equal(model(x, blocks), reference(x, blocks))
    assert max(samples) <= strategy.peak_bound()
    assert ctl.report().components["transformer"].device_bytes == NONLAYER_BYTES


@pytest.mark.parametrize(("policy", "resident", "first_window"), [
    ("leading", {0, 1}, {2}),
    ("strided", {2, 6}, {0}),
])
async def test_layers_chosen_by_the_policy_stay_on_device_for_the_whole_use(
        policy: str, resident: set[int], first_window: set[int]) -> None:
    """Resident layers (leading: the first r; strided: spread out) stay in between forwards;
    every streamed layer is released after it ran."""
    ctl, model, reference, strategy = await attach_layerwise(layerwise_config(1.0, 0.25, policy), n=8)
    assert set(strategy.resident) == resident
    x = x_in()
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert device_layers(strategy) == resident | first_window
            for _ in range(3):
                assert torch.equal(model(x), reference(x))
                assert device_layers(strategy) == resident
                # Plus the next pass's first layer, prefetched while the last one ran.
                assert ctl.report().components["transformer"].device_bytes == (
                    NONLAYER_BYTES + (len(resident) + strategy.prefetch) * LAYER_BYTES)
    assert device_layers(strategy) == set()


async def test_layerwise_recovers_from_a_block_that_raises_mid_forward() -> None:
    """A forward that raises inside a block releases its layers; the next one is exact."""
    ctl, model, reference, strategy = await attach_layerwise(layerwise_config(2.0, 0.0))

    def boom(module: nn.Module, args: tuple[object, ...]) -> None:
        raise RuntimeError("boom")

    handle = model.get_submodule("blocks.3.fc1").register_forward_pre_hook(boom)
    with torch.no_grad():
        async with ctl.use("transformer"):
            with pytest.raises(RuntimeError, match=r"^boom$"):
                model(x_in())
            handle.remove()
            assert torch.equal(model(x_in()), reference(x_in()))
    assert device_layers(strategy) == set()
    assert ctl.report().components["transformer"].device_bytes == NONLAYER_BYTES


@pytest.mark.parametrize("kind", ["copy", "alloc"])
async def test_layerwise_fault_while_placing_a_use_is_rolled_back(kind: str) -> None:
    """A failed move-in of the resident layers raises TransitionFailed and changes nothing;
    the next use is placed and exact."""
    layer = faulty_device()
    ctl, model, reference, strategy = await attach_layerwise(layerwise_config(1.0, 2.0), layer=layer)
    before = ctl.report().components["transformer"]
    layer.arm(**{f"{kind}_at": 2})
    with pytest.raises(TransitionFailed):
        async with ctl.use("transformer"):
            pytest.fail("the use body ran although placement failed")
    assert ctl.report().components["transformer"] == before
    assert (device_layers(strategy), ctl.in_flight) == (set(), 0)
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert device_layers(strategy) == {0, 1, 2}
            assert torch.equal(model(x_in()), reference(x_in()))
    assert ctl.report().components["transformer"] == before


@pytest.mark.parametrize("k", [1, 2, 3])
async def test_layerwise_copy_fault_inside_a_forward_fails_that_forward_only(k: int) -> None:
    """A layer fetch that fails raises out of the forward; the next forward is exact and the
    use ends with only non-layer bytes on the device."""
    layer = faulty_device()
    ctl, model, reference, strategy = await attach_layerwise(layerwise_config(1.0, 0.0), layer=layer)
    with torch.no_grad():
        async with ctl.use("transformer"):
            layer.arm(copy_at=k)
            with pytest.raises(InjectedFault):
                model(x_in())
            assert layer.faults == 1
            assert torch.equal(model(x_in()), reference(x_in()))
    assert device_layers(strategy) == set()
    assert ctl.report().components["transformer"].device_bytes == NONLAYER_BYTES


async def test_layerwise_streams_every_listed_block_list() -> None:
    """A module with two explicitly named block lists streams both, bit-identically."""
    torch.manual_seed(0)
    module = TwoLists()
    reference = copy.deepcopy(module)
    enable_layerwise_offload(module, ["encoder.layers", "decoder.layers"])
    ctl = LifecycleController(device_layer=faulty_device(), residency="transformer=layerwise-offload")
    await ctl.attach({"transformer": module})
    assert ctl.report().components["transformer"].device_bytes == (DIM * DIM + DIM) * 4
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert torch.equal(module(x_in()), reference(x_in()))
    assert ctl.report().components["transformer"].device_bytes == (DIM * DIM + DIM) * 4


async def test_a_layer_written_during_its_forward_is_copied_back_before_its_copy_is_read() -> None:
    """A layer whose weights a forward wrote in place (a hook adding to a bias: its version
    moved) is copied back to its host copy when evicted, and the host waits for that copy
    before the layer points at it: the next forwards read the written weights, and so do
    a sleep and a wake."""
    ctl, model, reference, _ = await attach_layerwise(layerwise_config(1.0, 0.0))

    def write(block: nn.Module, args: tuple[object, ...]) -> None:
        with torch.no_grad():
            block.fc1.bias.add_(0.5)  # type: ignore[union-attr, operator]

    for m in (model, reference):
        m.blocks[2].register_forward_pre_hook(write)
    x = x_in()
    async with ctl:
        for _ in range(3):
            with torch.no_grad():
                async with ctl.use("transformer"):
                    assert torch.equal(model(x), reference(x))
        assert (await ctl.sleep()).success and (await ctl.wake()).success
        for (name, got), want in zip(model.state_dict().items(),
                                     reference.state_dict().values(), strict=True):
            assert torch.equal(got, want), name
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
