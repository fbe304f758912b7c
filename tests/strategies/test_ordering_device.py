"""The ordering layer itself: each class of CUDA ordering mistake is made visible on CPU
(reads without a wait see NaN, frees and overwrites in flight are reported naming the owner),
and correctly ordered code sees exact bytes. Then two end-to-end checks of the layerwise
strategy on it: a dirty evict streams exact bytes back, and a pass entered below the root
leaves no copy in flight."""

from __future__ import annotations

import gc
import time

import anyio
import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from lifecycle.testing import (
    POISON,
    InjectedFault,
    OrderingDevice,
    OrderingFaultyDevice,
    OrderingViolation,
    check_ordering,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

N = 64  # bytes per test buffer (16 float32)


def filled(layer: OrderingDevice, tier: str = "host", start: int = 0) -> torch.Tensor:
    """A fresh buffer of ``N`` bytes on ``tier`` holding ``start, start + 1, ...``."""
    buf = layer.alloc(N, "host" if tier == "host" else "device")
    buf.copy_(torch.arange(start, start + N, dtype=torch.uint8))
    return buf


def expected(start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + N, dtype=torch.uint8)


def test_a_read_without_a_wait_sees_poison_and_the_wait_sees_exact_bytes() -> None:
    """Until its copy is waited for, a destination holds 0xFF bytes (NaN as floats); after
    the wait it holds exactly the source's bytes."""
    layer = OrderingDevice(seed=1)
    host, dev = filled(layer), layer.alloc(N, "device")
    handle = layer.start_copy([(dev, host)], "device")
    assert bool((dev == POISON).all())
    assert bool(dev.view(torch.float32).isnan().all())
    handle.wait()
    assert torch.equal(dev, expected())
    layer.synchronize()
    assert check_ordering() == []


def test_a_fresh_buffer_is_poison_until_something_is_copied_into_it() -> None:
    """Allocations on either tier read as NaN: a kernel on a buffer nobody filled computes
    garbage, as it would on CUDA."""
    layer = OrderingDevice()
    for tier in ("device", "host"):
        assert bool(layer.alloc(N, tier).view(torch.float32).isnan().all())


def test_wait_orders_compute_but_only_wait_host_lets_the_host_read() -> None:
    """A device-to-host copy waited for by compute only (``wait``) has not landed for the
    host: the mirror is poison until ``wait_host``."""
    layer = OrderingDevice(seed=2)
    dev, host = filled(layer, "device", 7), layer.alloc(N, "host")
    handle = layer.start_copy([(host, dev)], "host")
    handle.wait()
    assert bool((host == POISON).all())
    handle.wait_host()
    assert torch.equal(host, expected(7))
    assert check_ordering() == []


def test_a_buffer_dropped_while_its_copy_is_in_flight_is_reported_naming_its_owner() -> None:
    """Dropping a device buffer whose copy nobody waited for is recorded when it is freed,
    names the buffer's owner and the copy, raises at the next call into the layer, and is
    still reported at teardown."""
    layer = OrderingDevice(seed=3)
    host = filled(layer)
    layer.label(host, "transformer", "blocks.2")
    dev = layer.alloc(N, "device")
    layer.label(dev, "transformer", "blocks.2")
    layer.start_copy([(dev, host)], "device")  # the handle is lost: nobody will wait
    del dev
    assert len(layer.violations) == 1
    message = layer.violations[0]
    assert "device buffer of component 'transformer' unit 'blocks.2'" in message
    assert "was freed while copy #1 to device" in message and "never waited for" in message
    with pytest.raises(OrderingViolation, match="was freed while copy #1"):
        layer.alloc(N, "device")
    layer.alloc(N, "device")  # raised once; the layer goes on
    problems = check_ordering()
    assert problems[0] == message
    assert problems[1].endswith("was never waited for")
    assert check_ordering() == []


def test_a_host_mirror_dropped_under_a_copy_that_reads_it_is_reported() -> None:
    """The source side counts too: a host mirror freed while an unwaited copy still reads it
    is reported as the mirror of its unit."""
    layer = OrderingDevice()
    host = filled(layer)
    layer.label(host, "vae", "decoder.0")
    dev = layer.alloc(N, "device")
    handle = layer.start_copy([(dev, host)], "device")
    del host
    assert "host mirror of component 'vae' unit 'decoder.0'" in layer.violations[0]
    assert "still reads it" in layer.violations[0]
    with pytest.raises(OrderingViolation):
        handle.wait()
    assert torch.equal(dev, expected())  # the copy read its source when it started
    assert len(check_ordering()) == 1


def test_a_source_overwritten_mid_copy_is_reported() -> None:
    """A host mirror written while a copy still reads it fails the wait, naming the mirror
    and the copy."""
    layer = OrderingDevice(seed=4)
    host = filled(layer)
    layer.label(host, "text_encoder", "(component)")
    dev = layer.alloc(N, "device")
    handle = layer.start_copy([(dev, host)], "device")
    host[3] = 0
    with pytest.raises(OrderingViolation, match=r"host mirror of component 'text_encoder' "
                                                r"unit '\(component\)' .* was written while copy"):
        handle.wait()
    assert len(check_ordering()) == 1


def test_a_destination_written_mid_copy_is_reported() -> None:
    """A buffer written (by a kernel, by the host) while a copy into it is in flight fails
    the wait: the copy would overwrite that write when it lands."""
    layer = OrderingDevice(seed=5)
    host, dev = filled(layer), layer.alloc(N, "device")
    handle = layer.start_copy([(dev, host)], "device")
    dev.zero_()
    with pytest.raises(OrderingViolation, match=r"was written while copy #1 .* into it"):
        handle.wait()
    assert len(check_ordering()) == 1


def test_host_writes_refuses_device_memory_and_a_mirror_a_copy_still_reads() -> None:
    """The host may write a host buffer no copy touches; never a device buffer (CUDA memory);
    and a host mirror an unwaited copy still reads is an ordering violation naming both,
    until the host waited for that copy."""
    layer = OrderingDevice(seed=6)
    host, dev, idle = filled(layer), layer.alloc(N, "device"), filled(layer, start=9)
    layer.label(host, "vae", "decoder.1")
    assert layer.host_writes(idle, "host")
    assert not layer.host_writes(dev, "device")
    assert not layer.host_writes(dev, "host")  # the buffer's own tier decides, not the caller
    handle = layer.start_copy([(dev, host)], "device")
    with pytest.raises(OrderingViolation, match=r"the host writes host mirror of component "
                                                r"'vae' unit 'decoder.1' .* still reads it"):
        layer.host_writes(host, "host")
    handle.wait_host()
    assert layer.host_writes(host, "host")
    assert len(check_ordering()) == 1


def test_a_copy_that_reads_a_buffer_another_stream_still_writes_raises_at_once() -> None:
    """Copying a device buffer back to the host before its copy in was waited for is refused
    when it starts (the two copy streams are not ordered)."""
    layer = OrderingDevice()
    host, dev, back = filled(layer), layer.alloc(N, "device"), layer.alloc(N, "host")
    layer.label(dev, "unet", "down.1")
    handle = layer.start_copy([(dev, host)], "device")
    with pytest.raises(OrderingViolation, match="reads device buffer of component 'unet'"):
        layer.start_copy([(back, dev)], "host")
    handle.wait()
    layer.start_copy([(back, dev)], "host").wait_host()  # ordered now: compute waited
    assert torch.equal(back, expected())
    assert len(check_ordering()) == 1


def test_a_copy_that_overwrites_a_source_another_stream_still_reads_raises_at_once() -> None:
    """Writing into a host mirror that an unwaited copy to the device still reads is refused
    when the writing copy starts."""
    layer = OrderingDevice()
    mirror, dev, other = filled(layer), layer.alloc(N, "device"), filled(layer, "device", 9)
    handle = layer.start_copy([(dev, mirror)], "device")
    with pytest.raises(OrderingViolation, match=r"overwrites host buffer .* still reads it"):
        layer.start_copy([(mirror, other)], "host")
    handle.wait_host()
    assert len(check_ordering()) == 1


def test_copies_on_one_stream_are_ordered_without_waits_between_them() -> None:
    """Two copies queued on one stream, the second reading what the first writes, need no
    wait between them (as on a CUDA stream) and land in order."""
    layer = OrderingDevice(seed=6)
    host, a, b = filled(layer, start=3), layer.alloc(N, "device"), layer.alloc(N, "device")
    layer.start_copy([(a, host)], "device")
    layer.start_copy([(b, a)], "device").wait()
    assert torch.equal(b, expected(3)) and torch.equal(a, expected(3))
    layer.synchronize()
    assert check_ordering() == []


def test_handing_a_buffer_to_compute_before_its_copy_was_waited_for_raises() -> None:
    """``for_compute`` (what a commit calls when tensors are re-pointed) on a buffer whose
    copy in was not waited for raises: kernels would read it first."""
    layer = OrderingDevice()
    host, dev = filled(layer), layer.alloc(N, "device")
    handle = layer.start_copy([(dev, host)], "device")
    with pytest.raises(OrderingViolation, match="handed to compute before copy #1"):
        layer.for_compute(dev)
    handle.wait()
    layer.for_compute(dev)
    layer.synchronize()
    assert len(check_ordering()) == 1


def test_a_fault_at_the_kth_pair_lands_the_pairs_started_before_it() -> None:
    """An injected copy failure propagates where CUDA would raise it (at the start), after
    the pairs started before it have landed; the pairs after it are not touched."""
    layer = OrderingFaultyDevice(fail_copy_at=2)
    srcs = [filled(layer, start=10 * k) for k in range(3)]
    dsts = [layer.alloc(N, "device") for _ in range(3)]
    with pytest.raises(InjectedFault):
        layer.start_copy(list(zip(dsts, srcs, strict=True)), "device")
    assert torch.equal(dsts[0], expected(0))
    assert bool((dsts[1] == POISON).all()) and bool((dsts[2] == POISON).all())
    assert layer.in_flight() == [] and check_ordering() == []


def test_a_wait_returns_only_once_its_copy_is_due_to_land() -> None:
    """Each copy lands a seeded random delay of at most ``max_delay`` after it started, and
    waiting for it blocks until then."""
    layer = OrderingDevice(seed=7, max_delay=0.01)
    host = filled(layer)
    for _ in range(3):
        dev = layer.alloc(N, "device")
        started = time.monotonic()
        handle = layer.start_copy([(dev, host)], "device")
        due = layer._ord_streams["device"][-1].due
        assert started <= due <= time.monotonic() + 0.01
        handle.wait_host()
        assert time.monotonic() >= due
    assert check_ordering() == []


async def test_an_async_copy_returns_with_exact_bytes_even_when_cancelled() -> None:
    """``copy`` returns once every byte landed; a caller cancelled meanwhile still waits for
    the copy, so it may free the buffers at once."""
    layer = OrderingDevice(seed=8, max_delay=0.01)
    host, dev = filled(layer, start=5), layer.alloc(N, "device")
    await layer.copy([(dev, host)], "device")
    assert torch.equal(dev, expected(5))
    other = layer.alloc(N, "device")
    with anyio.CancelScope() as scope:
        scope.cancel()
        await layer.copy([(other, host)], "device")
    assert layer.in_flight() == []
    del other
    assert check_ordering() == []


class _NormBlock(nn.Module):
    """A block whose forward in training mode writes its running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))  # type: ignore[no-any-return]


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_NormBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Autoencoder(nn.Module):
    """Like diffusers' VAE: the pipeline calls ``decode``, never ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = _Decoder()

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)  # type: ignore[no-any-return]


