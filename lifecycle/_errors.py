"""The error tree of the library (``strategies`` and ``lifecycle`` share its root).

::

    ResidencyError                      any refusal or failure of this library (strategies)
    ├── StoreError (+ValueError)        a module's tensors cannot be managed (strategies)
    ├── ComponentResidencyError         a configured mode does not fit how the module was
    │   (+ValueError)                   loaded (strategies)
    ├── UnsupportedCompute (+RuntimeError)  a forward under CUDA graph capture or on a
    │                                   non-default CUDA stream (strategies)
    ├── HostBudgetExceeded (+MemoryError)  a move would pass the host budget: refused
    │                                   before allocating, nothing changed (strategies)
    ├── CheckpointChanged (+OSError)    a file-backed component's checkpoint file changed or
    │                                   vanished while it slept: wake refused (strategies)
    └── LifecycleError                  any refusal or failure of the lifecycle
        ├── TransitionRejected          refused before anything moved (trigger, phase, reason)
        │   ├── FSDPInferenceUnsupported  sleep/wake of an FSDP-managed pipeline (+RuntimeError)
        │   ├── WeightUpdateWhileSleeping update requested while SLEEPING
        │   └── DrainTimeout            in-flight uses did not finish in time
        │   └── RanksDisagree           the ranks of a group are in different phases
        ├── TransitionFailed            the move failed and was rolled back (cause chained)
        │   └── GroupBroken             a rank of the group died or hung; rolled back here
        ├── ComponentAsleep             a forward or use() while SLEEPING (+RuntimeError)
        ├── ComponentNotPlaced          a forward outside use() on an offloaded component
        ├── ComponentBusy (+RuntimeError)  a forward outside use() of a layerwise component
        │                               while a transition moves or writes its weights
        ├── WeightsDiscarded (+RuntimeError)  a stale component (weights discarded by a
        │                               sleep, not updated since) asked to serve
        ├── AdmissionTimeout            use() waited too long for a transition
        ├── InvalidRequest (+ValueError)  a call's arguments are malformed, whatever the
        │                               pipeline holds (a LoRA scale, a tensor list, a port)
        ├── CheckpointMismatch (+ValueError)  attach(checkpoint=) names files that are not
        │                               the pipeline's weights
        ├── UnknownComponent (+KeyError)  a call named a component the pipeline lacks
        └── WeightSyncError             weight sync over a trainer's process group
            ├── WeightSyncGroupMissing  no group of that name: init it first
            └── WeightSyncGroupBroken   the group failed (a trainer died or stalled, a
                                        request it could not follow): destroy, init again

Configuration mistakes found while parsing (``ResidencyConfig``) are plain ``ValueError`` /
``TypeError``; a lifecycle error always carries structured fields besides its message.
:func:`failures_roll_back` is the one place where other errors become library errors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strategies import CheckpointChanged, HostBudgetExceeded, ResidencyError

# Defined once, in strategies (its moves forget locals too); re-exported for the modules of
# lifecycle that still import it from here.
from strategies.protocol import forget_locals

if TYPE_CHECKING:
    from ._owner import Owner
    from ._phase import Phase

# Messages of the reference system, kept recognisable.
ALREADY_SLEEPING = "already sleeping"
ALREADY_AWAKE = "already awake"
NOT_INITIALIZED = "pipeline not initialized"
FSDP_UNSUPPORTED = "sleep/wake does not support FSDP inference"
SERVER_SLEEPING = "Server is sleeping. Call resume_memory_occupation first."
UPDATE_WHILE_SLEEPING = ("Cannot update weights while the server is sleeping. "
                         "Call resume_memory_occupation first.")

__all__ = [
    "AdmissionTimeout",
    "CheckpointMismatch",
    "ComponentAsleep",
    "ComponentBusy",
    "ComponentNotPlaced",
    "DrainTimeout",
    "FSDPInferenceUnsupported",
    "GroupBroken",
    "HandOffExceedsBudget",
    "InvalidRequest",
    "LifecycleError",
    "RankFailure",
    "RanksDisagree",
    "TransitionFailed",
    "TransitionRejected",
    "UnknownComponent",
    "WeightSyncError",
    "WeightSyncGroupBroken",
    "WeightSyncGroupMissing",
    "WeightUpdateWhileSleeping",
    "WeightsDiscarded",
    "as_text",
    "failures_roll_back",
    "forget_locals",
]


class LifecycleError(ResidencyError):
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

    def __init__(self, trigger: str, phase: Phase, reason: str = FSDP_UNSUPPORTED) -> None:
        super().__init__(trigger, phase, reason)


class WeightUpdateWhileSleeping(TransitionRejected):
    """A weight update was requested while the pipeline sleeps."""

    def __init__(self, trigger: str, phase: Phase, reason: str = UPDATE_WHILE_SLEEPING) -> None:
        super().__init__(trigger, phase, reason)


@dataclass(frozen=True)
class RankFailure:
    """Why one rank voted against a collective transition (what the vote carries):
    ``cause``, the class name of its error (``"DrainTimeout"``), and ``message``, the error's
    text. Reads ``cause: message``."""

    cause: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> RankFailure:
        return cls(type(error).__name__, str(error))

    def __str__(self) -> str:
        return f"{self.cause}: {self.message}"


def as_text(failures: Mapping[int, RankFailure]) -> dict[int, str]:
    """``failures`` as text: rank -> ``"Cause: message"``."""
    return {r: str(f) for r, f in failures.items()}


class _FailedRanks:
    """An error of a transition over several ranks: ``failed_causes``, rank ->
    :class:`RankFailure` for every rank that failed (empty on a single rank), and
    ``failed_ranks``, the same as text (rank -> ``"Cause: message"``)."""

    failed_causes: Mapping[int, RankFailure]

    @property
    def failed_ranks(self) -> dict[int, str]:
        return as_text(self.failed_causes)


class DrainTimeout(TransitionRejected, _FailedRanks):
    """In-flight uses were still held when the drain timeout ran out (several ranks:
    ``failed_causes`` names every rank that timed out)."""

    def __init__(self, trigger: str, phase: Phase, held: list[str], timeout: float,
                 failed_causes: Mapping[int, RankFailure] | None = None) -> None:
        super().__init__(trigger, phase,
                         f"{trigger}: {len(held)} use(s) still in flight after {timeout:g}s: "
                         f"{held}")
        self.held = held
        self.timeout = timeout
        self.failed_causes = dict(failed_causes or {})


class TransitionFailed(LifecycleError, _FailedRanks):
    """The move failed part-way and was rolled back: placement and phase are as before.

    ``failed_causes`` (``failed_ranks`` as text): for a transition over several ranks, what
    failed on each rank that failed (every rank raises this same error, naming them); empty
    on a single rank."""

    def __init__(self, trigger: str, phase: Phase, cause: BaseException,
                 failed_causes: Mapping[int, RankFailure] | None = None) -> None:
        self.failed_causes = dict(failed_causes or {})
        ranks = self.failed_ranks
        where = f" (failed on rank(s) {ranks})" if ranks else ""
        super().__init__(f"{trigger} failed and was rolled back; phase is still "
                         f"{phase.value}: {type(cause).__name__}: {cause}{where}")
        self.trigger = trigger
        self.phase = phase
        self.cause = cause


class GroupBroken(TransitionFailed):
    """The process group of a multi-rank controller failed (a rank died or hung past the
    collective timeout): this rank rolled back; every later collective call raises this at
    once, until :meth:`LifecycleController.rebind` gives it a new group."""

    def __init__(self, trigger: str, phase: Phase, cause: BaseException, group: str,
                 missing: str = "unknown") -> None:
        super().__init__(trigger, phase, cause)
        self.group = group
        self.missing = missing


class RanksDisagree(TransitionRejected):
    """The ranks of a group are in different phases (driven apart from outside): nothing is
    guessed, nothing moves. ``phases``: rank -> phase."""

    def __init__(self, trigger: str, phase: Phase, phases: Mapping[int, str]) -> None:
        super().__init__(trigger, phase, f"ranks disagree about the phase: {dict(phases)}; "
                                         "bring them to one phase before a collective call")
        self.phases = dict(phases)


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


class ComponentBusy(LifecycleError, RuntimeError):
    """A forward outside ``ctl.use()`` of a component whose forwards move its weights
    (layerwise offload) while a transition or a weight update moves or writes them."""

    def __init__(self, component: str, transition: str) -> None:
        super().__init__(f"component {component!r} streams its layers from host stores that "
                         f"{transition} is moving or writing now: a forward outside use() "
                         f"would race with it; run it inside `async with ctl.use({component!r})`, "
                         "which waits for the transition")
        self.component = component
        self.transition = transition


class WeightsDiscarded(LifecycleError, RuntimeError):
    """A stale component (its weights discarded by a sleep, not all written since) was asked
    to serve: a forward, ``use()``, a request, a checksum."""

    def __init__(self, stale: Mapping[str, Sequence[str]]) -> None:
        parts = []
        for name, tensors in stale.items():
            few = ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "")
            parts.append(f"{name!r} ({len(tensors)} tensor(s): {few})")
        super().__init__(f"Modules {sorted(stale)} have discarded weights after resume: "
                         f"{'; '.join(parts)} not updated since. Update weights first.")
        self.components = {name: len(tensors) for name, tensors in stale.items()}


class AdmissionTimeout(LifecycleError, TimeoutError):
    """``use()`` waited longer than ``admission_timeout`` for a transition to finish."""

    def __init__(self, component: str, timeout: float, transition: str | None) -> None:
        super().__init__(f"use({component!r}) waited {timeout:g}s for {transition or 'a transition'} "
                         "to finish")
        self.component = component
        self.timeout = timeout
        self.transition = transition



class InvalidRequest(LifecycleError, ValueError):
    """A call's arguments are malformed whatever the pipeline holds (an unknown update mode,
    a LoRA rank of 0, tensor lists of different lengths, a port out of range): refused
    before anything was looked at or changed. ``field``: the argument at fault."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


