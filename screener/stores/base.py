"""The Store protocol and the Transition record: where node states and their history live.

The lifecycle (screener.lifecycle) decides; a store remembers. Every store keeps, per node, the
current state, the ordered list of transitions that led there, and the last known-answer verdict.
`record()` writes a transition and the state it leads to as one unit: a reader never sees the state
of one transition with the history of another.

This module imports only the standard library and screener.types, so that the lifecycle, the
daemon and the CLI can all speak it without pulling in SQLite or Kubernetes.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, ContextManager, Mapping, Optional, Protocol, Sequence, runtime_checkable

from screener.errors import ScreenerError
from screener.types import NodeState

# Who made a transition. Automatic decisions are the screener's; a person's command is "human".
ACTOR_SCREENER = "screener"
ACTOR_HUMAN = "human"


def _json_safe(value: Any) -> Any:
    """Round-trip through JSON so evidence is plain data (and floats such as NaN are strings)."""
    def default(o: Any) -> Any:
        if isinstance(o, (set, frozenset, tuple)):
            return list(o)
        if hasattr(o, "to_dict"):
            return o.to_dict()
        if hasattr(o, "value"):  # enums
            return o.value
        return repr(o)

    def fix_floats(o: Any) -> Any:
        if isinstance(o, float) and not math.isfinite(o):
            return repr(o)
        if isinstance(o, dict):
            return {str(k): fix_floats(v) for k, v in o.items()}
        if isinstance(o, list):
            return [fix_floats(v) for v in o]
        return o

    return fix_floats(json.loads(json.dumps(value, default=default, allow_nan=True)))


class DiskFullError(ScreenerError):
    """The disk holding a store's file is full: the screener's environment failed, never a verdict.

    The message names the file and the filesystem (mount point, bytes free); the write can be
    retried once space is freed.
    """


class BudgetConflict(ScreenerError):
    """The fleet's quarantine-budget record changed between our read and our write: decide again."""


# States that take a node out of service and count against the quarantine budget.
BUDGET_STATES = frozenset({NodeState.QUARANTINED, NodeState.REPAIR})


class StaleTransition(ScreenerError):
    """record() was given a transition whose from_state is not the node's stored state.

    Someone else (a person, another writer) changed the node since the caller read it: read the
    state again and decide again.
    """


