"""One weight update across several modules: ``{module: [(name, tensor), ...]}`` planned as a
single :class:`~lifecycle._updates.UpdatePlan`, so that it is applied all or nothing (every
module written, or none), as the reference applies a multi-module tensor upload. Used by
``update_weights_from_modules`` (and so by ``/update_weights_from_tensor`` with several
``target_modules`` and a payload keyed by module, and by ``/weights_checker``'s reset)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from strategies.protocol import TensorStore

from ._updates import UpdatePlan, UpdateRefused, _check_targets, _Planner, add_tensors

__all__ = ["plan_from_modules"]


def plan_from_modules(stores: Mapping[str, TensorStore],
                      modules: Mapping[str, Sequence[tuple[str, torch.Tensor]]]) -> UpdatePlan:
    """Plan writing each module's named tensors (names inside the module) into it."""
    if not modules:
        raise UpdateRefused("an update names at least one module; nothing was updated")
    targets = list(modules)
    _check_targets(stores, targets)
    planner = _Planner(stores)
    for target, named in modules.items():
        if not named:
            raise UpdateRefused(f"no tensors for module {target!r}; every module named is "
                                "written (all or nothing), nothing was updated")
        add_tensors(planner, target, list(named), f"{target} ")
    return planner.finish(targets)
