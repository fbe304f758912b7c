"""The file-backed tier: a component whose weights are the bytes of checkpoint files keeps no
host copy while asleep, and wake reads them back from the files.

A store's :class:`FileBacking` records, for each parameter and persistent buffer (the slots a
discarding sleep may drop), the file region its bytes are in (``safetensors``, read
straight into the tensor: :mod:`strategies._fileread`), the tensor object and its version
counter then, and each file's size, modification time and inode. It is recorded when the
weights were loaded from, or verified against, those files (``attach(checkpoint=...)``,
``update_weights_from_disk``).

While it still *covers* the store (every such slot recorded, the same tensor object, its
version unchanged: any write through torch bumps it, and every update of the library forgets
or re-records what it wrote), a sleep drops those tensors like a discarding sleep (no host
copy: :mod:`strategies._discard`) and a wake gives them places again and reads each one from
its file (:func:`prepare_file_wake`), after checking that every file is still the one recorded.
A file changed or removed fails the wake with :class:`CheckpointChanged` naming it, before any
tensor is re-pointed (the move is undone like any other). Where the host cannot write the
destination (CUDA memory) the bytes are read into a pageable host buffer and copied, a unit at
a time.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ._discard import DiscardMove, UndiscardMove, prepare_discard, prepare_undiscard
from ._errors import ResidencyError, undo_on_failure
from ._fileread import FileRegion
from ._inventory import Slot, Unit
from ._store import Progress, TensorStore
from .devices import Tier

__all__ = ["CheckpointChanged", "FileBacking", "FileSleepMove", "FileStamp", "FileWakeMove",
           "covered", "forget_files", "prepare_file_sleep", "prepare_file_wake", "record_files"]


class CheckpointChanged(ResidencyError, OSError):
    """A checkpoint file a file-backed component's weights are kept in changed or vanished
    while it slept: its wake is refused (nothing changed). ``path``, ``what``: which file and
    how it differs; ``component``."""

    def __init__(self, component: str, path: str, what: str) -> None:
        self.component, self.path, self.what = component, path, what
        super().__init__(
            f"component {component!r} keeps its weights in {path} while asleep, and that file "
            f"{what} since they were recorded: refused to read it back (nothing changed). Put "
            "the file back, or forget the files (ctl.forget_checkpoint) and wake with its "
            "weights discarded, then update them")


@dataclass(frozen=True)
class FileStamp:
    """What identifies a file's contents cheaply: size, modification time, inode."""

    path: str
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: str) -> FileStamp:
        st = os.stat(path)
        return cls(path, st.st_size, st.st_mtime_ns, st.st_ino)

    def differs(self) -> str | None:
        """How the file differs from this stamp now (None: it does not)."""
        try:
            now = FileStamp.of(self.path)
        except FileNotFoundError:
            return "was removed"
        except OSError as exc:
            return f"cannot be read ({exc.strerror})"
        for what, a, b in (("size", self.size, now.size), ("inode", self.inode, now.inode),
                           ("modification time", self.mtime_ns, now.mtime_ns)):
            if a != b:
                return f"changed ({what} {a} -> {b})"
        return None


@dataclass
class _Recorded:
    region: FileRegion
    tensor: weakref.ref[torch.Tensor]
    version: int


@dataclass(eq=False)
class FileBacking:
    """The file regions of a store's slots (by first name), and the files' stamps."""

    slots: dict[str, _Recorded] = field(default_factory=dict)
    stamps: dict[str, FileStamp] = field(default_factory=dict)
    asleep: bool = False  # the store sleeps with its weights only in these files

    def nbytes(self) -> int:
        return sum(r.region.nbytes for r in self.slots.values())


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _fits(slot: Slot, region: FileRegion) -> bool:
    t = slot.tensor
    return region.dtype == t.dtype and int(t.nbytes) == region.nbytes and region.nbytes > 0 \
        and tuple(slot.stride) == _contiguous(tuple(t.shape))


def record_files(store: TensorStore, regions: Mapping[str, FileRegion]) -> int:
    """Record ``regions`` (tensor name -> where its bytes are) as the store's files, merged
    with what it recorded before (the names given replace theirs). Only regions that are
    exactly a tensor's bytes (same dtype and size, contiguous) count. Returns the bytes the
    store now keeps in files (whether or not they cover it)."""
    backing = store.file_backing or FileBacking()
    for slot in (s for u in store.units for s in u.slot_list if s.state):
        region = next((regions[n] for n in slot.names if n in regions), None)
        if region is None:
            continue
        key = slot.names[0]
        if not _fits(slot, region):
            backing.slots.pop(key, None)
            continue
        backing.slots[key] = _Recorded(region, weakref.ref(slot.tensor), slot.tensor._version)
        if region.path not in backing.stamps:
            backing.stamps[region.path] = FileStamp.of(region.path)
    used = {r.region.path for r in backing.slots.values()}
    backing.stamps = {p: s for p, s in backing.stamps.items() if p in used}
    store.file_backing = backing if backing.slots else None
    return backing.nbytes()


