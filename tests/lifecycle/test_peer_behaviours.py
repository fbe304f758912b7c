"""Behaviours the peers' own tests expect (SGLang's diffusion memory managers, diffusers'
group offloading and hooks, vLLM's sleep mode), tried through our public API: each test
names the peer test whose scenario it plays."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable

import anyio
import pytest
import torch
import transformers
from torch import nn

from lifecycle import InfeasibleBudget, LifecycleController, ResidencyPlan, WeightsDiscarded
from strategies import ResidencyConfig
from tests.helpers import cast_by_hand, faulty_device
from tests.models.zoo import _clip_config, _clip_inputs

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

MODES = ["resident", "component-offload", "snapshot-offload", "layerwise-offload"]


class ScalarBlock(nn.Module):
    """A block with a 0-d parameter and a 0-d integer buffer."""

    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) * self.gain + self.count
        return out


class EveryShape(nn.Module):
    """Tensors of every shape and of many dtypes: 0-d (float, bfloat16, int, bool), empty,
    complex, float8, beside ordinary weights, in two repeated blocks (layerwise streams them)."""

    half_scale: torch.Tensor
    flag: torch.Tensor
    nothing: torch.Tensor
    phase: torch.Tensor
    fp8: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ScalarBlock(), ScalarBlock()])
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        self.register_buffer("half_scale", torch.tensor(0.5, dtype=torch.bfloat16))
        self.register_buffer("flag", torch.tensor(True))
        self.register_buffer("nothing", torch.empty(0, 4))
        self.register_buffer("phase", torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
        self.register_buffer("fp8", torch.tensor([0.5, -1.0], dtype=torch.float8_e4m3fn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        extra = self.phase.real.sum() + self.fp8.float().sum() + self.nothing.sum()
        return x * self.logit_scale.exp() * self.half_scale.float() * self.flag + extra


def clip_model() -> transformers.CLIPModel:
    """transformers' CLIPModel (text and vision towers, 0-d ``logit_scale``), tiny, seeded."""
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, projection_dim=16,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           image_size=8, patch_size=4)
    text = _clip_config()
    config = transformers.CLIPConfig(text_config=text.to_dict(),
                                     vision_config=vision.to_dict(), projection_dim=16)
    return transformers.CLIPModel(config).eval()


def clip_logits(model: nn.Module) -> torch.Tensor:
    pixels = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=_clip_inputs(0)["input_ids"], pixel_values=pixels)
    return out.logits_per_image  # type: ignore[no-any-return]


# -- 1: a discarding sleep of 0-d tensors ---------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
async def test_a_discarding_sleep_takes_tensors_of_every_shape_and_dtype(mode: str) -> None:
    """vLLM's tests/basic_correctness/test_cumem.py::test_cumem_with_cudagraph (a sleep that
    discards what is tagged so): 0-d, empty, complex and float8 tensors are discarded, stale
    after the wake (forwards refused), and exact again once updated from the state dict."""
    model = EveryShape()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    async with LifecycleController(device_layer=faulty_device(), residency=f"m={mode}") as ctl:
        await ctl.attach({"m": model})
        result = await ctl.sleep(discard=True)
        assert result.success and result.discarded == ("m",)
        assert ctl.report().components["m"].device_bytes == 0
        assert model.logit_scale.shape == () and model.nothing.shape == (0, 4)
        await ctl.wake()
        assert ctl.stale == {"m": len(state)}
        with pytest.raises(WeightsDiscarded):
            async with ctl.use("m"):
                pass
        assert (await ctl.update_weights_from_tensors(state, "m")).success
        assert ctl.stale == {}
        async with ctl.use("m"):
            with torch.no_grad():
                assert torch.equal(model(x), expected)


