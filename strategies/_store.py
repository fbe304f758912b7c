"""Where one component's tensors live, and the moves that change it.

A :class:`TensorStore` takes inventory of a module once (:mod:`strategies._inventory`):
every parameter and buffer (persistent or not), each tensor object once (tied weights),
grouped by the storage they share (views), grouped again into *units* that move together. A
unit is one storage for the resident strategy (each tensor keeps a storage of its own on the
device, as usual in torch, so users' state dicts look as before), the whole component for the
offload strategies, and one layer for layerwise offload (one flat buffer, so one copy moves a
whole layer).

Every unit has a host mirror, allocated the first time it is needed and reused for the life
of the store (pinned on CUDA). Tensor objects never change identity: placement is changed by
re-pointing ``tensor.data`` at a view of a device buffer or of the host mirror. A version per
tensor (``Tensor._version``) says whether the mirror still matches the device bytes, so a
release of unchanged weights copies nothing.

Moves are two-phase so that a transition over many components is all-or-nothing:
``prepare_*`` allocates and copies without touching any tensor (it can fail or be cancelled
and leaves no trace after ``rollback``), ``commit`` only re-points tensors (cannot fail).

Known limit: writes through ``param.data`` (``p.data.copy_(...)``) bypass torch's version
counter; call :meth:`TensorStore.mark_dirty` after such writes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.lowlevel
import torch
from torch import nn

from ._chunks import chunked
from ._errors import StoreError, undo_on_failure
from ._inventory import Derived, Inventory, Slot, Storage, Unit, take_inventory
from ._write import WriteMove, WriteSource, cancel_refresh, land_refresh, prepare_write
from .devices import CopyHandle, CopyPair, DeviceLayer, Tier

if TYPE_CHECKING:
    from ._discard import Discarded
    from ._filebacked import FileBacking
    from .devices._vmm import Arena

__all__ = ["CHUNK", "Fetch", "Move", "PreparedMove", "Progress", "StoreReport", "TensorStore"]

CHUNK = 256 * 2**20  # bytes per copy batch: progress and cancellation points in between
IN_FLIGHT = 2  # copy batches handed to the layer at once (the link never waits for the host)
Progress = Callable[[int], None]  # told the bytes of each copied chunk
_log = logging.getLogger("residency.store")


@dataclass(frozen=True)
class KeptMirrors:
    """A store's host mirrors of its units on the device, kept across a move that drops
    them (:meth:`TensorStore.kept_mirrors`) for a move undoing it to give back
    (``prepare_regroup(..., mirrors=)``): each by :func:`mirror_key`, with whether it is
    current, and the store's pin choices (pageable units, why)."""

    mirrors: Mapping[tuple[int, ...], tuple[torch.Tensor, bool]]
    pageable_keys: frozenset[str]
    pin_reason: str


def mirror_key(unit: Unit) -> tuple[int, ...]:
    """A unit's storages as every store over the same tensors names them (each storage by
    the least id of its tensors), in order: a mirror fits a unit of another store with the
    same key (the same storages at the same offsets)."""
    return tuple(min(id(slot.tensor) for slot in st.slots) for st in unit.storages)


@dataclass(frozen=True)
class StoreReport:
    """Where a store's bytes are right now."""

    device_bytes: int
    host_bytes: int
    pinned_bytes: int  # the page-locked part of host_bytes, as footprint
    # Bytes whose only copy while asleep is in files they were loaded from (no host copy).
    file_backed_bytes: int = 0


class PreparedMove(Protocol):
    """What every prepared move offers the transaction that prepared it: commit (cannot
    fail), undo (if anything else failed), settle (after commit; returns instead of raising).
    :class:`Move` (placement) and :class:`~strategies._write.WriteMove` (new values) are
    prepared moves."""

    store: TensorStore
    bytes_copied: int

    def commit(self) -> None: ...

    async def undo(self) -> None: ...

    async def settle(self) -> BaseException | None: ...


