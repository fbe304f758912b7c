"""Discarding sleep: a component's weights released without a host copy, given a place again
(undefined contents) at wake, and stale until an update writes them.

In a colocated RL loop the weights slept are replaced by the trainer's right after the wake,
so copying them to the host (and keeping a mirror of the whole pipeline) is wasted time and
locked memory. A discarding sleep drops the tensors an update can bring back: the slots with
``state`` set (parameters and persistent buffers). Per unit:

* a unit none of whose storages is dropped sleeps as usual (copied if dirty, mirror kept);
* a unit with dropped storages gives up its mirror and its device buffer: its dropped tensors
  point at a one-element placeholder (their shape and dtype kept, their bytes gone), the
  storages it keeps (non-persistent buffers, tensor attributes: anything an update cannot
  bring back; a storage shared by a kept and a dropped tensor is kept whole) are packed into
  one host buffer for the whole store (:class:`Discarded`).

The dropped slots are marked ``stale``. Wake (:func:`prepare_undiscard`) gives every unit its
normal placement again (device buffers for the units that live there while awake, host stores
for the others) with the kept storages copied back and the stale bytes undefined (whatever the
new buffer held). A sleep of a store with stale slots drops them again (garbage is never
copied to the host). Both are moves like the others: prepared (copies, allocations), then
committed (re-pointing only) or undone (buffers dropped, nothing re-pointed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._errors import undo_on_failure
from ._inventory import Storage, Unit, aligned
from ._store import Move, Progress, TensorStore
from ._write import cancel_refresh
from .devices import CopyPair, Tier

__all__ = ["DiscardMove", "Discarded", "UndiscardMove", "prepare_discard", "prepare_undiscard"]


@dataclass(eq=False)
class Discarded:
    """What a store asleep with dropped tensors keeps: the units that hold nothing (to be
    placed again at wake), and their kept storages packed in one host buffer."""

    units: list[Unit]
    buffer: torch.Tensor | None = None
    offsets: dict[int, int] = field(default_factory=dict)  # id(storage) -> offset in buffer

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else int(self.buffer.nbytes)


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype over one element (host memory): what a dropped
    tensor points at while its component sleeps (NaN where the dtype has it). Viewed with one
    dimension per dimension of ``t`` before expanding, so that 0-d tensors (a ``logit_scale``)
    and empty ones take it too."""
    one = torch.empty(1, dtype=t.dtype)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        one.fill_(float("nan"))
    else:
        one.zero_()
    return one.reshape((1,) * t.dim()).expand(t.shape)


def _dropped(st: Storage, drop: set[int]) -> bool:
    return all(id(slot) in drop for slot in st.slots)


async def _alloc(store: TensorStore, nbytes: int, tier: Tier) -> torch.Tensor:
    if tier == "host" and store.layer.pinned:  # page-locking is slow: off the loop
        return await store.layer.off_loop(store.layer.alloc, nbytes, tier)
    return store.layer.alloc(nbytes, tier)


@dataclass(eq=False)
class _WholeStoreMove:
    """A discarding sleep's or its wake's move: it concerns every unit of ``store``; those
    that move as usual do so in its ``normal`` move, committed and undone first. Nothing is
    left to do after its commit (no mirror refresh runs)."""

    store: TensorStore
    normal: Move | None = field(default=None, kw_only=True)
    bytes_copied: int = field(default=0, kw_only=True)

    @property
    def units(self) -> list[Unit]:
        return list(self.store.units)

    def commit(self) -> None:
        if self.normal is not None:
            self.normal.commit()
        self._commit()

    async def undo(self) -> None:
        if self.normal is not None:
            await self.normal.undo()
        self._undo()

    async def settle(self) -> BaseException | None:
        return None

    def _commit(self) -> None:
        raise NotImplementedError

    def _undo(self) -> None:
        raise NotImplementedError


@dataclass(eq=False)
class DiscardMove(_WholeStoreMove):
    """A prepared discarding sleep of one store (see the module doc)."""

    drop: set[int]  # id() of every slot dropped (``normal``: the units with none dropped)
    discarded: Discarded
    to: Tier = "host"

    def _commit(self) -> None:
        d = self.discarded
        for unit in d.units:
            for st in unit.storages:
                offset = d.offsets.get(id(st))
                for slot in st.slots:
                    if offset is None:
                        slot.tensor.data = _placeholder(slot.tensor)
                    else:
                        assert d.buffer is not None
                        slot.tensor.data = slot.view_of(d.buffer, offset)
                    slot.record()
                    slot.host_view = None
            unit.where, unit.device_buf, unit.host, unit.mirror_current = "host", None, None, False
        for unit in self.store.units:
            for slot in unit.slot_list:
                if id(slot) in self.drop:
                    slot.stale = True
        self.store.count_stale()
        self.store.discarded = d
        self.store.refresh_derived(d.units)
        self.store.settle_arena()

    def _undo(self) -> None:
        self.discarded.buffer = None


