"""Stores over a module whose tensors are in the layer's device memory already, on every
layer: what a program has on a GPU once it placed a CPU-built model (``model.to("cuda")``)
before it hands it to the library. The tests that drive a store without a controller start
there; the attach of a model that is still in host memory (adopted into mirrors, copied
host -> device) is the controller's, tested with it."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from strategies import DeviceLayer
from strategies._inventory import take_inventory
from strategies.protocol import TensorStore

M = TypeVar("M", bound=nn.Module)


def on_the_device(module: M, layer: DeviceLayer) -> M:
    """``module`` with every tensor a store would inventory in ``layer``'s device memory
    (``layer.on_device``): moved to the layer's device (``module.to``), then, on a simulated
    GPU whose memory is its own (``RESIDENCY_SIM_HOST_MODULES=1``), the CPU storages it
    still has made the simulator's device memory (``runtime.adopt``, as ``.to("cuda")``
    would). On the CPU layers (and the simulated GPU without the mode) a CPU-built module
    is there already: nothing changes."""
    module.to(layer.device)
    inventory = take_inventory("(placing)", module, layer.device, layer.on_device)
    for slot in inventory.slots:
        if layer.on_device(slot.tensor):
            continue
        runtime = getattr(layer, "runtime", None)
        if runtime is None:
            raise AssertionError(f"{slot.names[0]!r} is not in the device memory of "
                                 f"{type(layer).__name__} and the layer has no runtime "
                                 "to adopt it")
        runtime.adopt(slot.tensor)
        assert layer.on_device(slot.tensor), slot.names
    return module


def device_store(name: str, module: nn.Module, layer: DeviceLayer, *args: Any,
                 **kwargs: Any) -> TensorStore:
    """``TensorStore(name, module, layer, ...)`` over ``module`` placed :func:`on_the_device`
    first: every unit starts on the device tier, on every layer."""
    return TensorStore(name, on_the_device(module, layer), layer, *args, **kwargs)
