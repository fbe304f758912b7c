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

import functools
import itertools
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ._chunks import chunked
from ._device import CopyHandle, CopyPair, DeviceLayer, Tier
from ._errors import ResidencyError
from ._write import WriteMove, WriteSource, cancel_refresh, land_refresh, prepare_write

if TYPE_CHECKING:
    from ._discard import Discarded

__all__ = ["ALIGN", "CHUNK", "Fetch", "Move", "PreparedMove", "Progress", "StoreError", "StoreReport",
           "TensorStore", "Unit", "forget_locals"]

# Byte alignment of every storage inside a unit buffer: keeps dtype views legal, and GEMM
# libraries pick the same kernels as for a fresh allocation (they look at pointer alignment).
ALIGN = 256
WHOLE = "(component)"  # the unit key of a store made with whole=True
CHUNK = 256 * 2**20  # bytes per copy batch: progress and cancellation points in between
Progress = Callable[[int], None]  # told the bytes of each copied chunk


class StoreError(ResidencyError, ValueError):
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
    # A parameter or persistent buffer (a ``state_dict()`` tensor): what an update can bring
    # back, so what a discarding sleep may drop (see strategies._discard).
    state: bool = False
    stale: bool = False  # discarded: its contents are undefined until an update writes it
    # Its strides in its storage (a discarded tensor's placeholder has others).
    stride: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.stride:
            self.stride = tuple(self.tensor.stride())

    def view_of(self, buf: torch.Tensor, byte_offset: int) -> torch.Tensor:
        """A tensor with this slot's dtype, shape and strides over ``buf`` at ``byte_offset``."""
        t = self.tensor
        itemsize = t.element_size()
        start = buf.storage_offset() + byte_offset + self.byte_offset
        return torch.empty(0, dtype=t.dtype, device=buf.device).set_(
            buf.untyped_storage(), start // itemsize, t.shape, self.stride)

    def record(self) -> None:
        self.version = self.tensor._version
        self.ptr = self.tensor.data_ptr()


@dataclass(eq=False)
class _Storage:
    """One untyped storage (or one self-contained region of it) and the tensor objects that
    view it."""

    nbytes: int
    slots: list[_Slot]
    offset: int = 0  # inside the unit's buffers
    base: int = 0  # where the region starts in the untyped storage the tensors view now
    # The storage the module came with: (token, its bytes); regions split from one storage
    # share it, so that detach can give the module its storages back as they were.
    origin: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.origin == (0, 0):
            self.origin = (next(_origins), self.nbytes)

    def source_bytes(self) -> torch.Tensor:
        """The storage's live bytes, wherever they are, as a 1-D uint8 tensor."""
        t = self.slots[0].tensor
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        return whole[self.base:self.base + self.nbytes]


_origins = itertools.count(1)


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last one in its storage."""
    if t.numel() == 0:
        return 0
    elements = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(),
                                                                         strict=True))
    return elements * t.element_size()


def _split(st: _Storage) -> list[_Storage]:
    """A storage whose tensors fall into disjoint byte ranges (a flat buffer several
    parameters were packed into, as another offloading tool or a previous flat placement
    leaves them) as one region per group of overlapping tensors, so that each region can
    move on its own (one layer's weights with its layer). Views that overlap stay together;
    a storage with one group is returned as it is."""
    if len(st.slots) < 2:
        return [st]
    ranges = sorted(((s.byte_offset, s.byte_offset + _span(s.tensor)), s) for s in st.slots)
    groups: list[tuple[int, int, list[_Slot]]] = []
    for (start, end), slot in ranges:
        if groups and start < groups[-1][1]:
            g_start, g_end, members = groups[-1]
            groups[-1] = (g_start, max(g_end, end), [*members, slot])
        else:
            groups.append((start, end, [slot]))
    if len(groups) == 1:
        return [st]
    out = []
    for start, end, members in groups:
        for slot in members:
            slot.byte_offset -= start
        out.append(_Storage(end - start, members, base=start, origin=st.origin))
    return out


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
        # A plain loop, not any(generator): a clean sleep runs this once per unit.
        for s in self.slot_list:  # noqa: SIM110
            if s.tensor._version != s.version:
                return True
        return False


@dataclass(frozen=True)
class StoreReport:
    """Where a store's bytes are right now."""

    device_bytes: int
    host_bytes: int
    pinned_bytes: int


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

    def _forget_buffers(self) -> None:
        self.store.add_pending(-sum(u.nbytes for u, _ in zip(self.units, self.buffers,
                                                             strict=False)))
        self.buffers.clear()

    def rollback(self) -> None:
        """Forget the prepared buffers; mirrors allocated for this move are freed too."""
        self._forget_buffers()
        for unit in self.new_mirrors:
            self.store.drop_mirror(unit)

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


_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})


