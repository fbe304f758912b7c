"""The public surface is exactly what we mean it to be."""

from __future__ import annotations

import lifecycle
import strategies


def test_lifecycle_exports_the_contract_names() -> None:
    """lifecycle.__all__ is the documented API, sorted, and every name resolves."""
    assert lifecycle.__all__ == sorted(lifecycle.__all__)
    assert set(lifecycle.__all__) == {
        "AdmissionTimeout", "ComponentAsleep", "ComponentNotPlaced", "ComponentPlacement",
        "DrainTimeout", "FSDPInferenceUnsupported", "LifecycleController", "LifecycleError",
        "OccupationResult", "Phase", "PlacementReport", "TransitionFailed",
        "TransitionRejected", "UpdateResult", "WeightUpdateWhileSleeping",
        "configure_logging", "mermaid"}
    assert all(hasattr(lifecycle, name) for name in lifecycle.__all__)


def test_strategies_exports_the_contract_names() -> None:
    """strategies.__all__ contains the issue's contract names and resolves."""
    contract = {"ResidencyMode", "ResidencyConfig", "LayerwiseTuning", "RESIDENCY_POLICIES",
                "ComponentResidencyError", "build_strategy", "enable_layerwise_offload",
                "is_layerwise_offloaded"}
    assert contract <= set(strategies.__all__)
    assert all(hasattr(strategies, name) for name in strategies.__all__)
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


def test_strategies_never_imports_lifecycle() -> None:
    """Dependencies point one way: no module of strategies imports lifecycle."""
    from pathlib import Path

    for path in Path(strategies.__file__).parent.glob("*.py"):
        assert "lifecycle" not in "".join(
            line for line in path.read_text().splitlines() if line.startswith(("import", "from")))
