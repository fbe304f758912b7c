"""Several threads forwarding one layerwise component at once on the CUDA layer (the diffusers
adapter runs pipelines in worker threads)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import anyio.to_thread
import pytest
import torch

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from strategies import CudaDevice
from tests.gpu.helpers import LAYERWISE, GpuRun, Recorder, memory, sim_workspaces

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]


async def test_four_threads_forwarding_a_layerwise_component_are_exact_and_leave_nothing(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """Four threads forwarding the pipeline at once, five times, inside one use of the
    layerwise transformer all compute exactly; after the use nothing is in flight and the
    library holds no more device memory than before it, and a sleep frees the weights.

    The library's own bytes are compared (``held_bytes``), the allocator's recorded: each
    thread's first GEMM takes a cuBLAS workspace (32 MiB on Hopper) that torch keeps for the
    thread's life, and the worker threads of the timed rounds may be new ones."""
    pipe = DemoPipeline.build(gpu.sizes.concurrency)
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer, residency=LAYERWISE,
                                   prefetch_components=False) as ctl:
        await ctl.attach(pipe)
        expected = pipe.forward_sync().to("cpu")
        outs: list[torch.Tensor] = []
        threads: set[int] = set()

        def forward() -> torch.Tensor:
            threads.add(threading.get_ident())
            return pipe.forward_sync()

        async def one() -> None:  # outputs kept on the host: device memory is compared below
            outs.append((await anyio.to_thread.run_sync(forward)).to("cpu"))

        async def rounds(n: int) -> None:
            async with ctl.use("transformer"):
                for _ in range(n):
                    async with anyio.create_task_group() as tg:
                        for _ in range(4):
                            tg.start_soon(one)

        await rounds(1)  # warms the worker threads (their cuBLAS workspaces)
        warm_threads = set(threads)
        outs.clear()
        # Less the workspaces the simulated GPU knows of (a timed round's new worker thread
        # takes one, of the weights' size here; on a GPU 32 MiB against 256 MiB of weights).
        base = memory(layer)["allocated"] - sim_workspaces(layer)
        held_base = layer.held_bytes
        await rounds(5)
        after_use = memory(layer)["allocated"] - sim_workspaces(layer)
        held_after_use = layer.held_bytes
        pending = ctl.strategy("transformer").store.pending_bytes
        await ctl.sleep()
        asleep = memory(layer)["allocated"] - sim_workspaces(layer)
        held_asleep = layer.held_bytes
        await ctl.wake()
        exact = all(torch.equal(o, expected) for o in outs)
        record(forwards=len(outs), outputs_identical=exact, pending_bytes=pending,
               held_base=held_base, held_after_use=held_after_use, held_asleep=held_asleep,
               allocated_base=base, allocated_after_use=after_use, allocated_asleep=asleep,
               allocated_growth_over_the_use=after_use - base, threads=len(threads),
               threads_new_after_warmup=len(threads - warm_threads))
        assert exact and len(outs) == 20 and pending == 0
        assert held_after_use <= held_base and held_asleep < held_base
        assert asleep < base
