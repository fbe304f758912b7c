"""The strategy protocol: what a residency mode decides for one component.

A strategy owns one :class:`TensorStore` and answers three questions; the controller does
the *when* (phases, locks, transactions):

* :meth:`awake_units` -- which units sit on the device while awake and idle (wake restores
  exactly these; sleep releases everything);
* :meth:`prepare_use` / :meth:`finish_use` -- what moves around a ``use()``;
* :meth:`ready` -- whether a forward may run now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from ._config import ResidencyMode
from ._inventory import Unit
from ._store import Move, TensorStore

__all__ = ["ResidencyStrategy"]


class ResidencyStrategy:
    """Base strategy; subclasses override the placement decisions, not the mechanics."""

    mode: ClassVar[ResidencyMode]
    #: Whether its forwards move weights themselves (layerwise: hooks fetch and evict layers).
    streams: ClassVar[bool] = False

    def __init__(self, name: str, store: TensorStore) -> None:
        self.name = name
        self.store = store
        # Raises when a forward must not run (set by the controller; hooks call it first).
        self.forward_check: Callable[[], None] = lambda: None

    def awake_units(self) -> list[Unit]:
        """Units that live on the device while the pipeline is awake and idle."""
        return list(self.store.units)

    def ready(self) -> bool:
        """Whether a forward may run now (weights it needs are on the device or come in
        by themselves)."""
        return all(u.where == "device" for u in self.awake_units())

    async def prepare_use(self) -> Move | None:
        """Prepare the moves a use needs; the caller commits them. None: nothing to move."""
        return None

    async def finish_use(self) -> int:
        """Undo what the use brought in; returns the bytes copied."""
        return 0

    def quiesce(self) -> None:
        """Give up background copies in flight (before a transition moves the store, which
        then waits for the device's queued work)."""

    def close(self) -> None:
        """Remove hooks this strategy installed (on detach)."""
