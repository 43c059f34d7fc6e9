"""apply_event: one lifecycle decision for one node, read and recorded atomically through a store.

The glue between the pure state machine (machine.py) and whatever persists it (a Store, see
ports.py): read the node and the budget's counts, decide, record, and decide again when another
writer got there first.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Optional

from screener.lifecycle import machine
from screener.lifecycle.ports import NodeTxn, Store
from screener.lifecycle.records import (ACTOR_SCREENER, BUDGET_STATES, BudgetConflict, StaleTransition,
                                        Transition)
from screener.types import NodeState, Reason

__all__ = ["apply_event", "reconsider_held", "release_held"]


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
    command the table refuses.

    Per event the work is O(1) in the fleet size: the node's own state and history, the budget's
    counts, and, only when a failure blames GPU serials, the failures that name those serials.
    """
    policy = policy or machine.DEFAULT_POLICY
    for attempt in range(attempts):
        try:
            with store.begin(node) as txn:
                decision = _decide(txn, node, event, now, policy)
                txn.commit(decision.transitions)
            return decision
        except (StaleTransition, BudgetConflict):
            if attempt == attempts - 1:
                raise
            sleep(min(0.2, 0.005 * 2 ** min(attempt, 6)) * (0.5 + rng()))
    raise AssertionError("unreachable")


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


def reconsider_held(store: Store, node: str, state: Optional[NodeState] = None, *, now: float,
                    policy: Any = None, min_interval_s: float = 30.0) -> Optional[NodeState]:
    """Give a node the quarantine-budget slot it was denied, once one is free; returns its state.

    release_held, for a caller that only needs the state (see there).
    """
    return release_held(store, node, state, now=now, policy=policy,
                        min_interval_s=min_interval_s)[0]


def release_held(store: Store, node: str, state: Optional[NodeState] = None, *, now: float,
                 policy: Any = None, min_interval_s: float = 30.0
                 ) -> tuple[Optional[NodeState], Optional[Transition]]:
    """Give a node the quarantine-budget slot it was denied, once one is free.

    Returns the node's state and the transition recorded when it took a slot (else None), so the
    caller treats it as any other move into quarantine or repair: its metrics, its log line, and
    the deep health check that a quarantine starts.

    The daemon calls this on every tick with its cached `state`. A node whose confirmed failure
    found the budget used up was held in suspect (tainted, no new work) with the state it wanted in
    the evidence. When a slot frees (a node leaves quarantine or repair), the held node takes it:
    the same atomic claim as any quarantine, so racing held nodes cannot overrun the budget. Costs
    nothing unless the node is suspect, and then at most one look every `min_interval_s` seconds
    per node (one read of the node and of the budget record).
    """
    if state is not None and state != NodeState.SUSPECT:
        return state, None
    last_look = _LAST_LOOK.get((id(store), node))
    if last_look is not None and 0 <= now - last_look < min_interval_s:
        return state, None
    _LAST_LOOK[(id(store), node)] = now
    policy = policy or machine.DEFAULT_POLICY
    for attempt in range(10):
        try:
            with store.begin(node) as txn:
                held = txn.history[-1] if txn.history else None
                if (txn.state != NodeState.SUSPECT or held is None
                        or held.to_state != NodeState.SUSPECT
                        or not held.evidence.get(machine.EVIDENCE_HELD_BY_BUDGET)):
                    return txn.state, None
                try:
                    wanted = NodeState(held.evidence.get("wanted") or NodeState.QUARANTINED.value)
                except ValueError:
                    wanted = NodeState.QUARANTINED
                limit = policy.budget_limit(max(1, txn.fleet_total))
                if wanted not in BUDGET_STATES or txn.out_of_service + 1 > limit:
                    return txn.state, None
                actions = ((machine.Action.DEEP_HEALTH_CHECK.value,) if wanted == NodeState.QUARANTINED
                           else (machine.Action.REQUEST_REPAIR.value,))
                t = Transition(
                    node=node, time=now, from_state=NodeState.SUSPECT, to_state=wanted,
                    reason=f"a quarantine budget slot is free ({txn.out_of_service + 1} of {limit}); "
                           f"held since {held.time:.0f}: {held.reason}"[:1024],
                    actor=ACTOR_SCREENER, code=Reason.BUDGET,
                    evidence={"released_by_budget": {"held_transition": held.id,
                                                     "limit": limit, "fleet": txn.fleet_total,
                                                     "out_of_service": txn.out_of_service}},
                    failure=False,  # the failure was counted when the node was held
                    gpu_serials=held.gpu_serials, rollback=held.rollback, actions=actions)
                txn.commit([t])
                return wanted, t
        except (StaleTransition, BudgetConflict):
            continue
    return state, None


# (store id, node) -> when release_held last looked; a daemon has one store and one node.
_LAST_LOOK: dict[tuple[int, str], float] = {}
