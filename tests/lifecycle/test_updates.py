"""Weight updates: validated first, written all-or-nothing, versioned and checksummed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lifecycle import (
    LifecycleController,
    Phase,
    TransitionFailed,
    UpdateResult,
    WeightUpdateWhileSleeping,
)
from lifecycle._errors import RankFailure
from lifecycle._updates import UpdatePlan
from tests.helpers import (
    attach_allocates,
    faulty_device,
    fingerprints,
    layer,
    run_pipeline,
    small_pipeline,
    tensor_ids,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

MODES = ["resident", "component-offload", "snapshot-offload", "layerwise-offload"]


def new_state(module: nn.Module, delta: float = 1.0) -> dict[str, torch.Tensor]:
    """Every tensor of ``module`` shifted by ``delta`` (one name per tensor)."""
    out = {}
    for k, v in module.state_dict().items():
        out[k] = (v + delta).contiguous() if v.is_floating_point() else v.clone()
    return out


async def attached(mode: str = "resident", layer: Any = None,
                   ) -> tuple[LifecycleController, dict[str, nn.Module]]:
    pipe = small_pipeline()
    # text_encoder has a block list, so every mode (layerwise too) applies to it.
    ctl = LifecycleController("cpu" if layer is None else None, device_layer=layer,
                              residency=f"text_encoder={mode}")
    await ctl.attach(pipe)
    return ctl, pipe


def write_checkpoint(root: Path, pipe: dict[str, nn.Module], names: list[str],
                     delta: float = 1.0) -> None:
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        state = new_state(pipe[name], delta)
        half = len(state) // 2 or 1
        items = sorted(state.items())
        save_file(dict(items[:half]), str(root / name / "part-0.safetensors"))
        if items[half:]:
            save_file(dict(items[half:]), str(root / name / "part-1.safetensors"))


async def expected_sums(pipe: dict[str, nn.Module], updates: dict[str, dict[str, torch.Tensor]]
                        ) -> dict[str, str]:
    """Checksums a fresh resident controller reports after loading ``updates``."""
    ref = small_pipeline()
    for name, state in updates.items():
        ref[name].load_state_dict(state, strict=False)
    ctl = LifecycleController("cpu")
    await ctl.attach(ref)
    return ctl.weights_checksum()


@pytest.mark.parametrize("mode", MODES)
async def test_update_from_tensors_writes_in_place_for_every_mode(mode: str) -> None:
    """New values land in the same Parameter objects, checksums match a fresh load, the
    version counts up, and sleep/wake keeps the new values."""
    ctl, pipe = await attached(mode)
    ids = tensor_ids(pipe)
    state = new_state(pipe["text_encoder"])
    state.pop("head.weight")  # tied to embed.weight: one name per tensor
    result = await ctl.update_weights_from_tensors(state, target_module="text_encoder")
    assert isinstance(result, UpdateResult)
    assert (result.success, result.version, result.updated) == (True, 1, ("text_encoder",))
    assert result.as_dict()["success"] is True
    assert ctl.weights_version == 1 and ctl.phase is Phase.AWAKE
    assert tensor_ids(pipe) == ids
    expected = await expected_sums(pipe, {"text_encoder": state})
    assert ctl.weights_checksum() == expected
    await ctl.sleep()
    assert ctl.weights_checksum() == expected
    await ctl.wake()
    assert ctl.weights_checksum() == expected
    async with ctl.use("text_encoder"):
        out = pipe["text_encoder"](torch.arange(4).reshape(1, 4))
    ref = small_pipeline()
    ref["text_encoder"].load_state_dict(state, strict=False)
    assert torch.equal(out, ref["text_encoder"](torch.arange(4).reshape(1, 4)))


async def test_resident_update_writes_mirror_too_so_next_sleep_copies_nothing() -> None:
    """After a sleep filled the mirrors, an update writes device and mirror: sleep copies 0."""
    ctl, pipe = await attached()
    await ctl.sleep()
    await ctl.wake()
    await ctl.update_weights_from_tensors(new_state(pipe["transformer"]))
    result = await ctl.sleep()
    assert result.bytes_moved == 0
    await ctl.wake()
    expected = await expected_sums(pipe, {"transformer": new_state(small_pipeline()["transformer"])})
    assert ctl.weights_checksum(["transformer"]) == {"transformer": expected["transformer"]}


async def test_offloaded_update_touches_only_the_host_store() -> None:
    """A component-offload update makes no device round trip: no device allocation."""
    layer = faulty_device()
    ctl, pipe = await attached("component-offload", layer)
    allocs = layer.allocations - layer.host_allocations
    await ctl.update_weights_from_tensors(new_state(pipe["text_encoder"]), "text_encoder")
    assert layer.allocations - layer.host_allocations == allocs
    assert ctl.report().components["text_encoder"].device_bytes == 0


async def test_update_accepts_name_tensor_pairs_and_casts_dtypes() -> None:
    """An iterable of pairs works; a float64 tensor is cast to the parameter's float32."""
    ctl, pipe = await attached()
    pairs = [(k, v.double()) for k, v in new_state(pipe["transformer"]).items()]
    # The annotation says Sequence; any iterable of pairs is accepted, and this checks it.
    result = await ctl.update_weights_from_tensors(iter(pairs))  # type: ignore[arg-type]
    assert result.success
    assert layer(pipe["transformer"], 0, nn.Linear).weight.dtype == torch.float32
    assert torch.equal(layer(pipe["transformer"], 0, nn.Linear).weight, pairs[0][1].float())


