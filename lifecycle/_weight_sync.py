"""Weight sync over a trainer's process group: init, update, destroy.

Trainers that do not share a GPU with the server push weights with ``torch.distributed``
(NCCL on GPUs, gloo on the CPU). The protocol is the reference's: the trainer is rank 0 of a
group of ``world_size`` and serves its store (a ``TCPStore`` on ``master_address:master_port``);
each server rank joins as ``rank_offset + its rank``; for each update the trainer broadcasts
every listed tensor, one ``broadcast`` per tensor in list order, while it posts the update's
metadata (names, dtypes, shapes) over HTTP.

The group is a **new** one, never the default process group (the controller may itself run in
one, for its votes): a store of its own and a backend object (``ProcessGroupGloo`` /
``ProcessGroupNCCL``) held here, with the key layout of ``init_custom_process_group`` (the
trainers' helper), so that a trainer using it meets this server in the store. ``backend`` is
passed through (``gloo`` or ``nccl``; gloo is what CI tests, NCCL needs GPUs).

**All or nothing.** An update validates the metadata against the target before the
broadcast starts (names, shapes, dtypes: the model's own dtype is required; LoRA layouts),
then receives the tensors into staging and writes them through the store's two-phase writes,
like every other update: nothing is committed until every tensor arrived, any failure
restores every tensor written (bit for bit, from in-memory backups), and over several server
ranks the collective vote decides. A request of at most ``bucket_bytes`` is received whole
before anything is written; a larger one is received a bucket at a time, each bucket written
undoably before the next arrives.

**Staging is bounded**: one buffer of at most ``bucket_bytes`` (default
:data:`DEFAULT_BUCKET_BYTES`, 256 MiB; a single tensor larger than that gets a buffer of its
size), reused bucket after bucket: on the host for gloo, kept from update to update while the
group lives (sized to the largest bucket received so far; warm pages receive faster), and on
the device for NCCL, allocated per update and dropped after. LoRA adapters (a small fraction
of the weights) are received whole before the merge.

**In step with the trainer, whatever the answer.** A refusal (validation, a sleeping
pipeline, a drain timeout, a refusal on another server rank) cannot stop a broadcast the
trainer has started: the server still receives each listed tensor, into a scratch buffer it
then drops, and answers the refusal once the broadcast is over. The trainer's broadcast
completes, the group stays usable, and the trainer learns of the refusal from the HTTP
answer (the reference's clients run the broadcast and the HTTP call side by side, then check
both). A trainer that dies mid-broadcast is noticed at once (the connection closes), one that
stalls after ``timeout`` seconds without the next tensor: the update fails and rolls back,
and the group is **broken**: every later call on it raises :class:`WeightSyncGroupBroken`
until it is destroyed and initialised again (as gloo and NCCL require). Metadata that cannot
be parsed (so the server cannot tell what the trainer sends) and a cancelled update break it
too.

Blocking ``torch.distributed`` calls (joining, each receive) run in worker threads, one at a
time per group, never abandoned once started (a receive writes into a buffer of ours).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from strategies.protocol import PreparedMove, TensorStore, WriteSource

from . import _events as events
from ._errors import InvalidRequest, WeightSyncGroupBroken, WeightSyncGroupMissing, forget_locals
from ._events import get_logger
from ._lora import LoraBases, LoraScale, LoraTarget, lora_layout, merge_plan, parse_mode, parse_scale
from ._results import UpdateResult, WeightUpdateGroupResult, WeightUpdateGroupState
from ._updates import UpdatePlan, UpdateRefused, _Write

__all__ = ["BACKENDS", "DEFAULT_BUCKET_BYTES", "DEFAULT_TIMEOUT", "TensorSpec", "WeightSync",
           "WeightUpdateGroup", "parse_dtype", "parse_specs"]

_log = get_logger("lifecycle.weight_sync")

#: Largest staging buffer of an update (bytes); a single larger tensor gets its own size.
DEFAULT_BUCKET_BYTES = 256 * 2**20
#: Seconds to join a group, and to wait for each broadcast tensor of an update.
DEFAULT_TIMEOUT = 60.0
BACKENDS = ("gloo", "nccl")
# torch.distributed exports these without declaring them (its stubs): typed as Any here.
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
_PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]
_ALIGN = 64  # bytes: every staged tensor starts on a multiple (dtype views stay legal)
_SHOWN = 20


def _brief(exc: BaseException) -> str:
    """A backend's error message without its source location and boilerplate."""
    text = re.sub(r"^\[[^\]]*\] ", "", str(exc).strip())
    return text.split(". This is typically caused", 1)[0][:300]


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


