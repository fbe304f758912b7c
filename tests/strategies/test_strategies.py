"""Residency strategies: selection, placement around uses, layerwise streaming, request prefetch."""

from __future__ import annotations

import copy
import random
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lifecycle import ComponentNotPlaced, LifecycleController, Phase, TransitionFailed
from lifecycle.testing import FaultyDevice, InjectedFault
from strategies import (
    ComponentResidencyError,
    LayerwiseOffloadStrategy,
    ResidencyConfig,
    ResidencyMode,
    enable_layerwise_offload,
    is_layerwise_offloaded,
    layerwise_blocks,
)
from strategies._device import Tier
from strategies.protocol import (
    ComponentOffloadStrategy,
    ResidentStrategy,
    SnapshotOffloadStrategy,
    build_strategy,
)
from tests.helpers import fingerprints, small_pipeline

pytestmark = pytest.mark.anyio

DIM = 16
NONLAYER_BYTES = 2 * (DIM * DIM + DIM) * 4  # DiT.inp and DiT.out: 2176
# one Block at DIM=16, tensors at 256-byte aligned offsets in one buffer:
# 64 | 64 @256 | 2048 @512 | 128 @2560 | 2048 @2816 | 64 @4864 -> 4928 bytes
LAYER_BYTES = 4928
SMALL_TRANSFORMER_BYTES = (16 * 32 + 32 + 32 * 16 + 16) * 4  # helpers' transformer: 4288
# An offloaded component moves as one buffer, each tensor at a 256-byte aligned offset:
# 2048 (w0) | 128 (b0) -> 2304 | 2048 (w2) -> 4352 | 64 (b2) = 4416 bytes.
OFFLOADED_TRANSFORMER_BYTES = 4416
OFFLOADED_MLP_BYTES = 2368  # 1024 | 64 @1024 | 1024 @1280 | 64 @2304


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """The CPU copy thread and OpenMP's spinning intra-op workers oversubscribe a small
    machine (single forwards stall for 100+ ms); one intra-op thread keeps this file fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def raises_exactly(kind: type[Exception], message: str) -> pytest.RaisesExc[Exception]:
    """Expect ``kind`` with exactly ``message``."""
    return pytest.raises(kind, match=f"^{re.escape(message)}$")


class TrackingDevice(FaultyDevice):
    """Counts the bytes of live device-tier buffers the layer allocated, and their peak
    (checked at every allocation, so buffers of prefetches still in flight count too).

    Each copy batch is emptied once copied: the worker threads (anyio's, the copier's) keep
    their last arguments referenced for a moment after reporting completion, which on the
    CPU stand-in keeps an evicted layer's buffer alive past its eviction."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def alloc(self, nbytes: int, tier: Tier, **kwargs: Any) -> torch.Tensor:
        buf = super().alloc(nbytes, tier, **kwargs)
        if tier == "device":
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(buf, self._freed, nbytes)
        return buf

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def _copy_batch(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super()._copy_batch(pairs)
        pairs.clear()


# --- models ---------------------------------------------------------------------------


class Block(nn.Module):
    """A DiT-like block: pre-norm MLP with a residual."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))  # type: ignore[no-any-return]


class DiT(nn.Module):
    """Input projection, ``n`` blocks, output projection; ``order`` picks which blocks run."""

    def __init__(self, n: int = 6, dim: int = DIM) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, order: Sequence[int] | None = None) -> torch.Tensor:
        h = self.inp(x)
        for i in range(len(self.blocks)) if order is None else order:
            h = self.blocks[i](h)
        return self.out(h)  # type: ignore[no-any-return]


class Counting(nn.Module):
    """A two-layer MLP that counts how often its forward body ran."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class Stack(nn.Module):
    """A holder of one block list (so that its name is dotted)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))


class TwoLists(nn.Module):
    """An encoder and a decoder block list, plus a head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Stack(2)
        self.decoder = Stack(3)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.encoder.layers, *self.decoder.layers]:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))


def fsdp_managed(module: nn.Module) -> nn.Module:
    """Make ``module`` an FSDP2 module without a process group (class swap)."""
    module.__class__ = type(f"FSDP{type(module).__name__}", (FSDPModule, type(module)), {})
    return module


def pointers(module: nn.Module) -> list[int]:
    return [t.data_ptr() for t in [*module.parameters(), *module.buffers()]]


def x_in(batch: int = 3) -> torch.Tensor:
    return torch.linspace(-2, 2, batch * DIM).reshape(batch, DIM)


def layerwise_config(prefetch: float = 1.0, resident: float = 0.0,
                     policy: str = "leading") -> ResidencyConfig:
    return ResidencyConfig.parse("transformer=layerwise-offload", prefetch={"transformer": prefetch},
                                 resident_layers={"transformer": resident},
                                 policy={"transformer": policy})


