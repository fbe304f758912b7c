"""Writing new values into a store's tensors: a move like the others, prepared then committed
or undone, so that a weight update travels the same road as sleep and wake.

``prepare_write`` backs up what has no current copy elsewhere, then writes the new values
into the live tensors where they are (device tensors on the device, host-placed units in their
host store), chunk by chunk as the caller's loader reads them. A failure or a cancellation
while preparing restores every tensor it wrote before it propagates, so a failed prepare
leaves nothing behind. The prepared :class:`WriteMove` is then

* committed: backups dropped, versions recorded (cannot fail);
* or undone, when another component's write failed: every written tensor restored;
* and, after commit, settled: the host mirrors that served as backups are refreshed from the
  device *in the background* (see below), so the update answers at copy speed and the next
  sleep still copies nothing.

The background refresh (:class:`MirrorRefresh`): the layer's refresh thread (refreshes run
one at a time, in order; stopped by the layer's ``close``) starts the copies through the
device layer (the CPU layer's copy thread; the device-to-host copy stream on CUDA) chunk by
chunk, small chunks first, and waits for each, overlapping whatever runs next (forwards only
read the weights). Between chunks it gives way to any write in progress on the same layer
(the next component's update: two copies at once share one memory bus, or one link, and the
write is what a caller waits for). On CUDA a chunk already queued cannot be cancelled, only
waited for.

A mirror is never wrong: at commit every refreshed tensor's version is set to a token of
this refresh (stale), and a landed chunk marks a tensor current only if it still holds that
token and its device tensor is the one copied from, unchanged since commit (same version
counter, same address). A failed or cancelled refresh leaves the rest stale:
the next sleep copies it. Whatever reads or frees what a refresh covers lands it first
(:func:`land_refresh`: a sleep, a detach, any other transition, an offload's move back to the
host); the next write into the same store supersedes it (:func:`_supersede`): its remaining
chunks are cancelled, the one in flight is waited for (the write never races with a copy
reading the same bytes), and the tensors it left stale join the next refresh.

Backups: a device tensor whose host mirror is current needs none (the mirror is one). Other
device tensors are backed up on the device when it has room for twice their bytes (no
device-to-host round trip), on the host otherwise; host-placed tensors on the host.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch

from ._chunks import chunked
from ._errors import forget_locals, undo_on_failure
from ._fileread import FileRegion
from ._inventory import Slot, Unit
from ._threads import to_thread
from .devices import CopyPair, DeviceLayer, Tier

if TYPE_CHECKING:
    from ._store import TensorStore

__all__ = ["MirrorRefresh", "WriteMove", "WriteSource", "cancel_refresh", "host_backup_bytes",
           "land_refresh", "prepare_write", "refresh_pending"]

# Bytes read per loader call (a chunk of sources is read in a worker thread, then written).
READ_CHUNK = 256 * 2**20
# Bytes per background refresh copy: the first are small (a write that follows at once
# waits for, or shares the bandwidth with, one small chunk), then they grow to the last.
REFRESH_FIRST = 4 * 2**20
REFRESH_CHUNK = 64 * 2**20
# Seconds a refresh nobody waits for holds back after a write on its layer ended: the next
# component's write of the same update follows within about a millisecond.
WRITE_GRACE = 0.01


@dataclass(eq=False)
class WriteSource:
    """A new value for the tensor named ``name`` (any of its names), read by ``load``;
    ``region``: where its bytes are in a file, when the host may read them straight into
    the tensor instead (:mod:`strategies._fileread`)."""

    name: str
    load: Callable[[], torch.Tensor]
    region: FileRegion | None = None


@dataclass(eq=False)
class _Target:
    slot: Slot
    unit: Unit
    source: WriteSource
    mirrored: bool  # on the device with a current mirror: the mirror is the backup
    was_clean: bool  # the mirror matched before the write
    backup: torch.Tensor | None = None

    @property
    def live(self) -> torch.Tensor:
        return self.slot.tensor.detach()

    @property
    def nbytes(self) -> int:
        return int(self.slot.tensor.nbytes)

    def restore_pair(self) -> CopyPair:
        source = self.backup if self.backup is not None else self.slot.host_view
        assert source is not None
        return self.live, source

    def forget_write(self) -> None:
        """After a restore: the mirror is as current as it was before the write."""
        self.slot.version = self.slot.tensor._version if self.was_clean else -1


def _tier(pairs: Sequence[CopyPair], store: TensorStore) -> Tier:
    """The stream for copies into buffers the layer allocated (backups): the device's when one
    is device memory."""
    return "device" if any(store.layer.device_memory(dst) for dst, _ in pairs) else "host"


def _live_tier(targets: Sequence[_Target]) -> Tier:
    """The stream for copies into live tensors (writes, restores): the device's when one is
    placed on the device. By placement, not by ``tensor.device``: on the CPU stand-in the
    device tier is CPU memory too, and the ordering layer (like CUDA) orders a copy into
    device memory on the device's stream."""
    return "device" if any(t.unit.where == "device" for t in targets) else "host"


