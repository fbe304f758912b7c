"""The file-backed tier: components whose weights are their checkpoint files' bytes keep no
host copy while asleep and are read back at wake, after checking the files are the ones
recorded; updates make their copies anonymous again (an update from disk records its files)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest
import torch

from lifecycle import (
    CheckpointChanged,
    CheckpointMismatch,
    LifecycleController,
    Phase,
    PlacementReport,
    TransitionFailed,
)
from lifecycle.demo import DemoPipeline
from lifecycle.demo._checkpoint import write_checkpoint
from lifecycle.testing import FaultInjection
from tests.helpers import faulty_device

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

SIZE = 2**20
MODES = ["resident", "component-offload", "snapshot-offload", "layerwise-offload"]
Made = tuple[LifecycleController, DemoPipeline, torch.Tensor, Path]
Make = Callable[..., Awaitable[Made]]


def state(pipe: DemoPipeline) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.detach().cpu().clone() for n, m in pipe.modules.items()
            for k, v in m.state_dict().items()}


def state_bytes(pipe: DemoPipeline) -> int:
    """Bytes of every parameter and persistent buffer, tied ones once (read while placed)."""
    seen: dict[int, int] = {}
    for m in pipe.modules.values():
        for t in m.state_dict(keep_vars=True).values():
            seen[t.data_ptr()] = int(t.nbytes)
    return sum(seen.values())


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    """``await make(residency, layer=None, checkpoint=True)``: a demo pipeline saved under
    ``tmp_path`` and attached (with ``checkpoint=`` those files), its output before attach;
    the controller closed after the test."""
    async with AsyncExitStack() as stack:
        async def made(residency: str | None = None, layer: FaultInjection | None = None,
                       checkpoint: bool = True) -> Made:
            pipe = DemoPipeline.build(SIZE)
            expected = pipe.forward_sync(steps=2)
            root = write_checkpoint({n: m.state_dict() for n, m in pipe.modules.items()},
                                    tmp_path / "ckpt")
            ctl = LifecycleController(device_layer=layer or faulty_device(), residency=residency)
            stack.push_async_callback(ctl.aclose)
            await ctl.attach(pipe, checkpoint=root if checkpoint else None)
            return ctl, pipe, expected, root

        yield made


async def settled(ctl: LifecycleController) -> PlacementReport:
    """The report once the device's queued work is done (on CUDA a block a failed copy
    used is freed when its stream gets there, not at once)."""
    await anyio.to_thread.run_sync(ctl.device_layer.synchronize)
    return ctl.report()


async def output(ctl: LifecycleController, pipe: DemoPipeline) -> torch.Tensor:
    return (await pipe.generate(ctl=ctl, steps=2)).cpu()


@pytest.mark.parametrize("mode", MODES)
async def test_a_file_backed_sleep_holds_no_host_copy_and_wakes_bit_exact(
        make: Make, mode: str) -> None:
    """Asleep, only the non-persistent buffers are held on the host (under 1% of the
    pipeline), the rest is file-backed; the wake reads it back bit-exact, nothing stale."""
    ctl, pipe, expected, _ = await make(f"transformer={mode},vae=component-offload")
    before, nbytes = state(pipe), state_bytes(pipe)
    result = await ctl.sleep()
    assert result.success and result.discarded == ()
    report = ctl.report()
    assert report.device_bytes == 0 and report.stale == {}
    assert report.file_backed_bytes == nbytes
    assert report.host_bytes <= pipe.nbytes // 100
    assert report.host_held_bytes <= pipe.nbytes // 100
    assert (await ctl.wake()).success
    assert ctl.stale == {} and ctl.report().file_backed_bytes == 0
    assert all(torch.equal(v, before[k]) for k, v in state(pipe).items())
    assert torch.equal(await output(ctl, pipe), expected)
    assert (await ctl.sleep()).success and ctl.report().file_backed_bytes == nbytes
    assert (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


async def test_a_refused_wake_has_freed_what_it_allocated_when_it_raises(
        make: Make, slow_handback: float) -> None:
    """A wake refused by a changed file after the components before it were read back, and
    rolled back: every device buffer it allocated is free when it raises, even while the
    worker threads that allocated them and read into them are slow to let go."""
    ctl, pipe, expected, root = await make("vae=component-offload")
    assert (await ctl.sleep()).success
    held, report = ctl.device_layer.held_bytes, ctl.report()
    path = root / "vae" / "model.safetensors"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    allocations = ctl.device_layer.allocations
    with pytest.raises(CheckpointChanged):
        await ctl.wake()
    assert ctl.device_layer.allocations > allocations  # (it had allocated)
    assert ctl.device_layer.held_bytes == held
    assert ctl.report() == report  # the allocator's own count too (CUDA layers)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


@pytest.mark.parametrize("change", ["touched", "resized", "removed"])
async def test_a_file_changed_or_removed_while_asleep_refuses_the_wake_naming_it(
        make: Make, change: str) -> None:
    """A file changed (mtime, size) or removed while asleep: the wake raises
    CheckpointChanged naming the file, the pipeline stays asleep exactly as it was; put
    back, the wake succeeds bit-exact."""
    ctl, pipe, expected, root = await make("vae=component-offload")
    assert (await ctl.sleep()).success
    path = root / "vae" / "model.safetensors"
    st = os.stat(path)
    data = path.read_bytes()
    report = ctl.report()
    if change == "touched":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    elif change == "resized":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:
        path.rename(path.with_suffix(".gone"))
    with pytest.raises(CheckpointChanged) as info:
        await ctl.wake()
    assert info.value.path == str(path) and info.value.component == "vae"
    what = {"touched": "changed (modification time", "resized": "changed (size",
            "removed": "was removed"}[change]
    assert info.value.what.startswith(what)
    assert ctl.phase is Phase.SLEEPING and ctl.report() == report
    if change == "removed":
        path.with_suffix(".gone").rename(path)
    else:
        path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


@pytest.mark.parametrize("mode", MODES)
async def test_a_fault_at_any_read_copy_or_allocation_of_the_wake_rolls_it_back(
        tmp_path: Path, mode: str) -> None:
    """Every file read, copy and allocation of a file-backed wake (of a two-block transformer
    alone), failed in turn: the wake fails with nothing changed (still asleep, same report),
    and the next wake gives back every tensor bit-exact."""
    dit = DemoPipeline.build(SIZE, num_layers=2).modules["transformer"]
    root = write_checkpoint({"transformer": dit.state_dict()}, tmp_path)
    before = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    layer = faulty_device()
    async with LifecycleController(device_layer=layer, residency=f"transformer={mode}") as ctl:
        await ctl.attach({"transformer": dit}, checkpoint=root)
        assert (await ctl.sleep()).success
        report = ctl.report()
        assert report.file_backed_bytes > 0
        copies, allocations = layer.copies, layer.allocations
        assert (await ctl.wake()).success
        copies, allocations = layer.copies - copies, layer.allocations - allocations
        assert (await ctl.sleep()).success and ctl.report() == report
        assert copies >= len(before) and allocations > 0
        for k in range(1, copies + 1):
            layer.arm(copy_at=k)
            with pytest.raises(TransitionFailed):
                await ctl.wake()
            assert ctl.phase is Phase.SLEEPING and await settled(ctl) == report, k
        for k in range(1, allocations + 1):
            layer.arm(alloc_at=k)
            with pytest.raises(TransitionFailed):
                await ctl.wake()
            assert ctl.phase is Phase.SLEEPING and await settled(ctl) == report, k
        layer.arm()
        assert (await ctl.wake()).success
        assert all(torch.equal(v.detach().cpu(), before[k]) for k, v in dit.state_dict().items())


async def test_an_update_from_tensors_makes_the_copies_anonymous_again(make: Make) -> None:
    """After a tensor update the transformer is no longer its files' bytes: its sleep keeps
    a host copy again, and the wake gives back the updated values."""
    ctl, pipe, _, _ = await make()
    name, value = next(iter(pipe.modules["transformer"].state_dict().items()))
    assert (await ctl.update_weights_from_tensors([(name, torch.ones_like(value))],
                                                  "transformer")).success
    assert (await ctl.sleep()).success
    components = ctl.report().components
    assert components["transformer"].file_backed_bytes == 0
    assert components["transformer"].host_bytes == components["transformer"].total_bytes
    assert components["vae"].host_bytes <= components["vae"].total_bytes // 100
    assert (await ctl.wake()).success
    assert torch.equal(pipe.modules["transformer"].state_dict()[name].cpu(),
                       torch.ones_like(value))


async def test_a_write_behind_the_controllers_back_makes_the_copies_anonymous(
        make: Make) -> None:
    """An in-place write to a parameter (its version bumps) after attach: the VAE's sleep
    keeps a host copy of it, and the wake restores the written value, not the file's."""
    ctl, pipe, _, _ = await make()
    weight = next(pipe.modules["vae"].parameters())
    with torch.no_grad():
        weight.add_(1.0)
    written = weight.detach().cpu().clone()
    assert (await ctl.sleep()).success
    assert ctl.report().components["vae"].file_backed_bytes == 0
    assert (await ctl.wake()).success
    assert torch.equal(weight.detach().cpu(), written)


