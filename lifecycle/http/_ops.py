"""The ops every rank of a multi-rank server runs (lifecycle.http._ranks): one frozen
dataclass per op, its arguments as typed fields, in one table (:data:`OPS`) that both sides
use: rank 0 makes the op and posts :meth:`Op.to_json`, every other rank reads it back with
:meth:`Op.from_json`, and each runs :meth:`Op.run` on its own controller; a follower posts
:meth:`Op.answer` of its result, rank 0 keeps its own typed result.

Steps that must not start on one rank before every rank can (a decoded upload, a received
broadcast, a weight update group) vote first (``OpChannel.agree``): a rank that cannot refuses
with the others, naming itself, instead of leaving them waiting in a collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar, cast

from strategies.protocol import to_thread

from .. import (
    LifecycleController,
    OccupationResult,
    TensorHashCheck,
    UpdateResult,
    WeightUpdateGroupResult,
)
from .._discard import Discard
from .._weight_sync import Broadcast, broadcast_from_json
from ._channel import OpChannel, describe
from ._driver import LocalDriver, Modules, local_state
from ._wire import Decoded, TensorRequest, WireRefused, group_refusal

__all__ = ["OPS", "Op", "RankContext", "run_op"]

R = TypeVar("R")


@dataclass(frozen=True)
class RankContext:
    """Where an op runs: this rank's driver, the channel, the op's number, and on rank 0 the
    payload a relayed op carries in memory (the other ranks read it from the store)."""

    local: LocalDriver
    channel: OpChannel
    seq: int
    payload: str | memoryview | None = None


@dataclass(frozen=True)
class Op(Generic[R]):
    """One call every rank runs."""

    name: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"op": self.name, "args": {f.name: getattr(self, f.name)
                                          for f in dataclasses.fields(self)}}

    @classmethod
    def from_json(cls, args: Mapping[str, Any]) -> Self:
        return cls(**args)

    async def run(self, ctx: RankContext) -> R:
        raise NotImplementedError

    def answer(self, result: R) -> dict[str, Any]:
        """A follower's result as JSON (what rank 0 combines): a result class's ``as_dict``
        (the ops whose result is another type say how)."""
        as_dict: dict[str, Any] = cast(Any, result).as_dict()
        return as_dict


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


async def _decoded(local: LocalDriver, channel: OpChannel, seq: int, text: Any, index: int,
                   request: TensorRequest, fd_timeout: float, timeout: float
                   ) -> Decoded:
    """This rank's entry decoded, once every rank has decoded its own (``agree``); raises
    :class:`WireRefused` naming every rank that could not."""
    named: Decoded | None = None
    error: str | None = None
    try:
        if callable(text):
            text = await to_thread(text)
        named = await local.decode(text, index, request, fd_timeout)
    except WireRefused as exc:
        error = str(exc)
    except RuntimeError as exc:  # the store: the entry never came
        error = f"the entry did not arrive: {exc}"
    del text
    failures = await to_thread(channel.agree, seq, error, timeout)
    if failures:
        raise WireRefused(describe(failures, channel.world_size))
    assert named is not None
    return named


async def _ready(ctl: LifecycleController, channel: OpChannel, seq: int, group_name: str,
                 timeout: float) -> None:
    """Every rank has the weight update group, unbroken; else :class:`WireRefused`."""
    failures = await to_thread(channel.agree, seq, group_refusal(ctl, group_name), timeout)
    if failures:
        raise WireRefused(describe(failures, channel.world_size))


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
    failures = await to_thread(channel.agree, seq, error, timeout)
    if failures:
        raise WireRefused(describe(failures, channel.world_size))
    assert modules is not None
    return local.staging.add(serial, modules)


@dataclass(frozen=True)
class Sleep(Op[OccupationResult]):
    name = "sleep"
    discard: Discard  # as the body gave it (None: each rank's option)
    components: list[str] | None

    async def run(self, ctx: RankContext) -> OccupationResult:
        return await ctx.local.sleep(self.discard, self.components)


@dataclass(frozen=True)
class Wake(Op[OccupationResult]):
    name = "wake"
    components: list[str] | None

    async def run(self, ctx: RankContext) -> OccupationResult:
        return await ctx.local.wake(self.components)


@dataclass(frozen=True)
class CheckWeights(Op[tuple[bool, str]]):
    name = "weights_checker"
    action: str

    async def run(self, ctx: RankContext) -> tuple[bool, str]:
        return await ctx.local.weights_checker(self.action)

    def answer(self, result: tuple[bool, str]) -> dict[str, Any]:
        return {"success": result[0], "message": result[1]}


@dataclass(frozen=True)
class _Done(Op[None]):
    """An op with nothing to answer but that it ran."""

    def answer(self, result: None) -> dict[str, Any]:
        return {"success": True}


@dataclass(frozen=True)
class _Staged(Op[dict[str, int] | None]):
    """An op that stages tensors for a transaction: answers what it staged."""

    def answer(self, result: dict[str, int] | None) -> dict[str, Any]:
        return {"staged": result}


@dataclass(frozen=True)
class SetWeightVersion(_Done):
    name = "set_weight_version"
    label: str

    async def run(self, ctx: RankContext) -> None:
        await ctx.local.set_weight_version(self.label)


@dataclass(frozen=True)
class UpdateFromDisk(Op[UpdateResult]):
    name = "update_from_disk"
    path: str
    targets: list[str] | None
    weight_version: str | None
    flush_cache: bool

    async def run(self, ctx: RankContext) -> UpdateResult:
        return await ctx.local.update_from_disk(self.path, self.targets,
                                                weight_version=self.weight_version,
                                                flush_cache=self.flush_cache)


@dataclass(frozen=True)
class UpdateFromUpload(Op[UpdateResult]):
    """A tensor upload: each rank decodes its own entry (``entries``: rank -> index; rank 0
    from memory, the others from the store under ``keys``), the ranks agree, then update."""

    name = "update_from_upload"
    keys: dict[str, str]
    entries: dict[str, int]
    request: dict[str, Any]
    fd_timeout: float
    agree_timeout: float

    async def run(self, ctx: RankContext) -> UpdateResult:
        me = str(ctx.channel.rank)
        request = TensorRequest.from_json(self.request)
        text: Any = ctx.payload if ctx.payload is not None else (
            lambda: ctx.channel.get_raw(self.keys[me]))
        named = await _decoded(ctx.local, ctx.channel, ctx.seq, text, self.entries[me], request,
                               self.fd_timeout, self.agree_timeout)
        return await ctx.local.update_decoded(named, request)


@dataclass(frozen=True)
class Checksum(Op[dict[str, str]]):
    name = "checksum"
    names: list[str]

    async def run(self, ctx: RankContext) -> dict[str, str]:
        return await ctx.local.checksum(self.names)

    def answer(self, result: dict[str, str]) -> dict[str, Any]:
        return {"sums": result}


@dataclass(frozen=True)
class CheckTensorHashes(Op[TensorHashCheck]):
    name = "check_tensor_hashes"
    target: str
    expected: dict[str, str]

    async def run(self, ctx: RankContext) -> TensorHashCheck:
        return await ctx.local.check_tensor_hashes(self.target, self.expected)


@dataclass(frozen=True)
class InitGroup(Op[WeightUpdateGroupResult]):
    """Join a trainer's group; ``args`` are the body's fields as the route read them (the
    controller checks their values: lifecycle._weight_sync)."""

    name = "init_weights_update_group"
    args: dict[str, Any]

    async def run(self, ctx: RankContext) -> WeightUpdateGroupResult:
        return await ctx.local.init_weights_update_group(self.args)


@dataclass(frozen=True)
class UpdateFromDistributed(Op[UpdateResult]):
    """An update over a group, once every rank has the group unbroken (``agree``); a
    refused request too: every rank still receives the broadcast it announced."""

    name = "update_weights_from_distributed"
    request: Broadcast
    agree_timeout: float

    def to_json(self) -> dict[str, Any]:
        return {"op": self.name, "args": {"request": self.request.to_json(),
                                          "agree_timeout": self.agree_timeout}}

    @classmethod
    def from_json(cls, args: Mapping[str, Any]) -> Self:
        return cls(broadcast_from_json(args["request"]), args["agree_timeout"])

    async def run(self, ctx: RankContext) -> UpdateResult:
        await _ready(ctx.local.ctl, ctx.channel, ctx.seq, self.request.group_name,
                     self.agree_timeout)
        return await ctx.local.update_from_broadcast(self.request)


@dataclass(frozen=True)
class DestroyGroup(Op[WeightUpdateGroupResult]):
    name = "destroy_weights_update_group"
    group_name: str

    async def run(self, ctx: RankContext) -> WeightUpdateGroupResult:
        return await ctx.local.destroy_weights_update_group(self.group_name)


@dataclass(frozen=True)
class StageIpc(_Staged):
    """vLLM's ipc ``update_info`` staged on every rank (rank 0's payload from memory, the
    others' from the store under ``key``)."""

    name = "stage_ipc"
    serial: int
    key: str
    info: dict[str, Any]  # update_info without its payload
    agree_timeout: float

    async def run(self, ctx: RankContext) -> dict[str, int] | None:
        async def arrive() -> Modules:
            text = ctx.payload if ctx.payload is not None else \
                await to_thread(ctx.channel.get_raw, self.key)
            return await ctx.local.decode_ipc({**self.info, "ipc_handles_pickled": text})

        return await _staged_everywhere(ctx.local, ctx.channel, ctx.seq, self.serial, arrive,
                                        self.agree_timeout)


