"""The simulated GPU itself (strategies.checking._cudasim): what it models, and what it reports."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lifecycle.testing import POISON, CudaSimViolation, SimCuda, check_cuda_sim

pytestmark = pytest.mark.moves

MiB = 2**20


def host(n: int, value: int = 7) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.uint8)


def test_a_copy_lands_late_holding_poison_until_then_and_a_host_wait_lands_it() -> None:
    """A queued copy's destination holds poison until the copy lands; an event recorded after
    it is not complete at once (the lag), and synchronizing on it lands the bytes."""
    gpu = SimCuda(max_lag=10.0)
    stream = gpu.new_stream()
    dst = gpu.empty(64)
    with gpu.use_stream(stream):
        gpu.copy(dst, host(64))
    assert bool((dst == POISON).all())
    event = gpu.event()
    event.record(stream)
    assert not event.query()
    with gpu.use_device():
        event.synchronize()
    assert event.query()
    assert bool((dst == 7).all())


def test_work_on_one_stream_lands_in_order_and_after_what_it_waits_for() -> None:
    """A stream waiting on another's event lands its copy only after that one, and items of
    one stream land in queue order whatever their lags."""
    gpu = SimCuda(max_lag=10.0)
    first, second = gpu.new_stream(), gpu.new_stream()
    a, b = gpu.empty(16), gpu.empty(16)
    with gpu.use_stream(first):
        gpu.copy(a, host(16, 1))
    event = gpu.event()
    event.record(first)
    second.wait_event(event)
    with gpu.use_stream(second):
        gpu.copy(b, a)  # ordered after the copy into a: lands its bytes, not poison
    done = gpu.event()
    done.record(second)
    with gpu.use_device():
        done.synchronize()
    assert bool((b == 1).all()) and event.query()


def test_a_kernel_reading_a_buffer_before_its_copy_landed_is_refused_naming_its_owner() -> None:
    """A module forward whose weight a copy still writes, not ordered after it, raises at once
    naming the buffer's owner; once the compute stream waited for the copy's event it runs."""
    gpu = SimCuda(max_lag=10.0)
    copier = gpu.new_stream()
    lin = nn.Linear(4, 4, bias=False)
    buf = gpu.empty(64)
    gpu.label(buf, "component 'transformer' unit 'blocks.0'")
    with gpu.use_stream(copier):
        gpu.copy(buf, lin.weight.detach().reshape(-1).view(torch.uint8).clone())
    event = gpu.event()
    event.record(copier)
    with torch.no_grad():
        lin.weight.data = buf.view(torch.float32).view(4, 4)
        with pytest.raises(CudaSimViolation, match=r"blocks\.0.*before"):
            lin(torch.ones(1, 4))
        gpu.default_stream().wait_event(event)
        out = lin(torch.ones(1, 4))
    assert torch.isfinite(out).all()
    assert len(check_cuda_sim()) == 1  # the one raised (a test fails for those it swallowed)


def test_the_compute_stream_lags_the_host() -> None:
    """A forward's kernels are queued on the compute stream and complete later, as on a GPU
    where Python runs ahead: the stream is not idle right after the forward returns."""
    gpu = SimCuda(max_lag=10.0)
    lin = nn.Linear(4, 4)
    for p in lin.parameters():
        gpu.adopt(p)
    with torch.no_grad():
        lin(torch.ones(1, 4))
    assert not gpu.default_stream().query()
    with gpu.use_device():
        gpu.default_stream().synchronize()
    assert gpu.default_stream().query()


def test_a_block_is_reused_only_by_its_own_stream() -> None:
    """A freed block goes back to the pool of the stream it was allocated on: an allocation on
    that stream gets it again, one on another stream never does."""
    gpu = SimCuda()
    other = gpu.new_stream()
    a = gpu.empty(4096)
    address = a.data_ptr()
    del a
    with gpu.use_stream(other):
        b = gpu.empty(4096)
    assert b.data_ptr() != address
    c = gpu.empty(4096)
    assert c.data_ptr() == address


def test_a_block_recorded_on_a_busy_stream_returns_to_the_pool_once_it_passed_the_free() -> None:
    """Freed while a stream that recorded a use has work queued, a block is not reusable
    (active, not allocated) until that stream passes the point of the free."""
    gpu = SimCuda(max_lag=10.0)
    copier = gpu.new_stream()
    a = gpu.empty(4096)
    address = a.data_ptr()
    with gpu.use_stream(copier):
        gpu.copy(a, host(4096))
    gpu.record_stream(a, copier)
    del a
    stats = gpu.memory()
    assert (stats.allocated, stats.active) == (0, 4096)
    b = gpu.empty(4096)
    assert b.data_ptr() != address
    with gpu.use_device():
        copier.synchronize()
    c = gpu.empty(4096)
    assert c.data_ptr() == address
    assert gpu.memory().active == gpu.memory().allocated == 8192
    del b, c


def test_a_device_buffer_freed_under_a_copy_on_another_stream_is_reported() -> None:
    """A device buffer freed while another stream's copy still writes it, with no
    record_stream and no wait, is recorded (its block could be reused before the copy ran)."""
    gpu = SimCuda(max_lag=10.0)
    copier = gpu.new_stream()
    a = gpu.empty(4096)
    gpu.label(a, "component 'vae' unit 'decoder'")
    with gpu.use_stream(copier):
        gpu.copy(a, host(4096))
    del a
    problems = check_cuda_sim()
    assert len(problems) == 1 and "'vae' unit 'decoder'" in problems[0] and "freed" in problems[0]


def test_memory_counters_peaks_empty_cache_and_free_memory_follow_the_allocator() -> None:
    """Allocations come from 2 MiB segments (small) or larger ones; reserved stays after a
    free until empty_cache gives the unused segments back; mem_get_info counts reserved bytes
    as taken; the peaks reset to the current values."""
    gpu = SimCuda(capacity=64 * MiB)
    small = gpu.empty(1000)
    big = gpu.empty(3 * MiB)
    stats = gpu.memory()
    assert stats.allocated == 1024 + 3 * MiB
    assert stats.reserved == 2 * MiB + 20 * MiB
    assert gpu.mem_get_info() == (64 * MiB - stats.reserved, 64 * MiB)
    del big
    assert gpu.memory().allocated == 1024 and gpu.memory().reserved == 22 * MiB
    gpu.empty_cache()
    assert gpu.memory().reserved == 2 * MiB
    assert gpu.memory().peak_reserved == 22 * MiB
    gpu.reset_peak()
    assert (gpu.memory().peak_allocated, gpu.memory().peak_reserved) == (1024, 2 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        gpu.empty(128 * MiB)
    del small


def test_a_freed_block_holds_poison() -> None:
    """What a freed block held is gone: a new allocation that reuses it reads poison."""
    gpu = SimCuda()
    a = gpu.empty(512)
    a.fill_(3)
    del a
    b = gpu.empty(512)
    assert bool((b == POISON).all())


def test_the_host_writing_a_buffer_a_copy_still_reads_is_refused() -> None:
    """A host copy into a buffer that a queued copy (not waited for) reads raises at once."""
    gpu = SimCuda(max_lag=10.0)
    copier = gpu.new_stream()
    mirror = host(256)
    with gpu.use_device():
        gpu.host_register(mirror.data_ptr(), 256)  # (a pageable source is read at once)
    gpu.label(mirror, "component 'transformer' unit 'blocks.3'")
    dst = gpu.empty(256)
    with gpu.use_stream(copier):
        gpu.copy(dst, mirror)
    with pytest.raises(CudaSimViolation, match=r"blocks\.3.*still reads"):
        gpu.host_copy(mirror, host(256, 9))
    with gpu.use_device():
        copier.synchronize()
    gpu.host_copy(mirror, host(256, 9))  # waited for: fine
    assert len(check_cuda_sim()) == 1
    with gpu.use_device():
        gpu.host_unregister(mirror.data_ptr())


def test_pinned_registration_is_bounded_and_seen_by_is_pinned() -> None:
    """Registered host ranges are pinned; past the locked-memory limit registration fails
    with cudaErrorMemoryAllocation, left as the thread's last error: the next launch on the
    thread raises it unless cleared; unregistering an unknown range is an error code too."""
    gpu = SimCuda(locked_limit=8192)
    buf = host(8192)
    with gpu.use_device():
        assert gpu.host_register(buf.data_ptr(), 4096) == 0
        assert gpu.is_pinned(buf[:10]) and not gpu.is_pinned(buf[4096:])
        assert gpu.host_register(buf.data_ptr() + 4096, 8192) == 2
        with pytest.raises(CudaSimViolation, match=r"cudaErrorMemoryAllocation.*cudaHostRegister"):
            gpu.empty(64)
        assert gpu.host_unregister(buf.data_ptr()) == 0
        assert gpu.host_unregister(buf.data_ptr()) == 1
        assert gpu.clear_error() == 1 and gpu.clear_error() == 0
    assert not gpu.is_pinned(buf)
    assert len(check_cuda_sim()) == 1  # the one raised


def test_calls_made_with_another_device_current_are_reported() -> None:
    """Registering pinned memory or waiting on an event from a thread whose current device is
    not the simulated one (cuda:1) would create a context on that device: recorded."""
    gpu = SimCuda(index=1)
    buf = host(4096)
    errors: list[int] = []
    thread = threading.Thread(target=lambda: errors.append(gpu.host_register(buf.data_ptr(), 4096)))
    thread.start()
    thread.join()
    problems = check_cuda_sim()
    assert errors == [0]
    assert len(problems) == 1 and "cudaHostRegister" in problems[0] and "cuda:0" in problems[0]
    with gpu.use_device():
        gpu.host_unregister(buf.data_ptr())


@pytest.mark.anyio
async def test_a_synchronizing_call_on_the_event_loop_is_reported() -> None:
    """empty_cache run on the event loop's thread (it synchronizes the device: the loop would
    stop serving) is recorded; in a worker thread it is not."""
    import anyio.to_thread

    gpu = SimCuda()
    await anyio.to_thread.run_sync(gpu.empty_cache)
    assert check_cuda_sim() == []
    with pytest.raises(CudaSimViolation, match="event loop"):
        gpu.empty_cache()
    assert len(check_cuda_sim()) == 1


def test_a_copy_nobody_waited_for_is_reported_at_the_check_and_then_forgotten() -> None:
    """check_cuda_sim names a copy neither the host nor another stream ever waited for (a
    forgotten wait), lands it, and the next check is clean; a discarded one is not named."""
    gpu = SimCuda(max_lag=10.0)
    copier = gpu.new_stream()
    dst = gpu.empty(64)
    with gpu.use_stream(copier):
        gpu.copy(dst, host(64))
    problems = check_cuda_sim()
    assert len(problems) == 1 and "never waited for" in problems[0]
    assert check_cuda_sim() == []
    with gpu.use_stream(copier):
        gpu.copy(dst, host(64))
    event = gpu.event()
    event.record(copier)
    gpu.discard(event)
    assert check_cuda_sim() == []


def test_a_reused_block_carries_the_old_tenants_queued_kernels() -> None:
    """A block freed while a kernel queued on its stream still reads it, then handed to a new
    tensor, keeps that kernel: a copy on another stream into the new tenant, not ordered after
    the compute stream, is refused; after a wait_stream it runs."""
    gpu = SimCuda(max_lag=10.0)
    copier = gpu.new_stream()
    lin = nn.Linear(4, 4, bias=False)
    old = gpu.empty(64)
    gpu.label(old, "component 'unet' unit 'down.0'")
    address = old.data_ptr()
    with torch.no_grad():
        lin.weight.data = old.view(torch.float32).view(4, 4)
        lin(torch.ones(1, 4))  # a kernel queued on the compute stream reads the block
    del lin, old
    new = gpu.empty(64)
    assert new.data_ptr() == address
    with gpu.use_stream(copier), pytest.raises(CudaSimViolation, match=r"'down\.0'.*not ordered"):
        gpu.copy(new, host(64))
    copier.wait_stream(gpu.default_stream())
    with gpu.use_stream(copier):
        gpu.copy(new, host(64))
    with gpu.use_device():
        copier.synchronize()
    assert bool((new == 7).all())
    assert len(check_cuda_sim()) == 1  # the one raised


def test_an_event_recorded_on_another_devices_stream_is_refused() -> None:
    """An event of one GPU recorded on a stream of another is an error (CUDA's
    cudaErrorInvalidResourceHandle): raised naming both devices."""
    first, second = SimCuda(index=1), SimCuda(index=2)
    event = first.event()
    with pytest.raises(CudaSimViolation, match=r"event of simulated cuda:1.*cuda:2"):
        event.record(second.new_stream())
    assert len(check_cuda_sim()) == 1


def test_synchronizing_calls_while_a_graph_is_captured_are_refused() -> None:
    """While a stream of the device captures a graph, a host wait, a device synchronize,
    empty_cache and cudaHostRegister are errors (they would invalidate the capture)."""
    gpu = SimCuda()
    buf = host(4096)
    event = gpu.event()
    event.record(gpu.new_stream())
    calls: list[Callable[[], object]] = [
        event.synchronize, gpu.synchronize, gpu.empty_cache,
        lambda: gpu.host_register(buf.data_ptr(), 4096)]
    with gpu.use_device(), gpu.capture():
        for call in calls:
            with pytest.raises(CudaSimViolation, match="captur"):
                call()
    assert len(check_cuda_sim()) == 4


@pytest.mark.anyio
async def test_pinned_registration_takes_time_and_is_reported_on_the_event_loop() -> None:
    """cudaHostRegister takes time in proportion to its bytes (the driver pins every page)
    and blocks: in a worker thread it is not reported, on the event loop's thread it is."""
    import anyio.to_thread

    gpu = SimCuda(register_rate=2**30)  # 1 GiB/s: 4 MiB take at least 4 ms
    buf, other = host(4 * MiB), host(4 * MiB)

    def register() -> float:
        start = time.monotonic()
        with gpu.use_device():
            assert gpu.host_register(buf.data_ptr(), 4 * MiB) == 0
        return time.monotonic() - start

    assert await anyio.to_thread.run_sync(register) >= 4 * MiB / 2**30
    assert check_cuda_sim() == []
    with gpu.use_device():
        assert gpu.host_register(other.data_ptr(), 4 * MiB) == 0
    problems = check_cuda_sim()
    assert len(problems) == 1 and "cudaHostRegister" in problems[0] and "event loop" in problems[0]


