"""A weight update answers once the new weights are written; the host mirrors it makes stale
are refreshed in the background, and whatever reads them waits for (or supersedes) that."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import anyio
import pytest
import torch
from torch import nn

import strategies._write as write
from lifecycle import LifecycleController, Phase
from lifecycle._events import UPDATE_MIRROR_STALE
from lifecycle.testing import FaultInjection, capture_events
from strategies import CopyHandle
from strategies.devices import CopyPair, Tier
from strategies.protocol import TensorStore
from tests.helpers import SelectedFaultyDevice, fingerprints, small_pipeline

pytestmark = pytest.mark.anyio


class GatedDevice(SelectedFaultyDevice):
    """The fault-injecting CPU layer whose background refresh copies wait for ``gate``
    before they start: a test holds a refresh in flight as long as it needs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # a refresh copy is held at the gate
        self.refresh_copies = 0  # refresh chunks started

    def start_copy(self, pairs: Sequence[CopyPair], to: Tier) -> CopyHandle:
        if threading.current_thread().name.startswith("residency-refresh"):
            self.waiting.set()
            self.gate.wait()
            self.waiting.clear()
            self.refresh_copies += 1
        handle: CopyHandle = super().start_copy(pairs, to)
        return handle


def shifted(module: nn.Module, delta: float, names: Sequence[str] | None = None
            ) -> dict[str, torch.Tensor]:
    """``module``'s tensors (or only ``names``) plus ``delta``."""
    return {k: (v + delta).contiguous() for k, v in module.state_dict().items()
            if names is None or k in names}


def expected_after(updates: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, str]:
    """Fingerprints of a fresh pipeline whose transformer loaded ``updates`` in order."""
    ref = small_pipeline()
    for state in updates:
        ref["transformer"].load_state_dict(state, strict=False)
    return fingerprints(ref)


async def attached(layer: FaultInjection) -> tuple[LifecycleController, dict[str, nn.Module]]:
    """A resident pipeline on ``layer`` whose host mirrors are current (slept and woken)."""
    pipe = small_pipeline()
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach(pipe)
    await ctl.sleep()
    await ctl.wake()
    return ctl, pipe


def store_of(ctl: LifecycleController) -> TensorStore:
    return ctl.strategy("transformer").store


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every refresh copies one tensor per chunk (so it can be cancelled between them)."""
    monkeypatch.setattr(write, "REFRESH_FIRST", 1)
    monkeypatch.setattr(write, "REFRESH_CHUNK", 1)
    yield


async def wait_for(event: threading.Event) -> None:
    with anyio.fail_after(10):
        while not event.is_set():
            await anyio.sleep(0.001)


async def test_update_answers_before_the_refresh_and_a_sleep_waits_for_it() -> None:
    """The update returns with its mirror refresh still held back; the new weights are live;
    a sleep waits for the refresh, then copies nothing, and the woken weights are exact."""
    layer = GatedDevice()
    ctl, pipe = await attached(layer)
    async with ctl:
        state = shifted(pipe["transformer"], 1.0)
        layer.gate.clear()
        result = await ctl.update_weights_from_tensors(state)
        assert result.success and ctl.phase is Phase.AWAKE
        store = store_of(ctl)
        refresh = write.refresh_pending(store)
        assert refresh is not None and not refresh.done()
        await wait_for(layer.waiting)
        assert fingerprints(pipe) == expected_after([state])  # the write is complete
        assert all(u.dirty() for u in store.units)  # mirrors stale until the refresh lands
        slept: list[Any] = []

        async def sleep() -> None:
            slept.append(await ctl.sleep())

        async with anyio.create_task_group() as tg:
            tg.start_soon(sleep)
            await anyio.sleep(0.05)
            assert not slept and ctl.phase is Phase.AWAKE  # waiting for the refresh
            layer.gate.set()
        assert slept[0].success and slept[0].bytes_moved == 0  # the refresh made them current
        await ctl.wake()
        assert fingerprints(pipe) == expected_after([state])


async def test_waiting_for_mirrors_lands_the_refresh_so_the_next_sleep_copies_nothing(
        ) -> None:
    """``wait_for_mirrors`` returns only once the update's held refresh has landed (every
    mirror current, nothing pending) and reports a refresh that failed; the phase is
    untouched; the sleep after a landed refresh copies nothing, after a failed one what it
    left, and the woken weights are exact."""
    layer = GatedDevice()
    ctl, pipe = await attached(layer)
    async with ctl:
        first, second = shifted(pipe["transformer"], 1.0), shifted(pipe["transformer"], 2.0)
        before = layer.copies
        layer.gate.clear()
        assert (await ctl.update_weights_from_tensors(first)).success
        await wait_for(layer.waiting)
        writes = layer.copies - before  # the update's own copies (the refresh is held)
        done: list[bool] = []

        async def settle() -> None:
            await ctl.wait_for_mirrors()
            done.append(True)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(settle)
                await anyio.sleep(0.05)
                assert not done  # held at the gate
                layer.gate.set()
        finally:
            layer.gate.set()  # (a failure above must not leave the refresh held for detach)
        assert write.refresh_pending(store_of(ctl)) is None and ctl.phase is Phase.AWAKE
        assert not any(u.dirty() for u in store_of(ctl).units)
        assert (await ctl.sleep()).bytes_moved == 0
        await ctl.wake()

        with capture_events() as events:
            layer.arm(copy_at=writes + 1)  # the first copy of the second refresh
            assert (await ctl.update_weights_from_tensors(second)).success
            await ctl.wait_for_mirrors()
        assert layer.faults == 1
        assert [e["component"] for e in events if e["event"] == UPDATE_MIRROR_STALE] == \
            ["transformer"]
        assert write.refresh_pending(store_of(ctl)) is None
        slept = await ctl.sleep()
        assert slept.success and slept.bytes_moved > 0  # what the failed refresh left
        await ctl.wake()
        assert fingerprints(pipe) == expected_after([first, second])


async def test_a_sleep_right_after_an_update_gives_the_exact_weights() -> None:
    """Back-to-back updates and sleeps, with no wait in between: every wake gives exactly
    the last update's weights, and every mirror the sleep kept is current."""
    layer = GatedDevice(copy_delay=0.001)
    ctl, pipe = await attached(layer)
    async with ctl:
        updates = []
        for k in range(3):
            state = shifted(pipe["transformer"], 0.5 + k)
            updates.append(state)
            assert (await ctl.update_weights_from_tensors(state)).success
            assert (await ctl.sleep()).success
            assert not any(u.dirty() for u in store_of(ctl).units)
            await ctl.wake()
            assert fingerprints(pipe) == expected_after(updates)


