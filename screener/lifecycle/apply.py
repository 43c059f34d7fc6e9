"""apply_event: one lifecycle decision for one node, read and recorded atomically through a store.

The glue between the pure state machine (machine.py) and whatever persists it (a Store, see
ports.py): read the node and the budget's counts, decide, check every transition against the
table (table.py), record, and decide again when another writer got there first.

The one gateway: every transition the daemon, burn-in and every command record goes through
apply_event (release_held is apply_event with the BudgetLook input), and only machine.py builds a
Transition (tests/test_transition_gateway.py holds both). Nothing here keeps state between calls:
a caller that wants its looks for a free slot spaced out holds a SlotLooks.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from screener.lifecycle import machine
from screener.lifecycle.ports import NodeTxn, Store
from screener.lifecycle.records import BudgetConflict, StaleTransition, Transition
from screener.lifecycle.table import allows, trigger_of
from screener.types import NodeState

__all__ = ["SlotLooks", "apply_event", "reconsider_held", "release_held"]


def apply_event(store: Store, node: str, event: Any, *, now: float, policy: Any = None,
                attempts: int = 30, sleep: Callable[[float], None] = time.sleep,
                rng: Callable[[], float] = random.random) -> Any:
    """Read what the lifecycle needs from `store`, decide, and record the transitions, atomically
    with the fleet's quarantine budget.

    The glue between the pure lifecycle and a store, for the daemon, burn-in and the CLI. Returns
    the screener.lifecycle.machine.Decision. One `store.begin(node)` holds the read-decide-write: on SQLite
    one BEGIN IMMEDIATE transaction; on Kubernetes the budget is one small object written with its
    resourceVersion as precondition. When another writer changed the node (StaleTransition) or the
    budget (BudgetConflict) in between, it reads and decides again, up to `attempts` times, with a
    short random pause so that racing daemons spread out. Raises TransitionRefused for a person's
    command (or replacement) the table refuses; every transition it records is one the table
    lists for its actor.

    Per event the work is O(1) in the fleet size: the node's own state and history, the budget's
    counts, and, only when a failure blames GPU serials, the failures that name those serials.
    """
    policy = policy or machine.DEFAULT_POLICY
    for attempt in range(attempts):
        try:
            with store.begin(node) as txn:
                decision = _decide(txn, node, event, now, policy)
                txn.commit(_checked(decision.transitions))
            return decision
        except (StaleTransition, BudgetConflict):
            if attempt == attempts - 1:
                raise
            sleep(min(0.2, 0.005 * 2 ** min(attempt, 6)) * (0.5 + rng()))
    raise AssertionError("unreachable")


def _checked(transitions: tuple[Transition, ...]) -> tuple[Transition, ...]:
    """The transitions, each one the table lists for its actor: the table's promise holds for
    whatever the machine decided, not only where it asked (a failed check is a bug, as in
    machine.py, and nothing of the decision is recorded)."""
    for t in transitions:
        if not allows(t.from_state, t.to_state, trigger_of(t.actor)):
            raise AssertionError(f"node {t.node}: {t.from_state} -> {t.to_state.value} by "
                                 f"{t.actor} is not in the transition table")
    return transitions


def _decide(txn: NodeTxn, node: str, event: Any, now: float, policy: Any) -> Any:
    fleet = machine.FleetCounts(total=max(1, txn.fleet_total), out_of_service=txn.out_of_service)
    decision = machine.decide(node, txn.state, event, now=now, history=txn.history, fleet=fleet,
                                policy=policy)
    # The per-GPU lemon rule needs other nodes' failures, but only those naming the serials this
    # failure blames: fetch exactly those (an indexed lookup) and decide again with them.
    serials = sorted({s for t in decision.transitions if t.failure for s in t.gpu_serials})
    if serials:
        failures = txn.failures_for(serials, now - policy.window_seconds)
        if failures:
            decision = machine.decide(node, txn.state, event, now=now, history=txn.history,
                                        failures=failures, fleet=fleet, policy=policy)
    return decision


@dataclass
class SlotLooks:
    """When a caller last looked for a free budget slot per node, to look at most every
    `min_interval_s` seconds of `now` (one read of the node and of the budget record per look).

    Held by the caller (a tool, a test), so the lifecycle keeps no state between calls. The daemon
    holds none: it spaces its looks on the monotonic clock (screener.agent.daemon.feed), which a
    stepped wall clock cannot defeat.
    """

    min_interval_s: float = 30.0
    last: dict[str, float] = field(default_factory=dict)

    def due(self, node: str, now: float) -> bool:
        """Whether `node` may be looked at now; if so, the look is noted."""
        last = self.last.get(node)
        if last is not None and 0 <= now - last < self.min_interval_s:
            return False
        self.last[node] = now
        return True


def reconsider_held(store: Store, node: str, state: Optional[NodeState] = None, *, now: float,
                    policy: Any = None, looks: Optional[SlotLooks] = None) -> Optional[NodeState]:
    """Give a node the quarantine-budget slot it was denied, once one is free; returns its state.

    release_held, for a caller that only needs the state (see there).
    """
    return release_held(store, node, state, now=now, policy=policy, looks=looks)[0]


def release_held(store: Store, node: str, state: Optional[NodeState] = None, *, now: float,
                 policy: Any = None, looks: Optional[SlotLooks] = None
                 ) -> tuple[Optional[NodeState], Optional[Transition]]:
    """Give a node the quarantine-budget slot it was denied, once one is free.

    Returns the node's state and the transition recorded when it took a slot (else None), so the
    caller treats it as any other move into quarantine or repair: its metrics, its log line, and
    the deep health check that a quarantine starts.

    The daemon calls this on every tick with its cached `state`. A node whose confirmed failure
    found the budget used up was held in suspect (tainted, no new work) with the state it wanted in
    the evidence. When a slot frees (a node leaves quarantine or repair), the held node takes it:
    apply_event with machine.BudgetLook, the same atomic claim as any quarantine, so racing held
    nodes cannot overrun the budget. Costs nothing unless the node is suspect, and then one read
    of the node and of the budget record per look; with `looks`, at most one look every
    `looks.min_interval_s` seconds per node. Lost races are retried 10 times at once (a held node
    looks again at its next tick), then it stays held.
    """
    if state is not None and state != NodeState.SUSPECT:
        return state, None
    if looks is not None and not looks.due(node, now):
        return state, None
    try:
        decision = apply_event(store, node, machine.BudgetLook(), now=now, policy=policy,
                               attempts=10, sleep=_no_pause)
    except (StaleTransition, BudgetConflict):
        return state, None
    return decision.state, decision.transition


def _no_pause(seconds: float) -> None:
    """release_held retries a lost race at once: its next look is the caller's next tick."""
