"""Transitions over several ranks (torch.distributed, gloo, fork-started processes on this
machine): all ranks commit or none does, failures name their ranks, a dead rank breaks the
group cleanly, and ranks driven apart are refused."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist

from lifecycle import DrainTimeout, GroupBroken, LifecycleController, RanksDisagree, TransitionFailed
from lifecycle._collective import Collective
from lifecycle._errors import RankFailure
from lifecycle._owner import Owner
from tests.helpers import SelectedFaultyDevice, faulty_device, fingerprints, small_pipeline

Scenario = Callable[[int, int, Path], Awaitable[dict[str, Any]]]
TIMEOUT = 3.0


def _rank_main(rank: int, world: int, tmp: Path, scenario: Scenario,
               results: Any) -> None:
    try:
        store = dist.FileStore(str(tmp / "store"), world)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store,
                                rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT))
        dist.barrier()  # gloo may still be connecting pairs
        torch.set_num_threads(1)
        out = anyio.run(scenario, rank, world, tmp)
    except BaseException as exc:  # reported to the test, which fails with it
        out = {"crashed": f"{type(exc).__name__}: {exc}"}
    results.put((rank, out))
    results.close()
    results.join_thread()
    os._exit(0)  # no destroy_process_group: a peer may be gone


def run_ranks(scenario: Scenario, tmp: Path, world: int = 2,
              expect: int | None = None) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` on ``world`` fork-started ranks; returns each rank's report."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, tmp, scenario, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    for _ in range(world if expect is None else expect):
        try:
            rank, report = results.get(timeout=60)
        except queue_module.Empty:
            break
        out[rank] = report
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    crashed = {r: o["crashed"] for r, o in out.items() if "crashed" in o}
    assert not crashed, crashed
    return out


def collective(rank: int, layer: Any = None) -> LifecycleController:
    return LifecycleController(device_layer=layer or faulty_device(),
                               process_group=dist.group.WORLD, collective_timeout=TIMEOUT)


def describe(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "failed_ranks": getattr(exc, "failed_ranks", None),
            "failed_causes": getattr(exc, "failed_causes", None),
            "phases": getattr(exc, "phases", None)}


def test_sleep_wake_and_updates_commit_on_every_rank(tmp_path: Path) -> None:
    """With every rank well, each collective transition commits everywhere: same phase,
    same version, same checksums."""

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        ctl = collective(rank)
        pipe = small_pipeline()
        await ctl.attach(pipe)
        slept = await ctl.sleep()
        again = await ctl.sleep()
        woke = await ctl.wake()
        new = {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}
        updated = await ctl.update_weights_from_tensors(new)
        return {"slept": slept.success, "noop": again.message, "woke": woke.success,
                "updated": updated.success, "version": ctl.weights_version,
                "world": ctl.world_size, "sums": ctl.weights_checksum(),
                "phase": ctl.phase.value}

    out = run_ranks(scenario, tmp_path)
    assert out[0]["sums"] == out[1]["sums"]
    for r in (0, 1):
        assert out[r] | {"sums": None} == {
            "slept": True, "noop": "already sleeping", "woke": True, "updated": True,
            "version": 1, "world": 2, "sums": None, "phase": "awake"}


def test_a_sleep_failing_on_one_rank_rolls_back_on_every_rank(tmp_path: Path) -> None:
    """A copy failing on rank 1 makes every rank raise TransitionFailed naming rank 1; every
    rank is still awake with its bytes in place, and the retry commits everywhere."""

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        layer = faulty_device()
        ctl = collective(rank, layer)
        pipe = small_pipeline()
        await ctl.attach(pipe)
        before = ctl.report().device_bytes
        if rank == 1:
            layer.arm(copy_at=1)
        try:
            await ctl.sleep()
            raised: dict[str, Any] = {}
        except TransitionFailed as exc:
            raised = describe(exc)
        state = {"phase": ctl.phase.value, "bytes_kept": ctl.report().device_bytes == before,
                 "sums": fingerprints(pipe)}
        retry = await ctl.sleep()
        return raised | state | {"retry": retry.success}

    out = run_ranks(scenario, tmp_path)
    for r in (0, 1):
        assert out[r]["type"] == "TransitionFailed"
        assert list(out[r]["failed_ranks"]) == [1]
        assert out[r]["failed_ranks"][1].startswith("InjectedFault: injected copy failure")
        # the vote carried the failure typed: its class name a field, not a prefix to parse
        (failure,) = out[r]["failed_causes"].values()
        assert failure.cause == "InjectedFault"
        assert failure.message.startswith("injected copy failure")
        assert (out[r]["phase"], out[r]["bytes_kept"], out[r]["retry"]) == ("awake", True, True)


def test_an_update_refused_or_rolled_back_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """A wrong shape on rank 1 (refused before writing) and a copy fault on rank 1 (rolled
    back) both give every rank the same failed result naming rank 1; nothing changed."""

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        layer = faulty_device()
        ctl = collective(rank, layer)
        pipe = small_pipeline()
        await ctl.attach(pipe)
        sums = ctl.weights_checksum()
        new = {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}
        bad = dict(new)
        if rank == 1:
            bad["0.weight"] = torch.zeros(1)
        refused = await ctl.update_weights_from_tensors(bad)
        if rank == 1:
            layer.arm(copy_at=1)
        rolled = await ctl.update_weights_from_tensors(new)
        return {"refused": (refused.success, refused.message, dict(refused.failed_ranks)),
                "rolled": (rolled.success, rolled.rolled_back, list(rolled.failed_ranks)),
                "unchanged": ctl.weights_checksum() == sums, "version": ctl.weights_version}

    out = run_ranks(scenario, tmp_path)
    assert out[0]["refused"] == out[1]["refused"]
    ok, message, failed = out[0]["refused"]
    assert not ok and list(failed) == [1] and message.startswith("update refused on rank 1: ")
    for r in (0, 1):
        assert out[r]["rolled"] == (False, True, [1])
        assert out[r]["unchanged"] and out[r]["version"] == 0


def test_ranks_driven_apart_are_refused_naming_each_phase(tmp_path: Path) -> None:
    """Rank 0 slept on its own before the controllers became collective: the next
    collective call raises RanksDisagree on every rank, naming each rank's phase, and
    nothing moves."""

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        ctl = LifecycleController(device_layer=faulty_device())
        await ctl.attach(small_pipeline())
        if rank == 0:
            await ctl.sleep()
        ctl.rebind(dist.group.WORLD, collective_timeout=TIMEOUT)
        try:
            await ctl.wake()
            return {}
        except RanksDisagree as exc:
            return describe(exc) | {"phase": ctl.phase.value}

    out = run_ranks(scenario, tmp_path)
    for r, phase in ((0, "sleeping"), (1, "awake")):
        assert out[r]["type"] == "RanksDisagree"
        assert out[r]["phases"] == {0: "sleeping", 1: "awake"}
        assert out[r]["phase"] == phase


class _DiesOnCopy(SelectedFaultyDevice):
    """Rank 1's device layer: the process dies in the middle of a copy."""

    def _copy_one(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        os._exit(3)


def test_a_rank_dying_mid_sleep_breaks_the_group_without_a_hang_or_half_commit(
        tmp_path: Path) -> None:
    """Rank 1 dies while copying: rank 0 notices within the collective timeout, rolls back
    (still awake, bytes in place), raises GroupBroken, raises it again at once on the next
    call, and works again after rebind to a new group of the survivors."""

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        ctl = collective(rank, _DiesOnCopy() if rank == 1 else None)
        pipe = small_pipeline()
        await ctl.attach(pipe)  # nothing copied: the weights are adopted where they are
        before = ctl.report().device_bytes
        t0 = anyio.current_time()
        try:
            await ctl.sleep()
            return {"broke": False}
        except GroupBroken as exc:
            waited = anyio.current_time() - t0
            first = describe(exc)
        state = {"phase": ctl.phase.value, "bytes_kept": ctl.report().device_bytes == before,
                 "waited": waited}
        t1 = anyio.current_time()
        try:
            await ctl.wake()
            again = "no error"
        except GroupBroken:
            again = "GroupBroken"
        again_waited = anyio.current_time() - t1
        group = _solo_group(dist.FileStore(str(tmp / "survivors"), 1))  # type: ignore[attr-defined]
        ctl.rebind(group, collective_timeout=TIMEOUT)
        slept = await ctl.sleep()
        return first | state | {"again": again, "again_waited": again_waited,
                                "rebound_sleep": slept.success, "world": ctl.world_size}

    out = run_ranks(scenario, tmp_path, expect=1)
    r0 = out[0]
    assert r0["type"] == "GroupBroken"
    assert (r0["phase"], r0["bytes_kept"]) == ("awake", True)
    assert r0["waited"] < TIMEOUT + 5
    assert r0["again"] == "GroupBroken" and r0["again_waited"] < 0.5
    assert (r0["rebound_sleep"], r0["world"]) == (True, 1)


def _solo_group(store: Any) -> Any:
    """A new default group of this one surviving rank (the failed one cannot be reused)."""
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=TIMEOUT))
    return dist.group.WORLD


pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


def test_a_rank_that_cannot_drain_makes_every_rank_raise_drain_timeout(tmp_path: Path) -> None:
    """A use held on rank 1 past the drain timeout: every rank raises DrainTimeout naming
    rank 1, every rank stays awake, and the sleep after the use ended commits everywhere."""

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        ctl = LifecycleController(device_layer=faulty_device(), drain_timeout=0.3,
                                  process_group=dist.group.WORLD, collective_timeout=TIMEOUT)
        await ctl.attach(small_pipeline())
        raised: dict[str, Any] = {}

        async def hold() -> None:
            async with ctl.use("vae"):
                await anyio.sleep(1.0)

        async with anyio.create_task_group() as tg:
            if rank == 1:
                tg.start_soon(hold)
                await anyio.sleep(0.1)
            try:
                await ctl.sleep()
            except Exception as exc:
                raised = {"type": type(exc).__name__,
                          "failed": sorted(getattr(exc, "failed_ranks", {})),
                          "causes": {r: f.cause
                                     for r, f in getattr(exc, "failed_causes", {}).items()}}
        phase = ctl.phase.value
        retry = await ctl.sleep()
        return raised | {"phase": phase, "retry": retry.success}

    out = run_ranks(scenario, tmp_path)
    for r in (0, 1):
        assert out[r] == {"type": "DrainTimeout", "failed": [1], "causes": {1: "DrainTimeout"},
                          "phase": "awake", "retry": True}


