"""Phases, the transition table and the refusal table: data, defined once.

Code (the controller), the diagram (``residency diagram``) and the docs are generated from
these tables. :func:`refusal` answers a (trigger, phase) pair from them, a pure look-up;
:class:`PhaseMachine` (a ``transitions.Machine``) is the commit point: the controller fires
a trigger only after the work it stands for is done.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from transitions import Machine

from ._errors import (
    ALREADY_AWAKE,
    ALREADY_SLEEPING,
    FSDP_UNSUPPORTED,
    NOT_INITIALIZED,
    UPDATE_WHILE_SLEEPING,
    FSDPInferenceUnsupported,
    TransitionRejected,
    WeightUpdateWhileSleeping,
)

__all__ = [
    "REFUSALS",
    "TRANSITIONS",
    "Phase",
    "PhaseMachine",
    "Refusal",
    "Rule",
    "Transition",
    "mermaid",
    "refusal",
]


class Phase(enum.Enum):
    """Where the pipeline is in its lifecycle."""

    UNINITIALIZED = "uninitialized"
    AWAKE = "awake"
    SLEEPING = "sleeping"
    UPDATING_WEIGHTS = "updating_weights"


@dataclass(frozen=True)
class Transition:
    trigger: str
    source: Phase
    dest: Phase


U, A, S, W = Phase.UNINITIALIZED, Phase.AWAKE, Phase.SLEEPING, Phase.UPDATING_WEIGHTS

TRANSITIONS: tuple[Transition, ...] = (
    Transition("attach", U, A),
    Transition("sleep", A, S),
    Transition("wake", S, A),
    # Partial sleep and wake (``sleep(components=...)``): the phase is sleeping only while
    # every component is asleep; a sleep of some (others stay awake) and a wake of some
    # asleep ones while others are awake keep it awake. A wake of some from sleeping is
    # ``wake`` (one component awake: awake).
    Transition("sleep_some", A, A),
    Transition("wake_some", A, A),
    Transition("begin_update", A, W),
    Transition("end_update", W, A),
    Transition("detach", A, U),
    Transition("detach", S, U),
)


class Refusal(enum.Enum):
    """How a (trigger, phase) pair that is not a transition is answered."""

    NOOP = "success, nothing done"
    FAIL = "failure result, no exception"
    REJECT = "TransitionRejected raised"


@dataclass(frozen=True)
class Rule:
    """The answer to one refused (trigger, phase) pair: how, the reason, and for
    :attr:`Refusal.REJECT` the error raised (built as ``error(trigger, phase, message)``)."""

    kind: Refusal
    message: str
    error: type[TransitionRejected] | None = None


_ATTACHED = "a pipeline is already attached; detach() it first"

# Pairs in neither table are rejected with a generic reason naming the trigger and phase.
# FSDP refusals come from :func:`refusal` (they depend on the pipeline, not the phase).
REFUSALS: dict[tuple[str, Phase], Rule] = {
    ("sleep", S): Rule(Refusal.NOOP, ALREADY_SLEEPING),
    ("sleep", U): Rule(Refusal.FAIL, NOT_INITIALIZED),
    ("wake", A): Rule(Refusal.NOOP, ALREADY_AWAKE),
    ("wake", U): Rule(Refusal.FAIL, NOT_INITIALIZED),
    ("begin_update", U): Rule(Refusal.FAIL, NOT_INITIALIZED),
    ("begin_update", S): Rule(Refusal.REJECT, UPDATE_WHILE_SLEEPING, WeightUpdateWhileSleeping),
    ("attach", A): Rule(Refusal.REJECT, _ATTACHED, TransitionRejected),
    ("attach", S): Rule(Refusal.REJECT, _ATTACHED, TransitionRejected),
    ("detach", U): Rule(Refusal.NOOP, "no pipeline attached"),
}

_VALID = frozenset((t.trigger, t.source) for t in TRANSITIONS)
_FSDP = Rule(Refusal.REJECT, FSDP_UNSUPPORTED, FSDPInferenceUnsupported)


def refusal(trigger: str, phase: Phase, *, fsdp: bool = False) -> Rule | None:
    """How ``trigger`` in ``phase`` is refused, or None when it is a transition to run.

    Noop first, then FSDP (sleep/wake of a pipeline FSDP places: ``fsdp``), then failure or
    rejection: the reference's order."""
    rule = REFUSALS.get((trigger, phase))
    if rule is not None and rule.kind is Refusal.NOOP:
        return rule
    if fsdp and trigger in ("sleep", "wake", "sleep_some", "wake_some"):
        return _FSDP
    if rule is None and (trigger, phase) not in _VALID:
        return Rule(Refusal.REJECT, f"{trigger} is not valid in phase {phase.value}",
                    TransitionRejected)
    return rule


class _Model:
    """The ``transitions`` model: holds ``state`` and nothing else."""

    state: Phase


class PhaseMachine:
    """The phase, changed only by firing a trigger of :data:`TRANSITIONS` on a
    ``transitions.Machine`` (which refuses any other)."""

    def __init__(self) -> None:
        self._model = _Model()
        self._machine = Machine(
            model=self._model, states=Phase, initial=U,
            transitions=[{"trigger": t.trigger, "source": t.source, "dest": t.dest}
                         for t in TRANSITIONS],
            auto_transitions=False)

    @property
    def phase(self) -> Phase:
        return self._model.state

    def fire(self, trigger: str) -> None:
        """Commit ``trigger``: called only after the work it stands for is done."""
        self._model.trigger(trigger)  # type: ignore[attr-defined]


def mermaid() -> str:
    """The state machine as a Mermaid ``stateDiagram-v2``, from :data:`TRANSITIONS`."""
    lines = ["stateDiagram-v2", f"    [*] --> {U.value}"]
    lines += [f"    {t.source.value} --> {t.dest.value}: {t.trigger}" for t in TRANSITIONS]
    for (trigger, phase), rule in REFUSALS.items():
        if rule.kind is Refusal.NOOP:
            lines.append(f"    {phase.value} --> {phase.value}: {trigger} ({rule.message})")
    return "\n".join(lines) + "\n"
