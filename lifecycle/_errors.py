"""The error tree of the lifecycle.

::

    LifecycleError                      any refusal or failure of this library
    ├── TransitionRejected              refused before anything moved (trigger, phase, reason)
    │   ├── FSDPInferenceUnsupported    sleep/wake of an FSDP-managed pipeline (+RuntimeError)
    │   ├── WeightUpdateWhileSleeping   update requested while SLEEPING
    │   └── DrainTimeout                in-flight uses did not finish in time
    ├── TransitionFailed                the move failed and was rolled back (cause chained)
    ├── ComponentAsleep                 a forward or use() while SLEEPING (+RuntimeError)
    ├── ComponentNotPlaced              a forward outside use() on an offloaded component
    └── AdmissionTimeout                use() waited too long for a transition

Configuration mistakes are ``ValueError``/``TypeError`` (``ComponentResidencyError`` lives in
``strategies``); a lifecycle error always carries structured fields besides its message.
"""

from __future__ import annotations

from ._phase import FSDP_UNSUPPORTED, SERVER_SLEEPING, UPDATE_WHILE_SLEEPING, Phase

__all__ = [
    "AdmissionTimeout",
    "ComponentAsleep",
    "ComponentNotPlaced",
    "DrainTimeout",
    "FSDPInferenceUnsupported",
    "LifecycleError",
    "TransitionFailed",
    "TransitionRejected",
    "WeightUpdateWhileSleeping",
]


class LifecycleError(Exception):
    """Base of every error this library raises about the lifecycle."""


class TransitionRejected(LifecycleError):
    """A transition was refused before anything moved; the phase is unchanged."""

    def __init__(self, trigger: str, phase: Phase, reason: str) -> None:
        super().__init__(reason)
        self.trigger = trigger
        self.phase = phase
        self.reason = reason


class FSDPInferenceUnsupported(TransitionRejected, RuntimeError):
    """Sleep/wake of a pipeline whose placement FSDP owns."""

    def __init__(self, trigger: str, phase: Phase) -> None:
        super().__init__(trigger, phase, FSDP_UNSUPPORTED)


class WeightUpdateWhileSleeping(TransitionRejected):
    """A weight update was requested while the pipeline sleeps."""

    def __init__(self, trigger: str, phase: Phase) -> None:
        super().__init__(trigger, phase, UPDATE_WHILE_SLEEPING)


class DrainTimeout(TransitionRejected):
    """In-flight uses were still held when the drain timeout ran out."""

    def __init__(self, trigger: str, phase: Phase, held: list[str], timeout: float) -> None:
        super().__init__(trigger, phase,
                         f"{trigger}: {len(held)} use(s) still in flight after {timeout:g}s: "
                         f"{held}")
        self.held = held
        self.timeout = timeout


class TransitionFailed(LifecycleError):
    """The move failed part-way and was rolled back: placement and phase are as before."""

    def __init__(self, trigger: str, phase: Phase, cause: BaseException) -> None:
        super().__init__(f"{trigger} failed and was rolled back; phase is still "
                         f"{phase.value}: {type(cause).__name__}: {cause}")
        self.trigger = trigger
        self.phase = phase
        self.cause = cause


class ComponentAsleep(LifecycleError, RuntimeError):
    """A component was used (forward or ``use()``) while the pipeline sleeps."""

    def __init__(self, component: str) -> None:
        super().__init__(SERVER_SLEEPING)
        self.component = component


class ComponentNotPlaced(LifecycleError, RuntimeError):
    """A forward ran on an offloaded component outside ``ctl.use()``."""

    def __init__(self, component: str, mode: str) -> None:
        super().__init__(f"component {component!r} is {mode}: its weights are on the host "
                         f"between uses; run it inside `async with ctl.use({component!r})`")
        self.component = component
        self.mode = mode


class AdmissionTimeout(LifecycleError, TimeoutError):
    """``use()`` waited longer than ``admission_timeout`` for a transition to finish."""

    def __init__(self, component: str, timeout: float, transition: str | None) -> None:
        super().__init__(f"use({component!r}) waited {timeout:g}s for {transition or 'a transition'} "
                         "to finish")
        self.component = component
        self.timeout = timeout
        self.transition = transition
