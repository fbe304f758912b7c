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
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread

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
from ._driver import Driver, LocalDriver, Modules, RanksUnavailable, Upload, local_state
from ._wire import Decoded, TensorRequest, WireRefused, group_refusal, pick_entry

__all__ = ["OpChannel", "OutputsDisagree", "RankDriver", "follow"]

HEARTBEAT_S = 1.0
STALE_S = 5.0
_POLL_S = 0.005
_ABORT_POLL_S = 0.05  # how often a rank running a generation looks for its abort
# The largest value put in the store at once: its server refuses values over 8 MiB (an upload
# is relayed in pieces of this size).
_PIECE = 4 * 2**20


class OutputsDisagree(RuntimeError):
    """The ranks' outputs of one generation differ (answered with 500)."""


class OpChannel:
    """Numbered ops and per-rank answers in a torch.distributed store (see module doc)."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def _put(self, key: str, value: Mapping[str, Any]) -> None:
        self.store.set(key, json.dumps(value))

    def _get(self, key: str) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(bytes(self.store.get(key)).decode())
        return value

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def post(self, seq: int, op: Mapping[str, Any]) -> None:
        self._put(f"op/{seq}", op)

    def next_op(self, seq: int) -> dict[str, Any]:
        """Wait (polling) for op ``seq``."""
        while not self._has(f"op/{seq}"):
            time.sleep(_POLL_S)
        return self._get(f"op/{seq}")

    def answer(self, seq: int, value: Mapping[str, Any]) -> None:
        self._put(f"answer/{seq}/{self.rank}", value)

    def answers(self, seq: int, timeout: float) -> dict[int, dict[str, Any]]:
        """Every other rank's answer to op ``seq``; a rank that did not answer in time is
        missing from the result."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.world_size))
        out: dict[int, dict[str, Any]] = {}
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                if self._has(f"answer/{seq}/{r}"):
                    out[r] = self._get(f"answer/{seq}/{r}")
                    pending.discard(r)
            if pending:
                time.sleep(_POLL_S)
        return out

    def agree(self, seq: int, error: str | None, timeout: float) -> dict[int, str]:
        """Post this rank's outcome of a step of op ``seq`` (None: ready) and wait for every
        rank's; returns rank -> reason for each rank that is not ready (a rank silent for
        ``timeout`` seconds included). Every rank gets the same answer."""
        self._put(f"agree/{seq}/{self.rank}", {"error": error})
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        failures: dict[int, str] = {}
        while pending:
            for r in sorted(pending):
                if self._has(f"agree/{seq}/{r}"):
                    reason = self._get(f"agree/{seq}/{r}")["error"]
                    if reason is not None:
                        failures[r] = str(reason)
                    pending.discard(r)
            if pending:
                if time.monotonic() > deadline:
                    failures.update({r: f"did not answer within {timeout:g} s" for r in pending})
                    break
                time.sleep(_POLL_S)
        return dict(sorted(failures.items()))

    def abort(self, seq: int) -> None:
        """Mark op ``seq`` (a generation) aborted: every rank ends its part of it."""
        self.store.set(f"abort/{seq}", "1")

    def aborted(self, seq: int) -> bool:
        return self._has(f"abort/{seq}")

    def forget(self, seq: int) -> None:
        """Delete op ``seq``'s keys (every rank has answered it)."""
        keys = [f"op/{seq}", f"abort/{seq}", *(f"{kind}/{seq}/{r}" for kind in ("answer", "agree")
                                               for r in range(self.world_size))]
        for key in keys:
            with contextlib.suppress(RuntimeError):
                self.store.delete_key(key)

    def put_raw(self, key: str, data: str | memoryview) -> list[str]:
        """Put ``data`` under ``key`` in pieces of at most :data:`_PIECE` bytes (the store
        refuses values over 8 MiB); returns every key used (to delete them)."""
        view = memoryview(data.encode()) if isinstance(data, str) else data.cast("B")
        keys = []
        for i, start in enumerate(range(0, len(view), _PIECE)):
            keys.append(f"{key}/{i}")
            self.store.set(keys[-1], bytes(view[start:start + _PIECE]))
        self.store.set(key, str(len(keys)))  # last: once it is there, every piece is
        return [*keys, key]

    def get_raw(self, key: str) -> memoryview:
        """The bytes :meth:`put_raw` put under ``key`` (waiting for them at most the store's
        timeout), writable."""
        count = int(bytes(self.store.get(key)).decode())
        out = bytearray()
        for i in range(count):
            out += self.store.get(f"{key}/{i}")
        return memoryview(out)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            with contextlib.suppress(RuntimeError):
                self.store.delete_key(key)

    def publish_uuid(self, uuid: str) -> None:
        self.store.set(f"device/{self.rank}", uuid)

    def uuid_of(self, rank: int) -> str:
        """Rank ``rank``'s published device UUID (waits for it at most the store's timeout)."""
        return bytes(self.store.get(f"device/{rank}")).decode()

    def beat(self) -> None:
        self.store.set(f"heartbeat/{self.rank}", str(time.time()))

    def silent_ranks(self) -> list[int]:
        """Ranks whose last heartbeat is older than :data:`STALE_S` (or missing)."""
        now = time.time()
        out = []
        for r in range(1, self.world_size):
            key = f"heartbeat/{r}"
            if not self._has(key) or now - float(bytes(self.store.get(key)).decode()) > STALE_S:
                out.append(r)
        return out


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


