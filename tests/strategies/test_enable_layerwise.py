"""enable_layerwise_offload: which block lists it streams, explicit names, refusals;
attach enabling it for the components configured for it."""

from __future__ import annotations

import pytest
from torch import nn

from strategies import (
    LayerwiseOffloadStrategy,
    ResidencyConfig,
    ResidencyMode,
    enable_layerwise_offload,
    is_layerwise_offloaded,
    layerwise_blocks,
)
from strategies.protocol import (
    build_strategy,
)
from tests.modes.strategy_suite import (
    DiT,
    TwoLists,
    _one_intra_op_thread,  # noqa: F401 (an autouse fixture)
    attach_layerwise,
    layerwise_config,
    raises_exactly,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


def test_enable_layerwise_offload_leaves_out_lists_tiny_next_to_the_largest() -> None:
    """With no names a list under a tenth of the largest list's bytes is a head, not blocks:
    the long list of small layers is left out, the short list of large ones streams."""
    module = nn.Module()
    module.many_small = nn.ModuleList(nn.Linear(2, 2) for _ in range(8))
    module.few_large = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
    assert not is_layerwise_offloaded(module)
    assert enable_layerwise_offload(module) == ("few_large",)
    assert is_layerwise_offloaded(module)
    assert layerwise_blocks(module) == ("few_large",)


def test_enable_layerwise_offload_takes_explicit_dotted_names() -> None:
    """Nested block lists are named by their dotted path and all of them stream."""
    module = TwoLists()
    names = ("encoder.layers", "decoder.layers")
    assert enable_layerwise_offload(module, names) == names
    assert layerwise_blocks(module) == names
    strategy = build_strategy("transformer", module, ResidencyConfig.parse(""))
    try:
        assert isinstance(strategy, LayerwiseOffloadStrategy)
        assert [key for key, _ in strategy.layers] == [
            "encoder.layers.0", "encoder.layers.1",
            "decoder.layers.0", "decoder.layers.1", "decoder.layers.2"]
    finally:
        strategy.close()


def test_enable_layerwise_offload_on_a_module_without_block_lists_says_why() -> None:
    """A module with no nn.ModuleList gets a clear error and stays not layerwise-enabled."""
    module = nn.Linear(4, 4)
    with raises_exactly(ValueError, "Linear has no nn.ModuleList of repeated blocks to offload layer "
                        "by layer; pass layers=[...] naming its block lists (nn.ModuleList / "
                        "nn.Sequential: [])"):
        enable_layerwise_offload(module)
    assert not is_layerwise_offloaded(module)


def test_enable_layerwise_offload_refuses_unknown_names() -> None:
    """Names that are not block lists are listed with the block lists that exist, and a
    near miss gets a hint."""
    module = DiT()
    with raises_exactly(ValueError, "layers ['blox', 'inp'] are not block lists of DiT (did you "
                        "mean 'blocks' for 'blox'?); block lists: ['blocks']"):
        enable_layerwise_offload(module, ["blox", "inp"])
    assert not is_layerwise_offloaded(module)


async def test_attach_enables_layerwise_offload_for_components_configured_for_it() -> None:
    """A component configured layerwise-offload is made layerwise-capable at attach."""
    ctl, model, _, strategy = await attach_layerwise(layerwise_config())
    assert is_layerwise_offloaded(model)
    assert layerwise_blocks(model) == ("blocks",)
    assert strategy.mode is ResidencyMode.LAYERWISE_OFFLOAD
    assert ctl.report().components["transformer"].mode == "layerwise-offload"