@pytest.mark.parametrize("mode", ["resident", "component-offload"])
async def test_a_clip_model_with_its_scalar_logit_scale_sleeps_by_discarding(mode: str) -> None:
    """SGLang's test/post_training/test_e2e_sleep_wake_up.py::
    test_sleep_wake_refit_generate_e2e (release, resume, refit, generate), released here
    with the weights dropped:
    transformers' CLIPModel, whose ``logit_scale`` is a 0-d parameter, is discarded, woken
    stale and updated from its state dict: its logits are exact again."""
    model = clip_model()
    expected = clip_logits(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    async with LifecycleController(device_layer=faulty_device(), residency=f"clip={mode}") as ctl:
        await ctl.attach({"clip": model})
        assert (await ctl.sleep(discard=True)).success
        await ctl.wake()
        assert ctl.stale["clip"] == len(state)
        assert (await ctl.update_weights_from_tensors(state, "clip")).success
        async with ctl.use("clip"):
            assert torch.equal(clip_logits(model), expected)


# -- 8: unknown component names ---------------------------------------------------------
async def test_every_call_naming_an_unknown_component_raises_unknown_component() -> None:
    """SGLang's weights updater (runtime/post_training/weights_updater.py, exercised by
    test/unit/test_weights_updater.py) refuses a module the pipeline lacks naming the
    available ones; so does every name look-up here: use, request, strategy, weights_checksum,
    mark_dirty, plan's declared uses and the pipeline adapter's order all raise
    UnknownComponent naming the known components, and nothing changes."""
    from lifecycle import UnknownComponent
    from lifecycle.adapters import PipelineRunner
    from lifecycle.demo import DemoPipeline

    pipe = DemoPipeline.build(2**16)
    async with LifecycleController(device_layer=faulty_device()) as ctl:
        await ctl.attach(pipe)
        before = ctl.weights_checksum()
        known = ["text_encoder", "transformer", "vae"]
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "use": lambda: ctl.use("unet").__aenter__(),
            "request": lambda: ctl.request(["text_encoder", "unet"]).__aenter__(),
            "plan": lambda: ctl.plan("70%", uses=["unet"]),
            "runner": PipelineRunner(lambda: None, ctl, order=["unet"]),
        }
        for name, call in calls.items():
            with pytest.raises(UnknownComponent) as caught:
                await call()
            assert (name, caught.value.component, caught.value.known) == (name, "unet", known)
        for sync in (lambda: ctl.strategy("unet"), lambda: ctl.weights_checksum(["unet"]),
                     lambda: ctl.mark_dirty(["unet"])):
            with pytest.raises(UnknownComponent, match=r"\['unet'\]. Available Module\(s\): "
                               r"\['text_encoder', 'transformer', 'vae'\]"):
                sync()
        assert ctl.in_flight == 0 and ctl.weights_checksum() == before


async def test_an_upload_matching_nothing_is_refused_naming_its_keys_as_given() -> None:
    """SGLang's test/unit/test_weights_updater.py::test_text_encoder_receives_unmapped_names
    (names reach the loader as the caller wrote them): a tensor upload whose keys match
    nothing is refused naming those keys as sent, the module prefix not added again."""
    from lifecycle.demo import DemoPipeline

    async with LifecycleController(device_layer=faulty_device()) as ctl:
        await ctl.attach(DemoPipeline.build(2**16))
        result = await ctl.update_weights_from_tensors(
            {"transformer.no_such.weight": torch.zeros(2)}, "transformer")
        assert (result.success, result.message) == (
            False, "1 key(s) match no parameter or buffer of transformer: "
                   "['transformer.no_such.weight']; nothing was updated")


@pytest.mark.parametrize("mode", ["component-offload", "snapshot-offload"])
async def test_a_forward_outside_use_of_a_stale_offloaded_component_says_discarded(mode: str
                                                                                   ) -> None:
    """vLLM's test_cumem.py::test_cumem_with_cudagraph (discarded memory is not the weights):
    a forward outside use() of an offloaded component whose weights a sleep discarded is
    refused as WeightsDiscarded (the reason that holds whatever the placement), not as
    not placed."""
    model = EveryShape()
    async with LifecycleController(device_layer=faulty_device(), residency=f"m={mode}") as ctl:
        await ctl.attach({"m": model})
        await ctl.sleep(discard=True)
        await ctl.wake()
        with pytest.raises(WeightsDiscarded, match=r"Modules \['m'\] have discarded weights"):
            model(torch.zeros(1, 8))


