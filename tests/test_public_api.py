"""The public surface is exactly what we mean it to be."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
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
        "AdmissionTimeout", "CheckpointChanged", "CheckpointMismatch", "ComponentAsleep",
        "ComponentBusy", "ComponentNotPlaced",
        "ComponentPlacement",
        "ComponentResidencyError", "DrainTimeout", "FSDPInferenceUnsupported", "GroupBroken",
        "HandOffExceedsBudget",
        "HostBudgetExceeded", "HostBudgets",
        "LifecycleController", "LifecycleError", "OccupationResult", "Phase", "PlacementReport",
        "RankChecksums", "RanksDisagree", "ResidencyChange", "ResidencyPlan", "InfeasibleBudget",
        "ResidencyError", "StoreError", "SyncLifecycleController", "TransitionFailed",
        "TransitionRejected", "UnsupportedCompute", "UpdateResult", "WeightUpdateWhileSleeping",
        "InvalidRequest", "UnknownComponent", "WeightSyncError", "WeightSyncGroupBroken",
        "WeightSyncGroupMissing", "TensorHashCheck", "WeightUpdateGroupResult",
        "WeightUpdateGroupState", "WeightsDiscarded",
        "configure_logging",
        "mermaid"}


# What strategies offers, and for whom. Configuration: everyone. Layerwise helpers: users
# preparing a module. The strategies: to recognise one (``ctl.strategy(name)``). Device
# layers and CopyHandle: who brings another device. The errors. No more than 30 names.
STRATEGIES_API = {
    "DIT_GROUP", "RESIDENCY_POLICIES", "VAE_GROUP", "LayerwiseTuning", "ResidencyConfig",
    "ResidencyMode", "group_of",
    "ResidencyStrategy", "LayerwiseOffloadStrategy", "is_fsdp_managed",
    "enable_layerwise_offload", "disable_layerwise_offload", "is_layerwise_offloaded",
    "layerwise_blocks", "detect_block_lists",
    "DeviceLayer", "CpuDevice", "CudaDevice", "CopyHandle", "make_device_layer", "resolve_device",
    "HostBudgetExceeded",
    "ResidencyError", "StoreError", "ComponentResidencyError", "UnsupportedCompute",
    "CheckpointChanged",
}
# strategies.protocol: the types of the strategy protocol and the moves the lifecycle drives
# (TensorStore, Unit, the prepared moves: placement, writes, regrouping for a residency
# change and the device bytes it allocates, restoring at detach, discarding), the factory,
# the forward guard, and
# forget_locals (a failed move's frames must not keep its buffers: lifecycle uses it too).
PROTOCOL_API = {
    "ResidencyStrategy", "ResidentStrategy", "ComponentOffloadStrategy", "SnapshotOffloadStrategy",
    "build_strategy", "Shape", "check_block_lists", "ComputeGuard", "forget_locals",
    "TensorStore", "Unit", "StoreReport", "Move", "PreparedMove", "WriteMove", "WriteSource",
    "FileRegion", "safetensors_regions",
    "RegroupMove", "prepare_regroup", "regroup_device_bytes", "regroup_host_plan", "RestoreMove",
    "prepare_restore", "needs_restore",
    "DiscardMove", "UndiscardMove", "prepare_discard", "prepare_undiscard",
    "FileSleepMove", "FileWakeMove", "prepare_file_sleep", "prepare_file_wake", "record_files",
    "forget_files", "covered", "host_backup_bytes",
}


def test_strategies_all_is_exactly_its_public_names() -> None:
    """strategies.__all__ (kept in ruff's order) has no repeats, equals the names it offers,
    is the argued API, and stays small enough to hold in mind; strategies.protocol's too."""
    from strategies import protocol

    assert len(strategies.__all__) == len(set(strategies.__all__)) <= 30
    assert set(strategies.__all__) == public_names(strategies)
    assert set(strategies.__all__) == STRATEGIES_API
    assert strategies.RESIDENCY_POLICIES == ("leading", "strided", "first_last")
    assert protocol.__all__ == sorted(protocol.__all__)
    assert set(protocol.__all__) == public_names(protocol) == PROTOCOL_API


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


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, wherever it is (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_strategies_never_imports_lifecycle() -> None:
    """Dependencies point one way: no module of strategies imports lifecycle."""
    for path in Path(strategies.__file__).parent.rglob("*.py"):
        bad = [(n, m) for n, m in _imports(path) if m.split(".")[0] == "lifecycle"]
        assert not bad, f"{path}: {bad}"


def test_lifecycle_imports_only_what_strategies_exports() -> None:
    """lifecycle imports ``strategies`` and ``strategies.protocol``, never a private module
    (but lifecycle.testing, the one public testing entry, re-exports the testing layers of the
    private strategies._testing: the only private module lifecycle may import)."""
    root = Path(lifecycle.__file__).parent
    for path in root.rglob("*.py"):
        allowed = {"strategies", "strategies.protocol"}
        if path == root / "testing.py":
            allowed.add("strategies._testing")
        bad = [(n, m) for n, m in _imports(path)
               if m.split(".")[0] == "strategies" and m not in allowed]
        assert not bad, f"{path}: {bad}"


def test_payload_imports_only_torch_and_the_standard_library() -> None:
    """lifecycle.payload (the decoding of uploads, a security boundary audited on its own)
    imports torch, the standard library and its own modules: not the rest of lifecycle, not
    strategies, not the HTTP service's libraries; and lifecycle.http reaches it only through
    the package (its ``__all__``), never a private module of it."""
    root = Path(lifecycle.__file__).parent
    for path in (root / "payload").rglob("*.py"):
        tree = ast.parse(path.read_text())
        relative = [(node.lineno, node.level, node.module) for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level > 0
                    and (node.level > 1 or not (node.module or "").startswith("_"))]
        assert not relative, f"{path}: {relative}"
        bad = [(n, m) for n, m in _imports(path) if m.split(".")[0] != "torch"
               and m.split(".")[0] not in sys.stdlib_module_names]
        assert not bad, f"{path}: {bad}"
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        private = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.module or "").startswith(("payload._", "lifecycle.payload._"))]
        assert path.parent.name == "payload" or not private, f"{path}: {private}"