async def attach_layerwise(config: ResidencyConfig, n: int = 6, layer: FaultyDevice | None = None
                           ) -> tuple[LifecycleController, DiT, DiT, LayerwiseOffloadStrategy]:
    """A controller serving a layerwise DiT, a resident copy of the same weights, the strategy."""
    torch.manual_seed(0)
    model = DiT(n)
    reference = copy.deepcopy(model)
    ctl = LifecycleController(device_layer=layer or FaultyDevice(), residency=config)
    await ctl.attach({"transformer": model})
    strategy = ctl.strategy("transformer")
    assert isinstance(strategy, LayerwiseOffloadStrategy)
    return ctl, model, reference, strategy


def sample_device_bytes(ctl: LifecycleController, model: DiT, name: str = "transformer") -> list[int]:
    """Pre-hooks registered after attach (so after the library's): the component's device
    bytes as each block starts."""
    samples: list[int] = []

    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        samples.append(ctl.report().components[name].device_bytes)

    for block in model.blocks:
        block.register_forward_pre_hook(hook)
    return samples


def device_layers(strategy: LayerwiseOffloadStrategy) -> set[int]:
    return {i for i, u in enumerate(strategy.units) if u is not None and u.where == "device"}


# --- build_strategy -------------------------------------------------------------------


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


# --- enable_layerwise_offload ---------------------------------------------------------


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


