"""Which strategy a component gets (build_strategy: the mode, FSDP, layerwise-enabled
modules) and what attach refuses or validates before anything moves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController, Phase, TransitionFailed
from strategies import (
    ComponentResidencyError,
    LayerwiseOffloadStrategy,
    ResidencyConfig,
    ResidencyMode,
    enable_layerwise_offload,
    is_layerwise_offloaded,
)
from strategies.protocol import (
    ComponentOffloadStrategy,
    ResidentStrategy,
    SnapshotOffloadStrategy,
    build_strategy,
)
from tests.helpers import faulty_device, fingerprints, small_pipeline
from tests.modes.strategy_suite import (
    DiT,
    _one_intra_op_thread,  # noqa: F401 (an autouse fixture)
    fsdp_managed,
    layerwise_config,
    mlp,
    pointers,
    raises_exactly,
    x_in,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


def test_layerwise_mode_on_a_module_without_layerwise_offload_is_refused() -> None:
    """layerwise-offload on a module loaded without it raises the reference's message."""
    with raises_exactly(ComponentResidencyError, "Component 'vit' resolved to layerwise-offload, "
                        "but its loaded module did not enable layerwise offload"):
        build_strategy("vit", DiT(), ResidencyConfig.parse("vit=layerwise-offload"))
    assert issubclass(ComponentResidencyError, ValueError)


@pytest.mark.parametrize("mode", ["component-offload", "snapshot-offload"])
def test_offload_modes_on_an_fsdp_managed_module_are_refused(mode: str) -> None:
    """Component and snapshot offload refuse a module whose placement FSDP owns."""
    module = fsdp_managed(nn.Linear(4, 4))
    with raises_exactly(ComponentResidencyError,
                        f"Component 'x' resolved to {mode}, but it was loaded as an FSDP-managed module"):
        build_strategy("x", module, ResidencyConfig.parse(f"x={mode}"))


def test_fsdp_managed_module_may_stay_resident() -> None:
    """Resident placement of an FSDP-managed module is not refused."""
    strategy = build_strategy("x", fsdp_managed(nn.Linear(4, 4)), ResidencyConfig.parse("x=resident"))
    assert type(strategy) is ResidentStrategy


@pytest.mark.parametrize("mode", [m.value for m in ResidencyMode])
def test_layerwise_enabled_module_gets_the_layerwise_strategy_whatever_the_mode(mode: str) -> None:
    """A module loaded with layerwise offload is streamed whatever mode it resolves to."""
    module = DiT()
    enable_layerwise_offload(module)
    strategy = build_strategy("transformer", module, ResidencyConfig.parse(f"transformer={mode}"))
    try:
        assert type(strategy) is LayerwiseOffloadStrategy
        assert strategy.mode is ResidencyMode.LAYERWISE_OFFLOAD
    finally:
        strategy.close()


@pytest.mark.parametrize(("spec", "kind"), [
    ("", ResidentStrategy),
    ("vae=component-offload", ResidentStrategy),
    ("transformer=component-offload", ComponentOffloadStrategy),
    ("dit=snapshot-offload", SnapshotOffloadStrategy),
    ("all=component-offload,transformer=resident", ResidentStrategy),
])
def test_strategy_follows_the_resolved_mode_and_defaults_to_resident(
        spec: str, kind: type[object]) -> None:
    """Each mode builds its own strategy; a component no selector matches is resident."""
    assert type(build_strategy("transformer", mlp(), ResidencyConfig.parse(spec))) is kind


async def test_attach_refuses_layerwise_for_a_module_without_block_lists_and_moves_nothing() -> None:
    """A component with no block list configured layerwise is refused before anything moves,
    and the auto-enable of the other components is undone."""
    torch.manual_seed(0)
    pipe: dict[str, nn.Module] = {"transformer": DiT(), "vae": nn.Sequential(nn.Conv2d(4, 8, 3))}
    sums, ptrs = fingerprints(pipe), {n: pointers(m) for n, m in pipe.items()}
    ctl = LifecycleController(device_layer=faulty_device(),
                              residency="transformer=layerwise-offload,vae=layerwise-offload")
    with raises_exactly(ComponentResidencyError, "Component 'vae' resolved to layerwise-offload, "
                        "but its loaded module did not enable layerwise offload"):
        await ctl.attach(pipe)
    assert ctl.phase is Phase.UNINITIALIZED
    assert ctl.device_layer.copies == 0
    assert (is_layerwise_offloaded(pipe["transformer"]), is_layerwise_offloaded(pipe["vae"])) == (
        False, False)
    assert fingerprints(pipe) == sums
    assert {n: pointers(m) for n, m in pipe.items()} == ptrs


