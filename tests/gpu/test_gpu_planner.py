"""The planner on the CUDA layer: plans for half the free memory (all resident on a GPU) and
for 60% of the pipeline (some offloaded), applied and validated with a request, each within
its budget by the library's count and by the allocator's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from strategies import CudaDevice
from tests.gpu.helpers import GpuRun, Recorder, memory

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]

LATENCY_TARGET = 1.10  # a validation request at most this much slower than predicted: recorded
# The demo pipeline is copy-bound on a GPU (its layers compute in less time than they copy), so
# the plan's latency is the link's, with fixed costs the model does not predict: the bound is
# recorded, never asserted (correctness and the memory budgets are).
LATENCY_NOT_ASSERTED = "a copy-bound pipeline: its latency is the link's, not the plan's"


async def test_plans_for_half_the_memory_and_most_of_the_pipeline_fit_their_budgets(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """``plan("50%")`` and ``plan(60% of the pipeline's bytes)``, each applied with
    ``set_residency`` and validated: the outputs stay exact, and a generate's peak (the
    library's, and the allocator's less what is not the library's) fits the budget; the
    validation request's latency against the prediction is recorded against its bound."""
    pipe = DemoPipeline.build(gpu.sizes.planner)
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        expected = await pipe.generate(ctl=ctl)

        async def warmup() -> object:
            return await pipe.generate(ctl=ctl)

        rows: list[dict[str, Any]] = []
        for budget in ("50%", pipe.nbytes * 3 // 5):
            plan = await ctl.plan(budget, warmup=warmup)
            # Validation undoes a plan whose request runs slower than predicted by more than
            # the tolerance: generous here, so that the exactness and peaks below are checked
            # whatever the latency; the latency itself is a target.
            change = await ctl.set_residency(plan, latency_tolerance=100.0)
            base = memory(layer)
            held = layer.held_bytes
            ctl.reset_peak()
            out = await pipe.generate(ctl=ctl)
            layer.synchronize()
            report = ctl.report()
            peak, alloc_peak = report.peak_device_bytes, report.allocator_peak_bytes
            device_peak = None if alloc_peak is None else alloc_peak - max(base["allocated"] - held, 0)
            slower = None if not change.measured_seconds or not plan.predicted_seconds else \
                change.measured_seconds / plan.predicted_seconds
            rows.append({"budget": budget, "budget_bytes": plan.budget_bytes,
                         "config": plan.config.to_string() or "all resident",
                         "predicted_peak": plan.predicted_peak_bytes, "measured_peak": peak,
                         "device_peak": device_peak, "activation_reserve": plan.activation_reserve,
                         "validated": change.validated, "applied": change.success,
                         "measured_over_predicted_seconds": slower,
                         "outputs_identical": torch.equal(out, expected),
                         "message": change.message[:160]})
        record(budget_bytes=rows[-1]["budget_bytes"], measured_peak=rows[-1]["measured_peak"],
               device_peak=rows[-1]["device_peak"], config=rows[-1]["config"], plans=rows)
        for row in rows:
            assert row["applied"] and row["validated"], row["message"]
            assert row["outputs_identical"]
            assert row["measured_peak"] <= row["budget_bytes"], row
            assert row["device_peak"] is not None and row["device_peak"] <= row["budget_bytes"], row
        assert rows[-1]["config"] != "all resident"  # 60% of the pipeline: something offloads
        for i, row in enumerate(rows):
            record.target(f"plan{i}_measured_over_predicted_seconds",
                          row["measured_over_predicted_seconds"], at_most=LATENCY_TARGET,
                          why_not_asserted=LATENCY_NOT_ASSERTED)
