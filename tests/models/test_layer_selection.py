"""Layerwise streaming on real diffusers and transformers models: ``prefetch=0`` streams one
layer at a time (no read-ahead), and the resident layers can be the first and the last
(diffusers' ``pin_groups="first_last"``) or those a callable over (index, name, bytes)
picks (diffusers' callable ``pin_groups``); a policy that cannot pick is refused before
anything moves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lifecycle import ComponentResidencyError, LifecycleController, Phase
from strategies import LayerwiseOffloadStrategy, ResidencyConfig, is_layerwise_offloaded
from tests.helpers import attach_allocates
from tests.models.zoo import CASES, build_deep
from tests.modes.strategy_suite import TrackingDevice

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

FLUX = CASES["flux"]


def layerwise(prefetch: float = 1.0, resident: float = 0.0, policy: object = "leading"
              ) -> ResidencyConfig:
    return ResidencyConfig.parse("transformer=layerwise-offload", prefetch={"transformer": prefetch},
                                 resident_layers={"transformer": resident},
                                 policy={"transformer": policy})


def flux() -> nn.Module:
    return build_deep("flux", 3)  # 3 double blocks, 6 single ones: two sizes of layer


async def served(config: ResidencyConfig, layer: TrackingDevice | None = None,
                 model: nn.Module | None = None
                 ) -> tuple[LifecycleController, nn.Module, nn.Module, LayerwiseOffloadStrategy]:
    model = model or flux()
    reference = copy.deepcopy(model)
    ctl = LifecycleController(device_layer=layer or TrackingDevice(), residency=config)
    await ctl.attach({"transformer": model})
    strategy = ctl.strategy("transformer")
    assert isinstance(strategy, LayerwiseOffloadStrategy)
    return ctl, model, reference, strategy


def on_device(strategy: LayerwiseOffloadStrategy) -> list[str]:
    return [key for (key, _), u in zip(strategy.layers, strategy.units, strict=True)
            if u is not None and u.where == "device"]


async def test_prefetch_zero_holds_exactly_the_running_layer_with_no_read_ahead() -> None:
    """With prefetch 0 each layer is copied when its forward starts and is the only streamed
    layer on the device then (sampled at every layer), the output is the resident model's,
    and the layer's peak is non-layer + 1 x largest layer (SGLang's layerwise offload reads
    at least one layer ahead: test_layerwise_offload.py)."""
    layer = TrackingDevice()
    ctl, model, reference, strategy = await served(layerwise(prefetch=0), layer)
    assert (strategy.prefetch, strategy.resident) == (0, frozenset())
    idle = ctl.report().components["transformer"].device_bytes
    sizes = {key: u.nbytes for (key, _), u in zip(strategy.layers, strategy.units, strict=True)
             if u is not None}
    seen: list[tuple[list[str], int]] = []
    for _, block in strategy.layers:
        block.register_forward_pre_hook(
            lambda m, a: seen.append((on_device(strategy),
                                      ctl.report().components["transformer"].device_bytes)))
    async with ctl.use("transformer"):
        assert torch.equal(FLUX.run(model), FLUX.run(reference))
    keys = [key for key, _ in strategy.layers]
    assert [s[0] for s in seen] == [[key] for key in keys]
    assert [s[1] for s in seen] == [idle + sizes[key] for key in keys]
    assert strategy.fetched == 9  # each layer once: nothing read ahead, nothing wasted
    assert strategy.peak_bound() == idle + max(sizes.values())
    assert layer.peak <= strategy.peak_bound()
    assert on_device(strategy) == []


async def test_prefetch_one_holds_two_layers_at_once_where_zero_holds_one() -> None:
    """The same pass with prefetch 1 copies the next layer while one runs, so the layer
    buffers it allocates at once pass the largest layer, which prefetch 0 never does; the
    bounds differ by one largest layer."""
    peaks = {}
    for prefetch in (0, 1):
        layer, model = TrackingDevice(), flux()
        # (the non-layer weights are in the layer's peak when attach allocated them)
        allocated = attach_allocates(model, layer)
        ctl, model, _, strategy = await served(layerwise(prefetch=prefetch), layer, model)
        non_layer = ctl.report().device_bytes if allocated else 0
        async with ctl.use("transformer"):
            FLUX.run(model)
        peaks[prefetch] = (layer.peak - non_layer, strategy.peak_bound())
    largest = max(u.nbytes for u in strategy.units if u is not None)
    assert peaks[0][0] <= largest < peaks[1][0]
    assert peaks[1][1] - peaks[0][1] == largest


async def test_first_last_keeps_the_first_and_the_last_layer_that_run_for_the_whole_use() -> None:
    """policy=first_last keeps the first double block and the last single block in between
    forwards of a use, streams the seven others, and gives the resident model's output
    (diffusers' test_group_offloading.py: pin_groups="first_last")."""
    ctl, model, reference, strategy = await served(layerwise(policy="first_last"))
    async with ctl.use("transformer"):
        assert on_device(strategy)[:1] == ["transformer_blocks.0"]
        for _ in range(2):
            assert torch.equal(FLUX.run(model), FLUX.run(reference))
            assert on_device(strategy) == ["transformer_blocks.0", "single_transformer_blocks.5"]
    assert on_device(strategy) == []


async def test_first_last_with_three_resident_layers_takes_two_from_the_front() -> None:
    """resident_layers=3 with first_last: two from the front of the run order, one from the
    end."""
    ctl, model, _, strategy = await served(layerwise(resident=3, policy="first_last"))
    async with ctl.use("transformer"):
        FLUX.run(model)
        assert on_device(strategy) == ["transformer_blocks.0", "transformer_blocks.1",
                                       "single_transformer_blocks.5"]


async def test_a_callable_policy_picks_the_resident_layers_by_index_name_and_bytes() -> None:
    """A callable gets every layer's (index, name, bytes) once, in definition order; the
    layers it returns True for stay in for the whole use (diffusers' callable pin_groups)."""
    calls: list[tuple[int, str, int]] = []

    def single_blocks(index: int, name: str, nbytes: int) -> bool:
        calls.append((index, name, nbytes))
        return name.startswith("single_transformer_blocks") and index % 2 == 0

    ctl, model, reference, strategy = await served(layerwise(policy=single_blocks))
    sizes = [sum(t.nbytes for t in [*b.parameters(), *b.buffers()]) for _, b in strategy.layers]
    assert calls == [(i, key, sizes[i]) for i, (key, _) in enumerate(strategy.layers)]
    assert [c[1] for c in calls] == [*(f"transformer_blocks.{i}" for i in range(3)),
                                     *(f"single_transformer_blocks.{i}" for i in range(6))]
    async with ctl.use("transformer"):
        assert torch.equal(FLUX.run(model), FLUX.run(reference))
        # definition indices 4, 6 and 8
        assert on_device(strategy) == ["single_transformer_blocks.1", "single_transformer_blocks.3",
                                       "single_transformer_blocks.5"]


@pytest.mark.parametrize(("policy", "message"), [
    (lambda i, n, b: 1 / 0, "Component 'transformer': residency policy '<lambda>' raised for "
                            "layer 0 ('transformer_blocks.0'): ZeroDivisionError: division by zero"),
    (lambda i, n, b: "yes", "Component 'transformer': residency policy '<lambda>' must return a "
                            "bool for layer 0 ('transformer_blocks.0'), got 'yes'"),
], ids=["raises", "not-a-bool"])
async def test_a_callable_policy_that_cannot_pick_refuses_attach_and_leaves_the_model_as_it_was(
        policy: object, message: str) -> None:
    """Attach is refused with a ComponentResidencyError naming the component and the layer;
    the model keeps no hook or mark and still computes its own output."""
    model = build_deep("flux", 3)
    expected = FLUX.run(copy.deepcopy(model))
    ctl = LifecycleController("cpu", residency=layerwise(policy=policy))
    with pytest.raises(ComponentResidencyError) as info:
        await ctl.attach({"transformer": model})
    assert str(info.value) == message
    assert ctl.phase is Phase.UNINITIALIZED
    assert not is_layerwise_offloaded(model)
    assert torch.equal(FLUX.run(model), expected)


async def test_set_residency_to_a_callable_policy_that_raises_changes_nothing() -> None:
    """Switching a served component to a callable policy that raises is refused before any
    move: the old strategy, its placement and the output stay."""
    ctl, model, reference, strategy = await served(layerwise(prefetch=2))
    before = ctl.report().components["transformer"]
    with pytest.raises(ComponentResidencyError, match="raised for layer 0"):
        await ctl.set_residency(layerwise(policy=lambda i, n, b: [][1]))
    assert ctl.strategy("transformer") is strategy
    assert ctl.report().components["transformer"] == before
    async with ctl.use("transformer"):
        assert torch.equal(FLUX.run(model), FLUX.run(reference))
    await ctl.aclose()
