"""What calls return: frozen dataclasses, with ``as_dict()`` where a wire format needs one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Self, TypeVar, overload

from ._phase import Phase
from ._units import gbps

Owner = TypeVar("Owner")
T = TypeVar("T")

__all__ = ["ComponentPlacement", "OccupationResult", "PlacementReport", "ResidencyChange",
           "TensorHashCheck", "UpdateResult", "WeightUpdateGroupResult", "WeightUpdateGroupState"]


@dataclass(frozen=True)
class OccupationResult:
    """The answer to sleep/wake (``release_memory_occupation``/``resume_memory_occupation``)."""

    success: bool
    sleeping: bool
    message: str
    phase: Phase
    bytes_moved: int = 0
    bytes_released: int = 0
    seconds: float = 0.0
    rank: int = 0
    world_size: int = 1
    # The components whose weights a discarding sleep dropped (no host copy; stale at wake).
    discarded: tuple[str, ...] = ()
    # The components this sleep or wake moved (every one but those already where it puts
    # them); and those asleep after it (a partial sleep: the others are awake).
    moved: tuple[str, ...] = ()
    asleep: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        return gbps(self.bytes_moved, self.seconds)

    def as_dict(self) -> dict[str, Any]:
        """The reference's wire format plus our extra fields."""
        return {"success": self.success, "sleeping": self.sleeping, "message": self.message,
                "phase": self.phase.value, "bytes_moved": self.bytes_moved,
                "bytes_released": self.bytes_released, "seconds": self.seconds,
                "rank": self.rank, "world_size": self.world_size,
                "discarded": list(self.discarded), "moved": list(self.moved),
                "asleep": list(self.asleep)}


@dataclass(frozen=True)
class UpdateResult:
    """The answer to a weight update."""

    success: bool
    message: str
    version: int
    updated: tuple[str, ...] = ()
    bytes_written: int = 0
    seconds: float = 0.0
    rolled_back: bool = False  # it failed while writing and every tensor was restored
    # Several ranks: rank -> reason for each rank that failed (the same result on every rank).
    failed_ranks: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    rank: int = 0
    world_size: int = 1
    # The weight version label after the call (the trainer's ``weight_version`` of the last
    # successful update that gave one; unchanged by a failed update).
    weight_version: str | None = None
    # Components still stale after the call (discarded tensors no update wrote yet): count.
    stale: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # The same components (and any asleep file-backed one that is stale) with the first
    # three names of their stale tensors: what a success's message names.
    stale_tensors: Mapping[str, tuple[int, tuple[str, ...]]] = field(
        default_factory=lambda: MappingProxyType({}))
    # A rolled-back update: the class name of each error it was rolled back for (this
    # rank's and, several ranks, every failed rank's), sorted; e.g. WeightSyncTransferFailed
    # (the trainer's broadcast failed), LoraMergeNotFinite (what the client sent).
    causes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"success": self.success, "message": self.message, "version": self.version,
                "updated": list(self.updated), "bytes_written": self.bytes_written,
                "seconds": self.seconds, "rolled_back": self.rolled_back,
                "failed_ranks": {str(r): why for r, why in self.failed_ranks.items()},
                "rank": self.rank, "world_size": self.world_size,
                "weight_version": self.weight_version, "stale": dict(self.stale),
                "stale_tensors": {n: [k, list(names)]
                                  for n, (k, names) in self.stale_tensors.items()},
                "causes": list(self.causes)}


@dataclass(frozen=True)
class ComponentPlacement:
    """Where one component's bytes are."""

    mode: str
    device_bytes: int
    host_bytes: int
    pinned_bytes: int
    total_bytes: int
    # Host bytes of the pristine base weights kept for LoRA merges (see lifecycle._lora).
    lora_base_bytes: int = 0
    # Tensors discarded by a sleep and not written by an update since (see lifecycle._discard).
    stale_tensors: int = 0
    # Bytes whose only copy while asleep is the checkpoint files they were loaded from (no
    # host copy held: strategies._filebacked).
    file_backed_bytes: int = 0
    # Why its host copies are pinned or pageable (the pin budget's priorities).
    host_tier: str = ""

    @property
    def pageable_bytes(self) -> int:
        """Host bytes not page-locked (``host_bytes`` less the pinned part; a pinned
        buffer's footprint rounds up to pages, so never below 0)."""
        return max(0, self.host_bytes - self.pinned_bytes)


