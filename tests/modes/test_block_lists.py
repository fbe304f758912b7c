"""Layerwise offload streams every list of repeated blocks (Flux and HunyuanVideo have two),
counts tuning over all streamed layers in the order they run, and takes explicit lists
from the configuration with clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from strategies import (
    ComponentResidencyError,
    LayerwiseOffloadStrategy,
    ResidencyConfig,
    detect_block_lists,
    enable_layerwise_offload,
    layerwise_blocks,
)
from tests.modes.strategy_suite import DIM, Block, TrackingDevice, copied_in_bytes, x_in

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


class Wide(nn.Module):
    """A bigger block (a 'single' block next to a 'double' one)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))  # type: ignore[no-any-return]


class TwoStacks(nn.Module):
    """Flux's shape: embedder, two block lists of different blocks, head; ``interleave`` runs
    them alternately instead (a UNet's resnets and attentions)."""

    def __init__(self, interleave: bool = False) -> None:
        super().__init__()
        self.interleave = interleave
        self.embed = nn.Linear(DIM, DIM)
        self.heads = nn.ModuleList(nn.Linear(DIM, 1) for _ in range(2))  # tiny: not blocks
        self.transformer_blocks = nn.ModuleList(Block() for _ in range(3))
        self.single_transformer_blocks = nn.ModuleList(Wide() for _ in range(4))
        self.mixed = nn.ModuleList([Block(), Wide()])  # two classes: searched inside
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        a, b = list(self.transformer_blocks), list(self.single_transformer_blocks)
        if self.interleave:
            order = [blk for pair in zip(b, a, strict=False) for blk in pair] + b[len(a):]
        else:
            order = a + b
        for block in order:
            h = block(h)
        for m in self.mixed:
            h = m(h)
        return self.out(h) + sum(head(h) for head in self.heads)  # type: ignore[no-any-return]


def test_every_list_of_repeated_blocks_is_detected_and_heads_are_not() -> None:
    """Both block lists are found in definition order; a list of tiny heads and a list of
    mixed classes are not block lists."""
    assert detect_block_lists(TwoStacks()) == ("transformer_blocks", "single_transformer_blocks")


async def serve(config: ResidencyConfig, interleave: bool = False,
                layer: TrackingDevice | None = None
                ) -> tuple[LifecycleController, TwoStacks, TwoStacks, LayerwiseOffloadStrategy]:
    torch.manual_seed(0)
    model = TwoStacks(interleave)
    torch.manual_seed(0)
    reference = TwoStacks(interleave)
    ctl = LifecycleController(device_layer=layer or TrackingDevice(), residency=config)
    await ctl.attach({"transformer": model})
    strategy = ctl.strategy("transformer")
    assert isinstance(strategy, LayerwiseOffloadStrategy)
    return ctl, model, reference, strategy


def config(prefetch: float = 1, resident: float = 0, policy: str = "leading",
           layers: str | None = None) -> ResidencyConfig:
    return ResidencyConfig.parse("transformer=layerwise-offload", prefetch={"transformer": prefetch},
                                 resident_layers={"transformer": resident},
                                 policy={"transformer": policy}, layers=layers)


@pytest.mark.parametrize(("prefetch", "resident", "policy"),
                         [(1, 0, "leading"), (2, 0, "leading"), (1, 2, "leading"), (2, 2, "strided")])
async def test_both_lists_stream_and_the_peak_bound_holds(prefetch: int, resident: int,
                                                           policy: str) -> None:
    """All 7 blocks of both lists stream; counting every buffer the layer allocates, the
    device never holds more than non-layer + (resident + prefetch + 1) x largest layer."""
    layer = TrackingDevice()
    ctl, model, reference, strategy = await serve(config(prefetch, resident, policy), layer=layer)
    assert layerwise_blocks(model) == ("transformer_blocks", "single_transformer_blocks")
    assert len(strategy.layers) == 7
    with torch.no_grad():
        expected = reference(x_in())
        for _ in range(2):
            assert torch.equal(model(x_in()), expected)
        async with ctl.use("transformer"):
            for _ in range(3):
                assert torch.equal(model(x_in()), expected)
    nonlayer = ctl.report().components["transformer"].device_bytes
    assert nonlayer < strategy.store.nbytes  # every layer went back
    # The non-layer weights, in buffers of the layer's when the model was in host memory.
    held = copied_in_bytes(layer, reference.embed, reference.heads, reference.mixed, reference.out)
    assert held in (0, nonlayer)
    assert nonlayer + layer.peak - held <= strategy.peak_bound()
    assert layer.live == held