@dataclass(frozen=True)
class StageReceived(_Staged):
    """The trainer's broadcast received by every rank in its group and staged."""

    name = "stage_received"
    serial: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    timeout: float
    agree_timeout: float

    async def run(self, ctx: RankContext) -> dict[str, int] | None:
        return await _staged_everywhere(
            ctx.local, ctx.channel, ctx.seq, self.serial, lambda: ctx.local.receive(
                self.serial, self.names, self.dtypes, self.shapes, self.timeout),
            self.agree_timeout)


@dataclass(frozen=True)
class CommitStaged(Op[UpdateResult]):
    """What a transaction staged, written as one collective update (every rank or none)."""

    name = "commit_staged"
    serial: int
    weight_version: str | None

    async def run(self, ctx: RankContext) -> UpdateResult:
        return await ctx.local.commit_staged(self.serial, self.weight_version)


@dataclass(frozen=True)
class DropStaged(_Done):
    name = "drop_staged"
    serial: int

    async def run(self, ctx: RankContext) -> None:
        await ctx.local.drop_staged(self.serial)


@dataclass(frozen=True)
class Generate(Op[Mapping[str, Any]]):
    name = "generate"
    body: dict[str, Any]

    async def run(self, ctx: RankContext) -> Mapping[str, Any]:
        return await ctx.local.generate(self.body)

    def answer(self, result: Mapping[str, Any]) -> dict[str, Any]:
        return dict(result)


