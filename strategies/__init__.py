"""Placement of one component's weights: configuration, strategies, the device layer.

What a user needs: the configuration (modes, tunings, groups), the layerwise helpers that
prepare a module, the strategies (to recognise them), the device layers, the errors. The
plumbing the lifecycle drives (the tensor store, its moves, the strategy factory) is in
:mod:`strategies.protocol`.
"""

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
from ._errors import ResidencyError, StoreError
from ._factory import ComponentResidencyError, is_fsdp_managed
from ._filebacked import CheckpointChanged
from ._hostmem import HostBudgetExceeded
from ._layerwise import (
    LayerwiseOffloadStrategy,
    detect_block_lists,
    disable_layerwise_offload,
    enable_layerwise_offload,
    is_layerwise_offloaded,
    layerwise_blocks,
)
from .devices import (
    CopyHandle,
    CpuDevice,
    CudaDevice,
    DeviceLayer,
    UnsupportedCompute,
    make_device_layer,
    resolve_device,
)

__all__ = [
    "DIT_GROUP",
    "RESIDENCY_POLICIES",
    "VAE_GROUP",
    "CheckpointChanged",
    "ComponentResidencyError",
    "CopyHandle",
    "CpuDevice",
    "CudaDevice",
    "DeviceLayer",
    "HostBudgetExceeded",
    "LayerwiseOffloadStrategy",
    "LayerwiseTuning",
    "ResidencyConfig",
    "ResidencyError",
    "ResidencyMode",
    "ResidencyStrategy",
    "StoreError",
    "UnsupportedCompute",
    "detect_block_lists",
    "disable_layerwise_offload",
    "enable_layerwise_offload",
    "group_of",
    "is_fsdp_managed",
    "is_layerwise_offloaded",
    "layerwise_blocks",
    "make_device_layer",
    "resolve_device",
]
