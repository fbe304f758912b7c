"""The tensors of one module, as a :class:`~strategies._store.TensorStore` manages them.

:func:`take_inventory` finds every tensor reachable from a module's tree: parameters and
buffers (persistent or not), then plain tensor attributes and tensors in list, tuple and
dict attributes. Each tensor object is one :class:`Slot` however many names it has (tied
weights); slots are grouped by the storage they view (:class:`Storage`: views share one),
a flat buffer several tensors were packed into is split into one region per group of
overlapping tensors, and storages are grouped again into *units* that move together
(:class:`Unit`: one storage, one layer, or the whole component). Attributes a forward
pre-hook recomputes from parameters (``weight_norm``, ``spectral_norm``) are no slots: they
are :class:`Derived`, released and recomputed with their parameters.

The placement state lives here as plain data (a unit's tier, host mirror and device buffer;
a slot's version, address, host view, and whether its contents are ``stale``); the store's
moves change it. An :class:`Inventory` is not changed after it is taken: a new one replaces
it (a rescan, a regroup), and slots discarded (stale) stay stale in the new one.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ._errors import StoreError
from .devices import Tier

__all__ = ["ALIGN", "Derived", "Inventory", "Slot", "Storage", "Unit", "aligned",
           "take_inventory"]

# Byte alignment of every storage inside a unit buffer: keeps dtype views legal, and GEMM
# libraries pick the same kernels as for a fresh allocation (they look at pointer alignment).
ALIGN = 256
WHOLE = "(component)"  # the unit key of an inventory taken with whole=True


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class Slot:
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
    # Its dtype and shape at inventory: what a change made behind the store's back (a
    # ``module.to(torch.float64)``) is described against.
    meta: tuple[torch.dtype, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if not self.stride:
            self.stride = tuple(self.tensor.stride())
        if self.meta is None:
            self.meta = (self.tensor.dtype, tuple(self.tensor.shape))

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


_origins = itertools.count(1)


@dataclass(eq=False)
class Storage:
    """One untyped storage (or one self-contained region of it) and the tensor objects that
    view it."""

    nbytes: int
    slots: list[Slot]
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


@dataclass(eq=False)
class Unit:
    """Storages that move together: one host region, one device buffer."""

    key: str
    storages: list[Storage]
    nbytes: int = 0
    where: Tier = "device"
    host: torch.Tensor | None = None
    device_buf: torch.Tensor | None = None  # our own device buffer (None: adopted storages)
    mirror_current: bool = False
    slot_list: list[Slot] = field(default_factory=list)  # flattened: hot loops use it

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


@dataclass(eq=False)
class Derived:
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


def _derived_of(module: nn.Module) -> list[Derived]:
    return [Derived(module, h.name, h) for h in module._forward_pre_hooks.values()
            if isinstance(h, WeightNorm | SpectralNorm)]


@dataclass(eq=False)
class Inventory:
    """One module's tensors, as :func:`take_inventory` found them."""

    units: list[Unit]
    slots: list[Slot]  # every slot once, in unit order
    derived: list[Derived]
    # Bytes of the local shards of the DTensors FSDP places (not inventoried: FSDP's to place).
    fsdp_bytes: int = 0
    # id(module) -> the slots of its buffers (see TensorStore.note_training_forward).
    buffers_of: dict[int, list[Slot]] = field(default_factory=dict)
    # Where each tensor (and each container of tensors) was found: (table, key, object).
    watch: list[tuple[Any, object, object]] = field(default_factory=list)
    stale_count: int = 0  # tensors whose contents are undefined (see count_stale)
    by_key: dict[str, Unit] = field(init=False)
    _unit_of_storage: dict[int, Unit] = field(init=False)
    _by_name: dict[str, tuple[Slot, Unit]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.by_key = {u.key: u for u in self.units}
        self._unit_of_storage = {id(st): u for u in self.units for st in u.storages}
        self.count_stale()

    def storages(self) -> list[Storage]:
        """Every storage, in unit order."""
        return [st for u in self.units for st in u.storages]

    def unit_of(self, st: Storage) -> Unit:
        return self._unit_of_storage[id(st)]

    def slot_named(self, name: str) -> tuple[Slot, Unit]:
        """The tensor called ``name`` (any of its names) and its unit; KeyError if none."""
        if self._by_name is None:
            self._by_name = {n: (slot, u) for u in self.units for slot in u.slot_list
                             for n in slot.names}
        return self._by_name[name]

    def count_stale(self) -> int:
        """Count the stale tensors again (after a move marked or cleared some): kept in
        :attr:`stale_count`, which forward checks read."""
        self.stale_count = sum(1 for s in self.slots if s.stale)
        return self.stale_count

    def stale_ids(self) -> set[int]:
        """``id()`` of the tensors whose contents are undefined (discarded)."""
        return {id(s.tensor) for s in self.slots if s.stale}

    def derived_nbytes(self, unit: Unit) -> int:
        """Device bytes of the derived attributes computed from ``unit``'s parameters while
        it is placed (they come and go with it)."""
        return sum(d.full_nbytes() for d in self.derived if any(u is unit for u in d.sources))

    def structure_changed(self) -> list[str]:
        """Names of tensors replaced or removed since inventory (a few look-ups per
        tensor): ``p = nn.Parameter(...)`` assignments, caches a forward re-created."""
        out = []
        for table, key, obj in self.watch:
            try:  # a plain look-up: this runs for every tensor before every sleep
                if table[key] is obj:
                    continue
            except (KeyError, IndexError, TypeError):
                pass
            out.append(key if isinstance(key, str) else f"[{key!r}]")
        return out

    def drifted(self) -> list[str]:
        """Names of tensors re-pointed behind the store's back (``p.data = other``)."""
        return [s.names[0] for s in self.slots if s.tensor.data_ptr() != s.ptr]

    def changes(self) -> list[str]:
        """What was changed behind the store's back, one entry per tensor, sorted by name:
        ``name: float32 -> float64`` (its dtype, shape or device), ``(replaced)`` after it
        when another object took its place (``module.to()`` replaces buffers), ``removed``,
        or ``re-pointed`` when only its storage changed."""
        slot_of = {id(s.tensor): s for s in self.slots}
        out: dict[str, str] = {}
        for table, key, obj in self.watch:
            try:
                now = table[key]
            except (KeyError, IndexError, TypeError):
                now = None
            if now is obj:
                continue
            slot = slot_of.get(id(obj))
            name = slot.names[0] if slot is not None else \
                (key if isinstance(key, str) else f"[{key!r}]")
            if now is None:
                out[name] = "removed"
            elif slot is not None and isinstance(now, torch.Tensor):
                change = _change(slot, now)
                out[name] = f"{change} (replaced)" if change else "replaced"
            else:
                out[name] = "replaced"
        for s in self.slots:
            if s.names[0] not in out and s.tensor.data_ptr() != s.ptr:
                out[s.names[0]] = _change(s, s.tensor) or "re-pointed"
        return [f"{name}: {what}" for name, what in sorted(out.items())]


def _change(slot: Slot, now: torch.Tensor) -> str:
    """How ``now`` differs from what ``slot`` held at inventory ('' if only its storage)."""
    assert slot.meta is not None
    dtype, shape = slot.meta
    parts = []
    if now.dtype != dtype:
        parts.append(f"{str(dtype).removeprefix('torch.')} -> "
                     f"{str(now.dtype).removeprefix('torch.')}")
    if tuple(now.shape) != shape:
        parts.append(f"shape {list(shape)} -> {list(now.shape)}")
    if now.device.type == "meta" or now.device != slot.tensor.device:
        parts.append(f"now on {now.device}")
    return ", ".join(parts)


_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})


