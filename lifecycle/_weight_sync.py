"""Weight sync over a trainer's process group: init, update, destroy.

Trainers that do not share a GPU with the server push weights with ``torch.distributed``
(NCCL on GPUs, gloo on the CPU). The protocol is the reference's: the trainer is rank 0 of a
group of ``world_size`` and serves its store (a ``TCPStore`` on ``master_address:master_port``);
each server rank joins as ``rank_offset + its rank``; for each update the trainer broadcasts
every listed tensor, one ``broadcast`` per tensor in list order, while it posts the update's
metadata (names, dtypes, shapes) over HTTP.

The group is a **new** one, never the default process group (the controller may itself run in
one, for its votes): a store of its own and a backend object (``ProcessGroupGloo`` /
``ProcessGroupNCCL``) held by the group's receiving process (below), with the key layout
of ``init_custom_process_group`` (the trainers' helper), so that a trainer using it meets this
server in the store. ``backend`` is passed through (``gloo`` or ``nccl``; gloo is what CI tests,
NCCL needs GPUs).

**All or nothing.** An update validates the metadata against the target before the
broadcast starts (names, shapes, dtypes: the model's own dtype is required; LoRA layouts),
then receives the tensors into staging and writes them through the store's two-phase writes,
like every other update: nothing is committed until every tensor arrived, any failure
restores every tensor written (bit for bit, from in-memory backups), and over several server
ranks the collective vote decides. A request of at most ``bucket_bytes`` is received whole
before anything is written; a larger one is received a bucket at a time, each bucket written
undoably before the next arrives.

**The round trip** (inherent: the controller owns the update road, this module the group):

    ctl.update_weights_from_distributed(...)      # the controller's public call
      -> WeightSync.update(run, ...)              # checks the metadata, keeps the group in step
        -> run(make_plan) = ctl._update(...)      # lock, vote, gate: the controller's road
          -> make_plan() receives the broadcast   # into staging, via the group's process
        <- two-phase writes, commit or undo       # back in the controller, as any update

**Received, not written.** :meth:`WeightSync.receive_tensors` receives a broadcast the same
way (the group's process, its buffer, the canaries, one deadline, a refusal drained) into
host copies that nothing writes: vLLM's weight-transfer contract (lifecycle.http._transfer)
stages them from ``/update_weights`` to ``/finish_weight_update`` and writes them there as one
update; what a transaction stages counts against ``max_staging_bytes``.

**Receive in isolation.** Each group's transport runs in a process of its own
(:mod:`lifecycle._weight_sync_child`, forked from a fork server), which joins the trainer's
group and receives each broadcast into a staging buffer it shares with the server (a
``memfd``, mapped by both): the bytes land once, where the writes read them. A bad peer can
end that process (gloo aborts on its I/O thread when a message is longer than its buffer; a
huge ``world_size`` builds a connection object per rank; a store that accepts and never
answers holds a join), never the server: the server sees its connection close, or kills it
at a wall-clock deadline, fails the call with a typed error (:class:`WeightSyncTransferFailed`
for an update), rolls back, and reports the group broken until destroyed and initialised
again. Killing the process is also how a receive in progress is stopped: it can no longer
write into the buffer, so no receive is ever left running behind a rolled-back update.

**Checking what arrived.** A receiver of a plain ``broadcast`` learns nothing but the bytes:
no name, no length (gloo fills the buffer's first bytes and says nothing of how many). So
each tensor is received into its slot of the buffer, ``_SLACK`` (64) bytes larger than
announced, after the server wrote a fixed 8-byte canary over the tensor's last 8 bytes and
over the slack; once the bucket arrived, before anything is written:

* a broadcast **longer** than announced by 1..64 bytes overwrote slack (caught unless the
  extra bytes are the canary's own, 256**-k for k extra bytes: harmless then, the announced
  bytes are the trainer's); longer still, gloo aborts the receiving process (caught always);
* one **shorter** by 8 bytes or more left the canary in the tensor's last 8 bytes (caught
  always; an honest tensor ends with those 8 bytes with probability 2**-64). One shorter by
  1..7 bytes (only a tensor whose dtype was swapped for one of a smaller item size, of
  fewer than 8 bytes in all, or a hostile trainer) is not caught: no single receive can tell;
* **reordered** or **extra** broadcasts shift sizes: caught where the sizes differ (an extra
  one at the next update, whose first receive gets it), not between tensors of one size
  (the wire carries no names: a receiver of a plain broadcast cannot tell two of them apart);
* a trainer that **stalls or trickles** meets one wall-clock deadline for the whole update
  (``timeout``, not per tensor), kept outside torch: the process is killed at it.

The canary is fixed, not random, because gloo's broadcast tree has a server rank forward its
whole buffer (slack included) to others: every receiver of a group must expect the same
bytes. Knowing it gains a hostile trainer nothing: it can only make a longer broadcast look
exact, whose announced bytes are its own anyway.

**Bounds** (:class:`WeightSyncLimits`, each refusal naming its bound): ``world_size``, groups
per rank, the bytes one group stages (its buffer: ``bucket_bytes`` or one tensor larger than
that, default 256 MiB, at most ``max_staging_bytes``), and the largest tensor a refused
update is drained of. ``master_address`` must be an IP address in the allowed networks
(loopback by default). A join's failure is answered with one message at its deadline,
whatever happened (refused, timed out, not a store: logged, not answered), so that the
route is no port scanner and echoes nothing a peer sent.

**In step with the trainer, whatever the answer.** A refusal (validation, a sleeping
pipeline, a drain timeout, a refusal on another server rank) cannot stop a broadcast the
trainer has started: the receiving process still receives each listed tensor, into a scratch
buffer of its own freed after (nothing is staged in the server), and the server answers the
refusal once the broadcast is over. The trainer's broadcast completes, the group stays
usable, and the trainer learns of the refusal from the HTTP answer (the reference's clients
run the broadcast and the HTTP call side by side, then check both). Metadata that cannot be
parsed (so the server cannot tell what the trainer sends), a tensor too large to drain and a
cancelled update break the group.

Joins, updates and destroys of different groups never wait for each other: the table of
groups is locked only to read or change it; a destroy stops the group's process at once (an
update in progress on it rolls back); a shutdown (:meth:`WeightSync.shutdown`) stops joins at
once and updates after the drain's grace.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import mmap
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing import reduction
from typing import Any

import anyio
import torch

from strategies.protocol import PreparedMove, TensorStore, WriteSource, to_thread

from . import _events as events
from . import _weight_sync_child as _child
from ._errors import InvalidRequest, WeightSyncError, WeightSyncGroupBroken, WeightSyncGroupMissing
from ._events import get_logger
from ._lora import (
    LoraBases,
    LoraScale,
    LoraTarget,
    WeightUpdateMode,
    lora_layout,
    merge_plan,
    parse_mode,
    parse_scale,
)
from ._results import UpdateResult, WeightUpdateGroupResult, WeightUpdateGroupState
from ._updates import PlannedWrite, UpdatePlan, UpdateRefused, version_label

__all__ = [
    "BACKENDS",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT",
    "Broadcast",
    "DistributedUpdate",
    "RefusedBroadcast",
    "TensorSpec",
    "WeightSync",
    "WeightSyncLimits",
    "WeightSyncTransferFailed",
    "WeightUpdateGroup",
    "broadcast_from_json",
    "parse_address",
    "parse_dtype",
    "parse_specs",
    "warm_up",
]

_log = get_logger("lifecycle.weight_sync")

#: Largest staging buffer of an update (bytes); a single larger tensor gets its own size.
DEFAULT_BUCKET_BYTES = 256 * 2**20
#: Seconds to join a group, and for the whole broadcast of an update to arrive.
DEFAULT_TIMEOUT = 60.0
BACKENDS = ("gloo", "nccl")
_ALIGN = 64  # bytes: every staged tensor starts on a multiple (dtype views stay legal)
_SHOWN = 20


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# -- the request's metadata -------------------------------------------------------------
def parse_dtype(value: object) -> torch.dtype:
    """A dtype from a ``torch.dtype`` or its name (``"torch.bfloat16"``, ``"bfloat16"``)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        found = getattr(torch, value.strip().removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise InvalidRequest("dtypes", f"dtypes must be torch dtype names such as 'bfloat16' or "
                                   f"'torch.float32', got {value!r}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the trainer broadcasts: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def parse_specs(names: object, dtypes: object, shapes: object) -> list[TensorSpec]:
    """The broadcast's tensors from the request's three lists, or :class:`InvalidRequest`."""
    for field_name, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
            raise InvalidRequest(field_name, f"{field_name} must be a non-empty list, got "
                                             f"{type(value).__name__}")
    assert isinstance(names, Sequence) and isinstance(dtypes, Sequence) \
        and isinstance(shapes, Sequence)
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequest("names", f"names, dtypes and shapes must have one entry per tensor, "
                                      f"got {len(names)}, {len(dtypes)} and {len(shapes)}")
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or not name:
            raise InvalidRequest("names", f"names[{i}] must be a non-empty string, got {name!r}")
        if name in seen:
            raise InvalidRequest("names", f"names must be unique, {name!r} is given twice")
        seen.add(name)
        if isinstance(shape, str | bytes) or not isinstance(shape, Sequence) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InvalidRequest("shapes", f"shapes[{i}] ({name}) must be a list of integers "
                                           f">= 0, got {shape!r}")
        specs.append(TensorSpec(name, parse_dtype(dtype), tuple(int(d) for d in shape)))
    return specs


def _positive(name: str, value: object, kind: type = float) -> Any:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if not ok or (kind is int and not isinstance(value, int)):
        raise InvalidRequest(name, f"{name} must be a positive {kind.__name__}, got {value!r}")
    return value


# -- an update's request ------------------------------------------------------------------
def _specs_json(specs: Sequence[TensorSpec]) -> dict[str, Any]:
    return {"names": [s.name for s in specs], "dtypes": [str(s.dtype) for s in specs],
            "shapes": [list(s.shape) for s in specs]}


def _specs_from_json(value: Mapping[str, Any]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(n, parse_dtype(d), tuple(s)) for n, d, s in zip(
        value["names"], value["dtypes"], value["shapes"], strict=True))


@dataclass(frozen=True)
class DistributedUpdate:
    """An update over a weight update group, checked (make one with :meth:`parse`): the
    tensors the trainer broadcasts (``specs``: the request's ``names``, ``dtypes`` and
    ``shapes``, in broadcast order), the group, the one target module, the update mode and
    its LoRA scale (``lora_alpha`` / ``lora_rank``, None outside a LoRA merge), the seconds
    the whole broadcast may take, the staging bucket (None: the group's), and what the
    controller's update does after (``flush_cache``, ``weight_version``)."""

    specs: tuple[TensorSpec, ...]
    group_name: str = "weight_update_group"
    target_modules: tuple[str] = ("transformer",)
    weight_update_mode: WeightUpdateMode = "full"
    lora_alpha: float | None = None
    lora_rank: int | None = None
    timeout: float = DEFAULT_TIMEOUT
    bucket_bytes: int | None = None
    flush_cache: bool = False
    weight_version: str | None = None

    @property
    def scale(self) -> LoraScale:
        return LoraScale(self.lora_alpha, self.lora_rank)

    @classmethod
    def parse(cls, body: Mapping[str, object]) -> DistributedUpdate | RefusedBroadcast:
        """The request of ``body`` (the keyword arguments of
        :meth:`LifecycleController.update_weights_from_distributed`; an absent field takes
        its default), or, when a field is wrong, a :class:`RefusedBroadcast`: the trainer
        broadcasts whatever the answer, so the update refuses only once it received (and
        dropped) what was announced. Raises :class:`InvalidRequest` at once only for a
        ``weight_version`` or ``group_name`` that is not a string (no group to receive over)."""
        version = version_label(body.get("weight_version"))
        group_name = body.get("group_name", "weight_update_group")
        if not isinstance(group_name, str) or not group_name:
            raise InvalidRequest("group_name", f"group_name must be a non-empty string, got "
                                               f"{_shown(group_name)}")
        specs: tuple[TensorSpec, ...] | None = None
        timeout = DEFAULT_TIMEOUT
        try:
            specs = tuple(parse_specs(body.get("names"), body.get("dtypes"), body.get("shapes")))
            timeout = float(_positive("timeout", body.get("timeout", DEFAULT_TIMEOUT)))
            mode = parse_mode(body.get("weight_update_mode"))
            scale = parse_scale(mode, body.get("lora_alpha"), body.get("lora_rank"))
            bucket = body.get("bucket_bytes")
            bucket_bytes = None if bucket is None else int(_positive("bucket_bytes", bucket, int))
            targets = body.get("target_modules", ("transformer",))
            if isinstance(targets, str) or not isinstance(targets, Sequence) \
                    or len(targets) != 1 or not isinstance(targets[0], str):
                raise InvalidRequest("target_modules", f"target_modules must name exactly one "
                                                       f"module, got {_shown(targets)}")
        except InvalidRequest as exc:
            return RefusedBroadcast(group_name, specs, timeout, exc.field, exc.reason)
        return cls(specs, group_name, (targets[0],), mode, scale.alpha, scale.rank, timeout,
                   bucket_bytes, bool(body.get("flush_cache", False)), version)

    def to_json(self) -> dict[str, Any]:
        """The request as JSON (what rank 0 of a multi-rank server posts to the others)."""
        return {**_specs_json(self.specs), "group_name": self.group_name,
                "target_modules": list(self.target_modules),
                "weight_update_mode": self.weight_update_mode, "lora_alpha": self.lora_alpha,
                "lora_rank": self.lora_rank, "timeout": self.timeout,
                "bucket_bytes": self.bucket_bytes, "flush_cache": self.flush_cache,
                "weight_version": self.weight_version}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> DistributedUpdate:
        """The request :meth:`to_json` gave (checked when it was parsed)."""
        (target,) = value["target_modules"]
        return cls(_specs_from_json(value), value["group_name"], (target,),
                   value["weight_update_mode"], value["lora_alpha"], value["lora_rank"],
                   value["timeout"], value["bucket_bytes"], value["flush_cache"],
                   value["weight_version"])


@dataclass(frozen=True)
class RefusedBroadcast:
    """A distributed update refused for its fields (:meth:`DistributedUpdate.parse`), still
    carried to the group: the update receives the broadcast it announced (``specs``; None
    when they could not be read: the group breaks instead, it cannot follow the trainer)
    within ``timeout`` seconds, drops it, then raises :attr:`error`, naming ``field``."""

    group_name: str
    specs: tuple[TensorSpec, ...] | None
    timeout: float
    field: str
    reason: str

    @property
    def error(self) -> InvalidRequest:
        return InvalidRequest(self.field, self.reason)

    def to_json(self) -> dict[str, Any]:
        specs = None if self.specs is None else _specs_json(self.specs)
        return {"group_name": self.group_name, "specs": specs, "timeout": self.timeout,
                "refused": {"field": self.field, "reason": self.reason}}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> RefusedBroadcast:
        specs = None if value["specs"] is None else _specs_from_json(value["specs"])
        refused = value["refused"]
        return cls(value["group_name"], specs, value["timeout"], refused["field"],
                   refused["reason"])


#: A distributed update as parsed: checked, or refused (and still received).
Broadcast = DistributedUpdate | RefusedBroadcast


def broadcast_from_json(value: Mapping[str, Any]) -> Broadcast:
    """The request that ``to_json`` of a :class:`DistributedUpdate` or a
    :class:`RefusedBroadcast` gave."""
    return RefusedBroadcast.from_json(value) if "refused" in value else \
        DistributedUpdate.from_json(value)


# -- the bounds -------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightSyncLimits:
    """What a trainer may ask of this rank (each refusal names the bound it passed).

    ``max_world_size``: the largest group a trainer may ask this rank to join (gloo makes a
    connection object per rank before anything can fail). ``max_groups``: groups joined (or
    joining) at once; each is a process with a few sockets and threads. ``max_staging_bytes``:
    the most one group stages at once (its shared buffer: a bucket, or one tensor larger than
    the bucket) and the largest tensor a refused update's broadcast is drained of (a larger
    one breaks the group instead). ``trainer_networks``: the networks ``master_address`` must
    be in (loopback by default: a client may otherwise make the server connect anywhere)."""

    max_world_size: int = 1024
    max_groups: int = 8
    max_staging_bytes: int = 4 * 2**30
    trainer_networks: tuple[str, ...] = ("127.0.0.0/8", "::1/128")

    def __post_init__(self) -> None:
        for name in ("max_world_size", "max_groups", "max_staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for net in self.trainer_networks:
            ipaddress.ip_network(net, strict=False)  # ValueError naming it

    def networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(n, strict=False) for n in self.trainer_networks]


def parse_address(value: object, limits: WeightSyncLimits) -> str:
    """``master_address`` as an IP address in one of ``limits.trainer_networks`` (``localhost``
    is 127.0.0.1), canonical; else :class:`InvalidRequest`. Host names are not resolved (a
    name could resolve anywhere, or differently the next time)."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest("master_address", f"master_address must be an IP address such "
                                               f"as '127.0.0.1', got {_shown(value)}")
    text = "127.0.0.1" if value == "localhost" else value
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise InvalidRequest("master_address", f"master_address must be an IP address such as "
                                               f"'127.0.0.1' (host names are not resolved), "
                                               f"got {_shown(value)}") from None
    if not any(address in net for net in limits.networks()):
        raise InvalidRequest("master_address", f"master_address {address} is not in the trainer "
                                               f"networks this server accepts "
                                               f"{list(limits.trainer_networks)} "
                                               f"(trainer_networks; residency serve "
                                               f"--trainer-networks)")
    return str(address)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


# -- the transport: a receiving process per group --------------------------------------------
# Bytes past each announced tensor that its receive may take (checked: a canary region), and
# the 8-byte pattern written into that region and into each tensor's last 8 bytes before it
# arrives. Fixed, not random: every server rank of a group must receive the same bytes (gloo's
# broadcast tree has ranks forward their whole buffer to others).
_SLACK = 64
_CANARY = torch.tensor(list(b"\xa5Z\x52SDNCY"), dtype=torch.uint8)
_SLACK_FILL = _CANARY.repeat(_SLACK // 8)
_HEADER = _ALIGN  # the buffer's first bytes: the child's count of spans received
_STARTUP_S = 120.0  # the receiving process's start (the fork server's first start imports torch)
_CLOSE_S = 2.0  # a receiving process told to exit is killed after this long
_POLL_S = 0.1  # how often a wait looks at the shutdown and destroy flags


def _slot(nbytes: int) -> int:
    return _align(nbytes + _SLACK)


class _Gone(Exception):
    """The receiving process did not answer (it died, the deadline passed, or it was
    stopped): ``reason`` says which, in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _forget_inherited_fork_server() -> None:
    """In a fork-started child: forget the parent's fork server (the child cannot wait for a
    process that is not its own, and multiprocessing would try); it starts one of its own."""
    server: Any = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is None:
        return
    with contextlib.suppress(OSError, TypeError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


os.register_at_fork(after_in_child=_forget_inherited_fork_server)


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # Where the fork server is not running yet: it imports these once (each child forks ready).
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lifecycle._weight_sync_child"])
    return ctx


def warm_up() -> None:
    """Start the fork server the receiving processes fork from (blocking: it imports torch,
    seconds), so that a first init does not wait for it; ``residency serve`` does this in a
    thread at start when it serves the group routes."""
    _context()
    multiprocessing.forkserver.ensure_running()


class _Receiver:
    """One receiving process (:mod:`lifecycle._weight_sync_child`), its command connection and
    the staging buffer it shares with this process. Every wait for it has a wall-clock
    deadline; past it, or when ``abort()`` gives a reason, the process is killed (a receive
    cannot be cancelled otherwise), which also stops it writing into the buffer."""

    def __init__(self) -> None:  # blocking: starts the process (the fork server, once)
        ctx = _context()
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_child.main, args=(child,), daemon=True,
                                   name="residency-weight-sync")
        try:
            self.process.start()
        finally:
            child.close()
        self.buffer: mmap.mmap | None = None
        self.view: torch.Tensor | None = None
        self.size = 0

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None

    def kill(self) -> None:
        """Stop the process now (signal-safe: one syscall)."""
        pid = self.process.pid
        if pid is not None and self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def ended(self) -> str:
        """How the process ended, in a few words."""
        code = self.process.exitcode
        if code is None:
            return "the receiving process stopped answering"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"the receiving process died ({signal.Signals(-code).name})"
        return f"the receiving process exited ({code})"

    async def ask(self, message: tuple[Any, ...] | None, deadline: float,
                  abort: Callable[[], str | None], fd: int | None = None) -> tuple[Any, ...]:
        """Send ``message`` (and ``fd``), then wait for the answer until ``deadline``
        (``time.monotonic()``); raises :class:`_Gone` (the process killed) otherwise."""
        try:
            if message is not None:
                self.conn.send(message)
            if fd is not None:
                reduction.send_handle(self.conn, fd, self.process.pid)
            while not self.conn.poll():
                why = abort()
                left = deadline - time.monotonic()
                if why is not None or left <= 0:
                    self.kill()
                    raise _Gone(why or "timed out")
                with anyio.move_on_after(min(left, _POLL_S)):
                    await anyio.wait_readable(self.conn.fileno())
            answer: tuple[Any, ...] = self.conn.recv()
            return answer
        except (EOFError, OSError):
            self.kill()
            with anyio.CancelScope(shield=True):
                await to_thread(self.process.join, _CLOSE_S)
            raise _Gone(self.ended()) from None
        except BaseException:  # cancelled: it may be writing into our buffer
            self.kill()
            raise

    async def ensure(self, nbytes: int, deadline: float, abort: Callable[[], str | None]
                     ) -> torch.Tensor:
        """The shared buffer, at least ``nbytes`` (grown when smaller: a new memfd, mapped
        here and there; the old one goes first)."""
        if self.view is None or self.size < nbytes:
            self.view = self.buffer = None
            self.size = 0
            fd = os.memfd_create("residency-weight-sync", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, nbytes)
                buffer = mmap.mmap(fd, nbytes)
                await self.ask(("buffer", nbytes), deadline, abort, fd=fd)
            finally:
                os.close(fd)
            self.buffer, self.size = buffer, nbytes
            self.view = torch.frombuffer(buffer, dtype=torch.uint8)
        return self.view

    def received(self) -> int:
        """How many spans of the last receive the process reported done (it keeps the count
        in the buffer's header; readable after it died)."""
        return 0 if self.view is None else int(self.view[:8].view(torch.int64).item())

    def close(self) -> None:
        """Tell the process to exit; kill it if it has not after a moment (blocking)."""
        if self.alive:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(("exit",))
            self.process.join(_CLOSE_S)
        self.kill()
        self.process.join(_CLOSE_S)
        with contextlib.suppress(ValueError):
            self.process.close()
        self.conn.close()
        self.view = self.buffer = None
        self.size = 0


def _fill(view: torch.Tensor, offset: int, nbytes: int) -> None:
    """The canaries of one span: the tensor's last bytes (up to 8) and the slack after it."""
    tail = min(8, nbytes)
    if tail:
        view[offset + nbytes - tail:offset + nbytes].copy_(_CANARY[8 - tail:])
    view[offset + nbytes:offset + nbytes + _SLACK].copy_(_SLACK_FILL)


def _framing(view: torch.Tensor, offset: int, nbytes: int) -> str | None:
    """What the canaries of one received span say: None (the broadcast was as announced), or
    ``"shorter"`` / ``"longer"``."""
    if not torch.equal(view[offset + nbytes:offset + nbytes + _SLACK], _SLACK_FILL):
        return "longer"
    tail = min(8, nbytes)
    if tail and torch.equal(view[offset + nbytes - tail:offset + nbytes], _CANARY[8 - tail:]):
        return "shorter"
    return None


class WeightSyncTransferFailed(RuntimeError):
    """A broadcast of an update failed, timed out, or was not what the update announced (the
    cause of its rollback; the group is broken)."""


@dataclass(eq=False)
class WeightUpdateGroup:
    """One joined group of this rank, and its bookkeeping."""

    name: str
    backend: str
    master_address: str
    master_port: int
    rank: int
    world_size: int
    staging_device: torch.device
    bucket_bytes: int
    receiver: _Receiver | None
    limits: WeightSyncLimits = field(default_factory=WeightSyncLimits)
    broken: str | None = None
    updates: int = 0
    peak_staging_bytes: int = 0
    joining: bool = False
    gone: str | None = None  # why its waits stop now (destroyed, the server shutting down)
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # one update (or destroy) at a time
    shutdown: Callable[[], str | None] = field(default=lambda: None)

    def state(self) -> WeightUpdateGroupState:
        kept = 0 if self.receiver is None else max(0, self.receiver.size - _HEADER)
        return WeightUpdateGroupState(self.name, self.backend, self.master_address,
                                      self.master_port, self.rank, self.world_size, self.broken,
                                      self.updates, self.bucket_bytes, self.peak_staging_bytes,
                                      kept)

    def abort(self) -> str | None:
        """Why a wait on this group's process stops now, or None."""
        return self.gone or self.shutdown()

    def check(self) -> None:
        if self.broken is not None:
            raise WeightSyncGroupBroken(self.name, self.broken)

    def mark_broken(self, reason: str) -> None:
        """Out of step with the trainer: the receiving process is stopped (its sockets close,
        the trainer's broadcast fails instead of waiting) until a destroy and a new init."""
        if self.broken is None:
            self.broken = reason
            _log.warning(events.WEIGHT_SYNC_BROKEN, group=self.name, reason=reason,
                         group_rank=self.rank)
        if self.receiver is not None:
            self.receiver.kill()

    def _failed(self, why: str) -> WeightSyncTransferFailed:
        self.mark_broken(why)
        return WeightSyncTransferFailed(f"{why}; weight update group {self.name!r} is broken: "
                                        "destroy it and init it again")

    async def staging(self, nbytes: int, deadline: float) -> torch.Tensor:
        """The group's shared staging buffer, at least ``nbytes`` past its header (kept and
        reused from update to update, grown when a larger bucket needs it)."""
        assert self.receiver is not None
        try:
            view = await self.receiver.ensure(_HEADER + nbytes, deadline, self.abort)
        except _Gone as exc:
            raise self._failed(f"the receiving process could not map a staging buffer of "
                               f"{nbytes} bytes: {exc.reason}") from None
        self.peak_staging_bytes = max(self.peak_staging_bytes, self.receiver.size - _HEADER)
        return view

    async def receive(self, specs: Sequence[TensorSpec], buffer: torch.Tensor,
                      deadline: float, progress: _Progress) -> list[torch.Tensor]:
        """Receive each tensor of the trainer's broadcast, in order, into the staging buffer,
        and check its canaries: the tensors, of the announced dtypes and shapes. A failure
        (the trainer left, the deadline passed, a broadcast shorter or longer than announced)
        breaks the group and raises :class:`WeightSyncTransferFailed`."""
        self.check()
        assert self.receiver is not None
        spans: list[tuple[int, int]] = []
        offset = _HEADER
        for spec in specs:
            _fill(buffer, offset, spec.nbytes)
            spans.append((offset, spec.nbytes + _SLACK))
            offset += _slot(spec.nbytes)
        t0 = time.monotonic()

        def where(i: int) -> str:
            spec = specs[i]
            return (f"tensor {progress.received + i + 1}/{progress.total} {spec.name[:100]!r} "
                    f"({spec.dtype}{list(spec.shape)}, {spec.nbytes} bytes)")

        try:
            answer = await self.receiver.ask(("receive", spans, max(0.001, deadline - t0)),
                                             deadline, self.abort)
        except _Gone as exc:
            done = min(self.receiver.received(), len(specs) - 1)
            after = f"{time.monotonic() - t0:.3g} s"
            why = (f"the update's deadline passed at {where(done)} ({after})"
                   if exc.reason == "timed out" else
                   f"the broadcast of {where(done)} failed after {after}: {exc.reason}")
            raise self._failed(why) from None
        if answer[0] != "received":
            _, index, category = answer
            after = f"{time.monotonic() - t0:.3g} s"
            # The child's own wait ends at the same deadline as the server's (whichever
            # notices first): one message for both.
            raise self._failed(f"the update's deadline passed at {where(index)} ({after})"
                               if category == "timed out" else
                               f"the trainer's broadcast of {where(index)} failed after "
                               f"{after}: {category}")
        views = []
        offset = _HEADER
        for i, spec in enumerate(specs):
            wrong = _framing(buffer, offset, spec.nbytes)
            if wrong is not None:
                raise self._failed(f"the trainer's broadcast of {where(i)} was {wrong} than "
                                   f"announced (a dtype, shape or order that differs from the "
                                   f"update's, or a broadcast the update did not announce)")
            views.append(buffer[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape))
            offset += _slot(spec.nbytes)
        progress.received += len(specs)
        return views

    async def drain(self, specs: Sequence[TensorSpec], deadline: float,
                    progress: _Progress) -> None:
        """Receive ``specs``' broadcasts into the receiving process's scratch buffer (one, of
        the largest, freed after; nothing staged here), so the trainer's broadcast completes.
        A tensor over ``max_staging_bytes`` is not drained: the group breaks instead."""
        assert self.receiver is not None
        bound = self.limits.max_staging_bytes
        largest = max(specs, key=lambda s: s.nbytes)
        if largest.nbytes > bound:
            size = (f"{largest.nbytes} bytes" if largest.nbytes < 2**64
                    else f"about 2**{largest.nbytes.bit_length() - 1} bytes")
            self.mark_broken(f"the update announced {largest.name[:100]!r} of {size}, over the "
                             f"{bound} bytes a refused update's tensor may be drained of "
                             f"(max_staging_bytes): it cannot be received here")
            return
        try:
            answer = await self.receiver.ask(
                ("drain", [s.nbytes + _SLACK for s in specs], max(0.001, deadline -
                                                                  time.monotonic())),
                deadline, self.abort)
        except _Gone as exc:
            self.mark_broken(f"draining a refused update's broadcast failed: {exc.reason}")
            return
        if answer[0] != "drained":
            self.mark_broken(f"draining a refused update's broadcast failed at tensor "
                             f"{progress.received + answer[1] + 1}/{progress.total}: "
                             f"{answer[2]}")
            return
        progress.received += len(specs)

    def close(self) -> None:
        """Leave the group (blocking: the receiving process exits)."""
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()


@dataclass
class _Progress:
    """How many of an update's broadcasts this rank has consumed (written, staged, dropped)."""

    total: int
    received: int = 0


# -- staging ---------------------------------------------------------------------------
def _buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indexes of ``specs`` in consecutive buckets of at most ``bucket_bytes`` (each tensor's
    slot: its bytes, the canary slack, aligned)."""
    out: list[list[int]] = []
    size = 0
    for i, spec in enumerate(specs):
        n = _slot(spec.nbytes)
        if out and size + n <= bucket_bytes:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size = n
    return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _host_copies(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [v.to("cpu", copy=True) for v in views]


def _not_received(name: str) -> torch.Tensor:
    raise RuntimeError(f"tensor {name!r} was not received yet")


@dataclass(eq=False)
class DistributedPlan(UpdatePlan):
    """An update whose values arrive over the group while it is written (see the module
    doc): :meth:`write` receives bucket after bucket and prepares each bucket's writes."""

    group: WeightUpdateGroup | None = None
    specs: list[TensorSpec] = field(default_factory=list)
    progress: _Progress = field(default_factory=lambda: _Progress(0))
    deadline: float = 0.0  # time.monotonic() by which the whole broadcast must have arrived
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    lora: list[LoraTarget] | None = None
    staging_bytes: int = 0

    async def write(self, stores: Mapping[str, TensorStore], moves: list[PreparedMove],
                    limiter: anyio.CapacityLimiter | None) -> None:
        assert self.group is not None
        component = self.components[0]
        store = stores[component]
        everything = [list(range(len(self.specs)))]
        buckets = everything if self.lora is not None else _buckets(self.specs, self.bucket_bytes)
        self.staging_bytes = max(sum(_slot(self.specs[i].nbytes) for i in b) for b in buckets)
        buffer = await self.group.staging(self.staging_bytes, self.deadline)
        try:
            for bucket in buckets:
                specs = [self.specs[i] for i in bucket]
                views = await self.group.receive(specs, buffer, self.deadline, self.progress)
                if self.lora is not None:
                    merges = merge_plan(component, self.lora, views.__getitem__)
                    await merges.write(stores, moves, limiter)
                else:
                    moves.append(await store.prepare_write(
                        [WriteSource(s.name, functools.partial(_same, v))
                         for s, v in zip(specs, views, strict=True)], limiter))
        finally:
            del buffer


def plan_distributed(stores: Mapping[str, TensorStore], group: WeightUpdateGroup,
                     specs: list[TensorSpec], target: str, mode: str, scale: LoraScale,
                     bases: LoraBases, progress: _Progress, deadline: float,
                     bucket_bytes: int) -> DistributedPlan:
    """Validate the broadcast's metadata against ``target`` before it starts (blocking: in a
    worker thread; a LoRA merge takes the bases it needs now); raises :class:`UpdateRefused`."""
    if target not in stores:
        raise UpdateRefused(f"Module(s) requested for update not found in pipeline: {[target]}. "
                            f"Available Module(s): {sorted(stores)}")
    store = stores[target]
    bound = group.limits.max_staging_bytes
    plan = DistributedPlan([], (target,), group=group, specs=specs, progress=progress,
                           deadline=deadline, bucket_bytes=min(bucket_bytes, bound))
    if mode == "lora_merge":
        targets = lora_layout(store, target, [(s.name, s.shape, s.dtype) for s in specs], scale)
        staged = sum(_slot(s.nbytes) for s in specs)
        if staged > bound:  # an adapter is received whole
            raise UpdateRefused(f"the LoRA adapter's {staged} bytes are over the {bound} bytes "
                                f"one group may stage (max_staging_bytes); nothing was updated")
        bases.attach_bases(store, targets)
        merged = merge_plan(target, targets, _not_received_index)
        plan.writes, plan.merged, plan.captured = merged.writes, merged.merged, merged.captured
        plan.lora = targets
        return plan
    over = [s for s in specs if _slot(s.nbytes) > bound]
    if over:
        raise UpdateRefused(f"{len(over)} tensor(s) are over the {bound} bytes one group may "
                            f"stage (max_staging_bytes): {[s.name[:100] for s in over[:_SHOWN]]}"
                            f"; nothing was updated")
    unknown: list[str] = []
    faults: list[str] = []
    tied: dict[int, str] = {}
    for spec in specs:
        try:
            slot, _ = store.slot_named(spec.name)
        except KeyError:
            unknown.append(spec.name)
            continue
        live = slot.tensor
        if id(slot) in tied:
            faults.append(f"{spec.name} and {tied[id(slot)]} are one tensor (tied): send it once")
        tied[id(slot)] = spec.name
        if spec.shape != tuple(live.shape):
            faults.append(f"Shape mismatch for {spec.name}: model={tuple(live.shape)}, "
                          f"sent={spec.shape}")
        elif spec.dtype != live.dtype:
            faults.append(f"dtype mismatch for {spec.name}: model={live.dtype}, sent="
                          f"{spec.dtype} (send it in the model's dtype)")
        plan.writes.append(PlannedWrite(target, spec.name,
                                  functools.partial(_not_received, spec.name), int(live.nbytes)))
    if unknown:
        shown = sorted(unknown)
        more = f" (and {len(shown) - _SHOWN} more)" if len(shown) > _SHOWN else ""
        raise UpdateRefused(f"{len(shown)} name(s) match no parameter or buffer of {target}: "
                            f"{shown[:_SHOWN]}{more}; nothing was updated")
    if faults:
        raise UpdateRefused("; ".join(faults[:_SHOWN]) + "; nothing was updated")
    return plan


def _not_received_index(i: int) -> torch.Tensor:
    raise RuntimeError(f"LoRA entry {i} was not received yet")


# -- the groups of one controller -----------------------------------------------------------
class WeightSync:
    """The weight update groups of one controller's rank, by name (bounded by ``limits``)."""

    def __init__(self, limits: WeightSyncLimits | None = None) -> None:
        self.limits = limits or WeightSyncLimits()
        self._groups: dict[str, WeightUpdateGroup] = {}
        self._lock = anyio.Lock()  # the table of groups (never held across a join or a wait)
        self._closing: float | None = None  # time.monotonic() past which waits stop

    def states(self) -> dict[str, WeightUpdateGroupState]:
        return {name: g.state() for name, g in self._groups.items() if not g.joining}

    def shutdown(self, after: float = 0.0) -> None:
        """The server is stopping: joins in progress stop now, and so does every wait on a
        trainer (an update's receive, a drain) ``after`` seconds from now (its update rolls
        back and answers); new inits and updates are refused. Safe in a signal handler (it
        only stores a time)."""
        when = time.monotonic() + max(0.0, after)
        self._closing = when if self._closing is None else min(self._closing, when)

    def _stopping(self) -> str | None:
        if self._closing is not None and time.monotonic() >= self._closing:
            return "the server is shutting down"
        return None

    def _joining_stops(self) -> str | None:
        return "the server is shutting down" if self._closing is not None else None

    def _refuse_when_closing(self, group_name: str) -> None:
        if self._closing is not None:
            raise WeightSyncError(group_name, "the server is shutting down; weight update "
                                              "groups take no new calls")

    def _group(self, name: object) -> WeightUpdateGroup:
        if not isinstance(name, str) or not name:
            raise InvalidRequest("group_name", f"group_name must be a non-empty string, got "
                                               f"{_shown(name)}")
        group = self._groups.get(name)
        if group is None or group.joining:
            raise WeightSyncGroupMissing(name, [n for n, g in self._groups.items()
                                                if not g.joining])
        return group

    async def init(self, *, master_address: object, master_port: object, rank_offset: object,
                   world_size: object, group_name: object, backend: object, rank: int,
                   device: torch.device, timeout: object, bucket_bytes: object
                   ) -> WeightUpdateGroupResult:
        """Join the trainer's group as rank ``rank_offset + rank`` (see
        :meth:`LifecycleController.init_weights_update_group`)."""
        if not isinstance(group_name, str) or not group_name or len(group_name) > 256:
            raise InvalidRequest("group_name", f"group_name must be a non-empty string of at "
                                               f"most 256 characters, got {_shown(group_name)}")
        address = parse_address(master_address, self.limits)
        for name, value in (("master_port", master_port), ("rank_offset", rank_offset),
                            ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequest(name, f"{name} must be an integer, got {_shown(value)}")
        assert isinstance(master_port, int) and isinstance(rank_offset, int) \
            and isinstance(world_size, int)
        if not 0 < master_port < 65536:
            raise InvalidRequest("master_port", f"master_port must be in 1..65535, got "
                                                f"{master_port}")
        if world_size > self.limits.max_world_size:
            raise InvalidRequest("world_size", f"world_size must be at most "
                                               f"{self.limits.max_world_size} (max_world_size), "
                                               f"got {world_size if world_size < 10**12 else 'more'}")
        if not 0 < rank_offset < world_size:
            raise InvalidRequest("rank_offset", f"rank_offset must be in 1..world_size-1 (the "
                                                f"trainer is rank 0), got {rank_offset} with "
                                                f"world_size {world_size}")
        if rank_offset + rank >= world_size:
            raise InvalidRequest("world_size", f"this server rank {rank} would join as rank "
                                               f"{rank_offset + rank}, past world_size "
                                               f"{world_size}")
        chosen = str(backend).lower() if isinstance(backend, str) else backend
        if chosen not in BACKENDS:
            raise InvalidRequest("backend", f"backend must be one of {list(BACKENDS)}, got "
                                            f"{_shown(backend)}")
        assert isinstance(chosen, str)
        if chosen == "nccl" and device.type != "cuda":
            raise InvalidRequest("backend", f"backend 'nccl' needs a CUDA device; this "
                                            f"controller serves {device} (use 'gloo')")
        wait = float(_positive("timeout", timeout))
        bucket = min(int(_positive("bucket_bytes", bucket_bytes, int)),
                     self.limits.max_staging_bytes)
        t0 = time.perf_counter()
        member = rank_offset + rank
        staging = device if chosen == "nccl" else torch.device("cpu")
        group = WeightUpdateGroup(group_name, chosen, address, master_port, member, world_size,
                                  staging, bucket, None, self.limits, joining=True,
                                  shutdown=self._stopping)
        async with self._lock:
            self._refuse_when_closing(group_name)
            old = self._groups.get(group_name)
            if old is not None and old.joining:
                raise InvalidRequest("group_name", f"weight update group {group_name!r} is "
                                                   "being initialized; wait for that init")
            if old is not None and old.broken is None:
                raise InvalidRequest("group_name", f"weight update group {group_name!r} is "
                                                   "already initialized; destroy it first")
            others = len(self._groups) - (old is not None)
            if others >= self.limits.max_groups:
                raise InvalidRequest("group_name", f"this server rank holds "
                                                   f"{self.limits.max_groups} weight update "
                                                   f"group(s), its bound (max_groups): destroy "
                                                   f"one first")
            self._groups[group_name] = group  # reserved: the join runs without the lock
        if old is not None:  # broken: replaced
            await self._drop(old)
        failure = await self._join(group, chosen, wait, device)
        if failure is not None:
            async with self._lock:
                if self._groups.get(group_name) is group:
                    del self._groups[group_name]
            with anyio.CancelScope(shield=True):
                await to_thread(group.close)
            _log.warning(events.WEIGHT_SYNC_BROKEN, group=group_name, reason=failure,
                         group_rank=member)
            return WeightUpdateGroupResult(
                False, f"Failed to initialize weight update group {group_name!r} at "
                       f"{address}:{master_port} as rank {member} of {world_size}: no trainer "
                       f"store completed the rendezvous there within {wait:g} s",
                group_name, seconds=time.perf_counter() - t0)
        group.joining = False
        seconds = time.perf_counter() - t0
        _log.info(events.WEIGHT_SYNC_JOINED, group=group_name, backend=chosen, group_rank=member,
                  world_size=world_size, seconds=round(seconds, 6))
        return WeightUpdateGroupResult(
            True, f"Initialized weight update group {group_name!r} ({chosen}) as rank {member} "
                  f"of {world_size}", group_name, group.state(), seconds)

    async def _join(self, group: WeightUpdateGroup, backend: str, wait: float,
                    device: torch.device) -> str | None:
        """Start the group's receiving process and have it join; None, or why it did not
        (for the log: the answer is one message whatever happened, given at the deadline,
        so that the route tells nothing of what listens where)."""

        def abort() -> str | None:
            return group.gone or self._joining_stops()

        try:
            group.receiver = await to_thread(_Receiver)
        except (OSError, RuntimeError, ValueError) as exc:
            return f"the receiving process could not start ({type(exc).__name__})"
        failure: str | None = None
        try:
            await group.receiver.ask(None, time.monotonic() + _STARTUP_S, abort)  # ("ready",)
            deadline = time.monotonic() + wait
            answer = await group.receiver.ask(
                ("join", group.master_address, group.master_port, group.rank, group.world_size,
                 group.name, backend, wait, str(device)), deadline, abort)
            if answer[0] != "joined":
                failure = f"the join failed: {answer[1]}"
        except _Gone as exc:
            return f"the join stopped: {exc.reason}"
        if failure is not None:  # an early failure waits for the deadline (see above)
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                while abort() is None:
                    await anyio.sleep(_POLL_S)
        return failure

    async def destroy(self, group_name: object) -> WeightUpdateGroupResult:
        """Leave the group (an absent one: success, nothing to do). An update or a join in
        progress on it stops at once (rolled back, or failed)."""
        if not isinstance(group_name, str) or not group_name:
            raise InvalidRequest("group_name", f"group_name must be a non-empty string, got "
                                               f"{_shown(group_name)}")
        t0 = time.perf_counter()
        async with self._lock:
            group = self._groups.get(group_name)
            if group is not None:
                del self._groups[group_name]
        if group is None:
            return WeightUpdateGroupResult(True, f"weight update group {group_name!r} does "
                                           "not exist; nothing to destroy", group_name)
        await self._drop(group)
        _log.info(events.WEIGHT_SYNC_DESTROYED, group=group_name, group_rank=group.rank)
        return WeightUpdateGroupResult(True, f"Destroyed weight update group {group_name!r}",
                                       group_name, seconds=time.perf_counter() - t0)

    async def _drop(self, group: WeightUpdateGroup) -> None:
        """Stop ``group``'s waits and process, then leave it (its update, if any, first ends:
        it sees the process gone and rolls back)."""
        group.gone = "the group was destroyed"
        if group.receiver is not None:
            group.receiver.kill()
        with anyio.CancelScope(shield=True):
            if not group.joining:
                async with group.lock:  # an update in progress ends first (at once: killed)
                    pass
            await to_thread(group.close)

    async def aclose(self) -> None:
        """Leave every group (the controller is closing)."""
        async with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
        for group in groups:
            await self._drop(group)

    async def update(self, run: Callable[[Callable[[], UpdatePlan]], Awaitable[UpdateResult]],
                     stores: Mapping[str, TensorStore], bases: LoraBases,
                     request: Broadcast) -> UpdateResult:
        """An update over the group: ``run(make_plan)`` is the controller's update road
        (lock, vote, gate, two-phase writes); around it the group is kept in step with the
        trainer (see the module doc): a :class:`RefusedBroadcast` is received, dropped,
        then raised."""
        started = time.monotonic()
        async with self._locked(request.group_name) as group, \
                self._in_step(group, started) as step:
            step.specs = None if request.specs is None else list(request.specs)
            step.progress.total = len(request.specs or ())
            step.deadline = started + request.timeout
            if isinstance(request, RefusedBroadcast):
                raise request.error
            specs, progress, deadline = step.specs, step.progress, step.deadline
            assert specs is not None
            bucket = group.bucket_bytes if request.bucket_bytes is None else request.bucket_bytes
            target, mode, scale = request.target_modules[0], request.weight_update_mode, \
                request.scale
            group.updates += 1
            return await run(lambda: plan_distributed(stores, group, specs, target, mode, scale,
                                                      bases, progress, deadline, bucket))

    async def receive_tensors(self, group_name: object, names: object, dtypes: object,
                              shapes: object, *, timeout: object, held: int = 0
                              ) -> list[torch.Tensor]:
        """Receive the trainer's broadcast of ``names`` (in list order) over the group into
        host tensors of the announced dtypes and shapes, written nowhere (a transaction
        stages them: ``/update_weights``'s nccl backend). The same receiver as an update's:
        the group's process, its staging buffer a bucket at a time, the canary checks, one
        deadline ``timeout`` seconds from now. ``held``: bytes the caller already staged
        from this group; with these they must stay within ``max_staging_bytes``, else
        :class:`InvalidRequest` (the broadcast drained, as every refusal's). A failed
        broadcast breaks the group and raises :class:`WeightSyncTransferFailed`."""
        started = time.monotonic()
        async with self._locked(group_name) as group, self._in_step(group, started) as request:
            request.specs = specs = parse_specs(names, dtypes, shapes)
            request.progress.total = len(specs)
            request.deadline = started + float(_positive("timeout", timeout))
            bound = self.limits.max_staging_bytes
            total = held + sum(_slot(s.nbytes) for s in specs)
            if total > bound:
                raise InvalidRequest("names", f"staging these {len(specs)} tensor(s) "
                                              f"would hold {total} bytes ({held} staged "
                                              f"before), over the {bound} bytes one group "
                                              f"may stage (max_staging_bytes): send fewer "
                                              f"or smaller tensors; nothing was staged")
            buckets = _buckets(specs, group.bucket_bytes)
            size = max(sum(_slot(specs[i].nbytes) for i in b) for b in buckets)
            buffer = await group.staging(size, request.deadline)
            out: list[torch.Tensor] = []
            try:
                for bucket in buckets:
                    views = await group.receive([specs[i] for i in bucket], buffer,
                                                request.deadline, request.progress)
                    # copies: the next bucket reuses the buffer (blocking: in a thread)
                    out += await to_thread(functools.partial(
                        _host_copies, views))
            finally:
                del buffer
            return out

    @asynccontextmanager
    async def _locked(self, group_name: object) -> AsyncIterator[WeightUpdateGroup]:
        """The group named, held for one update or receive (refused when absent, broken,
        destroyed while waiting for it, or the server is shutting down)."""
        group = self._group(group_name)
        self._refuse_when_closing(group.name)
        group.check()
        async with group.lock:
            if self._groups.get(group.name) is not group:  # destroyed while we waited
                raise WeightSyncGroupMissing(group.name, list(self._groups))
            group.check()
            yield group

    @asynccontextmanager
    async def _in_step(self, group: WeightUpdateGroup, started: float
                       ) -> AsyncIterator[_Request]:
        """Around an update: whatever the outcome, every broadcast the request announced is
        received (dropped when not written), or the group is marked broken."""
        request = _Request(deadline=started + DEFAULT_TIMEOUT)
        try:
            yield request
        except anyio.get_cancelled_exc_class():
            if request.specs is None or request.progress.received < request.progress.total:
                group.mark_broken("an update was cancelled mid-broadcast")
            raise
        except BaseException:
            await self._drain(group, request)
            raise
        else:
            await self._drain(group, request)

    async def _drain(self, group: WeightUpdateGroup, request: _Request) -> None:
        """Receive the broadcasts the request announced that were not consumed yet (in the
        receiving process, dropped there), so that the trainer's broadcast completes; marks
        the group broken when that cannot be done."""
        if group.broken is not None or group.receiver is None:
            return
        if request.specs is None:
            group.mark_broken("a request whose tensor list could not be read")
            return
        left = request.specs[request.progress.received:]
        if not left:
            return
        t0 = time.perf_counter()
        try:
            await group.drain(left, request.deadline, request.progress)
        except anyio.get_cancelled_exc_class():
            group.mark_broken("an update was cancelled mid-broadcast")
            raise
        if group.broken is None:
            _log.info(events.WEIGHT_SYNC_DRAINED, group=group.name, tensors=len(left),
                      bytes=sum(s.nbytes for s in left),
                      seconds=round(time.perf_counter() - t0, 6), group_rank=group.rank)


@dataclass
class _Request:
    deadline: float
    specs: list[TensorSpec] | None = None
    progress: _Progress = field(default_factory=lambda: _Progress(0))
