"""Components added to and removed from an attached pipeline (a second text encoder, a
refiner loaded later: diffusers' pipelines take components after load, SGLang's component
residency manager builds a strategy per component at any time), on real diffusers and
transformers models: placed per the configuration, transactional under a fault at every
copy and allocation, refused with the reason where it cannot be done."""

from __future__ import annotations

import anyio
import pytest
import torch
from torch import nn

from lifecycle import (
    InvalidRequest,
    LifecycleController,
    Phase,
    SyncLifecycleController,
    TransitionFailed,
    TransitionRejected,
    UnknownComponent,
)
from lifecycle.testing import FaultInjection, InjectedFault
from strategies import LayerwiseOffloadStrategy, is_layerwise_offloaded
from tests.helpers import device_tier_storages, faulty_device, fingerprint
from tests.models.zoo import CASES, build_deep

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

CLIP, FLUX = CASES["clip_text"], CASES["flux"]
RESIDENCY = "text_encoder=component-offload,transformer=layerwise-offload"


def one_layer_clip(seed: int) -> nn.Module:
    """A real CLIP text encoder with one layer: the fault sweeps' (fewest copies)."""
    return build_deep("clip_text", 1, seed)


async def served(layer: FaultInjection | None = None, residency: str = RESIDENCY,
                 small: bool = False) -> tuple[LifecycleController, dict[str, nn.Module]]:
    pipe = {"text_encoder": one_layer_clip(0) if small else CLIP.build(0),
            "transformer": one_layer_clip(5) if small else FLUX.build(0)}
    ctl = LifecycleController(device_layer=layer or faulty_device(), residency=residency)
    await ctl.attach(pipe)
    return ctl, pipe


def placed(ctl: LifecycleController) -> tuple[object, ...]:
    """The report's phase and components: its peaks and allocator counts are left out (a
    rolled-back attempt raises a peak; the layer's own count of live buffers is checked)."""
    report = ctl.report()
    return report.phase, dict(report.components)


def hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


async def test_an_added_component_is_placed_by_its_group_and_serves_across_sleep_and_wake() -> None:
    """text_encoder_2 gets the text_encoder group's mode (component-offload), computes the
    plain model's output in a use, sleeps with the others (no device byte left) and wakes
    with the same output."""
    ctl, pipe = await served()
    second = CLIP.build(1)
    expected = CLIP.run(CLIP.build(1))
    assert await ctl.add_component("text_encoder_2", second) is Phase.AWAKE
    assert list(ctl.components) == ["text_encoder", "transformer", "text_encoder_2"]
    assert ctl.report().components["text_encoder_2"].mode == "component-offload"
    assert ctl.report().components["text_encoder_2"].device_bytes == 0
    async with ctl.use("text_encoder_2") as module:
        assert torch.equal(CLIP.run(module), expected)
    assert (await ctl.sleep()).success
    assert ctl.report().device_bytes == 0
    assert device_tier_storages({**pipe, "text_encoder_2": second}, ctl) == {}
    assert (await ctl.wake()).success
    async with ctl.request(["text_encoder", "text_encoder_2", "transformer"]), \
            ctl.use("text_encoder_2") as module:
        assert torch.equal(CLIP.run(module), expected)
    await ctl.aclose()
    assert hooks(second) == 0


async def test_an_added_component_takes_the_residency_it_is_given() -> None:
    """residency="layerwise-offload" streams a second Flux transformer's blocks; the
    configuration names it until it is removed."""
    ctl, _ = await served()
    refiner = FLUX.build(2)
    expected = FLUX.run(FLUX.build(2))
    await ctl.add_component("refiner", refiner, residency="layerwise-offload")
    assert isinstance(ctl.strategy("refiner"), LayerwiseOffloadStrategy)
    assert ctl.config.mode_for("refiner").value == "layerwise-offload"
    async with ctl.use("refiner") as module:
        assert torch.equal(FLUX.run(module), expected)
    await ctl.remove_component("refiner")
    assert ctl.config.to_string() == RESIDENCY  # its selector goes with it
    assert (await ctl.set_residency(ctl.config)).success
    await ctl.aclose()
    assert not is_layerwise_offloaded(refiner)


