"""The fleet quorum on Kubernetes: each node's candidates on its Node, promoted goldens in ConfigMaps.

What a platform without a golden is judged by (screener.known_answer.verdict.quorum) lives in two
places:

- a node's candidates, the results its devices reproduced, in the annotation
  `screener.io/kat-candidates` on its own Node ({platform hash: {job: {"digest", "spec_hash"}}}):
  written by the node's daemon only (the admission policy admits only screener.io/ keys, and the
  node claim binds a daemon to its own Node), read by every other node of the platform from one
  paginated list of Node metadata;
- a platform's promoted goldens in the ConfigMap `screener-quorum-<platform hash>` of the
  screener namespace, one data key `<job>.json` per job, labelled `screener.io/quorum=true` so
  one label-selected list reads them all (one object per platform: a handful). Add-only: a key
  once written is never changed (the admission policy `screener-configmaps` refuses a change of
  an existing key and any delete of these objects), so a node whose result differs from the
  promoted one cannot replace it; it reports the conflict instead.

Every request goes through the store's ApiCaller (timeouts, retries, deadlines: calls.py).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable, Mapping, Optional

from screener import boundedjson
from screener.stores.kube.calls import ApiCaller, KubeApiError
from screener.stores.kube.formats import MANAGED_BY
from screener.types import ANNOTATION_CANDIDATES

log = logging.getLogger("screener.kube")

QUORUM_PREFIX = "screener-quorum-"
LABEL_QUORUM = "screener.io/quorum"
_PHASH = re.compile(r"^[0-9a-f]{16}$")
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")
MAX_CANDIDATES_BYTES = 64 * 1024  # the annotation (all of a Node's annotations: 256 KiB)
MAX_RECORD_BYTES = 256 * 1024  # one promoted record (the ConfigMap's limit is 1 MiB)
CONFLICT_ATTEMPTS = 5


def configmap_name(phash: str) -> str:
    return QUORUM_PREFIX + phash


class KubeQuorum:
    """The quorum's reads and writes on the API server (see the module docstring).

    patch_annotations(node, values): the store's merge patch of our annotations."""

    def __init__(self, calls: ApiCaller,
                 patch_annotations: Callable[[str, Mapping[str, Optional[str]]], None]) -> None:
        self.calls = calls
        self.patch_annotations = patch_annotations

    def publish_candidates(self, node: str,
                           candidates: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None:
        """Merge a screen's candidates into the node's annotation (a platform's jobs replace
        that platform's earlier entries job by job; other platforms stay, for a node that
        moves back). Written only when something changed."""
        current = self._parse(self.calls.read_node(node)["metadata"].get("annotations", {})
                              .get(ANNOTATION_CANDIDATES), node) or {}
        merged = {p: dict(jobs) for p, jobs in current.items()}
        for phash, jobs in candidates.items():
            merged.setdefault(phash, {}).update({j: dict(e) for j, e in jobs.items()})
        if merged == current:
            return
        text = json.dumps(merged, sort_keys=True, separators=(",", ":"))
        while len(text) > MAX_CANDIDATES_BYTES and len(merged) > 1:
            # Oldest platforms first out: the ones this node runs now are in `candidates`.
            drop = next(p for p in sorted(merged) if p not in candidates)
            merged.pop(drop)
            text = json.dumps(merged, sort_keys=True, separators=(",", ":"))
        self.patch_annotations(node, {ANNOTATION_CANDIDATES: text})

    def candidates(self) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
        """Every node's published candidates: node -> platform -> job -> entry. An annotation
        that does not parse is skipped with a log line (no vote, never a failed screen)."""
        out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
        for obj in self.calls.node_meta():
            name = obj["metadata"]["name"]
            parsed = self._parse((obj["metadata"].get("annotations") or {})
                                 .get(ANNOTATION_CANDIDATES), name)
            if parsed:
                out[name] = parsed
        return out

    @staticmethod
    def _parse(raw: Optional[str], node: str) -> Optional[dict[str, dict[str, dict[str, Any]]]]:
        if raw is None:
            return None
        try:
            data = boundedjson.loads(raw, max_bytes=MAX_CANDIDATES_BYTES, max_depth=4)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError) as e:
            log.warning("node %s: ignoring its %s annotation: %s", node, ANNOTATION_CANDIDATES, e)
            return None
        return {str(p): {str(j): dict(e) for j, e in jobs.items() if isinstance(e, dict)}
                for p, jobs in data.items() if isinstance(jobs, dict)}

    def promote(self, phash: str, job: str, text: str) -> Optional[str]:
        """Store a promoted golden; None when stored, else the record already there (it
        stays: the caller compares the two)."""
        if not _PHASH.match(phash) or not _JOB.match(job):
            raise ValueError(f"not a platform hash and job name: {phash!r}, {job!r}")
        if len(text.encode()) > MAX_RECORD_BYTES:
            raise ValueError(f"promoted golden {job} on {phash}: {len(text.encode())} bytes, "
                             f"over the bound of {MAX_RECORD_BYTES}")
        name, key = configmap_name(phash), f"{job}.json"
        for _ in range(CONFLICT_ATTEMPTS):
            cm = self.calls.cm_get(name)
            if cm is None:
                body = {"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": name, "namespace": self.calls.namespace,
                                     "labels": {**MANAGED_BY, LABEL_QUORUM: "true"}},
                        "data": {key: text}}
            else:
                have = (cm.get("data") or {}).get(key)
                if have is not None:
                    return str(have)
                body = {**cm, "data": {**(cm.get("data") or {}), key: text}}
            if self.calls.cm_write(body) is not None:
                return None
        raise KubeApiError(f"configmap {name}: still conflicting after {CONFLICT_ATTEMPTS} "
                           "read-modify-write rounds", 409)

    def promoted(self) -> dict[str, dict[str, str]]:
        """Platform hash -> job -> record text of every promoted golden (one list)."""
        out: dict[str, dict[str, str]] = {}
        for cm in self.calls.cm_list("list promoted goldens", f"{LABEL_QUORUM}=true"):
            name = cm["metadata"]["name"]
            phash = name[len(QUORUM_PREFIX):]
            if not name.startswith(QUORUM_PREFIX) or not _PHASH.match(phash):
                continue
            for key, text in (cm.get("data") or {}).items():
                if key.endswith(".json") and isinstance(text, str):
                    out.setdefault(phash, {})[key[:-len(".json")]] = text
        return out