@dataclass(frozen=True)
class Transition:
    """One change of a node's state, with why, on what evidence, by whom, and what to do next.

    time: unix seconds (float), from the clock passed to the lifecycle.
    from_state: None when the node was unknown before (its first transition, into burnin).
    reason: a sentence for people; code: a CamelCase reason for the GPUHardwareSuspect condition
      and the Kubernetes Event (e.g. KnownAnswerMismatch, RepeatedFailures, ManualOverride).
    failure: True when the input was a confirmed hardware failure; these count for the lemon rule.
    gpu_serials: serial numbers of the GPUs the evidence blames, so the lemon rule can follow a GPU
      across nodes.
    rollback: where the suspect period began ({"time": unix seconds, "step": training step or None,
      "job": job name or None}) so a training job knows how far back to roll; None when not relevant.
    actions: what the caller should do now (screener.lifecycle.Action values, as strings).
    """

    node: str
    time: float
    from_state: Optional[NodeState]
    to_state: NodeState
    reason: str
    actor: str = ACTOR_SCREENER
    code: str = ""
    evidence: Mapping[str, Any] = field(default_factory=dict)
    failure: bool = False
    gpu_serials: tuple[str, ...] = ()
    rollback: Optional[Mapping[str, Any]] = None
    actions: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """A stable identifier derived from the content, so a replayed write is recognised."""
        key = json.dumps([self.node, repr(float(self.time)),
                          self.from_state.value if self.from_state else None,
                          self.to_state.value, self.reason, self.actor, self.code],
                         separators=(",", ":"))
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "time": float(self.time),
            "from": self.from_state.value if self.from_state else None,
            "to": self.to_state.value,
            "reason": self.reason,
            "actor": self.actor,
            "code": self.code,
            "evidence": _json_safe(dict(self.evidence)),
            "failure": bool(self.failure),
            "gpu_serials": list(self.gpu_serials),
            "rollback": _json_safe(dict(self.rollback)) if self.rollback is not None else None,
            "actions": list(self.actions),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Transition":
        """Parse a stored transition; raises ValueError naming what is wrong."""
        try:
            return cls(
                node=str(d["node"]), time=float(d["time"]),
                from_state=NodeState(d["from"]) if d.get("from") else None,
                to_state=NodeState(d["to"]), reason=str(d.get("reason") or ""),
                actor=str(d.get("actor") or ACTOR_SCREENER), code=str(d.get("code") or ""),
                evidence=dict(d.get("evidence") or {}), failure=bool(d.get("failure")),
                gpu_serials=tuple(str(s) for s in d.get("gpu_serials") or ()),
                rollback=dict(d["rollback"]) if d.get("rollback") else None,
                actions=tuple(str(a) for a in d.get("actions") or ()),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed transition record: {e!r}") from None


@runtime_checkable
class Store(Protocol):
    """Where node states, their history and the last verdicts live (LocalStore, KubeStore).

    Times are unix seconds. Nodes never seen have no state (None), not a default one: the
    lifecycle decides that a new node starts in burnin.
    """

    def get_state(self, node: str) -> Optional[NodeState]:
        """The node's current state, or None if the store has never seen it."""
        ...

    def record(self, transition: Transition) -> None:
        """Write the transition and the node's new state together (all or nothing).

        Recording the same transition twice (same id) is a no-op. Raises StaleTransition when
        from_state is not the stored state (someone changed the node since the caller read it).

        A store that cannot write now (an unreachable API) keeps the transition and writes it
        later, in order; it raises only when it could neither write nor keep it.
        """
        ...

    def history(self, node: str, since: Optional[float] = None) -> list[Transition]:
        """The node's transitions, oldest first; only those at or after `since` if given."""
        ...

    def all_states(self) -> dict[str, NodeState]:
        """Every known node and its current state."""
        ...

    def failures(self, since: float) -> list[Transition]:
        """Transitions with failure=True at or after `since`, on every node, oldest first.

        The lemon rule counts these per node and per GPU serial.
        """
        ...

    def set_verdict(self, node: str, verdict: Mapping[str, Any]) -> None:
        """Remember the node's last known-answer verdict (plain JSON-able data)."""
        ...

    def get_verdict(self, node: str) -> Optional[dict[str, Any]]:
        """The node's last recorded verdict, or None."""
        ...

    def close(self) -> None:
        """Release connections and files."""
        ...

    def begin(self, node: str) -> ContextManager["NodeTxn"]:
        """Open one atomic read-decide-write of `node` (see NodeTxn); apply_event uses it."""
        ...

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        """Failures at or after `since` that blame one of `serials`, without reading the fleet."""
        ...

    def summaries(self) -> list[dict[str, Any]]:
        """node, state, since, reason, actor of every known node, from one (paginated) read."""
        ...


@runtime_checkable
class NodeTxn(Protocol):
    """One read-decide-write of one node, atomic with the fleet's quarantine budget.

    Opened by a store's `begin(node)` (a context manager). It holds what the lifecycle needs,
    read at the start: the node's state and history, and the fleet's counts for the budget, read
    from one small record (never by listing the fleet). `commit` records the transitions; a
    transition that takes the node out of service automatically also claims a budget slot, and
    fails with BudgetConflict (SQLite: cannot happen, the transaction holds the write lock) when
    the counts changed since they were read, so the caller decides again.
    """

    state: Optional[NodeState]
    history: list[Transition]
    fleet_total: int  # nodes in the fleet, this node included
    out_of_service: int  # *other* nodes quarantined or in repair

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        """Failure transitions at or after `since` on any node that blame one of `serials`."""
        ...

    def commit(self, transitions: Sequence[Transition]) -> None:
        """Record the transitions in order, claiming or releasing budget slots as they require."""
        ...


def summary_row(node: str, state: NodeState, last: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """One row of `screener node status` for the fleet: node, state, since, reason, actor."""
    last = last or {}
    return {"node": node, "state": state.value, "since": last.get("time"),
            "reason": str(last.get("reason") or ""), "actor": str(last.get("actor") or "")}


def lemon_counts(failures: Sequence[Transition]) -> tuple[dict[str, int], dict[str, int]]:
    """Count failures per node and per GPU serial (helper shared by the CLI and the stores)."""
    by_node: dict[str, int] = {}
    by_serial: dict[str, int] = {}
    for t in failures:
        if not t.failure:
            continue
        by_node[t.node] = by_node.get(t.node, 0) + 1
        for s in set(t.gpu_serials):
            by_serial[s] = by_serial.get(s, 0) + 1
    return by_node, by_serial
