"""Cancellation: a transition, update or residency change cancelled at any moment (at every
await point, at growing deadlines while its copies are slow) either completed or left
everything as it was (phase, placement, weights, leases, mirrors), and a retry succeeds.

The helpers that build each case are those of the suite of the feature cancelled."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

import strategies._write as write
from lifecycle import LifecycleController, Phase
from strategies import ResidencyMode
from tests.helpers import faulty_device, fingerprints, small_pipeline
from tests.lifecycle.test_background_refresh import (
    GatedDevice,
    expected_after,
    small_chunks,  # noqa: F401 (a fixture: used by name)
    store_of,
    wait_for,
)
from tests.lifecycle.test_background_refresh import attached as attached_refreshing
from tests.lifecycle.test_background_refresh import shifted as shifted_by
from tests.lifecycle.test_discard import served
from tests.lifecycle.test_faults import sleep_, start, wake_
from tests.lifecycle.test_reliability import RESIDENCY, shifted
from tests.lifecycle.test_set_residency import _attached, _config, _layout
from tests.lifecycle.test_updates import attached, new_state

pytestmark = pytest.mark.anyio


async def cancel_after_checkpoints(n: int, call: Callable[[], Awaitable[Any]]) -> bool:
    """Run ``call`` and cancel it after ``n`` scheduler checkpoints of a second task.
    Returns whether the cancellation was requested before ``call`` finished (it then either
    raised there or was deferred past a copy that is never abandoned)."""
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def canceller() -> None:
                for _ in range(n):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
            tg.start_soon(canceller)
            await call()
            tg.cancel_scope.cancel()
    return scope.cancel_called


async def one_call(ctl: LifecycleController, trigger: str, new: dict[str, torch.Tensor]) -> None:
    if trigger == "update":
        await ctl.update_weights_from_tensors(new)
    elif trigger == "use":
        async with ctl.use("vae") as m:
            m(torch.ones(1, 4, 5, 5))
    else:
        await getattr(ctl, trigger)()


@pytest.mark.parametrize("trigger", ["sleep", "wake", "update", "use"])
async def test_cancellation_at_every_await_point_leaves_a_consistent_state(trigger: str) -> None:
    """Cancelled after n = 0, 1, 2, ... checkpoints until the call completes on its own:
    each time the phase matches the placement, weights are intact or fully updated, no lease
    is left, and a retry succeeds."""
    landed = 0
    # Every n up to 200, then growing: while the call waits on a worker thread (a copy) the
    # canceller keeps counting checkpoints, so how many the whole call spans depends on the
    # machine's speed; the dense part hits each await point, the growing part lets the call
    # complete on any machine.
    for n in [*range(200), *(int(200 * 1.5**k) for k in range(1, 25))]:
        pipe = small_pipeline()
        async with LifecycleController(device_layer=faulty_device(), residency=RESIDENCY) as ctl:
            await ctl.attach(pipe)
            if trigger == "wake":
                await ctl.sleep()
            before, new = fingerprints(pipe), shifted(pipe)
            awake_bytes = ctl.report().device_bytes if trigger != "wake" else None
            call = functools.partial(one_call, ctl, trigger, new)

            cancelled = await cancel_after_checkpoints(n, call)
            landed += cancelled
            assert ctl.transition is None and ctl.in_flight == 0
            report = ctl.report()
            if ctl.phase is Phase.SLEEPING:
                assert report.device_bytes == 0
            else:
                assert ctl.phase is Phase.AWAKE
                if awake_bytes is not None:
                    assert report.device_bytes == awake_bytes
            allowed = [before]
            if trigger == "update":
                ref = small_pipeline()
                ref["transformer"].load_state_dict(new)
                allowed.append(fingerprints(ref))
            assert fingerprints(pipe) in allowed
            await ctl.wake()
            await call()  # the retry succeeds
            if not cancelled:
                break
    else:
        pytest.fail("the call never completed, even with millions of checkpoints")
    assert landed >= 1, "the sweep should hit at least one await point"


@pytest.mark.parametrize("target", ["sleep", "wake"])
async def test_cancellation_at_any_moment_leaves_a_true_phase(target: str) -> None:
    """Cancelled after t ms, a transition has either committed or rolled back: the phase
    matches the placement, the bytes are intact, and a retry succeeds."""
    for delay_ms in (0, 1, 3, 7, 15, 40):
        layer = faulty_device(copy_delay=0.001)
        ctl, pipe = await start([sleep_, wake_] if target == "sleep" else [sleep_], layer)
        sums = fingerprints(pipe)
        with anyio.move_on_after(delay_ms / 1000):
            await (ctl.sleep() if target == "sleep" else ctl.wake())
        report = ctl.report()
        if ctl.phase is Phase.SLEEPING:
            assert report.device_bytes == 0
        else:
            assert ctl.phase is Phase.AWAKE
            assert report.device_bytes == sum(c.total_bytes for c in report.components.values())
        assert ctl.transition is None
        await ctl.sleep()
        await ctl.wake()
        assert fingerprints(pipe) == sums


@pytest.mark.moves
async def test_cancelled_update_rolls_back_and_leaves_phase_awake() -> None:
    """An update cancelled at any moment leaves the old weights and phase AWAKE."""
    for delay_ms in (0, 1, 2, 5, 10, 30):
        layer = faulty_device(copy_delay=0.0005)
        ctl, pipe = await attached("resident", layer)
        async with ctl:
            sums = ctl.weights_checksum()
            state = new_state(pipe["text_encoder"])
            state.pop("head.weight")
            with anyio.move_on_after(delay_ms / 1000) as scope:
                result = await ctl.update_weights_from_tensors(state, "text_encoder")
            assert ctl.phase is Phase.AWAKE and ctl.transition is None
            if scope.cancelled_caught:
                assert ctl.weights_checksum() == sums and ctl.weights_version == 0
            else:
                assert result.success and ctl.weights_version == 1


@pytest.mark.moves
async def test_a_cancelled_change_leaves_the_old_layout() -> None:
    """A change cancelled at any point of its copies (slow copies, growing deadlines) either
    completes or leaves the old layout exactly, and outputs stay identical."""
    outcomes = set()
    for deadline in (0.0, 0.003, 0.01, 0.03, 3.0):  # (the last: enough for 64 slow copies)
        layer = faulty_device(copy_delay=0.004)
        ctl, pipe, expected = await _attached("resident", layer)
        async with ctl:
            before = _layout(ctl)
            with anyio.move_on_after(deadline) as scope:
                await ctl.set_residency(_config("layerwise-offload"))
            if scope.cancelled_caught:
                outcomes.add("cancelled")
                assert _layout(ctl) == before, deadline
            else:
                outcomes.add("done")
                assert ctl.strategy("transformer").mode is ResidencyMode.LAYERWISE_OFFLOAD
            assert torch.equal(await pipe.generate(ctl=ctl), expected)
    assert outcomes == {"cancelled", "done"}


async def test_a_cancelled_discarding_sleep_either_committed_or_changed_nothing() -> None:
    """Cancelled at growing deadlines while its copies are slow, a discarding sleep either
    committed (sleeping, stale at wake) or left everything as it was."""
    outcomes = set()
    for deadline in (0.0, 0.002, 0.01, 3.0):
        ctl, _, _, _ = await served("resident", faulty_device(copy_delay=0.002))
        async with ctl:
            before = (ctl.report(), dict(ctl.stale))
            with anyio.move_on_after(deadline) as scope:
                await ctl.sleep(discard=["text_encoder"])
            if scope.cancelled_caught and ctl.phase is Phase.AWAKE:
                outcomes.add("cancelled")
                assert (ctl.report(), dict(ctl.stale)) == before
            else:
                outcomes.add("done")
                await ctl.wake()
                assert set(ctl.stale) == {"text_encoder"}
    assert outcomes == {"cancelled", "done"}


@pytest.mark.usefixtures("small_chunks")
async def test_a_cancelled_update_cancels_the_refresh_it_superseded() -> None:
    """An update cancelled while it waits to supersede a refresh writes nothing; the refresh
    stops after its chunk in flight, what it did not copy stays stale, and the next sleep
    copies that: the woken weights are exactly the first update's."""
    layer = GatedDevice()
    ctl, pipe = await attached_refreshing(layer)
    async with ctl:
        first = shifted_by(pipe["transformer"], 1.0)
        layer.gate.clear()
        assert (await ctl.update_weights_from_tensors(first)).success
        refresh = write.refresh_pending(store_of(ctl))
        assert refresh is not None
        await wait_for(layer.waiting)
        with anyio.move_on_after(0.05) as scope:
            await ctl.update_weights_from_tensors(shifted_by(pipe["transformer"], 5.0))
        assert scope.cancelled_caught
        assert ctl.weights_version == 1 and ctl.phase is Phase.AWAKE
        layer.gate.set()
        await refresh.wait()
        assert refresh.cancelled and refresh.error is None
        assert any(u.dirty() for u in store_of(ctl).units)  # left stale, not marked current
        slept = await ctl.sleep()
        assert slept.success and slept.bytes_moved > 0
        await ctl.wake()
        assert fingerprints(pipe) == expected_after([first])


async def test_a_cancelled_sleep_leaves_the_refresh_running_and_nothing_moved() -> None:
    """A sleep cancelled while it waits for a refresh moves nothing; the refresh lands later,
    and the next sleep copies nothing."""
    layer = GatedDevice()
    ctl, pipe = await attached_refreshing(layer)
    async with ctl:
        state = shifted_by(pipe["transformer"], 1.0)
        layer.gate.clear()
        await ctl.update_weights_from_tensors(state)
        await wait_for(layer.waiting)
        with anyio.move_on_after(0.05) as scope:
            await ctl.sleep()
        assert scope.cancelled_caught and ctl.phase is Phase.AWAKE
        assert all(u.where == "device" for u in store_of(ctl).units)
        layer.gate.set()
        slept = await ctl.sleep()
        assert slept.success and slept.bytes_moved == 0
        await ctl.wake()
        assert fingerprints(pipe) == expected_after([state])
