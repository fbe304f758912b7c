"""The device layers: the four verbs every placement goes through (allocate on the device,
allocate on the host, copy a batch, wait) and the layers that implement them for real.

* :mod:`._device`: the protocol (:class:`DeviceLayer`, :class:`CopyHandle`) and the CPU layer
  (:class:`CpuDevice`);
* :mod:`._cuda`: the CUDA layer (:class:`CudaDevice`), the only code that knows CUDA, through
  one runtime seam, :mod:`._cudart` (:class:`CudaRuntime`; :class:`TorchCuda` forwards to
  ``torch.cuda``);
* :mod:`._layers`: which layer a device gets (:func:`make_device_layer`), and
  :data:`DEVICE_LAYER_ENV`, which can put a whole program's CPU layers on a checking layer.

The checking layers (test doubles: the ordering layer, the simulated GPU, the fault-injecting
layers) are in :mod:`strategies.checking`, which imports this package; this package imports
it only inside :func:`make_device_layer`, when :data:`DEVICE_LAYER_ENV` names one of them.
"""

from ._cuda import CudaDevice
from ._cudart import CudaRuntime, Event, MemoryStats, Stream, TorchCuda
from ._device import (
    CopyHandle,
    CopyPair,
    CpuDevice,
    DeviceLayer,
    Tier,
    UnsupportedCompute,
    resolve_device,
)
from ._layers import (
    DEVICE_LAYER_ENV,
    LAYER_KINDS,
    cpu_layer_kind,
    layer_seed,
    make_device_layer,
    seed_layers,
)

__all__ = [
    "DEVICE_LAYER_ENV",
    "LAYER_KINDS",
    "CopyHandle",
    "CopyPair",
    "CpuDevice",
    "CudaDevice",
    "CudaRuntime",
    "DeviceLayer",
    "Event",
    "MemoryStats",
    "Stream",
    "Tier",
    "TorchCuda",
    "UnsupportedCompute",
    "cpu_layer_kind",
    "layer_seed",
    "make_device_layer",
    "resolve_device",
    "seed_layers",
]