@functools.cache
def _dtensor_type() -> type | None:
    """DTensor, imported once, on first need (it pulls in torch.distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
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


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last one in its storage."""
    if t.numel() == 0:
        return 0
    elements = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(),
                                                                         strict=True))
    return elements * t.element_size()


def _split(st: Storage) -> list[Storage]:
    """A storage whose tensors fall into disjoint byte ranges (a flat buffer several
    parameters were packed into, as another offloading tool or a previous flat placement
    leaves them) as one region per group of overlapping tensors, so that each region can
    move on its own (one layer's weights with its layer). Views that overlap stay together;
    a storage with one group is returned as it is."""
    if len(st.slots) < 2:
        return [st]
    ranges = sorted(((s.byte_offset, s.byte_offset + _span(s.tensor)), s) for s in st.slots)
    groups: list[tuple[int, int, list[Slot]]] = []
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
        out.append(Storage(end - start, members, base=start, origin=st.origin))
    return out


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


def _make_unit(key: str, storages: list[Storage]) -> Unit:
    offset = end = 0
    for st in storages:
        st.offset = offset
        end = offset + st.nbytes
        offset = aligned(end)
    return Unit(key, storages, nbytes=end)


@dataclass
class _Taking:
    """One taking of inventory: what it was asked, and what it found so far."""

    name: str
    module: nn.Module
    device: torch.device
    layer_keys: Sequence[str]
    whole: bool
    refuse_dtensors: bool
    watch: list[tuple[Any, object, object]] = field(default_factory=list)

    def registrations(self) -> list[_Registration]:
        """Every tensor reachable from the module's tree: parameters and buffers first, then
        plain tensor attributes (``_``-prefixed too) and tensors in list, tuple and dict
        attributes (rotary tables, caches). Attributes a forward pre-hook recomputes from
        parameters (``weight_norm``, ``spectral_norm``) are not tensors of their own: see
        :class:`Derived`."""
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
                    self.watch.append((sub.__dict__, attr, value))
                attrs += [_Registration(f"{dot}{attr}[{k!r}]", v, sub, "attribute", value, k)
                          for k, v in found]
        # An attribute with no bytes (or none yet: meta) has nothing to place.
        return out + [r for r in attrs if r.tensor.is_meta is False and r.tensor.numel()]

    def check_tensor(self, name: str, t: torch.Tensor, kind: str) -> None:
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
        if t.device.type != "cpu" and t.device != self.device:
            raise StoreError(f"{where} is on {t.device}; expected {self.device} or cpu")
        if self.refuse_dtensors and _is_dtensor(t):
            raise StoreError(
                f"{where} is a DTensor (sharded by tensor parallelism): torch ignores a new "
                "`.data` on it and its storage is not the local shard's, so it cannot be "
                "released or restored; attach each rank's local modules unsharded, or keep the "
                "component FSDP-managed and resident")

    def storages_from(self, layout: Inventory, slots: dict[int, Slot]) -> list[Storage]:
        """``layout``'s storages over this inventory's slots (same tensors, same offsets)."""
        old = {id(s.tensor): s for s in layout.slots}
        if old.keys() != slots.keys():
            raise StoreError(f"component {self.name!r} changed structure since it was "
                             "attached (tensors replaced, added or removed); cannot regroup it")
        out: list[Storage] = []
        for st in layout.storages():
            new_slots = []
            for s in st.slots:
                slot = slots[id(s.tensor)]
                slot.byte_offset = s.byte_offset
                new_slots.append(slot)
            # ``base`` is where the region sits in the storage the tensors view *now*:
            # wherever the old store placed it, its bytes are found through ``locate``.
            out.append(Storage(st.nbytes, new_slots, base=st.base, origin=st.origin))
        return out

    def unit_key(self, st: Storage) -> str:
        """The layer a storage belongs to, or '' when it is not wholly inside one layer."""
        if self.whole:
            return WHOLE
        keys = {self.layer_of(n) for s in st.slots for n in s.names}
        return keys.pop() if len(keys) == 1 else ""

    def layer_of(self, name: str) -> str:
        for key in self.layer_keys:
            if name.startswith(key + "."):
                return key
        return ""

    def derived(self, units: list[Unit], slots: dict[int, Slot]) -> list[Derived]:
        """Each recomputed attribute, attached to the units holding its module's parameters."""
        unit_of = {id(slot): u for u in units for slot in u.slot_list}
        out: list[Derived] = []
        for _, sub in self.module.named_modules():
            for d in _derived_of(sub):
                sources = {id(u): u for p in sub._parameters.values() if p is not None
                           if (slot := slots.get(id(p))) is not None
                           if (u := unit_of.get(id(slot))) is not None}
                d.sources = list(sources.values())
                out.append(d)
        return out


