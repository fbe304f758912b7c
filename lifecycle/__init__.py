"""The lifecycle of a model pipeline's weights: attach, sleep, wake, update, detach."""

from strategies import ComponentResidencyError, ResidencyError, StoreError, UnsupportedCompute

from ._controller import LifecycleController
from ._errors import (
    AdmissionTimeout,
    ComponentAsleep,
    ComponentNotPlaced,
    DrainTimeout,
    FSDPInferenceUnsupported,
    GroupBroken,
    LifecycleError,
    RanksDisagree,
    TransitionFailed,
    TransitionRejected,
    WeightUpdateWhileSleeping,
)
from ._events import configure_logging
from ._phase import Phase, mermaid
from ._planner import InfeasibleBudget, ResidencyPlan
from ._results import (
    ComponentPlacement,
    OccupationResult,
    PlacementReport,
    RankChecksums,
    ResidencyChange,
    UpdateResult,
)
from ._sync import SyncLifecycleController

__all__ = [
    "AdmissionTimeout",
    "ComponentAsleep",
    "ComponentNotPlaced",
    "ComponentPlacement",
    "ComponentResidencyError",
    "DrainTimeout",
    "FSDPInferenceUnsupported",
    "GroupBroken",
    "InfeasibleBudget",
    "LifecycleController",
    "LifecycleError",
    "OccupationResult",
    "Phase",
    "PlacementReport",
    "RankChecksums",
    "RanksDisagree",
    "ResidencyChange",
    "ResidencyError",
    "ResidencyPlan",
    "StoreError",
    "SyncLifecycleController",
    "TransitionFailed",
    "TransitionRejected",
    "UnsupportedCompute",
    "UpdateResult",
    "WeightUpdateWhileSleeping",
    "configure_logging",
    "mermaid",
]
