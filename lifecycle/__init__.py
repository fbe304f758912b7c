"""The lifecycle of a model pipeline's weights: attach, sleep, wake, update, detach."""

from ._controller import LifecycleController
from ._errors import (
    AdmissionTimeout,
    ComponentAsleep,
    ComponentNotPlaced,
    DrainTimeout,
    FSDPInferenceUnsupported,
    LifecycleError,
    TransitionFailed,
    TransitionRejected,
    WeightUpdateWhileSleeping,
)
from ._events import configure_logging
from ._phase import Phase, mermaid
from ._results import ComponentPlacement, OccupationResult, PlacementReport, UpdateResult

__all__ = [
    "AdmissionTimeout",
    "ComponentAsleep",
    "ComponentNotPlaced",
    "ComponentPlacement",
    "DrainTimeout",
    "FSDPInferenceUnsupported",
    "LifecycleController",
    "LifecycleError",
    "OccupationResult",
    "Phase",
    "PlacementReport",
    "TransitionFailed",
    "TransitionRejected",
    "UpdateResult",
    "WeightUpdateWhileSleeping",
    "configure_logging",
    "mermaid",
]
