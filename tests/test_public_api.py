"""The public surface is exactly what we mean it to be."""

from __future__ import annotations

from types import ModuleType

import lifecycle
import strategies


def public_names(package: ModuleType) -> set[str]:
    """Names a package offers that are neither private nor submodules."""
    return {n for n, v in vars(package).items()
            if not n.startswith("_") and not isinstance(v, ModuleType)}


def test_lifecycle_all_is_exactly_its_public_names() -> None:
    """lifecycle.__all__ is sorted, equals the names it offers, and is the documented API."""
    assert lifecycle.__all__ == sorted(lifecycle.__all__)
    assert set(lifecycle.__all__) == public_names(lifecycle)
    assert set(lifecycle.__all__) == {
        "AdmissionTimeout", "ComponentAsleep", "ComponentBusy", "ComponentNotPlaced",
        "ComponentPlacement",
        "ComponentResidencyError", "DrainTimeout", "FSDPInferenceUnsupported", "GroupBroken",
        "LifecycleController", "LifecycleError", "OccupationResult", "Phase", "PlacementReport",
        "RankChecksums", "RanksDisagree", "ResidencyChange", "ResidencyPlan", "InfeasibleBudget",
        "ResidencyError", "StoreError", "SyncLifecycleController", "TransitionFailed",
        "TransitionRejected", "UnsupportedCompute", "UpdateResult", "WeightUpdateWhileSleeping",
        "InvalidRequest", "UnknownComponent", "WeightSyncError", "WeightSyncGroupBroken",
        "WeightSyncGroupMissing", "TensorHashCheck", "WeightUpdateGroupResult",
        "WeightUpdateGroupState", "WeightsDiscarded",
        "configure_logging",
        "mermaid"}


# What strategies offers, and for whom. Configuration: everyone. Strategies and layerwise
# helpers: users choosing or preparing a module's placement. Device layers and CopyHandle:
# who brings another device. TensorStore, Unit, Move, PreparedMove, WriteMove, WriteSource,
# StoreReport, ComputeGuard: the types of the strategy protocol, for who writes a strategy
# (and for lifecycle, which may import nothing else). Shape, RegroupMove, prepare_regroup,
# check_block_lists: changing a component's residency while attached, and sizing the options;
# RestoreMove, prepare_restore, needs_restore: a detach that gives the storages back.
STRATEGIES_API = {
    "DIT_GROUP", "RESIDENCY_POLICIES", "VAE_GROUP", "LayerwiseTuning", "ResidencyConfig",
    "ResidencyMode", "group_of",
    "ResidencyStrategy", "ResidentStrategy", "ComponentOffloadStrategy", "SnapshotOffloadStrategy",
    "LayerwiseOffloadStrategy", "build_strategy", "is_fsdp_managed",
    "enable_layerwise_offload", "disable_layerwise_offload", "is_layerwise_offloaded",
    "layerwise_blocks", "detect_block_lists", "check_block_lists",
    "Shape", "RegroupMove", "prepare_regroup", "RestoreMove", "prepare_restore", "needs_restore",
    "DeviceLayer", "CpuDevice", "CudaDevice", "CopyHandle", "make_device_layer", "resolve_device",
    "TensorStore", "Unit", "Move", "PreparedMove", "WriteMove", "WriteSource", "StoreReport",
    "FileRegion", "safetensors_regions",
    "DiscardMove", "UndiscardMove", "prepare_discard", "prepare_undiscard",
    "ComputeGuard",
    "ResidencyError", "StoreError", "ComponentResidencyError", "UnsupportedCompute",
}


def test_strategies_all_is_exactly_its_public_names() -> None:
    """strategies.__all__ (kept in ruff's order) has no repeats, equals the names it offers,
    and is the argued API."""
    assert len(strategies.__all__) == len(set(strategies.__all__))
    assert set(strategies.__all__) == public_names(strategies)
    assert set(strategies.__all__) == STRATEGIES_API
    assert strategies.RESIDENCY_POLICIES == ("leading", "strided")


def test_error_tree_matches_its_documentation() -> None:
    """Each error has the documented bases."""
    assert issubclass(lifecycle.TransitionRejected, lifecycle.LifecycleError)
    assert issubclass(lifecycle.FSDPInferenceUnsupported, lifecycle.TransitionRejected)
    assert issubclass(lifecycle.FSDPInferenceUnsupported, RuntimeError)
    assert issubclass(lifecycle.WeightUpdateWhileSleeping, lifecycle.TransitionRejected)
    assert issubclass(lifecycle.DrainTimeout, lifecycle.TransitionRejected)
    assert issubclass(lifecycle.TransitionFailed, lifecycle.LifecycleError)
    assert issubclass(lifecycle.ComponentAsleep, lifecycle.LifecycleError)
    assert issubclass(lifecycle.AdmissionTimeout, TimeoutError)
    assert issubclass(strategies.ComponentResidencyError, ValueError)
    assert issubclass(lifecycle.InvalidRequest, ValueError)
    assert issubclass(lifecycle.UnknownComponent, KeyError)
    for sync_error in (lifecycle.WeightSyncGroupMissing, lifecycle.WeightSyncGroupBroken):
        assert issubclass(sync_error, lifecycle.WeightSyncError)
    for error in (lifecycle.LifecycleError, strategies.StoreError,
                  strategies.ComponentResidencyError, lifecycle.InvalidRequest,
                  lifecycle.WeightSyncError):
        assert issubclass(error, strategies.ResidencyError)
    assert lifecycle.ResidencyError is strategies.ResidencyError


def test_strategies_never_imports_lifecycle() -> None:
    """Dependencies point one way: no module of strategies imports lifecycle."""
    from pathlib import Path

    for path in Path(strategies.__file__).parent.glob("*.py"):
        assert "lifecycle" not in "".join(
            line for line in path.read_text().splitlines() if line.startswith(("import", "from")))


def test_lifecycle_imports_only_what_strategies_exports() -> None:
    """lifecycle never reaches into strategies' private modules."""
    from pathlib import Path

    root = Path(lifecycle.__file__).parent
    for path in root.rglob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import", "from")) and "strategies" in line:
                assert line.startswith(("from strategies import", "import strategies",
                                        "from strategies.testing import")), f"{path}: {line}"
