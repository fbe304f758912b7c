"""Ordering against the compute stream, with GPU work still queued when the host moves on (a
real GPU: ``torch.cuda._sleep`` queues ~100 ms first; the simulated GPU's compute stream lags
the host by itself): a forward under a user stream, an update right after a generate, a sleep
right after a generate. Outputs are compared bit for bit with a resident pipeline's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lifecycle import LifecycleController, Phase, UnsupportedCompute
from lifecycle.demo import DemoPipeline
from strategies import CudaDevice
from tests.gpu.helpers import (
    LAYERWISE,
    GpuRun,
    Recorder,
    layerwise_strategy,
    perturbed,
    queue_work,
    reference_outputs,
    user_stream,
    work_pending,
)

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]

LAG = 0.005  # seconds: how late the simulated GPU's queued work lands, at most


class Expected:
    """A resident pipeline's outputs before and after the update ``new``."""

    def __init__(self, old: torch.Tensor, new: torch.Tensor, update: dict[str, torch.Tensor]
                 ) -> None:
        self.old, self.new, self.update = old, new, update


_EXPECTED: dict[tuple[bool, int], Expected] = {}  # made once per process and size


async def expected(gpu: GpuRun, cuda_layer: Callable[..., CudaDevice]) -> Expected:
    key = (gpu.real, gpu.sizes.ordering)
    if key not in _EXPECTED:
        pipe = DemoPipeline.build(gpu.sizes.ordering)
        update = perturbed(pipe, 1e-2)
        old, new = await reference_outputs(cuda_layer(), pipe, update)
        assert new is not None
        _EXPECTED[key] = Expected(old, new, update)
    return _EXPECTED[key]


async def test_a_forward_under_a_user_stream_is_refused_and_the_next_one_is_exact(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """A layerwise generate under a user's stream raises ``UnsupportedCompute`` before
    anything moves; the next generate, on the default stream, is exact and nothing is left
    in flight."""
    exp = await expected(gpu, cuda_layer)
    pipe = DemoPipeline.build(gpu.sizes.ordering)
    layer = cuda_layer(max_lag=LAG)
    async with LifecycleController(device_layer=layer, residency=LAYERWISE) as ctl:
        await ctl.attach(pipe)
        warm = torch.equal(await pipe.generate(ctl=ctl), exp.old)
        fetched = layerwise_strategy(ctl).fetched
        error: BaseException | None = None
        try:
            with user_stream(layer, gpu.real):
                await pipe.generate(ctl=ctl)
        except UnsupportedCompute as exc:
            error = exc
        moved = layerwise_strategy(ctl).fetched - fetched
        again = torch.equal(await pipe.generate(ctl=ctl), exp.old)
        record(refused=error is not None, error=str(error)[:160], layers_fetched_meanwhile=moved,
               exact_after=again, user_stream="torch.cuda.Stream" if gpu.real else "SimStream")
        assert warm and error is not None and "non-default CUDA stream" in str(error)
        assert again and ctl.phase is Phase.AWAKE and ctl.in_flight == 0


async def test_an_update_right_after_a_layerwise_generate_serves_the_new_weights(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """An update issued while the previous layerwise generate's kernels are still queued
    leaves that generate's output as it was (old weights) and gives the next one exactly the
    new weights."""
    exp = await expected(gpu, cuda_layer)
    pipe = DemoPipeline.build(gpu.sizes.ordering)
    layer = cuda_layer(max_lag=LAG)
    async with LifecycleController(device_layer=layer, residency=LAYERWISE) as ctl:
        await ctl.attach(pipe)
        await pipe.generate(ctl=ctl)  # learns the layer order
        queue_work(layer, gpu.real)
        first = await pipe.generate(ctl=ctl)
        pending = work_pending(layer)
        updated = await ctl.update_weights_from_tensors(exp.update)
        second = await pipe.generate(ctl=ctl)
        layer.synchronize()
        old_ok, new_ok = torch.equal(first, exp.old), torch.equal(second, exp.new)
        record(gpu_work_pending_at_update=pending, generate_before_exact=old_ok,
               generate_after_exact_new_weights=new_ok, message=updated.message[:160])
        assert updated.success, updated.message
        assert old_ok and new_ok


@pytest.mark.parametrize("residency", ["layerwise", "resident"])
async def test_a_sleep_right_after_a_generate_keeps_its_output_and_the_weights(
        residency: str, gpu: GpuRun, cuda_layer: Callable[..., CudaDevice],
        record: Recorder) -> None:
    """A sleep issued while a generate's kernels are still queued (for a resident pipeline,
    its first sleep: the mirrors are filled from the device) leaves that generate's output
    exact, and the generate after the wake is exact too."""
    exp = await expected(gpu, cuda_layer)
    pipe = DemoPipeline.build(gpu.sizes.ordering)
    layer = cuda_layer(max_lag=LAG)
    config = LAYERWISE if residency == "layerwise" else None
    async with LifecycleController(device_layer=layer, residency=config) as ctl:
        await ctl.attach(pipe)
        await pipe.generate(ctl=ctl)
        queue_work(layer, gpu.real)
        first = await pipe.generate(ctl=ctl)
        pending = work_pending(layer)
        slept = await ctl.sleep()
        woke = await ctl.wake()
        second = await pipe.generate(ctl=ctl)
        layer.synchronize()
        in_flight_ok, after_ok = torch.equal(first, exp.old), torch.equal(second, exp.old)
        record(gpu_work_pending_at_sleep=pending, in_flight_output_exact=in_flight_ok,
               after_wake_exact=after_ok, sleep_bytes=slept.bytes_moved)
        assert slept.success and woke.success
        assert in_flight_ok and after_ok