# -- 2: a validation request that raises ------------------------------------------------
@pytest.mark.parametrize("fault", ["injected allocation", "out of memory", "cancelled"])
async def test_a_validation_request_that_raises_restores_the_previous_residency(fault: str
                                                                                ) -> None:
    """SGLang's test/unit/test_auto_residency_warmup.py::
    test_validation_rpc_failure_rolls_back_and_rewarms and
    ::test_failed_first_calibration_rolls_back_and_rewarms (the warm-up raising "oom"): a
    validation request that fails (an allocation fault in its use, an out-of-memory error,
    a cancellation) undoes the plan: the old residency is back and serves exactly."""
    from lifecycle.demo import DemoPipeline

    pipe = DemoPipeline.build(2**16)
    expected = pipe.forward_sync(steps=2)
    layer = faulty_device()
    uses = ["text_encoder", "transformer", "vae"]
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        before = ctl.config
        with pytest.raises(InfeasibleBudget) as info:
            await ctl.plan(0, uses=uses)
        plan = await ctl.plan(info.value.minimum_bytes, uses=uses)  # components offloaded

        async def failing() -> None:
            if fault == "injected allocation":
                layer.arm(alloc_at=1)
                await pipe.generate(ctl=ctl, steps=1)
            elif fault == "out of memory":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            else:
                await anyio.sleep(30)

        if fault == "cancelled":
            with anyio.move_on_after(0.2) as scope:
                await ctl.set_residency(plan, validate=failing)
            assert scope.cancelled_caught
        else:
            change = await ctl.set_residency(plan, validate=failing)
            assert (change.success, change.rolled_back) == (False, True)
            assert change.message.startswith("plan undone, previous residency restored: the "
                                             "validation request raised ")
        assert ctl.config == before
        assert {c.mode for c in ctl.report().components.values()} == {"resident"}
        assert ctl.in_flight == 0
        assert torch.equal(await pipe.generate(ctl=ctl, steps=2), expected)


# -- 3: one module, two controllers -----------------------------------------------------
async def test_attaching_a_module_another_controller_manages_is_refused_naming_it() -> None:
    """diffusers' tests/hooks/test_group_offloading.py::
    test_error_raised_if_group_offloading_applied_on_model_offloaded_module (a module under
    one offload manager is refused by another): a second controller attaching the pipeline,
    or one submodule of it, is refused naming the first controller, and nothing changes;
    after the first detaches, the second may attach it."""
    from lifecycle import Phase, TransitionRejected
    from lifecycle.demo import DemoPipeline

    pipe = DemoPipeline.build(2**16)
    expected = pipe.forward_sync(steps=2)
    transformer = pipe.modules["transformer"]
    block = next(m for m in transformer.modules() if m is not transformer
                 and next(m.parameters(), None) is not None)
    async with LifecycleController(device_layer=faulty_device(),
                                   residency="transformer=component-offload") as first, \
            LifecycleController(device_layer=faulty_device()) as second:
        await first.attach(pipe)
        hooks = sum(len(m._forward_pre_hooks) for m in transformer.modules())
        refusals = {
            "component 'text_encoder' is managed by controller "
            f"{first.id} as component 'text_encoder': detach it there first": pipe,
            f"component 'block' is managed by controller {first.id} as component "
            "'transformer': detach it there first": {"block": block}}
        for message, pipeline in refusals.items():
            with pytest.raises(TransitionRejected) as caught:
                await second.attach(pipeline)
            assert str(caught.value) == message
            assert second.phase is Phase.UNINITIALIZED and second.components == {}
        assert sum(len(m._forward_pre_hooks) for m in transformer.modules()) == hooks
        assert torch.equal(await pipe.generate(ctl=first, steps=2), expected)
        await first.detach()
        await second.attach(pipe)
        assert torch.equal(await pipe.generate(ctl=second, steps=2), expected)


