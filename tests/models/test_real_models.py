"""Real diffusers and transformers models (tiny configs, nothing downloaded) under the
controller: every residency mode computes exactly what the plain model computes, sleep
releases every device byte (by report and by an independent scan) and refuses forwards,
layerwise offload keeps its peak bound, and updates take what users really have."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lifecycle import ComponentAsleep, LifecycleController, Phase
from strategies import LayerwiseOffloadStrategy, ResidencyConfig, layerwise_blocks
from tests.helpers import attach_allocates, device_tier_storages
from tests.models.zoo import CASES, ModelCase
from tests.modes.strategy_suite import TrackingDevice

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

NAME = "model"  # the component name every case is attached under

# mode, prefetch, resident_layers, policy
MODES: dict[str, tuple[str, float, float, str]] = {
    "resident": ("resident", 1, 0, "leading"),
    "component-offload": ("component-offload", 1, 0, "leading"),
    "snapshot-offload": ("snapshot-offload", 1, 0, "leading"),
    "layerwise-p1": ("layerwise-offload", 1, 0, "leading"),
    "layerwise-p2": ("layerwise-offload", 2, 0, "leading"),
    "layerwise-r-leading": ("layerwise-offload", 1, 0.5, "leading"),
    "layerwise-r-strided": ("layerwise-offload", 1, 0.5, "strided"),
}
CYCLES = 2


def config(mode: str) -> ResidencyConfig:
    kind, prefetch, resident, policy = MODES[mode]
    return ResidencyConfig.parse(f"{NAME}={kind}", prefetch={NAME: prefetch},
                                 resident_layers={NAME: resident}, policy={NAME: policy})


@functools.cache
def plain_output(name: str) -> torch.Tensor:
    """What the untouched model (seed 0) computes on the example inputs."""
    return CASES[name].run(CASES[name].build(0))


def record_call(module: nn.Module) -> dict[str, Any]:
    """Keeps the arguments of ``module``'s first call (to call it directly later)."""
    seen: dict[str, Any] = {}

    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.setdefault("call", (args, kwargs))

    seen["handle"] = module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def call_recorded(module: nn.Module, seen: dict[str, Any]) -> None:
    args, kwargs = seen["call"]
    with torch.no_grad():
        module(*args, **kwargs)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
async def test_every_mode_computes_what_the_plain_model_computes_over_sleep_wake_cycles(
        case: ModelCase, mode: str) -> None:
    """Outputs equal the untouched model's (torch.equal) before a sleep and after every
    wake; after each sleep the report and a scan of everything the model reaches find no
    device bytes, and a forward of the root, a block and a leaf raises ComponentAsleep.
    Layerwise: every block list streams and the peak stays within its bound."""
    model = case.build(0)
    expected = plain_output(case.name)
    block, leaf = model.get_submodule(case.block), model.get_submodule(case.leaf)
    calls = {"block": record_call(block), "leaf": record_call(leaf)}
    layer = TrackingDevice()
    allocated = attach_allocates(model, layer)
    ctl = LifecycleController(device_layer=layer, residency=config(mode))
    pipe = {NAME: model}
    await ctl.attach(pipe)
    async with ctl.use(NAME):
        assert torch.equal(case.run(model), expected)
    for seen in calls.values():
        seen["handle"].remove()
    strategy = ctl.strategy(NAME)
    if isinstance(strategy, LayerwiseOffloadStrategy):
        if case.name in ("flux", "hunyuan_video"):
            assert {"transformer_blocks", "single_transformer_blocks"} <= set(layerwise_blocks(model))
        idle = ctl.report().device_bytes  # non-layer weights only
        assert idle < strategy.store.nbytes
        # Streamed buffers, in flight too, and the non-layer weights (in the layer's peak
        # when attach allocated them: a model in host memory).
        assert (0 if allocated else idle) + layer.peak <= strategy.peak_bound()
    for _ in range(CYCLES):
        assert (await ctl.sleep()).success
        assert ctl.report().device_bytes == 0
        assert device_tier_storages(pipe, ctl) == {}
        with pytest.raises(ComponentAsleep):
            case.run(model)
        for seen in calls.values():
            with pytest.raises(ComponentAsleep):
                call_recorded(block if seen is calls["block"] else leaf, seen)
        assert (await ctl.wake()).success
        async with ctl.use(NAME):
            assert torch.equal(case.run(model), expected)
            assert torch.equal(case.run(model), expected)
    if isinstance(strategy, LayerwiseOffloadStrategy):
        assert layer.peak <= strategy.peak_bound()  # after wake the non-layer buffers count too
    # Awake and idle, the report counts exactly what the scan finds on the device tier.
    assert ctl.report().device_bytes == sum(device_tier_storages(pipe, ctl).values())