async def test_refused_attach_leaves_no_hooks_that_move_tensors_on_forward() -> None:
    """After a refused attach, running a component's forward leaves its tensors in place."""
    torch.manual_seed(0)
    pipe: dict[str, nn.Module] = {"transformer": DiT(), "vae": nn.Sequential(nn.Conv2d(4, 8, 3))}
    ptrs = pointers(pipe["transformer"])
    ctl = LifecycleController(device_layer=faulty_device(),
                              residency="transformer=layerwise-offload,vae=layerwise-offload")
    with pytest.raises(ComponentResidencyError):
        await ctl.attach(pipe)
    with torch.no_grad():
        pipe["transformer"](x_in())
    assert pointers(pipe["transformer"]) == ptrs


async def test_attach_retried_after_a_failed_placement_serves_identical_outputs() -> None:
    """A copy fault during attach is rolled back; attaching again serves the same outputs."""
    layer = faulty_device()
    torch.manual_seed(0)
    model = DiT()
    reference = copy.deepcopy(model)
    ctl = LifecycleController(device_layer=layer, residency=layerwise_config())
    layer.arm(copy_at=2)
    with pytest.raises(TransitionFailed):
        await ctl.attach({"transformer": model})
    await ctl.attach({"transformer": model})
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert torch.equal(model(x_in()), reference(x_in()))


async def test_a_copy_fault_adopting_tensors_in_host_memory_fails_attach_typed() -> None:
    """Tensors in host memory (here a model a detach gave back) are copied into mirrors of
    the store's own at attach: a copy fault there fails the attach as a transition
    (TransitionFailed, on every rank) and leaves the model as it was; attaching again serves
    the same outputs."""
    layer = faulty_device()
    torch.manual_seed(0)
    model = DiT()
    reference = copy.deepcopy(model)
    ctl = LifecycleController(device_layer=layer, residency=layerwise_config())
    await ctl.attach({"transformer": model})
    await ctl.detach()
    assert not any(layer.on_device(p) for p in model.parameters())
    sums = fingerprints({"transformer": model})
    layer.arm(copy_at=1)
    with pytest.raises(TransitionFailed):
        await ctl.attach({"transformer": model})
    assert ctl.phase is Phase.UNINITIALIZED
    assert fingerprints({"transformer": model}) == sums
    await ctl.attach({"transformer": model})
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert torch.equal(model(x_in()), reference(x_in()))


async def test_attach_refuses_inference_tensors_with_a_clear_error() -> None:
    """A module created under torch.inference_mode is refused with a ValueError naming the tensor."""
    with torch.inference_mode():
        model = mlp()
    ctl = LifecycleController(device_layer=faulty_device(), residency="transformer=component-offload")
    with pytest.raises(ValueError, match=r"'0\.weight'.*inference"):
        await ctl.attach({"transformer": model})
    assert ctl.phase is Phase.UNINITIALIZED


async def test_attach_validates_the_whole_config_before_anything_moves() -> None:
    """A selector naming no component is refused at attach; the pipeline is untouched."""
    pipe = small_pipeline()
    pipe["transformer"] = DiT()
    sums, ptrs = fingerprints(pipe), {n: pointers(m) for n, m in pipe.items()}
    ctl = LifecycleController(device_layer=faulty_device(),
                              residency="transformer=layerwise-offload,transformer_3=component-offload")
    with raises_exactly(ValueError, "residency selector 'transformer_3' matches no component; "
                        "components: ['text_encoder', 'transformer', 'vae']; "
                        "groups: all, dit, image_encoder, text_encoder, vae; did you mean 'transformer'?"):
        await ctl.attach(pipe)
    assert ctl.phase is Phase.UNINITIALIZED
    assert (ctl.device_layer.copies, ctl.device_layer.allocations) == (0, 0)
    assert not is_layerwise_offloaded(pipe["transformer"])
    with torch.no_grad():
        pipe["transformer"](x_in())
    assert fingerprints(pipe) == sums
    assert {n: pointers(m) for n, m in pipe.items()} == ptrs