# -- 4: buffers a use updates -----------------------------------------------------------
class Counting(nn.Module):
    """A linear, a batch norm (running statistics in training mode) and a use counter."""

    uses: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("uses", torch.zeros((), dtype=torch.int64))

    def stats(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The batch norm's running mean and variance and its batch count."""
        norm = self.norm
        assert norm.running_mean is not None and norm.running_var is not None
        assert norm.num_batches_tracked is not None
        return norm.running_mean, norm.running_var, int(norm.num_batches_tracked.item())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.uses.add_(1)
        out: torch.Tensor = self.norm(self.lin(x))
        return out


@pytest.mark.parametrize("mode", ["snapshot-offload", "component-offload"])
async def test_buffers_a_use_updates_are_kept_after_it(mode: str) -> None:
    """SGLang's test/unit/test_component_residency.py::
    test_snapshot_offload_preserves_host_storage_and_live_buffers (``counter.add_(1)`` in
    each use, then ``counter == iteration + 1``): the counter and the batch norm's running
    statistics written during uses are what a plain model has after the same forwards, use
    after use and over a sleep and wake; snapshot-offload still drops parameter writes."""
    model, plain = Counting().train(), Counting().train()
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    weight = model.lin.weight.detach().clone()
    async with LifecycleController(device_layer=faulty_device(), residency=f"m={mode}") as ctl:
        await ctl.attach({"m": model})
        for i, x in enumerate(xs):
            async with ctl.use("m"):
                with torch.no_grad():
                    model(x)
                    if mode == "snapshot-offload":
                        model.lin.weight.add_(1.0)  # dropped after the use, by design
            with torch.no_grad():
                plain(x)
            mean, var, batches = model.stats()
            assert (model.uses.item(), batches) == (i + 1, i + 1)
            assert torch.equal(mean, plain.stats()[0]) and torch.equal(var, plain.stats()[1])
        await ctl.sleep()
        await ctl.wake()
        assert model.uses.item() == 3
        assert torch.equal(model.stats()[0], plain.stats()[0])
        if mode == "snapshot-offload":
            assert torch.equal(model.lin.weight, weight)


async def test_a_failed_copy_back_of_a_snapshot_buffer_keeps_the_live_values() -> None:
    """A fault in the copy of the buffers a snapshot-offload use wrote leaves the component
    on the device with its live values (the mirror no longer the truth): the next sleep
    copies it whole, and the wake brings the counter and statistics back."""
    model, plain = Counting().train(), Counting().train()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain(x)
    layer = faulty_device()
    async with LifecycleController(device_layer=layer, residency="m=snapshot-offload") as ctl:
        await ctl.attach({"m": model})
        async with ctl.use("m"):
            with torch.no_grad():
                model(x)
            layer.arm(copy_at=1)
        assert layer.faults == 1
        assert ctl.report().components["m"].device_bytes == ctl.report().components["m"].total_bytes
        await ctl.sleep()
        await ctl.wake()
        async with ctl.use("m"):
            assert model.uses.item() == 1
            assert torch.equal(model.stats()[0], plain.stats()[0])


# -- 5: a failed use() ------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["copy_at", "alloc_at"])
@pytest.mark.parametrize("mode", ["component-offload", "snapshot-offload", "layerwise-offload"])
async def test_a_failed_use_keeps_no_device_buffer_alive_through_its_exception(
        mode: str, fault: str) -> None:
    """SGLang's test/unit/test_component_residency.py::
    test_component_offload_restores_cpu_after_failed_device_transfer (a failed move-in puts
    the component back on the host): the move-in's device buffers are freed with the
    rollback, not kept alive by the frames of the error the caller holds (the cyclic
    collector off: nothing but the frames could free them late)."""
    import gc

    from lifecycle import TransitionFailed

    layer = faulty_device()
    async with LifecycleController(device_layer=layer, residency=f"m={mode}",
                                   prefetch_components=False) as ctl:
        await ctl.attach({"m": EveryShape()})
        idle = layer.live_device_bytes
        held = ctl.report().components["m"].device_bytes
        gc.collect()
        gc.disable()
        try:
            layer.arm(**{fault: 1})  # the use's one move-in
            with pytest.raises(TransitionFailed) as caught:
                async with ctl.use("m"):
                    pass
            assert layer.faults == 1
            assert (layer.live_device_bytes, ctl.report().components["m"].device_bytes) \
                == (idle, held), caught.value
        finally:
            gc.enable()


# -- 6: a managed component moved by hand -------------------------------------------------
class Small(nn.Module):
    """Two repeated blocks and a buffer."""

    offset: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x + self.offset


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ["component-offload", "snapshot-offload", "layerwise-offload"])
async def test_an_offloaded_component_moved_by_hand_is_refused_naming_what_changed(
        mode: str, dtype: torch.dtype) -> None:
    """diffusers' tests/hooks/test_group_offloading.py::
    test_warning_logged_if_group_offloaded_module_moved_to_accelerator (``module.to()`` on
    a managed module is noticed): after ``module.to(dtype)`` the next use and the next
    transition are refused naming the component and each change; the module keeps what the
    user gave it (never silently back to float32)."""
    from lifecycle import TransitionRejected

    model = Small()
    async with LifecycleController(device_layer=faulty_device(), residency=f"m={mode}") as ctl:
        await ctl.attach({"m": model})
        model.to(dtype)
        new = str(dtype).removeprefix("torch.")
        for step in ("use", "sleep", "use"):
            with pytest.raises(TransitionRejected) as caught:
                if step == "use":
                    async with ctl.use("m"):
                        pass
                else:
                    await ctl.sleep()
            assert (caught.value.trigger, str(caught.value)) == (step, (
                f"component 'm' was changed behind the controller while offloaded: "
                f"blocks.0.bias: float32 -> {new}, blocks.0.weight: float32 -> {new}, "
                f"blocks.1.bias: float32 -> {new}, blocks.1.weight: float32 -> {new}, "
                f"offset: float32 -> {new} (replaced); the controller does not adopt that: "
                "detach it, change it, and attach it again"))
            assert {t.dtype for t in model.state_dict().values()} == {dtype}
        await ctl.detach()