async def test_update_from_disk_folder_layout_updates_every_component_with_files(tmp_path: Path
                                                                                 ) -> None:
    """<path>/<component>/*.safetensors; target_modules=None takes every folder present."""
    ctl, pipe = await attached()
    write_checkpoint(tmp_path, pipe, ["transformer", "vae"])
    result = await ctl.update_weights_from_disk(tmp_path)
    assert (result.success, result.updated) == (True, ("transformer", "vae"))
    assert ctl.weights_checksum(["transformer", "vae"]) == {
        k: v for k, v in (await expected_sums(pipe, {
            "transformer": new_state(small_pipeline()["transformer"]),
            "vae": new_state(small_pipeline()["vae"])})).items() if k != "text_encoder"}


async def test_update_from_one_file_with_component_prefixed_keys(tmp_path: Path) -> None:
    """One .safetensors file with <component>.<name> keys updates those components."""
    ctl, pipe = await attached()
    state = {f"vae.{k}": v for k, v in new_state(pipe["vae"]).items()}
    save_file(state, str(tmp_path / "all.safetensors"))
    result = await ctl.update_weights_from_disk(tmp_path / "all.safetensors")
    assert (result.success, result.updated) == (True, ("vae",))
    run_pipeline(pipe)


def refusal_cases(tmp: Path, pipe: dict[str, nn.Module]) -> list[tuple[str, Any, str]]:
    write_checkpoint(tmp / "ok", pipe, ["vae"])
    (tmp / "bad" / "vae").mkdir(parents=True)
    (tmp / "bad" / "vae" / "x.safetensors").write_bytes(b"not safetensors at all")
    write_checkpoint(tmp / "trunc", pipe, ["vae"])
    f = tmp / "trunc" / "vae" / "part-0.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    unknown = {f"vae.{k}": v for k, v in new_state(pipe["vae"]).items()}
    unknown |= {"vae.extra.weight": torch.zeros(2), "unet.x": torch.zeros(1)}
    save_file(unknown, str(tmp / "unknown.safetensors"))
    shaped = new_state(pipe["vae"]) | {"0.weight": torch.zeros(8, 4, 3, 2)}
    save_file({f"vae.{k}": v for k, v in shaped.items()}, str(tmp / "shape.safetensors"))
    return [
        ("disk", (tmp / "ok", ["vae", "nope", "unet"]),
         "Module(s) requested for update not found in pipeline: ['nope', 'unet']. "
         "Available Module(s): ['text_encoder', 'transformer', 'vae']"),
        ("disk", (tmp / "ok", ["vae", "transformer"]),
         "Cannot update weights: missing weight files for modules: ['transformer']. "
         "No partial updates allowed."),
        ("disk", (tmp / "missing", None), f"weight path does not exist: {tmp / 'missing'}"),
        ("disk", (tmp / "bad", None),
         f"cannot read weight file {tmp / 'bad' / 'vae' / 'x.safetensors'}: not a valid "
         "safetensors file"),
        ("disk", (tmp / "trunc", None),
         f"cannot read weight file {tmp / 'trunc' / 'vae' / 'part-0.safetensors'}: not a "
         "valid safetensors file"),
        ("disk", (tmp / "unknown.safetensors", None),
         "2 key(s) match no parameter or buffer: ['unet.x', 'vae.extra.weight']; "
         "nothing was updated"),
        ("disk", (tmp / "shape.safetensors", None),
         "Shape mismatch for 0.weight: model=(8, 4, 3, 3), loaded=(8, 4, 3, 2)"),
        ("tensors", ({"0.weight": torch.zeros(8, 4, 3, 3), "nope": torch.zeros(1)}, "vae"),
         "1 key(s) match no parameter or buffer of vae: ['nope']; nothing was updated"),
        ("tensors", ({"0.weight": torch.zeros(3)}, "vae"),
         "Shape mismatch for 0.weight: model=(8, 4, 3, 3), loaded=(3,)"),
        ("tensors", ({}, "unet"), "Module(s) requested for update not found in pipeline: "
         "['unet']. Available Module(s): ['text_encoder', 'transformer', 'vae']"),
    ]


