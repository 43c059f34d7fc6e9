"""The adoption rule: a node the store does not know, that was already serving, is not new.

A daemon rolled out onto a running fleet must not put every node through burn-in (the jobs on them
would be evicted or starved). A node with no state starts in burnin unless it was already serving:
GPU pods running on it (other than the daemon's own), or a Node object older than
`adopt_min_age_s` or created before `adopt_created_before`. Such a node is adopted as
healthy-but-unscreened and gets a quick screen at its next idle window (screener.agent.daemon.loop).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from screener.agent.daemon.ports import NodeObject
from screener.settings.daemon import DaemonConfig

log = logging.getLogger("screener.daemon")


def adoption_reason(config: DaemonConfig, node_object: Optional[NodeObject],
                    now: Callable[[], float]) -> str:
    """Why this node, unknown to the store, is adopted as serving ("" when it is not).

    node_object: the daemon's port to the Node (None: outside a cluster, nothing known). now():
    the stamp clock, read only when the Node's creation time is known. A failure to read the
    pods or the creation time is logged and taken as "not serving": the safe default is burnin.
    """
    if config.adopt == "off" or node_object is None:
        return ""
    node = config.node
    try:
        pods = [p for p in node_object.gpu_pods()
                if not (config.own_pod and p.get("name") == config.own_pod)]
    except Exception as e:  # noqa: BLE001 - cannot tell: the safe default is burnin
        log.warning("cannot list the GPU pods on %s for adoption: %s", node, e)
        pods = []
    if pods:
        names = ", ".join(f"{p.get('namespace', '')}/{p.get('name', '')}" for p in pods[:3])
        return f"already running {len(pods)} GPU pod(s) ({names})"
    created = None
    try:
        created = node_object.created()
    except Exception as e:  # noqa: BLE001
        log.warning("cannot read when node %s was created: %s", node, e)
    if created is None:
        return ""
    if config.adopt_created_before > 0 and created < config.adopt_created_before:
        return f"created before {config.adopt_created_before:.0f} (adopt_created_before)"
    age = now() - created
    if age >= config.adopt_min_age_s:
        return (f"existed {age:.0f} s before the screener first saw it "
                f"(adopt_min_age_s {config.adopt_min_age_s:g})")
    return ""
