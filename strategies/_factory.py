"""``build_strategy``: the residency mode of a component, checked against how it was loaded."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ._base import ResidencyStrategy
from ._config import LayerwiseTuning, ResidencyConfig, ResidencyMode
from ._errors import ResidencyError
from ._inventory import Unit
from ._layerwise import (
    LayerwiseOffloadStrategy,
    check_block_lists,
    disable_layerwise_offload,
    enable_layerwise_offload,
    is_layerwise_offloaded,
    layer_keys,
    layerwise_blocks,
)
from ._layerwise import _nbytes as layer_nbytes
from ._offload import ComponentOffloadStrategy, SnapshotOffloadStrategy
from ._resident import ResidentStableStrategy, ResidentStrategy
from ._store import TensorStore
from .devices import DeviceLayer, make_device_layer

__all__ = ["ComponentResidencyError", "Shape", "build_strategy", "is_fsdp_managed"]

_RESIDENT = (ResidencyMode.RESIDENT, ResidencyMode.RESIDENT_STABLE)  # one unit per storage


class ComponentResidencyError(ResidencyError, ValueError):
    """A component's configured mode does not fit how its module was loaded."""


def is_fsdp_managed(module: nn.Module) -> bool:
    """Whether FSDP (FSDP2 ``FSDPModule`` or FSDP1 ``FullyShardedDataParallel``) owns any part
    of ``module``'s placement."""
    kinds: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        kinds = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # torch built without distributed
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
    store_layer = layer or make_device_layer("cpu")
    if is_layerwise_offloaded(module):
        layers = layer_keys(module)
        store = TensorStore(name, module, store_layer, [k for k, _ in layers])
        try:
            return LayerwiseOffloadStrategy(name, store, config.layerwise_tuning_for(name),
                                            layers)
        except ValueError as exc:  # a callable policy refused its layers
            raise ComponentResidencyError(f"Component {name!r}: {exc}") from None
    if mode is ResidencyMode.LAYERWISE_OFFLOAD:
        raise ComponentResidencyError(
            f"Component {name!r} resolved to layerwise-offload, but its loaded module did not "
            "enable layerwise offload")
    if mode in (ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.SNAPSHOT_OFFLOAD,
                ResidencyMode.RESIDENT_STABLE) and is_fsdp_managed(module):
        raise ComponentResidencyError(
            f"Component {name!r} resolved to {mode.value}, but it was loaded as an "
            "FSDP-managed module")
    # Offloaded components always move whole: one buffer and one copy each way.
    store = TensorStore(name, module, store_layer, whole=mode not in _RESIDENT,
                        refuse_dtensors=not is_fsdp_managed(module))
    return _STRATEGIES[mode](name, store)


@dataclass(frozen=True)
class Shape:
    """What a residency decides about one component's placement: the mode, and for
    layerwise offload the block lists and their tuning. Equal shapes place equally."""

    mode: ResidencyMode
    lists: tuple[str, ...] = ()
    tuning: LayerwiseTuning | None = None

    @classmethod
    def of(cls, strategy: ResidencyStrategy) -> Shape:
        if isinstance(strategy, LayerwiseOffloadStrategy):
            return cls(strategy.mode, layerwise_blocks(strategy.store.module), strategy.tuning)
        return cls(strategy.mode)

    @classmethod
    def wanted(cls, name: str, module: nn.Module, config: ResidencyConfig) -> Shape:
        """The shape ``config`` asks for ``name``; refuses what cannot work (layerwise
        without block lists, any change of an FSDP-managed component)."""
        mode = config.mode_for(name)
        if mode is not ResidencyMode.LAYERWISE_OFFLOAD:
            return cls(mode)
        lists = config.layers_for(name) or layerwise_blocks(module) or None
        tuning = config.layerwise_tuning_for(name)
        try:
            found = check_block_lists(module, lists)  # marks the module only at commit
            # A callable policy is asked now: the strategy is built at commit, which
            # cannot fail.
            tuning.pick([(k, layer_nbytes(b)) for k, b in layer_keys(module, found)])
        except ValueError as exc:
            raise ComponentResidencyError(f"Component {name!r}: {exc}") from None
        return cls(mode, found, tuning)

    def store(self, name: str, module: nn.Module, layer: DeviceLayer,
              layout: TensorStore | None = None) -> TensorStore:
        """An (unplaced) store grouped for this shape."""
        if self.mode is ResidencyMode.LAYERWISE_OFFLOAD:
            return TensorStore(name, module, layer, [k for k, _ in layer_keys(module, self.lists)],
                               layout=layout)
        return TensorStore(name, module, layer, whole=self.mode not in _RESIDENT,
                           refuse_dtensors=not is_fsdp_managed(module), layout=layout)

    def strategy(self, name: str, store: TensorStore) -> ResidencyStrategy:
        """The strategy over ``store`` (installs layerwise hooks and marks the module)."""
        if self.mode is ResidencyMode.LAYERWISE_OFFLOAD:
            assert self.tuning is not None
            enable_layerwise_offload(store.module, self.lists)
            return LayerwiseOffloadStrategy(name, store, self.tuning,
                                            layer_keys(store.module, self.lists))
        disable_layerwise_offload(store.module)
        return _STRATEGIES[self.mode](name, store)

    def awake_units(self, store: TensorStore) -> list[Unit]:
        """The units of ``store`` (grouped for this shape) on the device while awake."""
        if self.mode in _RESIDENT:
            return list(store.units)
        if self.mode is ResidencyMode.LAYERWISE_OFFLOAD:
            keys = set(store.layer_keys)
            return [u for u in store.units if u.key not in keys]
        return []


_STRATEGIES: dict[ResidencyMode, type[ResidencyStrategy]] = {
    ResidencyMode.RESIDENT: ResidentStrategy,
    ResidencyMode.RESIDENT_STABLE: ResidentStableStrategy,
    ResidencyMode.COMPONENT_OFFLOAD: ComponentOffloadStrategy,
    ResidencyMode.SNAPSHOT_OFFLOAD: SnapshotOffloadStrategy,
}