async def test_adding_a_component_does_not_wait_for_a_use_of_another() -> None:
    """A use of the transformer in progress goes on while a component is added."""
    ctl, _ = await served()
    entered, leave = anyio.Event(), anyio.Event()

    async def hold() -> None:
        async with ctl.use("transformer"):
            entered.set()
            await leave.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        await entered.wait()
        with anyio.fail_after(10):
            await ctl.add_component("text_encoder_2", CLIP.build(1))
        assert ctl.in_flight == 1
        leave.set()
    await ctl.aclose()


async def test_a_removed_component_is_given_back_whole_and_can_be_served_elsewhere() -> None:
    """After remove_component the module holds its own weights (bit-identical, no hook of
    ours), the controller forgets it and keeps serving the rest; another controller can
    take the module."""
    ctl, pipe = await served()
    clip = pipe["text_encoder"]
    before = fingerprint(CLIP.build(0))
    async with ctl.use("text_encoder"):
        pass
    assert await ctl.remove_component("text_encoder") is Phase.AWAKE
    assert list(ctl.components) == ["transformer"]
    assert "text_encoder" not in ctl.report().components
    assert hooks(clip) == 0
    assert fingerprint(clip) == before
    assert torch.equal(CLIP.run(clip), CLIP.run(CLIP.build(0)))
    async with ctl.use("transformer") as module:
        assert torch.equal(FLUX.run(module), FLUX.run(FLUX.build(0)))
    other = LifecycleController("cpu")
    await other.attach({"text_encoder": clip})
    await other.aclose()
    await ctl.add_component("text_encoder", clip)  # and back again
    async with ctl.use("text_encoder") as module:
        assert torch.equal(CLIP.run(module), CLIP.run(CLIP.build(0)))
    await ctl.aclose()


async def test_a_component_is_removed_while_sleeping_with_its_weights() -> None:
    """While sleeping a component can be removed: it comes back with its weights on the
    host; the rest wakes as usual."""
    ctl, pipe = await served()
    assert (await ctl.sleep()).success
    await ctl.remove_component("text_encoder")
    assert ctl.phase is Phase.SLEEPING
    assert fingerprint(pipe["text_encoder"]) == fingerprint(CLIP.build(0))
    assert (await ctl.wake()).success
    await ctl.aclose()


def refusals(ctl: LifecycleController, pipe: dict[str, nn.Module]
             ) -> dict[str, tuple[str, nn.Module, str]]:
    """id -> (name, module, the reason it is refused)."""
    return {
        "name taken": ("text_encoder", CLIP.build(1),
                       "a component named 'text_encoder' is attached already (components: "
                       "['text_encoder', 'transformer']); remove_component('text_encoder') first"),
        "same module": ("clip", pipe["text_encoder"],
                        "module CLIPTextModel of 'clip' is (or shares modules with) component "
                        "'text_encoder': a module is managed once"),
        "part of one": ("blocks", pipe["transformer"].get_submodule("transformer_blocks"),
                        "module ModuleList of 'blocks' is (or shares modules with) component "
                        "'transformer': a module is managed once"),
    }


@pytest.mark.parametrize("case", ["name taken", "same module", "part of one"])
async def test_an_add_that_cannot_be_done_is_refused_with_its_reason_and_changes_nothing(
        case: str) -> None:
    """A taken name, a module already a component, or a part of one: TransitionRejected
    with the reason; components, report and weights unchanged."""
    ctl, pipe = await served()
    name, module, reason = refusals(ctl, pipe)[case]
    before = (list(ctl.components), ctl.report(), {n: fingerprint(m) for n, m in pipe.items()})
    with pytest.raises(TransitionRejected) as info:
        await ctl.add_component(name, module)
    assert (info.value.trigger, info.value.reason) == ("add_component", reason)
    assert (list(ctl.components), ctl.report(),
            {n: fingerprint(m) for n, m in pipe.items()}) == before
    await ctl.aclose()