# -- the transport ------------------------------------------------------------------------
class _Transport:
    """The torch objects of one joined group: its store and its backend."""

    def __init__(self, store: Any, backend: Any) -> None:
        self.store = store
        self.backend = backend

    def broadcast(self, tensor: torch.Tensor, timeout: float) -> None:
        """Receive ``tensor`` from rank 0 (blocking, at most ``timeout`` seconds)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=timeout)
        work = self.backend.broadcast([tensor], opts)
        if not work.wait(timedelta(seconds=timeout)):
            raise RuntimeError(f"broadcast timed out after {timeout:g} s")

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(RuntimeError):  # a failed group: dropping it is all
                shutdown()
        self.backend = self.store = None


def _join(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
          backend: str, timeout: float) -> _Transport:
    """Join the trainer's group (blocking until every rank joined, at most ``timeout``)."""
    td = timedelta(seconds=timeout)
    # The trainer (rank 0) serves the store. Keys as init_custom_process_group lays them out:
    # PrefixStore(group_name) around the rendezvous store, then torch's own group prefix and
    # device prefix (torch.distributed.distributed_c10d._new_process_group_helper).
    tcp = _TCPStore(master_address, master_port, world_size, False, timeout=td)
    store = _PrefixStore(f"{group_name}/", _PrefixStore(group_name, tcp))
    if backend == "gloo":
        made: Any = dist.ProcessGroupGloo(_PrefixStore("cpu/", store), rank, world_size, td)
    else:
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL")
        options = nccl.Options()
        options.is_high_priority_stream = False
        options._timeout = td
        made = nccl(_PrefixStore("cuda/", store), rank, world_size, options)
    made._set_sequence_number_for_group()
    return _Transport(tcp, made)


class WeightSyncTransferFailed(RuntimeError):
    """A broadcast of an update failed or timed out (the cause of its rollback)."""


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
    transport: _Transport | None
    broken: str | None = None
    updates: int = 0
    peak_staging_bytes: int = 0
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # one update (or destroy) at a time
    limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(1))
    _kept: torch.Tensor | None = None  # the host staging buffer, kept between updates

    def state(self) -> WeightUpdateGroupState:
        return WeightUpdateGroupState(self.name, self.backend, self.master_address,
                                      self.master_port, self.rank, self.world_size, self.broken,
                                      self.updates, self.bucket_bytes, self.peak_staging_bytes,
                                      0 if self._kept is None else int(self._kept.numel()))

    def staging(self, nbytes: int) -> torch.Tensor:
        """A staging buffer of at least ``nbytes``. On the host it is kept and reused from
        update to update (grown when a larger bucket needs it, never two at once): warm pages
        receive faster than fresh ones. On the device (NCCL) it is allocated per update and
        dropped after, so that no device memory is held between updates (or while asleep)."""
        if self.staging_device.type != "cpu":
            buffer = _staging(nbytes, self.staging_device)
        else:
            if self._kept is None or self._kept.numel() < nbytes:
                self._kept = None  # the old one goes first
                self._kept = _staging(nbytes, self.staging_device)
            buffer = self._kept
        self.peak_staging_bytes = max(self.peak_staging_bytes, int(buffer.numel()))
        return buffer

    def check(self) -> None:
        if self.broken is not None:
            raise WeightSyncGroupBroken(self.name, self.broken)

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            _log.warning(events.WEIGHT_SYNC_BROKEN, group=self.name, reason=reason,
                         group_rank=self.rank)

    async def receive(self, specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor],
                      timeout: float, progress: _Progress) -> None:
        """Receive each tensor of the trainer's broadcast, in order (worker thread; a receive
        that started is finished before a cancellation goes on). A failure breaks the group
        and raises :class:`WeightSyncTransferFailed`."""
        self.check()
        transport = self.transport
        assert transport is not None

        def run() -> None:
            for spec, tensor in zip(specs, tensors, strict=True):
                t0 = time.perf_counter()
                try:
                    transport.broadcast(tensor, timeout)
                except (RuntimeError, ValueError) as exc:
                    where = (f"tensor {progress.received + 1}/{progress.total} {spec.name!r} "
                             f"({list(spec.shape)}, {spec.dtype})")
                    why = f"the trainer's broadcast of {where} failed after " \
                          f"{time.perf_counter() - t0:.3g} s: {type(exc).__name__}: {_brief(exc)}"
                    self.mark_broken(why)
                    raise WeightSyncTransferFailed(
                        f"{why}; weight update group {self.name!r} is broken: destroy it and "
                        "init it again") from None
                progress.received += 1
            if tensors and tensors[0].device.type == "cuda":  # landed before another stream reads
                torch.cuda.current_stream(tensors[0].device).synchronize()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(run, limiter=self.limiter)

    def close(self) -> None:
        """Leave the group (blocking)."""
        transport, self.transport, self._kept = self.transport, None, None
        if transport is not None:
            transport.close()


