"""The file-backed tier, the controller's side: which checkpoint files a component's weights
are recorded as (``attach(checkpoint=...)`` verifies them; ``update_weights_from_disk``
records what it read), and what every other update forgets (see
:mod:`strategies._filebacked`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

import torch

from strategies.protocol import FileRegion, TensorStore, forget_files, record_files

from ._errors import CheckpointMismatch
from ._updates import UpdatePlan, UpdateRefused, plan_from_disk

__all__ = ["after_update", "verify_checkpoint"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _read(region: FileRegion) -> torch.Tensor:
    """A region's bytes read into a fresh buffer with ``preadv`` (not through a mapping of
    the file, whose pages would count in the process's resident memory)."""
    buf = torch.empty(region.nbytes, dtype=torch.uint8)
    if not region.nbytes:
        return buf
    view = memoryview((ctypes.c_char * region.nbytes).from_address(buf.data_ptr())).cast("B")
    fd = os.open(region.path, os.O_RDONLY)
    try:
        done = 0
        while done < region.nbytes:
            n = os.preadv(fd, [view[done:]], region.offset + done)
            if not n:
                raise CheckpointMismatch(region.path, f"the file ends before byte "
                                         f"{region.offset + done}")
            done += n
    finally:
        os.close(fd)
    return buf


def verify_checkpoint(stores: Mapping[str, TensorStore], path: str | os.PathLike[str]
                      ) -> dict[str, dict[str, FileRegion]]:
    """``{component: {tensor: region}}`` of checkpoint ``path`` (laid out as
    ``update_weights_from_disk`` reads it), each tensor checked byte for byte against the
    component's (blocking: it reads every file once). :class:`CheckpointMismatch` for a
    checkpoint that cannot be read or is not these weights."""
    try:
        plan = plan_from_disk(stores, path, None)
    except UpdateRefused as exc:
        raise CheckpointMismatch(str(path), str(exc)) from None
    try:
        out: dict[str, dict[str, FileRegion]] = {}
        for w in plan.writes:
            live = stores[w.component].tensor_named(w.name)
            assert live is not None  # (the plan checked the names, shapes and dtypes)
            direct = w.region is not None and hasattr(os, "preadv")
            got = _read(w.region) if direct and w.region is not None else _bytes(w.load())
            if not torch.equal(got, _bytes(live)):
                raise CheckpointMismatch(str(path), f"tensor {w.name!r} of component "
                                         f"{w.component!r} differs from the file's",
                                         w.component, w.name)
            if w.region is not None:
                out.setdefault(w.component, {})[w.name] = w.region
        return out
    finally:
        plan.close()


def after_update(kind: str, plan: UpdatePlan, stores: Mapping[str, TensorStore]) -> None:
    """After a committed update: the tensors it wrote are no longer any file's bytes, but an
    update from disk's are its files' (where read as they are: no cast)."""
    for component in plan.components:
        written = {w.name for w in plan.writes if w.component == component}
        store = stores[component]
        if kind != "update_from_disk":
            forget_files(store)
            continue
        forget_files(store, written)
        record_files(store, {w.name: w.region for w in plan.writes
                             if w.component == component and w.region is not None})
