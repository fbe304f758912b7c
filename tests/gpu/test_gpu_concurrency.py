"""Several threads forwarding one layerwise component at once on the CUDA layer (the diffusers
adapter runs pipelines in worker threads)."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.to_thread
import pytest
import torch

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from strategies import CudaDevice
from tests.gpu.helpers import LAYERWISE, GpuRun, Recorder, memory

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]


async def test_four_threads_forwarding_a_layerwise_component_are_exact_and_leave_nothing(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """Four threads forwarding the pipeline at once, five times, inside one use of the
    layerwise transformer all compute exactly; after the use nothing is in flight and no
    more device memory is allocated than before it, and a sleep frees the weights."""
    pipe = DemoPipeline.build(gpu.sizes.concurrency)
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer, residency=LAYERWISE,
                                   prefetch_components=False) as ctl:
        await ctl.attach(pipe)
        expected = pipe.forward_sync().to("cpu")
        base = memory(layer)["allocated"]
        outs: list[torch.Tensor] = []

        async def one() -> None:  # outputs kept on the host: device memory is compared below
            outs.append((await anyio.to_thread.run_sync(pipe.forward_sync)).to("cpu"))

        async with ctl.use("transformer"):
            for _ in range(5):
                async with anyio.create_task_group() as tg:
                    for _ in range(4):
                        tg.start_soon(one)
        after_use = memory(layer)["allocated"]
        pending = ctl.strategy("transformer").store.pending_bytes
        await ctl.sleep()
        asleep = memory(layer)["allocated"]
        await ctl.wake()
        exact = all(torch.equal(o, expected) for o in outs)
        record(forwards=len(outs), outputs_identical=exact, pending_bytes=pending,
               allocated_base=base, allocated_after_use=after_use, allocated_asleep=asleep)
        assert exact and len(outs) == 20 and pending == 0
        assert after_use <= base and asleep < base