async def test_a_resident_component_moved_by_hand_is_adopted_exactly() -> None:
    """diffusers' test_group_offloading.py::
    test_warning_logged_if_group_offloaded_module_moved_to_accelerator: a resident component
    cast by hand is taken as it now is (warned), and serves, sleeps and wakes in float64."""
    model = Small()
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layer = faulty_device()
    async with LifecycleController(device_layer=layer, residency="m=resident") as ctl:
        await ctl.attach({"m": model})
        cast_by_hand(model, torch.float64, layer)  # (model.to(torch.float64) on a GPU)
        with torch.no_grad():
            expected = model(x)
        async with ctl.use("m"):
            pass
        await ctl.sleep()
        await ctl.wake()
        assert {t.dtype for t in model.state_dict().values()} == {torch.float64}
        with torch.no_grad():
            assert torch.equal(model(x), expected)


# -- 7: a residency hand-off ----------------------------------------------------------------
SWAP_FROM = "text_encoder=resident,transformer=component-offload,vae=component-offload"
SWAP_TO = "text_encoder=component-offload,transformer=resident,vae=component-offload"


async def test_a_residency_hand_off_releases_the_old_owner_before_loading_the_new() -> None:
    """SGLang's test/unit/test_component_residency.py::
    test_adjacent_same_component_replacement_finishes_old_instance (the old owner finished
    before the new one is prepared): swapping which component is resident peaks at the
    larger of the two, not at both, and serves exactly after."""
    from lifecycle.demo import DemoPipeline

    pipe = DemoPipeline.build(2**16)
    expected = pipe.forward_sync(steps=2)
    async with LifecycleController(device_layer=faulty_device(), residency=SWAP_FROM) as ctl:
        await ctl.attach(pipe)
        sizes = {n: c.total_bytes for n, c in ctl.report().components.items()}
        ctl.reset_peak()
        change = await ctl.set_residency(SWAP_TO)
        assert change.changed == {"text_encoder": ("resident", "component-offload"),
                                  "transformer": ("component-offload", "resident")}
        assert ctl.report().peak_device_bytes == max(sizes["text_encoder"], sizes["transformer"])
        assert torch.equal(await pipe.generate(ctl=ctl, steps=2), expected)


