"""Changing a component's residency while it is attached: a move from one store to another.

A residency mode decides how a component's storages are grouped into units (one per storage,
one for the whole component, one per layer) and which units sit on the device. Switching
modes therefore means a new :class:`TensorStore` over the same tensors (built from the old
store's storage layout, see ``TensorStore(layout=...)``) and a placement for each of its
units. Like every move it is two-phase:

* prepare: for each new unit, carry the old unit over when it holds exactly the same
  storages and already sits where it must (nothing copied), or allocate the new unit's
  buffer on its target tier and copy each storage's bytes in from wherever they are now
  (the device copy, or a current host mirror); nothing is re-pointed, so a failure or a
  cancellation is undone by dropping the new buffers;
* commit: re-point tensors at the new buffers and hand the new store to the caller (cannot
  fail).

Moves only what must move: a component whose mode and grouping do not change is not
touched at all, and a unit that keeps its storages and tier keeps its buffers and mirror.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ._errors import undo_on_failure
from ._inventory import Storage, Unit
from ._store import KeptMirrors, Progress, TensorStore, mirror_key
from .devices import CopyPair, Tier

__all__ = ["RegroupMove", "RestoreMove", "needs_restore", "prepare_regroup", "prepare_restore",
           "regroup_device_bytes", "regroup_host_plan"]


@dataclass(eq=False)
class _Placement:
    """One new unit's placement: carried over from ``old`` or filled into ``buf``."""

    unit: Unit
    to: Tier
    old: Unit | None = None  # carried over (same storages); None: copied into ``buf``
    buf: torch.Tensor | None = None  # new device buffer or new host mirror
    mirror: tuple[torch.Tensor, bool] | None = None  # a kept mirror given back (and current?)


@dataclass(eq=False)
class RegroupMove:
    """A prepared regroup of one component: ``store`` is the new store (placed at commit)."""

    store: TensorStore
    old: TensorStore
    placements: list[_Placement]
    bytes_copied: int = 0
    on_commit: Callable[[], None] = lambda: None
    on_undo: Callable[[], None] = lambda: None
    _pending: int = field(default=0)

    def commit(self) -> None:
        """Place every unit of the new store (re-pointing only), then ``on_commit``."""
        versions = {id(s.tensor): s.version for u in self.old.units for s in u.slot_list}
        for p in self.placements:
            _place(self.store, p, versions)
        self.old.add_pending(-self._pending)
        self._pending = 0
        self.placements.clear()
        self.store.refresh_derived(self.store.units)
        self.on_commit()

    async def undo(self) -> None:
        """Drop the new buffers; the old store was never touched."""
        self.old.add_pending(-self._pending)
        self._pending = 0
        self.placements.clear()
        self.on_undo()

    async def settle(self) -> BaseException | None:
        return None


def _place(store: TensorStore, p: _Placement, versions: dict[int, int]) -> None:
    unit, old = p.unit, p.old
    if old is None:
        assert p.buf is not None
        if p.to == "device":
            unit.host, unit.mirror_current = None, False
            store.point_to_device(unit, p.buf)
            if p.mirror is not None:
                store.adopt_mirror(unit, p.mirror[0])
                unit.mirror_current = p.mirror[1]
        else:
            store.adopt_mirror(unit, p.buf)
            store.point_to_host(unit)
        return
    # Carried over: the same storages at the same offsets, so the old buffers fit as they are.
    if old.host is not None:
        store.adopt_mirror(unit, old.host)
        unit.mirror_current = old.mirror_current
    if p.to == "device":
        if old.where == "device":
            unit.device_buf, unit.where = old.device_buf, "device"
            for slot in unit.slot_list:  # tensors already point there; keep dirtiness
                slot.version = versions.get(id(slot.tensor), -1)
                slot.ptr = slot.tensor.data_ptr()
        else:
            assert p.buf is not None
            store.point_to_device(unit, p.buf)  # from a current mirror: clean
    else:
        store.point_to_host(unit)


