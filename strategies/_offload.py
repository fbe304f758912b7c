"""``component-offload`` and ``snapshot-offload``: on the host between uses.

Both bring the whole component to the device for a use. After the use, component-offload
copies back only what changed (the reference copies the whole unchanged module back every
time); snapshot-offload never copies parameters back: the device copy is dropped and the
tensors are re-pointed at the kept host copy (parameter changes made during the use are
discarded, by design). Buffers and tensor attributes a use wrote (a running counter, batch
norm statistics) are live state, not weights: snapshot-offload copies those back (as
SGLang's snapshot keeps live buffers).
"""

from __future__ import annotations

from torch import nn

from ._base import ResidencyStrategy
from ._config import ResidencyMode
from ._inventory import Unit
from ._store import Move
from .devices import CopyPair

__all__ = ["ComponentOffloadStrategy", "SnapshotOffloadStrategy"]


class ComponentOffloadStrategy(ResidencyStrategy):
    mode = ResidencyMode.COMPONENT_OFFLOAD
    copy_back = True

    def awake_units(self) -> list[Unit]:
        return []

    def ready(self) -> bool:
        return all(u.where == "device" for u in self.store.units)

    async def prepare_use(self) -> Move | None:
        units = self.store.select("host")
        return await self.store.prepare_to_device(units) if units else None

    async def finish_use(self) -> int:
        move = await self.store.prepare_to_host(self.store.select("device"),
                                                copy_back=self.copy_back)
        move.commit()
        return move.bytes_copied


class SnapshotOffloadStrategy(ComponentOffloadStrategy):
    mode = ResidencyMode.SNAPSHOT_OFFLOAD
    copy_back = False

    async def finish_use(self) -> int:
        store = self.store
        units = store.select("device")
        pairs: list[CopyPair] = []
        for unit in units:
            if unit.host is None or not unit.mirror_current:
                continue  # (no host copy: prepare_to_host refuses it)
            for st in unit.storages:
                if any(not isinstance(s.tensor, nn.Parameter) and s.tensor._version != s.version
                       for s in st.slots):
                    device = store.locate(st)[1]
                    assert device is not None
                    pairs.append((unit.host[st.offset:st.offset + st.nbytes], device))
        copied = sum(int(dst.nbytes) for dst, _ in pairs)
        try:
            if pairs:
                await store.copy_pairs(pairs, "host")
        except BaseException:
            # Part of the mirror may hold new bytes: it is no longer the truth (the unit stays
            # on the device; the next sleep copies it whole).
            for unit in units:
                unit.mirror_current = False
            raise
        finally:
            pairs.clear()
        move = await store.prepare_to_host(units, copy_back=False)
        move.commit()
        return copied