class HandOffExceedsBudget(LifecycleError):
    """``set_residency(plan)``: applying the plan from the layout held now would raise the
    device past the plan's budget (and past what is held now) while old and new placements
    are held together (the transient peak of the hand-off); refused before anything moved.
    ``transient_peak_bytes``, ``budget_bytes``, ``components``, ``held_bytes``: the
    predicted peak, the budget, what would move, the device bytes held before it."""

    def __init__(self, transient_peak_bytes: int, budget_bytes: int,
                 components: Sequence[str], held_bytes: int) -> None:
        super().__init__(
            f"applying this residency plan would hold {transient_peak_bytes} device bytes at "
            f"its transient peak (old and new placements of {sorted(components)} held "
            f"together, from {held_bytes} held now), over the plan's device budget of "
            f"{budget_bytes} bytes; nothing changed: plan for a budget that leaves room for "
            "the hand-off, or apply it in smaller steps (offload first, then load)")
        self.transient_peak_bytes = transient_peak_bytes
        self.held_bytes = held_bytes
        self.budget_bytes = budget_bytes
        self.components = tuple(sorted(components))


class CheckpointMismatch(LifecycleError, ValueError):
    """``attach(checkpoint=...)``: the checkpoint is not the pipeline's weights (a tensor's
    bytes, dtype or shape differ, or it cannot be read): refused before anything moved.
    ``component``, ``tensor``, ``path``: what differs, where."""

    def __init__(self, path: str, reason: str, component: str = "", tensor: str = "") -> None:
        super().__init__(f"checkpoint {path}: {reason}; attach without checkpoint=, or give "
                         "the files the weights were loaded from")
        self.path, self.reason, self.component, self.tensor = path, reason, component, tensor