class Computed(Generic[Owner, T]):
    """A read-only attribute computed from the object it is read on (``compute(obj)``), typed
    as what ``compute`` returns: a property given as a function where it is declared."""

    def __init__(self, compute: Callable[[Owner], T], doc: str | None = None) -> None:
        self._compute = compute
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...
    @overload
    def __get__(self, obj: Owner, owner: type) -> T: ...
    def __get__(self, obj: Owner | None, owner: type) -> Self | T:
        return self if obj is None else self._compute(obj)


def _total(name: str) -> Computed[PlacementReport, int]:
    """A :class:`PlacementReport` total: the components' field ``name``, summed."""
    return Computed(lambda report: sum(int(getattr(c, name)) for c in report.components.values()))


@dataclass(frozen=True)
class PlacementReport:
    """Where the pipeline's bytes are, per component and in total."""

    phase: Phase
    components: Mapping[str, ComponentPlacement] = field(
        default_factory=lambda: MappingProxyType({}))
    device_allocated: int | None = None  # the allocator's own count (CUDA), None on CPU
    rank: int = 0
    world_size: int = 1
    # High-water mark of device bytes the library held (copies in flight included) since
    # attach or ``reset_peak()``; on CUDA also the allocator's own (``max_memory_allocated``).
    # History, not placement: two reports of the same placement compare equal without them.
    peak_device_bytes: int = field(default=0, compare=False)
    allocator_peak_bytes: int | None = field(default=None, compare=False)
    # The label of the weights served (the trainer's ``weight_version``), if one was given.
    weight_version: str | None = field(default=None, compare=False)
    # The caching allocator's reserved bytes (its segments, used or cached) now and their
    # peak since attach or ``reset_peak()`` (CUDA, and the simulated GPU); None on CPU layers.
    reserved_bytes: int | None = field(default=None, compare=False)
    reserved_peak_bytes: int | None = field(default=None, compare=False)
    # The host budgets (None: no cap) and every host byte the device layer holds now, by
    # kind (mirrors, and transient buffers of a move in flight), and their peak.
    host_budget: int | None = field(default=None, compare=False)
    pin_budget: int | None = field(default=None, compare=False)
    host_held_pinned: int = field(default=0, compare=False)
    host_held_pageable: int = field(default=0, compare=False)
    peak_host_bytes: int = field(default=0, compare=False)
    host_budget_source: str = field(default="none", compare=False)

    # Totals over the components.
    device_bytes = _total("device_bytes")
    host_bytes = _total("host_bytes")
    pinned_bytes = _total("pinned_bytes")
    lora_base_bytes = _total("lora_base_bytes")
    pageable_bytes = _total("pageable_bytes")
    file_backed_bytes = _total("file_backed_bytes")

    @property
    def host_held_bytes(self) -> int:
        """Every host byte the device layer holds now, pinned and pageable."""
        return self.host_held_pinned + self.host_held_pageable

    @property
    def host_left(self) -> int | None:
        """Host bytes still free under the host budget (None: no cap)."""
        return None if self.host_budget is None else max(0, self.host_budget
                                                         - self.host_held_bytes)

    @property
    def pin_left(self) -> int | None:
        """Pinned bytes still free under the pin budget (None: no cap)."""
        return None if self.pin_budget is None else max(0, self.pin_budget
                                                        - self.host_held_pinned)

    def host_memory(self) -> dict[str, Any]:
        """The host bytes by kind, the budgets and what is left (``/state``'s ``host``)."""
        return {"pinned_bytes": self.pinned_bytes, "pageable_bytes": self.pageable_bytes,
                "file_backed_bytes": self.file_backed_bytes,
                "held_pinned_bytes": self.host_held_pinned,
                "held_pageable_bytes": self.host_held_pageable,
                "peak_bytes": self.peak_host_bytes,
                "host_budget": self.host_budget, "pin_budget": self.pin_budget,
                "host_left": self.host_left, "pin_left": self.pin_left,
                "source": self.host_budget_source}

    @property
    def stale(self) -> dict[str, int]:
        """Stale components (their discarded tensors not updated yet): how many tensors."""
        return {n: c.stale_tensors for n, c in self.components.items() if c.stale_tensors}