def load_chunk(sources: Sequence[WriteSource], dtypes: Sequence[torch.dtype]
               ) -> list[torch.Tensor]:
    """Read ``sources`` and cast each to its target's dtype (runs in a worker thread)."""
    out = []
    for source, dtype in zip(sources, dtypes, strict=True):
        value = source.load()
        out.append(value if value.dtype == dtype else value.to(dtype))
    return out


_tokens = itertools.count(2)


def _token() -> int:
    """A version no tensor has (negative: stale), unique to one refresh."""
    return -next(_tokens)


@dataclass(eq=False)
class _Mark:
    """A tensor a background refresh brings up to date, and what it must still find to say
    so: its slot still holding the refresh's token, its device tensor unchanged since the
    commit (version counter and address)."""

    slot: Slot
    unit: Unit
    token: int
    version: int
    ptr: int

    @classmethod
    def of(cls, slot: Slot, unit: Unit, token: int) -> _Mark:
        """Mark ``slot`` stale with ``token`` and note the device tensor it is copied from."""
        t = slot.tensor
        slot.version = token
        return cls(slot, unit, token, t._version, t.data_ptr())

    def pending(self) -> bool:
        """Still stale with this refresh's token (not landed, nothing else since)."""
        return self.slot.version == self.token

    def unchanged(self) -> bool:
        """The device tensor is the one copied from, with the bytes it had at commit."""
        t = self.slot.tensor
        return t._version == self.version and t.data_ptr() == self.ptr

    def pair(self) -> CopyPair:
        """(its mirror, its device tensor as committed)."""
        assert self.slot.host_view is not None
        return self.slot.host_view, self.slot.tensor.detach()

    def land(self) -> None:
        """The copy of this tensor landed: the mirror is current, if still true."""
        if self.pending() and self.unchanged():
            self.slot.version = self.version


def _refreshable(slot: Slot, unit: Unit) -> bool:
    """On the device with a mirror that is meaningful (a stale tensor in it can be copied)."""
    return unit.where == "device" and unit.mirror_current and slot.host_view is not None


