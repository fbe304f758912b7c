"""What each wait, record and synchronization of the CUDA layer (strategies.devices._cuda) orders, on
the simulated GPU: each test fails when the one it names is taken out (scripts/mutate_cuda.py
takes them out one at a time)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lifecycle.testing import SimCuda, check_cuda_sim
from strategies import CudaDevice

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


def layer_on(gpu: SimCuda) -> CudaDevice:
    return CudaDevice(torch.device("cpu"), gpu)


def weight_of(buf: torch.Tensor) -> nn.Linear:
    """A Linear whose weight is ``buf``'s 64 bytes (4 x 4 fp32)."""
    lin = nn.Linear(4, 4, bias=False)
    lin.weight.data = buf.view(torch.float32).view(4, 4)
    return lin


def test_a_handle_waited_for_on_a_user_stream_orders_the_compute_stream() -> None:
    """_EventHandle.wait called while a user stream is current (prepare_use on the event
    loop's thread) still makes the compute stream wait: a forward on it reads the landed
    bytes, not poison."""
    gpu = SimCuda(max_lag=10.0)
    layer = layer_on(gpu)
    buf = layer.alloc(64, "device")
    host = layer.alloc(64, "host")
    host.copy_(torch.ones(4, 4).reshape(-1).view(torch.uint8))
    handle = layer.start_copy([(buf, host)], "device")
    with gpu.use_stream(gpu.new_stream()):
        handle.wait()
    with torch.no_grad():
        out = weight_of(buf)(torch.ones(1, 4))
    assert out.tolist() == [[4.0, 4.0, 4.0, 4.0]]
    layer.synchronize()
    assert check_cuda_sim() == []
    layer.close()


def compute_frees_a_block_first(gpu: SimCuda) -> list[int]:
    """Make every allocation of the simulated GPU first queue a kernel (a forward on the
    compute stream, as the event loop's thread may run meanwhile) reading a buffer of the same
    size that is then freed: the allocation reuses that block while the kernel is queued.
    Returns the list the reused addresses are appended to."""
    real = gpu.empty
    reused: list[int] = []

    def empty(nbytes: int) -> torch.Tensor:
        old = real(nbytes)
        with torch.no_grad():
            weight_of(old[:64])(torch.ones(1, 4))
        address = old.data_ptr()
        del old
        new = real(nbytes)
        if new.data_ptr() == address:
            reused.append(address)
        return new

    gpu.empty = empty  # type: ignore[method-assign]
    return reused


@pytest.mark.parametrize("direction", ["in", "out"])
def test_a_staged_copys_device_temporary_is_written_only_after_compute_freed_its_block(
        direction: str) -> None:
    """A strided device side of a staged copy goes through a contiguous device temporary,
    allocated on the compute stream after the batch's wait for compute: the copy into it is
    ordered after compute work queued meanwhile on the block it reuses."""
    gpu = SimCuda(max_lag=10.0)
    layer = layer_on(gpu)
    layer.stage_bytes = 32
    device = layer.alloc(64, "device").view(torch.float32).view(4, 4)
    values = torch.arange(16, dtype=torch.float32).view(4, 4)
    if direction == "out":
        layer._staged([(device, values.t().contiguous())])  # fill it first
    reused = compute_frees_a_block_first(gpu)
    if direction == "in":
        layer._staged([(device.t(), values)])  # a strided device destination
        result, expected = device, values.t()
    else:
        result = torch.zeros(4, 4)
        layer._staged([(result, device.t())])  # a strided device source
        expected = values
    assert reused
    layer.synchronize()
    assert torch.equal(result, expected)
    assert check_cuda_sim() == []
    layer.close()


def test_a_batch_that_fails_part_way_lands_its_queued_copies_before_raising() -> None:
    """start_copy whose second copy fails raises only once the first, already queued, landed:
    the caller may free its buffers the moment it sees the error."""
    gpu = SimCuda(max_lag=10.0)
    layer = layer_on(gpu)
    real, calls = gpu.copy, []

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise RuntimeError("injected copy fault")
        real(dst, src)

    gpu.copy = copy  # type: ignore[method-assign]
    first, second = layer.alloc(64, "device"), layer.alloc(64, "device")
    source = layer.alloc(64, "host")
    source.fill_(3)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        layer.start_copy([(first, source), (second, source)], "device")
    del source  # freed at once after the failure
    assert check_cuda_sim() == []
    assert first.tolist() == [3] * 64
    layer.close()


def test_a_staged_copy_into_a_buffer_compute_still_reads_is_ordered_after_it() -> None:
    """A staged copy from pageable memory into a live weight (a restore) that a queued kernel
    still reads is ordered after the compute stream: the kernel reads the old bytes, the
    weight then holds the new ones."""
    gpu = SimCuda(max_lag=10.0)
    layer = layer_on(gpu)
    layer.stage_bytes = 32
    buf = layer.alloc(64, "device")
    layer._staged([(buf.view(torch.float32).view(4, 4), torch.ones(4, 4))])
    lin = weight_of(buf)
    with torch.no_grad():
        out = lin(torch.ones(1, 4))  # its kernel is queued, reading buf
    layer._staged([(buf.view(torch.float32).view(4, 4), torch.full((4, 4), 2.0))])
    layer.synchronize()
    assert out.tolist() == [[4.0, 4.0, 4.0, 4.0]]
    assert lin.weight.tolist() == [[2.0] * 4] * 4
    assert check_cuda_sim() == []
    layer.close()


def test_measure_links_timed_copies_land_before_their_buffers_are_freed() -> None:
    """measure_link's timed copies (on the copy stream, a fresh device buffer each, freed at
    once) are waited for on the host before their buffers go, and are ordered after compute
    work queued on the blocks they reuse: nothing is reported, and both numbers are real."""
    gpu = SimCuda(max_lag=0.001)
    layer = layer_on(gpu)
    reused = compute_frees_a_block_first(gpu)
    rate, latency = layer.measure_link(nbytes=8192, repeats=2)
    assert reused
    assert rate > 0 and latency > 0
    assert check_cuda_sim() == []
    layer.close()