async def test_every_refusal_names_the_problem_and_writes_nothing(tmp_path: Path) -> None:
    """Each invalid update is refused with its message; weights, version, phase unchanged."""
    ctl, pipe = await attached()
    sums = ctl.weights_checksum()
    for kind, args, message in refusal_cases(tmp_path, pipe):
        if kind == "disk":
            result = await ctl.update_weights_from_disk(*args)
        else:
            result = await ctl.update_weights_from_tensors(*args)
        assert not result.success
        assert result.message.startswith(message), (result.message, message)
        assert (ctl.weights_version, ctl.phase) == (0, Phase.AWAKE)
        assert ctl.weights_checksum() == sums


async def test_update_while_sleeping_raises_and_uninitialized_fails() -> None:
    """SLEEPING raises the reference's refusal; UNINITIALIZED returns a failure result."""
    ctl, pipe = await attached()
    await ctl.sleep()
    with pytest.raises(WeightUpdateWhileSleeping) as info:
        await ctl.update_weights_from_tensors(new_state(pipe["transformer"]))
    assert str(info.value) == ("Cannot update weights while the server is sleeping. "
                               "Call resume_memory_occupation first.")
    assert ctl.phase is Phase.SLEEPING
    fresh = LifecycleController("cpu")
    result = await fresh.update_weights_from_tensors({})
    assert (result.success, result.message) == (False, "pipeline not initialized")


@pytest.mark.parametrize("mode", MODES)
async def test_fault_at_every_copy_and_allocation_rolls_back_every_tensor(mode: str) -> None:
    """For every k, failing the k-th copy or allocation of an update of two components
    leaves every checksum as before; a retry then succeeds. (A resident one attached with
    current mirrors, a pipeline in host memory, allocates nothing: its mirrors are the
    backups.)"""
    probe = faulty_device()
    backed = mode == "resident" and attach_allocates(small_pipeline()["text_encoder"], probe)
    ctl, pipe = await attached(mode, probe)
    copies, allocs = probe.copies, probe.allocations
    state = new_state(pipe["text_encoder"])
    state.pop("head.weight")
    await ctl.update_weights_from_tensors(state, "text_encoder")
    points = {"copy": probe.copies - copies, "alloc": probe.allocations - allocs}
    assert points["copy"] > 10
    assert points["alloc"] == 0 if backed else points["alloc"] > 10
    for kind, n in points.items():
        for k in range(1, n + 1):
            layer = faulty_device()
            ctl, pipe = await attached(mode, layer)
            sums = ctl.weights_checksum()
            layer.arm(**{f"{kind}_at": k})
            result = await ctl.update_weights_from_tensors(state, "text_encoder")
            assert not result.success and "rolled back" in result.message
            assert layer.faults == 1
            assert ctl.weights_checksum() == sums, (kind, k)
            assert (ctl.weights_version, ctl.phase) == (0, Phase.AWAKE)
            assert (await ctl.update_weights_from_tensors(state, "text_encoder")).success
            await ctl.sleep()
            await ctl.wake()
            assert ctl.weights_checksum() != sums


@pytest.mark.parametrize("mode", ["resident", "component-offload"])
async def test_fault_at_every_read_of_a_disk_update_rolls_back_every_tensor(
        tmp_path: Path, mode: str) -> None:
    """For every k, failing the k-th copy of an update from disk (file reads straight into
    place count as copies) leaves every checksum as before; a retry then succeeds."""
    probe = faulty_device()
    ctl, pipe = await attached(mode, probe)
    write_checkpoint(tmp_path, pipe, ["transformer", "text_encoder"])
    before = probe.copies
    assert (await ctl.update_weights_from_disk(tmp_path)).success
    n = probe.copies - before
    assert n >= 10
    for k in range(1, n + 1):
        layer = faulty_device()
        ctl, pipe = await attached(mode, layer)
        sums = ctl.weights_checksum()
        layer.arm(copy_at=k)
        result = await ctl.update_weights_from_disk(tmp_path)
        assert not result.success and "rolled back" in result.message, k
        assert layer.faults == 1
        assert ctl.weights_checksum() == sums, k
        assert (await ctl.update_weights_from_disk(tmp_path)).success
        assert ctl.weights_checksum() != sums


