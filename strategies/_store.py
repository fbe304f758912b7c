"""The tensors of one component and where their bytes live.

A :class:`TensorStore` takes inventory of a module once: every parameter and buffer
(persistent or not), each tensor object once (tied weights), grouped by the storage they
share (views), grouped again into *units* that move together. A unit is one storage for the
resident strategy (each tensor keeps a storage of its own on the device, as usual in torch,
so users' state dicts look as before), the whole component for the offload strategies, and
one layer for layerwise offload (one flat buffer, so one copy moves a whole layer).

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

import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ._device import CopyHandle, CopyPair, DeviceLayer, Tier

__all__ = ["ALIGN", "CHUNK", "Fetch", "Move", "Progress", "StoreError", "StoreReport",
           "TensorStore", "Unit", "forget_locals"]

# Byte alignment of every storage inside a unit buffer: keeps dtype views legal, and GEMM
# libraries pick the same kernels as for a fresh allocation (they look at pointer alignment).
ALIGN = 256
WHOLE = "(component)"  # the unit key of a store made with whole=True
CHUNK = 256 * 2**20  # bytes per copy batch: progress and cancellation points in between
Progress = Callable[[int], None]  # told the bytes of each copied chunk


class StoreError(ValueError):
    """A module's tensors cannot be managed (meta, sparse, on a foreign device, drifted)."""


