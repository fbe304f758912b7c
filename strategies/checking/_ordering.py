"""A CPU device layer that makes the CUDA path's ordering bugs visible, deterministically.

On CUDA a copy runs on a copy stream, behind the host: its destination holds whatever it held
until the copy has landed, and nothing orders later work after it but an explicit wait (a
stream wait on its event, a host wait, a device synchronize). The plain CPU layer hides every
mistake in that ordering (its copies land at once, in one thread). :class:`OrderingDevice`
models the CUDA contract instead:

* a fresh buffer holds poison, on either tier;
* a copy is *started* when asked for: its source is read at once (a snapshot, taken through
  the ``_copy_one`` hook, so copies are counted and faults injected where CUDA enqueues), its
  destination is filled with poison (``0xFF`` bytes: NaN in every float dtype);
* it *lands* (the destination gets the bytes) only when someone waits for it, after a random
  delay (seeded): :meth:`CopyHandle.wait` lands copies into the device tier (compute is
  ordered after them), :meth:`CopyHandle.wait_host`, the async :meth:`copy`,
  :meth:`synchronize` and :meth:`close` land everything they cover and order the host too.
  A read that did not wait computes on NaN, and an exact-output test fails;
* copies on one stream (``to="device"``, ``to="host"``) are ordered among themselves, as on
  CUDA; a copy that must wait on the compute stream (``to="host"``, or a device-tier source)
  is also ordered after copies compute waited for.

What it reports (:class:`OrderingViolation`, naming the buffers' owners when the store
:meth:`labelled <DeviceLayer.label>` them, and the copy):

* a copy started that reads, writes or overwrites a buffer an unordered copy still writes or
  reads (raised at once);
* a buffer freed while a copy into or out of it is in flight, never waited for (recorded by
  a finalizer on its storage, raised at the next call into the layer, and kept in
  :attr:`violations` so that a test fixture fails the test at teardown, see
  :func:`check_ordering` and ``tests/conftest.py``). Once compute waited for a copy, freeing
  its buffers is not reported (the allocator orders a device block's reuse after compute;
  host mirrors are freed by transitions and detach, which synchronize first), but host
  writes into its source are, until the host waited;
* a source written while a copy still reads it (a host mirror overwritten mid-copy: the
  snapshot differs when the copy lands), a destination written while a copy into it is in
  flight (it is no longer poison when the copy lands);
* a device buffer handed to compute (:meth:`for_compute`) before the copy into it was waited
  for.

It is strict where CUDA is lenient by accident: device buffers are freed as if no
``record_stream`` protected them (the library's own rule: every copy is waited for before its
buffers are dropped).
"""

from __future__ import annotations

import atexit
import gc
import random
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

import torch

from .._threads import to_thread
from ..devices import CopyHandle, CopyPair, CpuDevice, Tier

__all__ = ["POISON", "OrderingDevice", "OrderingViolation", "Violations", "check_ordering",
           "poison"]

POISON = 0xFF  # the byte a buffer holds until a copy into it lands (NaN in float dtypes)

_OWNER = "_residency_owner"  # attributes set on storage objects (torch keeps one per storage)
_TIER = "_residency_tier"


class OrderingViolation(AssertionError):
    """A copy and its buffers were not ordered as the CUDA path needs (see module doc)."""


