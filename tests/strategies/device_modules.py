"""Modules and tensors in the layer's device memory already, on every layer: what a program
has on a GPU once it placed a CPU-built model (``model.to("cuda")``) before it hands it to
the library, or once its compute made a tensor. The tests that drive a store without a
controller start there; the attach of a model still in host memory (adopted into mirrors,
copied host -> device) is the controller's, tested with it. (A new copy allocated by the
layer: ``tests/helpers.py`` ``new_on_the_device``; whole pipelines re-pointed at new device
storages: ``DeviceLayer.place``.)"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from strategies import DeviceLayer
from strategies._inventory import take_inventory
from strategies.protocol import TensorStore

M = TypeVar("M", bound=nn.Module)


def in_device_memory(t: torch.Tensor, layer: DeviceLayer) -> torch.Tensor:
    """``t`` in ``layer``'s device memory (``layer.on_device``), as compute on a GPU makes
    it: moved to the layer's device, then, on a simulated GPU whose memory is its own
    (``RESIDENCY_SIM_HOST_MODULES=1``; its kernels run on the CPU and make CPU tensors),
    its CPU storage made the simulator's device memory (``runtime.adopt``). On the CPU
    layers (and the simulated GPU without the mode) a CPU tensor is there already."""
    t = t.to(layer.device)
    if not layer.on_device(t):
        runtime = getattr(layer, "runtime", None)
        if runtime is None:
            raise AssertionError(f"a tensor on {t.device} is not in the device memory of "
                                 f"{type(layer).__name__}, and the layer has no runtime to "
                                 "adopt it")
        runtime.adopt(t)
        assert layer.on_device(t)
    return t


def on_the_device(module: M, layer: DeviceLayer) -> M:
    """``module`` with every tensor a store would inventory (parameters, buffers, tensor
    attributes) :func:`in_device_memory`, in place: what ``model.to("cuda")`` leaves on a
    GPU. Nothing changes on the layers where a CPU-built module is device memory already."""
    module.to(layer.device)
    for slot in take_inventory("(placing)", module, layer.device, layer.on_device).slots:
        if not layer.on_device(slot.tensor):
            placed = in_device_memory(slot.tensor, layer)
            assert placed is slot.tensor, slot.names  # (adopted where it is)
    return module


def device_store(name: str, module: nn.Module, layer: DeviceLayer, *args: Any,
                 **kwargs: Any) -> TensorStore:
    """``TensorStore(name, module, layer, ...)`` over ``module`` placed :func:`on_the_device`
    first: every unit starts on the device tier, on every layer."""
    return TensorStore(name, on_the_device(module, layer), layer, *args, **kwargs)