def _describe(failures: Mapping[int, str], world_size: int) -> str:
    """One message for the ranks that failed: the reason alone when every rank gave it."""
    reasons = set(failures.values())
    if len(failures) == world_size and len(reasons) == 1:
        return next(iter(reasons))
    return "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))


async def _decoded(local: LocalDriver, channel: OpChannel, seq: int, text: Any, index: int,
                   request: TensorRequest, fd_timeout: float, timeout: float
                   ) -> Decoded:
    """This rank's entry decoded, once every rank has decoded its own (``agree``); raises
    :class:`WireRefused` naming every rank that could not."""
    named: Decoded | None = None
    error: str | None = None
    try:
        if callable(text):
            text = await anyio.to_thread.run_sync(text)
        named = await local.decode(text, index, request, fd_timeout)
    except WireRefused as exc:
        error = str(exc)
    except RuntimeError as exc:  # the store: the entry never came
        error = f"the entry did not arrive: {exc}"
    del text
    failures = await anyio.to_thread.run_sync(channel.agree, seq, error, timeout)
    if failures:
        raise WireRefused(_describe(failures, channel.world_size))
    assert named is not None
    return named


async def _ready(ctl: LifecycleController, channel: OpChannel, seq: int, group_name: str,
                 timeout: float) -> None:
    """Every rank has the weight update group, unbroken; else :class:`WireRefused`."""
    failures = await anyio.to_thread.run_sync(channel.agree, seq,
                                              group_refusal(ctl, group_name), timeout)
    if failures:
        raise WireRefused(_describe(failures, channel.world_size))


async def _staged_everywhere(local: LocalDriver, channel: OpChannel, seq: int, serial: int,
                             arrive: Callable[[], Awaitable[Modules]], timeout: float
                             ) -> dict[str, int] | None:
    """What ``arrive`` brings (a decoded payload, a received broadcast), staged for
    transaction ``serial`` once every rank has it (``agree``); else nothing is staged on any
    rank, and :class:`WireRefused` names every rank where it failed and why."""
    modules: Modules | None = None
    error: str | None = None
    try:
        modules = await arrive()
    except Exception as exc:  # any failure is this rank's vote: the others must not wait
        error = str(exc) or type(exc).__name__
    failures = await anyio.to_thread.run_sync(channel.agree, seq, error, timeout)
    if failures:
        raise WireRefused(_describe(failures, channel.world_size))
    assert modules is not None
    return local.staging.add(serial, modules)


