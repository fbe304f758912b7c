"""One weight update across several modules: ``{module: [(name, tensor), ...]}`` planned as a
single :class:`~lifecycle._updates.UpdatePlan`, so that it is applied all or nothing (every
module written, or none), as the reference applies a multi-module tensor upload. Used by
``update_weights_from_modules`` (and so by ``/update_weights_from_tensor`` with several
``target_modules`` and a payload keyed by module, and by ``/weights_checker``'s reset)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch

from strategies.protocol import TensorStore

from ._updates import UpdatePlan, UpdateRefused, _check_targets, _Planner, _same

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
        for i, item in enumerate(named):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise UpdateRefused(f"{target} entry {i} is not a (name, tensor) pair")
            name, tensor = item
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise UpdateRefused(f"{target} entry {i} must be (str, torch.Tensor), got "
                                    f"({type(name).__name__}, {type(tensor).__name__})")
            if tensor.is_meta or tensor.layout != torch.strided:
                raise UpdateRefused(f"tensor {target}.{name} has no dense data "
                                    f"({tensor.device}, {tensor.layout})")
            planner.add(target, name, tensor.shape, tensor.dtype,
                        functools.partial(_same, tensor))
    return planner.finish(targets)
