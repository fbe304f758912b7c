"""``component-offload`` and ``snapshot-offload``: on the host between uses.

Both bring the whole component to the device for a use. After the use, component-offload
copies back only what changed (the reference copies the whole unchanged module back every
time); snapshot-offload never copies back: the device copy is dropped and the tensors are
re-pointed at the kept host copy (changes made during the use are discarded, by design).
"""

from __future__ import annotations

from ._base import ResidencyStrategy
from ._config import ResidencyMode
from ._inventory import Unit
from ._store import Move

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
