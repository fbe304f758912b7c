"""The planner plans host bytes too: a plan fits the device and the host budget (host bytes
held while awake: the mirrors of what it offloads), and an infeasible one names the budget
that does not fit."""

from __future__ import annotations

import itertools
import time

import pytest

from lifecycle import InfeasibleBudget, LifecycleController
from lifecycle._planner import (
    ComponentSizes,
    Measurements,
    Use,
    make_plan,
    options_for,
    predict,
)
from lifecycle.cli import main
from lifecycle.demo import DemoPipeline
from tests.helpers import faulty_device
from tests.lifecycle.test_planner import _exhaustive

LAYERS = (100, 100, 100, 100)


def measurements() -> Measurements:
    sizes = (ComponentSizes("text_encoder", 300, 310),
             ComponentSizes("transformer", 500, 520, 100, LAYERS, ("blocks",)),
             ComponentSizes("vae", 200, 210, 40, (80, 80), ("up",)))
    uses = (Use("text_encoder", 1, 0.01), Use("transformer", 4, 0.02), Use("vae", 1, 0.01))
    return Measurements(sizes, uses, bandwidth=1000.0, other_seconds=0.01)


@pytest.mark.parametrize("host_budget", [0, 150, 300, 520, 2000])
def test_the_plan_is_the_fastest_layout_within_both_budgets(host_budget: int) -> None:
    """Under a device budget of 700 bytes and each host budget, the plan's host bytes fit,
    and no layout of the decision space within both budgets is faster."""
    m = measurements()
    try:
        plan = make_plan(m, 700, planner_started=time.perf_counter(), host_budget=host_budget)
    except InfeasibleBudget as exc:
        assert exc.budget == "host" and _exhaustive(m, 700, host_budget) == float("inf")
        return
    assert plan.predicted_host_bytes <= host_budget
    assert plan.host_budget_bytes == host_budget
    assert plan.predicted_seconds == pytest.approx(_exhaustive(m, 700, host_budget))


def test_a_host_budget_that_no_device_feasible_layout_fits_is_named() -> None:
    """Device 700 needs something offloaded: a host budget of 50 bytes fits none, and the
    error names the host budget and the fewest host bytes a device-feasible layout holds."""
    with pytest.raises(InfeasibleBudget) as info:
        make_plan(measurements(), 700, planner_started=time.perf_counter(), host_budget=50)
    assert info.value.budget == "host" and info.value.budget_bytes == 50
    assert info.value.minimum_bytes == 480  # transformer streams 4 layers, vae 1 of its 2
    m = measurements()
    options = [options_for(s, [u for u in m.uses if u.name == s.name], m.bandwidth)
               for s in m.sizes]
    assert min(sum(o.host for o in combo) for combo in itertools.product(*options)
               if predict(dict(zip(["text_encoder", "transformer", "vae"], combo,
                                   strict=True)), m.uses) <= 700) == 480
    assert "no residency fits a host budget of 50 B within a device budget of 700 B" \
        in str(info.value)


def test_a_device_budget_nothing_fits_is_still_named_as_the_device_budget() -> None:
    """Too small a device budget is the device's, whatever the host budget."""
    with pytest.raises(InfeasibleBudget) as info:
        make_plan(measurements(), 10, planner_started=time.perf_counter(), host_budget=10**9)
    assert info.value.budget == "device"


@pytest.mark.anyio
async def test_the_controller_plans_under_its_host_budget() -> None:
    """ctl.plan() holds the layout to the controller's host budget: with none, everything
    resident-or-offloaded fits; with a host budget of 0 only resident layouts may be chosen."""
    pipe = DemoPipeline.build(2**20)
    async with LifecycleController(device_layer=faulty_device(), host_budget=0) as ctl:
        await ctl.attach(pipe)
        free = await ctl.plan(pipe.nbytes * 2, host_budget="1GiB")
        assert free.host_budget_bytes == 2**30
        held = await ctl.plan(pipe.nbytes * 2)
        assert held.host_budget_bytes == 0 and held.predicted_host_bytes == 0
        assert {d.mode.value for d in held.decisions} == {"resident"}
        with pytest.raises(InfeasibleBudget) as info:
            await ctl.plan(pipe.nbytes * 9 // 10)
        assert info.value.budget == "host"


def test_residency_plan_takes_a_host_budget_and_exits_1_naming_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``residency plan --host-budget 0`` under a device budget that needs offloading: exit
    1, the message names the host budget."""
    code = main(["plan", "--budget", "90%", "--host-budget", "0", "--size", "1MB",
                 "--device", "cpu", "--no-warmup"])
    assert code == 1
    assert "no residency fits a host budget of 0 B" in capsys.readouterr().err
