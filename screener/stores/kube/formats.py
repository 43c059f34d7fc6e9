"""What the Kubernetes store keeps where, as plain data: no API calls here (calls.py makes them).

Node objects are watched by every kubelet, scheduler and controller, so what screener writes on
them stays small and bounded. A node's full history lives off the Node:

  * Node annotation `screener.io/history`: a summary, {"v": 2, "last": [...]}, the last few
    transitions without evidence (at most SUMMARY_BYTES); enough for `node status` of the whole
    fleet from one list of Node metadata, and written in the same patch as the state label, so the
    Node on its own is always consistent.
  * ConfigMap `screener-history-<node>` in the screener namespace: every transition (evidence
    shrunk to a few KB) of the last HISTORY_KEEP, within HISTORY_BYTES. Labelled
    `screener.io/history=true` (so `lemons` lists them, paginated) and, for each GPU serial a
    failure in it blames, `gpu.screener.io/s-<hash>=true` (so the per-GPU lemon rule finds the few
    nodes that saw a serial with one label-selected list, whatever the fleet's size).
  * The quarantine budget (budget.py), ConfigMaps labelled `screener.io/budget=true`, read
    with one list: the record `screener-budget` (the fleet's size as last counted, and who is
    counting it now); one claim per node out of service, `screener-budget-slot-<k>`, created
    (atomically: a taken name is 409 AlreadyExists) and deleted on release, so claims do not
    queue on one object; and FLEET_SHARDS registration shards `screener-fleet-<s>` holding the
    nodes that got their first state since the record was counted.

Earlier versions kept the whole history (a JSON list of full transitions) in the annotation. Such a
node keeps working: its entries are read, and moved to the ConfigMap the first time its daemon
looks at the node (at start-up) or on its next transition.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from screener import boundedjson
from screener.types import BUDGET_STATES, NodeState

HISTORY_FORMAT = 2
SUMMARY_KEEP = 5  # transitions in the Node's summary annotation
SUMMARY_BYTES = 2048
SUMMARY_REASON_CHARS = 200
# A node's history ConfigMap is read and rewritten whole on every transition of the node, so its
# bounds are the per-event bytes: 100 transitions (weeks of a busy node) within 128 KiB; failures
# inside the lemon window are the last entries dropped (see history_configmap).
HISTORY_KEEP = 100
HISTORY_BYTES = 128 * 1024

BUDGET_CONFIGMAP = "screener-budget"
SLOT_PREFIX = "screener-budget-slot-"
SHARD_PREFIX = "screener-fleet-"
LABEL_BUDGET = "screener.io/budget"  # the record, the slots and the shards: one list reads them
LABEL_BUDGET_KIND = "screener.io/budget-kind"  # record, slot or shard
HISTORY_PREFIX = "screener-history-"
LABEL_HISTORY = "screener.io/history"
LABEL_SERIAL_PREFIX = "gpu.screener.io/s-"
ANNOTATION_NODE = "screener.io/node"
DATA_HISTORY = "history"
MANAGED_BY = {"app.kubernetes.io/name": "screener", "app.kubernetes.io/managed-by": "screener"}

_SLIM_KEYS = ("id", "node", "time", "from", "to", "actor", "code", "failure")


# --- the Node's summary annotation -----------------------------------------------------------------


def slim(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A transition for the summary: identity, states, actor, code and a short reason."""
    out = {k: entry.get(k) for k in _SLIM_KEYS if k in entry}
    out["reason"] = str(entry.get("reason") or "")[:SUMMARY_REASON_CHARS]
    return out


def summary_annotation(entries: list[dict[str, Any]]) -> str:
    """The bounded summary: the newest SUMMARY_KEEP slim entries that fit in SUMMARY_BYTES."""
    last = [slim(e) for e in entries[-SUMMARY_KEEP:]]
    while True:
        text = json.dumps({"v": HISTORY_FORMAT, "last": last}, separators=(",", ":"),
                          sort_keys=True)
        if len(text) <= SUMMARY_BYTES or len(last) <= 1:
            return text
        last = last[1:]


