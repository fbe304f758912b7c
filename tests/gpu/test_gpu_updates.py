"""Weight updates on the CUDA layer: from host tensors into every dtype and layout, from device
tensors against ``load_state_dict``, rolled back after an injected copy fault, and from a
safetensors checkpoint."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import anyio.to_thread
import pytest
import torch
from safetensors.torch import save_file

from lifecycle import LifecycleController
from lifecycle._units import gbps
from lifecycle.demo import DemoPipeline
from lifecycle.testing import FaultyCudaDevice
from strategies import CudaDevice
from tests.gpu.helpers import GpuRun, Recorder, device_copy_seconds, perturbed, ratio, timed
from tests.strategies.typed_buffers import DTYPES, Typed, new_values

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]


def written(module: Typed, new: dict[str, torch.Tensor]) -> dict[str, bool]:
    out = {}
    for name, value in new.items():
        got = getattr(module, name)
        out[name] = got.dtype == module.vector.dtype and got.shape == value.shape and \
            torch.equal(got.to("cpu"), value.to(got.dtype))
    return out


@pytest.mark.parametrize("mode", ["resident", "component-offload"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_an_update_from_host_tensors_writes_every_dtype_and_layout_exactly(
        dtype: torch.dtype, mode: str, gpu: GpuRun, cuda_layer: Callable[..., CudaDevice],
        record: Recorder) -> None:
    """An update from CPU tensors (pageable: staged through the pinned buffers) writes 0-d,
    1-d, 2-d, non-contiguous and multi-chunk targets of fp32, bf16, fp16 and int8 exactly, on
    the device, and a sleep and a wake keep them."""
    big = (4096, 6144) if gpu.real else (24, 40)
    layer = cuda_layer()
    # Several chunks per big tensor (24 MiB of int8 to 96 MiB of fp32 on a GPU), both
    # staging buffers in turn.
    layer.stage_bytes = 16 * 2**20 if gpu.real else 64
    module = Typed(dtype, big)
    async with LifecycleController(device_layer=layer, residency=f"typed={mode}") as ctl:
        await ctl.attach({"typed": module})
        new = new_values(dtype, big)
        result, seconds = await timed(layer, lambda: ctl.update_weights_from_tensors(new, "typed"))
        assert result.success, result.message
        async with ctl.use("typed"):
            if mode == "resident" and gpu.real:
                assert module.big.is_cuda
            first = written(module, new)
        await ctl.sleep()
        await ctl.wake()
        async with ctl.use("typed"):
            again = written(module, new)
        record(gbps=gbps(result.bytes_written, seconds), bytes=result.bytes_written,
               stage_bytes=layer.stage_bytes, exact=first, exact_after_sleep_wake=again)
        assert all(first.values()), first
        assert all(again.values()), again


async def test_an_update_from_device_tensors_matches_load_state_dict(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """An update of the transformer from tensors on the device writes exactly what
    ``load_state_dict`` writes into an identical pipeline (weights and outputs), and its
    throughput is recorded against ``load_state_dict``'s and against the copy floor (one
    flat device-to-device copy of the same bytes): on a GPU both copy at memory speed,
    where ours also pays its transitions, so the ratios are reported, not judged."""
    size = gpu.sizes.updates
    pipe, ref = DemoPipeline.build(size), DemoPipeline.build(size)
    layer, ref_layer = cuda_layer(), cuda_layer()
    async with LifecycleController(device_layer=layer) as ctl, \
            LifecycleController(device_layer=ref_layer) as ref_ctl:
        await ref_ctl.attach(ref)
        await ctl.attach(pipe)
        await ctl.sleep()  # the steady state of an RL loop: host mirrors exist
        await ctl.wake()
        base = {k: v.detach().clone() for k, v in ref.modules["transformer"].state_dict().items()}
        nbytes = sum(t.nbytes for t in base.values())
        ours: list[float] = []
        theirs: list[float] = []
        for k in (1, 2):  # round 1 is the warm-up
            with torch.no_grad():
                state = {n: (t + k * 1e-3).to(t.dtype) for n, t in base.items()}
            if not gpu.real:
                for t in state.values():  # device memory of the simulated GPU
                    layer.runtime.adopt(t)
            result, seconds = await timed(layer, functools.partial(ctl.update_weights_from_tensors,
                                                                    state))
            assert result.success, result.message
            ours.append(seconds)
            ref_layer.synchronize()
            t0 = time.perf_counter()
            ref.modules["transformer"].load_state_dict(state)
            ref_layer.synchronize()
            theirs.append(time.perf_counter() - t0)
            del state
        live = pipe.modules["transformer"].state_dict()
        exact = all(torch.equal(live[n], t) for n, t in
                    ref.modules["transformer"].state_dict().items())
        same = torch.equal(await pipe.generate(ctl=ctl), await ref.generate(ctl=ref_ctl))
        ours_gbps, ref_gbps = gbps(nbytes, ours[-1]), gbps(nbytes, theirs[-1])
        floor_gbps = gbps(nbytes, await anyio.to_thread.run_sync(device_copy_seconds, layer, nbytes))
        record(ours_gbps=ours_gbps, load_state_dict_gbps=ref_gbps,
               ratio_ours_over_load_state_dict=ratio(ours_gbps, ref_gbps),
               copy_floor_gbps=floor_gbps, ratio_ours_over_copy_floor=ratio(ours_gbps, floor_gbps),
               bytes=nbytes,
               ours_s=ours[-1], load_state_dict_s=theirs[-1], values_exact=exact,
               outputs_identical=same, version=ctl.weights_version)
        assert exact and same and ctl.weights_version == 2


async def test_a_copy_fault_midway_rolls_the_update_back(
        gpu: GpuRun, faulty_cuda_layer: Callable[..., FaultyCudaDevice], record: Recorder) -> None:
    """A copy that fails halfway through an update from host tensors rolls every tensor back:
    the checksums and the output are as before, and a retry succeeds."""
    pipe = DemoPipeline.build(gpu.sizes.updates, seed=1)
    layer = faulty_cuda_layer()
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        expected = await pipe.generate(ctl=ctl)
        before = ctl.weights_checksum()
        state = perturbed(pipe, 0.01)
        copy_at = max(2, len(state) // 2)
        layer.arm(copy_at=copy_at)
        faults = layer.faults
        failed = await ctl.update_weights_from_tensors(state)
        layer.arm()
        kept = ctl.weights_checksum() == before
        same = torch.equal(await pipe.generate(ctl=ctl), expected)
        retry = await ctl.update_weights_from_tensors(state)
        record(fault_at_copy=copy_at, faults_injected=layer.faults - faults,
               rolled_back=failed.rolled_back, checksums_equal=kept, outputs_identical=same,
               retry=retry.success, message=failed.message[:160])
        assert not failed.success and failed.rolled_back and layer.faults == faults + 1
        assert kept and same
        assert retry.success, retry.message
        assert ctl.weights_checksum() != before


async def test_an_update_from_disk_is_exact_and_survives_sleep_and_wake(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder,
        tmp_path: Path) -> None:
    """An update from a safetensors checkpoint of the transformer writes every tensor
    exactly, and a sleep and a wake keep it."""
    pipe = DemoPipeline.build(gpu.sizes.updates, seed=2)
    layer = cuda_layer()
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        on_disk = {k: (v * 0.5).contiguous() for k, v in perturbed(pipe, 0.01).items()}
        (tmp_path / "transformer").mkdir()
        save_file(on_disk, str(tmp_path / "transformer" / "model.safetensors"))
        result, seconds = await timed(layer, lambda: ctl.update_weights_from_disk(tmp_path))
        assert result.success, result.message

        def exact() -> bool:
            live = pipe.modules["transformer"].state_dict()
            return all(torch.equal(live[k].detach().to("cpu"), v) for k, v in on_disk.items())

        now = exact()
        slept, woke = await ctl.sleep(), await ctl.wake()
        after = exact()
        record(gbps=gbps(result.bytes_written, seconds), seconds=seconds,
               bytes=result.bytes_written, values_exact=now, exact_after_sleep_wake=after,
               version=ctl.weights_version)
        assert now and slept.success and woke.success and after