class MirrorRefresh:
    """The background refresh of one store's host mirrors after a committed write (see the
    module doc): the refresh thread copies through the device layer, chunk by chunk."""

    def __init__(self, store: TensorStore, marks: list[_Mark],
                 after: MirrorRefresh | None = None) -> None:
        self.store = store
        self.marks = marks
        self.nbytes = sum(int(m.slot.tensor.nbytes) for m in marks)
        self.copied = 0  # bytes landed so far
        self.error: BaseException | None = None
        self.cancelled = False
        self._reported = False
        self._cancel = threading.Event()
        self._urgent = threading.Event()  # somebody waits for it: no grace after writes
        self._done: Future[None] = Future()
        self._after = after  # a refresh still landing into the same mirrors: wait for it

    def start(self) -> None:
        """Queue it on its layer's refresh thread (refreshes run one at a time, in order)."""
        self.store.layer.refresher.submit(self._run)

    def _run(self) -> None:
        try:
            if self._after is not None:
                self._after._done.result()
                self._after = None
            writes = _writes_on(self.store.layer)
            for chunk in _growing_chunks(self.marks):
                writes.wait_idle(self._cancel, self._urgent)  # writes go first
                if self._cancel.is_set():
                    self.cancelled = True
                    return
                # The device tensors now: a tensor re-pointed since commit is copied from
                # where it is, and its mark does not land (its address changed).
                pairs = [m.pair() for m in chunk]
                try:
                    self.store.layer.start_copy(pairs, "host").wait_host()
                finally:
                    pairs.clear()  # drop the buffers of a landed chunk now
                for m in chunk:
                    m.land()
                self.copied += sum(int(m.slot.tensor.nbytes) for m in chunk)
        except BaseException as exc:  # what it did not land stays stale
            forget_locals(exc)  # frames held the buffers
            self.error = exc
        finally:
            self._done.set_result(None)

    def done(self) -> bool:
        return self._done.done()

    def cancel(self) -> None:
        """Copy no further chunk (the one in flight lands); what is left stays stale."""
        self._cancel.set()
        self.expedite()  # and the refreshes queued before it, that it waits for

    def expedite(self) -> None:
        """Somebody waits for it: it copies at once (after a write in progress), and so do
        the refreshes queued before it on the refresh thread."""
        for refresh in list(_PENDING.values()):
            refresh._urgent.set()
        self._urgent.set()
        _writes_on(self.store.layer).wake()

    async def wait(self) -> None:
        """Return once no copy of this refresh is in flight (the event loop keeps serving)."""
        if not self._done.done():
            self.expedite()
            await self.store.layer.off_loop(self._done.result, abandon_on_cancel=True)

    def take_error(self) -> BaseException | None:
        """The error that stopped the refresh, once (for one report)."""
        if self._reported or self.error is None:
            return None
        self._reported = True
        return self.error

    def leftovers(self) -> list[_Mark]:
        """Tensors it did not bring up to date that a next refresh can still copy."""
        return [m for m in self.marks if m.pending() and m.unchanged()]


class _Writes:
    """Writes in progress on one device layer. Background refreshes wait between chunks
    while there is one, and for :data:`WRITE_GRACE` seconds after the last one ended
    (an update of several components is one write per component, back to back), unless
    somebody waits for them: two copies at once share the memory bandwidth (on CUDA: the
    copy engines), and the write is what its caller waits for."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0
        self._ended = 0.0  # time.monotonic() when the last write ended

    def enter(self) -> None:
        with self._cond:
            self._count += 1

    def exit(self) -> None:
        with self._cond:
            self._count -= 1
            if not self._count:
                self._ended = time.monotonic()
                self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_idle(self, cancel: threading.Event, urgent: threading.Event) -> None:
        """Until no write is in progress and (unless ``urgent``: awaited) the grace after
        the last one has passed, or ``cancel``."""
        with self._cond:
            while not cancel.is_set():
                if self._count:
                    self._cond.wait()
                    continue
                left = 0.0 if urgent.is_set() else \
                    self._ended + WRITE_GRACE - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)


_WRITES: weakref.WeakKeyDictionary[DeviceLayer, _Writes] = weakref.WeakKeyDictionary()
_WRITES_LOCK = threading.Lock()


def _writes_on(layer: DeviceLayer) -> _Writes:
    with _WRITES_LOCK:
        writes = _WRITES.get(layer)
        if writes is None:
            writes = _WRITES[layer] = _Writes()
        return writes


def _growing_chunks(marks: Sequence[_Mark]) -> Iterator[list[_Mark]]:
    """``marks`` in chunks of :data:`REFRESH_FIRST` bytes, doubling up to
    :data:`REFRESH_CHUNK` (one tensor larger than that is a chunk of its own)."""
    chunk: list[_Mark] = []
    size, limit = 0, REFRESH_FIRST
    for m in marks:
        chunk.append(m)
        size += int(m.slot.tensor.nbytes)
        if size >= limit:
            yield chunk
            chunk, size, limit = [], 0, min(2 * limit, REFRESH_CHUNK)
    if chunk:
        yield chunk


def _forget_after_fork() -> None:
    # A forked child inherits no thread: its refreshes never land (their tensors stay
    # stale, which is safe), so it forgets them (its layers start refresh threads anew).
    _PENDING.clear()


# The refresh in flight (or landed, not yet collected) per store (by identity).
_PENDING: weakref.WeakKeyDictionary[TensorStore, MirrorRefresh] = weakref.WeakKeyDictionary()
os.register_at_fork(after_in_child=_forget_after_fork)


async def cancel_refresh(store: TensorStore) -> None:
    """Stop ``store``'s background refresh (the chunk in flight lands first): what it would
    still copy is not wanted (a discarding sleep drops it, or copies it itself)."""
    await _supersede(store)


def refresh_pending(store: TensorStore) -> MirrorRefresh | None:
    """``store``'s background refresh not landed yet, if any."""
    return _PENDING.get(store)


