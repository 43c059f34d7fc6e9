"""The Event the Kubernetes store posts on a Node for each transition.

One Event per transition (Warning for suspect, quarantined and repair, else Normal), named after
the transition's id: the API server refuses a second create of that name (409 AlreadyExists), so
a replay after a partial write cannot post it twice. API call: events create, in the store's
event namespace.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from screener.lifecycle.records import Transition
from screener.stores.kube.calls import ApiCaller, KubeApiError, missing_namespace
from screener.stores.kube.node import WARNING_STATES, iso, state_name


class NodeEvents:
    """Posts the Events of one store's transitions: who posts (component, instance), and where."""

    def __init__(self, calls: ApiCaller, *, namespace: str, component: str, instance: str,
                 clock: Callable[[], float]) -> None:
        self.calls, self.namespace = calls, namespace
        self.component, self.instance, self.clock = component, instance, clock

    def body(self, t: Transition, node_obj: Mapping[str, Any]) -> dict[str, Any]:
        """The Event of `t` on the Node `node_obj` (its uid ties the Event to that very Node)."""
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{t.node}.screener.{t.id}", "namespace": self.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": t.node,
                               "uid": node_obj["metadata"].get("uid", t.node)},
            "reason": t.code or "StateChanged",
            "message": f"{state_name(t.from_state)} -> {t.to_state.value} by {t.actor}: "
                       f"{t.reason}"[:1024],
            "type": "Warning" if t.to_state in WARNING_STATES else "Normal",
            "source": {"component": self.component, "host": self.instance},
            "reportingComponent": f"screener.io/{self.component}",
            "reportingInstance": self.instance,
            "firstTimestamp": iso(t.time), "lastTimestamp": iso(self.clock()), "count": 1,
        }

    def post(self, t: Transition, node_obj: Mapping[str, Any]) -> None:
        """Create the Event; one an earlier attempt posted already is left as it is."""
        body = self.body(t, node_obj)
        try:
            self.calls.call(f"create event for {t.node}", self.calls.api.create_namespaced_event,
                            self.namespace, body)
        except KubeApiError as e:
            if e.status == 404:
                raise KubeApiError(missing_namespace(self.namespace, "the Node Events"),
                                   404) from e
            if e.status != 409:  # 409: AlreadyExists, posted by an earlier attempt
                raise