async def test_layerwise_streams_layers_a_training_forward_changed_back_exactly() -> None:
    """Layers whose statistics a training-mode forward changed are evicted through a copy
    the host waits for: outputs, and the statistics after sleep and wake, match a plain
    module bit for bit."""
    torch.manual_seed(0)
    model, reference = _Decoder().train(), _Decoder().train()
    reference.load_state_dict(model.state_dict())
    layer = OrderingDevice(seed=9)
    ctl = LifecycleController(device_layer=layer, residency="all=layerwise-offload")
    await ctl.attach({"decoder": model})
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        async with ctl.use("decoder") as module:
            with torch.no_grad():
                out = module(x)
        with torch.no_grad():
            assert torch.equal(out, reference(x))
    assert (await ctl.sleep()).success and (await ctl.wake()).success
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(),
                                 strict=True):
        assert torch.equal(got, want), name
    await ctl.detach()
    assert check_ordering() == []


async def test_a_layerwise_pass_entered_below_the_root_leaves_no_copy_in_flight() -> None:
    """A direct call outside a use that enters through a submodule (``vae.decode``) releases
    the layers it prefetched for a next pass when it returns: nothing stays in flight or
    held on the device."""
    torch.manual_seed(1)
    vae = _Autoencoder().eval()
    layer = OrderingDevice(seed=10)
    ctl = LifecycleController(device_layer=layer, residency="all=layerwise-offload")
    await ctl.attach({"vae": vae})
    before = ctl.report().device_bytes
    x = torch.randn(4, 8)
    with torch.no_grad():
        first = vae.decode(x)
        for _ in range(2):
            assert torch.equal(vae.decode(x), first)
    assert layer.in_flight() == []
    assert ctl.report().device_bytes == before
    del ctl
    gc.collect()
    assert check_ordering() == []


