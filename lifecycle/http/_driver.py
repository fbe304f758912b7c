"""What the HTTP handlers call: a driver between the routes and the controller(s).

:class:`LocalDriver` calls this process's controller. A multi-rank server (``residency serve
--nproc``) uses :class:`lifecycle.http._ranks.RankDriver`, which runs each call on every rank
and combines the answers. The handlers do not know which one they have.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from strategies.protocol import to_thread

from .. import (
    LifecycleController,
    OccupationResult,
    Phase,
    TensorHashCheck,
    UpdateResult,
    WeightsDiscarded,
    WeightUpdateGroupResult,
)
from .._discard import Discard
from .._weight_sync import Broadcast
from ..payload import FD_TIMEOUT, TransportError, decode_base64, decode_modules
from ._checker import WeightsChecker
from ._wire import Decoded, TensorRequest, WireRefused, decode_entry, device_uuid, pick_entry

__all__ = ["DISCARDED", "Driver", "Generate", "LocalDriver", "RanksUnavailable", "Staging",
           "Upload"]

#: The process group vLLM's nccl weight transfer joins (lifecycle.http._transfer).
TRANSFER_GROUP = "vllm_weight_transfer"

# A pipeline's generation: (controller, request body) -> JSON-able answer.
Generate = Callable[[LifecycleController, Mapping[str, Any]], Awaitable[Mapping[str, Any]]]


#: ``/get_weights_checksum``'s answer for a stale component (its weights discarded by a release,
#: not all written by updates since): it has no checksum to give.
DISCARDED = "discarded"


class RanksUnavailable(RuntimeError):
    """Some rank of a multi-rank server is dead or unreachable (answered with 503)."""


@dataclass
class Upload:
    """An ``/update_weights_from_tensor`` request: the base64 text of each entry (views of
    the request's body where it can be: decoding one overwrites it), the UUID of each entry
    (``payload_gpu_uuids``) if given, and the rest of the request."""

    entries: Sequence[str | memoryview]
    uuids: Sequence[str] | None
    request: TensorRequest
    fd_timeout: float = FD_TIMEOUT


Modules = dict[str, list[tuple[str, torch.Tensor]]]


def split_by_module(names: Sequence[str], tensors: Sequence[torch.Tensor],
                    components: Mapping[str, Any]) -> Modules:
    """``{module: [(name relative to it, tensor), ...]}``: a name ``module.tensor`` is that
    module's, a name without a module prefix the transformer's."""
    out: Modules = {}
    for name, tensor in zip(names, tensors, strict=True):
        head, _, rest = name.partition(".")
        module = head if rest and head in components else "transformer"
        out.setdefault(module, []).append((name.removeprefix(f"{module}."), tensor))
    return out


def decode_ipc(info: Mapping[str, Any], components: Mapping[str, Any]) -> Modules:
    """vLLM's ipc ``update_info``: ``ipc_handles_pickled`` (base64 of the pickled ``[(name,
    tensor), ...]``, read by the tensor-upload path) split by module; the optional ``names``,
    ``dtype_names`` and ``shapes`` checked against it. Raises :class:`WireRefused`."""
    payload = info.get("ipc_handles_pickled")  # text; relayed to another rank: its bytes
    if not isinstance(payload, str | memoryview):
        raise WireRefused("update_info.ipc_handles_pickled is required for the ipc backend: "
                          "base64 of the pickled [(name, tensor), ...]")
    try:
        bare = decode_modules(decode_base64(payload), None, ("transformer",))["transformer"]
    except TransportError as exc:
        raise WireRefused(f"Failed to deserialize update_info.ipc_handles_pickled: {exc}"
                          ) from None
    names = [n for n, _ in bare]
    for key, got in (("names", names), ("dtype_names",
                                        [str(t.dtype).removeprefix("torch.") for _, t in bare]),
                     ("shapes", [list(t.shape) for _, t in bare])):
        want = info.get(key)
        if want is not None:
            want = [str(w).removeprefix("torch.") for w in want] if key == "dtype_names" else want
            if want != got:
                raise WireRefused(f"update_info.{key} does not match the tensors sent")
    return split_by_module(names, [t for _, t in bare], components)


@dataclass
class Staging:
    """What one rank staged for the weight-transfer transaction ``serial`` (vLLM's
    ``/start_weight_update`` .. ``/finish_weight_update``, lifecycle.http._transfer): host
    tensors by module, written nowhere until the commit. ``dropped``: the last transaction
    dropped here; what arrives for it later (a receive that outlived its transaction) is
    thrown away, never staged into the next one."""

    serial: int = 0
    dropped: int = 0
    modules: Modules = field(default_factory=dict)

    def add(self, serial: int, modules: Modules) -> dict[str, int] | None:
        """Stage ``modules`` for transaction ``serial``; the count staged per module, or None
        when that transaction was dropped."""
        if serial <= self.dropped:
            return None
        if serial != self.serial:
            self.serial, self.modules = serial, {}
        for module, named in modules.items():
            self.modules.setdefault(module, []).extend(named)
        return self.counts(serial)

    def counts(self, serial: int) -> dict[str, int]:
        return {m: len(v) for m, v in self.modules.items()} if serial == self.serial else {}

    def held(self, serial: int) -> int:
        """Bytes staged for ``serial``."""
        return sum(t.nbytes for named in self.modules.values() for _, t in named) \
            if serial == self.serial else 0

    def take(self, serial: int) -> Modules:
        """Everything staged for ``serial``, no longer staged."""
        out = self.modules if serial == self.serial else {}
        self.drop(serial)
        return out

    def drop(self, serial: int) -> None:
        self.dropped = max(self.dropped, serial)
        if self.serial <= serial:
            self.modules = {}


class Driver:
    """The calls the routes make (see :class:`LocalDriver` for their meaning)."""

    ctl: LifecycleController

    @property
    def world_size(self) -> int:
        """Server ranks that run every call."""
        raise NotImplementedError

    async def sleep(self, discard: Discard = None, components: Sequence[str] | None = None
                    ) -> OccupationResult:
        """A release: ``discard`` as the body gave it (None: the controller's
        ``discard_on_release``), JSON-able and already checked against the components;
        ``components``: those released (None: all)."""
        raise NotImplementedError

    async def wake(self, components: Sequence[str] | None = None) -> OccupationResult:
        raise NotImplementedError

    async def set_weight_version(self, label: str) -> None:
        """Name the weights served ``label`` (``/update_weight_version``), on every rank."""
        raise NotImplementedError

    async def weights_checker(self, action: str) -> tuple[bool, str]:
        """``/weights_checker``'s ``action`` on every rank: ``(success, message)``."""
        raise NotImplementedError

    async def update_from_disk(self, path: str, targets: Sequence[str] | None, *,
                               weight_version: str | None = None,
                               flush_cache: bool = False) -> UpdateResult:
        raise NotImplementedError

    async def update_from_upload(self, upload: Upload) -> UpdateResult:
        raise NotImplementedError

    async def checksum(self, names: Sequence[str]) -> dict[str, str]:
        """The checksum of each of ``names`` the pipeline has; :data:`DISCARDED` for a
        stale one."""
        raise NotImplementedError

    async def check_tensor_hashes(self, target: str, expected: Mapping[str, str]
                                  ) -> TensorHashCheck:
        raise NotImplementedError

    async def init_weights_update_group(self, args: Mapping[str, Any]
                                        ) -> WeightUpdateGroupResult:
        raise NotImplementedError

    async def update_from_broadcast(self, request: Broadcast) -> UpdateResult:
        raise NotImplementedError

    async def destroy_weights_update_group(self, group_name: str) -> WeightUpdateGroupResult:
        raise NotImplementedError

    # vLLM's weight transfer (lifecycle.http._transfer): every rank stages the same tensors
    # for one transaction, and writes them at its commit as one update, or drops them.

    async def stage_ipc(self, serial: int, info: Mapping[str, Any]) -> dict[str, int] | None:
        """Stage an ipc ``update_info`` for transaction ``serial`` on every rank (all or
        none: a rank that cannot decode it is named in the :class:`WireRefused`); the count
        staged per module, or None when the transaction was dropped meanwhile."""
        raise NotImplementedError

    async def stage_received(self, serial: int, names: Sequence[str], dtypes: Sequence[str],
                             shapes: Sequence[Sequence[int]], timeout: float
                             ) -> dict[str, int] | None:
        """Receive the trainer's broadcast over the transfer group on every rank and stage
        it (as :meth:`stage_ipc`); raises ``ResidencyError``, ``WeightSyncTransferFailed`` or
        :class:`WireRefused` naming the ranks where it failed (none staged it)."""
        raise NotImplementedError

    async def staged(self, serial: int) -> dict[str, int]:
        """The count staged per module for ``serial`` (rank 0's: every rank stages alike)."""
        raise NotImplementedError

    async def commit_staged(self, serial: int, weight_version: str | None) -> UpdateResult:
        """Write what transaction ``serial`` staged, as one update on every rank (every
        module on every rank, or nothing anywhere); nothing stays staged."""
        raise NotImplementedError

    async def drop_staged(self, serial: int) -> None:
        """Drop what transaction ``serial`` staged, on every rank."""
        raise NotImplementedError

    @property
    def can_generate(self) -> bool:
        raise NotImplementedError

    async def generate(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        raise NotImplementedError

    async def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def unavailable(self) -> str | None:
        """Why the server cannot serve at all (503 on /health), or None."""
        raise NotImplementedError


def local_state(ctl: LifecycleController) -> dict[str, Any]:
    """One controller's phase, versions, device and placement, as /state shows it."""
    report = ctl.report()
    return {
        "pid": os.getpid(),
        "phase": ctl.phase.value, "transition": ctl.transition, "in_flight": ctl.in_flight,
        "asleep": sorted(ctl.asleep),
        "weights_version": ctl.weights_version, "weight_version": ctl.weight_version_label,
        "device": str(ctl.device), "device_uuid": device_uuid(ctl.device, ctl.rank),
        "rank": report.rank, "world_size": report.world_size,
        "device_bytes": report.device_bytes, "host_bytes": report.host_bytes,
        "lora_base_bytes": report.lora_base_bytes,
        "stale": report.stale,
        "host": report.host_memory(),
        "components": {n: {"mode": c.mode, "device_bytes": c.device_bytes,
                           "host_bytes": c.host_bytes, "pinned_bytes": c.pinned_bytes,
                           "pageable_bytes": c.pageable_bytes,
                           "file_backed_bytes": c.file_backed_bytes, "host_tier": c.host_tier,
                           "total_bytes": c.total_bytes, "stale_tensors": c.stale_tensors}
                       for n, c in report.components.items()},
        "weight_update_groups": {n: g.as_dict() for n, g in ctl.weight_update_groups.items()}}


class LocalDriver(Driver):
    """This process's controller, called directly."""

    def __init__(self, ctl: LifecycleController, generate: Generate | None) -> None:
        self.ctl = ctl
        self._generate = generate
        self._uuid: str | None = None
        self._checker = WeightsChecker()
        self.staging = Staging()

    @property
    def world_size(self) -> int:
        return 1

    @property
    def device_uuid(self) -> str:
        """This rank's "GPU UUID" (see lifecycle.http._wire)."""
        if self._uuid is None:
            self._uuid = device_uuid(self.ctl.device, self.ctl.rank)
        return self._uuid

    async def sleep(self, discard: Discard = None, components: Sequence[str] | None = None
                    ) -> OccupationResult:
        return await self.ctl.release_memory_occupation(discard, components=components)

    async def wake(self, components: Sequence[str] | None = None) -> OccupationResult:
        return await self.ctl.wake(components=components)

    async def set_weight_version(self, label: str) -> None:
        self.ctl.weight_version_label = label

    async def weights_checker(self, action: str) -> tuple[bool, str]:
        return await self._checker.handle(self.ctl, action)

    async def update_from_disk(self, path: str, targets: Sequence[str] | None, *,
                               weight_version: str | None = None,
                               flush_cache: bool = False) -> UpdateResult:
        return await self.ctl.update_weights_from_disk(
            path, targets, weight_version=weight_version, flush_cache=flush_cache)

    async def update_from_upload(self, upload: Upload) -> UpdateResult:
        index = pick_entry(len(upload.entries), upload.uuids, 0, 1, self.device_uuid)
        named = await self.decode(upload.entries[index], index, upload.request,
                                  upload.fd_timeout)
        return await self.update_decoded(named, upload.request)

    async def decode(self, text: str | bytes | memoryview, index: int, request: TensorRequest,
                     fd_timeout: float) -> Decoded:
        """Entry ``index`` decoded (in a worker thread) into the named tensors of each
        target; raises :class:`~lifecycle.http._wire.WireRefused`."""
        return await to_thread(functools.partial(
            decode_entry, text, index, request, self.ctl.components, fd_timeout=fd_timeout))

    async def update_decoded(self, named: Decoded, request: TensorRequest) -> UpdateResult:
        if len(named) > 1:  # several modules: one update, all or nothing
            return await self.ctl.update_weights_from_modules(
                named, weight_version=request.weight_version, flush_cache=request.flush_cache)
        return await self.ctl.update_weights_from_tensors(named[request.targets[0]],
                                                          request.targets[0],
                                                          **request.options())

    async def checksum(self, names: Sequence[str]) -> dict[str, str]:
        known = [n for n in names if n in self.ctl.components]
        stale = {n for n in known if n in self.ctl.stale}
        while True:
            try:
                sums = await self.ctl.weights_checksum_async([n for n in known if n not in stale])
            except WeightsDiscarded as exc:  # a release discarded it since we looked
                stale |= set(exc.components)
                continue
            return {n: DISCARDED if n in stale else sums[n] for n in known}

    async def check_tensor_hashes(self, target: str, expected: Mapping[str, str]
                                  ) -> TensorHashCheck:
        return await self.ctl.check_tensor_hashes(target, expected)

    async def init_weights_update_group(self, args: Mapping[str, Any]
                                        ) -> WeightUpdateGroupResult:
        return await self.ctl.init_weights_update_group(**args)

    async def update_from_broadcast(self, request: Broadcast) -> UpdateResult:
        return await self.ctl.update_from_broadcast(request)

    async def destroy_weights_update_group(self, group_name: str) -> WeightUpdateGroupResult:
        return await self.ctl.destroy_weights_update_group(group_name)

    async def decode_ipc(self, info: Mapping[str, Any]) -> Modules:
        """An ipc ``update_info`` decoded (in a worker thread): see :func:`decode_ipc`."""
        return await to_thread(functools.partial(
            decode_ipc, info, self.ctl.components))

    async def receive(self, serial: int, names: Sequence[str], dtypes: Sequence[str],
                      shapes: Sequence[Sequence[int]], timeout: float) -> Modules:
        """The trainer's broadcast received into host tensors (lifecycle._weight_sync: its
        canaries, ``timeout``, the group's staging bound counting what ``serial`` holds)."""
        tensors = await self.ctl.receive_from_distributed(
            names, dtypes, shapes, TRANSFER_GROUP, timeout=timeout,
            held=self.staging.held(serial))
        return split_by_module(names, tensors, self.ctl.components)

    async def stage_ipc(self, serial: int, info: Mapping[str, Any]) -> dict[str, int] | None:
        return self.staging.add(serial, await self.decode_ipc(info))

    async def stage_received(self, serial: int, names: Sequence[str], dtypes: Sequence[str],
                             shapes: Sequence[Sequence[int]], timeout: float
                             ) -> dict[str, int] | None:
        return self.staging.add(serial, await self.receive(serial, names, dtypes, shapes,
                                                           timeout))

    async def staged(self, serial: int) -> dict[str, int]:
        return self.staging.counts(serial)

    async def commit_staged(self, serial: int, weight_version: str | None) -> UpdateResult:
        modules = self.staging.take(serial)
        return await self.ctl.update_weights_from_modules(modules, weight_version=weight_version)

    async def drop_staged(self, serial: int) -> None:
        self.staging.drop(serial)

    @property
    def can_generate(self) -> bool:
        return self._generate is not None

    async def generate(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        assert self._generate is not None
        return await self._generate(self.ctl, body)

    async def state(self) -> dict[str, Any]:
        return local_state(self.ctl)

    def unavailable(self) -> str | None:
        return "no pipeline attached" if self.ctl.phase is Phase.UNINITIALIZED else None