def take_inventory(name: str, module: nn.Module, device: torch.device,
                   on_device: Callable[[torch.Tensor], bool],
                   layer_keys: Sequence[str] = (), *, whole: bool = False,
                   refuse_dtensors: bool = True, layout: Inventory | None = None,
                   stale: Collection[int] = ()) -> Inventory:
    """The inventory of ``module`` (component ``name``) for a layer on ``device`` whose
    device tier holds the tensors ``on_device`` accepts (``DeviceLayer.on_device``).

    ``layer_keys``: dotted prefixes (``"blocks.3"``) whose tensors form one unit each; every
    other storage is a unit of its own. ``whole``: the whole module is one unit.
    ``refuse_dtensors``: a DTensor is refused (else it is FSDP's: left out, its local shard
    counted in :attr:`Inventory.fsdp_bytes`). ``layout``: an inventory of the same module
    whose storages (which tensors share storage, each storage's size) are taken over instead
    of those the tensors point into now: after a whole-component or per-layer move every
    tensor views one flat buffer, and a new grouping must still see the storages the module
    came with. ``stale``: ``id()`` of tensors that stay stale (besides ``layout``'s): their
    bytes are still undefined. Each unit is on the device when all its tensors are there, on
    the host otherwise; every slot's version and address are recorded."""
    taking = _Taking(name, module, device, tuple(layer_keys), whole, refuse_dtensors)
    stale = {*stale, *(layout.stale_ids() if layout is not None else ())}
    regs = taking.registrations()
    buffers_of: dict[int, list[Slot]] = {}
    # Where each tensor is found, to notice a replaced tensor cheaply.
    taking.watch += [(r.table, r.key, r.tensor) for r in regs]
    slots: dict[int, Slot] = {}
    # DTensors of an FSDP-managed component are FSDP's to place: not inventoried (so not
    # moved, updated or hashed by us), but their local shards count as device bytes.
    fsdp_owned: dict[int, int] = {}
    for r in regs:
        taking.check_tensor(r.name, r.tensor, r.kind)
        t = r.tensor
        if not refuse_dtensors and _is_dtensor(t):
            fsdp_owned[id(t)] = int(t.to_local().nbytes)  # type: ignore[attr-defined]
            continue
        if id(t) not in slots:
            _unview(t)
            slots[id(t)] = Slot(t, [], int(t.storage_offset()) * t.element_size())
        slots[id(t)].names.append(r.name)
        slots[id(t)].state |= r.kind == "parameter" or (
            r.kind == "buffer" and r.key not in r.owner._non_persistent_buffers_set)
        if r.kind == "buffer":
            buffers_of.setdefault(id(r.owner), []).append(slots[id(t)])
    if layout is not None:
        regions = taking.storages_from(layout, slots)
    else:
        storages: dict[tuple[str, int], Storage] = {}
        for slot in slots.values():
            st = slot.tensor.untyped_storage()
            key = (str(slot.tensor.device), st.data_ptr())
            if key not in storages:
                storages[key] = Storage(st.nbytes(), [])
            storages[key].slots.append(slot)
        regions = [r for st_ in storages.values() for r in _split(st_)]
    grouped: dict[str, list[Storage]] = {}
    for st_ in regions:
        grouped.setdefault(taking.unit_key(st_), []).append(st_)
    units: list[Unit] = []
    for layer_key, group in grouped.items():
        if layer_key:
            units.append(_make_unit(layer_key, group))
        else:
            units += [_make_unit(st_.slots[0].names[0], [st_]) for st_ in group]
    all_slots = [slot for u in units for slot in u.slot_list]
    for slot in all_slots:
        slot.stale = id(slot.tensor) in stale
    for u in units:
        u.where = "device" if all(on_device(s.tensor) for s in u.slot_list) else "host"
        for slot in u.slot_list:
            slot.record()
    return Inventory(units, all_slots, taking.derived(units, slots),
                     fsdp_bytes=sum(fsdp_owned.values()), buffers_of=buffers_of,
                     watch=taking.watch)