def test_empty_cache_synchronizes_the_device() -> None:
    """empty_cache waits for the device (cudaFree synchronizes): a copy queued on a copy
    stream has landed, and the host knows, when it returns."""
    gpu = SimCuda(max_lag=10.0)
    stream = gpu.new_stream()
    dst = gpu.empty(64)
    with gpu.use_stream(stream):
        gpu.copy(dst, host(64))
    event = gpu.event()
    event.record(stream)
    with gpu.use_device():
        gpu.empty_cache()
    assert event.query() and bool((dst == 7).all())
    assert check_cuda_sim() == []


def test_memory_stats_change_at_the_next_allocation_not_when_read() -> None:
    """A block freed while a recorded stream is busy stays active after that stream passed
    the free until the allocator next runs (an allocation), as torch processes its events."""
    gpu = SimCuda(max_lag=10.0)
    copier = gpu.new_stream()
    a = gpu.empty(4096)
    with gpu.use_stream(copier):
        gpu.copy(a, host(4096))
    gpu.record_stream(a, copier)
    del a
    with gpu.use_device():
        copier.synchronize()
    assert gpu.memory().active == 4096
    b = gpu.empty(512)
    assert (gpu.memory().active, gpu.memory().allocated) == (512, 512)
    del b


@pytest.mark.anyio
async def test_an_allocation_under_pressure_waits_for_queued_work_and_blocks() -> None:
    """An allocation that does not fit frees the cache first, waiting for every stream's
    queued work (torch synchronizes before cudaFree): a block still recorded on a busy
    stream is then reused; on the event loop's thread that wait is reported."""
    import anyio.to_thread

    gpu = SimCuda(max_lag=10.0, capacity=40 * MiB)
    copier = gpu.new_stream()

    def allocate() -> int:
        first = gpu.empty(30 * MiB)
        with gpu.use_stream(copier):
            gpu.copy(first[:64], host(64))
        gpu.record_stream(first, copier)
        del first
        second = gpu.empty(30 * MiB)  # only fits once the first segment is given back
        reserved = gpu.memory().reserved
        del second
        return reserved

    assert await anyio.to_thread.run_sync(allocate) == 30 * MiB
    assert copier.query() and check_cuda_sim() == []
    with pytest.raises(CudaSimViolation, match="event loop"):
        allocate()
    assert len(check_cuda_sim()) == 1


