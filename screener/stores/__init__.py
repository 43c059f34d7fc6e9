"""Stores for node states and their history: `local` (SQLite, the default) and `kube` (Node objects).

`open_store(kind, ...)` is the one way the CLI and the daemon get a store, so that `kubernetes` is
imported only when a cluster store is asked for.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Optional

from screener.errors import ConfigError
from screener.stores.base import (ACTOR_HUMAN, ACTOR_SCREENER, BUDGET_STATES, BudgetConflict,
                                  DiskFullError, NodeTxn, StaleTransition, Store, Transition,
                                  lemon_counts)
from screener.types import NodeState

__all__ = ["ACTOR_HUMAN", "ACTOR_SCREENER", "BudgetConflict", "DiskFullError", "NodeTxn",
           "StaleTransition", "Store", "Transition", "lemon_counts", "open_store", "apply_event",
           "reconsider_held", "default_state_dir", "STORE_KINDS"]

STORE_KINDS = ("local", "kube")


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/screener, or ~/.local/state/screener when XDG_STATE_HOME is unset/empty."""
    base = os.environ.get("XDG_STATE_HOME") or ""
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "screener"


def open_store(kind: str = "local", *, db: Optional[os.PathLike[str] | str] = None,
               kubeconfig: Optional[str] = None, spool: Optional[os.PathLike[str] | str] = None,
               **kwargs: Any) -> Store:
    """Open a store by kind.

    local: SQLite at `db` (default: default_state_dir()/screener.db).
    kube: the cluster's Node objects, via `kubeconfig`, or in-cluster configuration when running in
      a pod, or ~/.kube/config; transitions that cannot be written yet go to the spool at `spool`
      (default: default_state_dir()/spool.db). Extra keyword arguments go to KubeStore.
    """
    if kind == "local":
        from screener.stores.local import LocalStore

        if kwargs:
            raise ConfigError(f"local store: unknown options {sorted(kwargs)}")
        return LocalStore(db if db is not None else default_state_dir() / "screener.db")
    if kind == "kube":
        from screener.stores.kube import KubeStore

        return KubeStore.from_config(kubeconfig=kubeconfig, spool_path=spool, **kwargs)
    raise ConfigError(f"unknown store kind {kind!r}; expected one of {', '.join(STORE_KINDS)}")


def apply_event(store: Store, node: str, event: Any, *, now: float, policy: Any = None,
                attempts: int = 30, sleep: Callable[[float], None] = time.sleep,
                rng: Callable[[], float] = random.random) -> Any:
    """Read what the lifecycle needs from `store`, decide, and record the transitions, atomically
    with the fleet's quarantine budget.

    The glue between the pure lifecycle and a store, for the daemon, burn-in and the CLI. Returns
    the screener.lifecycle.Decision. One `store.begin(node)` holds the read-decide-write: on SQLite
    one BEGIN IMMEDIATE transaction; on Kubernetes the budget is one small object written with its
    resourceVersion as precondition. When another writer changed the node (StaleTransition) or the
    budget (BudgetConflict) in between, it reads and decides again, up to `attempts` times, with a
    short random pause so that racing daemons spread out. Raises TransitionRefused for a person's
    command the table refuses.

    Per event the work is O(1) in the fleet size: the node's own state and history, the budget's
    counts, and, only when a failure blames GPU serials, the failures that name those serials.
    """
    from screener import lifecycle

    policy = policy or lifecycle.DEFAULT_POLICY
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
    from screener import lifecycle

    fleet = lifecycle.FleetCounts(total=max(1, txn.fleet_total), out_of_service=txn.out_of_service)
    decision = lifecycle.decide(node, txn.state, event, now=now, history=txn.history, fleet=fleet,
                                policy=policy)
    # The per-GPU lemon rule needs other nodes' failures, but only those naming the serials this
    # failure blames: fetch exactly those (an indexed lookup) and decide again with them.
    serials = sorted({s for t in decision.transitions if t.failure for s in t.gpu_serials})
    if serials:
        failures = txn.failures_for(serials, now - policy.window_seconds)
        if failures:
            decision = lifecycle.decide(node, txn.state, event, now=now, history=txn.history,
                                        failures=failures, fleet=fleet, policy=policy)
    return decision


def reconsider_held(store: Store, node: str, state: Optional[NodeState] = None, *, now: float,
                    policy: Any = None, min_interval_s: float = 30.0) -> Optional[NodeState]:
    """Give a node the quarantine-budget slot it was denied, once one is free; returns its state.

    The daemon calls this on every tick with its cached `state`. A node whose confirmed failure
    found the budget used up was held in suspect (tainted, no new work) with the state it wanted in
    the evidence. When a slot frees (a node leaves quarantine or repair), the held node takes it:
    the same atomic claim as any quarantine, so racing held nodes cannot overrun the budget. Costs
    nothing unless the node is suspect, and then at most one look every `min_interval_s` seconds
    per node (one read of the node and of the budget record).
    """
    from screener import lifecycle

    if state is not None and state != NodeState.SUSPECT:
        return state
    last_look = _LAST_LOOK.get((id(store), node))
    if last_look is not None and 0 <= now - last_look < min_interval_s:
        return state
    _LAST_LOOK[(id(store), node)] = now
    policy = policy or lifecycle.DEFAULT_POLICY
    for attempt in range(10):
        try:
            with store.begin(node) as txn:
                held = txn.history[-1] if txn.history else None
                if (txn.state != NodeState.SUSPECT or held is None
                        or held.to_state != NodeState.SUSPECT
                        or not held.evidence.get(lifecycle.EVIDENCE_HELD_BY_BUDGET)):
                    return txn.state
                try:
                    wanted = NodeState(held.evidence.get("wanted") or NodeState.QUARANTINED.value)
                except ValueError:
                    wanted = NodeState.QUARANTINED
                limit = policy.budget_limit(max(1, txn.fleet_total))
                if wanted not in BUDGET_STATES or txn.out_of_service + 1 > limit:
                    return txn.state
                actions = ((lifecycle.Action.DEEP_HEALTH_CHECK.value,) if wanted == NodeState.QUARANTINED
                           else (lifecycle.Action.REQUEST_REPAIR.value,))
                t = Transition(
                    node=node, time=now, from_state=NodeState.SUSPECT, to_state=wanted,
                    reason=f"a quarantine budget slot is free ({txn.out_of_service + 1} of {limit}); "
                           f"held since {held.time:.0f}: {held.reason}"[:1024],
                    actor=ACTOR_SCREENER, code=lifecycle.CODE_BUDGET,
                    evidence={"released_by_budget": {"held_transition": held.id,
                                                     "limit": limit, "fleet": txn.fleet_total,
                                                     "out_of_service": txn.out_of_service}},
                    failure=False,  # the failure was counted when the node was held
                    gpu_serials=held.gpu_serials, rollback=held.rollback, actions=actions)
                txn.commit([t])
                return wanted
        except (StaleTransition, BudgetConflict):
            continue
    return state


# (store id, node) -> when reconsider_held last looked; a daemon has one store and one node.
_LAST_LOOK: dict[tuple[int, str], float] = {}