async def land_refresh(store: TensorStore) -> BaseException | None:
    """Wait for ``store``'s background refresh (if any) before anything reads or frees what
    it covers. Returns the error that left part of its mirrors stale (once), else None."""
    refresh = _PENDING.get(store)
    if refresh is None:
        return None
    await refresh.wait()
    if _PENDING.get(store) is refresh:
        del _PENDING[store]
    return refresh.take_error()


async def _supersede(store: TensorStore) -> list[_Mark]:
    """Before a new write into ``store``: cancel its pending refresh (the chunk in flight
    lands first, so no copy reads what the write writes); returns the tensors it left stale
    that the next refresh copies too."""
    refresh = _PENDING.get(store)
    if refresh is None:
        return []
    refresh.cancel()
    await refresh.wait()
    if _PENDING.get(store) is refresh:
        del _PENDING[store]
    return refresh.leftovers()


@dataclass(eq=False)
class WriteMove:
    """New values written in place, old ones kept until :meth:`commit` (see module doc)."""

    store: TensorStore
    targets: list[_Target]
    bytes_copied: int = 0
    units: list[Unit] = field(default_factory=list)
    to: str = "write"
    # Tensors a superseded refresh left stale (refreshed with this write's), then the tensors
    # the refresh started by settle covers (marked at commit).
    leftovers: list[_Mark] = field(default_factory=list)
    marks: list[_Mark] = field(default_factory=list)

    async def _restore(self, targets: Sequence[_Target]) -> None:
        with anyio.CancelScope(shield=True):
            # (A stale tensor had no contents to keep: it stays stale, its bytes undefined.)
            pairs = [t.restore_pair() for t in targets if not t.slot.stale]
            await self.store.copy_pairs(pairs, _live_tier(targets))
            for t in targets:
                t.forget_write()

    async def undo(self) -> None:
        """Restore every written tensor (another component's write failed)."""
        await self._restore(self.targets)
        self._drop_backups()

    def commit(self) -> None:
        """Keep the new values: backups dropped; host-placed tensors are clean (the host
        store is the written copy), device tensors stale until the refresh :meth:`settle`
        starts lands them (those without a meaningful mirror: until the next sleep)."""
        self._drop_backups()
        token = _token()
        written = set()
        for t in self.targets:
            slot = t.slot
            slot.stale = False  # written: defined again
            written.add(id(slot))
            if t.unit.where == "host":
                slot.version = slot.tensor._version
            elif _refreshable(slot, t.unit):
                self.marks.append(_Mark.of(slot, t.unit, token))
            else:
                slot.version = -1
        for m in self.leftovers:
            if id(m.slot) not in written and m.pending() and m.unchanged() \
                    and _refreshable(m.slot, m.unit):
                self.marks.append(_Mark.of(m.slot, m.unit, token))
        self.leftovers = []
        if self.store.stale_count:
            self.store.count_stale()
        self.store.refresh_derived(self.units)

    async def settle(self) -> BaseException | None:
        """Start refreshing the mirrors of the written device tensors in the background
        (see the module doc) and return at once: the write is committed and usable, and the
        refresh overlaps what runs next. Returns the error that kept it from starting (the
        tensors stay stale: the next sleep copies them), else None; an error of the copies
        themselves is returned by :func:`land_refresh`."""
        marks, self.marks = self.marks, []
        if not marks:
            return None
        refresh = MirrorRefresh(self.store, marks, after=_PENDING.get(self.store))
        try:
            refresh.start()
        except Exception as exc:  # no thread to be had: stale until the next sleep
            return exc
        _PENDING[self.store] = refresh
        return None

    def _drop_backups(self) -> None:
        for t in self.targets:
            t.backup = None


def _backup(t: _Target, store: TensorStore, on_device: bool) -> torch.Tensor:
    live = t.slot.tensor
    if not t.nbytes:
        return torch.empty_like(live, device="cpu")
    buf = store.layer.alloc(t.nbytes, "device") if on_device else \
        store.layer.alloc(t.nbytes, "host", pinned=False)
    return buf.view(live.dtype).view(live.shape)