def forget_locals(exc: BaseException) -> None:
    """Drop the local variables of the frames ``exc`` passed through (file and line stay).

    A failed copy's traceback holds the frames that held the copy's buffers, and exceptions
    sit in reference cycles (anyio's futures, task groups) that only the cyclic collector
    breaks: without this, device memory a rollback released stays allocated until then."""
    traceback.clear_frames(exc.__traceback__)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class _Slot:
    """One tensor object (a Parameter or a buffer), however many names it has."""

    tensor: torch.Tensor
    names: list[str]
    byte_offset: int  # of the tensor's first element inside its storage
    host_view: torch.Tensor | None = None  # view into the unit's mirror, made once
    version: int = -1  # tensor._version when the mirror last matched / last re-pointed
    ptr: int = 0  # tensor.data_ptr() when last re-pointed

    def view_of(self, buf: torch.Tensor, byte_offset: int) -> torch.Tensor:
        """A tensor with this slot's dtype, shape and strides over ``buf`` at ``byte_offset``."""
        t = self.tensor
        itemsize = t.element_size()
        start = buf.storage_offset() + byte_offset + self.byte_offset
        return torch.empty(0, dtype=t.dtype, device=buf.device).set_(
            buf.untyped_storage(), start // itemsize, t.shape, t.stride())

    def record(self) -> None:
        self.version = self.tensor._version
        self.ptr = self.tensor.data_ptr()


@dataclass(eq=False)
class _Storage:
    """One untyped storage and the tensor objects that view it."""

    nbytes: int
    slots: list[_Slot]
    offset: int = 0  # inside the unit's buffers

    def source_bytes(self) -> torch.Tensor:
        """The storage's live bytes, wherever they are, as a 1-D uint8 tensor."""
        t = self.slots[0].tensor
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


@dataclass(eq=False)
class Unit:
    """Storages that move together: one host region, one device buffer."""

    key: str
    storages: list[_Storage]
    nbytes: int = 0
    where: Tier = "device"
    host: torch.Tensor | None = None
    device_buf: torch.Tensor | None = None  # our own device buffer (None: adopted storages)
    mirror_current: bool = False
    slot_list: list[_Slot] = field(default_factory=list)  # flattened: hot loops use it

    def __post_init__(self) -> None:
        self.slot_list = [slot for st in self.storages for slot in st.slots]

    def dirty(self) -> bool:
        """Whether the mirror may differ from the device bytes."""
        if not self.mirror_current:
            return True
        return any(s.tensor._version != s.version for s in self.slot_list)


@dataclass(frozen=True)
class StoreReport:
    """Where a store's bytes are right now."""

    device_bytes: int
    host_bytes: int
    pinned_bytes: int


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

    def _forget_buffers(self) -> None:
        self.store.pending_bytes -= sum(u.nbytes for u, _ in zip(self.units, self.buffers,
                                                                 strict=False))
        self.buffers.clear()

    def rollback(self) -> None:
        """Forget the prepared buffers; mirrors allocated for this move are freed too."""
        self._forget_buffers()
        for unit in self.new_mirrors:
            self.store.drop_mirror(unit)


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
            self.store.pending_bytes -= self.unit.nbytes
        self.store.point_to_device(self.unit, self.buf)


class TensorStore:
    """The inventory and placement of one component's tensors.

    ``layers``: dotted prefixes (``"blocks.3"``) whose tensors form one unit each; every other
    storage is a unit of its own. ``whole``: the whole component is one unit (one host buffer,
    one device buffer, one copy): for components that always move together.
    """

    def __init__(self, name: str, module: nn.Module, layer: DeviceLayer,
                 layers: Sequence[str] = (), *, whole: bool = False) -> None:
        self.name = name
        self.module = module
        self.layer = layer
        self.layer_keys = tuple(layers)
        self.whole = whole
        self.pending_bytes = 0  # device buffers allocated for moves not committed yet
        self.units: list[Unit] = []
        self.by_key: dict[str, Unit] = {}
        self._inventory()

    # -- inventory -----------------------------------------------------------------
    def _registrations(self) -> list[tuple[str, torch.Tensor, nn.Module, bool]]:
        """(name, tensor, owning module, is_buffer) for every registration."""
        out: list[tuple[str, torch.Tensor, nn.Module, bool]] = []
        for prefix, sub in self.module.named_modules(remove_duplicate=False):
            for is_buffer, table in ((False, sub._parameters), (True, sub._buffers)):
                out += [(f"{prefix}.{n}" if prefix else n, t, sub, is_buffer)
                        for n, t in table.items() if t is not None]
        return out

    def _inventory(self) -> None:
        regs = self._registrations()
        self._buffers_of: dict[int, list[_Slot]] = {}
        # Where each tensor is registered, to notice a replaced Parameter cheaply.
        self._where = [(sub._buffers if is_buffer else sub._parameters, n.rsplit(".", 1)[-1], t)
                       for n, t, sub, is_buffer in regs]
        self._registration_count = len(regs)
        slots: dict[int, _Slot] = {}
        for n, t, owner, is_buffer in regs:
            self._check_tensor(n, t)
            if id(t) not in slots:
                slots[id(t)] = _Slot(t, [], int(t.storage_offset()) * t.element_size())
            slots[id(t)].names.append(n)
            if is_buffer:
                self._buffers_of.setdefault(id(owner), []).append(slots[id(t)])
        storages: dict[tuple[str, int], _Storage] = {}
        for slot in slots.values():
            st = slot.tensor.untyped_storage()
            key = (str(slot.tensor.device), st.data_ptr())
            if key not in storages:
                storages[key] = _Storage(st.nbytes(), [])
            storages[key].slots.append(slot)
        grouped: dict[str, list[_Storage]] = {}
        for st_ in storages.values():
            grouped.setdefault(self._unit_key(st_), []).append(st_)
        self.units = []
        for layer_key, group in grouped.items():
            if layer_key:
                self.units.append(self._make_unit(layer_key, group))
            else:
                self.units += [self._make_unit(st_.slots[0].names[0], [st_]) for st_ in group]
        self.by_key = {u.key: u for u in self.units}
        self._all_slots = [slot for u in self.units for slot in u.slot_list]
        for u in self.units:
            on_device = all(s.tensor.device == self.layer.device for s in u.slot_list)
            u.where = "device" if on_device else "host"
            for slot in u.slot_list:
                slot.record()

    def _check_tensor(self, name: str, t: torch.Tensor) -> None:
        where = f"tensor {name!r} of component {self.name!r}"
        if t.is_meta:
            raise StoreError(f"{where} is on the meta device (no data); load real weights "
                             "before attaching")
        if t.is_inference():
            raise StoreError(f"{where} is an inference tensor (made under torch.inference_mode): "
                             "it cannot be tracked or updated in place; build or load the "
                             "module outside inference_mode")
        if t.layout != torch.strided:
            raise StoreError(f"{where} has layout {t.layout}; only dense (strided) tensors "
                             "are supported")
        if t.device.type != "cpu" and t.device != self.layer.device:
            raise StoreError(f"{where} is on {t.device}; expected {self.layer.device} or cpu")

    def _unit_key(self, st: _Storage) -> str:
        """The layer a storage belongs to, or '' when it is not wholly inside one layer."""
        if self.whole:
            return WHOLE
        keys = {self._layer_of(n) for s in st.slots for n in s.names}
        return keys.pop() if len(keys) == 1 else ""

    def _layer_of(self, name: str) -> str:
        for key in self.layer_keys:
            if name.startswith(key + "."):
                return key
        return ""

    @staticmethod
    def _make_unit(key: str, storages: list[_Storage]) -> Unit:
        offset = end = 0
        for st in storages:
            st.offset = offset
            end = offset + st.nbytes
            offset = _align(end)
        return Unit(key, storages, nbytes=end)

    def structure_changed(self, deep: bool = False) -> bool:
        """Whether a registered tensor was replaced or removed since inventory (a few dict
        look-ups per tensor); ``deep`` also walks the module tree for added tensors."""
        if any(table.get(key) is not t for table, key, t in self._where):
            return True
        return deep and len(self._registrations()) != self._registration_count

    def rescan(self) -> None:
        """Take inventory again (after the module's structure changed while on device)."""
        if any(u.where == "host" for u in self.units):
            raise StoreError(f"component {self.name!r} changed structure while offloaded")
        self._inventory()

    def note_training_forward(self, module: nn.Module) -> None:
        """``module`` ran a forward in training mode: its buffers may have been written by
        kernels that do not bump the version counter (batch-norm running statistics)."""
        for slot in self._buffers_of.get(id(module), ()):
            slot.version = -1

    def drifted(self) -> list[str]:
        """Names of tensors re-pointed behind the store's back (``p.data = other``)."""
        return [s.names[0] for s in self._all_slots if s.tensor.data_ptr() != s.ptr]

    def mark_dirty(self) -> None:
        """Declare every mirror stale (after writes that bypass the version counter)."""
        for u in self.units:
            if u.where == "device":
                u.mirror_current = False

    # -- mirrors -------------------------------------------------------------------
    def ensure_mirror(self, unit: Unit) -> bool:
        """Allocate ``unit``'s host mirror if it has none; True when it was allocated now."""
        if unit.host is not None:
            return False
        unit.host = self.layer.alloc(unit.nbytes, "host")
        for st in unit.storages:
            for slot in st.slots:
                slot.host_view = slot.view_of(unit.host, st.offset)
        unit.mirror_current = False
        return True

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
        for unit in units:
            self.ensure_mirror(unit)
            pairs += self._copy_out_pairs(unit)
        await self.layer.copy(pairs, "host")
        for unit in units:
            self.point_to_host(unit)
        return sum(u.nbytes for u in units)

    # -- re-pointing (the commit of every move) -----------------------------------------
    def point_to_device(self, unit: Unit, buf: torch.Tensor) -> None:
        """Re-point ``unit``'s tensors at ``buf`` (its bytes already copied in)."""
        for st in unit.storages:
            for slot in st.slots:
                slot.tensor.data = slot.view_of(buf, st.offset)
                slot.record()
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
    def select(self, where: Tier, keys: Iterable[str] | None = None,
               pred: Callable[[Unit], bool] | None = None) -> list[Unit]:
        """Units currently on ``where``, optionally only those in ``keys`` / matching ``pred``."""
        units = self.units if keys is None else [self.by_key[k] for k in keys]
        return [u for u in units if u.where == where and (pred is None or pred(u))]

    async def _copy(self, pairs: list[CopyPair], to: Tier, progress: Progress | None) -> None:
        """Copy in chunks of about :data:`CHUNK` bytes, telling ``progress`` after each (a
        progress bar, and a cancellation point between chunks)."""
        chunk: list[CopyPair] = []
        size = 0
        for pair in pairs:
            chunk.append(pair)
            size += pair[0].nbytes
            if size >= CHUNK:
                await self.layer.copy(chunk, to)
                if progress:
                    progress(size)
                chunk, size = [], 0
        await self.layer.copy(chunk, to)
        if progress and size:
            progress(size)

    async def prepare_to_device(self, units: Sequence[Unit],
                                progress: Progress | None = None) -> Move:
        """Allocate device buffers for ``units`` (on the host) and copy their mirrors in."""
        move = Move(self, "device", list(units))
        pairs: list[CopyPair] = []
        try:
            for unit in move.units:
                assert unit.where == "host" and unit.host is not None
                buf = self.layer.alloc(unit.nbytes, "device")
                move.buffers.append(buf)
                self.pending_bytes += unit.nbytes
                pairs.append((buf, unit.host))
            await self._copy(pairs, "device", progress)
        except BaseException as exc:
            move.rollback()
            forget_locals(exc)
            raise
        move.bytes_copied = sum(u.nbytes for u in move.units)
        return move

    async def prepare_to_host(self, units: Sequence[Unit], copy_back: bool = True,
                              progress: Progress | None = None) -> Move:
        """Bring ``units``' mirrors up to date (copying only dirty units, and only if
        ``copy_back``); the device bytes are released at commit."""
        move = Move(self, "host", list(units))
        pairs: list[CopyPair] = []
        try:
            for unit in move.units:
                assert unit.where == "device"
                if self.ensure_mirror(unit):
                    move.new_mirrors.append(unit)
                if copy_back and unit.dirty():
                    pairs += self._copy_out_pairs(unit)
                    move.bytes_copied += unit.nbytes
                elif not copy_back and not unit.mirror_current:
                    raise StoreError(f"unit {unit.key!r} of component {self.name!r} has no "
                                     "current host copy to fall back to")
            await self._copy(pairs, "host", progress)
        except BaseException as exc:
            move.rollback()
            forget_locals(exc)
            raise
        return move

    # -- synchronous moves, for forward hooks ----------------------------------------
    def start_fetch(self, unit: Unit) -> Fetch:
        """Allocate ``unit``'s device buffer and start copying its mirror in."""
        assert unit.where == "host" and unit.host is not None
        buf = self.layer.alloc(unit.nbytes, "device")
        handle = self.layer.start_copy([(buf, unit.host)], "device")
        self.pending_bytes += unit.nbytes
        return Fetch(self, unit, buf, handle)

    def evict(self, unit: Unit) -> int:
        """Send ``unit`` back to its mirror now, copying first only if it changed on the
        device. Returns the bytes copied."""
        assert unit.where == "device"
        copied = 0
        if unit.dirty():
            self.ensure_mirror(unit)
            # The compute stream waits for the copy, so the freed buffer is not reused early;
            # the host waits too, since the mirror is read as soon as it is re-pointed.
            self.layer.start_copy(self._copy_out_pairs(unit), "host").wait()
            self.layer.synchronize()
            copied = unit.nbytes
        self.point_to_host(unit)
        return copied

    @staticmethod
    def _copy_out_pairs(unit: Unit) -> list[CopyPair]:
        assert unit.host is not None
        if unit.device_buf is not None:
            return [(unit.host, unit.device_buf)]
        return [(unit.host[st.offset:st.offset + st.nbytes], st.source_bytes())
                for st in unit.storages]

    # -- introspection -------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Bytes on the device: placed units and buffers of moves in flight."""
        return sum(u.nbytes for u in self.units if u.where == "device") + self.pending_bytes

    def report(self) -> StoreReport:
        device = self.device_bytes
        host = sum(u.nbytes for u in self.units if u.host is not None)
        return StoreReport(device, host, host if self.layer.pinned else 0)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor once, under its first name, sorted by name."""
        return sorted(((s.names[0], s.tensor) for u in self.units for s in u.slot_list),
                      key=lambda nt: nt[0])