async def prepare_discard(store: TensorStore, everything: bool,
                          progress: Progress | None = None) -> DiscardMove | None:
    """Prepare a sleep of ``store`` that drops its stale tensors, and with ``everything`` all
    of its parameters and persistent buffers; None when it drops nothing (an ordinary sleep
    then). Its background mirror refresh is cancelled first (what it would copy is dropped or
    copied now)."""
    if not everything and not store.stale_count:  # (a clean sleep's path: no slot loop)
        return None
    drop = {id(slot) for u in store.units for slot in u.slot_list
            if slot.stale or (everything and slot.state)}
    if not drop:
        return None
    await cancel_refresh(store)
    emptied = [u for u in store.units if any(_dropped(st, drop) for st in u.storages)]
    ids = {id(u) for u in emptied}
    move = DiscardMove(store, drop, Discarded(emptied))
    pairs: list[CopyPair] = []
    async with undo_on_failure(move.undo, pairs):
        rest = [u for u in store.units if id(u) not in ids and u.where == "device"]
        if rest:
            move.normal = await store.prepare_to_host(rest, progress=progress)
            move.bytes_copied += move.normal.bytes_copied
        kept = [st for u in emptied for st in u.storages if not _dropped(st, drop)]
        size = 0
        for st in kept:
            move.discarded.offsets[id(st)] = size
            size += aligned(st.nbytes)
        if kept:
            buffer = move.discarded.buffer = await _alloc(store, size, "host")
            for st in kept:
                source = store.source_of(st, "host")
                assert source is not None  # (kept: on the device, or current on the host)
                pairs.append((buffer[move.discarded.offsets[id(st)]:][:st.nbytes], source))
            await store.copy_pairs(pairs, "host", progress)
            move.bytes_copied += sum(st.nbytes for st in kept)
    return move


@dataclass(eq=False)
class UndiscardMove(_WholeStoreMove):
    """A prepared wake of a store a discarding sleep emptied (see the module doc)."""

    # (``normal``: the units that slept as usual and live on the device)
    placements: list[tuple[Unit, Tier, torch.Tensor]]
    _pending: int = 0
    to: Tier = "device"

    def _commit(self) -> None:
        store = self.store
        for unit, tier, buf in self.placements:
            if tier == "device":
                store.point_to_device(unit, buf)
            else:
                store.adopt_mirror(unit, buf)
                store.point_to_host(unit)
        store.add_pending(-self._pending)
        self._pending = 0
        self.placements.clear()
        store.discarded = None
        store.refresh_derived(store.units)

    def _undo(self) -> None:
        self.store.add_pending(-self._pending)
        self._pending = 0
        self.placements.clear()
        self.store.settle_arena()


async def prepare_undiscard(store: TensorStore, awake: list[Unit],
                            progress: Progress | None = None) -> UndiscardMove:
    """Prepare placing every unit of ``store`` (emptied by a discarding sleep) where it lives
    while awake (``awake`` on the device, the rest in host stores), the kept storages copied
    back; the stale tensors' bytes are whatever the new buffers hold."""
    d = store.discarded
    assert d is not None
    emptied = {id(u) for u in d.units}
    on_device = {id(u) for u in awake}
    move = UndiscardMove(store, [])
    pairs: dict[Tier, list[CopyPair]] = {"device": [], "host": []}
    async with undo_on_failure(move.undo, pairs):
        rest = [u for u in awake if id(u) not in emptied and u.where == "host"]
        if rest:
            move.normal = await store.prepare_to_device(rest, progress)
            move.bytes_copied += move.normal.bytes_copied
        device_bufs = iter(await store.device_buffers(
            [u for u in d.units if id(u) in on_device]))
        for unit in d.units:
            tier: Tier = "device" if id(unit) in on_device else "host"
            if tier == "device":
                buf = next(device_bufs)  # (labelled as it was made)
            else:
                buf = await _alloc(store, unit.nbytes, tier)
                store.layer.label(buf, store.name, unit.key)
            move.placements.append((unit, tier, buf))
            if tier == "device":
                move._pending += unit.nbytes
                store.add_pending(unit.nbytes)
            for st in unit.storages:
                offset = d.offsets.get(id(st))
                if offset is not None:
                    assert d.buffer is not None
                    pairs[tier].append((buf[st.offset:st.offset + st.nbytes],
                                        d.buffer[offset:offset + st.nbytes]))
        for tier in ("host", "device"):
            if pairs[tier]:
                await store.copy_pairs(pairs[tier], tier, progress)
                move.bytes_copied += sum(int(dst.nbytes) for dst, _ in pairs[tier])
    return move