def forget_files(store: TensorStore, names: set[str] | None = None) -> None:
    """The store's tensors ``names`` (all: None) are no longer the files' bytes (an update
    wrote them): their copies are anonymous again."""
    backing = store.file_backing
    if backing is None or backing.asleep:
        return
    if names is None:
        store.file_backing = None
        return
    for slot in (s for u in store.units for s in u.slot_list):
        if any(n in names for n in slot.names):
            backing.slots.pop(slot.names[0], None)
    if not backing.slots:
        store.file_backing = None


def covered(store: TensorStore) -> bool:
    """Whether every parameter and persistent buffer of the store is still its recorded
    file's bytes (the same tensor object, its version unchanged), and nothing is stale."""
    backing = store.file_backing
    if backing is None or store.stale_count or store.discarded is not None:
        return False
    for u in store.units:
        for slot in u.slot_list:
            if not slot.state:
                continue
            rec = backing.slots.get(slot.names[0])
            if rec is None or rec.tensor() is not slot.tensor \
                    or rec.version != slot.tensor._version:
                return False
    return True


@dataclass(eq=False)
class FileSleepMove:
    """A file-backed sleep: a discarding sleep of every parameter and persistent buffer (no
    host copy) that, committed, leaves the store's files as the only copy."""

    store: TensorStore
    inner: DiscardMove
    backing: FileBacking
    bytes_copied: int = 0
    to: Tier = "host"

    @property
    def units(self) -> list[Unit]:
        return self.inner.units

    def commit(self) -> None:
        self.inner.commit()
        self.backing.asleep = True

    async def undo(self) -> None:
        await self.inner.undo()

    async def settle(self) -> BaseException | None:
        return None


async def prepare_file_sleep(store: TensorStore, progress: Progress | None = None
                             ) -> FileSleepMove | None:
    """A file-backed sleep of ``store`` when its files cover it (else None)."""
    if not covered(store):
        return None
    backing = store.file_backing
    assert backing is not None
    move = await prepare_discard(store, True, progress)
    assert move is not None  # (covered: it has parameters or persistent buffers to drop)
    return FileSleepMove(store, move, backing, move.bytes_copied)


@dataclass(eq=False)
class FileWakeMove:
    """A file-backed wake: every unit placed again (:class:`UndiscardMove`) with the dropped
    tensors read from their files; committed, they are current again (not stale)."""

    store: TensorStore
    inner: UndiscardMove
    backing: FileBacking
    bytes_copied: int = 0  # the kept storages copied back and the bytes read from files
    to: Tier = "device"

    @property
    def units(self) -> list[Unit]:
        return self.inner.units

    def commit(self) -> None:
        store = self.store
        self.inner.commit()
        for u in store.units:
            for slot in u.slot_list:
                slot.stale = False
        store.count_stale()
        self.backing.asleep = False

    async def undo(self) -> None:
        await self.inner.undo()

    async def settle(self) -> BaseException | None:
        return None


def _check(store: TensorStore, backing: FileBacking) -> None:
    for stamp in backing.stamps.values():
        what = stamp.differs()
        if what is not None:
            raise CheckpointChanged(store.name, stamp.path, what)


async def prepare_file_wake(store: TensorStore, awake: list[Unit],
                            progress: Progress | None = None) -> FileWakeMove:
    """Prepare the wake of a store asleep file-backed: its files checked against their
    stamps (:class:`CheckpointChanged`), every unit given its awake place, and each dropped
    tensor read from its file into it (a unit at a time through a pageable host buffer
    where the host cannot write the place), the files checked again after."""
    backing = store.file_backing
    assert backing is not None and backing.asleep
    _check(store, backing)
    inner = await prepare_undiscard(store, awake, progress)
    move = FileWakeMove(store, inner, backing, inner.bytes_copied)
    async with undo_on_failure(move.undo):
        layer = store.layer
        for unit, tier, buf in inner.placements:
            reads = []
            for st in unit.storages:
                for slot in st.slots:
                    rec = backing.slots.get(slot.names[0])
                    if rec is not None and slot.stale:
                        reads.append((slot.view_of(buf, st.offset), rec.region))
            if not reads:
                continue
            nbytes = sum(r.nbytes for _, r in reads)
            if layer.host_writes(buf, tier):
                await layer.read_file(reads)
            else:
                staging = layer.alloc(unit.nbytes, "host", pinned=False)
                staged = _restaged(reads, buf, staging)
                await layer.read_file([(view, r) for view, r, _ in staged])
                await store.copy_pairs([pair for _, _, pair in staged], tier)
                del staging, staged
            move.bytes_copied += nbytes
            if progress:
                progress(nbytes)
        _check(store, backing)  # nothing is served from a file that changed while read
    return move


def _restaged(reads: list[tuple[torch.Tensor, FileRegion]], buf: torch.Tensor,
              staging: torch.Tensor
              ) -> list[tuple[torch.Tensor, FileRegion, tuple[torch.Tensor, torch.Tensor]]]:
    """The same reads into ``staging`` (a host buffer the size of ``buf``) at the same
    offsets, each with the copy pair that then moves exactly its bytes into ``buf`` (the
    unit's other bytes, copied in already, are not touched)."""
    out = []
    for dst, region in reads:
        offset = dst.storage_offset() * dst.element_size() - buf.storage_offset()
        here = staging[offset:offset + region.nbytes]
        out.append((here.view(dst.dtype).view(dst.shape), region,
                    (buf[offset:offset + region.nbytes], here)))
    return out
