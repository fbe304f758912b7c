"""``resident``: every tensor on the device while awake; nothing moves around a use.
``resident-stable``: the same, its tensors re-homed into a virtual-memory arena whose
addresses a sleep and a wake keep (:mod:`strategies.devices._vmm`)."""

from __future__ import annotations

from ._base import ResidencyStrategy
from ._config import ResidencyMode
from ._store import TensorStore
from .devices._vmm import Arena, vmm_for

__all__ = ["ResidentStableStrategy", "ResidentStrategy"]


class ResidentStrategy(ResidencyStrategy):
    mode = ResidencyMode.RESIDENT


class ResidentStableStrategy(ResidencyStrategy):
    """Resident, address-stable: the store's units packed into one :class:`Arena` (made
    here: the address range is reserved now, mapped at the first placement)."""

    mode = ResidencyMode.RESIDENT_STABLE

    def __init__(self, name: str, store: TensorStore) -> None:
        super().__init__(name, store)
        if store.arena is None:
            store.arena = Arena(vmm_for(store.layer), [(u.key, u.nbytes) for u in store.units],
                                f"component {name!r}")

    def close(self) -> None:
        arena, self.store.arena = self.store.arena, None
        if arena is not None:
            arena.close()