def _targets(store: TensorStore, sources: Sequence[WriteSource]) -> list[_Target]:
    targets = []
    for source in sources:
        slot, unit = store.slot_named(source.name)
        mirrored = (unit.where == "device" and unit.mirror_current
                    and slot.host_view is not None and slot.version == slot.tensor._version)
        targets.append(_Target(slot, unit, source, mirrored,
                               slot.version == slot.tensor._version))
    return targets


def _backup_on_device(store: TensorStore, targets: Sequence[_Target]) -> bool:
    """Whether the backups of device tensors go on the device (room for twice them)."""
    layer = store.layer
    device = [t for t in targets if not t.mirrored and not t.slot.stale
              and layer.device_memory(t.live)]
    free = layer.free_bytes()
    return free is None or free > 2 * sum(t.nbytes for t in device)


def host_backup_bytes(store: TensorStore, sources: Sequence[WriteSource]) -> int:
    """Host bytes :func:`prepare_write` would allocate for ``sources``' backups (a tensor
    whose mirror is current is backed up by it, a stale one needs none): for a host budget's
    check before anything is written."""
    targets = _targets(store, sources)
    on_device = _backup_on_device(store, targets)
    return sum(t.nbytes for t in targets if not t.mirrored and not t.slot.stale
               and not (on_device and store.layer.device_memory(t.live)))


async def prepare_write(store: TensorStore, sources: Sequence[WriteSource],
                        limiter: anyio.CapacityLimiter | None = None) -> WriteMove:
    """Back up, then write every source into ``store``'s live tensors (see module doc)."""
    leftovers = await _supersede(store)
    targets = _targets(store, sources)
    move = WriteMove(store, targets, units=list({id(t.unit): t.unit for t in targets}.values()),
                     leftovers=leftovers)
    layer = store.layer
    backup_on_device = _backup_on_device(store, targets)
    written: list[_Target] = []  # what a failure restores: every target written so far

    async def undo() -> None:
        await move._restore(written)
        move._drop_backups()

    writes = _writes_on(layer)
    writes.enter()  # background refreshes (of other stores) pause meanwhile
    try:
        async with undo_on_failure(undo):  # (its frames held the sources and backups)
            await _write_all(store, targets, written, backup_on_device, limiter)
    finally:
        writes.exit()
    move.bytes_copied = sum(t.nbytes for t in targets)
    return move


async def _write_all(store: TensorStore, targets: Sequence[_Target], written: list[_Target],
                     backup_on_device: bool, limiter: anyio.CapacityLimiter | None) -> None:
    """Back ``targets`` up, then write each one's source into it, appending to ``written``
    each target before its bytes are touched (for the undo of a failure)."""
    layer = store.layer
    needed = [t for t in targets if not t.mirrored and not t.slot.stale]

    def back_up() -> None:
        for t in needed:
            t.backup = _backup(t, store, backup_on_device and layer.device_memory(t.live))

    if needed:  # off the loop: a device allocation the cache cannot serve synchronizes
        await layer.off_loop(back_up)
    pairs = [(t.backup, t.live) for t in targets if t.backup is not None]
    await store.copy_pairs(pairs, _tier(pairs, store))
    for chunk in chunked(targets, lambda t: t.nbytes, READ_CHUNK):
        # File bytes the host may write straight into the live tensor: one copy (no
        # loaded tensor, no page faults on the file's mapping). Counted as written
        # before the read starts: a failed read leaves them half-written.
        direct: list[tuple[_Target, FileRegion]] = []
        rest: list[_Target] = []
        for t in chunk:
            region, live = t.source.region, t.live
            if region is not None and region.fits(live) \
                    and layer.host_writes(live, t.unit.where):
                direct.append((t, region))
            else:
                rest.append(t)
        if direct:
            written.extend(t for t, _ in direct)
            await layer.read_file([(t.live, region) for t, region in direct], limiter)
        if not rest:
            continue
        values = await to_thread(
            load_chunk, [t.source for t in rest], [t.slot.tensor.dtype for t in rest],
            limiter=limiter)
        written.extend(rest)
        pairs = [(t.live, v) for t, v in zip(rest, values, strict=True)]
        await store.copy_pairs(pairs, _live_tier(rest))
