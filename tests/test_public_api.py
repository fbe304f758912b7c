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
        "ComponentResidencyError", "DistributedUpdate", "DrainTimeout", "FSDPInferenceUnsupported",
        "GroupBroken",
        "HandOffExceedsBudget",
        "HostBudgetExceeded", "HostBudgets",
        "LifecycleController", "LifecycleError", "OccupationResult", "Phase", "PlacementReport",
        "RankChecksums", "RankFailure", "RanksDisagree", "RefusedBroadcast", "ResidencyChange",
        "ResidencyPlan",
        "InfeasibleBudget",
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
    "TensorStore", "Unit", "StoreReport", "KeptMirrors", "Move", "PreparedMove", "WriteMove", "WriteSource",
    "FileRegion", "safetensors_regions",
    "RegroupMove", "prepare_regroup", "regroup_device_bytes", "regroup_host_plan", "RestoreMove",
    "prepare_restore", "needs_restore",
    "DiscardMove", "UndiscardMove", "prepare_discard", "prepare_undiscard",
    "FileSleepMove", "FileWakeMove", "prepare_file_sleep", "prepare_file_wake", "record_files",
    "forget_files", "covered", "host_backup_bytes", "to_thread",
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


ROOT = Path(strategies.__file__).parent.parent


def _resolved_imports(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, module, inside a function)`` of every import in ``path``, wherever it is,
    relative imports made absolute (``from ..checking import X`` in ``strategies/devices/``:
    ``strategies.checking``; ``from . import _events``: ``lifecycle._events``)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" \
        else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    in_function = {id(inner) for node in ast.walk(tree)
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for inner in ast.walk(node) if inner is not node}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, id(node) in in_function) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" for a in node.names] if node.module is None else [base]
            found += [(node.lineno, name, id(node) in in_function) for name in names]
    return found


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, wherever it is (inside functions too)."""
    return [(n, m) for n, m, _ in _resolved_imports(path)]


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_strategies_never_imports_lifecycle() -> None:
    """Dependencies point one way: no module of strategies imports lifecycle."""
    for path in Path(strategies.__file__).parent.rglob("*.py"):
        bad = [(n, m) for n, m in _imports(path) if m.split(".")[0] == "lifecycle"]
        assert not bad, f"{path}: {bad}"


def test_lifecycle_imports_only_what_strategies_exports() -> None:
    """lifecycle imports ``strategies`` and ``strategies.protocol``, never a private module
    or a sub-package (but lifecycle.testing, the one public testing entry, re-exports the
    checking layers of ``strategies.checking``, and ``residency bench chunks``, an A/B of
    the store's own copy loop, swaps that loop)."""
    root = Path(lifecycle.__file__).parent
    exceptions = {root / "testing.py": {"strategies.checking"},
                  root / "cli" / "bench_chunks.py": {"strategies._store", "strategies._chunks"}}
    for path in root.rglob("*.py"):
        allowed = {"strategies", "strategies.protocol", *exceptions.get(path, ())}
        bad = [(n, m) for n, m in _imports(path)
               if m.split(".")[0] == "strategies" and m not in allowed]
        assert not bad, f"{path}: {bad}"


#: The modules of strategies the device layers stand on (nothing of the store or the
#: strategies above them).
_DEVICE_LEAVES = ("strategies._errors", "strategies._fileread", "strategies._hostmem",
                  "strategies._threads")


#: The device-layer modules that pick a checking layer, inside a function: make_device_layer
#: (RESIDENCY_DEVICE_LAYER names one) and vmm_for (the simulated virtual-memory driver, for the
#: CPU and simulated layers' resident-stable arenas).
_PICKS_A_CHECKING_LAYER = ("_layers.py", "_vmm.py")


def test_the_device_layers_import_no_strategy_and_no_checking_layer() -> None:
    """strategies.devices imports itself and the leaf modules it stands on, never the store,
    a strategy or a checking layer: but make_device_layer, inside the function, when
    RESIDENCY_DEVICE_LAYER names a checking layer."""
    root = Path(strategies.__file__).parent / "devices"
    for path in root.rglob("*.py"):
        bad = [(n, m) for n, m, lazy in _resolved_imports(path)
               if m.split(".")[0] == "strategies"
               and not _within(m, "strategies.devices", *_DEVICE_LEAVES)
               and not (path.name in _PICKS_A_CHECKING_LAYER and lazy
                        and _within(m, "strategies.checking"))]
        assert not bad, f"{path}: {bad}"


def test_the_checking_layers_stand_on_the_device_layers_only() -> None:
    """strategies.checking (the test doubles) imports itself, strategies.devices and the leaf
    modules; and nothing of strategies outside it imports it (but make_device_layer, above)."""
    root = Path(strategies.__file__).parent
    for path in (root / "checking").rglob("*.py"):
        bad = [(n, m) for n, m, _ in _resolved_imports(path)
               if m.split(".")[0] == "strategies"
               and not _within(m, "strategies.checking", "strategies.devices", *_DEVICE_LEAVES)]
        assert not bad, f"{path}: {bad}"
    for path in root.rglob("*.py"):
        if path.is_relative_to(root / "checking") or (
                path.parent == root / "devices" and path.name in _PICKS_A_CHECKING_LAYER):
            continue
        bad = [(n, m) for n, m in _imports(path) if _within(m, "strategies.checking")]
        assert not bad, f"{path}: {bad}"


def test_the_lifecycle_core_imports_neither_the_service_nor_the_command() -> None:
    """The core (lifecycle's own modules) never imports lifecycle.http or lifecycle.cli
    (``python -m lifecycle``, lifecycle/__main__.py, is the command's entry), and the service
    never imports the command."""
    root = Path(lifecycle.__file__).parent
    for path in root.glob("*.py"):
        if path.name == "__main__.py":
            continue
        bad = [(n, m) for n, m in _imports(path)
               if _within(m, "lifecycle.http", "lifecycle.cli")]
        assert not bad, f"{path}: {bad}"
    for path in (root / "http").rglob("*.py"):
        bad = [(n, m) for n, m in _imports(path) if _within(m, "lifecycle.cli")]
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
               and m.split(".")[0] not in sys.stdlib_module_names
               and not _within(m, "lifecycle.payload")]
        assert not bad, f"{path}: {bad}"
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        private = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.module or "").startswith(("payload._", "lifecycle.payload._"))]
        assert path.parent.name == "payload" or not private, f"{path}: {private}"


#: lifecycle.http's modules that must not import the routes or the app: bodies and state are
#: what the routes stand on, the answers and the route modules of _control and _transfer are
#: what the table in _routes gathers.
_BELOW_THE_ROUTES = ("_bodies", "_state", "_answers", "_control", "_transfer")


def test_the_http_package_imports_downwards_from_the_app_to_the_routes_to_the_bodies() -> None:
    """Inside lifecycle.http: the bodies, the service state, the shared answers and the route
    modules the table gathers import neither lifecycle.http._routes nor lifecycle.http._app;
    lifecycle.http._routes does not import lifecycle.http._app."""
    root = Path(lifecycle.__file__).parent / "http"
    rules = {**{name: ("lifecycle.http._routes", "lifecycle.http._app")
                for name in _BELOW_THE_ROUTES}, "_routes": ("lifecycle.http._app",)}
    for name, forbidden in rules.items():
        path = root / f"{name}.py"
        bad = [(n, m) for n, m in _imports(path) if _within(m, *forbidden)]
        assert not bad, f"{path}: {bad}"
