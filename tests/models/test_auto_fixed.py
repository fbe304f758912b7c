"""``residency="auto,transformer=layerwise-offload"``: the planner at attach keeps what the
user fixed and plans the rest around it (SGLang's auto residency takes explicit component
choices first), on a real CLIP text encoder and a real Flux transformer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lifecycle import ComponentResidencyError, InfeasibleBudget, LifecycleController
from tests.models.zoo import CASES, build_deep

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

CLIP, FLUX = CASES["clip_text"], CASES["flux"]


def pipeline(clip_depth: int = 2) -> dict[str, nn.Module]:
    return {"text_encoder": build_deep("clip_text", clip_depth),
            "transformer": build_deep("flux", 3)}


def total(pipe: dict[str, nn.Module]) -> int:
    return sum(t.nbytes for m in pipe.values() for t in [*m.parameters(), *m.buffers()])


def modes(ctl: LifecycleController) -> dict[str, str]:
    return {n: ctl.strategy(n).mode.value for n in ctl.components}


async def test_a_fixed_mode_is_kept_where_plain_auto_would_choose_another() -> None:
    """With room for everything, plain auto keeps both resident; with the transformer fixed
    to layerwise-offload (by its group, dit) it streams, the text encoder stays resident,
    outputs are the plain models' and the plan's decision says the mode was fixed."""
    pipe = pipeline()
    budget = 2 * total(pipe)
    async with LifecycleController("cpu", residency="auto", device_budget=budget) as plain:
        await plain.attach(pipeline())
        assert modes(plain) == {"text_encoder": "resident", "transformer": "resident"}
    async with LifecycleController("cpu", residency="auto,dit=layerwise-offload",
                                   device_budget=budget) as ctl:
        await ctl.attach(pipe)
        assert modes(ctl) == {"text_encoder": "resident", "transformer": "layerwise-offload"}
        plan = ctl.last_plan
        assert plan is not None and ctl.config == plan.config
        reasons = {d.name: d.why for d in plan.decisions}
        assert reasons["transformer"].startswith("mode fixed by the residency; ")
        assert not reasons["text_encoder"].startswith("mode fixed")
        async with ctl.use("transformer") as module:
            assert torch.equal(FLUX.run(module), FLUX.run(build_deep("flux", 3)))
        async with ctl.use("text_encoder") as module:
            assert torch.equal(CLIP.run(module), CLIP.run(build_deep("clip_text", 2)))


async def test_the_rest_is_planned_around_a_fixed_mode_under_a_tight_budget() -> None:
    """The text encoder fixed resident and a budget that leaves no room for the whole
    transformer beside it: the planner streams the transformer layer by layer, and the
    measured peak of a request stays within the budget."""
    pipe = pipeline()
    flux_bytes = total({"t": pipe["transformer"]})
    clip_bytes = total({"c": pipe["text_encoder"]})
    budget = clip_bytes + flux_bytes // 2
    async with LifecycleController("cpu", residency="auto,text_encoder=resident",
                                   device_budget=budget) as ctl:
        await ctl.attach(pipe)
        assert modes(ctl) == {"text_encoder": "resident", "transformer": "layerwise-offload"}
        plan = ctl.last_plan
        assert plan is not None and plan.predicted_peak_bytes <= budget
        ctl.reset_peak()
        async with ctl.request(["text_encoder", "transformer"]):
            async with ctl.use("text_encoder") as te:
                CLIP.run(te)
            async with ctl.use("transformer") as dit:
                FLUX.run(dit)
        assert ctl.report().peak_device_bytes <= budget


async def test_a_fixed_mode_that_cannot_fit_the_budget_is_infeasible() -> None:
    """The transformer fixed resident under a budget below its own bytes: InfeasibleBudget,
    whose minimum counts the fixed transformer whole."""
    pipe = pipeline()
    flux_bytes = total({"t": pipe["transformer"]})
    ctl = LifecycleController("cpu", residency="auto,transformer=resident",
                              device_budget=flux_bytes // 2)
    with pytest.raises(InfeasibleBudget) as info:
        await ctl.attach(pipe)
    assert info.value.minimum_bytes >= flux_bytes
    await ctl.aclose()


async def test_a_fixed_mode_the_component_cannot_have_is_refused_naming_those_it_can() -> None:
    """A one-layer CLIP (no block list) fixed to layerwise-offload is refused with the modes
    it can have; a selector naming no component is refused at attach as in any residency."""
    ctl = LifecycleController("cpu", residency="auto,text_encoder=layerwise-offload",
                              device_budget="100%")
    with pytest.raises(ComponentResidencyError) as info:
        await ctl.attach(pipeline(clip_depth=1))
    assert str(info.value) == (
        "Component 'text_encoder' is fixed to layerwise-offload in residency='auto,...', but it "
        "has no block list to stream; modes it can have: ['component-offload', 'resident', "
        "'snapshot-offload']")
    ctl = LifecycleController("cpu", residency="auto,transfomer=resident", device_budget="100%")
    with pytest.raises(ValueError, match="residency selector 'transfomer' matches no component"):
        await ctl.attach(pipeline())


def test_a_fixed_entry_with_a_bad_mode_is_refused_when_the_controller_is_made() -> None:
    """An invalid mode after auto is the usual residency error, raised by the constructor."""
    with pytest.raises(ValueError, match="Invalid component residency mode 'fast'"):
        LifecycleController("cpu", residency="auto,transformer=fast", device_budget="90%")
    with pytest.raises(ValueError, match="device_budget"):
        LifecycleController("cpu", residency="auto,transformer=resident")


async def test_a_component_fixed_to_resident_stable_is_planned_as_resident_would_be() -> None:
    """``auto,transformer=resident-stable``: the planner plans the transformer with resident's
    bytes and keeps its mode (its weights in an arena whose addresses survive a sleep), and
    plans the other components around it."""
    pipe = pipeline()
    ctl = LifecycleController("cpu", residency="auto,transformer=resident-stable",
                              device_budget="100%")
    await ctl.attach(pipe)
    try:
        assert ctl.report().components["transformer"].mode == "resident-stable"
        where = [p.data_ptr() for p in pipe["transformer"].parameters()]
        await ctl.sleep()
        await ctl.wake()
        assert [p.data_ptr() for p in pipe["transformer"].parameters()] == where
    finally:
        await ctl.aclose()
