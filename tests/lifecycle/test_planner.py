"""The planner: placement under a device budget, measured peaks within it, exact and
monotone choices, infeasible budgets, validation that undoes a plan, and auto residency."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from torch import nn

from lifecycle import InfeasibleBudget, LifecycleController, LifecycleError, ResidencyPlan
from lifecycle._planner import (
    ComponentSizes,
    Measurements,
    Use,
    make_plan,
    options_for,
    parse_budget,
    predict,
)
from lifecycle.demo import DemoPipeline
from strategies import ResidencyMode
from strategies.checking import SimCuda, sim_cuda_layer

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

SIZE = 4 * 2**20


async def _demo(size: int = SIZE) -> tuple[LifecycleController, DemoPipeline, torch.Tensor,
                                           Callable[[], Awaitable[Any]]]:
    pipe = DemoPipeline.build(size)
    expected = pipe.forward_sync(steps=3)
    ctl = LifecycleController("cpu", residency="all=component-offload")
    await ctl.attach(pipe)

    async def warmup() -> Any:
        return await pipe.generate(ctl=ctl)

    return ctl, pipe, expected, warmup


async def test_plans_from_full_size_to_the_smallest_feasible_budget_fit_and_stay_exact() -> None:
    """For ten budgets from the pipeline's size down to the smallest feasible one, the plan
    applied and run has a measured peak within the budget (and within its prediction), and
    outputs bit-identical to resident; predicted latency never falls as the budget shrinks."""
    ctl, pipe, expected, warmup = await _demo()
    async with ctl:
        full = ctl.report().components
        total = sum(c.total_bytes for c in full.values())
        with pytest.raises(InfeasibleBudget) as info:
            await ctl.plan(0, warmup)
        smallest = info.value.minimum_bytes
        assert 0 < smallest < total
        budgets = [int(smallest + (total - smallest) * i / 9) for i in range(9, -1, -1)]
        previous = 0.0
        modes = set()
        for budget in budgets:
            plan = await ctl.plan(budget, warmup)
            assert plan.predicted_peak_bytes <= budget
            assert plan.predicted_seconds >= previous - 1e-12  # smaller budget: never faster
            previous = plan.predicted_seconds
            change = await ctl.set_residency(plan, latency_tolerance=100.0)
            assert change.validated and change.success, change.message
            assert change.measured_peak_bytes is not None
            assert change.measured_peak_bytes <= plan.predicted_peak_bytes <= budget
            ctl.reset_peak()
            assert torch.equal(await pipe.generate(ctl=ctl), expected)
            assert ctl.report().peak_device_bytes <= budget
            modes.add(tuple(sorted((d.name, d.mode.value) for d in plan.decisions)))
        assert len(modes) >= 3  # the budgets really chose different layouts


def _exhaustive(m: Measurements, budget: int, host_budget: int | None = None) -> float:
    names = [s.name for s in m.sizes]
    options = [options_for(s, [u for u in m.uses if u.name == s.name], m.bandwidth)
               for s in m.sizes]
    best = float("inf")
    for combo in itertools.product(*options):
        layout = dict(zip(names, combo, strict=True))
        if predict(layout, m.uses, m.activation_reserve) <= budget and \
                (host_budget is None or sum(o.host for o in combo) <= host_budget):
            best = min(best, sum(o.seconds for o in combo))
    return best + m.other_seconds


def _measurements(layers: tuple[int, ...], seconds: tuple[float, ...], prefetched: bool
                  ) -> Measurements:
    sizes = (ComponentSizes("text_encoder", 300, 310),
             ComponentSizes("transformer", sum(layers) + 100, sum(layers) + 120, 100, layers,
                            ("blocks",)),
             ComponentSizes("vae", 200, 210, 40, (80, 80), ("up",)))
    uses = (Use("text_encoder", 1, seconds[0]),
            Use("transformer", 4, seconds[1], prefetched, seconds[0]),
            Use("vae", 1, seconds[2], prefetched, seconds[1]))
    return Measurements(sizes, uses, bandwidth=1000.0, other_seconds=0.01)


@pytest.mark.parametrize("prefetched", [False, True])
@pytest.mark.parametrize("seconds", [(0.0, 0.0, 0.0), (0.1, 2.0, 0.3), (1.0, 0.05, 0.0)])
def test_no_feasible_layout_of_the_decision_space_beats_the_plan(
        prefetched: bool, seconds: tuple[float, float, float]) -> None:
    """An exhaustive search over every combination of every option finds no layout within
    the budget that is predicted faster than the plan by more than 2%, at every budget."""
    m = _measurements((120, 90, 150, 60, 100, 110), seconds, prefetched)
    total = sum(s.resident for s in m.sizes)
    for budget in range(100, total + 200, 37):
        try:
            plan = make_plan(m, budget, planner_started=0.0)
        except InfeasibleBudget as exc:
            assert _exhaustive(m, budget) == float("inf")
            assert _exhaustive(m, exc.minimum_bytes) < float("inf")
            assert _exhaustive(m, exc.minimum_bytes - 1) == float("inf")
            continue
        assert plan.predicted_peak_bytes <= budget
        assert _exhaustive(m, budget) >= plan.predicted_seconds / 1.02


def test_a_bigger_budget_never_predicts_a_slower_plan() -> None:
    """Predicted latency is non-increasing in the budget, over every byte of a range."""
    m = _measurements((120, 90, 150, 60, 100, 110), (0.1, 0.5, 0.2), True)
    seen = []
    for budget in range(200, 1400, 5):
        try:
            seen.append(make_plan(m, budget, planner_started=0.0).predicted_seconds)
        except InfeasibleBudget:
            assert not seen  # infeasible only below every feasible budget
    assert seen == sorted(seen, reverse=True)
    assert seen[0] > seen[-1]


async def test_an_infeasible_budget_names_the_smallest_feasible_one() -> None:
    """InfeasibleBudget is a LifecycleError whose minimum_bytes plans, one byte less does
    not, and whose message names the layout that runs there."""
    ctl, _, _, warmup = await _demo()
    async with ctl:
        with pytest.raises(InfeasibleBudget) as info:
            await ctl.plan(1000, warmup)
        exc = info.value
        assert isinstance(exc, LifecycleError)
        assert "smallest feasible budget" in str(exc) and "transformer=" in str(exc)
        plan = await ctl.plan(exc.minimum_bytes)
        assert plan.predicted_peak_bytes == exc.minimum_bytes
        with pytest.raises(InfeasibleBudget):
            await ctl.plan(exc.minimum_bytes - 1)


async def test_plan_changes_nothing_and_explains_itself() -> None:
    """plan() moves nothing; explain() has a row per component with bytes, mode, tuning,
    moved bytes and why, the prediction, and the runners-up with how much slower each is."""
    ctl, _, _, warmup = await _demo()
    async with ctl:
        before = ctl.report()
        plan = await ctl.plan("60%", warmup)
        assert ctl.report().components == before.components
        assert isinstance(plan, ResidencyPlan)
        text = plan.explain()
        for name in ("text_encoder", "transformer", "vae"):
            assert name in text
        assert "predicted: peak" in text and "runners-up:" in text
        assert plan.runners_up and all(r.worse_by >= 0 for r in plan.runners_up)
        assert all(r.predicted_seconds >= plan.predicted_seconds for r in plan.runners_up)
        as_dict = plan.as_dict()
        assert as_dict["config"] == plan.config.to_string()
        assert plan.moved_bytes_per_request == sum(d.option.moved for d in plan.decisions)


async def test_measurements_are_taken_once_and_reused() -> None:
    """Plans for different budgets share one measurement (the warm-up runs once) until
    remeasure=True."""
    ctl, pipe, _, _ = await _demo()
    async with ctl:
        runs = 0

        async def warmup() -> None:
            nonlocal runs
            runs += 1
            await pipe.generate(ctl=ctl)

        await ctl.plan("90%", warmup)
        await ctl.plan("70%", warmup)
        assert runs == 1
        await ctl.plan("70%", warmup, remeasure=True)
        assert runs == 2


async def test_the_warm_up_measures_uses_in_order_with_forwards_and_prefetch() -> None:
    """The warm-up records each use in order, the denoiser's forwards per use, and which
    uses a request prefetch can bring in while the previous one runs."""
    ctl, _pipe, _, warmup = await _demo()
    async with ctl:
        await ctl.plan("90%", warmup)
        m = ctl._measurer.measurements
        assert m is not None and m.source == "warm-up"
        assert [u.name for u in m.uses] == ["text_encoder", "transformer", "vae"]
        assert [u.forwards for u in m.uses] == [1, 3, 1]
        assert [u.prefetched for u in m.uses] == [False, True, True]
        assert all(u.seconds > 0 for u in m.uses) and m.bandwidth > 0


async def test_a_validation_request_over_budget_or_too_slow_restores_the_previous_layout() -> None:
    """After applying a plan, a validation request whose peak passes the budget (the
    denoiser running while the text encoder is still in), or which runs far slower than
    predicted, undoes the plan and says why."""
    ctl, pipe, expected, warmup = await _demo()
    async with ctl:
        before = ctl.config
        with pytest.raises(InfeasibleBudget) as info:
            await ctl.plan(0, warmup)
        plan = await ctl.plan(info.value.minimum_bytes)  # the tightest: components offloaded

        async def overlapping() -> None:
            async with ctl.use("text_encoder") as te, ctl.use("transformer") as dit:
                pipe._denoise(dit, pipe._encode(te, None), steps=1, seed=0)

        change = await ctl.set_residency(plan, validate=overlapping, latency_tolerance=100.0)
        assert change.rolled_back and not change.success
        assert "exceeds the budget" in change.message
        assert ctl.config == before

        async def slow() -> None:
            await warmup()
            await anyio.sleep(plan.predicted_seconds * 2 + 0.05)

        plan = await ctl.plan("60%")
        change = await ctl.set_residency(plan, validate=slow)
        assert change.rolled_back and "predicted" in change.message
        assert ctl.config == before
        assert torch.equal(await pipe.generate(ctl=ctl), expected)


async def test_auto_residency_plans_at_attach_under_the_budget() -> None:
    """residency='auto' with a device_budget plans from sizes at attach, places the pipeline
    so, and generations stay within the budget with identical outputs."""
    pipe = DemoPipeline.build(SIZE)
    expected = pipe.forward_sync(steps=3)
    # In bytes: a share would be of the device's free memory where the layer knows it.
    budget = int(0.7 * pipe.nbytes)
    async with LifecycleController("cpu", residency="auto", device_budget=budget) as ctl:
        await ctl.attach(pipe)
        plan = ctl.last_plan
        assert plan is not None
        assert plan.budget_bytes == budget
        assert ctl.config == plan.config
        modes = {n: ctl.strategy(n).mode for n in ctl.components}
        assert modes != dict.fromkeys(modes, ResidencyMode.RESIDENT)
        ctl.reset_peak()
        assert torch.equal(await pipe.generate(ctl=ctl), expected)
        assert ctl.report().peak_device_bytes <= plan.budget_bytes
        await ctl.aclose()
        with pytest.raises(ValueError, match="device_budget"):
            LifecycleController("cpu", residency="auto")
        with pytest.raises(ValueError, match="auto"):
            LifecycleController("cpu", device_budget="1GiB")


@pytest.mark.parametrize(("budget", "expected"), [
    (1000, 1000), ("300MB", 300 * 10**6), ("20GiB", 20 * 2**30), ("50%", 500), ("100%", 1000),
])
def test_budgets_are_bytes_sizes_or_shares(budget: Any, expected: int) -> None:
    """A budget is bytes, a size string or a percentage (of free memory; on the CPU, of the
    pipeline)."""
    assert parse_budget(budget, free_bytes=None, pipeline_bytes=1000) == expected


@pytest.mark.parametrize("budget", ["-5%", "0%", "120%", "lots", -1, float("nan"), True])
def test_bad_budgets_are_refused_with_what_is_valid(budget: Any) -> None:
    """A negative, zero or over-100 percentage, a size without a number, a negative or NaN
    byte count and a bool are refused."""
    with pytest.raises((ValueError, TypeError)):
        parse_budget(budget, free_bytes=None, pipeline_bytes=1000)


async def test_declared_uses_replace_the_warm_up() -> None:
    """uses=[...] declares the request (names, seconds, forwards) instead of a warm-up; an
    unknown component is refused with the known ones."""
    ctl, _, _, _ = await _demo()
    async with ctl:
        plan = await ctl.plan("70%", uses=["text_encoder", ("transformer", 0.2, 4), ("vae", 0.01)])
        m = ctl._measurer.measurements
        assert m is not None and m.source == "declared" and plan.measured_from == "declared"
        assert [(u.name, u.forwards, u.seconds) for u in m.uses] == [
            ("text_encoder", 1, 0.0), ("transformer", 4, 0.2), ("vae", 1, 0.01)]
        with pytest.raises(KeyError, match="Available Module"):
            await ctl.plan("70%", uses=["unet"])



def _in_a_new_thread(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: out.append(module(x)))
    thread.start()
    thread.join()
    return out[0]


async def _plan_forwarding_in_new_threads(workspace: int) -> tuple[ResidencyPlan, int]:
    """The plan at the pipeline's own size, on a simulated GPU whose library takes
    ``workspace`` bytes at each fresh thread's first kernel, measured by a warm-up whose
    forwards each run in a new thread; and the workspace bytes taken."""
    layer = sim_cuda_layer(workspace_bytes=workspace)
    gpu = layer.runtime
    assert isinstance(gpu, SimCuda)
    torch.manual_seed(0)
    pipeline = {"first": nn.Linear(128, 128), "second": nn.Linear(128, 128)}
    x = torch.randn(4, 128)
    async with LifecycleController(device_layer=layer, residency="all=component-offload") as ctl:
        await ctl.attach(pipeline)

        async def warmup() -> torch.Tensor:
            y = x
            async with ctl.request(list(pipeline)):
                for name in pipeline:
                    async with ctl.use(name) as module:
                        y = await anyio.to_thread.run_sync(_in_a_new_thread, module, y)
            return y

        budget = sum(c.total_bytes for c in ctl.report().components.values())
        return await ctl.plan(budget, warmup), gpu.workspace_total


async def test_a_workspace_a_fresh_thread_takes_in_the_warm_up_does_not_inflate_the_plan() -> None:
    """The first kernel of each fresh host thread takes a library workspace it never gives
    back (cuBLAS: 32 MiB a thread on Hopper), here one bigger than the pipeline: a warm-up
    whose forwards run in new threads measures the same activation reserve, and plans the
    same peak at the pipeline's own size, as on a GPU whose library takes none (a later
    request on those threads takes no more; they are not a request's activations)."""
    workspace = 4 * 2**20
    without, none_taken = await _plan_forwarding_in_new_threads(0)
    plan, taken = await _plan_forwarding_in_new_threads(workspace)
    assert none_taken == 0 and taken >= workspace  # taken in the warm-up by its new threads
    assert plan.activation_reserve == without.activation_reserve
    assert plan.predicted_peak_bytes == without.predicted_peak_bytes <= plan.budget_bytes