@dataclass(eq=False)
class Move:
    """A prepared move: bytes copied, nothing re-pointed yet. ``commit`` or ``rollback``."""

    store: TensorStore
    to: Tier
    units: list[Unit]
    buffers: list[torch.Tensor | None] = field(default_factory=list)
    new_mirrors: list[Unit] = field(default_factory=list)
    bytes_copied: int = 0

    def commit(self) -> None:
        """Re-point every tensor of the moved units. Never fails, never awaits."""
        if self.to == "device":
            for unit, buf in zip(self.units, self.buffers, strict=True):
                assert buf is not None
                self.store.point_to_device(unit, buf)
        else:
            for unit in self.units:
                self.store.point_to_host(unit)
        self._forget_buffers()
        self.store.refresh_derived(self.units)
        self.store.settle_arena()

    def _forget_buffers(self) -> None:
        self.store.add_pending(-sum(u.nbytes for u, _ in zip(self.units, self.buffers,
                                                             strict=False)))
        self.buffers.clear()

    def rollback(self) -> None:
        """Forget the prepared buffers; mirrors allocated for this move are freed too."""
        self._forget_buffers()
        for unit in self.new_mirrors:
            self.store.drop_mirror(unit)
        self.store.settle_arena()

    async def undo(self) -> None:
        """:meth:`rollback`, for callers that undo moves of every kind (a write's undo
        copies bytes back)."""
        self.rollback()

    async def settle(self) -> BaseException | None:
        """Work after commit that cannot undo it (none for a placement move)."""
        return None


@dataclass(eq=False)
class Fetch:
    """A unit's copy to the device started from synchronous code (a forward hook)."""

    store: TensorStore
    unit: Unit
    buf: torch.Tensor
    handle: CopyHandle

    def complete(self) -> None:
        """Order the compute after the copy and re-point the unit's tensors at it."""
        try:
            self.handle.wait()
        finally:
            self.store.add_pending(-self.unit.nbytes)
        self.store.point_to_device(self.unit, self.buf)
        self.store.refresh_derived([self.unit])

    def drop(self) -> None:
        """Give the fetch up (a prefetch off the path that ran): nothing waits for the copy,
        the unit stays on the host, the buffer goes (see :meth:`CopyHandle.drop`)."""
        self.handle.drop()
        self.store.add_pending(-self.unit.nbytes)