def _alloc_all(store: TensorStore, placements: list[_Placement]) -> None:
    """Allocate each placement's buffer on its tier (as it goes: a failure leaves those made
    so far on their placements, for the undo to drop)."""
    for p in placements:
        p.buf = store.layer.alloc(p.unit.nbytes, p.to)


def _same_storages(new: Unit, old_of: dict[int, Storage], old: TensorStore) -> Unit | None:
    """The old unit holding exactly ``new``'s storages in the same order, if any."""
    mapped = [old_of[id(st)] for st in new.storages]
    unit, _, _ = old.locate(mapped[0])
    return unit if unit.storages == mapped else None


def regroup_device_bytes(old: TensorStore, new: TensorStore, on_device: Sequence[Unit]
                         ) -> tuple[int, int]:
    """``(after, fresh)``: the device bytes ``new`` holds once :func:`prepare_regroup` with
    ``on_device`` commits, and the device buffers that preparation allocates (a unit over
    the same storages already on the device keeps its buffer; any other comes new), while
    ``old`` is still held. Allocates nothing."""
    by_tensor = {id(slot.tensor): st for st in old.storages() for slot in st.slots}
    old_of = {id(st): by_tensor[id(st.slots[0].tensor)] for st in new.storages()}
    fresh = 0
    for unit in on_device:
        same = _same_storages(unit, old_of, old)
        fresh += 0 if same is not None and same.where == "device" else unit.nbytes
    return sum(u.nbytes for u in on_device), fresh


async def prepare_regroup(old: TensorStore, new: TensorStore, on_device: Sequence[Unit],
                          progress: Progress | None = None, *,
                          mirrors: KeptMirrors | None = None) -> RegroupMove:
    """Prepare placing ``new`` (a store built with ``layout=old``) with ``on_device`` on the
    device and every other unit on the host, copying from wherever ``old`` has the bytes.
    ``mirrors``: host mirrors an earlier store kept (:meth:`TensorStore.kept_mirrors`):
    a unit that comes onto the device over the same storages takes its mirror back, as
    current as it was (a put-back restores the mirrors the move it undoes dropped)."""
    # The same storage in both stores holds the same tensor objects.
    by_tensor = {id(slot.tensor): st for st in old.storages() for slot in st.slots}
    old_of = {id(st): by_tensor[id(st.slots[0].tensor)] for st in new.storages()}
    device_ids = {id(u) for u in on_device}
    move = RegroupMove(new, old, [])
    if mirrors is not None:
        new.pageable_keys, new.pin_reason = set(mirrors.pageable_keys), mirrors.pin_reason
    pairs: dict[Tier, list[CopyPair]] = {"device": [], "host": []}
    async with undo_on_failure(move.undo, pairs):
        fresh: list[_Placement] = []  # filled from wherever the bytes are, into a new buffer
        for unit in new.units:
            to: Tier = "device" if id(unit) in device_ids else "host"
            p = _Placement(unit, to)
            move.placements.append(p)
            same = _same_storages(unit, old_of, old)
            if same is not None and (same.where == to or (
                    to == "host" and same.host is not None and not same.dirty())):
                p.old = same  # nothing to copy
                continue
            if same is not None and to == "device" and same.host is not None:
                p.old = same  # on the host: its current mirror comes in and stays the mirror
            elif to == "device" and mirrors and (kept := mirrors.mirrors.get(mirror_key(unit))):
                p.mirror = kept
            fresh.append(p)
        # Off the loop, in one go: device buffers (an allocation the cache cannot serve
        # synchronizes the device), and pinned host ones (page-locking is slow).
        made = [p for p in fresh if p.to == "device" or new.layer.pinned]
        if made:
            await new.layer.off_loop(_alloc_all, new, made)
        for p in fresh:
            if p.old is not None:  # its mirror comes in and stays the mirror
                assert p.buf is not None and p.old.host is not None
                move._pending += p.unit.nbytes
                old.add_pending(p.unit.nbytes)
                pairs["device"].append((p.buf, p.old.host))
                continue
            if p.buf is None:
                p.buf = new.layer.alloc(p.unit.nbytes, p.to)
            if p.to == "device":
                move._pending += p.unit.nbytes
                old.add_pending(p.unit.nbytes)
            for st in p.unit.storages:
                source = old.source_of(old_of[id(st)], p.to)
                assert source is not None  # (set_residency refuses a store emptied by a sleep)
                pairs[p.to].append((p.buf[st.offset:st.offset + st.nbytes], source))
        for to in ("host", "device"):
            if pairs[to]:
                await new.copy_pairs(pairs[to], to, progress)
                move.bytes_copied += sum(int(d.nbytes) for d, _ in pairs[to])
    return move


