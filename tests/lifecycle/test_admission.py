"""Admission control: leases, draining with a timeout, waiting admission, auto-wake."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
import torch

from lifecycle import (
    AdmissionTimeout,
    ComponentAsleep,
    DrainTimeout,
    LifecycleController,
    Phase,
    TransitionRejected,
)
from tests.helpers import faulty_device, fingerprints, small_pipeline

pytestmark = pytest.mark.anyio


async def wait_for(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (a transition's progress is not an event we can wait on)."""
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.001)


async def attached(**kwargs: object) -> LifecycleController:
    ctl = LifecycleController("cpu", **kwargs)  # type: ignore[arg-type]
    await ctl.attach(small_pipeline())
    return ctl


async def test_sleep_waits_for_in_flight_uses_before_moving() -> None:
    """A sleep requested during a use starts moving only after the use ends."""
    ctl = await attached()
    order: list[str] = []
    in_use = anyio.Event()

    async def user() -> None:
        async with ctl.use("transformer") as m:
            order.append("use start")
            in_use.set()
            await wait_for(lambda: ctl.transition == "sleep")
            m(torch.zeros(1, 16))  # the weights are still there
            order.append("use end")

    async def sleeper() -> None:
        await in_use.wait()
        assert ctl.in_flight == 1
        order.append("sleep called")
        await ctl.sleep()
        order.append("slept")

    async with anyio.create_task_group() as tg:
        tg.start_soon(user)
        tg.start_soon(sleeper)
    assert order == ["use start", "sleep called", "use end", "slept"]
    assert ctl.in_flight == 0


async def test_drain_timeout_reopens_admission_and_moves_nothing() -> None:
    """When a use outlives drain_timeout, sleep fails with DrainTimeout naming the lease,
    nothing moved, the phase is unchanged and new uses are admitted again."""
    ctl = await attached(drain_timeout=0.05)
    release = anyio.Event()
    result: dict[str, object] = {}

    async def holder() -> None:
        async with ctl.use("vae"):
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await wait_for(lambda: ctl.in_flight == 1)
        before = ctl.report()
        with pytest.raises(DrainTimeout) as info:
            await ctl.sleep()
        result["error"] = info.value
        assert ctl.phase is Phase.AWAKE
        assert ctl.report() == before
        assert ctl.transition is None
        async with ctl.use("transformer"):  # admission is open again
            result["second use"] = True
        release.set()
    err = result["error"]
    assert isinstance(err, DrainTimeout) and isinstance(err, TransitionRejected)
    assert err.held == ["vae"]
    assert str(err) == "sleep: 1 use(s) still in flight after 0.05s: ['vae']"
    assert result["second use"] is True
    assert (await ctl.sleep()).success


async def test_use_during_a_transition_waits_then_proceeds_when_awake() -> None:
    """A use requested while a wake is moving waits for it and then runs on the weights."""
    layer = faulty_device(copy_delay=0.002)
    ctl = LifecycleController(device_layer=layer, auto_wake=False)
    pipe = small_pipeline()
    await ctl.attach(pipe)
    await ctl.sleep()
    seen: list[Phase] = []

    async def user() -> None:
        await wait_for(lambda: ctl.transition == "wake")
        async with ctl.use("transformer") as m:
            seen.append(ctl.phase)
            m(torch.zeros(1, 16))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ctl.wake)
        tg.start_soon(user)
    assert seen == [Phase.AWAKE]


async def test_use_that_waits_too_long_raises_admission_timeout() -> None:
    """admission_timeout bounds the wait behind a transition."""
    layer = faulty_device(copy_delay=0.01)
    ctl = LifecycleController(device_layer=layer, admission_timeout=0.02)
    await ctl.attach(small_pipeline())
    await ctl.sleep()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ctl.wake)
        await wait_for(lambda: ctl.transition == "wake")
        with pytest.raises(AdmissionTimeout) as info:
            async with ctl.use("vae"):
                pass
    assert (info.value.component, info.value.transition) == ("vae", "wake")
    assert isinstance(info.value, TimeoutError)
    assert ctl.in_flight == 0


async def test_use_while_sleeping_is_refused_at_once() -> None:
    """Without auto_wake, use() while sleeping raises ComponentAsleep immediately."""
    ctl = await attached()
    await ctl.sleep()
    with anyio.fail_after(1):
        with pytest.raises(ComponentAsleep) as info:
            async with ctl.use("text_encoder"):
                pass
    assert info.value.component == "text_encoder"
    assert ctl.in_flight == 0


async def test_auto_wake_wakes_once_for_many_waiting_callers() -> None:
    """With auto_wake, ten uses arriving while asleep cause exactly one wake that moves."""
    layer = faulty_device(copy_delay=0.001)
    ctl = LifecycleController(device_layer=layer, auto_wake=True)
    pipe = small_pipeline()
    sums = fingerprints(pipe)
    await ctl.attach(pipe)
    await ctl.sleep()
    copies = layer.copies
    ran: list[int] = []

    async def user(i: int) -> None:
        async with ctl.use("transformer") as m:
            m(torch.zeros(1, 16))
            ran.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(user, i)
    assert sorted(ran) == list(range(10))
    units = sum(len(ctl.strategy(n).store.units) for n in ctl.components)
    assert layer.copies - copies == units  # one wake's worth of copies
    assert ctl.phase is Phase.AWAKE and fingerprints(pipe) == sums


@pytest.mark.parametrize("exit_by", ["exception", "cancellation"])
async def test_leases_are_returned_on_every_exit_path(exit_by: str) -> None:
    """A use left by an exception or a cancellation returns its lease; sleep then drains."""
    ctl = await attached(drain_timeout=1.0)
    if exit_by == "exception":
        with pytest.raises(ZeroDivisionError):
            async with ctl.use("transformer"):
                assert ctl.in_flight == 1
                _ = 1 / 0
    else:
        with anyio.move_on_after(0.01):
            async with ctl.use("transformer"):
                await anyio.sleep(1)
    assert ctl.in_flight == 0
    assert (await ctl.sleep()).success


async def test_use_of_an_uninitialized_pipeline_is_rejected() -> None:
    """use() before attach is a TransitionRejected naming the reason."""
    ctl = LifecycleController("cpu")
    with pytest.raises(TransitionRejected, match="pipeline not initialized"):
        async with ctl.use("transformer"):
            pass