async def test_a_fault_in_the_refresh_leaves_the_mirror_stale_and_the_next_sleep_copies_it(
        ) -> None:
    """A copy of the background refresh fails: the update stays done, the failure is
    reported when the refresh is landed, the mirror is marked stale (never wrong), the next
    sleep copies it, and the woken weights are bit-exact."""
    probe = GatedDevice()
    ctl, pipe = await attached(probe)
    async with ctl:
        state = shifted(pipe["transformer"], 1.0)
        before = probe.copies
        await ctl.update_weights_from_tensors(state)
        await store_of(ctl).land_refresh()
        writes = probe.copies - before - len(state)  # the update's own copies (the rest: refresh)

    layer = GatedDevice()
    ctl, pipe = await attached(layer)
    async with ctl:
        with capture_events() as events:
            layer.arm(copy_at=writes + 1)  # the first copy of the refresh
            result = await ctl.update_weights_from_tensors(state)
            assert result.success
            refresh = write.refresh_pending(store_of(ctl))
            assert refresh is not None
            await refresh.wait()
            assert layer.faults == 1 and refresh.error is not None
            assert all(u.dirty() for u in store_of(ctl).units)  # stale, not current
            slept = await ctl.sleep()
        stale = [e for e in events if e["event"] == UPDATE_MIRROR_STALE]
        assert [e["component"] for e in stale] == ["transformer"]
        assert "InjectedFault" in stale[0]["error"]
        assert slept.success and slept.bytes_moved > 0  # the sleep copied the stale mirror
        await ctl.wake()
        assert fingerprints(pipe) == expected_after([state])


@pytest.mark.usefixtures("small_chunks")
async def test_a_second_update_supersedes_a_pending_refresh() -> None:
    """A second update while the first one's refresh is in flight: the chunk in flight lands
    first (the write never races with a copy reading the same tensor), the rest of that
    refresh is cancelled, and the next refresh covers what it left stale, so the sleep
    copies nothing and the woken weights are the second update over the first."""
    layer = GatedDevice()
    ctl, pipe = await attached(layer)
    async with ctl:
        first = shifted(pipe["transformer"], 1.0)
        second = shifted(pipe["transformer"], 2.0, names=["0.weight"])
        layer.gate.clear()
        assert (await ctl.update_weights_from_tensors(first)).success
        superseded = write.refresh_pending(store_of(ctl))
        assert superseded is not None
        await wait_for(layer.waiting)  # its first chunk is about to start
        done: list[bool] = []

        async def update() -> None:
            done.append((await ctl.update_weights_from_tensors(second)).success)

        async with anyio.create_task_group() as tg:
            tg.start_soon(update)
            await anyio.sleep(0.05)
            assert not done  # waits for the chunk in flight
            layer.gate.set()
        assert done == [True]
        assert superseded.cancelled and superseded.copied < sum(t.nbytes for t in first.values())
        follow = write.refresh_pending(store_of(ctl))
        assert follow is not None and follow is not superseded
        await follow.wait()
        assert follow.error is None and not any(u.dirty() for u in store_of(ctl).units)
        slept = await ctl.sleep()
        assert slept.bytes_moved == 0
        await ctl.wake()
        assert fingerprints(pipe) == expected_after([first, second])


async def test_forwards_run_while_the_refresh_is_in_flight() -> None:
    """A forward reads the new weights while their mirror refresh is held back."""
    layer = GatedDevice()
    ctl, pipe = await attached(layer)
    async with ctl:
        state = shifted(pipe["transformer"], 1.0)
        ref = small_pipeline()
        ref["transformer"].load_state_dict(state)
        layer.gate.clear()
        await ctl.update_weights_from_tensors(state)
        await wait_for(layer.waiting)
        x = torch.randn(2, 16)
        async with ctl.use("transformer") as transformer:
            with torch.no_grad():
                assert torch.equal(transformer(x), ref["transformer"](x))
        assert write.refresh_pending(store_of(ctl)) is not None
        layer.gate.set()
        await ctl.detach()  # detach lands the refresh too
        assert fingerprints(pipe) == expected_after([state])
