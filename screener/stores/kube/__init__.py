"""The store on the Kubernetes API: node states on the Node objects themselves (store.py, the
facade, and the only importer of the kubernetes client) and its parts, one module each: the API
client and its deadline (calls, deadline), what goes on the Node (node), the histories (history),
the quarantine budget (budget), the Events (events), the DRA device taints (devices), the fleet
quorum's records (quorum), the writer of one transition (write), the object formats (formats) and
the kubeconfig checks (config).

`from screener.stores.kube import KubeStore` stays the public path. The facade is loaded on first
use, so a part (the formats, read by the agent with any store) does not pull in the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from screener.stores.kube.store import (DEFAULT_NAMESPACE, KubeApiError, KubeStore,
                                            KubeTimeouts, NodeNotFound, RetryPolicy,
                                            TransientKubeError)

__all__ = ["DEFAULT_NAMESPACE", "KubeApiError", "KubeStore", "KubeTimeouts", "NodeNotFound",
           "RetryPolicy", "TransientKubeError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("screener.stores.kube.store"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
