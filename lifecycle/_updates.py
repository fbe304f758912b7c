"""Weight updates: validate everything first, then write through the stores' two-phase
writes (:meth:`strategies.TensorStore.prepare_write`), all or nothing.

A plan is built first and nothing is written until every check passed: target components
exist, every target has weight files, every key names a parameter or buffer (the reference
silently ignores unknown keys: that is how stale weights get served), every shape matches,
and names tied to one tensor carry one value. Dtype differences are cast to the parameter's
dtype and reported. The controller then prepares one write per component on the road every
transition travels: a failure or a cancellation undoes every write, from in-memory backups.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch
from safetensors import SafetensorError, safe_open

from strategies.protocol import (
    FileRegion,
    PreparedMove,
    TensorStore,
    WriteSource,
    safetensors_regions,
)

from . import _events as events
from ._errors import InvalidRequest, TransitionFailed
from ._events import get_logger
from ._results import UpdateResult

__all__ = ["PlannedWrite", "UpdatePlan", "UpdateRefused", "checksum", "plan_from_disk",
           "plan_from_tensors", "version_label"]

_log = get_logger("lifecycle.updates")

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class UpdateRefused(ValueError):
    """An update failed validation; nothing was written."""


@dataclass(eq=False)
class PlannedWrite:
    """One tensor an :class:`UpdatePlan` writes: its component and name, how to load the new
    value (``load``), its size, and the file region it is read from (``region``: a write the
    device layer reads straight from a file), if any. Planned by this module, by LoRA merges
    (:mod:`lifecycle._lora`) and by process-group updates (:mod:`lifecycle._weight_sync`)."""

    component: str
    name: str
    load: Callable[[], torch.Tensor]
    nbytes: int
    region: FileRegion | None = None


@dataclass(eq=False)
class UpdatePlan:
    """Validated writes, grouped by nothing: applied in order, all or none."""

    writes: list[PlannedWrite]
    components: tuple[str, ...]
    casts: list[str] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)  # open safetensors files
    # LoRA merges (lifecycle._lora): (component, tensor) written as base + adapter, whose kept
    # base stays; and the bases first taken by this update, kept from its commit on.
    merged: set[tuple[str, str]] = field(default_factory=set)
    captured: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.writes)

    def sources(self, component: str) -> list[WriteSource]:
        """What to write into ``component``, in plan order."""
        return [WriteSource(w.name, w.load, w.region) for w in self.writes
                if w.component == component]

    async def write(self, stores: Mapping[str, TensorStore], moves: list[PreparedMove],
                    limiter: anyio.CapacityLimiter | None) -> None:
        """Prepare every write (undoably), appending the prepared moves to ``moves`` as they
        are made (so that a failure undoes those already made): one per component."""
        for name in self.components:
            sources = self.sources(name)
            if sources:
                moves.append(await stores[name].prepare_write(sources, limiter))

    def applied(self, version: int, written: int, seconds: float) -> UpdateResult:
        """The answer once this plan's writes committed as weights version ``version``."""
        return UpdateResult(True, f"updated {len(self.writes)} tensor(s) of "
                            f"{list(self.components)} to version {version}", version,
                            self.components, written, seconds)

    @staticmethod
    def undone(failed: TransitionFailed, version: int) -> UpdateResult:
        """The answer when the writes failed and were rolled back (``version`` unchanged)."""
        return UpdateResult(False, f"update failed and was rolled back; weights are unchanged: "
                            f"{type(failed.cause).__name__}: {failed.cause}", version,
                            rolled_back=True, failed_ranks=failed.failed_ranks,
                            causes=_causes(failed))

    def close(self) -> None:
        for h in self.handles:
            h.__exit__(None, None, None)
        self.handles.clear()
        self.captured.clear()  # kept by the commit that registered them, if any


def _causes(failed: TransitionFailed) -> tuple[str, ...]:
    """The class names of the errors an update was rolled back for: this rank's cause, and
    every failed rank's (the ``cause`` of its :class:`~lifecycle._errors.RankFailure`; a rank
    that did not fail itself holds a RuntimeError naming the ranks that did)."""
    names = {type(failed.cause).__name__}
    names.update(f.cause for f in failed.failed_causes.values())
    return tuple(sorted(names))


