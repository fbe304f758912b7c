"""Transactions: injected faults at every copy and allocation, concurrency (cancellation:
test_cancellation.py; the events of a rollback: test_logging.py)."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import anyio
import pytest
import torch
from torch import nn

from lifecycle import LifecycleController, OccupationResult, Phase, TransitionFailed
from lifecycle.testing import FaultInjection, InjectedFault
from tests.helpers import SelectedFaultyDevice, faulty_device, fingerprints, run_pipeline, small_pipeline

pytestmark = pytest.mark.anyio

Step = Callable[[LifecycleController], Awaitable[object]]


async def sleep_(ctl: LifecycleController) -> object:
    return await ctl.sleep()


async def wake_(ctl: LifecycleController) -> object:
    return await ctl.wake()


DISCARDED = ["text_encoder", "transformer"]


async def discard_(ctl: LifecycleController) -> object:
    return await ctl.sleep(discard=DISCARDED)


# name -> (steps that lead to the starting point, the transition under test, its goal)
SCENARIOS: dict[str, tuple[list[Step], Step, Phase]] = {
    "first sleep (fills mirrors)": ([], sleep_, Phase.SLEEPING),
    "wake": ([sleep_], wake_, Phase.AWAKE),
    "dirty sleep": ([sleep_, wake_], sleep_, Phase.SLEEPING),
    "discarding sleep": ([sleep_, wake_], discard_, Phase.SLEEPING),
    "wake after a discarding sleep": ([discard_], wake_, Phase.AWAKE),
}


async def start(steps: list[Step], layer: FaultInjection
                ) -> tuple[LifecycleController, dict[str, nn.Module]]:
    pipe = small_pipeline()
    states[id(pipe)] = {n: {k: v.clone() for k, v in pipe[n].state_dict().items()}
                        for n in DISCARDED}
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach(pipe)
    for step in steps:
        await step(ctl)
    if steps and steps[-1] is wake_:
        with torch.no_grad():  # make every weight dirty without changing it
            for m in pipe.values():
                for p in m.parameters():
                    p.mul_(1)
    return ctl, pipe


async def count_ops(steps: list[Step], target: Step) -> tuple[int, int]:
    probe = faulty_device()
    ctl, _ = await start(steps, probe)
    copies, allocs = probe.copies, probe.allocations
    await target(ctl)
    return probe.copies - copies, probe.allocations - allocs


# A dirty sleep reuses the mirrors, and a discarding one here keeps only buffers that have
# mirrors already: they allocate nothing, so only their copies can fail.
FAULT_POINTS = [(s, k) for s in SCENARIOS for k in ("copy", "alloc")
                if (s, k) not in (("dirty sleep", "alloc"), ("discarding sleep", "alloc"))]
states: dict[int, dict[str, dict[str, torch.Tensor]]] = {}  # the discarded weights, per pipe
BUILT = fingerprints(small_pipeline())  # every scenario ends with these weights again


@pytest.mark.parametrize(("scenario", "kind"), FAULT_POINTS)
async def test_fault_at_every_point_rolls_back_exactly_and_retry_succeeds(
        scenario: str, kind: str) -> None:
    """For every k, failing the k-th copy (or allocation) leaves phase, placement and bytes
    exactly as before, chains the cause, and a retry reaches the goal with intact weights."""
    steps, target, goal = SCENARIOS[scenario]
    copies, allocs = await count_ops(steps, target)
    points = copies if kind == "copy" else allocs
    assert points > 3
    for k in range(1, points + 1):
        layer = faulty_device()
        ctl, pipe = await start(steps, layer)
        before_phase, before_report, before_sums = ctl.phase, ctl.report(), fingerprints(pipe)
        if kind == "copy":
            layer.arm(copy_at=k)
        else:
            layer.arm(alloc_at=k)
        with pytest.raises(TransitionFailed) as info:
            await target(ctl)
        assert isinstance(info.value.cause, InjectedFault)
        assert info.value.__cause__ is info.value.cause
        assert layer.faults == 1
        assert (ctl.phase, ctl.report()) == (before_phase, before_report)
        if ctl.phase is Phase.AWAKE and not ctl.stale:
            assert fingerprints(pipe) == before_sums
            run_pipeline(pipe)
        result = await target(ctl)
        assert isinstance(result, OccupationResult)
        assert result.success and ctl.phase is goal
        await ctl.wake()
        for name in ctl.stale:  # discarded: the trainer's weights come back by an update
            assert (await ctl.update_weights_from_tensors(states[id(pipe)][name], name)).success
        assert fingerprints(pipe) == BUILT


class OverlapDetector(SelectedFaultyDevice):
    """Fails the test if two copy batches ever run at the same time."""

    active = 0
    max_active = 0

    async def copy(self, pairs, to):  # type: ignore[no-untyped-def]
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await super().copy(pairs, to)
            await anyio.sleep(0)
        finally:
            self.active -= 1


async def test_concurrent_callers_are_serialised_and_all_answered() -> None:
    """40 tasks calling sleep/wake at random never interleave and each gets a result."""
    layer = OverlapDetector(copy_delay=0.0002)
    pipe = small_pipeline()
    sums = fingerprints(pipe)
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach(pipe)
    rng = random.Random(7)
    results: list[OccupationResult] = []

    async def caller() -> None:
        for _ in range(5):
            await anyio.sleep(rng.random() / 1000)
            results.append(await (ctl.sleep() if rng.random() < 0.5 else ctl.wake()))

    async with anyio.create_task_group() as tg:
        for _ in range(40):
            tg.start_soon(caller)
    assert len(results) == 200
    assert all(r.success for r in results)
    assert layer.max_active == 1
    assert ctl.phase is results[-1].phase
    await ctl.wake()
    assert fingerprints(pipe) == sums


@pytest.mark.parametrize("target", ["sleep", "wake", "update"])
async def test_rolled_back_buffers_are_freed_at_once_not_by_the_garbage_collector(
        target: str) -> None:
    """With the cyclic collector off, the device buffers of a failed move (and an update's
    backups) are gone as soon as the call returns: a traceback must not pin them."""
    import gc

    layer = faulty_device()
    ctl, pipe = await start([sleep_, wake_] if target != "wake" else [sleep_], layer)
    gc.collect()
    gc.disable()
    try:
        if target == "update":
            layer.arm(copy_at=3)
            state = {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}
            assert not (await ctl.update_weights_from_tensors(state)).success
        else:
            layer.arm(copy_at=3)
            with pytest.raises(TransitionFailed):
                await (ctl.sleep() if target == "sleep" else ctl.wake())
        assert layer.live_device_bytes == ctl.report().device_bytes
        await ctl.sleep()
        assert layer.live_device_bytes == 0
    finally:
        gc.enable()


async def test_a_failure_on_one_rank_names_no_failed_ranks() -> None:
    """Without a process group, TransitionFailed.failed_ranks is empty (it names ranks only
    when several ranks voted)."""
    layer = faulty_device()
    ctl, _ = await start([], layer)
    layer.arm(copy_at=1)
    with pytest.raises(TransitionFailed) as info:
        await ctl.sleep()
    assert info.value.failed_ranks == {}