def parse_node_history(raw: Optional[str], node: str) -> tuple[list[dict[str, Any]], bool]:
    """(entries, legacy) from the Node's history annotation.

    legacy: the annotation is the old format (a list of full transitions), whose entries must move
    to the ConfigMap. Entries lacking a node name get `node`. Unparsable text gives no entries.
    """
    if not raw:
        return [], False
    try:
        data = boundedjson.strict(raw)
    except ValueError:
        return [], False
    if isinstance(data, list):
        items, legacy = data, True
    elif isinstance(data, dict) and isinstance(data.get("last"), list):
        items, legacy = data["last"], False
    else:
        return [], False
    out = []
    for item in items:
        if isinstance(item, dict) and item.get("id"):
            out.append({**item, "node": item.get("node") or node})
    return out, legacy


# --- the node's history ConfigMap ------------------------------------------------------------------


def history_configmap_name(node: str) -> str:
    """`screener-history-<node>`; a node name too long for that gets a hash instead."""
    name = HISTORY_PREFIX + node
    if len(name) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name):
        return name
    return HISTORY_PREFIX + hashlib.sha256(node.encode()).hexdigest()[:32]


def serial_label(serial: str) -> str:
    """The label key that marks a history ConfigMap as holding a failure blaming `serial`."""
    return LABEL_SERIAL_PREFIX + hashlib.sha256(serial.encode()).hexdigest()[:24]


