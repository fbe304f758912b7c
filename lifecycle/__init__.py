"""The lifecycle of a model pipeline's weights: attach, sleep, wake, update, detach."""

from strategies import (
    CheckpointChanged,
    ComponentResidencyError,
    HostBudgetExceeded,
    ResidencyError,
    StoreError,
    UnsupportedCompute,
)

from ._blocking import SyncLifecycleController
from ._controller import LifecycleController
from ._errors import (
    AdmissionTimeout,
    CheckpointMismatch,
    ComponentAsleep,
    ComponentBusy,
    ComponentNotPlaced,
    DrainTimeout,
    FSDPInferenceUnsupported,
    GroupBroken,
    HandOffExceedsBudget,
    InvalidRequest,
    LifecycleError,
    RanksDisagree,
    TransitionFailed,
    TransitionRejected,
    UnknownComponent,
    WeightsDiscarded,
    WeightSyncError,
    WeightSyncGroupBroken,
    WeightSyncGroupMissing,
    WeightUpdateWhileSleeping,
)
from ._events import configure_logging
from ._hostbudget import HostBudgets
from ._phase import Phase, mermaid
from ._planner import InfeasibleBudget, ResidencyPlan
from ._results import (
    ComponentPlacement,
    OccupationResult,
    PlacementReport,
    RankChecksums,
    ResidencyChange,
    TensorHashCheck,
    UpdateResult,
    WeightUpdateGroupResult,
    WeightUpdateGroupState,
)
from ._weight_sync import DistributedUpdate, RefusedBroadcast

__all__ = [
    "AdmissionTimeout",
    "CheckpointChanged",
    "CheckpointMismatch",
    "ComponentAsleep",
    "ComponentBusy",
    "ComponentNotPlaced",
    "ComponentPlacement",
    "ComponentResidencyError",
    "DistributedUpdate",
    "DrainTimeout",
    "FSDPInferenceUnsupported",
    "GroupBroken",
    "HandOffExceedsBudget",
    "HostBudgetExceeded",
    "HostBudgets",
    "InfeasibleBudget",
    "InvalidRequest",
    "LifecycleController",
    "LifecycleError",
    "OccupationResult",
    "Phase",
    "PlacementReport",
    "RankChecksums",
    "RanksDisagree",
    "RefusedBroadcast",
    "ResidencyChange",
    "ResidencyError",
    "ResidencyPlan",
    "StoreError",
    "SyncLifecycleController",
    "TensorHashCheck",
    "TransitionFailed",
    "TransitionRejected",
    "UnknownComponent",
    "UnsupportedCompute",
    "UpdateResult",
    "WeightSyncError",
    "WeightSyncGroupBroken",
    "WeightSyncGroupMissing",
    "WeightUpdateGroupResult",
    "WeightUpdateGroupState",
    "WeightUpdateWhileSleeping",
    "WeightsDiscarded",
    "configure_logging",
    "mermaid",
]
