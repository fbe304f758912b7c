"""Guarded transitions: every (phase, trigger) pair, with exact outcomes and messages."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lifecycle import (
    ComponentAsleep,
    FSDPInferenceUnsupported,
    LifecycleController,
    LifecycleError,
    OccupationResult,
    Phase,
    TransitionRejected,
)
from tests.helpers import fingerprints, layer, run_pipeline, small_pipeline, tied_lm

pytestmark = pytest.mark.anyio


async def controller_in(phase: Phase, **kwargs: Any) -> tuple[LifecycleController, dict[str, nn.Module]]:
    pipe = small_pipeline()
    ctl = LifecycleController("cpu", **kwargs)
    if phase is not Phase.UNINITIALIZED:
        await ctl.attach(pipe)
    if phase is Phase.SLEEPING:
        await ctl.sleep()
    assert ctl.phase is phase
    return ctl, pipe


# (phase, call) -> expected: ("result", success, message, phase after) or
# ("raises", exception type, message, phase after) or ("phase", phase after)
TABLE: dict[tuple[Phase, str], tuple[Any, ...]] = {
    (Phase.UNINITIALIZED, "sleep"): ("result", False, "pipeline not initialized", Phase.UNINITIALIZED),
    (Phase.UNINITIALIZED, "wake"): ("result", False, "pipeline not initialized", Phase.UNINITIALIZED),
    (Phase.UNINITIALIZED, "release_memory_occupation"):
        ("result", False, "pipeline not initialized", Phase.UNINITIALIZED),
    (Phase.UNINITIALIZED, "resume_memory_occupation"):
        ("result", False, "pipeline not initialized", Phase.UNINITIALIZED),
    (Phase.UNINITIALIZED, "attach"): ("phase", Phase.AWAKE),
    (Phase.UNINITIALIZED, "detach"): ("phase", Phase.UNINITIALIZED),
    (Phase.AWAKE, "sleep"): ("result", True, "sleep succeeded", Phase.SLEEPING),
    (Phase.AWAKE, "release_memory_occupation"): ("result", True, "sleep succeeded", Phase.SLEEPING),
    (Phase.AWAKE, "wake"): ("result", True, "already awake", Phase.AWAKE),
    (Phase.AWAKE, "resume_memory_occupation"): ("result", True, "already awake", Phase.AWAKE),
    (Phase.AWAKE, "attach"): ("raises", TransitionRejected,
                              "a pipeline is already attached; detach() it first", Phase.AWAKE),
    (Phase.AWAKE, "detach"): ("phase", Phase.UNINITIALIZED),
    (Phase.SLEEPING, "sleep"): ("result", True, "already sleeping", Phase.SLEEPING),
    (Phase.SLEEPING, "release_memory_occupation"):
        ("result", True, "already sleeping", Phase.SLEEPING),
    (Phase.SLEEPING, "wake"): ("result", True, "wake succeeded", Phase.AWAKE),
    (Phase.SLEEPING, "resume_memory_occupation"): ("result", True, "wake succeeded", Phase.AWAKE),
    (Phase.SLEEPING, "attach"): ("raises", TransitionRejected,
                                 "a pipeline is already attached; detach() it first",
                                 Phase.SLEEPING),
    (Phase.SLEEPING, "detach"): ("phase", Phase.UNINITIALIZED),
}


async def call(ctl: LifecycleController, name: str) -> Any:
    if name == "attach":
        return await ctl.attach(small_pipeline(1))
    return await getattr(ctl, name)()


@pytest.mark.parametrize(("phase", "trigger"), list(TABLE), ids=lambda v: getattr(v, "value", v))
async def test_every_phase_and_trigger_pair_has_its_exact_outcome(phase: Phase, trigger: str) -> None:
    """Each (phase, trigger) pair gives the outcome of the table, and a refusal moves nothing."""
    ctl, pipe = await controller_in(phase)
    before = fingerprints(pipe)
    expected = TABLE[(phase, trigger)]
    if expected[0] == "result":
        _, success, message, after = expected
        result = await call(ctl, trigger)
        assert isinstance(result, OccupationResult)
        assert (result.success, result.message, result.phase, result.sleeping) == (
            success, message, after, after is Phase.SLEEPING)
        assert result.as_dict()["success"] is success
        assert result.as_dict()["message"] == message
        if message.startswith("already") or not success:
            assert result.bytes_moved == 0
    elif expected[0] == "raises":
        _, exc_type, message, after = expected
        with pytest.raises(exc_type) as info:
            await call(ctl, trigger)
        assert str(info.value) == message
        assert (info.value.trigger, info.value.phase, info.value.reason) == (trigger, phase, message)
    else:
        assert await call(ctl, trigger) == expected[1]
        after = expected[1]
    assert ctl.phase is after
    assert fingerprints(pipe) == before


def test_phase_enum_has_the_contract_values() -> None:
    """Phase members and values are the public contract."""
    assert {p.name: p.value for p in Phase} == {
        "UNINITIALIZED": "uninitialized", "AWAKE": "awake", "SLEEPING": "sleeping",
        "UPDATING_WEIGHTS": "updating_weights"}


def test_new_controller_is_uninitialized_and_picks_cpu_without_cuda() -> None:
    """A fresh controller is UNINITIALIZED; device=None picks CUDA only when available."""
    ctl = LifecycleController()
    assert ctl.phase is Phase.UNINITIALIZED
    assert ctl.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", 3.5])
def test_invalid_device_is_a_clear_value_error(bad: Any) -> None:
    """An unusable device names what was given and what is valid."""
    with pytest.raises(ValueError, match=r"expected 'cpu'|unsupported device|not available"):
        LifecycleController(bad)


@pytest.mark.parametrize("phase", [Phase.UNINITIALIZED, Phase.AWAKE])
@pytest.mark.parametrize("trigger", ["sleep", "wake"])
async def test_fsdp_inference_is_rejected_with_a_typed_error(phase: Phase, trigger: str) -> None:
    """use_fsdp_inference=True refuses sleep/wake (unless already there) and changes nothing."""
    ctl, _ = await controller_in(phase, use_fsdp_inference=True)
    if (phase, trigger) == (Phase.AWAKE, "wake"):
        assert (await ctl.wake()).message == "already awake"
        return
    with pytest.raises(FSDPInferenceUnsupported) as info:
        await call(ctl, trigger)
    assert str(info.value) == "sleep/wake does not support FSDP inference"
    assert isinstance(info.value, TransitionRejected)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.trigger, info.value.phase) == (trigger, phase)
    assert ctl.phase is phase


async def test_already_sleeping_is_checked_before_fsdp() -> None:
    """The reference's order: already sleeping wins over the FSDP refusal."""
    ctl, _ = await controller_in(Phase.SLEEPING)
    ctl.use_fsdp_inference = True
    assert (await ctl.sleep()).message == "already sleeping"
    with pytest.raises(FSDPInferenceUnsupported):
        await ctl.wake()
    assert ctl.phase is Phase.SLEEPING


