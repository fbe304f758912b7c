"""Serving one pipeline spread over several ranks: rank 0 answers HTTP, every rank runs
every call.

Rank 0 posts each call as a numbered *op* in the group's key-value store (the TCPStore that
``init_process_group`` uses, under its own prefix; JSON, no pickles). Every other rank reads
the ops in order, runs each on its own controller, and posts its answer; once every rank
answered, rank 0 deletes the op's keys. Control calls are collective in the controllers
themselves (every rank commits or none does, see ``lifecycle._collective``), so rank 0's result is
the combined one; generations run on every rank and rank 0 checks that their outputs agree.
Ranks post a heartbeat every second: ``/health`` names a rank whose heartbeat stopped. The
store is polled, not a collective, so idle ranks never hit a collective timeout.

**Tensor uploads** are relayed as they came: rank 0 picks each rank's entry of
``serialized_named_tensors`` (one for all, or one per rank by rank or by ``payload_gpu_uuids``;
each rank publishes its UUID in the store when it starts), puts the base64 text of each entry
another rank needs under a key of its own (one copy of the text; no re-encoding), and every
rank decodes its own entry. The ranks then compare their outcomes in the store (``agree``)
before any of them starts the update: a payload one rank cannot decode is refused on every
rank, naming the rank, and the collective update never waits for a rank that refused alone.
Rank 0 deletes the payload keys once every rank has read its entry.

**Weight sync over a trainer's group**: init, update and destroy run on every rank at once
(the trainer's group needs every server rank in it: each joins as ``rank_offset`` plus its
rank). Before an update the ranks compare whether each has the group, unbroken (``agree``),
so that a rank missing it refuses with the others instead of leaving them waiting in the
update's vote.

Each op is one frozen dataclass of typed fields in one table both sides use
(lifecycle.http._ops: ``to_json``, ``from_json``, ``run``); the store's keys, votes and
heartbeats are lifecycle.http._channel's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from strategies.protocol import to_thread

from .. import (
    LifecycleController,
    OccupationResult,
    Phase,
    TensorHashCheck,
    TransitionFailed,
    UpdateResult,
    WeightUpdateGroupResult,
)
from .._discard import Discard
from .._weight_sync import Broadcast
from ._channel import HEARTBEAT_S, OpChannel, describe
from ._driver import Driver, LocalDriver, RanksUnavailable, Upload
from ._ops import (
    Checksum,
    CheckTensorHashes,
    CheckWeights,
    CommitStaged,
    DestroyGroup,
    DropStaged,
    Generate,
    InitGroup,
    Op,
    RankContext,
    SetWeightVersion,
    Sleep,
    StageIpc,
    StageReceived,
    State,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromUpload,
    Wake,
    run_op,
)
from ._wire import WireRefused, pick_entry

__all__ = ["OutputsDisagree", "RankDriver", "follow"]

R = TypeVar("R")

_ABORT_POLL_S = 0.05  # how often a rank running a generation looks for its abort


class OutputsDisagree(RuntimeError):
    """The ranks' outputs of one generation differ (answered with 500)."""


async def follow(ctl: LifecycleController, local: LocalDriver, channel: OpChannel) -> None:
    """A rank other than 0: run rank 0's ops in order until ``stop``, then detach."""

    async def heartbeat() -> None:
        while True:
            await to_thread(channel.beat)
            await anyio.sleep(HEARTBEAT_S)

    await to_thread(channel.publish_uuid, local.device_uuid)
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        seq = 1
        while True:
            op = await to_thread(channel.next_op, seq, abandon_on_cancel=True)
            if op["op"] == "stop":
                await ctl.aclose()  # detach is collective: rank 0 detaches too
                channel.answer(seq, {"stopped": True})
                break
            if op["op"] == "generate":
                channel.answer(seq, await _abortable(local, channel, seq, op))
            else:
                channel.answer(seq, await run_op(local, channel, seq, op))
            seq += 1
        tg.cancel_scope.cancel()


async def _abortable(local: LocalDriver, channel: OpChannel, seq: int, op: Mapping[str, Any]
                     ) -> dict[str, Any]:
    """A generation on this rank, ended when rank 0 marks op ``seq`` aborted (its own
    generation was aborted: see lifecycle.http._generations); nothing else is cancellable."""
    answer: dict[str, Any] = {"error": "GenerationAborted",
                              "message": "the generation was aborted on rank 0"}
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while not await to_thread(channel.aborted, seq):
                await anyio.sleep(_ABORT_POLL_S)
            tg.cancel_scope.cancel()

        async def run() -> None:
            nonlocal answer
            answer = await run_op(local, channel, seq, op)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
    return answer