async def _run_op(local: LocalDriver, channel: OpChannel, seq: int, op: Mapping[str, Any]
                  ) -> dict[str, Any]:
    """Run one op on this rank's controller; the answer rank 0 combines."""
    name, args = op["op"], op.get("args", {})
    try:
        if name == "sleep":  # discard as the body gave it (None: this rank's option)
            return (await local.sleep(args.get("discard"), args.get("components"))).as_dict()
        if name == "wake":
            return (await local.wake(args.get("components"))).as_dict()
        if name == "weights_checker":
            success, message = await local.weights_checker(args["action"])
            return {"success": success, "message": message}
        if name == "set_weight_version":
            await local.set_weight_version(args["label"])
            return {"success": True}
        if name == "update_from_disk":
            return (await local.update_from_disk(
                args["path"], args["targets"], weight_version=args.get("weight_version"),
                flush_cache=bool(args.get("flush_cache", False)))).as_dict()
        if name == "update_from_upload":
            me = str(channel.rank)
            request = TensorRequest.from_json(args["request"])
            key = args["keys"][me]
            named = await _decoded(local, channel, seq, lambda: channel.get_raw(key),
                                   int(args["entries"][me]), request, float(args["fd_timeout"]),
                                   float(args["agree_timeout"]))
            return (await local.update_decoded(named, request)).as_dict()
        if name == "checksum":
            return {"sums": await local.checksum(args["names"])}
        if name == "check_tensor_hashes":
            return (await local.check_tensor_hashes(args["target"], args["expected"])).as_dict()
        if name == "init_weights_update_group":
            return (await local.init_weights_update_group(args)).as_dict()
        if name == "update_weights_from_distributed":
            await _ready(local.ctl, channel, seq, args["group_name"], float(op["agree_timeout"]))
            return (await local.update_weights_from_distributed(args)).as_dict()
        if name == "destroy_weights_update_group":
            return (await local.destroy_weights_update_group(args["group_name"])).as_dict()
        if name == "stage_ipc":
            key = args["key"]

            async def relayed() -> Modules:
                text = await anyio.to_thread.run_sync(channel.get_raw, key)
                return await local.decode_ipc({**args["info"], "ipc_handles_pickled": text})

            return {"staged": await _staged_everywhere(
                local, channel, seq, int(args["serial"]), relayed, float(args["agree_timeout"]))}
        if name == "stage_received":
            serial = int(args["serial"])
            return {"staged": await _staged_everywhere(
                local, channel, seq, serial, lambda: local.receive(
                    serial, args["names"], args["dtypes"], args["shapes"],
                    float(args["timeout"])), float(args["agree_timeout"]))}
        if name == "commit_staged":
            return (await local.commit_staged(int(args["serial"]),
                                              args["weight_version"])).as_dict()
        if name == "drop_staged":
            await local.drop_staged(int(args["serial"]))
            return {"success": True}
        if name == "generate":
            return dict(await local.generate(args["body"]))
        if name == "state":
            return local_state(local.ctl)
        return {"error": "UnknownOp", "message": f"unknown op {name!r}"}
    except Exception as exc:  # this rank's answer: a rank that stopped following would
        return _error(exc)    # leave rank 0 waiting for it, then the server without it


