"""Serving one pipeline spread over several ranks: rank 0 answers HTTP, every rank runs
every call.

Rank 0 posts each call as a numbered *op* in the group's key-value store (the TCPStore that
``init_process_group`` uses, under its own prefix; JSON, tensors as base64 safetensors: no
pickles). Every other rank reads the ops in order, runs each on its own controller, and posts
its answer. Control calls are collective in the controllers themselves (every rank commits or
none does, see ``lifecycle._group``), so rank 0's result is the combined one; generations run
on every rank and rank 0 checks that their outputs agree. Ranks post a heartbeat every second:
``/health`` names a rank whose heartbeat stopped. The store is polled, not a collective, so
idle ranks never hit a collective timeout.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .. import (
    LifecycleController,
    LifecycleError,
    OccupationResult,
    Phase,
    TransitionFailed,
    UpdateResult,
)
from ._driver import Driver, LocalDriver, RanksUnavailable, local_state

__all__ = ["OpChannel", "OutputsDisagree", "RankDriver", "follow"]

HEARTBEAT_S = 1.0
STALE_S = 5.0


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
            time.sleep(0.005)
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
                time.sleep(0.005)
        return out

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


def _encode_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    return base64.b64encode(save_safetensors(dict(named))).decode()


def _decode_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    return list(load_safetensors(base64.b64decode(payload)).items())


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


async def _run_op(local: LocalDriver, op: Mapping[str, Any]) -> dict[str, Any]:
    """Run one op on this rank's controller; the answer rank 0 combines."""
    name, args = op["op"], op.get("args", {})
    try:
        if name in ("sleep", "wake"):
            result: OccupationResult = await getattr(local, name)()
            return result.as_dict()
        if name == "update_from_disk":
            return (await local.update_from_disk(args["path"], args["targets"])).as_dict()
        if name == "update_from_tensors":
            named = _decode_tensors(args["tensors"])
            return (await local.update_from_tensors(named, args["target"])).as_dict()
        if name == "checksum":
            return {"sums": await local.checksum(args["names"])}
        if name == "generate":
            return dict(await local.generate(args["body"]))
        if name == "state":
            return local_state(local.ctl)
        return {"error": "UnknownOp", "message": f"unknown op {name!r}"}
    except (LifecycleError, ValueError, KeyError, OSError) as exc:
        return _error(exc)


async def follow(ctl: LifecycleController, local: LocalDriver, channel: OpChannel) -> None:
    """A rank other than 0: run rank 0's ops in order until ``stop``, then detach."""

    async def heartbeat() -> None:
        while True:
            await anyio.to_thread.run_sync(channel.beat)
            await anyio.sleep(HEARTBEAT_S)

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        seq = 1
        while True:
            op = await anyio.to_thread.run_sync(channel.next_op, seq, abandon_on_cancel=True)
            if op["op"] == "stop":
                await ctl.aclose()  # detach is collective: rank 0 detaches too
                channel.answer(seq, {"stopped": True})
                break
            channel.answer(seq, await _run_op(local, op))
            seq += 1
        tg.cancel_scope.cancel()


class RankDriver(Driver):
    """Rank 0's driver: each call is posted to every rank, run here too, and combined."""

    def __init__(self, local: LocalDriver, channel: OpChannel, timeout: float) -> None:
        self.local = local
        self.ctl = local.ctl
        self.channel = channel
        self.timeout = timeout  # for the other ranks' answers, beyond the call itself
        self._seq = 0
        self._lock = anyio.Lock()  # ops are posted and run in one order on every rank

    async def _everywhere(self, op: Mapping[str, Any], here: Any) -> tuple[Any, dict[int, Any]]:
        async with self._lock:
            silent = await anyio.to_thread.run_sync(self.channel.silent_ranks)
            if silent:
                raise RanksUnavailable(f"rank(s) {silent} do not respond")
            self._seq += 1
            seq = self._seq
            await anyio.to_thread.run_sync(self.channel.post, seq, op)
            result = await here()
            answers = await anyio.to_thread.run_sync(self.channel.answers, seq, self.timeout)
            missing = sorted(set(range(1, self.channel.world_size)) - set(answers))
            if missing:
                raise RanksUnavailable(f"rank(s) {missing} did not answer {op['op']}")
            return result, answers

    async def sleep(self) -> OccupationResult:
        result, _ = await self._everywhere({"op": "sleep"}, self.local.sleep)
        return result  # type: ignore[no-any-return]

    async def wake(self) -> OccupationResult:
        result, _ = await self._everywhere({"op": "wake"}, self.local.wake)
        return result  # type: ignore[no-any-return]

    async def update_from_disk(self, path: str, targets: Sequence[str] | None) -> UpdateResult:
        op = {"op": "update_from_disk", "args": {"path": path, "targets": targets}}
        result, _ = await self._everywhere(
            op, lambda: self.local.update_from_disk(path, targets))
        return result  # type: ignore[no-any-return]

    async def update_from_tensors(self, named: list[tuple[str, torch.Tensor]],
                                  target: str) -> UpdateResult:
        payload = await anyio.to_thread.run_sync(_encode_tensors, named)
        op = {"op": "update_from_tensors", "args": {"tensors": payload, "target": target}}
        result, _ = await self._everywhere(
            op, lambda: self.local.update_from_tensors(named, target))
        return result  # type: ignore[no-any-return]

    async def checksum(self, names: Sequence[str]) -> dict[str, str]:
        result, _ = await self._everywhere({"op": "checksum", "args": {"names": list(names)}},
                                           lambda: self.local.checksum(names))
        return result  # type: ignore[no-any-return]

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