@dataclass(frozen=True)
class RankChecksums:
    """Every rank's checksum of every component (:meth:`LifecycleController.
    weights_checksum_across_ranks`): ``per_rank[component][rank] -> sha256``."""

    per_rank: Mapping[str, Mapping[int, str]]

    def disagreeing(self) -> dict[str, list[int]]:
        """Components whose ranks do not all agree, with the ranks that differ from the
        most common checksum (a replicated component should have none)."""
        out: dict[str, list[int]] = {}
        for name, sums in self.per_rank.items():
            values = list(sums.values())
            common = max(set(values), key=values.count)
            odd = sorted(r for r, s in sums.items() if s != common)
            if odd:
                out[name] = odd
        return out

    @property
    def agree(self) -> bool:
        return not self.disagreeing()


@dataclass(frozen=True)
class ResidencyChange:
    """What :meth:`LifecycleController.set_residency` did: which components changed mode
    (``{name: (old, new)}``), the bytes copied, and, when validated with a request, the
    measured peak and latency against the prediction (and why it was undone, if it was)."""

    success: bool
    message: str
    config: str
    changed: Mapping[str, tuple[str, str]] = field(default_factory=lambda: MappingProxyType({}))
    bytes_copied: int = 0
    seconds: float = 0.0
    validated: bool = False
    measured_peak_bytes: int | None = None
    measured_seconds: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_seconds: float | None = None
    rolled_back: bool = False
    # The device peak predicted for applying the change (old and new placements held
    # together inside a transaction: lifecycle._handoff), from the layout held before it.
    transient_peak_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"success": self.success, "message": self.message, "config": self.config,
                "transient_peak_bytes": self.transient_peak_bytes,
                "changed": {n: list(v) for n, v in self.changed.items()},
                "bytes_copied": self.bytes_copied, "seconds": self.seconds,
                "validated": self.validated, "measured_peak_bytes": self.measured_peak_bytes,
                "measured_seconds": self.measured_seconds,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_seconds": self.predicted_seconds, "rolled_back": self.rolled_back}


@dataclass(frozen=True)
class TensorHashCheck:
    """The answer to :meth:`LifecycleController.check_tensor_hashes`: every tensor whose
    SHA-256 (the reference clients' per-tensor hash) differs from the expected one, and every
    expected name the component does not have."""

    success: bool
    message: str
    target_module: str
    checked: int
    mismatched: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The reference's ``{success, message}`` plus the names."""
        return {"success": self.success, "message": self.message,
                "target_module": self.target_module, "checked": self.checked,
                "mismatched": list(self.mismatched), "missing": list(self.missing)}


@dataclass(frozen=True)
class WeightUpdateGroupState:
    """One weight update group of this rank (:attr:`LifecycleController.
    weight_update_groups`): where it joined, as which rank, and whether it broke."""

    group_name: str
    backend: str
    master_address: str
    master_port: int
    rank: int  # this server rank's rank in the group (rank_offset + its own rank)
    world_size: int
    broken: str | None = None  # why it broke; it must be destroyed and initialised again
    updates: int = 0  # updates received over it (committed or not)
    bucket_bytes: int = 0  # the default bucket of its updates
    peak_staging_bytes: int = 0  # the most staging its updates held at once
    staging_bytes: int = 0  # host staging kept now (between updates, for the next one)

    def as_dict(self) -> dict[str, Any]:
        return {"group_name": self.group_name, "backend": self.backend,
                "master_address": self.master_address, "master_port": self.master_port,
                "rank": self.rank, "world_size": self.world_size, "broken": self.broken,
                "updates": self.updates, "bucket_bytes": self.bucket_bytes,
                "peak_staging_bytes": self.peak_staging_bytes,
                "staging_bytes": self.staging_bytes}


@dataclass(frozen=True)
class WeightUpdateGroupResult:
    """The answer to ``init_weights_update_group`` / ``destroy_weights_update_group``."""

    success: bool
    message: str
    group_name: str
    group: WeightUpdateGroupState | None = None  # after an init that joined
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The reference's ``{success, message}`` plus the group."""
        return {"success": self.success, "message": self.message,
                "group_name": self.group_name, "seconds": self.seconds,
                "group": None if self.group is None else self.group.as_dict()}