@dataclass
class _Progress:
    """How many of an update's broadcasts this rank has consumed (written, staged, dropped)."""

    total: int
    received: int = 0


# -- staging ---------------------------------------------------------------------------
def _buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indexes of ``specs`` in consecutive buckets of at most ``bucket_bytes`` (aligned)."""
    out: list[list[int]] = []
    size = 0
    for i, spec in enumerate(specs):
        n = _align(spec.nbytes)
        if out and size + n <= bucket_bytes:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size = n
    return out


def _views(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """Tensors of ``specs``' dtypes and shapes carved out of one flat uint8 ``buffer``."""
    out = []
    offset = 0
    for spec in specs:
        flat = buffer[offset:offset + spec.nbytes]
        out.append(flat.view(spec.dtype).view(spec.shape))
        offset += _align(spec.nbytes)
    return out


def _staging(nbytes: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _not_received(name: str) -> torch.Tensor:
    raise RuntimeError(f"tensor {name!r} was not received yet")


@dataclass(eq=False)
class DistributedPlan(UpdatePlan):
    """An update whose values arrive over the group while it is written (see the module
    doc): :meth:`write` receives bucket after bucket and prepares each bucket's writes."""

    group: WeightUpdateGroup | None = None
    specs: list[TensorSpec] = field(default_factory=list)
    progress: _Progress = field(default_factory=lambda: _Progress(0))
    timeout: float = DEFAULT_TIMEOUT
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
        self.staging_bytes = max(sum(_align(self.specs[i].nbytes) for i in b) for b in buckets)
        buffer = self.group.staging(self.staging_bytes)
        try:
            for bucket in buckets:
                specs = [self.specs[i] for i in bucket]
                views = _views(buffer, specs)
                await self.group.receive(specs, views, self.timeout, self.progress)
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
                     bases: LoraBases, progress: _Progress, timeout: float,
                     bucket_bytes: int) -> DistributedPlan:
    """Validate the broadcast's metadata against ``target`` before it starts (blocking: in a
    worker thread; a LoRA merge takes the bases it needs now); raises :class:`UpdateRefused`."""
    if target not in stores:
        raise UpdateRefused(f"Module(s) requested for update not found in pipeline: {[target]}. "
                            f"Available Module(s): {sorted(stores)}")
    store = stores[target]
    plan = DistributedPlan([], (target,), group=group, specs=specs, progress=progress,
                           timeout=timeout, bucket_bytes=bucket_bytes)
    if mode == "lora_merge":
        targets = lora_layout(store, target, [(s.name, s.shape, s.dtype) for s in specs], scale)
        bases.attach_bases(store, targets)
        merged = merge_plan(target, targets, _not_received_index)
        plan.writes, plan.merged, plan.captured = merged.writes, merged.merged, merged.captured
        plan.lora = targets
        return plan
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
        plan.writes.append(_Write(target, spec.name,
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
    """The weight update groups of one controller's rank, by name."""

    def __init__(self) -> None:
        self._groups: dict[str, WeightUpdateGroup] = {}
        self._lock = anyio.Lock()  # init and destroy, one at a time
        self._joins = anyio.CapacityLimiter(1)  # the worker thread that joins a group

    def states(self) -> dict[str, WeightUpdateGroupState]:
        return {name: g.state() for name, g in self._groups.items()}

    def _group(self, name: object) -> WeightUpdateGroup:
        if not isinstance(name, str) or not name:
            raise InvalidRequest("group_name", f"group_name must be a non-empty string, got "
                                               f"{name!r}")
        group = self._groups.get(name)
        if group is None:
            raise WeightSyncGroupMissing(name, list(self._groups))
        return group

    async def init(self, *, master_address: object, master_port: object, rank_offset: object,
                   world_size: object, group_name: object, backend: object, rank: int,
                   device: torch.device, timeout: object, bucket_bytes: object
                   ) -> WeightUpdateGroupResult:
        """Join the trainer's group as rank ``rank_offset + rank`` (see
        :meth:`LifecycleController.init_weights_update_group`)."""
        if not isinstance(group_name, str) or not group_name:
            raise InvalidRequest("group_name", f"group_name must be a non-empty string, got "
                                               f"{group_name!r}")
        if not isinstance(master_address, str) or not master_address:
            raise InvalidRequest("master_address", "master_address must be a host name or "
                                                   f"address, got {master_address!r}")
        for name, value in (("master_port", master_port), ("rank_offset", rank_offset),
                            ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequest(name, f"{name} must be an integer, got {value!r}")
        assert isinstance(master_port, int) and isinstance(rank_offset, int) \
            and isinstance(world_size, int)
        if not 0 < master_port < 65536:
            raise InvalidRequest("master_port", f"master_port must be in 1..65535, got "
                                                f"{master_port}")
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
                                            f"{backend!r}")
        assert isinstance(chosen, str)
        if chosen == "nccl" and device.type != "cuda":
            raise InvalidRequest("backend", f"backend 'nccl' needs a CUDA device; this "
                                            f"controller serves {device} (use 'gloo')")
        wait = float(_positive("timeout", timeout))
        bucket = int(_positive("bucket_bytes", bucket_bytes, int))
        t0 = time.perf_counter()
        async with self._lock:
            old = self._groups.get(group_name)
            if old is not None and old.broken is None:
                raise InvalidRequest("group_name", f"weight update group {group_name!r} is "
                                                   "already initialized; destroy it first")
            if old is not None:  # broken: replaced
                async with old.lock:
                    await self._drop(old)
            member = rank_offset + rank
            try:
                with anyio.CancelScope(shield=True):  # a joined group is kept (destroy drops it)
                    transport = await anyio.to_thread.run_sync(
                        functools.partial(_join, master_address, master_port, member,
                                          world_size, group_name, chosen, wait),
                        limiter=self._joins)
            except Exception as exc:  # an unreachable store, peers that did not join in time
                message = (f"Failed to initialize weight update group {group_name!r} at "
                           f"{master_address}:{master_port} as rank {member} of {world_size}: "
                           f"{type(exc).__name__}: {_brief(exc)}")
                forget_locals(exc)  # the frames held the half-made store: its socket closes
                _log.warning(events.WEIGHT_SYNC_BROKEN, group=group_name, reason=message,
                             group_rank=member)
                return WeightUpdateGroupResult(False, message, group_name,
                                               seconds=time.perf_counter() - t0)
            staging = device if chosen == "nccl" else torch.device("cpu")
            group = WeightUpdateGroup(group_name, chosen, master_address, master_port, member,
                                      world_size, staging, bucket, transport)
            self._groups[group_name] = group
        seconds = time.perf_counter() - t0
        _log.info(events.WEIGHT_SYNC_JOINED, group=group_name, backend=chosen, group_rank=member,
                  world_size=world_size, seconds=round(seconds, 6))
        return WeightUpdateGroupResult(
            True, f"Initialized weight update group {group_name!r} ({chosen}) as rank {member} "
                  f"of {world_size}", group_name, group.state(), seconds)

    async def destroy(self, group_name: object) -> WeightUpdateGroupResult:
        """Leave the group (an absent one: success, nothing to do)."""
        if not isinstance(group_name, str) or not group_name:
            raise InvalidRequest("group_name", f"group_name must be a non-empty string, got "
                                               f"{group_name!r}")
        t0 = time.perf_counter()
        async with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                return WeightUpdateGroupResult(True, f"weight update group {group_name!r} does "
                                               "not exist; nothing to destroy", group_name)
            async with group.lock:  # an update in progress finishes first
                await self._drop(group)
        _log.info(events.WEIGHT_SYNC_DESTROYED, group=group_name, group_rank=group.rank)
        return WeightUpdateGroupResult(True, f"Destroyed weight update group {group_name!r}",
                                       group_name, seconds=time.perf_counter() - t0)

    async def _drop(self, group: WeightUpdateGroup) -> None:
        if self._groups.get(group.name) is group:
            del self._groups[group.name]
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(group.close, limiter=group.limiter)

    async def aclose(self) -> None:
        """Leave every group (the controller is closing)."""
        async with self._lock:
            for group in list(self._groups.values()):
                await self._drop(group)

    async def update(self, run: Callable[[Callable[[], UpdatePlan]], Awaitable[UpdateResult]],
                     stores: Mapping[str, TensorStore], bases: LoraBases, *, names: object,
                     dtypes: object, shapes: object, group_name: object,
                     target_modules: object, weight_update_mode: object, lora_alpha: object,
                     lora_rank: object, timeout: object, bucket_bytes: object) -> UpdateResult:
        """An update over the group: ``run(make_plan)`` is the controller's update road
        (lock, vote, gate, two-phase writes); around it the group is kept in step with the
        trainer (see the module doc)."""
        group = self._group(group_name)
        group.check()
        async with group.lock:
            if self._groups.get(group.name) is not group:  # destroyed while we waited
                raise WeightSyncGroupMissing(group.name, list(self._groups))
            group.check()
            return await self._update(run, stores, bases, group, names, dtypes, shapes,
                                      target_modules, weight_update_mode, lora_alpha,
                                      lora_rank, timeout, bucket_bytes)

    async def _update(self, run: Callable[[Callable[[], UpdatePlan]], Awaitable[UpdateResult]],
                      stores: Mapping[str, TensorStore], bases: LoraBases,
                      group: WeightUpdateGroup, names: object, dtypes: object, shapes: object,
                      target_modules: object, weight_update_mode: object, lora_alpha: object,
                      lora_rank: object, timeout: object, bucket_bytes: object) -> UpdateResult:
        async with self._in_step(group) as request:
            request.specs = parse_specs(names, dtypes, shapes)
            request.progress.total = len(request.specs)
            request.timeout = float(_positive("timeout", timeout))
            mode = parse_mode(weight_update_mode)
            scale = parse_scale(mode, lora_alpha, lora_rank)
            bucket = group.bucket_bytes if bucket_bytes is None else \
                int(_positive("bucket_bytes", bucket_bytes, int))
            if isinstance(target_modules, str) or not isinstance(target_modules, Sequence) \
                    or len(target_modules) != 1 or not isinstance(target_modules[0], str):
                raise InvalidRequest("target_modules", f"target_modules must name exactly one "
                                                       f"module, got {target_modules!r}")
            target = target_modules[0]
            specs, progress, wait = request.specs, request.progress, request.timeout
            group.updates += 1
            return await run(lambda: plan_distributed(stores, group, specs, target, mode, scale,
                                                      bases, progress, wait, bucket))

    @asynccontextmanager
    async def _in_step(self, group: WeightUpdateGroup) -> AsyncIterator[_Request]:
        """Around an update: whatever the outcome, every broadcast the request announced is
        received (dropped when not written), or the group is marked broken."""
        request = _Request()
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
        """Receive the broadcasts the request announced that were not consumed yet, into a
        scratch buffer dropped after (one tensor at a time), so that the trainer's broadcast
        completes; marks the group broken when that cannot be done."""
        if group.broken is not None or group.transport is None:
            return
        if request.specs is None:
            group.mark_broken("a request whose tensor list could not be read")
            return
        left = request.specs[request.progress.received:]
        if not left:
            return
        t0 = time.perf_counter()
        largest = max(left, key=lambda s: s.nbytes)
        try:
            scratch = group.staging(_align(largest.nbytes))
        except (RuntimeError, TypeError, OverflowError, MemoryError) as exc:
            # A tensor announced too large to be held (a hostile or mistaken shape): the
            # broadcast cannot be followed, so the group is out of step with the trainer.
            size = (f"{largest.nbytes} bytes" if largest.nbytes < 2**64
                    else f"about 2**{largest.nbytes.bit_length() - 1} bytes")
            group.mark_broken(f"the update announced {largest.name[:100]!r} of {size}, which "
                              f"cannot be received here ({type(exc).__name__})")
            return
        try:
            for spec in left:
                await group.receive([spec], _views(scratch, [spec]), request.timeout,
                                    request.progress)
        except WeightSyncTransferFailed:
            return  # the group is broken: nothing more to keep in step
        except anyio.get_cancelled_exc_class():
            group.mark_broken("an update was cancelled mid-broadcast")
            raise
        finally:
            del scratch
        _log.info(events.WEIGHT_SYNC_DRAINED, group=group.name, tensors=len(left),
                  bytes=sum(s.nbytes for s in left), seconds=round(time.perf_counter() - t0, 6),
                  group_rank=group.rank)


@dataclass
class _Request:
    specs: list[TensorSpec] | None = None
    progress: _Progress = field(default_factory=lambda: _Progress(0))
    timeout: float = DEFAULT_TIMEOUT
