"""Writing new values into a store's tensors: a move like the others, prepared then committed
or undone, so that a weight update travels the same road as sleep and wake.

``prepare_write`` backs up what has no current copy elsewhere, then writes the new values
into the live tensors where they are (device tensors on the device, host-placed units in their
host store), chunk by chunk as the caller's loader reads them. A failure or a cancellation
while preparing restores every tensor it wrote before it propagates, so a failed prepare
leaves nothing behind. The prepared :class:`WriteMove` is then

* committed: backups dropped, versions recorded (cannot fail);
* or undone, when another component's write failed: every written tensor restored;
* and, after commit, settled: the host mirrors that served as backups are brought up to date
  from the device, so the next sleep copies nothing. The update is already complete by then:
  a failure there only leaves the mirror stale (the next sleep copies it).

Backups: a device tensor whose host mirror is current needs none (the mirror is one). Other
device tensors are backed up on the device when it has room for twice their bytes (no
device-to-host round trip), on the host otherwise; host-placed tensors on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import torch

from ._chunks import chunked
from ._device import CopyPair, Tier

if TYPE_CHECKING:
    from ._store import TensorStore, Unit, _Slot

__all__ = ["WriteMove", "WriteSource", "prepare_write"]

# Bytes read per loader call (a chunk of sources is read in a worker thread, then written).
READ_CHUNK = 256 * 2**20


@dataclass(eq=False)
class WriteSource:
    """A new value for the tensor named ``name`` (any of its names), read by ``load``."""

    name: str
    load: Callable[[], torch.Tensor]


@dataclass(eq=False)
class _Target:
    slot: _Slot
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
    device = store.layer.device
    on_device = device.type != "cpu" and any(dst.device == device for dst, _ in pairs)
    return "device" if on_device else "host"


def load_chunk(sources: Sequence[WriteSource], dtypes: Sequence[torch.dtype]
               ) -> list[torch.Tensor]:
    """Read ``sources`` and cast each to its target's dtype (runs in a worker thread)."""
    out = []
    for source, dtype in zip(sources, dtypes, strict=True):
        value = source.load()
        out.append(value if value.dtype == dtype else value.to(dtype))
    return out


@dataclass(eq=False)
class WriteMove:
    """New values written in place, old ones kept until :meth:`commit` (see module doc)."""

    store: TensorStore
    targets: list[_Target]
    bytes_copied: int = 0
    units: list[Unit] = field(default_factory=list)
    to: str = "write"

    async def _restore(self, targets: Sequence[_Target]) -> None:
        with anyio.CancelScope(shield=True):
            pairs = [t.restore_pair() for t in targets]
            await self.store.copy_pairs(pairs, _tier(pairs, self.store))
            for t in targets:
                t.forget_write()

    async def undo(self) -> None:
        """Restore every written tensor (another component's write failed)."""
        await self._restore(self.targets)
        self._drop_backups()

    def rollback(self) -> None:
        """Synchronous :meth:`undo` (blocks until the restore copy has landed)."""
        pairs = [t.restore_pair() for t in self.targets]
        if pairs:
            self.store.layer.start_copy(pairs, _tier(pairs, self.store)).wait()
            self.store.layer.synchronize()
        for t in self.targets:
            t.forget_write()
        self._drop_backups()

    def commit(self) -> None:
        """Keep the new values: backups dropped; host-placed tensors are clean (the host
        store is the written copy), device tensors dirty until :meth:`settle`."""
        self._drop_backups()
        for t in self.targets:
            t.slot.version = t.slot.tensor._version if t.unit.where == "host" else -1
        self.store.refresh_derived(self.units)

    async def settle(self) -> BaseException | None:
        """Bring the mirrors that were backups up to date; returns the error that left them
        stale instead of raising (the write itself is committed)."""
        targets = [t for t in self.targets if t.mirrored]
        pairs: list[CopyPair] = []
        for t in targets:
            assert t.slot.host_view is not None
            pairs.append((t.slot.host_view, t.live))
        try:
            await self.store.copy_pairs(pairs, "host")
        except Exception as exc:
            return exc
        for t in targets:
            t.slot.version = t.slot.tensor._version
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


async def prepare_write(store: TensorStore, sources: Sequence[WriteSource],
                        limiter: anyio.CapacityLimiter | None = None) -> WriteMove:
    """Back up, then write every source into ``store``'s live tensors (see module doc)."""
    targets = []
    for source in sources:
        slot, unit = store.slot_named(source.name)
        mirrored = (unit.where == "device" and unit.mirror_current
                    and slot.host_view is not None and slot.version == slot.tensor._version)
        targets.append(_Target(slot, unit, source, mirrored,
                               slot.version == slot.tensor._version))
    move = WriteMove(store, targets, units=list({id(t.unit): t.unit for t in targets}.values()))
    device = [t for t in targets if not t.mirrored and t.live.device.type != "cpu"]
    free = store.layer.free_bytes()
    backup_on_device = free is None or free > 2 * sum(t.nbytes for t in device)
    written: list[_Target] = []
    try:
        for t in targets:
            if not t.mirrored:
                t.backup = _backup(t, store, backup_on_device and t.live.device.type != "cpu")
        pairs = [(t.backup, t.live) for t in targets if t.backup is not None]
        await store.copy_pairs(pairs, _tier(pairs, store))
        for chunk in chunked(targets, lambda t: t.nbytes, READ_CHUNK):
            values = await anyio.to_thread.run_sync(
                load_chunk, [t.source for t in chunk], [t.slot.tensor.dtype for t in chunk],
                limiter=limiter)
            written += chunk
            pairs = [(t.live, v) for t, v in zip(chunk, values, strict=True)]
            await store.copy_pairs(pairs, _tier(pairs, store))
    except BaseException as exc:
        from ._store import forget_locals

        forget_locals(exc)  # frames that held the sources and backups
        await move._restore(written)
        move._drop_backups()
        raise
    move.bytes_copied = sum(t.nbytes for t in targets)
    return move
