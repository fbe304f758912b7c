"""The CUDA layer's own code (strategies.devices._cuda.CudaDevice) on the simulated GPU: weight updates
of every dtype and layout, layerwise memory bounds, threads and devices, streams, mappings.

These run in every test pass: the layers here are built over a simulated GPU explicitly."""

from __future__ import annotations

import copy
import ctypes
import faulthandler
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lifecycle import ComponentBusy, LifecycleController, Phase, UnsupportedCompute
from lifecycle.testing import OrderingDevice, SimCuda, check_cuda_sim, sim_cuda_layer
from strategies import CpuDevice, CudaDevice, DeviceLayer, LayerwiseOffloadStrategy, ResidencyConfig
from strategies.devices import TorchCuda
from tests.helpers import faulty_device
from tests.strategies.typed_buffers import DTYPES, Typed, new_values

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

ROOT = Path(__file__).resolve().parents[2]


def assert_written(module: Typed, new: dict[str, torch.Tensor]) -> None:
    for name, value in new.items():
        got = getattr(module, name)
        assert got.dtype == module.vector.dtype and got.shape == value.shape, name
        assert torch.equal(got, value.to(got.dtype)), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["resident", "component-offload"])
async def test_updates_from_host_tensors_of_every_dtype_and_layout_are_exact(
        dtype: torch.dtype, mode: str) -> None:
    """An update from CPU tensors (the pageable path, staged through pinned buffers) writes
    0-d, 1-d, 2-d and non-contiguous targets of fp32, bf16, fp16 and int8 exactly, from
    contiguous, strided and wider sources; a sleep and a wake keep them."""
    module = Typed(dtype)
    layer = sim_cuda_layer()
    layer.stage_bytes = 16  # several chunks per tensor, both staging buffers in turn
    async with LifecycleController(device_layer=layer, residency=f"typed={mode}") as ctl:
        await ctl.attach({"typed": module})
        new = new_values(dtype)
        result = await ctl.update_weights_from_tensors(new, "typed")
        assert result.success, result.message
        assert_written(module, new)
        await ctl.sleep()
        await ctl.wake()
        async with ctl.use("typed"):
            assert_written(module, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
async def test_updates_from_disk_of_every_layout_are_exact(dtype: torch.dtype,
                                                           tmp_path: Path) -> None:
    """An update from a safetensors checkpoint (loaded on the host) writes 0-d, 1-d, 2-d and
    strided targets exactly on the CUDA layer."""
    module = Typed(dtype)
    async with LifecycleController(device_layer=sim_cuda_layer()) as ctl:
        await ctl.attach({"typed": module})
        new = {k: v.to(dtype).contiguous() for k, v in new_values(dtype).items()}
        (tmp_path / "typed").mkdir()
        save_file(new, str(tmp_path / "typed" / "model.safetensors"))
        result = await ctl.update_weights_from_disk(tmp_path)
        assert result.success, result.message
        assert_written(module, new)


# -- layerwise: reserved memory --------------------------------------------------------

DIM = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))  # type: ignore[no-any-return]