def test_a_threads_first_kernel_takes_a_workspace_that_is_never_freed() -> None:
    """The first kernel each of two host threads runs at once on the device takes a library
    workspace (cuBLAS: 32 MiB on Hopper) from the allocator, counted as allocated and kept
    after the threads end; a thread's later kernels take none."""
    gpu = SimCuda(workspace_bytes=MiB)
    lin = nn.Linear(4, 4)
    for p in lin.parameters():
        gpu.adopt(p)
    base = gpu.memory().allocated

    both = threading.Barrier(2)

    def forwards() -> None:
        with torch.no_grad():
            lin(torch.ones(1, 4))
            lin(torch.ones(1, 4))
        both.wait()  # both threads alive at once: two handles, two workspaces

    threads = [threading.Thread(target=forwards) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert gpu.memory().allocated - base == 2 * MiB
    check_cuda_sim()


def test_memory_taken_outside_the_allocator_is_not_free_and_leaves_it_less_room() -> None:
    """NCCL's buffers (or another process's memory) are taken outside the caching allocator:
    mem_get_info sees them, the allocator's counters do not; a segment that does not fit
    beside them fails as out of memory naming them, after the cache is given back; what does
    not fit itself is refused; released, the room is back."""
    gpu = SimCuda(capacity=64 * MiB)
    cached = gpu.empty(30 * MiB)
    del cached  # a cached segment of 30 MiB: reserved, not allocated
    key = gpu.take_foreign(24 * MiB, "NCCL's buffers")
    assert gpu.mem_get_info() == (64 * MiB - 30 * MiB - 24 * MiB, 64 * MiB)
    assert (gpu.memory().allocated, gpu.memory().reserved) == (0, 30 * MiB)
    assert gpu.foreign_bytes == 24 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="could not take"):
        gpu.take_foreign(11 * MiB, "a second communicator")  # the cache stays
    big = gpu.empty(40 * MiB)  # fits once the cached 30 MiB go back
    assert gpu.memory().reserved == 40 * MiB
    with pytest.raises(torch.OutOfMemoryError, match=r"25165824 taken outside the caching"):
        gpu.empty(2 * MiB)
    gpu.release_foreign(key)
    small = gpu.empty(2 * MiB)
    assert gpu.mem_get_info()[0] == 64 * MiB - gpu.memory().reserved
    del big, small


