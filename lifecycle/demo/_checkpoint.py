"""Checkpoint helpers of the demo, shared with the drills and the benchmarks: each tensor once
(tied weights under their first name), and the ``<root>/<component>/model.safetensors``
layout that ``update_weights_from_disk`` reads."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

__all__ = ["unique_tensors", "write_checkpoint"]


def unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``named`` with each tensor's bytes once, under the first name they come with: tied
    weights (one object, or a state dict's two views of one storage) count once; a view of
    another size (a buffer viewing a parameter's first row) is its own entry."""
    seen: set[object] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in named:
        # Meta tensors (and empty ones) have no address: for them the object is the key.
        key: object = (t.device, t.data_ptr(), t.nbytes, t.dtype) \
            if t.nbytes and not t.is_meta else id(t)
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def write_checkpoint(states: Mapping[str, Mapping[str, torch.Tensor]], root: Path, *,
                     sync: bool = False) -> Path:
    """Write ``{component: {name: tensor}}`` as ``<root>/<component>/model.safetensors``
    (tied tensors once); ``sync`` flushes it to disk (benchmarks: no writeback during a
    timed load). Returns ``root``."""
    from safetensors.torch import save_file

    for component, state in states.items():
        (root / component).mkdir(parents=True, exist_ok=True)
        save_file({n: t.detach().to("cpu").contiguous()
                   for n, t in unique_tensors(state.items()).items()},
                  str(root / component / "model.safetensors"))
    if sync:
        os.sync()
    return root
