"""A node's history on Kubernetes: its ConfigMap, the summary on the Node, and the migration.

Every transition of a node goes into its history ConfigMap `screener-history-<node>` in the
screener namespace (the format, and its bounds: formats.py); the Node carries only a summary of
the last few (written with the state label, by the transition writer). Reads merge the two, and
the spool: a transition waiting there is part of the history already.

Earlier versions kept the whole history in the Node's annotation. `migrate` moves such a history
into the ConfigMap and leaves the summary on the Node; a node's daemon does it when it first looks
at the node (KubeTxn.commit with nothing to write), and any transition completes it.

API calls: configmaps get/create/update/list in the screener namespace; nodes list (metadata) for
the old format, and node patches for the migration.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional, Sequence

from screener.lifecycle.records import Transition
from screener.stores.kube import formats as kf
from screener.stores.kube.calls import ApiCaller, KubeApiError
from screener.stores.kube.node import annotation
from screener.stores.spool import Spool
from screener.types import ANNOTATION_HISTORY, LABEL_STATE

log = logging.getLogger("screener.stores.kube")


class NodeHistories:
    """Reads and appends the nodes' histories through one store's ApiCaller and spool."""

    def __init__(self, calls: ApiCaller, spool: Spool, *, keep: int = kf.HISTORY_KEEP,
                 max_bytes: int = kf.HISTORY_BYTES, conflict_attempts: int = 10) -> None:
        """keep/max_bytes bound a node's history ConfigMap; conflict_attempts bounds the rounds
        of a write that keeps meeting a concurrent one (409)."""
        self.calls, self.spool = calls, spool
        self.keep, self.max_bytes = keep, max_bytes
        self.conflict_attempts = conflict_attempts

    # --- one node -----------------------------------------------------------------------------

    def configmap(self, node: str) -> Optional[dict[str, Any]]:
        """The node's history ConfigMap, or None when it has none yet."""
        return self.calls.cm_get(kf.history_configmap_name(node))

    def of_node(self, node: str, obj: Mapping[str, Any], cm: Optional[Mapping[str, Any]],
                since: Optional[float] = None) -> list[Transition]:
        """The node's transitions, oldest first, from its ConfigMap `cm`, its Node `obj` and the
        spool; only those at or after `since` if given."""
        on_node, _ = kf.parse_node_history(annotation(obj, ANNOTATION_HISTORY), node)
        items = transitions(kf.merge_entries(kf.history_entries(cm), on_node), node)
        return merge_pending(items, [t for _, t in self.spool.entries(node)], since)

    def append(self, node: str, entry: dict[str, Any], cm: Optional[dict[str, Any]],
               on_node: list[dict[str, Any]]) -> None:
        """Add `entry`, and what only the Node holds (`on_node`: an old-format history to move,
        or a summary entry whose ConfigMap write an earlier crash cut short), to the ConfigMap
        `cm` just read; re-read and merged again on a conflict. Nothing to do writes nothing."""
        for _ in range(self.conflict_attempts):
            have = kf.history_entries(cm)
            ids = {e["id"] for e in have}
            missing = [e for e in on_node + [entry] if e["id"] not in ids]
            if not missing:
                return
            merged = kf.merge_entries(have, [entry], on_node)
            rv = (cm or {}).get("metadata", {}).get("resourceVersion") if cm else None
            body = kf.history_configmap(node, merged, namespace=self.calls.namespace,
                                        resource_version=rv, keep=self.keep,
                                        max_bytes=self.max_bytes)
            if self.calls.cm_write(body) is not None:
                return
            cm = self.configmap(node)
        raise KubeApiError(f"history of {node}: still conflicting after "
                           f"{self.conflict_attempts} rounds", 409)

    def migrate(self, node: str, entries: list[dict[str, Any]], cm: Optional[dict[str, Any]]) -> None:
        """Move an old-format history annotation into the node's ConfigMap, leave the summary."""
        self.append(node, entries[-1], cm, entries)

        def change(obj: dict[str, Any]) -> Optional[dict[str, Any]]:
            on_node, legacy = kf.parse_node_history(annotation(obj, ANNOTATION_HISTORY), node)
            if not legacy:
                return None
            return {"metadata": {"annotations": {ANNOTATION_HISTORY: kf.summary_annotation(on_node)}}}

        self.calls.update_node(node, change)
        log.info("node %s: history moved from the Node annotation to ConfigMap %s/%s", node,
                 self.calls.namespace, kf.history_configmap_name(node))

    # --- the fleet ----------------------------------------------------------------------------

    def failures(self, since: float) -> list[Transition]:
        """Failures of every node at or after `since`: one paginated list of the history
        ConfigMaps, and one of Node metadata for nodes whose history is still in the old
        annotation format. Linear in the fleet (for `lemons`, the failure-rate estimate)."""
        entries: dict[str, dict[str, Any]] = {}
        for cm in self.calls.cm_list(f"list configmaps in {self.calls.namespace}",
                                     kf.LABEL_HISTORY):
            for e in kf.history_entries(cm):
                if e.get("failure"):
                    entries.setdefault(str(e["id"]), e)
        for obj in self.calls.node_meta(LABEL_STATE):
            on_node, legacy = kf.parse_node_history(annotation(obj, ANNOTATION_HISTORY),
                                                    obj["metadata"]["name"])
            for e in on_node if legacy else ():
                if e.get("failure"):
                    entries.setdefault(str(e["id"]), e)
        items = [t for t in transitions(entries.values()) if t.time >= since]
        merged = merge_pending(items, [t for _, t in self.spool.entries()], since)
        return sorted((t for t in merged if t.failure), key=lambda t: t.time)

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        """Failures at or after `since` blaming one of `serials`: one label-selected list per
        serial, which returns only the history ConfigMaps of the nodes that saw it."""
        entries: dict[str, dict[str, Any]] = {}
        wanted = {str(s) for s in serials}
        for serial in sorted(wanted):
            # From the API server's cache: a failure recorded a moment ago and not in it yet
            # is the one being decided now, or counts at the next failure.
            for cm in self.calls.cm_list(f"list configmaps with GPU {serial}",
                                         kf.serial_label(serial), cached=True):
                for e in kf.history_entries(cm):
                    if e.get("failure") and wanted & {str(x) for x in e.get("gpu_serials") or ()}:
                        entries.setdefault(str(e["id"]), e)
        items = [t for t in transitions(entries.values()) if t.time >= since]
        pending = [t for _, t in self.spool.entries()
                   if t.failure and wanted & set(t.gpu_serials)]
        return sorted(merge_pending(items, pending, since), key=lambda t: t.time)


def entry(t: Transition) -> dict[str, Any]:
    """The history entry of `t`: the transition, its evidence shrunk to EVIDENCE_BYTES."""
    d = t.to_dict()
    d["evidence"] = kf.shrink_evidence(d["evidence"])
    return d


def transitions(entries: Iterable[dict[str, Any]], node: str = "") -> list[Transition]:
    """The entries as Transitions; one that does not parse is skipped, with a warning."""
    out = []
    for item in entries:
        try:
            out.append(Transition.from_dict(item))
        except ValueError as e:
            log.warning("node %s: skipping a history entry: %s", item.get("node") or node, e)
    return out


def merge_pending(written: list[Transition], pending: list[Transition],
                  since: Optional[float]) -> list[Transition]:
    """Written transitions, then the spooled ones not written yet; those at or after `since`."""
    seen = {t.id for t in written}
    items = written + [t for t in pending if t.id not in seen]
    return [t for t in items if since is None or t.time >= since]