@dataclass(frozen=True)
class State(Op[dict[str, Any]]):
    name = "state"

    async def run(self, ctx: RankContext) -> dict[str, Any]:
        return local_state(ctx.local.ctl)

    def answer(self, result: dict[str, Any]) -> dict[str, Any]:
        return result


#: Every op, by the name it is posted under.
OPS: dict[str, type[Op[Any]]] = {cls.name: cls for cls in (
    Sleep, Wake, CheckWeights, SetWeightVersion, UpdateFromDisk, UpdateFromUpload, Checksum,
    CheckTensorHashes, InitGroup, UpdateFromDistributed, DestroyGroup, StageIpc, StageReceived,
    CommitStaged, DropStaged, Generate, State)}


async def run_op(local: LocalDriver, channel: OpChannel, seq: int, posted: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """Run a posted op on this rank's controller; the answer rank 0 combines."""
    kind = OPS.get(posted["op"])
    if kind is None:
        return {"error": "UnknownOp", "message": f"unknown op {posted['op']!r}"}
    try:
        op = kind.from_json(posted.get("args", {}))
        return op.answer(await op.run(RankContext(local, channel, seq)))
    except Exception as exc:  # this rank's answer: a rank that stopped following would
        return _error(exc)    # leave rank 0 waiting for it, then the server without it
