"""The lifecycle's transition table: which moves exist, who may make them, what each entry asks for.

Every decision of screener.lifecycle.machine, and every person's command, is checked against it:
the machine asks `refusal` before it makes a move, and the one way a transition is recorded
(screener.lifecycle.apply.apply_event) asks `allows` again of every transition it commits, so a
transition the table does not list is never recorded, whichever input it came from.

A row from a state to itself is a step recorded on a node that stays where it is (a held failure,
a repair step, a replacement of a node already in repair). `refusal` speaks of changes of state: a
person's command to the state the node is in is refused ("already"); `allows` reads the rows as
they are.
"""

from __future__ import annotations

import enum
from typing import Mapping, Optional

from screener.lifecycle.records import ACTOR_HUMAN
from screener.types import NodeState


class Action(str, enum.Enum):
    """What the caller (the daemon, burn-in, the CLI) should do after a decision."""

    REQUEST_CONFIRMING_SCREEN = "request_confirming_screen"  # re-run known-answer jobs soon
    ALERT_BUDGET_EXHAUSTED = "alert_budget_exhausted"  # tell a person: the breaker tripped
    DEEP_HEALTH_CHECK = "deep_health_check"  # diagnostics, row-remap check, GPU reset
    START_BURNIN = "start_burnin"  # run the burn-in sequence
    REQUEST_REPAIR = "request_repair"  # out of service; ticket / replacement for a person


class Trigger(str, enum.Enum):
    """Who may make a move in the transition table."""

    AUTO = "auto"
    HUMAN = "human"


A, H = Trigger.AUTO, Trigger.HUMAN

# The transition table: (from, to) -> who may make the move. Anything not listed is refused.
TRANSITIONS: Mapping[tuple[Optional[NodeState], NodeState], frozenset[Trigger]] = {
    (None, NodeState.BURNIN): frozenset({A, H}),
    (None, NodeState.SUSPECT): frozenset({H}),
    (None, NodeState.QUARANTINED): frozenset({H}),
    (None, NodeState.REPAIR): frozenset({H}),
    (None, NodeState.HEALTHY): frozenset({A}),  # adoption of a node already serving (Adopted)
    (NodeState.BURNIN, NodeState.HEALTHY): frozenset({A}),
    (NodeState.BURNIN, NodeState.SUSPECT): frozenset({A, H}),
    (NodeState.BURNIN, NodeState.QUARANTINED): frozenset({A, H}),
    (NodeState.BURNIN, NodeState.REPAIR): frozenset({A, H}),
    (NodeState.HEALTHY, NodeState.SUSPECT): frozenset({A, H}),
    (NodeState.HEALTHY, NodeState.QUARANTINED): frozenset({A, H}),
    (NodeState.HEALTHY, NodeState.REPAIR): frozenset({A, H}),
    (NodeState.HEALTHY, NodeState.BURNIN): frozenset({H}),
    (NodeState.SUSPECT, NodeState.HEALTHY): frozenset({A}),
    (NodeState.SUSPECT, NodeState.QUARANTINED): frozenset({A, H}),
    (NodeState.SUSPECT, NodeState.REPAIR): frozenset({A, H}),
    (NodeState.SUSPECT, NodeState.BURNIN): frozenset({H}),
    # A suspect node's confirmed failure that the budget holds is recorded (it counts, and marks
    # the node held: no pass clears it, and reconsider_held gives it the next free slot).
    (NodeState.SUSPECT, NodeState.SUSPECT): frozenset({A}),
    (NodeState.QUARANTINED, NodeState.BURNIN): frozenset({A, H}),
    (NodeState.QUARANTINED, NodeState.REPAIR): frozenset({A, H}),
    # A repair step that keeps the node out (the repair ladder's reboot request and its end).
    (NodeState.QUARANTINED, NodeState.QUARANTINED): frozenset({A}),
    (NodeState.REPAIR, NodeState.BURNIN): frozenset({H}),
    # A person's replacement of a node already in repair (`hyperpod replace`) is on file too.
    (NodeState.REPAIR, NodeState.REPAIR): frozenset({H}),
}

_ENTRY_ACTIONS: Mapping[NodeState, tuple[Action, ...]] = {
    NodeState.BURNIN: (Action.START_BURNIN,),
    NodeState.HEALTHY: (),
    NodeState.SUSPECT: (Action.REQUEST_CONFIRMING_SCREEN,),
    NodeState.QUARANTINED: (Action.DEEP_HEALTH_CHECK,),
    NodeState.REPAIR: (Action.REQUEST_REPAIR,),
}


def refusal(from_state: Optional[NodeState], to_state: NodeState, trigger: Trigger) -> Optional[str]:
    """Why the table refuses this move for this trigger, or None when it is allowed."""
    name = from_state.value if from_state else "(new node)"
    if from_state == to_state:
        return f"the node is already {to_state.value}"
    allowed = TRANSITIONS.get((from_state, to_state))
    if allowed and trigger in allowed:
        return None
    if to_state == NodeState.HEALTHY:
        return ("only a passing known-answer screen makes a node healthy; set it to burnin to "
                "screen it")
    if from_state == NodeState.REPAIR:
        return "a node in repair goes back into service only through burnin"
    if allowed:
        return f"{name} -> {to_state.value} is made only by the screener, not by a person"
    return f"{name} -> {to_state.value} is not a move the lifecycle allows"



def trigger_of(actor: str) -> Trigger:
    """Who made a recorded transition, as the table names them (a person, or the screener)."""
    return H if actor == ACTOR_HUMAN else A


def allows(from_state: Optional[NodeState], to_state: NodeState, trigger: Trigger) -> bool:
    """Whether the table lists this move (a self-move included) for this trigger."""
    return trigger in TRANSITIONS.get((from_state, to_state), frozenset())