@functools.cache
def _dtensor_type() -> type | None:
    """DTensor, imported once, on first need (it pulls in torch.distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(t, kind)


@dataclass(eq=False)
class _Registration:
    """One place a tensor is found: ``table[key] is tensor``."""

    name: str
    tensor: torch.Tensor
    owner: nn.Module
    kind: str  # "parameter", "buffer" or "attribute"
    table: Any
    key: object


@dataclass(eq=False)
class _Derived:
    """A tensor attribute a forward pre-hook recomputes from the module's parameters on every
    forward (``torch.nn.utils.weight_norm``'s ``weight``, ``spectral_norm``'s). It is not
    stored: when its parameters leave the device it is released (an empty placeholder; the
    hook recomputes it before any forward), when they are all back it is recomputed there,
    bit for bit what the hook computes."""

    module: nn.Module
    name: str
    hook: Any
    sources: list[Unit] = field(default_factory=list)

    def full_nbytes(self) -> int:
        """Bytes of the attribute when computed: the size of the weight it stands for."""
        source = "_v" if isinstance(self.hook, WeightNorm) else "_orig"
        weight = getattr(self.module, self.name + source)
        return int(weight.nbytes)

    def nbytes(self) -> int:
        """Device bytes the attribute holds now (0 once released)."""
        value = getattr(self.module, self.name, None)
        placed = all(u.where == "device" for u in self.sources)
        return value.nbytes if placed and isinstance(value, torch.Tensor) else 0

    def refresh(self, placed: bool, track: Callable[[torch.Tensor], None] | None = None) -> None:
        current = getattr(self.module, self.name, None)
        dtype = current.dtype if isinstance(current, torch.Tensor) else torch.float32
        with torch.no_grad():
            if not placed:
                value = torch.empty(0, dtype=dtype)
            elif isinstance(self.hook, SpectralNorm):
                value = self.hook.compute_weight(self.module, do_power_iteration=False)
            else:
                value = self.hook.compute_weight(self.module)
        setattr(self.module, self.name, value)
        if placed and track is not None:
            track(value)


def _unview(t: torch.Tensor) -> None:
    """Make ``t`` (same Python object, same storage, same bytes) stop being a view.

    A view keeps its ``_base`` tensor alive, and ``.data = other`` does not drop it: a buffer
    registered as a slice of a temporary (``pe[:, :n]``, ``arange(n).expand(1, -1)``,
    ``weight.detach()[0]``) would keep that temporary's *original* storage, on the device,
    alive after every sleep. ``torch.utils.swap_tensors`` gives the object a plain alias of
    its storage instead. Not done for a view that requires grad (its base is a parameter,
    which moves with it), a tensor subclass, or one with weak references (which swapping
    refuses): those keep their base."""
    if t._base is None or t.requires_grad or type(t) is not torch.Tensor:
        return  # (a subclass: swapping would hand the object another class)
    with torch.inference_mode(False):  # (an attach under inference_mode: a normal tensor)
        alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    try:
        torch.utils.swap_tensors(t, alias)  # type: ignore[no-untyped-call]
    except RuntimeError:
        return  # weakly referenced: left a view (its base stays alive)


def _derived_of(module: nn.Module) -> list[_Derived]:
    return [_Derived(module, h.name, h) for h in module._forward_pre_hooks.values()
            if isinstance(h, WeightNorm | SpectralNorm)]


class TensorStore:
    """The inventory and placement of one component's tensors.

    ``layers``: dotted prefixes (``"blocks.3"``) whose tensors form one unit each; every other
    storage is a unit of its own. ``whole``: the whole component is one unit (one host buffer,
    one device buffer, one copy): for components that always move together.
    """

    def __init__(self, name: str, module: nn.Module, layer: DeviceLayer,
                 layers: Sequence[str] = (), *, whole: bool = False,
                 refuse_dtensors: bool = True, layout: TensorStore | None = None) -> None:
        self.name = name
        # ``layout``: another store of the same module whose storages (which tensors share
        # storage, each storage's size) are taken over instead of those the tensors point
        # into now: after a whole-component or per-layer move every tensor views one flat
        # buffer, and a new grouping must still see the storages the module came with.
        self._layout = layout
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
        self.units: list[Unit] = []
        self.by_key: dict[str, Unit] = {}
        self._all_slots: list[_Slot] = []
        self.stale_count = 0  # tensors whose contents are undefined (see count_stale)
        self._inventory()
        self._layout = None  # taken over: do not keep the other store (and its buffers) alive

    def add_pending(self, nbytes: int) -> None:
        """Count device bytes allocated for a move in flight (negative: no longer)."""
        with self._pending_lock:
            self.pending_bytes += nbytes

    # -- inventory -----------------------------------------------------------------
    def _registrations(self) -> list[_Registration]:
        """Every tensor reachable from the module's tree: parameters and buffers first, then
        plain tensor attributes (``_``-prefixed too) and tensors in list, tuple and dict
        attributes (rotary tables, caches). Attributes a forward pre-hook recomputes from
        parameters (``weight_norm``, ``spectral_norm``) are not tensors of their own: see
        :class:`_Derived`."""
        out: list[_Registration] = []
        attrs: list[_Registration] = []
        for prefix, sub in self.module.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
                out += [_Registration(dot + n, t, sub, kind, table, n)
                        for n, t in table.items() if t is not None]
            derived = {d.name for d in _derived_of(sub)}
            for attr, value in vars(sub).items():
                if attr in _MODULE_TABLES or attr in derived:
                    continue
                if isinstance(value, torch.Tensor):
                    attrs.append(_Registration(dot + attr, value, sub, "attribute",
                                               sub.__dict__, attr))
                    continue
                items: list[tuple[object, object]] = []
                if isinstance(value, list | tuple):
                    items = list(enumerate(value))
                elif isinstance(value, dict):
                    items = list(value.items())
                found = [(k, v) for k, v in items if isinstance(v, torch.Tensor)]
                if found:
                    # The container itself is watched too (a tuple is replaced, not edited).
                    self._watch.append((sub.__dict__, attr, value))
                attrs += [_Registration(f"{dot}{attr}[{k!r}]", v, sub, "attribute", value, k)
                          for k, v in found]
        # An attribute with no bytes (or none yet: meta) has nothing to place.
        return out + [r for r in attrs if r.tensor.is_meta is False and r.tensor.numel()]

    def _inventory(self) -> None:
        # Stale tensors stay stale through a new inventory (a rescan, a regroup): their bytes
        # are still undefined.
        stale = {id(s.tensor) for s in self._all_slots if s.stale}
        if self._layout is not None:
            stale |= {id(s.tensor) for s in self._layout._all_slots if s.stale}
        self._watch: list[tuple[Any, object, object]] = []
        regs = self._registrations()
        self._buffers_of: dict[int, list[_Slot]] = {}
        # Where each tensor is found, to notice a replaced tensor cheaply.
        self._watch += [(r.table, r.key, r.tensor) for r in regs]
        slots: dict[int, _Slot] = {}
        # DTensors of an FSDP-managed component are FSDP's to place: not inventoried (so not
        # moved, updated or hashed by us), but their local shards count as device bytes.
        fsdp_owned: dict[int, int] = {}
        for r in regs:
            self._check_tensor(r.name, r.tensor, r.kind)
            t = r.tensor
            if not self.refuse_dtensors and _is_dtensor(t):
                fsdp_owned[id(t)] = int(t.to_local().nbytes)  # type: ignore[attr-defined]
                continue
            if id(t) not in slots:
                _unview(t)
                slots[id(t)] = _Slot(t, [], int(t.storage_offset()) * t.element_size())
            slots[id(t)].names.append(r.name)
            slots[id(t)].state |= r.kind == "parameter" or (
                r.kind == "buffer" and r.key not in r.owner._non_persistent_buffers_set)
            if r.kind == "buffer":
                self._buffers_of.setdefault(id(r.owner), []).append(slots[id(t)])
        if self._layout is not None:
            regions = self._storages_from(self._layout, slots)
        else:
            storages: dict[tuple[str, int], _Storage] = {}
            for slot in slots.values():
                st = slot.tensor.untyped_storage()
                key = (str(slot.tensor.device), st.data_ptr())
                if key not in storages:
                    storages[key] = _Storage(st.nbytes(), [])
                storages[key].slots.append(slot)
            regions = [r for st_ in storages.values() for r in _split(st_)]
        grouped: dict[str, list[_Storage]] = {}
        for st_ in regions:
            grouped.setdefault(self._unit_key(st_), []).append(st_)
        self.units = []
        for layer_key, group in grouped.items():
            if layer_key:
                self.units.append(self._make_unit(layer_key, group))
            else:
                self.units += [self._make_unit(st_.slots[0].names[0], [st_]) for st_ in group]
        self.by_key = {u.key: u for u in self.units}
        self._by_name: dict[str, tuple[_Slot, Unit]] | None = None
        self._all_slots = [slot for u in self.units for slot in u.slot_list]
        for slot in self._all_slots:
            slot.stale = id(slot.tensor) in stale
        self.count_stale()
        self._unit_of_storage = {id(st): u for u in self.units for st in u.storages}
        for u in self.units:
            on_device = all(s.tensor.device == self.layer.device for s in u.slot_list)
            u.where = "device" if on_device else "host"
            for slot in u.slot_list:
                slot.record()
                if self._layout is None and u.where == "device":
                    # The module's own device storages (attach, rescan) count as held. A
                    # regrouped store's are the old store's buffers, counted already (and on
                    # the CPU a host mirror is a "cpu" tensor too: never count it).
                    self.layer.track(slot.tensor)
        self._inventory_derived(slots)
        self.fsdp_bytes = sum(fsdp_owned.values())

    def _storages_from(self, layout: TensorStore, slots: dict[int, _Slot]) -> list[_Storage]:
        """``layout``'s storages over this inventory's slots (same tensors, same offsets)."""
        old = {id(s.tensor): s for u in layout.units for s in u.slot_list}
        if old.keys() != slots.keys():
            raise StoreError(f"component {self.name!r} changed structure since it was "
                             "attached (tensors replaced, added or removed); cannot regroup it")
        out: list[_Storage] = []
        for st in layout.storages():
            new_slots = []
            for s in st.slots:
                slot = slots[id(s.tensor)]
                slot.byte_offset = s.byte_offset
                new_slots.append(slot)
            # ``base`` is where the region sits in the storage the tensors view *now*:
            # wherever the old store placed it, its bytes are found through ``locate``.
            out.append(_Storage(st.nbytes, new_slots, base=st.base, origin=st.origin))
        return out

    def storages(self) -> list[_Storage]:
        """Every storage, in unit order."""
        return [st for u in self.units for st in u.storages]

    def source_of(self, st: _Storage, to: Tier) -> torch.Tensor | None:
        """Storage ``st``'s current bytes to copy to tier ``to``: the copy already on that
        tier when there is one (no trip over the link), else the other; None for a storage a
        discarding sleep dropped (its bytes are gone)."""
        _, on_device, on_host = self.locate(st)
        first, second = (on_device, on_host) if to == "device" else (on_host, on_device)
        return first if first is not None else second

    def locate(self, st: _Storage) -> tuple[Unit, torch.Tensor | None, torch.Tensor | None]:
        """Where storage ``st``'s bytes are now: its unit, a device view and a host view of
        exactly its bytes (``None`` where it has none; the host view only if the mirror is
        current, i.e. equal to the device bytes or the live copy itself)."""
        unit = self._unit_of_storage[id(st)]
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

    def _inventory_derived(self, slots: dict[int, _Slot]) -> None:
        """Attach each recomputed attribute to the units holding its module's parameters."""
        unit_of = {id(slot): u for u in self.units for slot in u.slot_list}
        self.derived: list[_Derived] = []
        for _, sub in self.module.named_modules():
            for d in _derived_of(sub):
                sources = {id(u): u for p in sub._parameters.values() if p is not None
                           if (slot := slots.get(id(p))) is not None
                           if (u := unit_of.get(id(slot))) is not None}
                d.sources = list(sources.values())
                self.derived.append(d)

    def derived_nbytes(self, unit: Unit) -> int:
        """Device bytes of the derived attributes computed from ``unit``'s parameters while
        it is placed (they come and go with it)."""
        return sum(d.full_nbytes() for d in self.derived if any(u is unit for u in d.sources))

    def refresh_derived(self, units: Iterable[Unit]) -> None:
        """After ``units`` moved: recompute the derived attributes whose parameters are all
        on the device now; release (an empty placeholder) those whose parameters left."""
        if not self.derived:  # most modules (and a clean sleep's hot path): nothing to do
            return
        moved = {id(u) for u in units}
        for d in self.derived:
            if any(id(u) in moved for u in d.sources):
                d.refresh(all(u.where == "device" for u in d.sources), self.layer.track)

    def _check_tensor(self, name: str, t: torch.Tensor, kind: str) -> None:
        what = "tensor" if kind != "attribute" else "tensor attribute (neither parameter nor buffer)"
        where = f"{what} {name!r} of component {self.name!r}"
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
        if self.refuse_dtensors and _is_dtensor(t):
            raise StoreError(
                f"{where} is a DTensor (sharded by tensor parallelism): torch ignores a new "
                "`.data` on it and its storage is not the local shard's, so it cannot be "
                "released or restored; attach each rank's local modules unsharded, or keep the "
                "component FSDP-managed and resident")

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

    def structure_changed(self) -> list[str]:
        """Names of tensors replaced or removed since inventory (a few look-ups per
        tensor): ``p = nn.Parameter(...)`` assignments, caches a forward re-created."""
        out = []
        for table, key, obj in self._watch:
            try:  # a plain look-up: this runs for every tensor before every sleep
                if table[key] is obj:
                    continue
            except (KeyError, IndexError, TypeError):
                pass
            out.append(key if isinstance(key, str) else f"[{key!r}]")
        return out

    def rescan(self) -> None:
        """Take inventory again (after the module's structure changed while on device)."""
        if any(u.where == "host" for u in self.units):
            changed = self.structure_changed() or self.drifted()
            raise StoreError(f"component {self.name!r} changed structure while offloaded: "
                             f"tensor(s) {changed[:8]} were replaced behind the controller; "
                             "only a resident component can be taken inventory of again")
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
        self.adopt_mirror(unit, self.layer.alloc(unit.nbytes, "host"))
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
            await anyio.to_thread.run_sync(allocate)
        else:
            allocate()

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
    def slot_named(self, name: str) -> tuple[_Slot, Unit]:
        """The tensor called ``name`` (any of its names) and its unit; KeyError if none."""
        if self._by_name is None:
            self._by_name = {n: (slot, u) for u in self.units for slot in u.slot_list
                             for n in slot.names}
        return self._by_name[name]

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
        """Copy ``(dst, src)`` pairs in chunks of about :data:`CHUNK` bytes, telling
        ``progress`` after each (a progress bar, and a cancellation point between chunks)."""
        for chunk in chunked(pairs, lambda pair: int(pair[0].nbytes), CHUNK):
            await self.layer.copy(chunk, to)
            if progress:
                progress(sum(int(dst.nbytes) for dst, _ in chunk))

    async def prepare_to_device(self, units: Sequence[Unit],
                                progress: Progress | None = None) -> Move:
        """Allocate device buffers for ``units`` (on the host) and copy their mirrors in."""
        move = Move(self, "device", list(units))
        pairs: list[CopyPair] = []
        try:
            for unit in move.units:
                assert unit.where == "host" and unit.host is not None
                buf = self.layer.alloc(unit.nbytes, "device")
                self.layer.label(buf, self.name, unit.key)
                move.buffers.append(buf)
                self.add_pending(unit.nbytes)
                pairs.append((buf, unit.host))
            await self.copy_pairs(pairs, "device", progress)
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
        except BaseException as exc:
            move.rollback()
            forget_locals(exc)
            raise
        return move

    # -- synchronous moves, for forward hooks ----------------------------------------
    def start_fetch(self, unit: Unit) -> Fetch:
        """Allocate ``unit``'s device buffer and start copying its mirror in.

        The buffer is allocated on the compute stream and the copy runs on the copy stream,
        after the compute work queued so far (see :class:`~strategies._cuda.CudaDevice`).
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
    @property
    def device_bytes(self) -> int:
        """Bytes on the device: placed units, buffers of moves in flight, and derived
        attributes recomputed from placed parameters."""
        return sum(u.nbytes for u in self.units if u.where == "device") + self.pending_bytes \
            + sum(d.nbytes() for d in self.derived) + self.fsdp_bytes

    def report(self) -> StoreReport:
        device = self.device_bytes
        hosts = [u.nbytes for u in self.units if u.host is not None]
        if self.discarded is not None and self.discarded.nbytes:
            hosts.append(self.discarded.nbytes)
        pinned = sum(self.layer.pinned_footprint(n) for n in hosts) if self.layer.pinned else 0
        return StoreReport(device, sum(hosts), pinned)

    def count_stale(self) -> int:
        """Count the stale tensors again (after a move marked or cleared some): kept in
        :attr:`stale_count`, which forward checks read."""
        self.stale_count = sum(1 for s in self._all_slots if s.stale)
        return self.stale_count

    def stale_names(self) -> list[str]:
        """The tensors whose contents are undefined (discarded), under their first names."""
        return sorted(s.names[0] for s in self._all_slots if s.stale)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor once, under its first name, sorted by name."""
        return sorted(((s.names[0], s.tensor) for u in self.units for s in u.slot_list),
                      key=lambda nt: nt[0])