def history_entries(cm: Optional[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The transitions stored in a history ConfigMap (none when it is missing or unreadable)."""
    if not cm:
        return []
    raw = (cm.get("data") or {}).get(DATA_HISTORY)
    try:
        items = boundedjson.strict(raw) if raw else []
    except ValueError:
        return []
    return [i for i in items if isinstance(i, dict) and i.get("id")] if isinstance(items, list) else []


def merge_entries(*sources: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries of all sources, one per id (the first source that has it wins), oldest first."""
    seen: dict[str, dict[str, Any]] = {}
    for src in sources:
        for e in src:
            seen.setdefault(str(e["id"]), e)
    return sorted(seen.values(), key=_entry_time)


def _entry_time(entry: Mapping[str, Any]) -> float:
    """An entry's time for ordering; 0 when it is no finite number (the Node's annotation is
    writable by more than screener, and one bad entry must not stop the node's events)."""
    try:
        t = float(entry.get("time") or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return t if math.isfinite(t) else 0.0


def history_configmap(node: str, entries: list[dict[str, Any]], *, namespace: str,
                      resource_version: Optional[str] = None, keep: int = HISTORY_KEEP,
                      max_bytes: int = HISTORY_BYTES) -> dict[str, Any]:
    """The ConfigMap body holding `entries`, at most `keep` of them within `max_bytes` (see
    bounded_entries for which go first)."""
    entries = bounded_entries(entries, keep, max_bytes)
    text = json.dumps(entries, separators=(",", ":"), sort_keys=True)
    labels = {**MANAGED_BY, LABEL_HISTORY: "true"}
    for e in entries:
        serials = e.get("gpu_serials")
        if e.get("failure") and isinstance(serials, list):
            for s in serials:
                labels[serial_label(str(s))] = "true"
    meta: dict[str, Any] = {"name": history_configmap_name(node), "namespace": namespace,
                            "labels": labels, "annotations": {ANNOTATION_NODE: node}}
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {DATA_HISTORY: text}}


def bounded_entries(entries: list[dict[str, Any]], keep: int, max_bytes: int) -> list[dict[str, Any]]:
    """At most `keep` entries whose JSON list fits in `max_bytes`: the oldest non-failures go
    first, then the oldest failures (the lemon rule counts a node's recent failures from here),
    and the newest entry always stays. Order is kept."""
    sizes = [len(json.dumps(e, separators=(",", ":"), sort_keys=True)) + 1 for e in entries]
    total, count = sum(sizes) + 2, len(entries)
    dropped: set[int] = set()
    for want_failure in (False, True):
        for i, e in enumerate(entries[:-1]):
            if count <= keep and total <= max_bytes:
                break
            if bool(e.get("failure")) == want_failure:
                dropped.add(i)
                total -= sizes[i]
                count -= 1
    return [e for i, e in enumerate(entries) if i not in dropped]


# --- the budget record -----------------------------------------------------------------------------


@dataclass
class BudgetRecord:
    """The budget record `screener-budget`: the fleet's size as last counted, and the lease of
    whoever is counting it again.

    fleet: nodes with a screener state when the record was counted (nodes registered since are in
    the shards, see budget.py). counted: when that count's list of Node metadata began.
    counter, counting_until: the store instance that holds the recount lease, and until when (at
    most one daemon recounts a stale record; the others use it as it is). out: node -> claim, the
    out-of-service set an earlier version kept here (read, counted, and moved into slots by the
    next recount). resource_version: the record's, for the precondition.
    """

    fleet: int = 0
    out: dict[str, dict[str, Any]] = field(default_factory=dict)
    counted: float = 0.0
    resource_version: Optional[str] = None
    counter: str = ""
    counting_until: float = 0.0

    @classmethod
    def from_configmap(cls, cm: Mapping[str, Any]) -> "BudgetRecord":
        """Parse the record. Anyone with write access to the namespace can edit it, so every field
        is checked; a record with any field out of shape reads with `counted` = 0, which makes the
        next read recount it from the Nodes' labels (the truth) instead of trusting it."""
        data = cm.get("data") or {}
        rv = (cm.get("metadata") or {}).get("resourceVersion")
        counter = str(data.get("counter") or "")[:253]
        try:
            until = _unix_time(data.get("countingUntil") or "0")
        except ValueError:
            until = 0.0
        try:
            out = _record_out(data.get("outOfService"))
        except ValueError:
            return cls(fleet=0, out={}, counted=0.0, resource_version=rv, counter=counter,
                       counting_until=until)
        try:
            return cls(fleet=_record_fleet(data.get("fleet")), out=out,
                       counted=_unix_time(data.get("counted")), resource_version=rv,
                       counter=counter, counting_until=until)
        except ValueError:
            return cls(fleet=0, out=out, counted=0.0, resource_version=rv, counter=counter,
                       counting_until=until)

    def configmap(self, namespace: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": BUDGET_CONFIGMAP, "namespace": namespace,
                                "labels": budget_labels("record")}
        if self.resource_version:
            meta["resourceVersion"] = self.resource_version
        data = {"fleet": str(self.fleet), "counted": repr(float(self.counted)),
                "outOfService": json.dumps(self.out, separators=(",", ":"), sort_keys=True)}
        if self.counter:
            data.update(counter=self.counter, countingUntil=repr(float(self.counting_until)))
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def budget_labels(kind: str) -> dict[str, str]:
    """Labels of the budget's ConfigMaps: one label-selected list reads all of them."""
    return {**MANAGED_BY, LABEL_BUDGET: "true", LABEL_BUDGET_KIND: kind}


@dataclass(frozen=True)
class Claim:
    """One node out of service: the slot ConfigMap `screener-budget-slot-<index>` naming it."""

    index: int
    node: str
    state: str
    since: float
    uid: str = ""
    resource_version: str = ""

    @property
    def name(self) -> str:
        return slot_name(self.index)


def slot_name(index: int) -> str:
    return f"{SLOT_PREFIX}{index}"


def slot_configmap(index: int, node: str, state: str, since: float, *,
                   namespace: str) -> dict[str, Any]:
    """The body that claims slot `index` for `node` (created, never updated: create is atomic)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": slot_name(index), "namespace": namespace,
                         "labels": budget_labels("slot"), "annotations": {ANNOTATION_NODE: node}},
            "data": {"node": node, "state": state, "since": repr(float(since))}}


def parse_slot(cm: Mapping[str, Any]) -> Optional[Claim]:
    """The claim a slot ConfigMap holds; None when it is not one screener wrote (checked field by
    field: a hand-made slot must not free or take anyone's place)."""
    meta, data = cm.get("metadata") or {}, cm.get("data") or {}
    name = str(meta.get("name") or "")
    if not name.startswith(SLOT_PREFIX) or not re.fullmatch(r"[0-9]{1,7}", name[len(SLOT_PREFIX):]):
        return None
    node, state = data.get("node"), data.get("state")
    try:
        since = _unix_time(data.get("since"))
        if NodeState(state) not in BUDGET_STATES:
            return None
    except ValueError:
        return None
    if not isinstance(node, str) or not node or len(node) > 253:
        return None
    return Claim(index=int(name[len(SLOT_PREFIX):]), node=node, state=str(state), since=since,
                 uid=str(meta.get("uid") or ""), resource_version=str(meta.get("resourceVersion") or ""))


SHARD_MAX_NODES = 4096  # a shard holds registrations since the last count, which it triggers early


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index}"


def shard_of(node: str, shards: int) -> int:
    """Which registration shard counts `node` (a stable hash, the same in every daemon)."""
    return int(hashlib.sha256(node.encode()).hexdigest()[:8], 16) % max(1, shards)


def shard_configmap(index: int, nodes: Mapping[str, float], *, namespace: str,
                    resource_version: Optional[str] = None,
                    base: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """A registration shard: one data key per node (its name), whose value is when it got its
    first state, since the record's count.

    One key per node, not one JSON document, so the admission policy (screener-configmaps) can
    tell a daemon's own registration added from anyone else's removed or changed: CEL in
    admission cannot parse JSON. base: the shard's data as read; a registration adds its key to
    it and keeps everything else as it is, even what does not parse (only the lease holder's
    count may take keys away)."""
    meta: dict[str, Any] = {"name": shard_name(index), "namespace": namespace,
                            "labels": budget_labels("shard")}
    if resource_version:
        meta["resourceVersion"] = resource_version
    # A new or pruned shard keeps the earlier versions' key, empty: a daemon of an earlier version
    # still running in a rolling upgrade reads it (and so counts no node twice).
    data = dict(base) if base is not None else {SHARD_LEGACY_KEY: "{}"}
    data.update({node: repr(float(when)) for node, when in sorted(nodes.items())})
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def parse_shard(cm: Mapping[str, Any]) -> dict[str, float]:
    """The registrations a shard holds; entries out of shape are skipped (a hand-edited shard can
    at most make the fleet look smaller until the next count, which is the safe direction).

    Reads both formats: one key per node (this version) and the JSON object under `nodes` that
    earlier versions wrote (kept until the next count rewrites the shard)."""
    data = cm.get("data") or {}
    out: dict[str, float] = {}
    raw = data.get(SHARD_LEGACY_KEY)
    if isinstance(raw, str) and raw.lstrip().startswith("{"):
        try:
            items = boundedjson.loads(raw, max_bytes=RECORD_MAX_BYTES, max_depth=2)
        except ValueError:
            items = {}
        if isinstance(items, dict):
            for node, when in list(items.items())[:SHARD_MAX_NODES]:
                if isinstance(node, str) and isinstance(when, (int, float)) \
                        and not isinstance(when, bool) and math.isfinite(when):
                    out[node] = float(when)
    for node, text in list(data.items())[:SHARD_MAX_NODES]:
        if len(out) >= SHARD_MAX_NODES:
            break
        if not isinstance(node, str) or not isinstance(text, str) or len(node) > 253 \
                or len(text) > 32 or (node == SHARD_LEGACY_KEY and text.lstrip().startswith("{")):
            continue
        try:
            when = float(text)
        except ValueError:
            continue
        if math.isfinite(when):
            out[node] = when
    return out


SHARD_LEGACY_KEY = "nodes"  # earlier versions: one JSON object of every registration


# Bounds of a budget record written by screener: no fleet is larger, and the out-of-service set
# holds at most every node of it.
RECORD_MAX_FLEET = 1_000_000
RECORD_MAX_BYTES = 16 * 1024 * 1024
# How far one count may raise the record's fleet above the count before it (the admission
# policy screener-configmaps holds every write to it; budget.py clamps its count to it, and a
# fleet that grew more than this within one count reaches its size over the next counts: a
# smaller budget meanwhile, the safe direction). A record never counted (counted 0) may take
# any size: its first count.
RECORD_MAX_RAISE = 4096


def _record_fleet(text: Any) -> int:
    if not isinstance(text, str) or not re.fullmatch(r"[0-9]{1,7}", text.strip()):
        raise ValueError(f"fleet {str(text)[:40]!r} is not a node count")
    fleet = int(text)
    if fleet > RECORD_MAX_FLEET:
        raise ValueError(f"fleet {fleet} is more than {RECORD_MAX_FLEET} nodes")
    return fleet


def _unix_time(text: Any) -> float:
    try:
        counted = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"counted {str(text)[:40]!r} is not a time") from None
    if not math.isfinite(counted) or counted < 0:
        raise ValueError(f"counted {counted!r} is not a time")
    return counted


def _record_out(text: Any) -> dict[str, dict[str, Any]]:
    if text is None or text == "":
        return {}
    if not isinstance(text, str):
        raise ValueError("outOfService is not a string")
    out = boundedjson.loads(text, max_bytes=RECORD_MAX_BYTES, max_depth=4)
    if not isinstance(out, dict):
        raise ValueError("outOfService is not an object")
    claims: dict[str, dict[str, Any]] = {}
    for node, claim in out.items():
        if not isinstance(claim, dict):
            raise ValueError(f"outOfService[{node!r}] is not an object")
        try:
            state = NodeState(claim.get("state"))
            since_raw: Any = claim.get("since")  # unchecked JSON: float() refuses what is no time
            since = float(since_raw)
        except (TypeError, ValueError):
            raise ValueError(f"outOfService[{node!r}] is not a claim") from None
        if state not in BUDGET_STATES or not math.isfinite(since):
            raise ValueError(f"outOfService[{node!r}] is not a quarantined/repair claim")
        claims[str(node)] = {"state": state.value, "since": since}
    return claims


# --- evidence in the history ------------------------------------------------------------------------

EVIDENCE_BYTES = 2048
_BULK_KEYS = frozenset({"expected", "observed", "evidence"})


def shrink_evidence(evidence: dict[str, Any], limit: int = EVIDENCE_BYTES) -> dict[str, Any]:
    """Fit a transition's evidence into `limit` bytes of JSON for the history annotation.

    Annotations share a 256 KiB budget per object, so the bulk goes (expected/observed values,
    nested evidence, long strings and lists) while identifying fields stay: the alarm's alarm_id,
    a verdict's device, job and tensor, a finding's code, the lemon and budget details.
    """
    if len(json.dumps(evidence)) <= limit:
        return evidence

    def trim(v: Any, depth: int) -> Any:
        if isinstance(v, dict):
            return {k: trim(x, depth + 1) for k, x in v.items() if not (depth >= 1 and k in _BULK_KEYS)}
        if isinstance(v, list):
            return [trim(x, depth + 1) for x in v[:8]]
        if isinstance(v, str) and len(v) > 160:
            return v[:160] + "..."
        return v

    out = trim(evidence, 0)
    out["truncated"] = True
    if len(json.dumps(out)) <= limit:
        return out
    # Still too big: keep only scalars, one level down.
    flat: dict[str, Any] = {"truncated": True}
    for k, v in out.items():
        if isinstance(v, dict):
            flat[k] = {a: b for a, b in v.items() if isinstance(b, (str, int, float, bool, type(None)))}
        elif not isinstance(v, list):
            flat[k] = v
    if len(json.dumps(flat)) <= limit:
        return flat
    return {"truncated": True, "keys": sorted(evidence)[:20]}