def _shape(shape: Iterable[int]) -> str:
    return str(tuple(int(d) for d in shape))


def _check_targets(stores: Mapping[str, TensorStore], targets: Sequence[str]) -> None:
    missing = [t for t in targets if t not in stores]
    if missing:
        raise UpdateRefused(f"Module(s) requested for update not found in pipeline: {missing}. "
                            f"Available Module(s): {sorted(stores)}")


class _Planner:
    """Collects writes for one update, checking names, shapes and duplicates."""

    def __init__(self, stores: Mapping[str, TensorStore]) -> None:
        self.stores = stores
        self.plan = UpdatePlan([], ())
        self._seen: dict[int, tuple[str, Callable[[], torch.Tensor]]] = {}
        # (first name, its loader, second name, its loader, model dtype): one tensor given
        # under two tied names (T5's `shared.weight` / `encoder.embed_tokens.weight`).
        self._tied: list[tuple[str, Callable[[], torch.Tensor], str,
                               Callable[[], torch.Tensor], torch.dtype]] = []
        self.unknown: list[str] = []

    def add(self, component: str, name: str, shape: Sequence[int], dtype: torch.dtype,
            load: Callable[[], torch.Tensor], region: FileRegion | None = None, *,
            given: str | None = None) -> None:
        model = self.stores[component].tensor_named(name)
        if model is None:
            # (``given``: the name as the caller wrote it, named in the refusal as it is)
            self.unknown.append(given if given is not None else f"{component}.{name}")
            return
        if tuple(shape) != tuple(model.shape):
            raise UpdateRefused(f"Shape mismatch for {name}: model={_shape(model.shape)}, "
                                f"loaded={_shape(shape)}")
        label = f"{component}.{name}"
        if id(model) in self._seen:
            first, first_load = self._seen[id(model)]
            if first == label:
                raise UpdateRefused(f"tensor {label} is given twice")
            # Tied names of one tensor: written once, if the values agree (checked in finish).
            self._tied.append((first, first_load, label, load, model.dtype))
            return
        self._seen[id(model)] = (label, load)
        if dtype != model.dtype:
            self.plan.casts.append(f"{component}.{name}: {dtype} -> {model.dtype}")
        self.plan.writes.append(PlannedWrite(component, name, load, model.nbytes, region))

    def finish(self, components: Sequence[str], of: str | None = None) -> UpdatePlan:
        if self.unknown:
            shown = sorted(self.unknown)
            more = f" (and {len(shown) - 20} more)" if len(shown) > 20 else ""
            self.plan.close()
            where = "" if of is None else f" of {of}"
            raise UpdateRefused(f"{len(shown)} key(s) match no parameter or buffer{where}: "
                                f"{shown[:20]}{more}; nothing was updated")
        for first, first_load, second, load, dtype in self._tied:
            if not torch.equal(first_load().to(dtype), load().to(dtype)):
                self.plan.close()
                raise UpdateRefused(f"{first} and {second} are tied (one tensor) but are given "
                                    "different values; nothing was updated")
        self.plan.components = tuple(components)
        return self.plan


def plan_from_tensors(stores: Mapping[str, TensorStore],
                      named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                      target: str) -> UpdatePlan:
    """Plan writing ``named`` (names inside ``target``) into component ``target``."""
    _check_targets(stores, [target])
    items = list(named.items()) if isinstance(named, Mapping) else list(named)
    planner = _Planner(stores)
    add_tensors(planner, target, items)
    return planner.finish([target], of=target)


def add_tensors(planner: _Planner, target: str, items: Sequence[object], where: str = ""
                ) -> None:
    """Add each ``(name, tensor)`` of ``items`` to ``planner`` as a write into ``target``,
    checked (pairs, types, dense data); ``where`` prefixes the entry numbers in messages."""
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise UpdateRefused(f"{where}entry {i} is not a (name, tensor) pair")
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise UpdateRefused(f"{where}entry {i} must be (str, torch.Tensor), got "
                                f"({type(name).__name__}, {type(tensor).__name__})")
        if tensor.is_meta or tensor.layout != torch.strided:
            raise UpdateRefused(f"tensor {name!r} has no dense data ({tensor.device}, "
                                f"{tensor.layout})")
        planner.add(target, name, tensor.shape, tensor.dtype, functools.partial(_same, tensor),
                    given=name)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _files_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def _open(path: Path, plan: UpdatePlan) -> Any:
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        f = handle.__enter__()  # type: ignore[no-untyped-call]
    except (SafetensorError, OSError) as exc:
        plan.close()
        raise UpdateRefused(f"cannot read weight file {path}: not a valid safetensors file "
                            f"({exc})") from exc
    plan.handles.append(handle)
    return f


