"""The checking layers: test doubles of the device layers, shipped for testing code that uses
this library (and for this library's own tests). :mod:`lifecycle.testing`, the one public
testing entry, re-exports them.

* :mod:`._ordering`: :class:`OrderingDevice`, the CPU layer with CUDA's ordering made strict
  and visible (copies land late, only when waited for, poison until then; every ordering
  mistake is an :class:`OrderingViolation`, :func:`check_ordering`);
* :mod:`._cudasim`: :class:`SimCuda`, a simulated GPU behind the CUDA layer's runtime seam, so
  that :class:`~strategies.devices.CudaDevice`'s own code runs on the CPU and what would go
  wrong on a GPU is a :class:`CudaSimViolation` (:func:`check_cuda_sim`);
* :mod:`._faults`: fault injection (:class:`FaultInjection`: fail the k-th copy or
  allocation, slow copies down) on each layer: :class:`FaultyDevice` (CPU),
  :class:`OrderingFaultyDevice`, :class:`FaultyCudaDevice`; and the factories that follow
  :data:`~strategies.devices.DEVICE_LAYER_ENV` (:func:`faulty_device_layer`,
  :func:`faulty_cpu_layer_class`, :func:`sim_cuda_layer`).

It re-exports :data:`~strategies.devices.DEVICE_LAYER_ENV` (with :data:`LAYER_KINDS`,
:func:`seed_layers` and :func:`layer_seed`): the variable that selects a checking layer.

This package imports :mod:`strategies.devices` and the leaf modules of :mod:`strategies`;
nothing outside it imports it but :func:`~strategies.devices.make_device_layer` (inside the
function, when the environment names a checking layer) and :mod:`lifecycle.testing`.
"""

from ..devices import DEVICE_LAYER_ENV, LAYER_KINDS, layer_seed, seed_layers
from ._cudasim import (
    CONV_WORKSPACE_BYTES,
    WORKSPACE_BYTES,
    CudaSimViolation,
    SimCuda,
    SimEvent,
    SimStream,
    check_cuda_sim,
    checking_sim,
)
from ._faults import (
    FaultInjection,
    FaultyCudaDevice,
    FaultyDevice,
    InjectedFault,
    OrderingFaultyDevice,
    faulty_cpu_layer_class,
    faulty_device_layer,
    sim_cuda_layer,
)
from ._ordering import POISON, OrderingDevice, OrderingViolation, Violations, check_ordering, poison

__all__ = [
    "CONV_WORKSPACE_BYTES",
    "DEVICE_LAYER_ENV",
    "LAYER_KINDS",
    "POISON",
    "WORKSPACE_BYTES",
    "CudaSimViolation",
    "FaultInjection",
    "FaultyCudaDevice",
    "FaultyDevice",
    "InjectedFault",
    "OrderingDevice",
    "OrderingFaultyDevice",
    "OrderingViolation",
    "SimCuda",
    "SimEvent",
    "SimStream",
    "Violations",
    "check_cuda_sim",
    "check_ordering",
    "checking_sim",
    "faulty_cpu_layer_class",
    "faulty_device_layer",
    "layer_seed",
    "poison",
    "seed_layers",
    "sim_cuda_layer",
]
