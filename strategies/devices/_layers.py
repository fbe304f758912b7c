"""Which device layer a device gets: :func:`make_device_layer` and the environment variable
that puts a whole program's CPU layers on a checking layer."""

from __future__ import annotations

import itertools
import os

import torch

from ._device import CpuDevice, DeviceLayer, resolve_device

__all__ = ["DEVICE_LAYER_ENV", "LAYER_KINDS", "cpu_layer_kind", "layer_seed", "make_device_layer",
           "seed_layers"]

#: Environment variable naming the layer for a CPU device:
#:
#: * ``cpu`` (default): :class:`~strategies.CpuDevice`;
#: * ``ordering``: :class:`~strategies.checking._ordering.OrderingDevice` (copies land late, only when
#:   waited for, and ordering mistakes raise);
#: * ``cuda-sim``: :class:`~strategies.devices._cuda.CudaDevice` itself, over a simulated GPU
#:   (:mod:`strategies.checking._cudasim`): the CUDA layer's own code runs, and what would go wrong on a
#:   GPU raises;
#:
#: so that a whole program (``residency serve``, a drill, rank workers) runs its moves as CUDA
#: orders them, on a machine without a GPU.
DEVICE_LAYER_ENV = "RESIDENCY_DEVICE_LAYER"
LAYER_KINDS = ("cpu", "ordering", "cuda-sim")

_seeds = itertools.count()
_seed_base = 0


def cpu_layer_kind() -> str:
    """The layer :data:`DEVICE_LAYER_ENV` asks for on a CPU device (ValueError for anything
    not in :data:`LAYER_KINDS`)."""
    kind = os.environ.get(DEVICE_LAYER_ENV, "cpu")
    if kind not in LAYER_KINDS:
        valid = ", ".join(repr(k) for k in LAYER_KINDS)
        raise ValueError(f"{DEVICE_LAYER_ENV}={kind!r}: valid values are {valid}")
    return kind


def seed_layers(base: int) -> None:
    """Seed the delays of the checking layers made from now on: ``base``, ``base + 1``, ...
    (a test seeds them from its id, so a failure replays)."""
    global _seeds, _seed_base
    _seed_base, _seeds = base, itertools.count()


def layer_seed() -> int:
    """The next seed for a checking layer (see :func:`seed_layers`)."""
    return _seed_base + next(_seeds)


def make_device_layer(device: str | torch.device | None) -> DeviceLayer:
    """The device layer for ``device`` (see :func:`resolve_device`; a CPU device's layer is
    chosen by :data:`DEVICE_LAYER_ENV`)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        from ._cuda import CudaDevice

        return CudaDevice(dev)
    kind = cpu_layer_kind()
    if kind == "ordering":
        from ..checking import OrderingDevice

        return OrderingDevice(dev, seed=layer_seed())
    if kind == "cuda-sim":
        from ..checking import checking_sim
        from ._cuda import CudaDevice

        return CudaDevice(dev, runtime=checking_sim())
    return CpuDevice(dev)