def _add_file(planner: _Planner, f: Any, path: Path, component: str | None,
              components: set[str]) -> None:
    try:
        regions = safetensors_regions(path)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        regions = {}  # safe_open read it: the loader still can (bytes twice, not once)
    for key in sorted(f.keys()):
        sl = f.get_slice(key)
        dtype = _ST_DTYPES.get(sl.get_dtype())
        if dtype is None:
            planner.plan.close()
            raise UpdateRefused(f"{path}: tensor {key!r} has unsupported dtype {sl.get_dtype()}")
        comp, name = component, key
        if comp is None:
            comp = max((c for c in planner.stores if key.startswith(c + ".")), key=len,
                       default=None)
            if comp is None:
                planner.unknown.append(key)
                continue
            name = key[len(comp) + 1:]
        components.add(comp)
        at = regions.get(key)
        region = None if at is None else FileRegion(str(path), at[0], at[1], dtype)
        planner.add(comp, name, sl.get_shape(), dtype, functools.partial(f.get_tensor, key),
                    region)


def plan_from_disk(stores: Mapping[str, TensorStore], path: str | os.PathLike[str],
                   targets: Sequence[str] | None) -> UpdatePlan:
    """Plan an update from ``<path>/<component>/*.safetensors`` or from one ``.safetensors``
    file whose keys are ``<component>.<name>``."""
    root = Path(path)
    if targets is not None:
        _check_targets(stores, list(targets))
    if not root.exists():
        raise UpdateRefused(f"weight path does not exist: {root}")
    planner = _Planner(stores)
    components: set[str] = set()
    if root.is_file():
        f = _open(root, planner.plan)
        _add_file(planner, f, root, None, components)
        if targets is not None:
            extra = sorted(components - set(targets))
            missing = sorted(set(targets) - components)
            planner.plan.writes = [w for w in planner.plan.writes if w.component in targets]
            if missing:
                planner.plan.close()
                raise UpdateRefused(f"Cannot update weights: missing weight files for modules: "
                                    f"{missing}. No partial updates allowed.")
            if extra:
                _log.info(events.UPDATE_SKIPPED_COMPONENTS, components=extra)
        return planner.finish(sorted(set(targets or components)))
    wanted = list(targets) if targets is not None else \
        [c for c in stores if _files_of(root / c)]
    missing = [c for c in wanted if not _files_of(root / c)]
    if missing:
        raise UpdateRefused(f"Cannot update weights: missing weight files for modules: "
                            f"{missing}. No partial updates allowed.")
    if not wanted:
        raise UpdateRefused(f"no weight files under {root}: expected <path>/<component>/"
                            f"*.safetensors for components {sorted(stores)}")
    for comp in wanted:
        for file in _files_of(root / comp):
            _add_file(planner, _open(file, planner.plan), file, comp, components)
    return planner.finish(wanted)


def checksum(store: TensorStore) -> str:
    """SHA-256 over the component's tensors in name order: name, dtype, shape and bytes,
    read from wherever they live (device, mirror, layer store)."""
    h = hashlib.sha256()
    for name, t in store.named_tensors():
        c = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{str(c.dtype).removeprefix('torch.')}|{_shape(c.shape)}\n".encode())
        if c.numel():  # hashed in place, without a copy into a bytes object
            h.update((ctypes.c_char * c.nbytes).from_address(c.data_ptr()))
    return h.hexdigest()


def version_label(weight_version: object) -> str | None:
    """A ``weight_version`` label: a string, or None for none."""
    if weight_version is None or isinstance(weight_version, str):
        return weight_version
    raise InvalidRequest("weight_version", f"weight_version must be a string, got "
                                           f"{type(weight_version).__name__}")