class TensorStore:
    """The inventory and placement of one component's tensors.

    ``layers``: dotted prefixes (``"blocks.3"``) whose tensors form one unit each; every other
    storage is a unit of its own. ``whole``: the whole component is one unit (one host buffer,
    one device buffer, one copy): for components that always move together. ``layout``:
    another store of the same module whose storages are taken over (see
    :func:`~strategies._inventory.take_inventory`).
    """

    def __init__(self, name: str, module: nn.Module, layer: DeviceLayer,
                 layers: Sequence[str] = (), *, whole: bool = False,
                 refuse_dtensors: bool = True, layout: TensorStore | None = None) -> None:
        self.name = name
        self.module = module
        self.layer = layer
        self.layer_keys = tuple(layers)
        self.whole = whole
        # FSDP manages its own DTensor parameters (such a component stays resident and
        # sleep/wake is refused); anywhere else a DTensor cannot be placed by us.
        self.refuse_dtensors = refuse_dtensors
        self.pending_bytes = 0  # device buffers allocated for moves not committed yet
        # Asleep after a discarding sleep: what it kept (strategies._discard), else None.
        self.discarded: Discarded | None = None
        self._pending_lock = threading.Lock()  # forward hooks run in worker threads too
        # Units whose mirror is made pageable though the layer pins (the pin budget went to
        # units moved more often: lifecycle._hosttiers), and why this store's mirrors are
        # of the kind they are (the report says it).
        self.pageable_keys: set[str] = set()
        self.pin_reason = ""
        # The checkpoint files its weights are the bytes of, if recorded (the file-backed
        # tier: strategies._filebacked).
        self.file_backing: FileBacking | None = None
        # The address-stable arena its units live in while on the device (resident-stable:
        # strategies.devices._vmm), else None (device buffers from the layer's allocator).
        self.arena: Arena | None = None
        # (``layout``'s inventory is taken over, not the store: its buffers are not kept alive.)
        inventory = layout.inventory if layout is not None else None
        self._install(self._inventory(inventory), counted=layout is not None)

    def add_pending(self, nbytes: int) -> None:
        """Count device bytes allocated for a move in flight (negative: no longer)."""
        with self._pending_lock:
            self.pending_bytes += nbytes

    # -- inventory (see strategies._inventory) ---------------------------------------
    def _inventory(self, layout: Inventory | None, stale: Collection[int] = ()) -> Inventory:
        return take_inventory(
            self.name, self.module, self.layer.device, self.layer.on_device, self.layer_keys,
            whole=self.whole, refuse_dtensors=self.refuse_dtensors, layout=layout, stale=stale)

    def _install(self, inventory: Inventory, counted: bool) -> None:
        """Make ``inventory`` the store's (``counted``: its device storages are held already)."""
        self.inventory = inventory
        if not counted:
            # The module's own device storages (attach, rescan) count as held. A regrouped
            # store's are the old store's buffers, counted already (and on the CPU a host
            # mirror is a "cpu" tensor too: never count it).
            for u in self.inventory.units:
                if u.where == "device":
                    for slot in u.slot_list:
                        self.layer.track(slot.tensor)

    @property
    def units(self) -> list[Unit]:
        return self.inventory.units

    @property
    def by_key(self) -> dict[str, Unit]:
        return self.inventory.by_key

    @property
    def derived(self) -> list[Derived]:
        return self.inventory.derived

    @property
    def stale_count(self) -> int:
        """Tensors whose contents are undefined (discarded), as last counted."""
        return self.inventory.stale_count

    def count_stale(self) -> int:
        """Count the stale tensors again (after a move marked or cleared some)."""
        return self.inventory.count_stale()

    def stale_names(self) -> list[str]:
        """The tensors whose contents are undefined (discarded), under their first names."""
        return sorted(s.names[0] for s in self.inventory.slots if s.stale)

    def storages(self) -> list[Storage]:
        """Every storage, in unit order."""
        return self.inventory.storages()

    def structure_changed(self) -> list[str]:
        """Names of tensors replaced or removed since inventory."""
        return self.inventory.structure_changed()

    def drifted(self) -> list[str]:
        """Names of tensors re-pointed behind the store's back (``p.data = other``)."""
        return self.inventory.drifted()

    def derived_nbytes(self, unit: Unit) -> int:
        """Device bytes of the derived attributes computed from ``unit``'s parameters while
        it is placed (they come and go with it)."""
        return self.inventory.derived_nbytes(unit)

    def rescan(self) -> None:
        """Take inventory again (after the module's structure changed while on device);
        stale tensors stay stale."""
        if self.arena is not None:
            # Its arena is laid out for the tensors it was made for, at fixed addresses.
            changes = self.structure_changed() or self.drifted()
            raise StoreError(f"component {self.name!r} is resident-stable, but tensors were "
                             f"replaced behind the controller: {', '.join(changes[:8])}; its "
                             "arena keeps the addresses of the tensors it was attached with: "
                             "write new values in place (an update), or detach and attach again")
        if any(u.where == "host" for u in self.units):
            # Only a store wholly on the device is the module's own placement to take again;
            # anywhere else our host copy is the truth, and putting it back would silently
            # undo what was done (a ``module.to(torch.float64)``): refused, saying what.
            changes = self.inventory.changes()
            more = f", and {len(changes) - 8} more" if len(changes) > 8 else ""
            raise StoreError(f"component {self.name!r} was changed behind the controller while "
                             f"offloaded: {', '.join(changes[:8])}{more}; the controller does "
                             "not adopt that: detach it, change it, and attach it again")
        inventory = self._inventory(None, self.inventory.stale_ids())
        on_host = sorted(s.names[0] for u in inventory.units if u.where == "host"
                         for s in u.slot_list if not self.layer.on_device(s.tensor))
        if on_host:
            # Placed, every unit is on the device: a tensor put in host memory behind the
            # controller has no mirror and no move that would bring it there.
            more = f", and {len(on_host) - 8} more" if len(on_host) > 8 else ""
            raise StoreError(
                f"component {self.name!r} is placed on {self.layer.device}, but "
                f"{', '.join(repr(n) for n in on_host[:8])}{more} now hold host memory "
                "(replaced behind the controller); give them tensors on the device "
                f"({self.layer.device}), write new values in place (an update), or detach and "
                "attach again")
        self._install(inventory, counted=False)

    def note_training_forward(self, module: nn.Module) -> None:
        """``module`` ran a forward in training mode: its buffers may have been written by
        kernels that do not bump the version counter (batch-norm running statistics)."""
        for slot in self.inventory.buffers_of.get(id(module), ()):
            slot.version = -1

    def mark_dirty(self) -> None:
        """Declare every mirror stale (after writes that bypass the version counter); the
        tensors are no longer their checkpoint files' bytes either."""
        if self.file_backing is not None and not self.file_backing.asleep:
            self.file_backing = None
        for u in self.units:
            if u.where == "device":
                u.mirror_current = False

    def source_of(self, st: Storage, to: Tier) -> torch.Tensor | None:
        """Storage ``st``'s current bytes to copy to tier ``to``: the copy already on that
        tier when there is one (no trip over the link), else the other; None for a storage a
        discarding sleep dropped (its bytes are gone)."""
        _, on_device, on_host = self.locate(st)
        first, second = (on_device, on_host) if to == "device" else (on_host, on_device)
        return first if first is not None else second

    def locate(self, st: Storage) -> tuple[Unit, torch.Tensor | None, torch.Tensor | None]:
        """Where storage ``st``'s bytes are now: its unit, a device view and a host view of
        exactly its bytes (``None`` where it has none; the host view only if the mirror is
        current, i.e. equal to the device bytes or the live copy itself)."""
        unit = self.inventory.unit_of(st)
        device = host = None
        if unit.where == "device":
            device = (unit.device_buf[st.offset:st.offset + st.nbytes]
                      if unit.device_buf is not None else st.source_bytes())
        if unit.host is not None and (unit.where == "host" or not unit.dirty()):
            host = unit.host[st.offset:st.offset + st.nbytes]
        elif self.discarded is not None and self.discarded.buffer is not None \
                and (offset := self.discarded.offsets.get(id(st))) is not None:
            host = self.discarded.buffer[offset:offset + st.nbytes]  # kept by a discarding sleep
        return unit, device, host

    def refresh_derived(self, units: Iterable[Unit]) -> None:
        """After ``units`` moved: recompute the derived attributes whose parameters are all
        on the device now; release (an empty placeholder) those whose parameters left."""
        if not self.derived:  # most modules (and a clean sleep's hot path): nothing to do
            return
        moved = {id(u) for u in units}
        for d in self.derived:
            if any(id(u) in moved for u in d.sources):
                d.refresh(all(u.where == "device" for u in d.sources), self.layer.track)

    # -- mirrors -------------------------------------------------------------------
    def ensure_mirror(self, unit: Unit) -> bool:
        """Allocate ``unit``'s host mirror if it has none; True when it was allocated now."""
        if unit.host is not None:
            return False
        pinned = False if unit.key in self.pageable_keys else None
        self.adopt_mirror(unit, self.layer.alloc(unit.nbytes, "host", pinned=pinned))
        assert unit.host is not None
        self.layer.label(unit.host, self.name, unit.key)
        unit.mirror_current = False
        return True

    async def ensure_mirrors(self, units: Sequence[Unit], made: list[Unit]) -> None:
        """:meth:`ensure_mirror` for each unit, appending those allocated now to ``made``
        (as they are made: a cancelled caller still knows what to drop). Pinned memory is
        registered in a worker thread (page-locking is slow): never on the event loop."""
        def allocate() -> None:
            for unit in units:
                if self.ensure_mirror(unit):
                    made.append(unit)

        if self.layer.pinned and any(u.host is None for u in units):
            await self.layer.off_loop(allocate)
        else:
            allocate()

    def kept_mirrors(self) -> KeptMirrors:
        """The host mirrors of the units on the device now, and the pin choices: what a move
        that drops them gives back when another move undoes it (a hand-off's put-back)."""
        return KeptMirrors({mirror_key(u): (u.host, not u.dirty()) for u in self.units
                            if u.where == "device" and u.host is not None},
                           frozenset(self.pageable_keys), self.pin_reason)

    def adopt_mirror(self, unit: Unit, host: torch.Tensor) -> None:
        """Make ``host`` (a host buffer of the unit's size) ``unit``'s mirror."""
        unit.host = host
        for st in unit.storages:
            for slot in st.slots:
                slot.host_view = slot.view_of(host, st.offset)

    def drop_mirror(self, unit: Unit) -> None:
        if unit.where == "host":
            raise AssertionError("cannot drop the mirror of a unit that lives on the host")
        unit.host = None
        unit.mirror_current = False
        for slot in unit.slot_list:
            slot.host_view = None

    async def adopt(self) -> int:
        """Copy units that are not wholly on the device (loaded on the host) into fresh
        mirrors and re-point their tensors there, so that the store owns every host byte it
        reads from. Returns the bytes copied."""
        units = [u for u in self.units if u.where == "host" and u.host is None]
        pairs: list[CopyPair] = []
        await self.ensure_mirrors(units, [])
        for unit in units:
            pairs += self._copy_out_pairs(unit)
        await self.layer.copy(pairs, "host")
        for unit in units:
            self.point_to_host(unit)
        self.refresh_derived(units)
        return sum(u.nbytes for u in units)

    # -- the address-stable arena (resident-stable) ---------------------------------------
    def device_buffer(self, unit: Unit) -> torch.Tensor:
        """A device buffer for ``unit``: its place in the arena (mapped first if it is not:
        the same addresses every time), else a fresh one from the layer."""
        if self.arena is not None:
            return self.arena.view(unit.key)
        return self.layer.alloc(unit.nbytes, "device")

    async def device_buffers(self, units: Sequence[Unit]) -> list[torch.Tensor]:
        """:meth:`device_buffer` for each of ``units``, labelled, made in a worker thread
        (one hop for all): an allocation the caching allocator cannot serve from its cache
        synchronizes the device (torch frees its cached blocks: it waits for their events,
        and ``cudaFree`` synchronizes), and an arena maps its memory through the driver;
        neither may stop the event loop. A failure drops the buffers made so far (the
        caller's bookkeeping starts once all are made)."""

        def make() -> list[torch.Tensor]:
            out = []
            for unit in units:
                buf = self.device_buffer(unit)
                self.layer.label(buf, self.name, unit.key)
                out.append(buf)
            return out

        return await self.layer.off_loop(make) if units else []

    def in_arena(self, unit: Unit) -> bool:
        """Whether ``unit`` lives in the arena now."""
        return self.arena is not None and unit.where == "device" and \
            unit.device_buf is not None and self.arena.holds(unit.device_buf)

    def settle_arena(self) -> None:
        """After a move committed or was undone: release the arena's physical memory when
        no unit lives in it and no other move holds device buffers it has not committed (its
        addresses stay reserved). A failure is logged and leaves it mapped (counted as held;
        the next sleep releases it): the move stands."""
        arena = self.arena
        if arena is None or not arena.mapped or any(self.in_arena(u) for u in self.units):
            return
        with self._pending_lock:
            if self.pending_bytes:
                # A move prepared beside the one that settles (attach: the units in host
                # memory copied in, after the rehome of those on the device) holds views of
                # the arena it has not committed yet: released after it, if at all.
                return
        try:
            arena.unmap()
        except Exception as exc:  # (a VmmError)
            _log.warning("residency: component %r: releasing its arena failed, it stays "
                         "mapped: %s", self.name, exc)

    async def prepare_rehome(self, progress: Progress | None = None) -> Move:
        """Prepare moving the units on the device that are not in the arena (attach: the
        module's own storages) into it: the arena mapped, their bytes copied in."""
        units = [u for u in self.units if u.where == "device" and not self.in_arena(u)]
        move = Move(self, "device", units)
        pairs: list[CopyPair] = []
        async with undo_on_failure(move.undo, pairs):
            for unit, buf in zip(units, await self.device_buffers(units), strict=True):
                move.buffers.append(buf)
                self.add_pending(unit.nbytes)
                if unit.device_buf is not None:
                    pairs.append((buf, unit.device_buf))
                else:
                    pairs += [(buf[st.offset:st.offset + st.nbytes], st.source_bytes())
                              for st in unit.storages]
            await self.copy_pairs(pairs, "device", progress)
        move.bytes_copied = sum(u.nbytes for u in units)
        return move

    # -- re-pointing (the commit of every move) -----------------------------------------
    def point_to_device(self, unit: Unit, buf: torch.Tensor) -> None:
        """Re-point ``unit``'s tensors at ``buf`` (its bytes already copied in)."""
        for st in unit.storages:
            for slot in st.slots:
                slot.tensor.data = slot.view_of(buf, st.offset)
                slot.record()
        self.layer.for_compute(buf)
        unit.device_buf = buf
        unit.where = "device"

    def point_to_host(self, unit: Unit) -> None:
        """Re-point ``unit``'s tensors at its (current) mirror; the device bytes are dropped."""
        for slot in unit.slot_list:
            t = slot.tensor
            t.data = slot.host_view  # type: ignore[assignment]
            slot.version = t._version
            slot.ptr = t.data_ptr()
        unit.device_buf = None
        unit.where = "host"
        unit.mirror_current = True

    # -- moves ---------------------------------------------------------------------
    def slot_named(self, name: str) -> tuple[Slot, Unit]:
        """The tensor called ``name`` (any of its names) and its unit; KeyError if none."""
        return self.inventory.slot_named(name)

    def tensor_named(self, name: str) -> torch.Tensor | None:
        """The live tensor called ``name`` (parameter, buffer or attribute), if any."""
        try:
            return self.slot_named(name)[0].tensor
        except KeyError:
            return None

    async def prepare_write(self, sources: Sequence[WriteSource],
                            limiter: anyio.CapacityLimiter | None = None) -> WriteMove:
        """Write new values into tensors, undoably: see :mod:`strategies._write`."""
        return await prepare_write(self, sources, limiter)

    async def cancel_refresh(self) -> None:
        """Stop the background mirror refresh of an update, if any (the chunk in flight
        lands first): what it would copy is not wanted (see strategies._write)."""
        await cancel_refresh(self)

    async def land_refresh(self) -> BaseException | None:
        """Wait for the background mirror refresh a weight update started (if any); returns
        the error that left mirrors stale (once; the next sleep copies them), else None."""
        return await land_refresh(self)

    def select(self, where: Tier, keys: Iterable[str] | None = None,
               pred: Callable[[Unit], bool] | None = None) -> list[Unit]:
        """Units currently on ``where``, optionally only those in ``keys`` / matching ``pred``."""
        units = self.units if keys is None else [self.by_key[k] for k in keys]
        return [u for u in units if u.where == where and (pred is None or pred(u))]

    async def copy_pairs(self, pairs: Sequence[CopyPair], to: Tier,
                         progress: Progress | None = None) -> None:
        """Copy ``(dst, src)`` pairs in chunks of about :data:`CHUNK` bytes, :data:`IN_FLIGHT`
        chunks handed to the layer at once: the next chunk is queued before the one before it
        has landed, so the link does not idle while the host learns of a landing and queues
        the next chunk (a round trip per chunk otherwise). Tells ``progress`` after each chunk
        lands (a progress bar); checks for cancellation before handing over each chunk after
        the first. Returns once every chunk has landed; on a failure or a cancellation, once
        every chunk handed over has (a layer never abandons a started copy), raising the
        first error itself (not an exception group)."""
        chunks = list(chunked(pairs, lambda pair: int(pair[0].nbytes), CHUNK))
        if len(chunks) <= 1:  # (most moves: no task group to pay for)
            for chunk in chunks:
                await self.layer.copy(chunk, to)
                if progress:
                    progress(sum(int(dst.nbytes) for dst, _ in chunk))
            return
        slots = anyio.Semaphore(IN_FLIGHT)
        errors: list[Exception] = []

        async def one(chunk: list[CopyPair]) -> None:
            try:
                await self.layer.copy(chunk, to)
            except Exception as exc:  # raised below, once the other chunk has landed
                errors.append(exc)
                return
            finally:
                slots.release()
            if progress:
                progress(sum(int(dst.nbytes) for dst, _ in chunk))

        try:
            # A failed chunk cancels nothing: the one handed over with it (maybe still waiting
            # in the layer) lands, and no chunk is handed over after the failure.
            async with anyio.create_task_group() as tg:
                for i, chunk in enumerate(chunks):
                    await slots.acquire()
                    if errors:
                        break
                    if i:
                        # The cancellation point, whatever the layer: a layer may wait for a
                        # started copy shielded (the CUDA layer does) and return without one.
                        await anyio.lowlevel.checkpoint_if_cancelled()
                    tg.start_soon(one, chunk)
        finally:
            # Every chunk handed over has landed: the lists are not needed, and frames that a
            # cancellation's reference cycles keep must not keep their buffers alive.
            for chunk in chunks:
                chunk.clear()
        if errors:
            raise errors[0]

    async def prepare_to_device(self, units: Sequence[Unit],
                                progress: Progress | None = None) -> Move:
        """Allocate device buffers for ``units`` (on the host) and copy their mirrors in."""
        move = Move(self, "device", list(units))
        pairs: list[CopyPair] = []
        async with undo_on_failure(move.undo):
            for unit, buf in zip(move.units, await self.device_buffers(move.units),
                                 strict=True):
                assert unit.where == "host" and unit.host is not None
                move.buffers.append(buf)
                self.add_pending(unit.nbytes)
                pairs.append((buf, unit.host))
            await self.copy_pairs(pairs, "device", progress)
        move.bytes_copied = sum(u.nbytes for u in move.units)
        return move

    async def prepare_to_host(self, units: Sequence[Unit], copy_back: bool = True,
                              progress: Progress | None = None) -> Move:
        """Bring ``units``' mirrors up to date (copying only dirty units, and only if
        ``copy_back``); the device bytes are released at commit."""
        move = Move(self, "host", list(units))
        pairs: list[CopyPair] = []
        async with undo_on_failure(move.undo):
            # A mirror refresh still running after a weight update (strategies._write)
            # writes these mirrors and reads these device buffers: it lands first.
            await land_refresh(self)
            for unit in move.units:  # (a clean sleep: every mirror exists, no await)
                if unit.host is None:
                    await self.ensure_mirrors(move.units, move.new_mirrors)
                    break
            for unit in move.units:
                assert unit.where == "device"
                if copy_back and unit.dirty():
                    pairs += self._copy_out_pairs(unit)
                    move.bytes_copied += unit.nbytes
                elif not copy_back and not unit.mirror_current:
                    raise StoreError(f"unit {unit.key!r} of component {self.name!r} has no "
                                     "current host copy to fall back to")
            if pairs:
                await self.copy_pairs(pairs, "host", progress)
        return move

    # -- synchronous moves, for forward hooks ----------------------------------------
    def start_fetch(self, unit: Unit) -> Fetch:
        """Allocate ``unit``'s device buffer and start copying its mirror in.

        The buffer is allocated on the compute stream and the copy runs on the copy stream,
        after the compute work queued so far (see :class:`~strategies.devices._cuda.CudaDevice`).
        A Fetch is either completed (``Fetch.complete``: the compute stream waits for the
        copy's event before the tensors point at the buffer) or dropped (``Fetch.drop``: the
        buffer is recorded on the copy stream, so its block is not reused before the copy
        ran); the layerwise strategy's lock makes sure no Fetch is lost on the way (two
        threads never start two fetches of one unit)."""
        assert unit.where == "host" and unit.host is not None
        buf = self.layer.alloc(unit.nbytes, "device")
        self.layer.label(buf, self.name, unit.key)
        handle = self.layer.start_copy([(buf, unit.host)], "device")
        self.add_pending(unit.nbytes)
        return Fetch(self, unit, buf, handle)

    def evict(self, unit: Unit) -> int:
        """Send ``unit`` back to its mirror now, copying first only if it changed on the
        device. Returns the bytes copied."""
        assert unit.where == "device"
        copied = 0
        if unit.dirty():
            self.ensure_mirror(unit)
            # The host waits for this copy only (not the whole device): the mirror is read
            # as soon as it is re-pointed; the buffer, recorded on the copy stream, is not
            # reused before the copy ran even though it is dropped at once.
            self.layer.start_copy(self._copy_out_pairs(unit), "host").wait_host()
            copied = unit.nbytes
        self.point_to_host(unit)
        self.refresh_derived([unit])
        return copied

    @staticmethod
    def _copy_out_pairs(unit: Unit) -> list[CopyPair]:
        assert unit.host is not None
        if unit.device_buf is not None:
            return [(unit.host, unit.device_buf)]
        return [(unit.host[st.offset:st.offset + st.nbytes], st.source_bytes())
                for st in unit.storages]

    # -- introspection -------------------------------------------------------------
    # The attributes weight_norm and spectral_norm recompute from placed parameters count in
    # the device bytes *and* in the total: they are device memory the component holds
    # whenever those parameters are placed (computed at placement, counted in the peak, seen
    # by the allocator), and the planner budgets them (``derived_nbytes``). Leaving them out
    # of both would under-state what a placed component occupies; so the device bytes of an
    # idle resident component equal its total. They are never on the host (recomputed, not
    # copied): an asleep component's host bytes are its total less them. FSDP's local shards
    # count in both the same way.
    @property
    def device_bytes(self) -> int:
        """Bytes on the device: placed units, buffers of moves in flight, derived attributes
        recomputed from placed parameters, and FSDP's shards."""
        placed = sum(u.nbytes for u in self.units if u.where == "device") + self.pending_bytes
        if self.arena is not None and self.arena.mapped:
            # What is mapped, whatever it holds (the allocator never sees it): the packing's
            # alignment and the granularity's rounding included.
            placed = self.arena.size + sum(u.nbytes for u in self.units
                                           if u.where == "device" and not self.in_arena(u))
        return placed + sum(d.nbytes() for d in self.derived) + self.inventory.fsdp_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the component wholly placed: every unit, the derived attributes computed
        from them, and FSDP's shards."""
        return sum(u.nbytes for u in self.units) \
            + sum(d.full_nbytes() for d in self.derived) + self.inventory.fsdp_bytes

    def report(self) -> StoreReport:
        device = self.device_bytes
        hosts = [u.host for u in self.units if u.host is not None]
        if self.discarded is not None and self.discarded.buffer is not None:
            hosts.append(self.discarded.buffer)
        pinned = 0
        for buf in hosts:  # each buffer's kind as the layer's ledger counted it
            kind = self.layer.host.kind(buf)
            if kind is not None and kind[1]:
                pinned += self.layer.pinned_footprint(int(buf.nbytes))
        return StoreReport(device, sum(int(b.nbytes) for b in hosts), pinned,
                           self.file_backed_bytes())

    def file_backed_bytes(self) -> int:
        """Bytes kept only in their checkpoint files while asleep (see
        :mod:`strategies._filebacked`); 0 unless asleep file-backed."""
        backing = self.file_backing
        return backing.nbytes() if backing is not None and backing.asleep else 0

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor once, under its first name, sorted by name."""
        return sorted(((s.names[0], s.tensor) for s in self.inventory.slots),
                      key=lambda nt: nt[0])
