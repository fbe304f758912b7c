"""Host memory as a budget: every host buffer a device layer allocates, counted by kind.

A layer's :class:`HostLedger` sees each host allocation before it happens
(:meth:`HostLedger.admit`) and each host buffer's death (a weak reference to its storage,
as the device bytes are counted). It holds two optional budgets, in bytes:

* ``host_budget``: every host byte the library holds (pinned and pageable). An allocation
  that would pass it is refused *before* allocating, with :class:`HostBudgetExceeded` naming
  the numbers; the move that asked rolls back like after any failed allocation.
* ``pin_budget``: the page-locked part. A buffer that wants pinning and would pass it is
  allocated pageable instead (never refused for that): on CUDA its copies are staged through
  the layer's two pinned buffers (:class:`~strategies.devices._cuda.CudaDevice`).

Bytes count as they really occupy memory: a pinned buffer's footprint (rounded up to pages,
``DeviceLayer.pinned_footprint``), a pageable one's size.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ._errors import ResidencyError

__all__ = ["HostBudgetExceeded", "HostHeld", "HostLedger"]


class HostBudgetExceeded(ResidencyError, MemoryError):
    """A move would hold more host bytes than the host budget allows; refused before the
    allocation (nothing changed). ``needed``: the bytes asked for; ``held``: held now;
    ``budget``: the budget; ``what``: what asked."""

    def __init__(self, needed: int, held: int, budget: int, what: str = "host buffer") -> None:
        self.needed, self.held, self.budget, self.what = needed, held, budget, what
        super().__init__(
            f"{what} needs {needed:,} host bytes, {held:,} held of a host budget of "
            f"{budget:,} ({max(0, budget - held):,} left): refused before allocating; raise "
            "host_budget (--host-budget), release other host memory, or discard or "
            "file-back components at sleep")


@dataclass(frozen=True)
class HostHeld:
    """Host bytes the library holds now, by kind (footprints)."""

    pinned: int
    pageable: int

    @property
    def total(self) -> int:
        return self.pinned + self.pageable


class _Death(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a counted host buffer's storage that knows its key."""

    __slots__ = ("key",)
    key: int


class HostLedger:
    """The host buffers of one device layer, live, by kind; the budgets they are held to.
    ``footprint``: the bytes a pinned buffer of n bytes really locks."""

    def __init__(self, footprint: Callable[[int], int]) -> None:
        self._footprint = footprint
        self.host_budget: int | None = None
        self.pin_budget: int | None = None
        self._lock = threading.Lock()
        # id(storage) -> (footprint, pinned), while the storage lives. A death only appends
        # its weak reference to ``_dead`` (a C-level append: it may happen inside the cyclic
        # collector, in any thread, even while this ledger's lock is held), drained under
        # the lock before every read and every new count.
        self._live: dict[int, tuple[int, bool]] = {}
        self._refs: dict[int, _Death] = {}
        self._dead: list[_Death] = []
        self._pinned = 0
        self._pageable = 0
        self.peak = 0  # most host bytes held at once
        self.refused = 0  # allocations refused for the host budget
        self.unpinned = 0  # buffers that asked for pinning here and were made pageable
        self.exempt = 0  # inside unbudgeted(): no refusal

    def set_budgets(self, host_budget: int | None, pin_budget: int | None) -> None:
        for name, value in (("host budget", host_budget), ("pin budget", pin_budget)):
            if value is not None and (isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative number of bytes or None, "
                                 f"got {value!r}")
        self.host_budget, self.pin_budget = host_budget, pin_budget

    def _drain(self) -> None:
        """Uncount the buffers that died since (under ``_lock``)."""
        dead = self._dead
        while dead:
            death = dead.pop()
            if self._refs.get(death.key) is not death:
                continue  # (its id is a newer buffer's now: that one stays counted)
            del self._refs[death.key]
            cost, pinned = self._live.pop(death.key)
            if pinned:
                self._pinned -= cost
            else:
                self._pageable -= cost

    def held(self) -> HostHeld:
        with self._lock:
            self._drain()
            return HostHeld(self._pinned, self._pageable)

    def cost(self, nbytes: int, pinned: bool) -> int:
        """Host bytes a buffer of ``nbytes`` occupies, pinned or not."""
        return self._footprint(nbytes) if pinned else nbytes

    def would_pin(self, nbytes: int, wants: bool, pinned_extra: int = 0) -> bool:
        """Whether a buffer of ``nbytes`` that ``wants`` pinning is pinned, given
        ``pinned_extra`` more pinned bytes to come before it."""
        if not wants or not nbytes:
            return False
        if self.pin_budget is None:
            return True
        with self._lock:
            self._drain()
            return self._pinned + pinned_extra + self._footprint(nbytes) <= self.pin_budget

    def check(self, needed: int, what: str) -> None:
        """Refuse ``needed`` more host bytes if they would pass the host budget."""
        budget = self.host_budget
        if budget is None or needed <= 0:
            return
        with self._lock:
            self._drain()
            held = self._pinned + self._pageable
            over = held + needed > budget
            self.refused += over
        if over:
            raise HostBudgetExceeded(needed, held, budget, what)

    def admit(self, nbytes: int, wants_pinned: bool) -> bool:
        """Before allocating a host buffer: whether it is pinned (the pin budget decides);
        :class:`HostBudgetExceeded` if it would pass the host budget."""
        pinned = self.would_pin(nbytes, wants_pinned)
        if wants_pinned and not pinned and nbytes:
            with self._lock:
                self.unpinned += 1
        if not self.exempt:
            self.check(self.cost(nbytes, pinned), "a host buffer")
        return pinned

    @contextlib.contextmanager
    def unbudgeted(self) -> Iterator[None]:
        """Allocations inside are counted but never refused (a detach: it hands every byte
        back to the caller's module, and refusing would leave them nowhere)."""
        self.exempt += 1
        try:
            yield
        finally:
            self.exempt -= 1

    def track(self, buf: torch.Tensor, pinned: bool) -> None:
        """Count ``buf`` (just allocated) until its storage dies."""
        storage = buf.untyped_storage()
        key = id(storage)
        cost = self.cost(int(storage.nbytes()), pinned)
        death = _Death(storage, self._dead.append)
        death.key = key
        with self._lock:
            self._drain()  # first: a buffer that died may have had this id
            self._live[key] = (cost, pinned)
            if pinned:
                self._pinned += cost
            else:
                self._pageable += cost
            self.peak = max(self.peak, self._pinned + self._pageable)
            self._refs[key] = death

    def kind(self, buf: torch.Tensor) -> tuple[int, bool] | None:
        """``(footprint, pinned)`` of a host buffer this ledger counts (None: not one)."""
        with self._lock:
            self._drain()
            return self._live.get(id(buf.untyped_storage()))