# -- updates from what users have ------------------------------------------------------------
UPDATE_CASES = ["flux", "hunyuan_video", "unet", "oobleck", "clip_text", "t5_encoder"]


async def served(case: ModelCase, mode: str = "resident"
                 ) -> tuple[LifecycleController, nn.Module]:
    model = case.build(0)
    ctl = LifecycleController("cpu", residency=config(mode))
    await ctl.attach({NAME: model})
    return ctl, model


async def checksum_of(model: nn.Module) -> dict[str, str]:
    """What a fresh controller reports for ``model``."""
    ctl = LifecycleController("cpu")
    await ctl.attach({NAME: model})
    sums = ctl.weights_checksum()
    await ctl.detach()
    return sums


async def assert_serves(ctl: LifecycleController, model: nn.Module, case: ModelCase,
                        like: nn.Module) -> None:
    """``model`` under ``ctl`` computes what ``like`` computes and has its checksum."""
    async with ctl.use(NAME):
        assert torch.equal(case.run(model), case.run(like))
    assert ctl.weights_checksum() == await checksum_of(like)


def to_bf16_and_back(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16).to(t.dtype))
    return module


SAVES: dict[str, Callable[[nn.Module, Path], None]] = {
    "single-file": lambda m, path: m.save_pretrained(path),  # type: ignore[operator]
    "sharded": lambda m, path: m.save_pretrained(  # type: ignore[operator]
        path, max_shard_size=sum(p.nbytes for p in m.parameters()) // 3),
    "bf16": lambda m, path: m.to(torch.bfloat16).save_pretrained(path),  # type: ignore[operator]
}


@pytest.mark.parametrize(("save", "mode"), [("single-file", "resident"),
                                             ("sharded", "component-offload"),
                                             ("bf16", "layerwise-p1")])
@pytest.mark.parametrize("name", UPDATE_CASES)
async def test_update_from_save_pretrained_output_equals_the_saved_model(
        name: str, mode: str, save: str, tmp_path: Path) -> None:
    """A diffusers or transformers ``save_pretrained`` folder (one file, sharded, or bf16
    into fp32 weights) updates the served model to exactly the saved one, by output and by
    checksum, whatever the mode."""
    case = CASES[name]
    ctl, model = await served(case, mode)
    SAVES[save](case.build(1), tmp_path / NAME)
    files = sorted(p.name for p in (tmp_path / NAME).glob("*.safetensors"))
    assert len(files) > 1 if save == "sharded" else len(files) == 1
    result = await ctl.update_weights_from_disk(tmp_path)
    assert result.success, result.message
    expected = case.build(1)
    if save == "bf16":
        to_bf16_and_back(expected)
    await assert_serves(ctl, model, case, expected)
    await ctl.sleep()
    await ctl.wake()
    await assert_serves(ctl, model, case, expected)


@pytest.mark.parametrize("name", UPDATE_CASES)
async def test_update_from_a_state_dict_with_every_name_it_lists(name: str) -> None:
    """``update_weights_from_tensors(other.state_dict())`` works as users write it, tied names
    (T5's shared / embed_tokens) included."""
    case = CASES[name]
    ctl, model = await served(case, "component-offload")
    other = case.build(1)
    result = await ctl.update_weights_from_tensors(other.state_dict(), target_module=NAME)
    assert result.success, result.message
    await assert_serves(ctl, model, case, other)


@pytest.mark.parametrize("defect", ["unknown-key", "wrong-shape"])
@pytest.mark.parametrize("name", ["flux", "t5_encoder"])
async def test_a_bad_checkpoint_changes_nothing(name: str, defect: str, tmp_path: Path) -> None:
    """A saved folder with one unknown key or one wrong shape is refused as a whole: outputs,
    checksums and the version stay as they were."""
    case = CASES[name]
    ctl, model = await served(case, "layerwise-p1")
    before = ctl.weights_checksum()
    case.build(1).save_pretrained(tmp_path / NAME)  # type: ignore[operator]
    file = next((tmp_path / NAME).glob("*.safetensors"))
    state = load_file(str(file))
    if defect == "unknown-key":
        state["not_a_layer.weight"] = torch.zeros(2)
    else:
        key = sorted(k for k in state if state[k].dim() == 2)[0]
        state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    save_file(state, str(file))
    result = await ctl.update_weights_from_disk(tmp_path)
    assert not result.success
    assert ("not_a_layer.weight" if defect == "unknown-key" else "Shape mismatch") in result.message
    assert ctl.weights_checksum() == before and ctl.weights_version == 0
    await assert_serves(ctl, model, case, case.build(0))
    assert ctl.phase is Phase.AWAKE
