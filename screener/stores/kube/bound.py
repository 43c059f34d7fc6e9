"""The kube store bound to one node: the daemon's port to that node's object in the cluster
(screener.agent.daemon.ports.NodeObject).

Everything the daemon asks the cluster about its own node, beyond the states (the store): the
pods on it that hold GPUs (is it idle?), annotations it publishes (a passing screen's digests),
when the Node was created (the adoption rule), and the two catch-ups of every pass (the spooled
transitions the API did not take, the ones a killed predecessor left half-written).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Mapping, Optional

from screener.stores.kube.store import KubeStore


class KubeNodeObject:
    """`store` bound to `node` (the port the daemon's command wires on the kube store)."""

    def __init__(self, store: KubeStore, node: str) -> None:
        self.store, self.node = store, node

    def gpu_pods(self) -> list[dict[str, Any]]:
        return self.store.gpu_pods(self.node)

    def publish(self, annotations: Mapping[str, Optional[str]]) -> None:
        self.store.set_annotations(self.node, annotations)

    def created(self) -> Optional[float]:
        return created_at(self.store.get_node(self.node))

    def replay(self) -> int:
        return self.store.replay() if self.store.pending() else 0

    def finish(self) -> int:
        return self.store.finish_intents()


def created_at(node_obj: Any) -> Optional[float]:
    """A Node's metadata.creationTimestamp as unix seconds (None when absent or unreadable)."""
    text = ((node_obj or {}).get("metadata") or {}).get("creationTimestamp")
    if not isinstance(text, str):
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