async def test_io_error_midway_through_disk_update_rolls_back(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """A loader failing after writing started restores every tensor written before it."""
    import strategies._fileread as fileread
    import strategies._write as write

    ctl, pipe = await attached()
    write_checkpoint(tmp_path, pipe, ["transformer", "vae"])
    sums = ctl.weights_checksum()
    monkeypatch.setattr(fileread, "CAN_READ_INTO", False)  # every tensor through the loader
    monkeypatch.setattr(write, "READ_CHUNK", 1)  # one tensor per read, so writes interleave
    calls = {"n": 0}
    real = write.load_chunk

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk vanished")
        return real(*args)

    monkeypatch.setattr(write, "load_chunk", flaky)
    result = await ctl.update_weights_from_disk(tmp_path)
    assert not result.success
    assert result.message.endswith("OSError: disk vanished")
    assert ctl.weights_checksum() == sums


@pytest.mark.parametrize("fail_at", [1, 3, 7])
async def test_direct_read_failing_midway_restores_every_tensor(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                fail_at: int) -> None:
    """A file read straight into the live tensors that fails after writing garbage into some
    of them (and all of earlier ones) leaves every tensor, and the version, as before."""
    import strategies._fileread as fileread

    # An offloaded component: its tensors are host memory on every device layer (the
    # ordering layer, like CUDA, lets the host write nothing else).
    ctl, pipe = await attached("component-offload")
    write_checkpoint(tmp_path, pipe, ["text_encoder"])
    sums = ctl.weights_checksum()
    monkeypatch.setattr(fileread, "PIECE", 64)  # many pieces, dealt to several threads
    calls = {"n": 0}
    real = fileread._preadv
    assert real is not None

    def flaky(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls["n"] += 1
        if calls["n"] >= fail_at:
            buffers[0][: len(buffers[0]) // 2] = b"\xff" * (len(buffers[0]) // 2)
            raise OSError("disk vanished")
        return int(real(fd, buffers, offset))

    monkeypatch.setattr(fileread, "_preadv", flaky)
    result = await ctl.update_weights_from_disk(tmp_path)
    assert calls["n"] >= fail_at
    assert not result.success and result.message.endswith("OSError: disk vanished")
    assert ctl.weights_checksum() == sums and ctl.weights_version == 0
    assert ctl.phase is Phase.AWAKE


async def test_file_cut_short_after_planning_fails_and_restores(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """A checkpoint truncated between validation and the read is reported by name (the file
    ended early) and nothing of it stays written."""
    import strategies._fileread as fileread

    ctl, pipe = await attached("component-offload")
    write_checkpoint(tmp_path, pipe, ["text_encoder"])
    sums = ctl.weights_checksum()
    victim = tmp_path / "text_encoder" / "part-1.safetensors"
    real = fileread._read_lane

    def truncating(lane: Any) -> None:
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
        real(lane)

    monkeypatch.setattr(fileread, "_read_lane", truncating)
    result = await ctl.update_weights_from_disk(tmp_path)
    assert not result.success
    assert "the file ended at byte" in result.message and "part-1.safetensors" in result.message
    assert ctl.weights_checksum() == sums


async def test_disk_update_reads_exact_tensors_in_place_and_loads_only_casts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors stored as the model stores them are read straight into place (no loaded
    copy); a tensor stored in another dtype is loaded and cast; both end up exact."""
    import strategies._write as write

    ctl, pipe = await attached("component-offload")
    state = new_state(pipe["text_encoder"])
    cast_name = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[cast_name] = state[cast_name].double()
    (tmp_path / "text_encoder").mkdir()
    save_file(state, str(tmp_path / "text_encoder" / "w.safetensors"))
    loaded: list[str] = []
    real = write.load_chunk

    def spy(sources: Any, dtypes: Any) -> Any:
        loaded.extend(s.name for s in sources)
        return real(sources, dtypes)

    monkeypatch.setattr(write, "load_chunk", spy)
    result = await ctl.update_weights_from_disk(tmp_path)
    assert result.success
    assert loaded == [cast_name]
    state[cast_name] = state[cast_name].float()
    assert ctl.weights_checksum(["text_encoder"]) == {
        "text_encoder": (await expected_sums(pipe, {"text_encoder": state}))["text_encoder"]}


async def test_update_waits_for_in_flight_uses_and_new_uses_wait_for_it() -> None:
    """A use in progress finishes first; a use requested meanwhile sees the new weights."""
    ctl, pipe = await attached()
    order: list[str] = []
    state = new_state(pipe["transformer"])
    in_use, release = anyio.Event(), anyio.Event()

    async def first_use() -> None:
        async with ctl.use("transformer"):
            order.append("use1 start")
            in_use.set()
            await release.wait()
            order.append("use1 end")

    async def update() -> None:
        await in_use.wait()
        order.append("update called")
        await ctl.update_weights_from_tensors(state)
        order.append("update done")

    async def second_use() -> None:
        while ctl.transition is None:  # the update has closed admission
            await anyio.sleep(0.001)
        release.set()
        async with ctl.use("transformer") as m:
            order.append(f"use2 sees version {ctl.weights_version}")
            assert torch.equal(layer(m, 0, nn.Linear).weight, state["0.weight"])

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first_use)
            tg.start_soon(update)
            tg.start_soon(second_use)
    assert order == ["use1 start", "update called", "use1 end", "update done",
                     "use2 sees version 1"]


async def test_checksum_is_identical_across_placements() -> None:
    """The same weights give the same checksum on device, asleep, and under every mode."""
    sums = []
    for mode in MODES:
        ctl, _ = await attached(mode)
        sums.append(ctl.weights_checksum())
        await ctl.sleep()
        sums.append(ctl.weights_checksum())
    assert all(s == sums[0] for s in sums)
    assert fingerprints(small_pipeline()) != {}  # sanity: helper pipeline is deterministic


async def test_fault_at_every_point_of_an_update_whose_mirrors_are_current() -> None:
    """After a sleep filled the mirrors, a resident update uses them as its backup: a fault
    while writing the device rolls back from the mirror; a fault while bringing the mirror up
    to date (in the background) leaves the update done and the mirror stale, which the next
    sleep copies."""
    probe = faulty_device()
    ctl, pipe = await attached("resident", probe)
    await ctl.sleep()
    await ctl.wake()
    state = new_state(pipe["transformer"])
    copies = probe.copies
    await ctl.update_weights_from_tensors(state)
    await ctl.strategy("transformer").store.land_refresh()  # count the background copies too
    points = probe.copies - copies
    assert points >= 2  # device writes, then mirror refresh: no backup copies at all
    new_sums = ctl.weights_checksum()
    outcomes = set()
    for k in range(1, points + 1):
        layer = faulty_device()
        ctl, pipe = await attached("resident", layer)
        await ctl.sleep()
        await ctl.wake()
        old_sums = ctl.weights_checksum()
        layer.arm(copy_at=k)
        result = await ctl.update_weights_from_tensors(state)
        assert ctl.weights_checksum() == (new_sums if result.success else old_sums)
        slept = await ctl.sleep()
        assert layer.faults == 1
        await ctl.wake()
        assert ctl.weights_checksum() == (new_sums if result.success else old_sums)
        if result.success:  # the fault hit the mirror refresh: the sleep copied it instead
            assert slept.bytes_moved > 0
        outcomes.add(result.success)
    assert outcomes == {True, False}


def test_a_rolled_back_update_names_every_ranks_cause_as_a_field() -> None:
    """An update rolled back names the class of its cause and of every failed rank's (several
    ranks: a rank that did not fail itself holds a RuntimeError naming the others), so that a
    server tells the trainer's failure from its own without reading the message."""
    alone = UpdatePlan.undone(TransitionFailed("update", Phase.AWAKE, MemoryError("oom")), 4)
    assert (alone.rolled_back, alone.causes, alone.version) == (True, ("MemoryError",), 4)
    failures = {1: RankFailure("WeightSyncTransferFailed", "the trainer left"),
                2: RankFailure("ValueError", "bad: LoraMergeNotFinite: a message is no cause")}
    others = UpdatePlan.undone(TransitionFailed(
        "update", Phase.AWAKE, RuntimeError("rank 1: ...; rank 2: ..."), failures), 4)
    assert others.causes == ("RuntimeError", "ValueError", "WeightSyncTransferFailed")
    assert others.failed_ranks == {1: "WeightSyncTransferFailed: the trainer left",
                                   2: "ValueError: bad: LoraMergeNotFinite: a message is no cause"}
    assert others.as_dict()["causes"] == list(others.causes)
