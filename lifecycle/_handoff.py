"""The transient device peak of a residency hand-off, predicted before anything moves.

``set_residency`` applies a change as one transaction or, for a hand-off while awake, as
two (the components going to an offload mode released first, the others loaded after:
``LifecycleController._hand_off``). Inside a transaction every moving component's new
placement is allocated while its old one is still held (the old one is freed at commit),
so a step peaks at the bytes held before it plus the bytes its moves allocate. This
module is that arithmetic, pure: the controller feeds it what the stores say."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Reshape", "hand_off_peak"]


@dataclass(frozen=True)
class Reshape:
    """One component's move, in device bytes: ``held`` now, ``after`` once committed, and
    ``fresh``, the device buffers its preparation allocates (what the new placement does
    not keep of the old one's buffers) while the old placement is still held."""

    name: str
    held: int
    after: int
    fresh: int


def hand_off_peak(held_bytes: int, steps: Sequence[Sequence[Reshape]]) -> int:
    """The device peak of applying ``steps`` (transactions, in order) from ``held_bytes``
    held now: each step holds what is held before it plus what its moves allocate, then
    holds what it committed."""
    peak = held = held_bytes
    for step in steps:
        peak = max(peak, held + sum(r.fresh for r in step))
        held += sum(r.after - r.held for r in step)
    return peak