async def test_fsdp_managed_component_refuses_sleep() -> None:
    """A component FSDP manages (an FSDPModule inside it) makes sleep a typed refusal."""
    pipe = small_pipeline()
    inner = layer(pipe["transformer"], 0, nn.Linear)
    inner.__class__ = type("FSDPLinear", (FSDPModule, type(inner)), {})
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    with pytest.raises(FSDPInferenceUnsupported):
        await ctl.sleep()
    assert ctl.phase is Phase.AWAKE
    assert ctl.report().device_bytes > 0


async def test_forward_while_sleeping_raises_component_asleep_naming_the_component() -> None:
    """Any attached component, root or block, refuses to run on released weights."""
    ctl, pipe = await controller_in(Phase.SLEEPING)
    with pytest.raises(ComponentAsleep) as info:
        run_pipeline(pipe)
    assert str(info.value) == "Server is sleeping. Call resume_memory_occupation first."
    assert info.value.component == "text_encoder"
    assert isinstance(info.value, LifecycleError)
    with pytest.raises(ComponentAsleep) as info:
        tied_lm(pipe).blocks[1](torch.zeros(1, 16))
    assert info.value.component == "text_encoder"
    with pytest.raises(ComponentAsleep):
        async with ctl.use("vae"):
            pass


async def test_detach_removes_the_forward_guard_and_leaves_weights_on_the_host() -> None:
    """After detach the modules run again, with the same values, outside the library."""
    ctl, pipe = await controller_in(Phase.SLEEPING)
    before = fingerprints(pipe)
    assert await ctl.detach() is Phase.UNINITIALIZED
    run_pipeline(pipe)
    assert fingerprints(pipe) == before
    assert ctl.report().components == {}


