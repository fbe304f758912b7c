"""Helpers for testing code that uses this library (and for this library's own tests).

:class:`FaultyDevice` wraps a real device layer and fails the k-th copy or allocation, or
slows every copy down, so that rollback and cancellation paths run for real. It counts
every copy and allocation so a test can enumerate every failure point::

    probe = FaultyDevice(CpuDevice())
    ... run the operation once with probe ...
    for k in range(1, probe.copies + 1):
        layer = FaultyDevice(CpuDevice(), fail_copy_at=k)
        ...
"""

from __future__ import annotations

import time

import torch

from strategies import CpuDevice
from strategies._device import Tier

__all__ = ["FaultyDevice", "InjectedFault"]


class InjectedFault(RuntimeError):
    """The failure a :class:`FaultyDevice` raises at its chosen point."""


class FaultyDevice(CpuDevice):
    """A CPU device layer that fails the ``fail_copy_at``-th copy or the
    ``fail_alloc_at``-th allocation (1-based, counted over the layer's life), and sleeps
    ``copy_delay`` seconds in every copy (for cancellation tests).

    Copies before the failing one really happen: the failure is a real partial move.
    """

    def __init__(self, device: torch.device | None = None, *, fail_copy_at: int | None = None,
                 fail_alloc_at: int | None = None, copy_delay: float = 0.0) -> None:
        super().__init__(device)
        self.fail_copy_at = fail_copy_at
        self.fail_alloc_at = fail_alloc_at
        self.copy_delay = copy_delay
        self.faults = 0

    def arm(self, *, copy_at: int | None = None, alloc_at: int | None = None) -> None:
        """Fail the ``copy_at``-th / ``alloc_at``-th operation from now on (1 = the next)."""
        self.fail_copy_at = None if copy_at is None else self.copies + copy_at
        self.fail_alloc_at = None if alloc_at is None else self.allocations + alloc_at

    def _alloc(self, nbytes: int, tier: Tier) -> torch.Tensor:
        if self.allocations == self.fail_alloc_at:
            self.faults += 1
            self.fail_alloc_at = None
            raise InjectedFault(f"injected allocation failure ({tier}, {nbytes} bytes)")
        return super()._alloc(nbytes, tier)

    def _copy_one(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copy_delay:
            time.sleep(self.copy_delay)
        if self.copies + 1 == self.fail_copy_at:
            self.faults += 1
            self.fail_copy_at = None
            raise InjectedFault(f"injected copy failure ({src.nbytes} bytes)")
        super()._copy_one(dst, src)