async def test_an_update_from_disk_records_the_files_it_read(make: Make, tmp_path: Path
                                                             ) -> None:
    """Attached without a checkpoint nothing is file-backed; an update from disk makes the
    components it wrote file-backed from the files it read."""
    ctl, pipe, expected, root = await make(checkpoint=False)
    assert (await ctl.sleep()).success and ctl.report().file_backed_bytes == 0
    assert (await ctl.wake()).success
    assert (await ctl.update_weights_from_disk(root, ["vae"])).success
    assert (await ctl.sleep()).success
    components = ctl.report().components
    assert components["vae"].file_backed_bytes > 0 and components["transformer"].host_bytes > 0
    assert (await ctl.wake()).success
    assert torch.equal(await output(ctl, pipe), expected)


async def test_attach_with_a_checkpoint_of_other_weights_is_refused_naming_the_tensor(
        tmp_path: Path) -> None:
    """A checkpoint whose bytes differ from the pipeline's: CheckpointMismatch naming the
    tensor, nothing attached, the modules untouched."""
    pipe, other = DemoPipeline.build(SIZE), DemoPipeline.build(SIZE, seed=1)
    root = write_checkpoint({n: m.state_dict() for n, m in other.modules.items()}, tmp_path)
    before = state(pipe)
    async with LifecycleController(device_layer=faulty_device()) as ctl:
        with pytest.raises(CheckpointMismatch) as info:
            await ctl.attach(pipe, checkpoint=root)
        assert info.value.component == "text_encoder" and info.value.tensor
        assert ctl.phase is Phase.UNINITIALIZED
    assert all(torch.equal(v, before[k]) for k, v in state(pipe).items())


async def test_forgetting_a_changed_checkpoint_wakes_with_the_weights_discarded(
        make: Make) -> None:
    """The way out of a changed file: forget_checkpoint, and the wake gives the VAE places
    with its weights discarded (stale until updated), the others read back."""
    ctl, _, _, root = await make()
    assert (await ctl.sleep()).success
    path = root / "vae" / "model.safetensors"
    os.utime(path, ns=(1, 1))
    ctl.forget_checkpoint(["vae"])
    assert (await ctl.wake()).success
    assert set(ctl.stale) == {"vae"}


async def test_a_detach_while_asleep_file_backed_gives_the_weights_back(make: Make) -> None:
    """Detaching while asleep reads the file-backed weights back: the modules run as before."""
    ctl, pipe, expected, _ = await make("vae=component-offload")
    assert (await ctl.sleep()).success
    await ctl.detach()
    assert torch.equal(pipe.forward_sync(steps=2), expected)