class Violations:
    """The violations a checking layer found, in order (``found``; ``lock`` guards them).
    Each is raised once: where it is found (:meth:`fail`), or by the next call into the layer
    when it was only recorded where nothing could raise (:meth:`record`: a finalizer, another
    thread); a test fixture takes what nobody reported (:meth:`take_unreported`)."""

    def __init__(self, lock: threading.RLock, error: type[OrderingViolation]) -> None:
        self.lock = lock
        self.error = error
        self.found: list[str] = []
        self.raised = 0  # found[:raised] were raised by a call into the layer
        self.checked = 0  # found[:checked] were reported by a test fixture

    def record(self, message: str) -> None:
        with self.lock:
            self.found.append(message)

    def fail(self, message: str) -> NoReturn:
        """Record and raise at once."""
        with self.lock:
            self.found.append(message)
            self.raised = len(self.found)
        raise self.error(message)

    def raise_recorded(self) -> None:
        """Raise every violation recorded since the last one raised, in one error."""
        with self.lock:
            if self.raised >= len(self.found):
                return
            new = self.found[self.raised:]
            self.raised = len(self.found)
        raise self.error("; ".join(new))

    def take_unreported(self) -> list[str]:
        """The violations not yet reported by a test fixture (marks them reported)."""
        with self.lock:
            out = self.found[self.checked:]
            self.checked = len(self.found)
            return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as 1-D uint8 (a view when ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with poison in place (bumps its version counter, as the real copy would)."""
    with torch.no_grad(), torch.inference_mode(False):
        if t.is_contiguous():
            t.detach().reshape(-1).view(torch.uint8).fill_(POISON)
        elif t.dtype.is_floating_point or t.dtype.is_complex:
            t.detach().fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.detach().fill_(True)
        else:
            t.detach().fill_(-1 if t.dtype.is_signed else torch.iinfo(t.dtype).max)


def _is_poison(t: torch.Tensor) -> bool:
    if t.is_contiguous():
        return bool((_bytes(t) == POISON).all())
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(t.isnan().all())
    expected = True if t.dtype == torch.bool else \
        (-1 if t.dtype.is_signed else torch.iinfo(t.dtype).max)
    return bool((t == expected).all())


@dataclass(eq=False)
class _Side:
    """One operand of a copy: where its bytes are (a weak reference: the copy must not keep
    the buffer alive, or its free could not be seen), and whose they are."""

    ref: weakref.ref[torch.UntypedStorage]
    ptr: int  # the storage's data pointer (the index key while it lives)
    start: int  # byte span inside the storage
    end: int
    offset: int  # element geometry, to rebuild the tensor when the copy lands
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    tier: Tier
    owner: str | None
    storage_nbytes: int

    @classmethod
    def of(cls, t: torch.Tensor, tier: Tier) -> _Side:
        storage = t.untyped_storage()
        itemsize = t.element_size()
        extent = 0 if not t.numel() else itemsize * (
            1 + sum((int(s) - 1) * int(st) for s, st in zip(t.shape, t.stride(), strict=True)))
        offset = int(t.storage_offset())
        start = offset * itemsize
        return cls(weakref.ref(storage), storage.data_ptr(), start, start + extent,
                   offset, tuple(int(n) for n in t.shape), tuple(int(n) for n in t.stride()),
                   t.dtype,
                   getattr(storage, _TIER, tier), getattr(storage, _OWNER, None),
                   int(storage.nbytes()))

    def tensor(self) -> torch.Tensor | None:
        storage = self.ref()
        if storage is None:
            return None
        with torch.inference_mode(False):  # waits run in hooks, under inference_mode too
            return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
                storage, self.offset, self.size, self.stride)

    def overlaps(self, other: _Side) -> bool:
        return self.ptr == other.ptr and self.start < other.end and other.start < self.end

    def describe(self) -> str:
        what = {"device": "device buffer", "host": "host buffer"}[self.tier]
        if self.owner is not None:
            what = f"{'host mirror' if self.tier == 'host' else 'device buffer'} of {self.owner}"
        part = "" if (self.start, self.end) == (0, self.storage_nbytes) else \
            f" bytes [{self.start}, {self.end})"
        return f"{what} ({self.storage_nbytes} bytes{part})"


@dataclass(eq=False)
class _Batch:
    """The copies of one ``start_copy`` / ``copy`` call."""

    stream: Tier
    copies: list[_Copy] = field(default_factory=list)


@dataclass(eq=False)
class _Copy:
    seq: int
    batch: _Batch
    dst: _Side
    src: _Side
    snapshot: torch.Tensor | None  # the source's bytes when the copy started; None once landed
    due: float  # time.monotonic() before which it cannot land
    landed: bool = False
    compute_ordered: bool = False  # the compute stream waits for it (device tier may reuse)
    dropped: bool = False  # nobody will wait for it (CUDA records its device buffers instead)
    retired: bool = False  # the host waited for it too: out of every index
    finalizers: list[weakref.finalize[Any, Any]] = field(default_factory=list)

    @property
    def stream(self) -> Tier:
        return self.batch.stream

    def describe(self) -> str:
        return f"copy #{self.seq} to {self.stream}: {self.src.describe()} -> {self.dst.describe()}"


class _Handle:
    def __init__(self, layer: OrderingDevice, batch: _Batch) -> None:
        self._layer = layer
        self._batch = batch

    def wait(self) -> None:
        self._layer._ord_wait(self._batch, host=False)

    def wait_host(self) -> None:
        self._layer._ord_wait(self._batch, host=True)

    def drop(self) -> None:
        self._layer._ord_drop(self._batch)


class OrderingDevice(CpuDevice):
    """The CPU layer with CUDA's ordering made strict and visible (see the module doc).

    ``seed`` seeds the delays (each copy lands no earlier than up to ``max_delay`` seconds
    after it started). :attr:`violations` lists every violation seen, raised or not."""

    needs_sync = True  # transitions synchronize before they move, as on CUDA
    instances: ClassVar[weakref.WeakSet[OrderingDevice]] = weakref.WeakSet()

    def __init__(self, device: torch.device | None = None, *, seed: int = 0,
                 max_delay: float = 0.002) -> None:
        super().__init__(device)
        self.max_delay = max_delay
        self._ord_delays = random.Random(seed)
        self._ord_lock = threading.RLock()
        self._ord_seq = 0
        self._ord_streams: dict[Tier, list[_Copy]] = {"device": [], "host": []}
        self._ord_by_ptr: dict[int, list[tuple[_Copy, str]]] = {}
        self._ord_last_due: dict[Tier, float] = {"device": 0.0, "host": 0.0}
        self._ord_log = Violations(self._ord_lock, OrderingViolation)
        self.violations = self._ord_log.found
        OrderingDevice.instances.add(self)

    # -- labels and allocation -----------------------------------------------------------
    def label(self, buf: torch.Tensor, component: str, unit: str) -> None:
        self._ord_log.raise_recorded()
        setattr(buf.untyped_storage(), _OWNER, f"component {component!r} unit {unit!r}")

    def _alloc(self, nbytes: int, tier: Tier, pinned: bool) -> torch.Tensor:
        self._ord_log.raise_recorded()
        buf = super()._alloc(nbytes, tier, pinned)
        setattr(buf.untyped_storage(), _TIER, tier)
        buf.fill_(POISON)  # never written yet: whoever reads it sees NaN
        return buf

    def for_compute(self, buf: torch.Tensor) -> None:
        self._ord_log.raise_recorded()
        side = _Side.of(buf, "device")
        with self._ord_lock:
            for c, role in self._ord_by_ptr.get(side.ptr, ()):
                if role == "dst" and not c.compute_ordered and c.dst.overlaps(side):
                    self._ord_log.fail(f"{c.dst.describe()} was handed to compute before "
                                   f"{c.describe()} was waited for: kernels would read it "
                                   "before the copy landed")

    def host_writes(self, t: torch.Tensor, tier: Tier) -> bool:
        """Device-tier memory is the device's (CUDA: the host cannot write it): no. Host-tier
        memory: yes, unless a copy not yet waited for by the host reads or writes it, which
        is an ordering violation (the host would race with the copy)."""
        self._ord_log.raise_recorded()
        side = _Side.of(t, tier)
        if tier == "device" or side.tier == "device":
            return False
        with self._ord_lock:
            for c, role in self._ord_by_ptr.get(side.ptr, ()):
                if not c.retired and getattr(c, role).overlaps(side):
                    what = "writes" if role == "dst" else "reads"
                    self._ord_log.fail(f"the host writes {side.describe()} while {c.describe()} "
                                   f"still {what} it")
        return True

    # -- violations ------------------------------------------------------------------------
    def take_unreported(self) -> list[str]:
        """Violations not yet reported by a test fixture (marks them reported)."""
        return self._ord_log.take_unreported()

    # -- starting copies -------------------------------------------------------------------
    def start_copy(self, pairs: Sequence[CopyPair], to: Tier) -> CopyHandle:
        self._ord_log.raise_recorded()
        return _Handle(self, self._ord_start(list(pairs), to))

    async def copy(self, pairs: Sequence[CopyPair], to: Tier) -> None:
        self._ord_log.raise_recorded()
        if pairs:
            # abandon_on_cancel=False: a cancelled caller waits for the thread to finish.
            await to_thread(self._ord_copy_now, list(pairs), to,
                                           limiter=self._limiter)

    def _ord_copy_now(self, pairs: list[CopyPair], to: Tier) -> None:
        try:
            batch = self._ord_start(pairs, to)
        finally:
            pairs.clear()  # as _copy_batch: the worker thread keeps its arguments a while
        self._ord_wait(batch, host=True)

    def _ord_start(self, pairs: list[CopyPair], to: Tier) -> _Batch:
        """Start the pairs one by one, each checked against the copies in flight (those of
        this batch too: they run before it, in order). A violation or a fault injected at the
        k-th pair lands the copies started before it, then propagates."""
        batch = _Batch(to)
        after_compute = to == "host" or any(
            getattr(src.untyped_storage(), _TIER, None) == "device" for _, src in pairs)
        try:
            for dst_t, src_t in pairs:
                with torch.no_grad(), torch.inference_mode(False), self._ord_lock:
                    if not dst_t.nbytes:
                        self._copy_one(dst_t, src_t)  # nothing to order: counted, may fail
                        continue
                    dst = _Side.of(dst_t, to)
                    src = _Side.of(src_t, "host" if to == "device" else "device")
                    self._ord_check_start(batch, dst, src, after_compute)
                    snapshot = torch.empty_like(src_t, memory_format=torch.contiguous_format)
                    self._copy_one(snapshot, src_t)  # the CUDA enqueue: counted, may fail
                    poison(dst_t)
                    self._ord_add(batch, dst, src, snapshot)
        except BaseException:
            # Copies already queued land before the caller frees their buffers.
            self._ord_wait(batch, host=True, check=False)
            raise
        return batch

    def _ord_check_start(self, batch: _Batch, dst: _Side, src: _Side, after_compute: bool
                         ) -> None:
        """Raise if the new copy (``src`` -> ``dst`` in ``batch``) touches a buffer of a copy
        it is not ordered after; land the copies it is ordered after first: the earlier pairs
        of its batch, earlier copies on its stream, and copies compute waited for when it waits
        for compute. A host-to-host pair is a plain memcpy by the host (CUDA runs it in a
        worker thread, in batch order): other batches' copies only once the host waited."""
        to = batch.stream
        host_only = dst.tier == "host" and src.tier == "host"
        for mine, theirs_role, what in ((dst, "dst", "writes {b} while {c} still writes it"),
                                        (dst, "src", "overwrites {b} while {c} still reads it"),
                                        (src, "dst", "reads {b} before {c} was waited for")):
            for c, role in list(self._ord_by_ptr.get(mine.ptr, ())):
                if role != theirs_role or c.retired or not mine.overlaps(getattr(c, role)):
                    continue
                if c.batch is batch or (not host_only and (
                        c.stream == to or (c.compute_ordered and after_compute))):
                    self._ord_land(c)  # ordered after it: it has run by the time this one runs
                    continue
                self._ord_log.fail(f"a copy to {to} " + what.format(b=getattr(c, role).describe(),
                                                             c=c.describe()))

    def _ord_add(self, batch: _Batch, dst: _Side, src: _Side, snapshot: torch.Tensor) -> None:
        with self._ord_lock:
            self._ord_seq += 1
            now = time.monotonic()
            due = max(now + self._ord_delays.uniform(0.0, self.max_delay), self._ord_last_due[batch.stream])
            self._ord_last_due[batch.stream] = due
            # A copy of the same source on the same stream that compute already waited for is
            # covered by this one (the host waiting for this one waits for it too): forget it,
            # so the books stay short while a layer streams in again and again.
            for old, role in list(self._ord_by_ptr.get(src.ptr, ())):
                if role == "src" and old.stream == batch.stream and old.compute_ordered \
                        and old.landed and (old.src.start, old.src.end) == (src.start, src.end):
                    self._ord_retire(old)
            c = _Copy(self._ord_seq, batch, dst, src, snapshot, due)
            batch.copies.append(c)
            self._ord_streams[batch.stream].append(c)
            for side, role in ((dst, "dst"), (src, "src")):
                self._ord_by_ptr.setdefault(side.ptr, []).append((c, role))
                storage = side.ref()
                if storage is not None:
                    c.finalizers.append(weakref.finalize(storage, self._ord_freed, c, role))

    # -- landing and waiting ---------------------------------------------------------------
    def _ord_wait(self, batch: _Batch, *, host: bool, check: bool = True) -> None:
        """Land ``batch`` (and the copies before it on its stream) and order compute after
        them; with ``host``, the host too (they leave the books). Without ``host``, copies
        into the host tier are ordered for compute but do not land: the host cannot see
        their bytes until it waits itself."""
        if not batch.copies:
            if check:
                self._ord_log.raise_recorded()
            return
        last = batch.copies[-1]
        with self._ord_lock:
            queue = self._ord_streams[batch.stream]
            upto = [c for c in queue if c.seq <= last.seq]
        if not upto:
            if check:
                self._ord_log.raise_recorded()
            return
        due = max(c.due for c in upto)
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the copy is late; never under the lock
        with self._ord_lock:
            for c in upto:
                c.compute_ordered = True
                if host or c.dst.tier == "device":
                    self._ord_land(c)
                if host:
                    self._ord_retire(c)
        if check:  # landed first: a violation seen meanwhile leaves no copy behind
            self._ord_log.raise_recorded()

    def _ord_land(self, c: _Copy) -> list[str]:
        """Write ``c``'s bytes into its destination (once); returns the violations seen."""
        if c.landed:
            return []
        c.landed = True
        snapshot, c.snapshot = c.snapshot, None
        assert snapshot is not None
        errors: list[str] = []
        src = c.src.tensor()
        if src is not None and not torch.equal(_bytes(src), _bytes(snapshot)):
            errors.append(f"{c.src.describe()} was written while {c.describe()} still read it "
                          "(the copy read a mix of old and new bytes)")
        dst = c.dst.tensor()
        if dst is not None:
            if not _is_poison(dst):
                errors.append(f"{c.dst.describe()} was written while {c.describe()} into it was "
                              "in flight (the copy overwrote it when it landed)")
            with torch.inference_mode(False):
                dst.copy_(snapshot)  # a rebuilt view: no version bump (the start bumped it)
        self.violations += errors
        return errors

    def _ord_retire(self, c: _Copy) -> None:
        if c.retired:
            return
        c.retired = True
        for fin in c.finalizers:
            fin.detach()
        c.finalizers.clear()
        queue = self._ord_streams[c.stream]
        if c in queue:
            queue.remove(c)
        for side, role in ((c.dst, "dst"), (c.src, "src")):
            entries = self._ord_by_ptr.get(side.ptr)
            if entries is not None:
                entries[:] = [e for e in entries if e != (c, role)]
                if not entries:
                    del self._ord_by_ptr[side.ptr]

    def _ord_freed(self, c: _Copy, role: str) -> None:
        """A storage died while ``c`` had it as ``role`` (a weakref finalizer: record only)."""
        with self._ord_lock:
            side = c.dst if role == "dst" else c.src
            # Once compute waited for the copy, it is done as far as the library's contract
            # goes: a device buffer's reuse is ordered after compute by the allocator; a host
            # buffer (a mirror dropped after a fetch) is freed by a transition or detach,
            # which synchronize first. Host *writes* into it stay checked until the host
            # waited (``_ord_check_start``, and the landing's comparison).
            ordered = c.retired or c.compute_ordered or (c.dropped and side.tier == "device")
            if not ordered:
                does = "writes" if role == "dst" else "reads"
                self.violations.append(
                    f"{side.describe()} was freed while {c.describe()} still {does} it "
                    "(never waited for): its memory "
                    "could be handed to new work before the copy is done")
            if role == "dst" and not c.landed:
                c.landed = True  # nothing left to land into
                c.snapshot = None
            entries = self._ord_by_ptr.get(side.ptr)
            if entries is not None:  # the pointer may be reused by a new storage
                entries[:] = [e for e in entries if e != (c, role)]
                if not entries:
                    del self._ord_by_ptr[side.ptr]
            side.ptr = -1 - c.seq  # never overlaps anything again

    # -- whole-layer waits -----------------------------------------------------------------
    def _ord_land_all(self) -> None:
        """Land every copy in flight: the host waits for the last of each stream."""
        for stream in ("device", "host"):
            with self._ord_lock:
                queue = list(self._ord_streams[stream])
            if queue:
                self._ord_wait(queue[-1].batch, host=True, check=False)

    def synchronize(self) -> None:
        """Land every copy in flight and order everything after them."""
        self._ord_land_all()
        self._ord_log.raise_recorded()

    def close(self) -> None:
        """Land every copy in flight (as the CPU layer's close waits for its thread)."""
        self._ord_land_all()
        super().close()

    def _ord_drop(self, batch: _Batch) -> None:
        """Nobody will wait for ``batch``: its device buffers may be freed while it is in
        flight (on CUDA they are recorded on the copy stream: the allocator orders their reuse
        after it); its host buffers may not, and host writes into them are still checked."""
        with self._ord_lock:
            for c in batch.copies:
                c.dropped = True

    def in_flight(self) -> list[str]:
        """The copies nobody waited for yet (neither compute nor the host) nor dropped."""
        with self._ord_lock:
            return [c.describe() for q in self._ord_streams.values() for c in q
                    if not c.compute_ordered and not c.dropped]

    def abandon(self) -> list[str]:
        """Forget every copy in flight without landing it (a test ended): returns those that
        compute never waited for, described (a device copy waited for by compute only is
        complete as far as the library is concerned)."""
        with self._ord_lock:
            lost = [c for q in self._ord_streams.values() for c in q
                    if not c.compute_ordered and not c.dropped]
            for c in [c for q in self._ord_streams.values() for c in q]:
                c.snapshot = None
                self._ord_retire(c)
            return [c.describe() for c in lost]


def _report_at_exit() -> None:
    """A program run on the ordering layer (``RESIDENCY_DEVICE_LAYER=ordering``) names, on
    stderr as it exits, the violations nobody reported (raised ones failed their call)."""
    problems = check_ordering()
    if problems:
        print("residency: ordering violations:\n- " + "\n- ".join(problems), file=sys.stderr)


atexit.register(_report_at_exit)


def check_ordering() -> list[str]:
    """What a test fails for, from every live :class:`OrderingDevice`: the violations they
    recorded since the last check (raised and swallowed by the code under test, or recorded
    only by a finalizer) and the copies still in flight that nobody waited for (then
    forgotten, so that later tests are not blamed for them). Call it at each test's teardown."""
    layers = list(OrderingDevice.instances)
    if any(layer.in_flight() for layer in layers):
        gc.collect()  # buffers freed by the collector: their finalizers report now
    problems: list[str] = []
    for layer in layers:
        problems += layer.take_unreported()
        problems += [f"{c} was never waited for" for c in layer.abandon()]
    return problems
