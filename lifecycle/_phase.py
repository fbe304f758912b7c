"""Phases, the transition table and the refusal table: data, defined once.

Code (the controller), the diagram (``residency diagram``) and the docs are generated from
these tables. ``transitions.Machine`` is the commit point: the controller calls a trigger
only after the work it stands for is done.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._errors import (
    ALREADY_AWAKE,
    ALREADY_SLEEPING,
    NOT_INITIALIZED,
    UPDATE_WHILE_SLEEPING,
    TransitionRejected,
    WeightUpdateWhileSleeping,
)

__all__ = [
    "REFUSALS",
    "TRANSITIONS",
    "Phase",
    "Refusal",
    "Transition",
    "mermaid",
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


# (trigger, phase) -> (how, message, error raised for REJECT). Pairs in neither table are
# rejected with a generic reason naming the valid phases. FSDP checks come from the
# controller (they depend on the pipeline, not the phase).
REFUSALS: dict[tuple[str, Phase], tuple[Refusal, str, type[TransitionRejected] | None]] = {
    ("sleep", S): (Refusal.NOOP, ALREADY_SLEEPING, None),
    ("sleep", U): (Refusal.FAIL, NOT_INITIALIZED, None),
    ("wake", A): (Refusal.NOOP, ALREADY_AWAKE, None),
    ("wake", U): (Refusal.FAIL, NOT_INITIALIZED, None),
    ("begin_update", U): (Refusal.FAIL, NOT_INITIALIZED, None),
    ("begin_update", S): (Refusal.REJECT, UPDATE_WHILE_SLEEPING, WeightUpdateWhileSleeping),
    ("attach", A): (Refusal.REJECT, "a pipeline is already attached; detach() it first",
                    TransitionRejected),
    ("attach", S): (Refusal.REJECT, "a pipeline is already attached; detach() it first",
                    TransitionRejected),
    ("detach", U): (Refusal.NOOP, "no pipeline attached", None),
}


def mermaid() -> str:
    """The state machine as a Mermaid ``stateDiagram-v2``, from :data:`TRANSITIONS`."""
    lines = ["stateDiagram-v2", f"    [*] --> {U.value}"]
    lines += [f"    {t.source.value} --> {t.dest.value}: {t.trigger}" for t in TRANSITIONS]
    for (trigger, phase), (how, message, _) in REFUSALS.items():
        if how is Refusal.NOOP:
            lines.append(f"    {phase.value} --> {phase.value}: {trigger} ({message})")
    return "\n".join(lines) + "\n"