def regroup_host_plan(old: TensorStore, new: TensorStore, on_device: Sequence[Unit]
                      ) -> list[Unit]:
    """The new units :func:`prepare_regroup` (same arguments) will give a fresh host
    buffer, in its allocation order; allocates nothing. (Units it carries over keep the old
    unit's mirror; the old buffers stay held until the move is done with.)"""
    by_tensor = {id(slot.tensor): st for st in old.storages() for slot in st.slots}
    old_of = {id(st): by_tensor[id(st.slots[0].tensor)] for st in new.storages()}
    device_ids = {id(u) for u in on_device}
    fresh: list[Unit] = []
    for unit in new.units:
        if id(unit) in device_ids:
            continue
        same = _same_storages(unit, old_of, old)
        if same is None or not (same.where == "host" or (
                same.host is not None and not same.dirty())):
            fresh.append(unit)
    return fresh


@dataclass(eq=False)
class RestoreMove:
    """A prepared detach that gives the module its storages back: one pageable host tensor
    per storage it came with (its size, its tensors at their offsets, views sharing it as
    before), filled from wherever the bytes are. Commit re-points the tensors (cannot
    fail); the store is done with after."""

    store: TensorStore
    buffers: list[tuple[list[Storage], torch.Tensor]]
    bytes_copied: int = 0

    def commit(self) -> None:
        for storages, buf in self.buffers:
            for st in storages:
                for slot in st.slots:
                    slot.tensor.data = slot.view_of(buf, st.base)
        self.buffers.clear()
        for unit in self.store.units:
            unit.where, unit.device_buf, unit.host = "host", None, None
            for slot in unit.slot_list:
                slot.host_view = None
        self.store.discarded = None
        self.store.refresh_derived(self.store.units)
        self.store.settle_arena()

    async def undo(self) -> None:
        self.buffers.clear()

    async def settle(self) -> BaseException | None:
        return None


def needs_restore(store: TensorStore) -> bool:
    """Whether leaving ``store``'s tensors in its host mirrors would change the module's
    storage layout (a unit of several storages, a region of a storage), hand it pinned
    memory, or leave its discarded tensors on placeholders (a discarding sleep's)."""
    return store.layer.pinned or store.discarded is not None or any(
        len(u.storages) > 1 or u.storages[0].base or u.storages[0].nbytes != u.storages[0].origin[1]
        for u in store.units)


async def prepare_restore(store: TensorStore, progress: Progress | None = None) -> RestoreMove:
    """Prepare giving ``store``'s module its original storages back, on the host."""
    groups: dict[tuple[int, int], list[Storage]] = {}
    for st in store.storages():
        groups.setdefault(st.origin, []).append(st)
    move = RestoreMove(store, [])
    pairs: list[CopyPair] = []
    async with undo_on_failure(move.undo, pairs):
        for (_, nbytes), storages in groups.items():
            buf = store.layer.alloc(nbytes, "host", pinned=False)
            move.buffers.append((storages, buf))
            # (A storage a discarding sleep dropped has no bytes: its tensors get undefined ones.)
            pairs += [(buf[st.base:st.base + st.nbytes], source) for st in storages
                      if (source := store.source_of(st, "host")) is not None]
        await store.copy_pairs(pairs, "host", progress)
        move.bytes_copied = sum(int(d.nbytes) for d, _ in pairs)
    return move