async def follow(ctl: LifecycleController, local: LocalDriver, channel: OpChannel) -> None:
    """A rank other than 0: run rank 0's ops in order until ``stop``, then detach."""

    async def heartbeat() -> None:
        while True:
            await anyio.to_thread.run_sync(channel.beat)
            await anyio.sleep(HEARTBEAT_S)

    await anyio.to_thread.run_sync(channel.publish_uuid, local.device_uuid)
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        seq = 1
        while True:
            op = await anyio.to_thread.run_sync(channel.next_op, seq, abandon_on_cancel=True)
            if op["op"] == "stop":
                await ctl.aclose()  # detach is collective: rank 0 detaches too
                channel.answer(seq, {"stopped": True})
                break
            if op["op"] == "generate":
                channel.answer(seq, await _abortable(local, channel, seq, op))
            else:
                channel.answer(seq, await _run_op(local, channel, seq, op))
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
            while not await anyio.to_thread.run_sync(channel.aborted, seq):
                await anyio.sleep(_ABORT_POLL_S)
            tg.cancel_scope.cancel()

        async def run() -> None:
            nonlocal answer
            answer = await _run_op(local, channel, seq, op)
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
        while silent := await anyio.to_thread.run_sync(self.channel.silent_ranks):
            if time.monotonic() > deadline:
                raise RanksUnavailable(f"rank(s) {silent} did not start within {timeout:g} s")
            await anyio.sleep(HEARTBEAT_S / 10)

    async def _call(self, name: str,
                    args: Mapping[str, Any] | Callable[[int], Awaitable[Mapping[str, Any]]],
                    here: Callable[[int], Awaitable[Any]], **extra: Any
                    ) -> tuple[Any, dict[int, Any]]:
        """Op ``name`` on every rank: its ``args`` (or made once its number is known, before
        it is posted), and ``here(seq)`` on this rank meanwhile; rank 0's result and every
        other rank's answer."""
        async with self._lock:
            silent = await anyio.to_thread.run_sync(self.channel.silent_ranks)
            if silent:
                raise RanksUnavailable(f"rank(s) {silent} do not respond")
            self._seq += 1
            seq = self._seq
            made = args if isinstance(args, Mapping) else await args(seq)
            op = {"op": name, "args": dict(made), **extra}
            await anyio.to_thread.run_sync(self.channel.post, seq, op)
            try:
                result = await here(seq)
            except BaseException:
                # Refused here (a generation while asleep or stale): the other ranks ran the
                # op all the same; collect their answers so that the op's keys are deleted.
                # A generation aborted here (cancelled) is aborted on every rank.
                with anyio.CancelScope(shield=True):
                    if name == "generate":
                        await anyio.to_thread.run_sync(self.channel.abort, seq)
                    await anyio.to_thread.run_sync(self._drop, seq)
                raise
            answers = await anyio.to_thread.run_sync(self.channel.answers, seq, self.timeout)
            missing = sorted(set(range(1, self.channel.world_size)) - set(answers))
            if missing:
                raise RanksUnavailable(f"rank(s) {missing} did not answer {name}")
            await anyio.to_thread.run_sync(self.channel.forget, seq)
            return result, answers

    def _drop(self, seq: int) -> None:
        """Wait (up to the timeout) for op ``seq``'s answers, then delete its keys; kept
        while a rank has not answered (it may not have read the op yet: deleting it would
        leave that rank waiting for it)."""
        with contextlib.suppress(Exception):  # the op already failed here
            if len(self.channel.answers(seq, self.timeout)) == self.channel.world_size - 1:
                self.channel.forget(seq)

    async def _everywhere(self, op: Mapping[str, Any], here: Callable[[], Awaitable[Any]]
                          ) -> tuple[Any, dict[int, Any]]:
        return await self._call(op["op"], op.get("args", {}), lambda seq: here())

    async def sleep(self, discard: Discard = None, components: Sequence[str] | None = None
                    ) -> OccupationResult:
        args = {"discard": discard, "components": None if components is None else
                list(components)}
        result, _ = await self._everywhere({"op": "sleep", "args": args},
                                           lambda: self.local.sleep(discard, components))
        return result  # type: ignore[no-any-return]

    async def wake(self, components: Sequence[str] | None = None) -> OccupationResult:
        args = {"components": None if components is None else list(components)}
        result, _ = await self._everywhere({"op": "wake", "args": args},
                                           lambda: self.local.wake(components))
        return result  # type: ignore[no-any-return]

    async def weights_checker(self, action: str) -> tuple[bool, str]:
        (success, message), answers = await self._everywhere(
            {"op": "weights_checker", "args": {"action": action}},
            lambda: self.local.weights_checker(action))
        failures = {r: why for r, a in answers.items() if (why := _failed(a)) is not None}
        if not success:
            failures[0] = message
        if not failures:
            return True, message
        return False, _describe(failures, self.channel.world_size)

    async def set_weight_version(self, label: str) -> None:
        await self._everywhere({"op": "set_weight_version", "args": {"label": label}},
                               lambda: self.local.set_weight_version(label))

    async def update_from_disk(self, path: str, targets: Sequence[str] | None, *,
                               weight_version: str | None = None,
                               flush_cache: bool = False) -> UpdateResult:
        op = {"op": "update_from_disk", "args": {
            "path": path, "targets": targets, "weight_version": weight_version,
            "flush_cache": flush_cache}}
        result, _ = await self._everywhere(op, lambda: self.local.update_from_disk(
            path, targets, weight_version=weight_version, flush_cache=flush_cache))
        return result  # type: ignore[no-any-return]

    async def _uuid_of(self, rank: int) -> str:
        if rank == 0:
            return self.local.device_uuid
        if rank not in self._uuids:
            try:
                self._uuids[rank] = await anyio.to_thread.run_sync(self.channel.uuid_of, rank)
            except RuntimeError as exc:  # the store's timeout: the rank never started
                raise RanksUnavailable(f"rank {rank} did not publish its device UUID: "
                                       f"{exc}") from None
        return self._uuids[rank]

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
            raise WireRefused(_describe(refused, world))
        request = upload.request
        keys: list[str] = []

        async def relay(seq: int) -> dict[str, Any]:
            # One copy of each entry another rank needs, as it came: no re-encoding.
            by_index: dict[int, str] = {}
            for index in sorted({picks[r] for r in range(1, world)}):
                by_index[index] = key = f"payload/{seq}/{index}"
                try:
                    keys.extend(await anyio.to_thread.run_sync(
                        self.channel.put_raw, key, upload.entries[index]))
                except RuntimeError as exc:  # the store failed (a torch.distributed error)
                    raise RanksUnavailable(f"the ranks' store did not take the upload: "
                                           f"{exc}") from None
            return {"keys": {str(r): by_index[picks[r]] for r in range(1, world)},
                    "entries": {str(r): picks[r] for r in range(1, world)},
                    "request": request.to_json(), "fd_timeout": upload.fd_timeout,
                    "agree_timeout": self.timeout}

        async def here(seq: int) -> UpdateResult:
            try:
                named = await _decoded(self.local, self.channel, seq, upload.entries[picks[0]],
                                       picks[0], request, upload.fd_timeout, self.timeout)
            finally:  # every rank has read its entry (or given up)
                await anyio.to_thread.run_sync(self.channel.delete, list(keys))
                keys.clear()
            return await self.local.update_decoded(named, request)

        try:
            result, _ = await self._call("update_from_upload", relay, here)
        finally:
            if keys:  # the op failed before every rank read its entry
                await anyio.to_thread.run_sync(self.channel.delete, keys)
        return result  # type: ignore[no-any-return]

    async def checksum(self, names: Sequence[str]) -> dict[str, str]:
        result, _ = await self._everywhere({"op": "checksum", "args": {"names": list(names)}},
                                           lambda: self.local.checksum(names))
        return result  # type: ignore[no-any-return]

    async def check_tensor_hashes(self, target: str, expected: Mapping[str, str]
                                  ) -> TensorHashCheck:
        op = {"op": "check_tensor_hashes", "args": {"target": target, "expected": dict(expected)}}
        mine, answers = await self._everywhere(
            op, lambda: self.local.check_tensor_hashes(target, expected))
        assert isinstance(mine, TensorHashCheck)
        failures = {r: why for r, a in answers.items() if (why := _failed(a)) is not None}
        if not mine.success:
            failures[0] = mine.message
        if not failures:
            return mine
        return TensorHashCheck(False, _describe(failures, self.channel.world_size), target,
                               mine.checked, mine.mismatched, mine.missing)

    def _joined(self, name: str, mine: WeightUpdateGroupResult, answers: Mapping[int, Any]
                ) -> WeightUpdateGroupResult:
        """Rank 0's result of a group init or destroy, failed if any rank's failed."""
        failures = {r: why for r, a in answers.items() if (why := _failed(a)) is not None}
        if not mine.success:
            failures[0] = mine.message
        if not failures:
            return mine
        return WeightUpdateGroupResult(False, _describe(failures, self.channel.world_size),
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
        mine, answers = await self._everywhere(
            {"op": "init_weights_update_group", "args": dict(args)},
            lambda: self.local.init_weights_update_group(args))
        return self._joined(str(args.get("group_name")), mine, answers)

    async def update_weights_from_distributed(self, args: Mapping[str, Any]) -> UpdateResult:
        group_name = str(args.get("group_name"))

        async def here(seq: int) -> UpdateResult:
            await _ready(self.ctl, self.channel, seq, group_name, self.timeout)
            return await self.local.update_weights_from_distributed(args)

        result, _ = await self._call("update_weights_from_distributed", dict(args), here,
                                     agree_timeout=self.timeout)
        return result  # type: ignore[no-any-return]

    async def destroy_weights_update_group(self, group_name: str) -> WeightUpdateGroupResult:
        mine, answers = await self._everywhere(
            {"op": "destroy_weights_update_group", "args": {"group_name": group_name}},
            lambda: self.local.destroy_weights_update_group(group_name))
        return self._joined(group_name, mine, answers)

    async def stage_ipc(self, serial: int, info: Mapping[str, Any]) -> dict[str, int] | None:
        payload = info.get("ipc_handles_pickled")
        if not isinstance(payload, str):  # refused here, before any rank is asked
            return await self.local.stage_ipc(serial, info)
        rest = {k: v for k, v in info.items() if k != "ipc_handles_pickled"}
        keys: list[str] = []

        async def relay(seq: int) -> dict[str, Any]:  # one copy, as it came
            key = f"payload/{seq}/ipc"
            try:
                keys.extend(await anyio.to_thread.run_sync(self.channel.put_raw, key, payload))
            except RuntimeError as exc:  # the store failed (a torch.distributed error)
                raise RanksUnavailable(f"the ranks' store did not take the payload: "
                                       f"{exc}") from None
            return {"serial": serial, "key": key, "info": rest, "agree_timeout": self.timeout}

        async def here(seq: int) -> dict[str, int] | None:
            try:
                return await _staged_everywhere(self.local, self.channel, seq, serial,
                                                lambda: self.local.decode_ipc(info),
                                                self.timeout)
            finally:  # every rank has read the payload (or given up)
                await anyio.to_thread.run_sync(self.channel.delete, list(keys))

        result, _ = await self._call("stage_ipc", relay, here)
        return result  # type: ignore[no-any-return]

    async def stage_received(self, serial: int, names: Sequence[str], dtypes: Sequence[str],
                             shapes: Sequence[Sequence[int]], timeout: float
                             ) -> dict[str, int] | None:
        # The vote waits for a rank whose receive ends later than this one's (its own
        # deadline is the same ``timeout``), and then as long as for any other answer.
        agree_timeout = timeout + self.timeout
        args = {"serial": serial, "names": list(names), "dtypes": list(dtypes),
                "shapes": [list(s) for s in shapes], "timeout": timeout,
                "agree_timeout": agree_timeout}
        result, _ = await self._call("stage_received", args, lambda seq: _staged_everywhere(
            self.local, self.channel, seq, serial,
            lambda: self.local.receive(serial, names, dtypes, shapes, timeout),
            agree_timeout))
        return result  # type: ignore[no-any-return]

    async def staged(self, serial: int) -> dict[str, int]:
        return await self.local.staged(serial)

    async def commit_staged(self, serial: int, weight_version: str | None) -> UpdateResult:
        # The controllers' update is collective: every rank writes, or none (lifecycle._collective).
        result, _ = await self._everywhere(
            {"op": "commit_staged", "args": {"serial": serial, "weight_version": weight_version}},
            lambda: self.local.commit_staged(serial, weight_version))
        return result  # type: ignore[no-any-return]

    async def drop_staged(self, serial: int) -> None:
        await self._everywhere({"op": "drop_staged", "args": {"serial": serial}},
                               lambda: self.local.drop_staged(serial))

    @property
    def can_generate(self) -> bool:
        return self.local.can_generate

    async def generate(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        mine, answers = await self._everywhere({"op": "generate", "args": {"body": dict(body)}},
                                               lambda: self.local.generate(body))
        odd = {r: a for r, a in answers.items() if a.get("sha256") != mine.get("sha256")}
        if odd:
            raise OutputsDisagree(
                f"the ranks' outputs differ: rank 0 {mine.get('sha256')}, " + ", ".join(
                    f"rank {r} {a.get('sha256') or a.get('message')}" for r, a in odd.items()))
        return {**mine, "ranks_agree": True, "world_size": self.channel.world_size}

    async def state(self) -> dict[str, Any]:
        mine, answers = await self._everywhere({"op": "state"}, self.local.state)
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
            await anyio.to_thread.run_sync(self.channel.post, self._seq, {"op": "stop"})
            with contextlib.suppress(TransitionFailed):  # a rank is gone: nothing to pair with
                await self.ctl.aclose()
