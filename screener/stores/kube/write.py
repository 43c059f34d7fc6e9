"""Writing one transition to Kubernetes as one unit, so that a replay completes a partial write.

The order: the Node first (state label, state taint and history summary in one patch, with the
resourceVersion read: node.py), then the rest of the unit: the full entry in the history
ConfigMap (history.py), the quarantine budget (registration, slot: budget.py), condition
`GPUHardwareSuspect` through nodes/status, and the Event (events.py). Each step re-checks the
current objects, so writing a transition again after a partial write completes it and never does
a step twice; once the Node is written, a failure of the rest is transient (the store spools the
transition and replays it), never a transition left half-written.

A replayed transition (check_from=False) may find the node moved on: when a person decided about
it after the transition was decided, it is Superseded (dropped); a failure never is.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from screener.errors import ScreenerError
from screener.lifecycle.records import ACTOR_HUMAN, StaleTransition, Transition
from screener.stores.kube import formats as kf
from screener.stores.kube.budget import BudgetView, KubeBudget
from screener.stores.kube.calls import ApiCaller, KubeApiError, TransientKubeError
from screener.stores.kube.events import NodeEvents
from screener.stores.kube.history import NodeHistories, entry as history_entry
from screener.stores.kube.node import annotation, condition_patch, state_name, state_of, state_patch
from screener.types import ANNOTATION_HISTORY, NodeState


class Superseded(ScreenerError):
    """A spooled transition that a person's later decision on the node replaced: the screener
    decided it on a state the person has since changed, while this daemon could not write."""


class TransitionWriter:
    """Writes transitions through one store's API client, histories, budget and Events."""

    def __init__(self, calls: ApiCaller, histories: NodeHistories, budget: KubeBudget,
                 events: NodeEvents, *, clock: Callable[[], float]) -> None:
        self.calls, self.histories, self.budget, self.events = calls, histories, budget, events
        self.clock = clock

    def write(self, t: Transition, *, check_from: bool, write_taints: bool,
              node_obj: Optional[dict[str, Any]] = None, cm: Any = ...,
              view: Optional[BudgetView] = None) -> None:
        """Write `t` (see the module docstring). check_from: refuse it (StaleTransition) unless
        the node is in its from_state, as for a transition decided now; a replay passes False.
        write_taints: False in observe mode. node_obj, cm, view: the Node, history ConfigMap and
        budget just read, to save reading them again (`...` for cm: not read)."""
        if cm is ...:
            cm = self.histories.configmap(t.node)
        entry = history_entry(t)
        cm_ids = {e["id"] for e in kf.history_entries(cm)}
        seen: dict[str, Any] = {}

        def change_node(obj: dict[str, Any]) -> Optional[dict[str, Any]]:
            on_node, legacy = kf.parse_node_history(annotation(obj, ANNOTATION_HISTORY), t.node)
            seen.update(on_node=on_node, legacy=legacy, done=False)
            if t.id in cm_ids or any(e["id"] == t.id for e in on_node):
                seen["done"] = True
                return None  # written before (a replay after a partial write)
            stored = state_of(obj)
            seen["stored"] = stored
            if not check_from and stored != t.from_state:
                refuse_superseded(t, stored, on_node)
            if check_from and stored != t.from_state:
                raise StaleTransition(
                    f"node {t.node}: transition {state_name(t.from_state)} -> {t.to_state.value} "
                    f"not recorded: the node is {state_name(stored)} now")
            summary = kf.summary_annotation(kf.merge_entries(on_node, [entry]))
            return state_patch(obj, t.to_state, summary, write_taints=write_taints)

        obj = self.calls.update_node(t.node, change_node, first=node_obj)
        try:
            self._complete(t, obj, entry, cm, seen.get("on_node") or [], view)
        except TransientKubeError:
            raise
        except KubeApiError as e:
            if e.status != 409:
                raise  # RBAC, validation, a missing namespace: a person must fix them
            raise TransientKubeError(f"transition of {t.node} written on the Node, the rest "
                                     f"still conflicting: {e}", 409) from e

    def _complete(self, t: Transition, obj: dict[str, Any], entry: dict[str, Any], cm: Any,
                  on_node: list[dict[str, Any]], view: Optional[BudgetView]) -> None:
        """What a transition writes after the Node: history, budget, condition, Event."""
        # The full history: this entry, and what only the Node holds (an old-format history to
        # migrate, or a summary entry whose ConfigMap write an earlier crash cut short).
        self.histories.append(t.node, entry, cm, on_node)
        # The status write and the slots must not reorder history: only when this transition is
        # the node's latest (a replayed or finished older one must not undo a newer one's).
        summary, _ = kf.parse_node_history(annotation(obj, ANNOTATION_HISTORY), t.node)
        latest = not summary or summary[-1].get("id") == t.id
        self.budget.sync(t, view, latest=latest)
        if latest:
            self.calls.update_node(t.node, lambda o: condition_patch(o, t, self.clock()),
                                   status=True, first=obj)
        self.events.post(t, obj)


def refuse_superseded(t: Transition, stored: Optional[NodeState],
                      on_node: list[dict[str, Any]]) -> None:
    """Raise Superseded when the node's latest recorded transition is a person's, made after `t`
    was decided: a replay must not undo a person's decision with one taken on an older state.

    A failure (hardware evidence) is never superseded: the person could not see it while it sat
    in the spool, and losing it could return a bad GPU to service.
    """
    if t.failure:
        return
    latest = on_node[-1] if on_node else None
    if not latest or latest.get("actor") != ACTOR_HUMAN:
        return
    try:
        time_raw: Any = latest.get("time")  # unchecked JSON: float() refuses what is no time
        when = float(time_raw)
    except (TypeError, ValueError):
        return
    if when >= t.time:
        raise Superseded(f"node {t.node}: {state_name(t.from_state)} -> {t.to_state.value} not "
                         f"written: a person set it {state_name(stored)} afterwards "
                         f"({latest.get('reason') or 'no reason given'})")
