"""``build_strategy``: the residency mode of a component, checked against how it was loaded."""

from __future__ import annotations

from torch import nn

from ._base import ResidencyStrategy
from ._config import ResidencyConfig, ResidencyMode
from ._device import CpuDevice, DeviceLayer
from ._errors import ResidencyError
from ._layerwise import LayerwiseOffloadStrategy, is_layerwise_offloaded, layer_keys
from ._offload import ComponentOffloadStrategy, SnapshotOffloadStrategy
from ._resident import ResidentStrategy
from ._store import TensorStore

__all__ = ["ComponentResidencyError", "build_strategy", "is_fsdp_managed"]


class ComponentResidencyError(ResidencyError, ValueError):
    """A component's configured mode does not fit how its module was loaded."""


def is_fsdp_managed(module: nn.Module) -> bool:
    """Whether FSDP (FSDP2 ``FSDPModule`` or FSDP1 ``FullyShardedDataParallel``) owns any part
    of ``module``'s placement."""
    kinds: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        kinds = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return any(isinstance(m, tuple(kinds)) for m in module.modules())


def build_strategy(name: str, module: nn.Module, config: ResidencyConfig,
                   layer: DeviceLayer | None = None) -> ResidencyStrategy:
    """The strategy for component ``name``, refusing combinations that cannot work.

    Rules (the reference's): a layerwise-enabled module always gets the layerwise strategy;
    ``layerwise-offload`` on a module that did not enable it is an error; component- or
    snapshot-offload of an FSDP-managed module is an error; otherwise the configured mode.
    """
    mode = config.mode_for(name)
    store_layer = layer or CpuDevice()
    if is_layerwise_offloaded(module):
        layers = layer_keys(module)
        store = TensorStore(name, module, store_layer, [k for k, _ in layers])
        return LayerwiseOffloadStrategy(name, store, config.layerwise_tuning_for(name), layers)
    if mode is ResidencyMode.LAYERWISE_OFFLOAD:
        raise ComponentResidencyError(
            f"Component {name!r} resolved to layerwise-offload, but its loaded module did not "
            "enable layerwise offload")
    if mode in (ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.SNAPSHOT_OFFLOAD) \
            and is_fsdp_managed(module):
        raise ComponentResidencyError(
            f"Component {name!r} resolved to {mode.value}, but it was loaded as an "
            "FSDP-managed module")
    # Offloaded components always move whole: one buffer and one copy each way.
    store = TensorStore(name, module, store_layer, whole=mode is not ResidencyMode.RESIDENT,
                        refuse_dtensors=not is_fsdp_managed(module))
    return _STRATEGIES[mode](name, store)


_STRATEGIES: dict[ResidencyMode, type[ResidencyStrategy]] = {
    ResidencyMode.RESIDENT: ResidentStrategy,
    ResidencyMode.COMPONENT_OFFLOAD: ComponentOffloadStrategy,
    ResidencyMode.SNAPSHOT_OFFLOAD: SnapshotOffloadStrategy,
}