def test_the_option_puts_controllers_that_make_their_own_layer_on_the_ordering_layer(
        request: pytest.FixtureRequest) -> None:
    """Under ``--device-layer=ordering`` a controller on the CPU gets an ordering layer;
    otherwise the plain CPU layer."""
    ordering = request.config.getoption("--device-layer") == "ordering"
    assert isinstance(LifecycleController("cpu").device_layer, OrderingDevice) is ordering


def test_the_environment_picks_the_layer_of_a_cpu_device(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """RESIDENCY_DEVICE_LAYER=ordering makes every CPU layer the library builds itself (and
    lifecycle.testing's faulty_device_layer) an ordering layer, cuda-sim the CUDA layer over a
    simulated GPU (a program started by a test runs its moves as CUDA orders them); 'cpu' or
    nothing gives the plain layer; anything else is refused naming the valid values."""
    import lifecycle.testing
    from lifecycle.testing import DEVICE_LAYER_ENV, FaultyCudaDevice, SimCuda, faulty_device_layer
    from strategies import CpuDevice, CudaDevice, make_device_layer

    monkeypatch.setenv(DEVICE_LAYER_ENV, "ordering")
    assert type(make_device_layer("cpu")) is OrderingDevice
    assert isinstance(faulty_device_layer("cpu", fail_copy_at=3), OrderingFaultyDevice)
    assert issubclass(lifecycle.testing.faulty_cpu_layer_class(), OrderingFaultyDevice)
    monkeypatch.setenv(DEVICE_LAYER_ENV, "cuda-sim")
    layer = make_device_layer("cpu")
    assert type(layer) is CudaDevice and isinstance(layer.runtime, SimCuda)
    assert isinstance(faulty_device_layer("cpu", fail_copy_at=3), FaultyCudaDevice)
    assert issubclass(lifecycle.testing.faulty_cpu_layer_class(), FaultyCudaDevice)
    monkeypatch.setenv(DEVICE_LAYER_ENV, "cpu")
    assert type(make_device_layer("cpu")) is CpuDevice
    monkeypatch.delenv(DEVICE_LAYER_ENV)
    assert type(make_device_layer("cpu")) is CpuDevice
    monkeypatch.setenv(DEVICE_LAYER_ENV, "fast")
    with pytest.raises(ValueError, match="'cpu', 'ordering', 'cuda-sim'"):
        make_device_layer("cpu")
    monkeypatch.delenv(DEVICE_LAYER_ENV)
    # the factories read the variable when called: the plain layer, whatever the pass imported
    assert type(faulty_device_layer("cpu")) is lifecycle.testing.FaultyDevice
    assert lifecycle.testing.faulty_cpu_layer_class() is lifecycle.testing.FaultyDevice


def test_faulty_device_is_the_cpu_layer_whatever_the_environment(monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """lifecycle.testing.FaultyDevice names one class, the CPU layer with fault injection,
    under every RESIDENCY_DEVICE_LAYER; the selected layer comes from the factories."""
    from lifecycle.testing import DEVICE_LAYER_ENV, LAYER_KINDS, FaultyCudaDevice, FaultyDevice
    from strategies import CpuDevice

    for kind in LAYER_KINDS:
        monkeypatch.setenv(DEVICE_LAYER_ENV, kind)
        layer = FaultyDevice(fail_copy_at=3)
        assert type(layer) is FaultyDevice and isinstance(layer, CpuDevice)
        assert not isinstance(layer, (OrderingFaultyDevice, FaultyCudaDevice))
        layer.close()
