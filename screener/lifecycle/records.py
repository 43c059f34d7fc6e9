"""Transitions: the record of one change of a node's state, who may make it, and how they are counted.

The lifecycle (machine.py) produces Transitions; every store persists them as they are. Plain data
and the standard library only, so the lifecycle, the stores, the daemon and the CLI all speak it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from screener.errors import ScreenerError
from screener.types import BUDGET_STATES, NodeState

__all__ = ["ACTOR_HUMAN", "ACTOR_SCREENER", "BUDGET_STATES", "BudgetConflict", "StaleTransition", "json_safe",
           "Transition", "lemon_counts"]

# Who made a transition. Automatic decisions are the screener's; a person's command is "human".
ACTOR_SCREENER = "screener"
ACTOR_HUMAN = "human"



def json_safe(value: Any) -> Any:
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


class BudgetConflict(ScreenerError):
    """The fleet's quarantine-budget record changed between our read and our write: decide again."""


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
    actions: what the caller should do now (screener.lifecycle.machine.Action values, as strings).
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
            "evidence": json_safe(dict(self.evidence)),
            "failure": bool(self.failure),
            "gpu_serials": list(self.gpu_serials),
            "rollback": json_safe(dict(self.rollback)) if self.rollback is not None else None,
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
