"""The controller a collaborator acts for: its id, rank and phase, read live, and a logger
whose every event names the rank and the controller.

The controller's collaborators (its components, uses, planner, checksums, collective, the
sleep and wake runs) hold one :class:`Owner` rather than a callable each for the phase and
the rank and the controller's id beside them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _events as events

if TYPE_CHECKING:
    from ._controller import LifecycleController
    from ._phase import Phase

__all__ = ["Owner"]


class Owner:
    """The controller ``of`` as its collaborators see it: ``id`` (tells controllers of one
    process apart), and read at each use its ``rank`` (it changes when the controller is
    rebound to a process group) and ``phase`` (named in errors). ``log``: a logger of
    ``lifecycle`` whose every event ends with ``rank`` and ``controller``, after the call's
    own keys."""

    __slots__ = ("_of", "id", "log")

    def __init__(self, of: LifecycleController) -> None:
        self._of = of
        self.id = of.id
        self.log = events.get_logger("lifecycle", naming=self.naming)

    @property
    def phase(self) -> Phase:
        """The controller's phase now (read from its machine at each use)."""
        return self._of.phase

    def naming(self) -> dict[str, int]:
        """The fields that name this controller in its events, in their order."""
        return {"rank": self.rank, "controller": self.id}

    @property
    def rank(self) -> int:
        """The controller's rank now (a rebind to a process group changes it)."""
        return self._of.rank