def test_other_ranks_drain_timeouts_are_told_by_their_cause() -> None:
    """What a rank raises when only other ranks failed: every one of them a DrainTimeout
    (by the cause its vote carried) gives the same refusal, naming them; any other cause (a
    message that merely reads like one too) a TransitionFailed carrying the failures."""
    ranks = Collective(None, TIMEOUT, Owner(LifecycleController("cpu")))
    others = RuntimeError("rank 1: ...")
    drained = {1: RankFailure("DrainTimeout", "sleep: 1 use(s) still in flight after 0.3s")}
    refusal = ranks.failure("sleep", others, drained, own=False, drain_timeout=0.3)
    assert isinstance(refusal, DrainTimeout)
    assert (refusal.held, refusal.timeout, refusal.failed_causes) == (["rank 1"], 0.3, drained)
    assert refusal.failed_ranks == {1: "DrainTimeout: sleep: 1 use(s) still in flight after 0.3s"}
    mixed = drained | {2: RankFailure("InjectedFault", "DrainTimeout in a message")}
    failed = ranks.failure("sleep", others, mixed, own=False, drain_timeout=0.3)
    assert isinstance(failed, TransitionFailed) and failed.failed_causes == mixed
    assert failed.cause is others and failed.__cause__ is others


def test_resident_stable_votes_on_every_rank_and_keeps_addresses_on_each(
        tmp_path: Path) -> None:
    """Arenas of resident-stable (strategies.devices._vmm) over two ranks: a wake whose
    mapping fails on rank 1 (an injected driver fault) fails on every rank naming rank 1, and
    every rank stays asleep with nothing mapped; the retry wakes both at the addresses they
    had, and an update commits on both in place."""
    from strategies.checking._vmmsim import SimVmm

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        layer = faulty_device()
        sim = layer.vmm = SimVmm(runtime=getattr(layer, "runtime", None))
        ctl = LifecycleController(device_layer=layer, process_group=dist.group.WORLD,
                                  collective_timeout=TIMEOUT,
                                  residency={"transformer": "resident-stable"})
        pipe = small_pipeline()
        await ctl.attach(pipe)
        where = [p.data_ptr() for p in pipe["transformer"].parameters()]
        await ctl.sleep()
        if rank == 1:
            sim.fail_at = sim.calls + 2  # the wake's second driver call
        try:
            await ctl.wake()
            raised: dict[str, Any] = {}
        except TransitionFailed as exc:
            raised = describe(exc)
        failed = {"phase": ctl.phase.value, "mapped": sim.physical_bytes}
        sim.fail_at = None
        woke = await ctl.wake()
        new = {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}
        updated = await ctl.update_weights_from_tensors(new)
        same = [p.data_ptr() for p in pipe["transformer"].parameters()] == where
        return raised | failed | {"woke": woke.success, "updated": updated.success,
                                  "same_addresses": same, "sums": ctl.weights_checksum(),
                                  "version": ctl.weights_version}

    out = run_ranks(scenario, tmp_path)
    assert out[0]["sums"] == out[1]["sums"]
    for r in (0, 1):
        assert out[r]["type"] == "TransitionFailed", out[r]
        assert list(out[r]["failed_ranks"]) == [1], out[r]
        assert (out[r]["phase"], out[r]["mapped"]) == ("sleeping", 0), out[r]
        assert (out[r]["woke"], out[r]["updated"], out[r]["same_addresses"],
                out[r]["version"]) == (True, True, True, 1), out[r]