def test_a_convolutions_kernel_takes_cudnns_workspace_for_its_own_time() -> None:
    """A convolution's forward on device weights takes cuDNN's workspace from the allocator
    on its stream: the allocator's peak holds it, nothing stays allocated after, and the
    block it used carries the kernel to its next tenant (a copy on another stream into it must
    wait for compute). A linear layer takes none."""
    gpu = SimCuda(conv_workspace_bytes=MiB, max_lag=10.0)
    conv, lin = nn.Conv2d(2, 2, 3), nn.Linear(4, 4)
    for p in [*conv.parameters(), *lin.parameters()]:
        gpu.adopt(p)
    gpu.reset_peak()
    base = gpu.memory().allocated
    with torch.no_grad():
        lin(torch.ones(1, 4))
    assert gpu.memory().peak_allocated == base
    with torch.no_grad():
        conv(torch.ones(1, 2, 5, 5))
    assert gpu.memory().peak_allocated == base + MiB
    assert gpu.memory().allocated == base
    reused = gpu.empty(MiB)  # the workspace's block, its kernel still queued
    with gpu.use_stream(gpu.new_stream()), pytest.raises(CudaSimViolation, match="Conv2d"):
        gpu.copy(reused, host(MiB))
    check_cuda_sim()


def test_a_forward_writing_its_buffers_in_place_is_a_kernel_write() -> None:
    """A forward that updates a buffer in place (batch-norm running statistics in training)
    queues a kernel that writes it: a copy out of that buffer on another stream, not ordered
    after the compute stream, is refused; after a wait_stream it runs."""
    gpu = SimCuda(max_lag=10.0)
    copier = gpu.new_stream()
    norm = nn.BatchNorm1d(4)
    mean = norm.running_mean
    assert mean is not None
    for t in (*norm.parameters(), *norm.buffers()):
        gpu.adopt(t)
    with torch.no_grad():
        norm(torch.randn(8, 4))  # training: running_mean / running_var written
    out = gpu.empty(16)
    refused = r"reads .* before a kernel of BatchNorm1d"
    with gpu.use_stream(copier), pytest.raises(CudaSimViolation, match=refused):
        gpu.copy(out.view(torch.float32), mean)
    copier.wait_stream(gpu.default_stream())
    with gpu.use_stream(copier):
        gpu.copy(out.view(torch.float32), mean)
    with gpu.use_device():
        copier.synchronize()
    assert torch.equal(out.view(torch.float32), mean)
    assert len(check_cuda_sim()) == 1
