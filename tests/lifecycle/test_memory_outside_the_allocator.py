"""Device memory taken outside the caching allocator (NCCL's communicator buffers, another
process on the same GPU): the controller's choices read the driver's free memory, so a wake
that no longer fits rolls back, an update backs up on the host where the device has no room
for twice it, and a budget given as a share of the device is a share of what is free.
On a simulated GPU (``SimCuda.take_foreign``), with its device memory its own."""

from __future__ import annotations

import anyio
import anyio.to_thread
import pytest
import torch
from torch import nn

from lifecycle import LifecycleController, Phase, TransitionFailed
from strategies.checking import SimCuda, sim_cuda_layer
from strategies.devices import CudaDevice
from tests.helpers import fingerprints

pytestmark = pytest.mark.anyio

MiB = 2**20


def simulated(capacity: int) -> tuple[CudaDevice, SimCuda]:
    """The CUDA layer over a simulated GPU of ``capacity`` bytes, its device memory its own,
    every block a segment of its own (reserved bytes are the blocks')."""
    layer = sim_cuda_layer(capacity=capacity, host_modules=True, exact_segments=True)
    gpu = layer.runtime
    assert isinstance(gpu, SimCuda)
    return layer, gpu


def pipeline() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"transformer": nn.Sequential(nn.Linear(1024, 1024)), "vae": nn.Linear(8, 8)}


async def test_a_wake_that_no_longer_fits_beside_nccls_buffers_rolls_back_then_succeeds(
        ) -> None:
    """Asleep, a communicator takes all but 1 MiB of the GPU outside the allocator: the wake
    fails on its first allocation and rolls back (asleep, no device byte held, the host
    copies intact); once the communicator is gone the wake gives the exact weights."""
    layer, gpu = simulated(64 * MiB)
    pipe = pipeline()
    before = fingerprints(pipe)
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        await ctl.sleep()
        await anyio.to_thread.run_sync(layer.empty_cache)
        key = gpu.take_foreign(gpu.mem_get_info()[0] - MiB, "NCCL's buffers")
        with pytest.raises(TransitionFailed, match="out of memory"):
            await ctl.wake()
        assert ctl.phase is Phase.SLEEPING and ctl.report().device_bytes == 0
        assert layer.held_bytes == 0
        gpu.release_foreign(key)
        assert (await ctl.wake()).success
        assert fingerprints(pipe) == before


@pytest.mark.parametrize("nccl", [False, True])
async def test_an_update_backs_up_on_the_host_when_memory_outside_the_allocator_leaves_no_room(
        nccl: bool) -> None:
    """A pipeline placed on the device has no host copies, so an update backs up what it
    overwrites: on the device when there is room for twice it, else on the host. With NCCL's
    buffers leaving 6 MiB beside the 4 MiB weights' own, the backups go to the host and the
    update succeeds within the GPU (on the device they would not fit: out of memory)."""
    layer, gpu = simulated(256 * MiB)
    pipe = pipeline()
    layer.place(*pipe.values())
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        await anyio.to_thread.run_sync(layer.empty_cache)
        if nccl:
            gpu.take_foreign(gpu.mem_get_info()[0] - 6 * MiB, "NCCL's buffers")
        gpu.reset_peak()
        weights = gpu.memory().allocated
        host_before = layer.host_allocations
        new = {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}
        result = await ctl.update_weights_from_tensors(new, target_module="transformer")
        assert result.success, result.message
        assert all(torch.equal(pipe["transformer"].state_dict()[k], v) for k, v in new.items())
        backups = 4 * MiB + 4096  # the weight and the bias
        if nccl:
            assert layer.host_allocations - host_before == 2  # one backup a tensor
            assert gpu.memory().peak_allocated == weights
        else:
            assert layer.host_allocations == host_before
            assert gpu.memory().peak_allocated == weights + backups


async def test_a_share_of_the_device_as_a_budget_is_a_share_of_what_is_free() -> None:
    """``plan("50%")`` plans within half of the memory free to the library (what it holds
    plus the driver's free memory): memory NCCL holds outside the allocator is not free."""
    budgets = []
    for foreign in (0, 100 * MiB):
        layer, gpu = simulated(256 * MiB)
        async with LifecycleController(device_layer=layer) as ctl:
            await ctl.attach(pipeline())
            await anyio.to_thread.run_sync(layer.empty_cache)
            if foreign:
                gpu.take_foreign(foreign, "NCCL's buffers")
            plan = await ctl.plan("50%")
            budgets.append(plan.budget_bytes)
    assert budgets[0] - budgets[1] == 50 * MiB


async def test_a_residency_change_that_no_longer_fits_beside_nccls_buffers_is_undone() -> None:
    """The transformer offloaded; a communicator takes all but 1 MiB outside the allocator:
    making it resident again (4 MiB onto the device) fails and leaves the old layout and
    weights; without the communicator the same change succeeds."""
    layer, gpu = simulated(64 * MiB)
    pipe = pipeline()
    before = fingerprints(pipe)
    async with LifecycleController(device_layer=layer,
                                   residency="transformer=component-offload") as ctl:
        await ctl.attach(pipe)
        await anyio.to_thread.run_sync(layer.empty_cache)
        key = gpu.take_foreign(gpu.mem_get_info()[0] - MiB, "NCCL's buffers")
        with pytest.raises(TransitionFailed, match="out of memory"):
            await ctl.set_residency("transformer=resident")
        assert ctl.report().components["transformer"].mode == "component-offload"
        assert fingerprints(pipe) == before
        gpu.release_foreign(key)
        assert (await ctl.set_residency("transformer=resident")).success
        assert ctl.report().components["transformer"].mode == "resident"
        assert fingerprints(pipe) == before