class UnknownComponent(LifecycleError, KeyError):
    """A call named a component the attached pipeline does not have."""

    def __init__(self, component: str, known: list[str]) -> None:
        message = (f"Module(s) requested not found in pipeline: [{component!r}]. "
                   f"Available Module(s): {sorted(known)}")
        super().__init__(message)
        self.component = component
        self.known = sorted(known)
        self.message = message

    def __str__(self) -> str:  # KeyError would show the message quoted
        return self.message


class WeightSyncError(LifecycleError):
    """Weight sync over a trainer's process group failed or was refused (``group_name``)."""

    def __init__(self, group_name: str, message: str) -> None:
        super().__init__(message)
        self.group_name = group_name


class WeightSyncGroupMissing(WeightSyncError):
    """No weight update group of that name on this rank: ``init_weights_update_group`` it
    first (or it was destroyed)."""

    def __init__(self, group_name: str, known: list[str]) -> None:
        super().__init__(group_name, f"weight update group {group_name!r} is not initialized; "
                                     f"call init_weights_update_group first (groups: "
                                     f"{sorted(known)})")


class WeightSyncGroupBroken(WeightSyncError):
    """The weight update group failed earlier (``reason``: the trainer died or stalled
    mid-broadcast, or a request could not be followed) and is out of step with the trainer:
    destroy it and init it again."""

    def __init__(self, group_name: str, reason: str) -> None:
        super().__init__(group_name, f"weight update group {group_name!r} is broken ({reason}); "
                                     "destroy it and init it again")
        self.reason = reason

@contextmanager
def failures_roll_back(trigger: str, owner: Owner) -> Iterator[None]:
    """The one error boundary of a move: an ``Exception`` raised inside (a failed copy or
    allocation, after the caller rolled back) leaves as :class:`TransitionFailed` chaining
    it; the library's own errors and cancellation pass unchanged (a host budget's refusal
    too: it names the numbers). The ``owner``'s phase is read when the error passes (it is
    the phase the pipeline is still in)."""
    try:
        yield
    except (LifecycleError, HostBudgetExceeded, CheckpointChanged):
        raise
    except Exception as exc:
        raise TransitionFailed(trigger, owner.phase, exc) from exc