def _failed(answer: Mapping[str, Any]) -> str | None:
    """Why a rank's answer to a call with a ``success`` field failed, or None."""
    if "error" in answer:
        return f"{answer['error']}: {answer.get('message')}"
    if not answer.get("success", False):
        return str(answer.get("message"))
    return None


class RankDriver(Driver):
    """Rank 0's driver: each call is posted to every rank, run here too, and combined."""

    def __init__(self, local: LocalDriver, channel: OpChannel, timeout: float) -> None:
        self.local = local
        self.ctl = local.ctl
        self.channel = channel
        self.timeout = timeout  # for the other ranks' answers, beyond the call itself
        self._seq = 0
        self._lock = anyio.Lock()  # ops are posted and run in one order on every rank
        self._uuids: dict[int, str] = {}

    @property
    def world_size(self) -> int:
        return self.channel.world_size

    async def wait_for_ranks(self, timeout: float) -> None:
        """Wait until every other rank's heartbeat is there (each starts it once attached);
        raises :class:`RanksUnavailable` after ``timeout`` seconds. Until then a call would be
        answered 503 for a rank that is only late to start."""
        deadline = time.monotonic() + timeout
        while silent := await to_thread(self.channel.silent_ranks):
            if time.monotonic() > deadline:
                raise RanksUnavailable(f"rank(s) {silent} did not start within {timeout:g} s")
            await anyio.sleep(HEARTBEAT_S / 10)

    async def _call(self, make: Op[R] | Callable[[int], Awaitable[Op[R]]], *,
                    payload: str | memoryview | None = None,
                    after_here: Callable[[], Awaitable[None]] | None = None
                    ) -> tuple[R, dict[int, dict[str, Any]]]:
        """An op on every rank (``make``: the op, or made once its number is known, before
        it is posted), run here meanwhile (``payload``: what a relayed op carries in memory
        here; ``after_here``: run once it ran here, whatever happened); rank 0's result and
        every other rank's answer."""
        async with self._lock:
            silent = await to_thread(self.channel.silent_ranks)
            if silent:
                raise RanksUnavailable(f"rank(s) {silent} do not respond")
            self._seq += 1
            seq = self._seq
            op = make if isinstance(make, Op) else await make(seq)
            await to_thread(self.channel.post, seq, op.to_json())
            try:
                try:
                    result = await op.run(RankContext(self.local, self.channel, seq, payload))
                finally:
                    if after_here is not None:
                        await after_here()
            except BaseException:
                # Refused here (a generation while asleep or stale): the other ranks ran the
                # op all the same; collect their answers so that the op's keys are deleted.
                # A generation aborted here (cancelled) is aborted on every rank.
                with anyio.CancelScope(shield=True):
                    if isinstance(op, Generate):
                        await to_thread(self.channel.abort, seq)
                    await to_thread(self._drop, seq)
                raise
            answers = await to_thread(self.channel.answers, seq, self.timeout)
            missing = sorted(set(range(1, self.channel.world_size)) - set(answers))
            if missing:
                raise RanksUnavailable(f"rank(s) {missing} did not answer {op.name}")
            await to_thread(self.channel.forget, seq)
            return result, answers

    async def _mine(self, op: Op[R]) -> R:
        """Rank 0's result of ``op`` (collective in the controllers: every rank's)."""
        result, _ = await self._call(op)
        return result

    def _failures(self, answers: Mapping[int, Mapping[str, Any]], mine: str | None
                  ) -> dict[int, str]:
        """Rank -> why, for each rank whose answer failed (``mine``: rank 0's reason)."""
        failures = {r: why for r, a in answers.items() if (why := _failed(a)) is not None}
        if mine is not None:
            failures[0] = mine
        return failures

    def _drop(self, seq: int) -> None:
        """Wait (up to the timeout) for op ``seq``'s answers, then delete its keys; kept
        while a rank has not answered (it may not have read the op yet: deleting it would
        leave that rank waiting for it)."""
        with contextlib.suppress(Exception):  # the op already failed here
            if len(self.channel.answers(seq, self.timeout)) == self.channel.world_size - 1:
                self.channel.forget(seq)

    async def sleep(self, discard: Discard = None, components: Sequence[str] | None = None
                    ) -> OccupationResult:
        return await self._mine(Sleep(discard, _names(components)))

    async def wake(self, components: Sequence[str] | None = None) -> OccupationResult:
        return await self._mine(Wake(_names(components)))

    async def weights_checker(self, action: str) -> tuple[bool, str]:
        (success, message), answers = await self._call(CheckWeights(action))
        failures = self._failures(answers, None if success else message)
        if not failures:
            return True, message
        return False, describe(failures, self.channel.world_size)

    async def set_weight_version(self, label: str) -> None:
        await self._mine(SetWeightVersion(label))

    async def update_from_disk(self, path: str, targets: Sequence[str] | None, *,
                               weight_version: str | None = None,
                               flush_cache: bool = False) -> UpdateResult:
        return await self._mine(UpdateFromDisk(path, _names(targets), weight_version,
                                               flush_cache))

    async def _uuid_of(self, rank: int) -> str:
        if rank == 0:
            return self.local.device_uuid
        if rank not in self._uuids:
            try:
                self._uuids[rank] = await to_thread(self.channel.uuid_of, rank)
            except RuntimeError as exc:  # the store's timeout: the rank never started
                raise RanksUnavailable(f"rank {rank} did not publish its device UUID: "
                                       f"{exc}") from None
        return self._uuids[rank]

    async def _relay(self, entries: Mapping[str, str | memoryview]) -> list[str]:
        """Put each of ``entries`` (key -> text) in the store as it came (no re-encoding);
        every key used."""
        keys: list[str] = []
        for key, text in entries.items():
            try:
                keys.extend(await to_thread(self.channel.put_raw, key, text))
            except RuntimeError as exc:  # the store failed (a torch.distributed error)
                await to_thread(self.channel.delete, keys)
                raise RanksUnavailable(f"the ranks' store did not take the payload: "
                                       f"{exc}") from None
        return keys

    async def update_from_upload(self, upload: Upload) -> UpdateResult:
        world = self.channel.world_size
        picks: dict[int, int] = {}
        refused: dict[int, str] = {}
        for r in range(world):
            own = await self._uuid_of(r) if upload.uuids else ""
            try:
                picks[r] = pick_entry(len(upload.entries), upload.uuids, r, world, own)
            except WireRefused as exc:
                refused[r] = str(exc)
        if refused:
            raise WireRefused(describe(refused, world))
        keys: list[str] = []

        async def make(seq: int) -> UpdateFromUpload:
            # One copy of each entry another rank needs.
            by_index = {i: f"payload/{seq}/{i}" for i in sorted({picks[r] for r in range(1, world)})}
            keys.extend(await self._relay({key: upload.entries[i] for i, key in by_index.items()}))
            return UpdateFromUpload(
                keys={str(r): by_index[picks[r]] for r in range(1, world)},
                entries={str(r): picks[r] for r in range(world)},
                request=upload.request.to_json(), fd_timeout=upload.fd_timeout,
                agree_timeout=self.timeout)

        async def delete() -> None:  # every rank has read its entry (or given up)
            await to_thread(self.channel.delete, list(keys))
            keys.clear()

        try:
            result, _ = await self._call(make, payload=upload.entries[picks[0]],
                                         after_here=delete)
        finally:
            if keys:  # the op failed before every rank read its entry
                await delete()
        return result

    async def checksum(self, names: Sequence[str]) -> dict[str, str]:
        return await self._mine(Checksum(list(names)))

    async def check_tensor_hashes(self, target: str, expected: Mapping[str, str]
                                  ) -> TensorHashCheck:
        mine, answers = await self._call(CheckTensorHashes(target, dict(expected)))
        failures = self._failures(answers, None if mine.success else mine.message)
        if not failures:
            return mine
        return TensorHashCheck(False, describe(failures, self.channel.world_size), target,
                               mine.checked, mine.mismatched, mine.missing)

    def _joined(self, name: str, mine: WeightUpdateGroupResult,
                answers: Mapping[int, Mapping[str, Any]]) -> WeightUpdateGroupResult:
        """Rank 0's result of a group init or destroy, failed if any rank's failed."""
        failures = self._failures(answers, None if mine.success else mine.message)
        if not failures:
            return mine
        return WeightUpdateGroupResult(False, describe(failures, self.channel.world_size),
                                       name, None, mine.seconds)

    async def init_weights_update_group(self, args: Mapping[str, Any]
                                        ) -> WeightUpdateGroupResult:
        offset, size = args.get("rank_offset"), args.get("world_size")
        world = self.channel.world_size
        if isinstance(offset, int) and isinstance(size, int) and 0 < offset < size \
                and offset + world > size:
            raise WireRefused(f"world_size {size} leaves no room for this server's {world} "
                              f"ranks from rank_offset {offset} (they join as ranks {offset}.."
                              f"{offset + world - 1}); world_size must be at least "
                              f"{offset + world}")
        mine, answers = await self._call(InitGroup(dict(args)))
        return self._joined(str(args.get("group_name")), mine, answers)

    async def update_from_broadcast(self, request: Broadcast) -> UpdateResult:
        return await self._mine(UpdateFromDistributed(request, self.timeout))

    async def destroy_weights_update_group(self, group_name: str) -> WeightUpdateGroupResult:
        mine, answers = await self._call(DestroyGroup(group_name))
        return self._joined(group_name, mine, answers)

    async def stage_ipc(self, serial: int, info: Mapping[str, Any]) -> dict[str, int] | None:
        payload = info.get("ipc_handles_pickled")
        if not isinstance(payload, str):  # refused here, before any rank is asked
            return await self.local.stage_ipc(serial, info)
        rest = {k: v for k, v in info.items() if k != "ipc_handles_pickled"}
        keys: list[str] = []

        async def make(seq: int) -> StageIpc:  # one copy, as it came
            key = f"payload/{seq}/ipc"
            keys.extend(await self._relay({key: payload}))
            return StageIpc(serial, key, rest, self.timeout)

        async def delete() -> None:  # every rank has read the payload (or given up)
            await to_thread(self.channel.delete, list(keys))
            keys.clear()

        try:
            result, _ = await self._call(make, payload=payload, after_here=delete)
        finally:
            if keys:
                await delete()
        return result

    async def stage_received(self, serial: int, names: Sequence[str], dtypes: Sequence[str],
                             shapes: Sequence[Sequence[int]], timeout: float
                             ) -> dict[str, int] | None:
        # The vote waits for a rank whose receive ends later than this one's (its own
        # deadline is the same ``timeout``), and then as long as for any other answer.
        return await self._mine(StageReceived(serial, list(names), list(dtypes),
                                              [list(s) for s in shapes], timeout,
                                              timeout + self.timeout))

    async def staged(self, serial: int) -> dict[str, int]:
        return await self.local.staged(serial)

    async def commit_staged(self, serial: int, weight_version: str | None) -> UpdateResult:
        # The controllers' update is collective: every rank writes, or none (lifecycle._collective).
        return await self._mine(CommitStaged(serial, weight_version))

    async def drop_staged(self, serial: int) -> None:
        await self._mine(DropStaged(serial))

    @property
    def can_generate(self) -> bool:
        return self.local.can_generate

    async def generate(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        mine, answers = await self._call(Generate(dict(body)))
        odd = {r: a for r, a in answers.items() if a.get("sha256") != mine.get("sha256")}
        if odd:
            raise OutputsDisagree(
                f"the ranks' outputs differ: rank 0 {mine.get('sha256')}, " + ", ".join(
                    f"rank {r} {a.get('sha256') or a.get('message')}" for r, a in odd.items()))
        return {**mine, "ranks_agree": True, "world_size": self.channel.world_size}

    async def state(self) -> dict[str, Any]:
        mine, answers = await self._call(State())
        return {**mine, "ranks": {"0": mine, **{str(r): a for r, a in answers.items()}}}

    def unavailable(self) -> str | None:
        if self.ctl.phase is Phase.UNINITIALIZED:
            return "no pipeline attached"
        try:
            silent = self.channel.silent_ranks()
        except RuntimeError as exc:
            return f"the group's store is unreachable: {exc}"
        return f"rank(s) {silent} do not respond" if silent else None

    async def stop(self) -> None:
        """Tell every rank to detach and stop (rank 0 detaches with them)."""
        async with self._lock:
            self._seq += 1
            await to_thread(self.channel.post, self._seq, {"op": "stop"})
            with contextlib.suppress(TransitionFailed):  # a rank is gone: nothing to pair with
                await self.ctl.aclose()


def _names(names: Sequence[str] | None) -> list[str] | None:
    return None if names is None else list(names)
