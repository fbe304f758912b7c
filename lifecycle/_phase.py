"""Phases, the transition table and the refusal table: data, defined once.

Code (the controller), the diagram (``residency diagram``) and the docs are generated from
these tables. ``transitions.Machine`` is the commit point: the controller calls a trigger
only after the work it stands for is done.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "ALREADY_AWAKE",
    "ALREADY_SLEEPING",
    "FSDP_UNSUPPORTED",
    "NOT_INITIALIZED",
    "REFUSALS",
    "SERVER_SLEEPING",
    "TRANSITIONS",
    "UPDATE_WHILE_SLEEPING",
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
    doc: str


U, A, S, W = Phase.UNINITIALIZED, Phase.AWAKE, Phase.SLEEPING, Phase.UPDATING_WEIGHTS

TRANSITIONS: tuple[Transition, ...] = (
    Transition("attach", U, A, "components moved to the device, strategies built"),
    Transition("sleep", A, S, "device memory released; weights kept in host mirrors"),
    Transition("wake", S, A, "weights restored to their awake placement"),
    Transition("begin_update", A, W, "admission closed, in-flight uses drained"),
    Transition("end_update", W, A, "new weights committed (or the old ones restored)"),
    Transition("detach", A, U, "weights left on the host, hooks removed"),
    Transition("detach", S, U, "weights left on the host, hooks removed"),
)

# Messages of the reference system, kept recognisable.
ALREADY_SLEEPING = "already sleeping"
ALREADY_AWAKE = "already awake"
NOT_INITIALIZED = "pipeline not initialized"
FSDP_UNSUPPORTED = "sleep/wake does not support FSDP inference"
SERVER_SLEEPING = "Server is sleeping. Call resume_memory_occupation first."
UPDATE_WHILE_SLEEPING = ("Cannot update weights while the server is sleeping. "
                         "Call resume_memory_occupation first.")


class Refusal(enum.Enum):
    """How a (trigger, phase) pair that is not a transition is answered."""

    NOOP = "success, nothing done"
    FAIL = "failure result, no exception"
    REJECT = "TransitionRejected raised"


# (trigger, phase) -> (how, message). Pairs in neither table are rejected with a generic
# reason naming the valid phases. FSDP checks come from the controller (they depend on the
# pipeline, not the phase).
REFUSALS: dict[tuple[str, Phase], tuple[Refusal, str]] = {
    ("sleep", S): (Refusal.NOOP, ALREADY_SLEEPING),
    ("sleep", U): (Refusal.FAIL, NOT_INITIALIZED),
    ("wake", A): (Refusal.NOOP, ALREADY_AWAKE),
    ("wake", U): (Refusal.FAIL, NOT_INITIALIZED),
    ("begin_update", U): (Refusal.FAIL, NOT_INITIALIZED),
    ("begin_update", S): (Refusal.REJECT, UPDATE_WHILE_SLEEPING),
    ("attach", A): (Refusal.REJECT, "a pipeline is already attached; detach() it first"),
    ("attach", S): (Refusal.REJECT, "a pipeline is already attached; detach() it first"),
    ("detach", U): (Refusal.NOOP, "no pipeline attached"),
}


def mermaid() -> str:
    """The state machine as a Mermaid ``stateDiagram-v2``, from :data:`TRANSITIONS`."""
    lines = ["stateDiagram-v2", f"    [*] --> {U.value}"]
    lines += [f"    {t.source.value} --> {t.dest.value}: {t.trigger}" for t in TRANSITIONS]
    for (trigger, phase), (how, message) in REFUSALS.items():
        if how is Refusal.NOOP:
            lines.append(f"    {phase.value} --> {phase.value}: {trigger} ({message})")
    return "\n".join(lines) + "\n"