class Net(nn.Module):
    def __init__(self, n: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h


def layerwise(prefetch: float, resident: float) -> ResidencyConfig:
    return ResidencyConfig.parse("net=layerwise-offload", prefetch={"net": prefetch},
                                 resident_layers={"net": resident})


async def serve_layerwise(layer: CudaDevice, config: ResidencyConfig
                          ) -> tuple[LifecycleController, Net, Net, LayerwiseOffloadStrategy]:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    ctl = LifecycleController(device_layer=layer, residency=config)
    await ctl.attach({"net": model})
    strategy = ctl.strategy("net")
    assert isinstance(strategy, LayerwiseOffloadStrategy)
    return ctl, model, reference, strategy


@pytest.mark.parametrize(("prefetch", "resident"), [(1.0, 0.0), (2.0, 0.25)])
async def test_layerwise_reserved_memory_stays_within_the_bound_while_compute_lags(
        prefetch: float, resident: float) -> None:
    """With the compute stream lagging the host (every layer's kernels land up to 20 ms
    late), the allocator's reserved bytes during layerwise uses stay within non-layer +
    (resident + prefetch + 1) x largest layer (plus 512-byte block rounding): freed layer
    buffers are reused at once instead of new blocks being taken while compute catches up."""
    gpu = SimCuda(exact_segments=True, max_lag=0.02)
    ctl, model, reference, strategy = await serve_layerwise(CudaDevice(torch.device("cpu"), gpu),
                                                            layerwise(prefetch, resident))
    async with ctl:
        x = torch.randn(4, DIM)
        ctl.reset_peak()
        with torch.no_grad():
            expected = reference(x)
            async with ctl.use("net"):
                for _ in range(4):
                    assert torch.equal(model(x), expected)
            assert torch.equal(model(x), expected)  # outside use() too
        report = ctl.report()
        # (+ the workspace the first kernel of each thread takes, as cuBLAS does on a GPU)
        bound = strategy.peak_bound() + 512 * len(strategy.store.units) + gpu.workspace_total
        assert report.reserved_peak_bytes is not None
        assert report.reserved_peak_bytes <= bound, (report.reserved_peak_bytes, bound)


async def test_free_bytes_do_not_count_blocks_still_waiting_for_a_stream() -> None:
    """A block freed while a stream that used it has not passed the free is not free memory
    yet: free_bytes() leaves it out (the driver's free memory plus reusable cached blocks),
    until the allocator runs again after that stream passed (an allocation)."""
    gpu = SimCuda(max_lag=10.0, capacity=64 * 2**20)
    layer = CudaDevice(torch.device("cpu"), gpu)
    buf = layer.alloc(4096, "device")
    handle = layer.start_copy([(buf, torch.ones(4096, dtype=torch.uint8))], "device")
    before = layer.free_bytes()
    assert before is not None
    handle.drop()
    del buf
    assert gpu.memory().active - gpu.memory().allocated == 4096
    assert layer.free_bytes() == before
    layer.synchronize()
    assert layer.free_bytes() == before
    small = layer.alloc(512, "device")
    assert layer.free_bytes() == before + 4096 - 512
    del small


# -- threads, devices, the event loop ---------------------------------------------------

async def test_pinned_memory_is_registered_and_unregistered_with_the_layers_device_off_the_loop(
        ) -> None:
    """Mirrors are page-locked in worker threads and given back when freed, each time with the
    layer's device current (a context on GPU 0 otherwise) and never on the event loop's thread
    (unregistering synchronizes); empty_cache after a sleep runs off the loop too."""
    gpu = SimCuda(index=3)
    layer = CudaDevice(torch.device("cpu"), gpu)
    threads: list[str] = []
    original = gpu.empty_cache

    def empty_cache() -> None:
        threads.append(threading.current_thread().name)
        original()

    gpu.empty_cache = empty_cache  # type: ignore[method-assign]
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    async with LifecycleController(device_layer=layer, residency="net=component-offload") as ctl:
        await ctl.attach({"net": module})
        unit = ctl.strategy("net").store.units[0]
        assert unit.host is not None and gpu.is_pinned(unit.host)
        await ctl.sleep()
        await ctl.wake()
        await ctl.detach()
        await ctl.aclose()
        assert threads and threading.main_thread().name not in threads
        assert not gpu._pinned  # every registration given back
        assert check_cuda_sim() == []


def test_mirrors_stay_mapped_at_interpreter_exit(tmp_path: Path) -> None:
    """A weight that points into a pinned mirror is still readable from an atexit handler
    that runs after the finalizers would (the mirror is not unmapped at exit)."""
    script = textwrap.dedent("""
        import atexit
        seen = []
        # Registered before anything makes a weakref.finalize: runs after their exit hook.
        atexit.register(lambda: print("sum", float(seen[0].weight.detach().sum()), flush=True))
        import anyio, torch
        from torch import nn
        from lifecycle import LifecycleController
        from lifecycle.testing import sim_cuda_layer
        lin = nn.Linear(64, 64)
        torch.nn.init.constant_(lin.weight, 1.0)
        ctl = LifecycleController(device_layer=sim_cuda_layer(), residency="net=component-offload")
        anyio.run(ctl.attach, {"net": lin})
        seen.append(lin)  # its weight now points into a pinned mirror
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sum 4096.0" in done.stdout


def test_two_threads_staging_at_once_take_turns_with_the_staging_buffers() -> None:
    """Two worker threads copying pageable tensors at once (the layer's limiter allows two)
    never write a staging buffer a copy of the other still reads: both land exactly."""
    gpu = SimCuda(max_lag=0.05)
    layer = CudaDevice(torch.device("cpu"), gpu)
    layer.stage_bytes = 256
    host_copy = gpu.host_copy

    def slow_host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        time.sleep(0.0005)  # a host copy takes page faults: the other thread runs meanwhile
        host_copy(dst, src)

    gpu.host_copy = slow_host_copy  # type: ignore[method-assign]
    jobs = []
    for seed in range(2):
        dst = layer.alloc(4096, "device")
        src = torch.randint(0, 255, (4096,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
        jobs.append((dst, src))
    errors: list[BaseException] = []

    def run(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        try:
            layer._staged([pair])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for dst, src in jobs:
        assert torch.equal(dst, src)
    layer.close()


# -- layerwise: what compute waits for, and who may run a forward -----------------------

async def test_a_prefetch_nobody_uses_is_dropped_without_compute_waiting_for_it() -> None:
    """A forward outside use() ends by dropping the prefetch it started for a next pass:
    the compute stream waits for the copies of the layers that ran, one each, never for it."""
    gpu = SimCuda()
    ctl, model, reference, strategy = await serve_layerwise(CudaDevice(torch.device("cpu"), gpu),
                                                            layerwise(1.0, 0.0))
    async with ctl:
        x = torch.randn(2, DIM)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        assert strategy.fetched == len(model.blocks) + 1  # the last one: the next pass's first
        assert gpu.compute_waits == len(model.blocks)


async def test_a_layerwise_forward_outside_use_during_an_update_is_refused() -> None:
    """While an update writes the host stores a layerwise component streams from, its forward
    outside use() is refused (it would race with the write); after the update it serves the
    new weights."""
    layer = faulty_device(copy_delay=0.02)
    torch.manual_seed(0)
    model = Net(4)
    expected = copy.deepcopy(model)
    for block in expected.blocks:
        assert isinstance(block, Block)
        block.fc1.bias.data.fill_(0.5)
    async with LifecycleController(device_layer=layer, residency=layerwise(1.0, 0.0)) as ctl:
        await ctl.attach({"net": model})
        new = {f"blocks.{i}.fc1.bias": torch.full((2 * DIM,), 0.5) for i in range(4)}
        x = torch.randn(2, DIM)
        refused: list[BaseException] = []

        async def update() -> None:
            result = await ctl.update_weights_from_tensors(new, "net")
            assert result.success, result.message

        async with anyio.create_task_group() as tg:
            tg.start_soon(update)
            while ctl.phase is not Phase.UPDATING_WEIGHTS:
                await anyio.sleep(0.001)

            def forward() -> None:
                try:
                    with torch.no_grad():
                        model(x)
                except ComponentBusy as exc:
                    refused.append(exc)

            await anyio.to_thread.run_sync(forward)
        assert len(refused) == 1 and "'net'" in str(refused[0])
        with torch.no_grad():
            async with ctl.use("net"):
                assert torch.equal(model(x), expected(x))


async def test_forwards_on_a_user_stream_or_under_capture_are_refused_at_any_submodule() -> None:
    """Inside a component-offload use(), a submodule called directly on a user stream is
    refused (not only the component's root), and so is a forward while the layer's device
    captures a graph."""
    layer = sim_cuda_layer()
    gpu = layer.runtime
    assert isinstance(gpu, SimCuda)
    module = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    async with LifecycleController(device_layer=layer, residency="net=component-offload") as ctl:
        await ctl.attach({"net": module})
        x = torch.randn(2, 8)
        with torch.no_grad():
            async with ctl.use("net"):
                with gpu.use_stream(gpu.new_stream()):
                    with pytest.raises(UnsupportedCompute, match="non-default CUDA stream"):
                        module[2](x)
                    with pytest.raises(UnsupportedCompute, match="non-default CUDA stream"):
                        module(x)
                with gpu.capture(), pytest.raises(UnsupportedCompute, match="graph capture"):
                    module(x)
                module(x)


async def test_a_resident_components_forwards_may_run_on_a_user_stream_and_under_capture(
        ) -> None:
    """A resident component's weights never move around its forwards, so a forward on a user
    stream or while a graph is captured runs (docs/limits.md: reduce-overhead works for a
    resident component that is not put to sleep meanwhile); a sleep and a wake after it (the
    device synchronized first) keep its weights exact."""
    layer = sim_cuda_layer()
    gpu = layer.runtime
    assert isinstance(gpu, SimCuda)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    reference = copy.deepcopy(module)
    async with LifecycleController(device_layer=layer, residency="net=resident") as ctl:
        await ctl.attach({"net": module})
        x = torch.randn(2, 8)
        with torch.no_grad():
            expected = reference(x)
            async with ctl.use("net"):
                with gpu.use_stream(gpu.new_stream()):
                    assert torch.equal(module(x), expected)
                with gpu.capture():
                    assert torch.equal(module(x), expected)
            await ctl.sleep()
            await ctl.wake()
            async with ctl.use("net"):
                assert torch.equal(module(x), expected)


@pytest.mark.parametrize(("error", "named"), [(2, "cudaErrorMemoryAllocation"),
                                               (712, "cudaErrorHostMemoryAlreadyRegistered")])
def test_a_failed_registration_names_its_error_and_leaves_none_for_the_next_launch(
        error: int, named: str) -> None:
    """A mirror whose cudaHostRegister fails raises MemoryError naming the real error (the
    locked-memory limit only for an allocation failure); the error it left on the thread is
    cleared, so the next allocation and copy on that thread run."""
    gpu = SimCuda(locked_limit=4096) if error == 2 else SimCuda(register_error=error)
    layer = CudaDevice(torch.device("cpu"), gpu)
    with pytest.raises(MemoryError, match=named) as raised:
        layer.alloc(8192, "host")
    assert ("ulimit -l" in str(raised.value)) == (error == 2)
    buf = layer.alloc(64, "device")
    layer.start_copy([(buf, torch.ones(64, dtype=torch.uint8))], "device").wait_host()
    assert int(buf.sum()) == 64
    assert check_cuda_sim() == []
    layer.close()


def test_streams_that_cannot_be_made_fall_back_to_torchs_pool_logged_and_cleared(
        caplog: pytest.LogCaptureFixture) -> None:
    """When the layer's own streams cannot be created, it says so (a warning naming the CUDA
    error), uses pooled streams, and the error left on the thread does not fail the next
    copy."""
    gpu = SimCuda(stream_error=2)
    with caplog.at_level("WARNING", logger="residency.cuda"):
        layer = CudaDevice(torch.device("cpu"), gpu)
    assert not layer.own_streams
    assert [r.getMessage().count("cudaErrorMemoryAllocation") for r in caplog.records] == [1, 1]
    buf = layer.alloc(64, "device")
    layer.start_copy([(buf, torch.ones(64, dtype=torch.uint8))], "device").wait_host()
    assert int(buf.sum()) == 64
    layer.close()
    assert not any(getattr(s, "destroyed", False) for s in layer.streams.values())
    assert check_cuda_sim() == []


def test_close_destroys_the_layers_streams_unless_a_buffer_recorded_on_one_lives() -> None:
    """Closing a layer destroys its two copy streams; a layer whose dropped prefetch left a
    buffer recorded on a stream still alive keeps them (its free records an event there)."""
    layer = sim_cuda_layer()
    streams = list(layer.streams.values())
    layer.close()
    assert [getattr(s, "destroyed", None) for s in streams] == [True, True]
    layer = sim_cuda_layer()
    streams = list(layer.streams.values())
    buf, mirror = layer.alloc(64, "device"), layer.alloc(64, "host")
    layer.start_copy([(buf, mirror)], "device").drop()
    layer.close()
    assert [getattr(s, "destroyed", None) for s in streams] == [False, False]
    del buf  # freed after close: recorded on a stream that still exists
    assert check_cuda_sim() == []


def test_a_closed_layer_used_again_copies_on_new_streams_of_its_own() -> None:
    """A layer used after close (a controller closed, then attached again) makes two new
    copy streams on its first copy: the copies land, on neither destroyed stream."""
    layer = sim_cuda_layer()
    old = list(layer.streams.values())
    layer.close()
    buf, mirror = layer.alloc(64, "device"), layer.alloc(64, "host")
    mirror.fill_(7)
    layer.start_copy([(buf, mirror)], "device").wait_host()
    new = list(layer.streams.values())
    assert len(new) == 2 and not {id(s) for s in new} & {id(s) for s in old}
    assert [getattr(s, "destroyed", None) for s in new] == [False, False]
    assert torch.equal(buf, mirror)
    layer.close()
    assert [getattr(s, "destroyed", None) for s in new] == [True, True]
    assert check_cuda_sim() == []


def test_mirrors_are_not_copied_into_a_forked_child_and_ask_for_huge_pages() -> None:
    """A pinned mirror is left out of a forked child (MADV_DONTFORK: a data loader's fork does
    not copy gigabytes of weights): the child touching it faults, the parent's bytes stay; a
    large one is advised for transparent huge pages where the system has them."""
    layer = sim_cuda_layer()
    mirror = layer.alloc(4 * 2**20, "host")
    mirror.fill_(1)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (no torch kernel: its thread pool is gone)
        faulthandler.disable()  # the fault is expected: no traceback dump
        ctypes.memset(mirror.data_ptr(), 2, mirror.numel())
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
    assert int(mirror[0]) == 1 and int(mirror[-1]) == 1
    flags = _vm_flags(mirror.data_ptr()).split()
    assert "dc" in flags, flags  # "do not copy on fork"
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if hasattr(mmap, "MADV_HUGEPAGE") and thp.exists() and "[never]" not in thp.read_text():
        assert "hg" in flags, flags
    del mirror
    layer.close()


def _vm_flags(address: int) -> str:
    """The VmFlags line of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.removeprefix("VmFlags:")
    raise AssertionError(f"no mapping holds {address:#x}")


# -- the background refresh thread --------------------------------------------------------

async def test_each_layer_refreshes_in_a_thread_of_its_own_that_close_stops() -> None:
    """Two controllers refresh their mirrors after updates in two different threads, and once
    both are closed no refresh thread is left."""
    def refresh_threads() -> set[int]:
        return {t.ident or 0 for t in threading.enumerate() if t.name.startswith("residency-refresh")}

    seen: list[set[int]] = []
    before = refresh_threads()
    ctls = []
    async with AsyncExitStack() as stack:  # closed however the test ends
        for seed in range(2):
            torch.manual_seed(seed)
            module = nn.Sequential(nn.Linear(8, 8))
            ctl = await stack.enter_async_context(LifecycleController(device_layer=faulty_device()))
            await ctl.attach({"net": module})
            await ctl.sleep()
            await ctl.wake()  # mirrors exist: an update leaves them to refresh
            result = await ctl.update_weights_from_tensors({"0.weight": torch.zeros(8, 8)}, "net")
            assert result.success
            ctls.append(ctl)
            seen.append(refresh_threads() - before)
        assert len(seen[0]) == 1 and len(seen[1] - seen[0]) == 1
        for ctl in ctls:
            await ctl.aclose()
        assert refresh_threads() - before == set()


# -- device memory that arrives from the host ---------------------------------------------

LAYERS: dict[str, Callable[[], DeviceLayer]] = {
    "cpu": CpuDevice,
    "ordering": OrderingDevice,
    "cuda-sim": lambda: sim_cuda_layer(host_modules=False),
    "cuda-sim-host-modules": lambda: sim_cuda_layer(host_modules=True),
}


@pytest.mark.parametrize("kind", LAYERS)
def test_each_layer_says_which_tensors_are_on_its_device_tier(kind: str) -> None:
    """A CPU tensor a module brings is on the device tier of the CPU layers and of the default
    simulated GPU, not of a simulated GPU whose device memory is its own (``host_modules``);
    the layer's device buffers always are, its host buffers (pageable or pinned, views of
    them too) never."""
    layer = LAYERS[kind]()
    try:
        brought = torch.zeros(16)
        on_device = kind != "cuda-sim-host-modules"
        assert layer.on_device(brought) is on_device and layer.on_device(brought[4:]) is on_device
        device = layer.alloc(64, "device")
        assert layer.on_device(device) and layer.on_device(device[8:].view(torch.float32))
        assert not layer.on_device(layer.alloc(64, "host", pinned=False)[8:])
        assert not layer.on_device(layer.alloc(4096, "host").view(torch.float32))
    finally:
        layer.close()


def test_the_cuda_runtime_counts_only_its_own_gpus_tensors_as_on_the_device() -> None:
    """The real runtime: a CUDA tensor of the layer's GPU is on the device; one of another GPU,
    or a CPU tensor, is not (tensors without storage: no GPU needed)."""
    with FakeTensorMode():
        on_0 = torch.empty(4, device="cuda:0")
    assert TorchCuda(torch.device("cuda", 0)).on_device(on_0)
    assert not TorchCuda(torch.device("cuda", 1)).on_device(on_0)
    assert not TorchCuda(torch.device("cuda", 0)).on_device(torch.zeros(4))


@pytest.mark.parametrize("mode", ["resident", "component-offload"])
@pytest.mark.parametrize("host_modules", [True, False], ids=["host-modules", "default"])
async def test_a_model_built_on_the_cpu_attaches_through_mirrors_where_device_memory_is_the_gpus(
        mode: str, host_modules: bool) -> None:
    """On a simulated GPU whose device memory is its own, a model built on the CPU is host
    memory, as on a GPU: attach copies its units into mirrors registered with the driver and
    from there to the device, so every weight ends in the GPU's memory; it serves the model's
    outputs, through a sleep and a wake too. On the default simulator the same model is device
    memory where it lies: a resident attach copies nothing."""
    gpu = SimCuda(host_modules=host_modules)
    layer = CudaDevice(torch.device("cpu"), gpu)
    torch.manual_seed(0)
    model = Net(4)
    reference = copy.deepcopy(model)
    assert all(layer.on_device(p) is not host_modules for p in model.parameters())
    x = torch.randn(2, DIM)
    async with LifecycleController(device_layer=layer, residency=f"net={mode}") as ctl:
        await ctl.attach({"net": model})
        units = ctl.strategy("net").store.units
        if host_modules:
            assert all(u.host is not None and gpu.is_pinned(u.host) for u in units)
            assert layer.copies >= len(units)  # into the mirrors (resident: and to the device)
        elif mode == "resident":
            assert layer.copies == 0
        for _ in range(2):
            with torch.no_grad():
                async with ctl.use("net"):
                    assert {u.where for u in units} == {"device"}
                    assert all(gpu.is_device(p) for p in model.parameters())
                    assert torch.equal(model(x), reference(x))
            await ctl.sleep()
            await ctl.wake()