@pytest.mark.parametrize("mirrored", [False, True], ids=["as-attached", "mirrored"])
@pytest.mark.parametrize("point", ["copy_at", "alloc_at"])
async def test_a_hand_off_whose_load_fails_at_any_point_puts_the_old_owner_back(
        point: str, mirrored: bool) -> None:
    """The same hand-off with a fault at every copy and allocation of its load (the
    release already done): TransitionFailed, the old owner on the device again, every
    mode, placement, host mirror and output as before; a retry then succeeds. Mirrored: the
    old owner holds a host mirror (a sleep and wake made it; a model built on the CPU
    attaches with one on a GPU), which the put-back gives back."""
    from lifecycle import TransitionFailed
    from lifecycle.demo import DemoPipeline

    pipe = DemoPipeline.build(2**16)
    expected = pipe.forward_sync(steps=2)
    layer = faulty_device()
    async with LifecycleController(device_layer=layer, residency=SWAP_FROM) as ctl:
        await ctl.attach(pipe)
        if mirrored:
            await ctl.sleep()
            await ctl.wake()
            assert ctl.report().components["text_encoder"].host_bytes > 0
        before = ctl.report()
        for at in range(1, 500):
            layer.arm(**{point: at})
            try:
                await ctl.set_residency(SWAP_TO)
            except TransitionFailed:
                # (components, not the allocator's own totals: a simulated GPU caches blocks)
                assert ctl.report().components == before.components
                assert ctl.config.to_string() == before_config(ctl)
                assert torch.equal(await pipe.generate(ctl=ctl, steps=2), expected)
                continue
            layer.arm()
            break
        assert at > 2 and layer.faults == at - 1  # a fault at each point, then none left
        assert {n: c.mode for n, c in ctl.report().components.items()} == {
            "text_encoder": "component-offload", "transformer": "resident",
            "vae": "component-offload"}
        assert torch.equal(await pipe.generate(ctl=ctl, steps=2), expected)


def before_config(ctl: LifecycleController) -> str:
    """The configuration the hand-off starts from, as the controller writes it."""
    from strategies import ResidencyConfig

    return ResidencyConfig.parse(SWAP_FROM).to_string()


@pytest.mark.parametrize("case", ["flux", "clip_text"])
async def test_a_real_model_cast_by_hand_while_offloaded_is_refused_and_kept_as_cast(
        case: str) -> None:
    """diffusers' test_group_offloading.py::
    test_warning_logged_if_group_offloaded_module_moved_to_accelerator, on diffusers' Flux
    transformer and transformers' CLIP text model: ``model.half()`` while component-offloaded
    is refused at the next use naming a changed tensor, and the model stays in float16."""
    from lifecycle import TransitionRejected
    from tests.models.zoo import CASES

    model = CASES[case].build(0)
    async with LifecycleController(device_layer=faulty_device(),
                                   residency="m=component-offload") as ctl:
        await ctl.attach({"m": model})
        model.half()
        first = sorted(model.state_dict())[0]
        with pytest.raises(TransitionRejected, match=rf"component 'm' was changed behind the "
                           rf"controller while offloaded: {first}: float32 -> float16"):
            async with ctl.use("m"):
                pass
        assert {t.dtype for t in model.state_dict().values() if t.is_floating_point()} \
            == {torch.float16}
        assert ctl.in_flight == 0


# -- 7: the transient peak of a hand-off that cannot release first ---------------------------
ALL_OFFLOADED = "text_encoder=component-offload,transformer=component-offload,vae=component-offload"
BOTH_RESIDENT = "text_encoder=resident,transformer=resident,vae=component-offload"
TO_LAYERWISE = "text_encoder=layerwise-offload,transformer=resident,vae=component-offload"


async def hand_off_peak(start: str, to: str | ResidencyPlan) -> tuple[int | None, int]:
    """The predicted transient peak of ``set_residency(to)`` from ``start`` and the device
    layer's measured peak while applying it."""
    from lifecycle.demo import DemoPipeline

    pipe = DemoPipeline.build(2**16)
    expected = pipe.forward_sync(steps=2)
    async with LifecycleController(device_layer=faulty_device(), residency=start) as ctl:
        await ctl.attach(pipe)
        ctl.reset_peak()
        change = await ctl.set_residency(to, validate=False)
        measured = ctl.report().peak_device_bytes
        assert torch.equal(await pipe.generate(ctl=ctl, steps=2), expected)
        return change.transient_peak_bytes, measured


@pytest.mark.parametrize(("start", "to"), [(ALL_OFFLOADED, BOTH_RESIDENT), (SWAP_FROM, TO_LAYERWISE)],
                         ids=["every-move-loads", "the-old-owner-goes-layerwise"])
async def test_a_hand_off_that_cannot_release_first_peaks_at_old_and_new_as_predicted(
        start: str, to: str) -> None:
    """SGLang's test_component_residency.py::test_warmup_records_use_and_transition_peaks
    (an idle->component transition's peak counts the component it loads) and
    ::test_warmup_attributes_prefetch_peak_to_prefetched_component (old and new held together
    are both counted): a change that only loads (both encoders onto the device), or whose
    leaving component goes layerwise in the same transaction, peaks at the text encoder's
    and the transformer's resident bytes together, as ResidencyChange predicted."""
    predicted, measured = await hand_off_peak(start, to)
    assert predicted == measured == 91904 + 63296