async def test_resident_layers_count_over_the_execution_order_across_lists() -> None:
    """With blocks of two lists running alternately, ``resident_layers=2, leading`` keeps the
    first two blocks that *run* (one of each list) once a pass has been seen."""
    ctl, model, reference, strategy = await serve(config(1, 2, "leading"), interleave=True)
    keys = [k for k, _ in strategy.layers]
    resident = {keys[i] for i in strategy.resident}
    assert resident == {"transformer_blocks.0", "transformer_blocks.1"}  # definition order
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert torch.equal(model(x_in()), reference(x_in()))
        assert {keys[i] for i in strategy.resident} == {"single_transformer_blocks.0",
                                                        "transformer_blocks.0"}
        ran = [keys[i] for i in strategy.order]
        assert ran[:4] == ["single_transformer_blocks.0", "transformer_blocks.0",
                           "single_transformer_blocks.1", "transformer_blocks.1"]
        async with ctl.use("transformer"):
            for _ in range(2):
                assert torch.equal(model(x_in()), reference(x_in()))
    assert ctl.report().components["transformer"].device_bytes < strategy.store.nbytes


async def test_configured_layers_stream_only_the_named_lists() -> None:
    """``layers="transformer=single_transformer_blocks"`` streams that list alone."""
    ctl, model, reference, strategy = await serve(config(layers="transformer=single_transformer_blocks"))
    assert layerwise_blocks(model) == ("single_transformer_blocks",)
    assert next(k for k, _ in strategy.layers) == "single_transformer_blocks.0"
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert torch.equal(model(x_in()), reference(x_in()))


async def test_configured_layers_with_a_typo_are_refused_with_a_hint_before_anything_moves() -> None:
    """A misspelt block list is refused at attach, naming it, the closest list and all lists;
    the module is left as it was (not layerwise-enabled)."""
    torch.manual_seed(0)
    model = TwoStacks()
    ctl = LifecycleController("cpu", residency=config(
        layers="transformer=transformer_blocks,single_transfomer_blocks"))
    with pytest.raises(ComponentResidencyError) as info:
        await ctl.attach({"transformer": model})
    assert str(info.value).startswith(
        "Component 'transformer': layers ['single_transfomer_blocks'] are not block lists of "
        "TwoStacks (did you mean 'single_transformer_blocks' for 'single_transfomer_blocks'?); "
        "block lists: [")
    assert layerwise_blocks(model) == ()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_layers_for_a_component_that_is_not_layerwise_is_a_configuration_error() -> None:
    """Block lists named for a component of another mode are a mistake, said at attach."""
    cfg = ResidencyConfig.parse("vae=component-offload", layers="vae=decoder.up_blocks")
    with pytest.raises(ValueError) as info:
        cfg.validate_components(["vae", "transformer"])
    assert str(info.value) == ("layers are given for component 'vae', but its mode is "
                               "component-offload; layers apply to layerwise-offload only")


@pytest.mark.parametrize("spec", [
    "transformer=transformer_blocks,single_transformer_blocks",
    "transformer=transformer_blocks+single_transformer_blocks",
    ["transformer=transformer_blocks", "single_transformer_blocks"],
    '{"transformer": ["transformer_blocks", "single_transformer_blocks"]}',
    {"transformer": ["transformer_blocks", "single_transformer_blocks"]},
])
def test_layers_accept_every_form_the_other_options_take(spec: object) -> None:
    """String (a name without '=' continues the list, or '+'), list, JSON and mapping forms."""
    cfg = ResidencyConfig.parse("dit=layerwise-offload", layers=spec)  # type: ignore[arg-type]
    assert cfg.layers_for("transformer") == ("transformer_blocks", "single_transformer_blocks")
    assert cfg.layers_for("vae") is None


@pytest.mark.parametrize(("spec", "message"), [
    ("transformer_blocks", "layers must start with COMPONENT=BLOCK_LIST, got 'transformer_blocks'"),
    ("dit=a,a", "layers for 'dit' names a block list twice: ['a', 'a']"),
    ("dit=", "layers for 'dit' names no block list"),
    ("dit=a,dit=b", "duplicate residency selector 'dit' in layers (given as 'dit' and 'dit')"),
])
def test_bad_layers_are_refused_with_what_was_wrong(spec: str, message: str) -> None:
    """Malformed ``layers`` values fail when the configuration is built."""
    with pytest.raises(ValueError) as info:
        ResidencyConfig.parse("dit=layerwise-offload", layers=spec)
    assert str(info.value) == message


async def test_configured_layers_that_contradict_how_the_module_was_loaded_are_refused() -> None:
    """A module the user already made layerwise-capable with other lists is not silently
    re-listed: attach refuses, naming both."""
    torch.manual_seed(0)
    model = TwoStacks()
    enable_layerwise_offload(model, ["transformer_blocks"])
    ctl = LifecycleController("cpu", residency=config(layers="transformer=single_transformer_blocks"))
    with pytest.raises(ComponentResidencyError) as info:
        await ctl.attach({"transformer": model})
    assert str(info.value) == ("Component 'transformer' was loaded streaming block lists "
                               "['transformer_blocks'], but layers names ['single_transformer_blocks']")
    assert layerwise_blocks(model) == ("transformer_blocks",)
