"""What the Kubernetes store reads from a Node object and the merge patches it writes on one.

On the Node: the label `screener.io/state=<state>`; the taint `screener.io/state=<state>:NoSchedule`
on every state but healthy (ours replaced, everyone else's kept), or none in observe mode; the
taint `screener.io/screening=true:NoSchedule` during an idle-time screen; the condition
`GPUHardwareSuspect` (True for suspect, quarantined and repair). The names are screener.types'.

Pure: no API calls here. Each patch is computed from the Node object just read, and the ApiCaller
sends it with that object's resourceVersion (calls.py), so a concurrent writer makes it fail
with 409 and it is computed again from the fresh object: nobody's taints or conditions are lost.
"""

from __future__ import annotations

import datetime as _dt
import logging
from typing import Any, Mapping, Optional

from screener.lifecycle.records import Transition
from screener.types import (ANNOTATION_HISTORY, CONDITION_TYPE, LABEL_STATE, TAINT_SCREENING_KEY,
                            TAINT_STATE_KEY, NodeState)

log = logging.getLogger("screener.stores.kube")

GPU_RESOURCE = "nvidia.com/gpu"
WARNING_STATES = frozenset({NodeState.SUSPECT, NodeState.QUARANTINED, NodeState.REPAIR})


def iso(ts: float) -> str:
    """A unix time as Kubernetes writes times: RFC 3339, UTC, whole seconds."""
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def state_name(state: Optional[NodeState]) -> str:
    """A state for a message; "(new)" for a node that had none."""
    return state.value if state else "(new)"


def condition_status(state: NodeState) -> str:
    """GPUHardwareSuspect is True while the node is out of normal service for hardware reasons."""
    return "True" if state in WARNING_STATES else "False"


# --- reading ----------------------------------------------------------------------------------------


def state_of(obj: Mapping[str, Any], *, warn: bool = True) -> Optional[NodeState]:
    """The node's state label; None when it has none or one we do not know (warned unless `warn`
    is False: the budget's count reads every node and would repeat it fleet-wide)."""
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_STATE)
    try:
        return NodeState(value) if value else None
    except ValueError:
        if warn:
            log.warning("node %s: ignoring unknown %s label %r",
                        obj.get("metadata", {}).get("name"), LABEL_STATE, value)
        return None


def annotation(obj: Mapping[str, Any], key: str) -> Optional[str]:
    """One annotation of the object, or None."""
    value: Optional[str] = ((obj.get("metadata") or {}).get("annotations") or {}).get(key)
    return value


def gpus_requested(spec: Mapping[str, Any]) -> int:
    """GPUs a pod spec asks for: the limits (else requests) of all its containers."""
    total = 0
    for c in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(GPU_RESOURCE)
        try:
            total += int(value or 0)
        except (TypeError, ValueError):
            pass
    return total


# --- patches ----------------------------------------------------------------------------------------


def state_patch(obj: Mapping[str, Any], state: NodeState, summary: str, *,
                write_taints: bool) -> dict[str, Any]:
    """The one patch that moves the Node to `state`: label, state taint and history summary
    together, so the Node on its own is always consistent. Without `write_taints` (observe mode)
    no state taint is added, and one left from an enforcing run is removed."""
    taints = list((obj.get("spec") or {}).get("taints") or [])
    taints = [x for x in taints if x.get("key") != TAINT_STATE_KEY]
    if state != NodeState.HEALTHY and write_taints:
        taints.append({"key": TAINT_STATE_KEY, "value": state.value, "effect": "NoSchedule"})
    return {"metadata": {"labels": {LABEL_STATE: state.value},
                         "annotations": {ANNOTATION_HISTORY: summary}},
            "spec": {"taints": taints}}


def screening_patch(obj: Mapping[str, Any], on: bool) -> Optional[dict[str, Any]]:
    """Add or remove the screening taint; None when the taints are already so."""
    taints = list((obj.get("spec") or {}).get("taints") or [])
    others = [t for t in taints if t.get("key") != TAINT_SCREENING_KEY]
    new = others + ([{"key": TAINT_SCREENING_KEY, "value": "true", "effect": "NoSchedule"}]
                    if on else [])
    return None if new == taints else {"spec": {"taints": new}}


def reason_patch(obj: Mapping[str, Any], reason: str, message: str, now: float, *,
                 only_if: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The status patch giving GPUHardwareSuspect another reason and message without a
    transition (a platform waiting for its fleet quorum: screener.agent.daemon.fleet), its status
    and transition time kept; None when it already says so. The status follows the node's state
    label when the condition is not there yet. only_if: change it only from this reason (a
    reason a transition wrote since is left as it is)."""
    conditions = list((obj.get("status") or {}).get("conditions") or [])
    old = next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)
    if only_if is not None and (old is None or old.get("reason") != only_if):
        return None
    if old is not None and old.get("reason") == reason and old.get("message") == message[:1024]:
        return None
    state = state_of(obj)
    status = (old.get("status") if old is not None and old.get("status") in ("True", "False")
              else condition_status(state) if state is not None else "False")
    cond = {"type": CONDITION_TYPE, "status": status, "reason": reason,
            "message": message[:1024], "lastHeartbeatTime": iso(now),
            "lastTransitionTime": (old.get("lastTransitionTime") if old is not None
                                   and old.get("lastTransitionTime") else iso(now))}
    rest = [c for c in conditions if c.get("type") != CONDITION_TYPE]
    return {"status": {"conditions": rest + [cond]}}


def condition_patch(obj: Mapping[str, Any], t: Transition, now: float) -> dict[str, Any]:
    """The status patch setting GPUHardwareSuspect for `t`, every other condition kept (a merge
    patch replaces the list, so all are sent; the resourceVersion makes that safe). The
    transition time moves only when the status changes."""
    conditions = list((obj.get("status") or {}).get("conditions") or [])
    old = next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)
    status = condition_status(t.to_state)
    cond = {"type": CONDITION_TYPE, "status": status,
            "reason": t.code or "StateChanged",
            "message": f"{t.to_state.value}: {t.reason}"[:1024],
            "lastHeartbeatTime": iso(now),
            "lastTransitionTime": (old.get("lastTransitionTime") if old and
                                   old.get("status") == status and old.get("lastTransitionTime")
                                   else iso(t.time))}
    rest = [c for c in conditions if c.get("type") != CONDITION_TYPE]
    return {"status": {"conditions": rest + [cond]}}
