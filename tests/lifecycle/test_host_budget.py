"""The host budget: transitions whose host copies would pass it are refused before they
allocate, with nothing changed; the report splits host bytes by kind and says what is left."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
import torch

from lifecycle import HostBudgetExceeded, LifecycleController, Phase, TransitionFailed
from lifecycle.demo import DemoPipeline
from strategies import DeviceLayer
from tests.helpers import attach_allocates, faulty_device

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

SIZE = 2**20
MODES = ["resident", "component-offload", "snapshot-offload", "layerwise-offload"]
Make = Callable[..., Awaitable[tuple[LifecycleController, DemoPipeline, torch.Tensor]]]


def state(pipe: DemoPipeline) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.detach().cpu().clone() for n, m in pipe.modules.items()
            for k, v in m.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
async def make() -> AsyncIterator[Make]:
    """``await make(residency, **controller kwargs)``: an attached demo pipeline, its
    output before attach; every controller closed after the test. ``on_device``: the
    pipeline is moved into the device's memory before attach (as ``pipe.to("cuda")``; a
    pipeline built on the CPU is host memory on a GPU, attached with mirrors already)."""
    async with AsyncExitStack() as stack:
        async def made(residency: str | None = None, layer: DeviceLayer | None = None, *,
                       on_device: bool = False, **kwargs: object
                       ) -> tuple[LifecycleController, DemoPipeline, torch.Tensor]:
            pipe = DemoPipeline.build(SIZE)
            expected = pipe.forward_sync(steps=2)
            layer = layer or faulty_device()
            if on_device:
                layer.place(*pipe.modules.values())
            ctl = LifecycleController(device_layer=layer, residency=residency,
                                      **kwargs)  # type: ignore[arg-type]
            stack.push_async_callback(ctl.aclose)
            await ctl.attach(pipe)
            return ctl, pipe, expected

        yield made


def built_in_host_memory(layer: DeviceLayer) -> bool:
    """Whether the demo pipeline, built on the CPU, is host memory for ``layer`` (a GPU's,
    a simulated GPU's whose device memory is its own): attach then makes its mirrors."""
    return attach_allocates(DemoPipeline.build(SIZE).modules["text_encoder"], layer)


async def output(ctl: LifecycleController, pipe: DemoPipeline) -> torch.Tensor:
    return (await pipe.generate(ctl=ctl, steps=2)).cpu()


@pytest.mark.parametrize("mode", MODES)
async def test_a_sleep_whose_mirrors_do_not_fit_is_refused_before_allocating(
        make: Make, mode: str) -> None:
    """A sleep needing more host bytes than the budget leaves (a pipeline on the device at
    attach: no mirrors yet) raises HostBudgetExceeded with the numbers; no host buffer was
    allocated, the pipeline is awake and serves as before."""
    ctl, pipe, expected = await make(f"transformer={mode}", on_device=True)
    layer = ctl.device_layer
    held = ctl.report().host_held_bytes
    ctl.set_host_budget(held + 1)
    before, allocations = state(pipe), layer.host_allocations
    report = ctl.report()
    with pytest.raises(HostBudgetExceeded) as info:
        await ctl.sleep()
    assert (info.value.held, info.value.budget) == (held, held + 1)
    assert info.value.needed > 1 and info.value.what == "sleep"
    assert "refused before allocating" in str(info.value)
    assert layer.host_allocations == allocations
    assert ctl.phase is Phase.AWAKE and ctl.report() == report
    assert same(state(pipe), before)
    assert torch.equal(await output(ctl, pipe), expected)
    ctl.set_host_budget(None)
    assert (await ctl.sleep()).success and (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


@pytest.mark.parametrize("mode", MODES)
async def test_a_sleep_that_fits_the_budget_commits_and_reports_what_is_left(
        make: Make, mode: str) -> None:
    """Under a budget that fits, sleep and wake are bit-exact; the report gives the budget,
    the bytes held by kind and what is left (pinned only where the layer pins)."""
    ctl, pipe, expected = await make(f"transformer={mode}", host_budget=4 * SIZE)
    assert (await ctl.sleep()).success
    report = ctl.report()
    assert report.host_budget == 4 * SIZE and report.host_budget_source == "explicit"
    assert report.host_left == 4 * SIZE - report.host_held_bytes
    assert report.host_bytes == sum(c.total_bytes for c in report.components.values())
    if ctl.device_layer.pinned:
        assert report.pinned_bytes >= report.host_bytes and report.pageable_bytes == 0
    else:
        assert (report.pinned_bytes, report.pageable_bytes) == (0, report.host_bytes)
    assert report.host_memory()["host_budget"] == 4 * SIZE
    assert (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


async def test_an_attach_whose_host_copies_do_not_fit_is_refused_with_nothing_attached(
        make: Make) -> None:
    """Offloaded components need host mirrors at attach: with a budget of 0 the attach is
    refused before allocating, the controller stays detached, the modules untouched."""
    pipe = DemoPipeline.build(SIZE)
    before = state(pipe)
    layer = faulty_device()
    async with LifecycleController(device_layer=layer, residency="vae=component-offload",
                                   host_budget=0) as ctl:
        with pytest.raises(HostBudgetExceeded) as info:
            await ctl.attach(pipe)
        assert (info.value.held, info.value.budget, info.value.what) == (0, 0, "attach")
        assert ctl.phase is Phase.UNINITIALIZED and layer.host_allocations == 0
        assert same(state(pipe), before)
        assert torch.equal(pipe.forward_sync(steps=2), pipe.forward_sync(steps=2))


async def test_a_residency_change_past_the_budget_is_refused_and_rolled_back(
        make: Make) -> None:
    """Offloading a resident component needs new host mirrors: past the budget the change
    raises HostBudgetExceeded before its first allocation, and the old residency stays
    exactly as it was."""
    ctl, pipe, expected = await make()
    ctl.set_host_budget(ctl.report().host_held_bytes)
    report, before = ctl.report(), state(pipe)
    allocations = ctl.device_layer.allocations
    with pytest.raises(HostBudgetExceeded) as info:
        await ctl.set_residency("transformer=component-offload")
    assert info.value.what == "set_residency of transformer"
    assert ctl.device_layer.allocations == allocations
    assert ctl.report() == report and ctl.config.to_string() == ""
    assert same(state(pipe), before)
    assert ctl.device_layer.host.refused == 1
    assert torch.equal(await output(ctl, pipe), expected)


async def test_an_update_past_the_budget_is_refused_and_every_tensor_kept(make: Make) -> None:
    """Writing an offloaded component's host tensors needs host backups: past the budget the
    update raises HostBudgetExceeded naming their bytes before allocating any, and every
    tensor keeps its value."""
    ctl, pipe, expected = await make("transformer=component-offload")
    ctl.set_host_budget(ctl.report().host_held_bytes)
    before, allocations = state(pipe), ctl.device_layer.host_allocations
    name, value = next(iter(pipe.modules["transformer"].state_dict().items()))
    with pytest.raises(HostBudgetExceeded) as info:
        await ctl.update_weights_from_tensors([(name, torch.zeros_like(value))], "transformer")
    assert (info.value.what, info.value.needed) == ("update_from_tensors", int(value.nbytes))
    assert ctl.device_layer.host_allocations == allocations
    assert same(state(pipe), before) and ctl.weights_version == 0
    assert ctl.phase is Phase.AWAKE
    assert torch.equal(await output(ctl, pipe), expected)


async def test_a_discarding_sleep_needs_no_mirrors_and_fits_a_budget_of_what_is_held(
        make: Make) -> None:
    """Discarded components keep no host copy: a sleep discarding every resident one fits a
    budget of the bytes held already."""
    ctl, _, _ = await make()
    ctl.set_host_budget(ctl.report().host_held_bytes + 4096)
    assert (await ctl.sleep(discard="all")).success
    assert ctl.report().host_held_bytes <= 4096


async def test_pins_go_to_streamed_layers_first_and_the_rest_stays_pageable(
        make: Make) -> None:
    """With a pin budget for the transformer's streamed layers only, they get it; the other
    components' mirrors are pageable, the report says why, and sleep/wake stays bit-exact
    (pageable copies staged through the CUDA layer's pinned buffers)."""
    from strategies.checking import sim_cuda_layer

    residency = "transformer=layerwise-offload,vae=component-offload"
    probe, _, _ = await make(residency, layer=sim_cuda_layer())
    streamed = probe.report().components["transformer"].pinned_bytes
    ctl, pipe, expected = await make(residency, layer=sim_cuda_layer(),
                                     pin_budget=streamed + 4096)
    report = ctl.report()
    components = report.components
    assert components["transformer"].pinned_bytes == streamed > 0
    assert components["transformer"].host_tier == "streamed layers get pins first"
    assert (components["vae"].pinned_bytes, components["vae"].pageable_bytes) == \
        (0, components["vae"].host_bytes)
    assert components["vae"].host_tier == "pageable: the pin budget went to units moved more " \
                                          "often"
    # A pipeline built in host memory attaches with the resident encoder's mirrors made:
    # pins last, they take what the others left.
    encoder = components["text_encoder"]
    assert (encoder.host_bytes > 0) == built_in_host_memory(ctl.device_layer)
    assert report.pin_left == 4096 - encoder.pinned_bytes >= 0
    assert (await ctl.sleep()).success and (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


async def test_released_mirrors_after_wake_are_copied_again_by_the_next_sleep(
        make: Make) -> None:
    """With release_mirrors_after_wake the wake leaves only the offloaded VAE's mirror on
    the host; the next sleep copies every resident byte from the device again (a fault at
    its first mirror allocation rolls it back, still awake and exact), then wakes exact."""
    layer = faulty_device()
    ctl, pipe, expected = await make("vae=component-offload", layer=layer,
                                     release_mirrors_after_wake=True)
    assert (await ctl.sleep()).success and (await ctl.wake()).success
    report = ctl.report()
    vae = report.components["vae"]
    assert report.host_bytes == vae.host_bytes == vae.total_bytes
    layer.arm(alloc_at=1)
    with pytest.raises(TransitionFailed):
        await ctl.sleep()
    assert ctl.phase is Phase.AWAKE and ctl.report() == report
    assert torch.equal(await output(ctl, pipe), expected)
    slept = await ctl.sleep()
    assert slept.bytes_moved == report.device_bytes
    assert (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


async def test_the_drill_reports_host_bytes_by_kind_and_its_budgets() -> None:
    """A drill under a host budget gives the budgets and each step's host bytes by kind
    (asleep: every byte a mirror, pinned only where the layer pins)."""
    from lifecycle.cli.drills import default_scenario, run_drill
    from strategies.devices import cpu_layer_kind

    report = await run_drill(default_scenario(cycles=1), size="1MB", host_budget="64MB",
                             pin_budget="32MB")
    assert report.passed, report.failures
    assert (report.host_budget, report.pin_budget) == (64_000_000, 32_000_000)
    asleep = [o for o in report.outcomes if o.phase == "sleeping"]
    assert asleep and all(o.host_bytes > 0 for o in asleep)
    if cpu_layer_kind() == "cuda-sim":  # pinned within the pin budget: footprints, by page
        assert all(o.pinned_bytes >= o.host_bytes and o.pageable_bytes == 0 for o in asleep)
    else:
        assert all((o.pinned_bytes, o.pageable_bytes) == (0, o.host_bytes) for o in asleep)
    assert report.as_dict()["host_budget"] == 64_000_000
    assert report.peak_host_bytes >= max(o.host_bytes for o in asleep)


@pytest.mark.parametrize("mode", MODES)
async def test_with_no_pin_budget_every_mirror_is_pageable_and_staged_bit_exact(
        make: Make, mode: str) -> None:
    """On the CUDA layer (over a simulated GPU) a pin budget of 0 makes every mirror
    pageable: nothing is pinned, and sleep and wake (staged through the layer's pinned
    buffers) give back the same output."""
    from strategies.checking import sim_cuda_layer

    ctl, pipe, expected = await make(f"transformer={mode}", layer=sim_cuda_layer(),
                                     pin_budget=0)
    assert (await ctl.sleep()).success
    report = ctl.report()
    assert (report.pinned_bytes, report.host_held_pinned) == (0, 0)
    assert report.pageable_bytes == report.host_bytes > 0
    assert (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


# The mode changes of the transformer that allocate host memory (the others regroup over
# the same units, or only come onto the device): awake, what goes on the host in a new
# grouping; asleep, every regrouped mirror.
OFFLOADS = ["component-offload", "snapshot-offload"]
HOST_PAIRS = [(False, "resident", b) for b in MODES[1:]] + \
    [(False, a, "layerwise-offload") for a in OFFLOADS] + \
    [(False, "layerwise-offload", b) for b in OFFLOADS] + \
    [(True, a, b) for a in MODES for b in MODES
     if a != b and not (a in OFFLOADS and b in OFFLOADS)]


async def reshape_need(make: Make, residency: str | None, change: str, *,
                       asleep: bool = False, cycled: bool = False) -> int:
    """The most host bytes ``set_residency(change)`` adds at once, measured by the ledger's
    peak on a controller of its own (``residency`` at attach; asleep, or after a sleep and
    a wake) with no host budget and nothing pinned."""
    ctl, _, _ = await make(residency, pin_budget=0)
    if asleep or cycled:
        assert (await ctl.sleep()).success
    if cycled:
        assert (await ctl.wake()).success
    ledger = ctl.device_layer.host
    held = ledger.held().total
    ledger.peak = held
    assert (await ctl.set_residency(change)).success
    return ledger.peak - held


@pytest.mark.parametrize(("asleep", "source", "target"), HOST_PAIRS,
                         ids=[f"{'asleep' if z else 'awake'}:{a}>{b}" for z, a, b in HOST_PAIRS])
async def test_a_residency_change_is_refused_before_allocating_one_byte_short_of_its_peak(
        make: Make, source: str, target: str, asleep: bool) -> None:
    """With nothing pinned (past the pin budget a mirror is made pageable instead), a budget
    one byte short of the change's measured host peak refuses it with the numbers before
    any allocation (config, placement, weights and output unchanged); a budget of exactly
    that peak lets it commit, bit-exact."""
    need = await reshape_need(make, f"transformer={source}", f"transformer={target}",
                              asleep=asleep)
    ctl, pipe, expected = await make(f"transformer={source}", pin_budget=0)
    if asleep:
        assert (await ctl.sleep()).success
    layer = ctl.device_layer
    held = layer.host.held().total
    assert need > 0
    ctl.set_host_budget(held + need - 1, pin_budget=0)
    report, before, allocations = ctl.report(), state(pipe), layer.allocations
    with pytest.raises(HostBudgetExceeded) as info:
        await ctl.set_residency(f"transformer={target}")
    assert (info.value.needed, info.value.held, info.value.budget) == \
        (need, held, held + need - 1)
    assert info.value.what == "set_residency of transformer"
    assert (layer.allocations, layer.host.held().total) == (allocations, held)
    assert ctl.report().components == report.components
    assert ctl.config.to_string() == f"transformer={source}"
    assert same(state(pipe), before)
    ctl.set_host_budget(held + need, pin_budget=0)
    assert (await ctl.set_residency(f"transformer={target}")).success
    assert layer.host.peak <= held + need
    if asleep:
        assert (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


async def test_a_hand_off_is_checked_whole_before_its_first_transaction(make: Make) -> None:
    """Offloading the text encoder (committed first) while streaming the transformer is
    checked over both transactions at once (nothing pinned; the first one's freed mirrors
    are not credited, so the check never admits more than the measured peak): a budget one
    byte short of their new mirrors together is refused before the first allocation, the
    text encoder still resident; exactly that commits bit-exact."""
    change = "text_encoder=component-offload,transformer=layerwise-offload"

    async def woken() -> tuple[LifecycleController, DemoPipeline, torch.Tensor]:
        made = await make(pin_budget=0)
        assert (await made[0].sleep()).success and (await made[0].wake()).success
        return made

    peak = await reshape_need(make, None, change, cycled=True)
    encoder = await reshape_need(make, None, "text_encoder=component-offload", cycled=True)
    streamed = await reshape_need(make, None, "transformer=layerwise-offload", cycled=True)
    need = encoder + streamed
    assert 0 < encoder < peak <= need
    ctl, pipe, expected = await woken()
    layer = ctl.device_layer
    ctl.set_host_budget(layer.host.held().total + need - 1, pin_budget=0)
    allocations = layer.allocations
    with pytest.raises(HostBudgetExceeded) as info:
        await ctl.set_residency(change)
    assert (info.value.needed, layer.allocations) == (need, allocations)
    assert info.value.what == "set_residency of text_encoder, transformer"
    assert ctl.config.to_string() == "" and layer.host.refused == 1
    ctl.set_host_budget(layer.host.held().total + need, pin_budget=0)
    assert (await ctl.set_residency(change)).success
    assert torch.equal(await output(ctl, pipe), expected)


@pytest.mark.parametrize("target", MODES[1:])
async def test_a_residency_change_past_the_pin_budget_makes_its_new_mirrors_pageable(
        make: Make, target: str) -> None:
    """On the CUDA layer (over a simulated GPU) with a pin budget spent already, offloading
    the transformer is not refused: its new mirrors are pageable, nothing more is pinned,
    and it serves, sleeps and wakes bit-exact."""
    from strategies.checking import sim_cuda_layer

    ctl, pipe, expected = await make(layer=sim_cuda_layer())
    pinned = ctl.report().host_held_pinned
    # A pipeline built in host memory attaches with the resident transformer's mirrors made,
    # pinned: the regroup keeps those over the same storages, releases the others.
    before = ctl.report().components["transformer"].pinned_bytes
    assert (before > 0) == built_in_host_memory(ctl.device_layer)
    ctl.set_host_budget(None, pin_budget=pinned)
    assert (await ctl.set_residency(f"transformer={target}")).success
    transformer = ctl.report().components["transformer"]
    assert ctl.report().host_held_pinned == pinned - before + transformer.pinned_bytes
    assert transformer.pinned_bytes <= before and transformer.pageable_bytes > 0
    assert ctl.device_layer.host.unpinned > 0
    assert torch.equal(await output(ctl, pipe), expected)
    assert (await ctl.sleep()).success and (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)
