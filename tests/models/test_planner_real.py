"""The planner on real models: a CLIP text encoder and a Flux transformer (diffusers,
built from tiny configs), placed under budgets from their full size down to the smallest
feasible one."""

from __future__ import annotations

import pytest
import torch

from lifecycle import InfeasibleBudget, LifecycleController
from tests.models.zoo import CASES, build_deep

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


async def test_real_models_fit_every_budget_with_identical_outputs() -> None:
    """For eight budgets from the pipeline's size down to the smallest feasible one, the
    applied plan's measured peak stays within the budget and the text encoder's and the Flux
    transformer's outputs are bit-identical to resident ones."""
    clip, flux = CASES["clip_text"], CASES["flux"]
    pipeline = {"text_encoder": clip.build(0), "transformer": build_deep("flux", 3)}
    expected = (clip.run(pipeline["text_encoder"]),
                [flux.run(pipeline["transformer"], seed) for seed in (0, 1)])
    async with LifecycleController("cpu", residency="all=component-offload") as ctl:
        await ctl.attach(pipeline)

        async def request() -> tuple[torch.Tensor, list[torch.Tensor]]:
            async with ctl.request(["text_encoder", "transformer"]):
                async with ctl.use("text_encoder") as te:
                    text = clip.run(te)
                async with ctl.use("transformer") as dit:  # two denoising steps in one use
                    return text, [flux.run(dit, seed) for seed in (0, 1)]

        with pytest.raises(InfeasibleBudget) as info:
            await ctl.plan(0, request)
        smallest = info.value.minimum_bytes
        total = sum(c.total_bytes for c in ctl.report().components.values())
        chosen = set()
        for i in range(8):
            budget = int(total - (total - smallest) * i / 7)
            plan = await ctl.plan(budget, request)
            change = await ctl.set_residency(plan, latency_tolerance=100.0)
            assert change.success, change.message
            assert change.measured_peak_bytes is not None
            assert change.measured_peak_bytes <= plan.predicted_peak_bytes <= budget
            ctl.reset_peak()
            text, images = await request()
            assert ctl.report().peak_device_bytes <= budget
            assert torch.equal(text, expected[0])
            assert all(torch.equal(a, b) for a, b in zip(images, expected[1], strict=True))
            chosen.add(plan.config.to_string())
        assert "transformer=layerwise-offload" in " ".join(chosen)