async def test_attach_refuses_layerwise_for_a_module_without_block_lists_and_moves_nothing() -> None:
    """A component with no block list configured layerwise is refused before anything moves,
    and the auto-enable of the other components is undone."""
    torch.manual_seed(0)
    pipe: dict[str, nn.Module] = {"transformer": DiT(), "vae": nn.Sequential(nn.Conv2d(4, 8, 3))}
    sums, ptrs = fingerprints(pipe), {n: pointers(m) for n, m in pipe.items()}
    ctl = LifecycleController(device_layer=FaultyDevice(),
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
    ctl = LifecycleController(device_layer=FaultyDevice(),
                              residency="transformer=layerwise-offload,vae=layerwise-offload")
    with pytest.raises(ComponentResidencyError):
        await ctl.attach(pipe)
    with torch.no_grad():
        pipe["transformer"](x_in())
    assert pointers(pipe["transformer"]) == ptrs


async def test_attach_retried_after_a_failed_placement_serves_identical_outputs() -> None:
    """A copy fault during attach is rolled back; attaching again serves the same outputs."""
    layer = FaultyDevice()
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


async def test_attach_refuses_inference_tensors_with_a_clear_error() -> None:
    """A module created under torch.inference_mode is refused with a ValueError naming the tensor."""
    with torch.inference_mode():
        model = mlp()
    ctl = LifecycleController(device_layer=FaultyDevice(), residency="transformer=component-offload")
    with pytest.raises(ValueError, match=r"'0\.weight'.*inference"):
        await ctl.attach({"transformer": model})
    assert ctl.phase is Phase.UNINITIALIZED


async def test_attach_validates_the_whole_config_before_anything_moves() -> None:
    """A selector naming no component is refused at attach; the pipeline is untouched."""
    pipe = small_pipeline()
    pipe["transformer"] = DiT()
    sums, ptrs = fingerprints(pipe), {n: pointers(m) for n, m in pipe.items()}
    ctl = LifecycleController(device_layer=FaultyDevice(),
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


# --- resident, component-offload, snapshot-offload ------------------------------------


async def test_resident_stays_on_device_and_nothing_moves_around_a_use() -> None:
    """A resident component is wholly on the device while awake; a use copies nothing."""
    layer = FaultyDevice()
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
    ctl = LifecycleController(device_layer=FaultyDevice(), residency=f"transformer={mode}")
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
    layer = FaultyDevice()
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
    layer = FaultyDevice()
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
    layer = FaultyDevice()
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
    ctl = LifecycleController(device_layer=FaultyDevice(), residency="vae=component-offload")
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


async def test_concurrent_uses_share_one_placement_until_the_last_one_ends() -> None:
    """Two overlapping uses of one offloaded component move it in once and out after both."""
    layer = FaultyDevice()
    ctl = LifecycleController(device_layer=layer, residency="transformer=component-offload")
    await ctl.attach(small_pipeline())
    first_in, second_done = anyio.Event(), anyio.Event()
    start = layer.copies

    async def second() -> None:
        await first_in.wait()
        async with ctl.use("transformer"):
            assert ctl.in_flight == 2
        second_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        async with ctl.use("transformer"):
            first_in.set()
            await second_done.wait()
            assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES
    assert (layer.copies - start, ctl.in_flight) == (1, 0)
    assert ctl.report().components["transformer"].device_bytes == 0


@pytest.mark.parametrize("mode", ["component-offload", "snapshot-offload"])
async def test_forward_of_an_offloaded_component_outside_use_is_refused_and_never_runs(
        mode: str) -> None:
    """Outside use() the weights are on the host: the forward raises, naming the component."""
    model = Counting()
    ctl = LifecycleController(device_layer=FaultyDevice(), residency=f"text_encoder={mode}")
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


# --- layerwise-offload ----------------------------------------------------------------

# (prefetch, resident_layers, policy) -> (resolved prefetch count, resident indices) for 6 layers
TUNINGS: dict[tuple[float, float, str], tuple[int, tuple[int, ...]]] = {
    (0.0, 0.0, "leading"): (1, ()),
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
    most resident + prefetch + 1 layers are alive at once, and none after a use, whatever
    order the blocks run in."""
    layer = TrackingDevice()
    ctl, model, reference, _ = await attach_layerwise(layerwise_config(*tuning), n=6, layer=layer)
    prefetch, resident = resolved
    x = x_in()
    with torch.inference_mode():
        for call in range(3):
            assert torch.equal(model(x, permuted_order(6, call)), reference(x, permuted_order(6, call)))
        async with ctl.use("transformer"):
            for call in range(3):
                assert torch.equal(model(x), reference(x))
                assert torch.equal(model(x, even_order(6, call)), reference(x, even_order(6, call)))
    assert layer.live == 0
    assert LAYER_BYTES <= layer.peak <= (len(resident) + prefetch + 1) * LAYER_BYTES


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
    layer = FaultyDevice()
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
    layer = FaultyDevice()
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
    ctl = LifecycleController(device_layer=FaultyDevice(), residency="transformer=layerwise-offload")
    await ctl.attach({"transformer": module})
    assert ctl.report().components["transformer"].device_bytes == (DIM * DIM + DIM) * 4
    with torch.no_grad():
        async with ctl.use("transformer"):
            assert torch.equal(module(x_in()), reference(x_in()))
    assert ctl.report().components["transformer"].device_bytes == (DIM * DIM + DIM) * 4


# --- sleep / wake of every strategy ---------------------------------------------------

MIXED = ("image_encoder=resident,text_encoder=component-offload,vae=snapshot-offload,"
         "transformer=layerwise-offload")
AWAKE = {"image_encoder": 2176, "text_encoder": 0, "vae": 0, "transformer": NONLAYER_BYTES}


def mixed_pipeline() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"image_encoder": mlp(), "text_encoder": mlp(), "vae": mlp(), "transformer": DiT()}


async def test_sleep_releases_every_strategy_and_wake_restores_each_awake_placement() -> None:
    """Sleep leaves no device byte in any mode (layerwise non-layer weights included); wake
    restores each mode's placement and the outputs are bit-identical."""
    pipe = mixed_pipeline()
    reference = copy.deepcopy(pipe)
    ctl = LifecycleController(device_layer=FaultyDevice(), residency=MIXED)
    await ctl.attach(pipe)

    def device() -> dict[str, int]:
        return {n: c.device_bytes for n, c in ctl.report().components.items()}

    assert device() == AWAKE
    for _ in range(2):
        assert (await ctl.sleep()).success
        assert device() == {"image_encoder": 0, "text_encoder": 0, "vae": 0, "transformer": 0}
        assert ctl.report().host_bytes == 2176 + 2 * OFFLOADED_MLP_BYTES + NONLAYER_BYTES + \
            6 * LAYER_BYTES
        assert (await ctl.wake()).success
        assert device() == AWAKE
        with torch.no_grad():
            for name in pipe:
                async with ctl.use(name) as module:
                    assert torch.equal(module(x_in()), reference[name](x_in()))
        assert device() == AWAKE


async def test_report_shows_the_mode_of_every_component_and_no_pinned_bytes_on_cpu() -> None:
    """The report names each component's mode; on the CPU layers no host byte is pinned
    (on the CUDA one, every host byte is)."""
    layer = FaultyDevice()
    ctl = LifecycleController(device_layer=layer, residency=MIXED)
    await ctl.attach(mixed_pipeline())
    report = ctl.report()
    assert {n: c.mode for n, c in report.components.items()} == {
        "image_encoder": "resident", "text_encoder": "component-offload",
        "vae": "snapshot-offload", "transformer": "layerwise-offload"}
    assert {n: c.total_bytes for n, c in report.components.items()} == {
        "image_encoder": 2176, "text_encoder": OFFLOADED_MLP_BYTES, "vae": OFFLOADED_MLP_BYTES,
        "transformer": NONLAYER_BYTES + 6 * LAYER_BYTES}
    if not layer.pinned:
        assert report.pinned_bytes == 0
        assert all(c.pageable_bytes == c.host_bytes for c in report.components.values())
    else:
        assert all(c.pinned_bytes >= c.host_bytes for c in report.components.values())


# --- request-level prefetch -----------------------------------------------------------

ORDER = ["text_encoder", "transformer", "vae"]


async def offload_all(drain_timeout: float = 30.0) -> tuple[LifecycleController, FaultyDevice]:
    layer = FaultyDevice()
    ctl = LifecycleController(device_layer=layer, residency="all=component-offload",
                              drain_timeout=drain_timeout)
    await ctl.attach(small_pipeline())
    return ctl, layer


async def wait_for(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not condition():
            await anyio.sleep(0.01)


async def test_request_moves_the_next_component_in_while_the_current_one_runs() -> None:
    """Inside use('text_encoder') the transformer is copied in the background under a
    prefetch lease; entering use('transformer') then copies nothing more."""
    ctl, layer = await offload_all()
    async with ctl.request(ORDER):
        async with ctl.use("text_encoder"):
            start = layer.copies
            await anyio.sleep(0.05)
            assert ctl.in_flight == 3  # the request, the use, the prefetch
            await wait_for(lambda: layer.copies - start == 1)
            # Copied in, not yet placed: the report counts the buffer it holds.
            assert ctl.strategy("transformer").store.units[0].where == "host"
            assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES
        before = layer.copies
        async with ctl.use("transformer"):
            assert layer.copies == before
            assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES
    assert ctl.in_flight == 0
    assert ctl.report().device_bytes == 0


@pytest.mark.parametrize("copying", [False, True], ids=["prefetched", "still-copying"])
async def test_request_ending_without_the_prefetched_use_leaves_nothing_behind(copying: bool) -> None:
    """A prefetch the request never used is dropped: no device byte, no lease."""
    ctl, layer = await offload_all()
    async with ctl.request(ORDER), ctl.use("text_encoder"):
        layer.copy_delay = 0.05 if copying else 0.0
        await anyio.sleep(0.01 if copying else 0.05)
        assert ctl.in_flight == 3  # the request, the use, the prefetch
    assert ctl.in_flight == 0
    assert ctl.report().device_bytes == 0
    layer.copy_delay = 0.0
    async with ctl.use("transformer"):
        assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES


@pytest.mark.parametrize("copying", [False, True], ids=["prefetched", "still-copying"])
async def test_sleep_while_a_prefetch_is_pending_succeeds_and_drops_it(copying: bool) -> None:
    """A sleep inside a request (which does not wait for its own request) drops the pending
    prefetch and leaves no device byte; only the request's own lease is left."""
    ctl, layer = await offload_all(drain_timeout=5.0)
    async with ctl.request(ORDER):
        async with ctl.use("text_encoder"):
            layer.copy_delay = 0.05 if copying else 0.0
            await anyio.sleep(0.01 if copying else 0.05)
        result = await ctl.sleep()
        assert (result.success, result.sleeping) == (True, True)
        assert ctl.report().device_bytes == 0
        assert ctl.in_flight == 1  # the request itself
    assert ctl.in_flight == 0
    assert ctl.report().device_bytes == 0
    layer.copy_delay = 0.0
    assert (await ctl.wake()).success
    async with ctl.use("transformer"):
        assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES


# --- faults ---------------------------------------------------------------------------


# An offloaded component moves as one buffer: one allocation and one copy to fail.
@pytest.mark.parametrize(("kind", "k"), [("copy", 1), ("alloc", 1)])
async def test_fault_while_placing_a_use_is_rolled_back_and_the_next_use_works(
        kind: str, k: int) -> None:
    """A failed move-in raises TransitionFailed, leaves the report as it was and no lease."""
    ctl, layer = await offload_all()
    before = ctl.report().components["text_encoder"]
    layer.arm(**{f"{kind}_at": k})
    with pytest.raises(TransitionFailed) as info:
        async with ctl.use("text_encoder"):
            pytest.fail("the use body ran although placement failed")
    assert info.value.trigger == "use"
    assert ctl.report().components["text_encoder"] == before
    assert before.device_bytes == 0
    assert ctl.in_flight == 0
    async with ctl.use("text_encoder"):
        assert ctl.report().components["text_encoder"].device_bytes == before.total_bytes
    assert ctl.report().components["text_encoder"] == before