async def test_a_released_first_hand_off_predicts_the_larger_owner_as_its_peak() -> None:
    """SGLang's test_component_residency.py::test_warmup_splits_sequential_component_transition
    (text_encoder->idle, then idle->transformer, each its own peak): the swap released first
    is predicted, and measured, at the text encoder's bytes alone."""
    predicted, measured = await hand_off_peak(SWAP_FROM, SWAP_TO)
    assert predicted == measured == 91904


async def test_a_plan_whose_hand_off_would_pass_its_budget_is_refused_before_anything_moves(
        ) -> None:
    """SGLang's test_component_residency.py::
    test_warmup_attributes_prefetch_peak_to_prefetched_component (the transition peak holds
    both): a plan under 155200 bytes, applied from a layout whose hand-off holds the resident
    text encoder and the loaded transformer together (155200 bytes), raises
    HandOffExceedsBudget naming peak, budget and components, and nothing moved; its budget
    at the peak applies, measured at that peak."""
    from lifecycle import HandOffExceedsBudget
    from lifecycle.demo import DemoPipeline

    pipe = DemoPipeline.build(2**16)
    async with LifecycleController(device_layer=faulty_device(), residency=SWAP_FROM) as ctl:
        await ctl.attach(pipe)
        planned = await ctl.plan(160000, uses=["text_encoder", "transformer", "vae"])
        plan = dataclasses.replace(planned, config=ResidencyConfig.parse(TO_LAYERWISE),
                                   budget_bytes=155199)
        before = ctl.report()
        ctl.reset_peak()
        with pytest.raises(HandOffExceedsBudget, match=re.escape(
                "would hold 155200 device bytes at its transient peak (old and new "
                "placements of ['text_encoder', 'transformer'] held together, from 91904 "
                "held now), over the plan's device budget of 155199 bytes")):
            await ctl.set_residency(plan, validate=False)
        assert ctl.report().components == before.components
        assert ctl.report().peak_device_bytes == 91904
        assert ctl.config.to_string() == before_config(ctl)
        change = await ctl.set_residency(dataclasses.replace(plan, budget_bytes=155200),
                                         validate=False)
        assert change.transient_peak_bytes == ctl.report().peak_device_bytes == 155200


async def test_a_plan_reports_the_transient_peak_of_applying_it_from_the_layout_held_now(
        ) -> None:
    """SGLang's test_component_residency.py::test_warmup_splits_sequential_component_transition
    (a swap's peaks taken one owner at a time): the plan moving residency from the text
    encoder to the transformer reports the text encoder's 91904 bytes as its transient peak,
    in explain() and as_dict() too, and applying it measures that peak."""
    from lifecycle.demo import DemoPipeline

    pipe = DemoPipeline.build(2**16)
    async with LifecycleController(device_layer=faulty_device(), residency=SWAP_FROM) as ctl:
        await ctl.attach(pipe)
        plan = await ctl.plan(160000, uses=["text_encoder", "transformer", "vae"])
        assert plan.config.to_string() == ResidencyConfig.parse(SWAP_TO).to_string()
        assert plan.transient_peak_bytes == plan.as_dict()["transient_peak_bytes"] == 91904
        assert "applying it from the layout held now peaks at " in plan.explain()
        ctl.reset_peak()
        change = await ctl.set_residency(plan, validate=False)
        assert change.transient_peak_bytes == ctl.report().peak_device_bytes == 91904


def test_the_hand_off_peak_is_each_step_held_plus_what_it_allocates() -> None:
    """SGLang's test_component_residency.py::test_warmup_splits_sequential_component_transition
    (a swap split into text_encoder->idle and idle->transformer): the same 100-byte owner
    released before a 60-byte one loads peaks at 100, in one transaction at 160."""
    from lifecycle._handoff import Reshape, hand_off_peak

    release, load = Reshape("text_encoder", 100, 0, 0), Reshape("transformer", 0, 60, 60)
    assert hand_off_peak(100, [[release], [load]]) == 100
    assert hand_off_peak(100, [[release, load]]) == 160
    assert hand_off_peak(100, [[load], [release]]) == 160