async def test_adding_a_module_another_controller_manages_is_refused() -> None:
    """A module guarded by another controller (diffusers refuses a second offload manager)
    is refused; both controllers keep serving."""
    ctl, _ = await served()
    other = LifecycleController("cpu")
    clip = CLIP.build(3)
    await other.attach({"text_encoder": clip})
    with pytest.raises(TransitionRejected, match=f"managed by controller {other.id} as "
                                                 "component 'text_encoder'"):
        await ctl.add_component("text_encoder_2", clip)
    assert list(ctl.components) == ["text_encoder", "transformer"]
    async with other.use("text_encoder") as module:
        assert torch.equal(CLIP.run(module), CLIP.run(CLIP.build(3)))
    await other.aclose()
    await ctl.aclose()


async def test_an_added_component_is_registered_until_it_is_removed() -> None:
    """A module added to one controller is refused by another's attach (as at attach), and
    accepted there once it has been removed."""
    ctl, _ = await served()
    clip = CLIP.build(4)
    await ctl.add_component("text_encoder_2", clip)
    other = LifecycleController("cpu")
    with pytest.raises(TransitionRejected, match=f"managed by controller {ctl.id} as "
                                                 "component 'text_encoder_2'"):
        await other.attach({"text_encoder": clip})
    await ctl.remove_component("text_encoder_2")
    await other.attach({"text_encoder": clip})
    assert list(other.components) == ["text_encoder"]
    await other.aclose()
    await ctl.aclose()


async def test_adding_while_sleeping_or_detached_or_with_a_bad_argument_is_refused() -> None:
    """Sleeping and detached controllers refuse with the phase's reason; a non-module or an
    empty name is an InvalidRequest naming the argument; a residency that would change
    other components through a group selector is refused."""
    ctl = LifecycleController("cpu")
    with pytest.raises(TransitionRejected, match="pipeline not initialized: attach"):
        await ctl.add_component("x", CLIP.build(0))
    ctl, _ = await served(residency="dit=layerwise-offload,text_encoder=component-offload")
    with pytest.raises(InvalidRequest) as bad:
        await ctl.add_component("", CLIP.build(0))
    assert bad.value.field == "name"
    with pytest.raises(InvalidRequest) as bad:
        await ctl.add_component("x", torch.zeros(3))  # type: ignore[arg-type]
    assert (bad.value.field, str(bad.value)) == (
        "module", "component 'x' must be a torch.nn.Module, got Tensor")
    with pytest.raises(TransitionRejected) as group:
        await ctl.add_component("dit", FLUX.build(1), residency="resident")
    assert group.value.reason == ("residency 'resident' for 'dit' would also change components "
                                  "['transformer'] (a group selector): name it with "
                                  "set_residency instead")
    await ctl.sleep()
    with pytest.raises(TransitionRejected) as asleep:
        await ctl.add_component("x", CLIP.build(0))
    assert asleep.value.reason == ("cannot add component 'x' while sleeping: wake the pipeline "
                                   "first (a component is added placed for serving)")
    assert list(ctl.components) == ["text_encoder", "transformer"]
    await ctl.aclose()


async def test_a_remove_that_cannot_be_done_is_refused_with_its_reason() -> None:
    """An unknown name is UnknownComponent naming the known ones; a component in use, or
    the only one, is refused and stays served."""
    ctl, _ = await served()
    with pytest.raises(UnknownComponent) as unknown:
        await ctl.remove_component("vae")
    assert unknown.value.known == ["text_encoder", "transformer"]
    async with ctl.use("text_encoder") as module:
        with pytest.raises(TransitionRejected) as busy:
            await ctl.remove_component("text_encoder")
        assert busy.value.reason == ("component 'text_encoder' is in use (1 use(s) in "
                                     "flight): remove it once they end")
        assert torch.equal(CLIP.run(module), CLIP.run(CLIP.build(0)))
    await ctl.remove_component("transformer")
    with pytest.raises(TransitionRejected) as only:
        await ctl.remove_component("text_encoder")
    assert only.value.reason == "'text_encoder' is the only component: detach() the pipeline instead"
    await ctl.aclose()


