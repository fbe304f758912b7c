"""Placement of one component's weights: configuration, strategies, the device layer."""

from ._base import ResidencyStrategy
from ._config import (
    DIT_GROUP,
    RESIDENCY_POLICIES,
    VAE_GROUP,
    LayerwiseTuning,
    ResidencyConfig,
    ResidencyMode,
    group_of,
)
from ._device import (
    CopyHandle,
    CpuDevice,
    CudaDevice,
    DeviceLayer,
    make_device_layer,
    resolve_device,
)
from ._factory import ComponentResidencyError, build_strategy, is_fsdp_managed
from ._guard import ComputeGuard
from ._resident import ResidentStrategy
from ._store import Move, StoreError, StoreReport, TensorStore, Unit

__all__ = [
    "DIT_GROUP",
    "RESIDENCY_POLICIES",
    "VAE_GROUP",
    "ComponentResidencyError",
    "ComputeGuard",
    "CopyHandle",
    "CpuDevice",
    "CudaDevice",
    "DeviceLayer",
    "LayerwiseTuning",
    "Move",
    "ResidencyConfig",
    "ResidencyMode",
    "ResidencyStrategy",
    "ResidentStrategy",
    "StoreError",
    "StoreReport",
    "TensorStore",
    "Unit",
    "build_strategy",
    "group_of",
    "is_fsdp_managed",
    "make_device_layer",
    "resolve_device",
]
