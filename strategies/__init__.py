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
from ._cuda import CudaDevice
from ._device import (
    CopyHandle,
    CpuDevice,
    DeviceLayer,
    UnsupportedCompute,
    resolve_device,
)
from ._discard import DiscardMove, UndiscardMove, prepare_discard, prepare_undiscard
from ._errors import ResidencyError
from ._factory import ComponentResidencyError, Shape, build_strategy, is_fsdp_managed
from ._fileread import FileRegion, safetensors_regions
from ._guard import ComputeGuard
from ._layers import make_device_layer
from ._layerwise import (
    LayerwiseOffloadStrategy,
    check_block_lists,
    detect_block_lists,
    disable_layerwise_offload,
    enable_layerwise_offload,
    is_layerwise_offloaded,
    layerwise_blocks,
)
from ._offload import ComponentOffloadStrategy, SnapshotOffloadStrategy
from ._regroup import (
    RegroupMove,
    RestoreMove,
    needs_restore,
    prepare_regroup,
    prepare_restore,
)
from ._resident import ResidentStrategy
from ._store import Move, PreparedMove, StoreError, StoreReport, TensorStore, Unit
from ._write import WriteMove, WriteSource

__all__ = [
    "DIT_GROUP",
    "RESIDENCY_POLICIES",
    "VAE_GROUP",
    "ComponentOffloadStrategy",
    "ComponentResidencyError",
    "ComputeGuard",
    "CopyHandle",
    "CpuDevice",
    "CudaDevice",
    "DeviceLayer",
    "DiscardMove",
    "FileRegion",
    "LayerwiseOffloadStrategy",
    "LayerwiseTuning",
    "Move",
    "PreparedMove",
    "RegroupMove",
    "ResidencyConfig",
    "ResidencyError",
    "ResidencyMode",
    "ResidencyStrategy",
    "ResidentStrategy",
    "RestoreMove",
    "Shape",
    "SnapshotOffloadStrategy",
    "StoreError",
    "StoreReport",
    "TensorStore",
    "UndiscardMove",
    "Unit",
    "UnsupportedCompute",
    "WriteMove",
    "WriteSource",
    "build_strategy",
    "check_block_lists",
    "detect_block_lists",
    "disable_layerwise_offload",
    "enable_layerwise_offload",
    "group_of",
    "is_fsdp_managed",
    "is_layerwise_offloaded",
    "layerwise_blocks",
    "make_device_layer",
    "needs_restore",
    "prepare_discard",
    "prepare_regroup",
    "prepare_restore",
    "prepare_undiscard",
    "resolve_device",
    "safetensors_regions",
]
