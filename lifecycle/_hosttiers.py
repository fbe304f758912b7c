"""Which host copies a transition is about to make, whether they fit the host budget, and
which of them get the pin budget.

Before a transition allocates a host mirror, :func:`plan_mirrors` counts the mirrors it will
make (units that will live on the host and have none yet) and refuses the whole transition
with :class:`~strategies.HostBudgetExceeded` when they would pass the host budget: refused
before any allocation, nothing changed. It also decides which of them are pinned: the pin
budget goes first to streamed layers (layerwise offload: copied at every forward), then to
offloaded components (copied at every request), then to resident ones (copied only at sleep
and wake), larger units first within each (bytes moved per use); the rest stay pageable
(staged through the layer's pinned buffers on CUDA). Each store keeps why, for the report.

A residency change is checked the same way by :func:`plan_reshape`, before its first
allocation: every host buffer its regroups will allocate (old buffers are not counted as
freed before it is done).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from strategies import DeviceLayer, ResidencyMode
from strategies.protocol import Shape, Unit, regroup_host_plan

from ._uses import AttachedComponent

__all__ = ["plan_mirrors", "plan_reshape"]

# Lower first: what gets the pin budget first, and why.
_RANKS = {ResidencyMode.LAYERWISE_OFFLOAD: (0, "streamed layers get pins first"),
          ResidencyMode.COMPONENT_OFFLOAD: (1, "moved every request: pins after streamed "
                                               "layers"),
          ResidencyMode.SNAPSHOT_OFFLOAD: (1, "moved every request: pins after streamed "
                                              "layers")}
_RESIDENT = (2, "moved only at sleep and wake: pins last")


def plan_mirrors(layer: DeviceLayer, wanted: Iterable[tuple[AttachedComponent, Sequence[Unit]]],
                 what: str) -> int:
    """Check that the mirrors ``wanted`` (per component, the units that will need a host
    copy) fit the host budget, and mark which of those still lacking one are pinned.
    Returns the host bytes they will add. :class:`~strategies.HostBudgetExceeded` (nothing
    marked) when they do not fit."""
    ledger = layer.host
    new: list[tuple[tuple[int, int], AttachedComponent, Unit, str]] = []
    for c, units in wanted:
        rank, why = _RANKS.get(c.strategy.mode, _RESIDENT)
        for u in units:
            if u.host is None:
                new.append(((rank, -u.nbytes), c, u, why))
    new.sort(key=lambda item: item[0])
    pinned_extra = needed = 0
    choice: list[tuple[AttachedComponent, Unit, bool, str]] = []
    for _, c, u, why in new:
        pin = ledger.would_pin(u.nbytes, layer.pinned, pinned_extra)
        cost = ledger.cost(u.nbytes, pin)
        pinned_extra += cost if pin else 0
        needed += cost
        choice.append((c, u, pin, why))
    ledger.check(needed, what)
    for c, u, pin, why in choice:
        store = c.strategy.store
        if pin or not layer.pinned:
            store.pageable_keys.discard(u.key)
        else:
            store.pageable_keys.add(u.key)
        store.pin_reason = (why if pin else
                            "pageable: the pin budget went to units moved more often" if
                            layer.pinned else "pageable: this layer pins nothing")
    return needed


def plan_reshape(layer: DeviceLayer, components: Mapping[str, AttachedComponent],
                 wanted: Mapping[str, Shape], awake: bool) -> int:
    """Refuse a residency change (``wanted``: the new shapes) whose host buffers would pass
    the host budget, before it allocates: :class:`~strategies.HostBudgetExceeded` naming
    the components that need them. Returns the host bytes it adds.

    Counts every fresh host buffer of its regroups (pinned within the pin budget, in the
    order the allocations ask, as they decide; else pageable). The whole change is checked
    at once, and the old stores' host buffers are not credited as freed: a hand-off while
    awake commits in two transactions and keeps the first one's old mirrors until the
    second is done (a failed load gives them back); its other old host buffers are freed
    at its commit, so the check may refuse a change that would fit only thanks to those
    (it over-counts by at most them), never admit one that does not fit."""
    ledger = layer.host
    pinned_extra = needed = 0
    names: list[str] = []
    for name, shape in wanted.items():
        c = components[name]
        old = c.strategy.store
        new = shape.store(name, c.module, layer, layout=old)
        fresh = regroup_host_plan(old, new, shape.awake_units(new) if awake else [])
        for u in fresh:
            pin = ledger.would_pin(u.nbytes, layer.pinned, pinned_extra)
            cost = ledger.cost(u.nbytes, pin)
            pinned_extra += cost if pin else 0
            needed += cost
        if fresh:
            names.append(name)
    ledger.check(needed, f"set_residency of {', '.join(names)}")
    return needed