async def ops(step: str, mode: str, residency: str) -> tuple[int, int]:
    probe = faulty_device()
    ctl, _ = await served(probe, residency, small=True)
    copies, allocs = probe.copies, probe.allocations
    await run_step(ctl, step, mode)
    made = probe.copies - copies, probe.allocations - allocs
    await ctl.aclose()
    return made


async def run_step(ctl: LifecycleController, step: str, mode: str,
                   added: nn.Module | None = None) -> None:
    if step == "add":
        await ctl.add_component("text_encoder_2", added or CLIP.build(1), residency=mode)
    else:
        await ctl.remove_component("text_encoder")


# (step, mode): the added component's mode, or the removed one's
POINTS = [("add", "resident"), ("add", "layerwise-offload"), ("remove", "resident"),
          ("remove", "component-offload")]


@pytest.mark.parametrize(("step", "mode"), POINTS, ids=[f"{s}-{m}" for s, m in POINTS])
@pytest.mark.parametrize("kind", ["copy", "alloc"])
async def test_a_fault_at_every_copy_and_allocation_leaves_the_pipeline_as_it_was(
        step: str, mode: str, kind: str) -> None:
    """For every k, failing the k-th copy (or allocation) of add_component / remove_component
    raises TransitionFailed caused by the fault; components, report, device buffers and
    weights are as before, every component serves its output, and a retry succeeds."""
    residency = f"text_encoder={mode if step == 'remove' else 'component-offload'}," \
        "transformer=resident"
    copies, allocs = await ops(step, mode, residency)
    points = copies if kind == "copy" else allocs
    if points == 0:
        pytest.skip(f"{step} of a {mode} component makes no {kind}")
    for k in range(1, points + 1):
        layer = faulty_device()
        ctl, pipe = await served(layer, residency, small=True)
        added = CLIP.build(1)
        before = (list(ctl.components), placed(ctl), layer.live_device_bytes,
                  {n: fingerprint(m) for n, m in pipe.items()}, fingerprint(added))
        layer.arm(**{f"{kind}_at": k})
        with pytest.raises(TransitionFailed) as info:
            await run_step(ctl, step, mode, added)
        assert isinstance(info.value.cause, InjectedFault)
        assert layer.faults == 1
        assert (list(ctl.components), placed(ctl), layer.live_device_bytes,
                {n: fingerprint(m) for n, m in pipe.items()}, fingerprint(added)) == before
        if step == "add":
            assert hooks(added) == 0 and not is_layerwise_offloaded(added)
            assert torch.equal(CLIP.run(added), CLIP.run(CLIP.build(1)))
        async with ctl.use("text_encoder") as module:
            assert torch.equal(CLIP.run(module), CLIP.run(one_layer_clip(0)))
        await run_step(ctl, step, mode, added)  # the retry
        assert ("text_encoder_2" in ctl.components) == (step == "add")
        await ctl.aclose()


def test_the_blocking_facade_adds_and_removes_components() -> None:
    """SyncLifecycleController.add_component / remove_component block until done."""
    with SyncLifecycleController("cpu", residency="text_encoder=component-offload") as ctl:
        ctl.attach({"transformer": FLUX.build(0)})
        assert ctl.add_component("text_encoder", CLIP.build(0)) is Phase.AWAKE
        with ctl.use("text_encoder") as module:
            assert torch.equal(CLIP.run(module), CLIP.run(CLIP.build(0)))
        assert ctl.remove_component("text_encoder") is Phase.AWAKE
        assert list(ctl.components) == ["transformer"]