class _Modules:
    def __init__(self, modules: dict[str, Any]) -> None:
        self.modules = modules


class _Components:
    def __init__(self, components: dict[str, Any]) -> None:
        self.components = components


@pytest.mark.parametrize("wrap", [dict, _Modules, _Components], ids=["mapping", "modules", "components"])
async def test_pipeline_forms_are_accepted_and_non_modules_ignored(wrap: Any) -> None:
    """Mappings, .modules and .components pipelines attach; non-module entries are skipped."""
    pipe: dict[str, Any] = dict(small_pipeline())
    pipe["scheduler"] = object()
    pipe["tokenizer"] = None
    ctl = LifecycleController("cpu")
    await ctl.attach(wrap(pipe))
    assert sorted(ctl.components) == ["text_encoder", "transformer", "vae"]


@pytest.mark.parametrize("bad", [42, [nn.Linear(2, 2)], "transformer", object()])
async def test_unsupported_pipeline_is_a_type_error_naming_the_expected_forms(bad: Any) -> None:
    """Anything but a mapping or an object with .modules/.components is a TypeError."""
    ctl = LifecycleController("cpu")
    with pytest.raises(TypeError, match=r"expected a Mapping\[str, nn.Module\], or an object "
                                        "with a `modules` or `components` mapping"):
        await ctl.attach(bad)
    assert ctl.phase is Phase.UNINITIALIZED


async def test_detach_undoes_what_attach_enabled_so_reattach_follows_the_new_config() -> None:
    """Layerwise offload enabled by attach() is taken back by detach(): a later attach with
    a resident configuration gets the resident strategy."""
    pipe = small_pipeline()
    ctl = LifecycleController("cpu", residency="text_encoder=layerwise-offload")
    await ctl.attach(pipe)
    assert ctl.strategy("text_encoder").mode.value == "layerwise-offload"
    await ctl.detach()
    again = LifecycleController("cpu")
    await again.attach(pipe)
    assert again.strategy("text_encoder").mode.value == "resident"
    assert again.report().components["text_encoder"].device_bytes == \
        again.report().components["text_encoder"].total_bytes


@pytest.mark.parametrize("trigger", ["sleep", "wake", "attach", "detach", "update"])
async def test_calls_during_an_update_wait_their_turn_then_see_awake(trigger: str) -> None:
    """While UPDATING_WEIGHTS, every other call waits for the update to finish and then gets
    the outcome it would get in AWAKE; the update itself completes untouched."""
    import anyio

    from tests.helpers import faulty_device

    layer = faulty_device(copy_delay=0.002)
    pipe = small_pipeline()
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach(pipe)
    state = {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}
    seen: dict[str, Any] = {}

    async def updater() -> None:
        seen["update"] = await ctl.update_weights_from_tensors(state)

    async def other() -> None:
        with anyio.fail_after(10):
            while ctl.phase is not Phase.UPDATING_WEIGHTS:
                await anyio.sleep(0.0005)
        seen["phase while waiting"] = ctl.phase
        try:
            if trigger == "update":
                seen["result"] = await ctl.update_weights_from_tensors(state)
            else:
                seen["result"] = await call(ctl, trigger)
        except TransitionRejected as exc:
            seen["result"] = exc
        seen["version when answered"] = ctl.weights_version

    async with anyio.create_task_group() as tg:
        tg.start_soon(updater)
        tg.start_soon(other)
    assert seen["update"].success and seen["phase while waiting"] is Phase.UPDATING_WEIGHTS
    assert seen["version when answered"] >= 1  # answered only after the update committed
    expected = TABLE[(Phase.AWAKE, trigger)] if trigger != "update" else None
    result = seen["result"]
    if expected is None:
        assert result.success and result.version == 2
    elif expected[0] == "raises":
        assert isinstance(result, expected[1]) and str(result) == expected[2]
    elif expected[0] == "result":
        assert (result.success, result.message) == expected[1:3]
    else:
        assert result is expected[1]
