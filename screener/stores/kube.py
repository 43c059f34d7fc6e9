"""KubeStore: node states on the Kubernetes Node objects themselves (the only importer of kubernetes).

What a transition writes (the conventions of DESIGN.md; where each thing lives: kubeformat.py):
  * label `screener.io/state=<state>`, and taint `screener.io/state=<state>:NoSchedule` on every
    state but healthy (replacing our previous taint, keeping everyone else's), with the bounded
    summary annotation `screener.io/history` (the last few transitions), in one patch;
  * the full transition in the node's history ConfigMap in the screener namespace;
  * the quarantine budget (kubebudget.py): a slot claimed when the node leaves the service
    (before its node write) and freed when it rejoins; its registration when it is new;
  * condition `GPUHardwareSuspect` (True for suspect/quarantined/repair) through nodes/status;
  * one Event on the Node (Warning for suspect, quarantined and repair), named after the
    transition's id so a replay cannot post it twice.

The work per transition is a bounded number of requests and bytes whatever the fleet's size:
nothing on the per-event path lists nodes. Lists (always paginated, Node lists metadata-only) are
for fleet-wide commands (`node status`, `lemons`), the cross-check, and the budget record's
count, made by one daemon (its lease) when the record is an hour old.

API calls made (the RBAC in manifests/): nodes get/list/patch, nodes/status patch, events create,
pods list; configmaps get/list/create/update/delete in the screener namespace. Writes carry the
resourceVersion that was read, so a concurrent writer makes ours fail with 409 and we read again
and re-apply: nobody's labels, taints or conditions are lost. Every request has a connect and a
read timeout and every call a deadline (kubecalls.py); transient errors (5xx, 429, connection
failures, timeouts) are retried with backoff within it. A transition is one unit: when any of its
writes still fails (the API out of reach, or conflicts that do not settle), it goes to the spool
and is replayed in order before anything newer is written; each write re-checks the current
objects, so a replay completes a partial write (a node patch whose answer was lost, a missing
registration, condition or Event) and never does one twice.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import logging
import os
import random
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

from screener import boundedjson
from screener._optional import require

require("kubernetes", "the Kubernetes store (--store kube, or auto inside a cluster)")
import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

from screener.settings.stores import in_pod, kubeconfig_path
from screener.errors import ConfigError, ScreenerError
from screener.stores import kubeformat as kf
from screener.stores.kubebudget import FLEET_SHARDS, BudgetView, KubeBudget
from screener.stores.kubecalls import (META_ACCEPT, TRANSIENT_STATUS, ApiCaller,  # noqa: F401
                                       KubeApiError, KubeTimeouts, NodeNotFound, RetryPolicy,
                                       TransientKubeError, missing_namespace)
from screener.stores.kubeconfig import check_kubeconfig, check_loaded
from screener.stores.kubeformat import EVIDENCE_BYTES, shrink_evidence  # noqa: F401 (re-exported)
from screener.lifecycle.records import (ACTOR_HUMAN, ACTOR_SCREENER, BUDGET_STATES, BudgetConflict,
                                        StaleTransition, Transition, json_safe)
from screener.stores.base import summary_row
from screener.stores.paths import default_state_dir
from screener.stores.spool import Spool
from screener.types import (ANNOTATION_HISTORY, ANNOTATION_VERDICT, CONDITION_TYPE, LABEL_STATE,
                            TAINT_SCREENING_KEY, TAINT_STATE_KEY, NodeState, node_name)

log = logging.getLogger(__name__)

T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
GPU_RESOURCE = "nvidia.com/gpu"
WARNING_STATES = frozenset({NodeState.SUSPECT, NodeState.QUARANTINED, NodeState.REPAIR})
DEFAULT_NAMESPACE = "screener-system"


class Superseded(ScreenerError):
    """A spooled transition that a person's later decision on the node replaced: the screener
    decided it on a state the person has since changed, while this daemon could not write."""


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_status(state: NodeState) -> str:
    """GPUHardwareSuspect is True while the node is out of normal service for hardware reasons."""
    return "True" if state in WARNING_STATES else "False"


class KubeStore:
    """A Store on Node objects. Pass an ApiClient (tests point one at a loopback server)."""

    def __init__(self, api_client: Any, *, spool: Optional[Spool] = None,
                 event_namespace: str = "default", namespace: Optional[str] = None,
                 history_limit: int = kf.HISTORY_KEEP, history_bytes: int = kf.HISTORY_BYTES,
                 page_size: int = 500, recount_s: float = 3600.0, claim_grace_s: float = 600.0,
                 retry: RetryPolicy = RetryPolicy(), timeouts: KubeTimeouts = KubeTimeouts(),
                 fleet_shards: int = FLEET_SHARDS,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 rng: Callable[[], float] = random.random, component: str = "screener",
                 instance: Optional[str] = None) -> None:
        """namespace: where the history ConfigMaps and the budget live ($POD_NAMESPACE, else
        screener-system). history_limit/history_bytes bound a node's history ConfigMap.
        page_size: items per page of a list. recount_s: how old the budget record's fleet count
        may get before one daemon counts it again (one paginated list of Node metadata).
        claim_grace_s: how long a count keeps a budget slot whose node does not show the state
        yet (the claimer is between its two writes). timeouts: of every request and call (the
        daemon's `kube_timeouts` table). fleet_shards: how many objects registrations spread
        over (every daemon of a fleet must use the same number)."""
        self.api = kubernetes.client.CoreV1Api(api_client)
        self.spool = spool if spool is not None else Spool(":memory:")
        self.event_namespace = event_namespace
        self.namespace = namespace or os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE
        self.history_limit = history_limit
        self.history_bytes = history_bytes
        self.page_size = page_size
        self.retry, self.timeouts = retry, timeouts
        self.clock, self.sleep, self.rng = clock, sleep, rng
        self.component = component
        self.instance = instance or node_name()
        # False in the daemon's observe mode (observe_only): no screener taint is ever added.
        self.write_taints = True
        self._lock = threading.RLock()
        self.calls = ApiCaller(self.api, self.namespace, api_exception=ApiException, retry=retry,
                               timeouts=timeouts, sleep=sleep, rng=rng, page_size=page_size)
        self._call, self._pages = self.calls.call, self.calls.pages
        self._list_node_meta = self.calls.node_meta
        self._cm_get, self._cm_write = self.calls.cm_get, self.calls.cm_write
        self.budget = KubeBudget(self.calls, instance=self.instance, clock=clock, sleep=sleep,
                                 rng=rng, conflict_attempts=retry.conflict_attempts,
                                 recount_s=recount_s, claim_grace_s=claim_grace_s,
                                 shards=fleet_shards)

    @classmethod
    def from_config(cls, *, kubeconfig: Optional[str] = None, context: Optional[str] = None,
                    spool_path: Optional[os.PathLike[str] | str] = None, **kwargs: Any) -> "KubeStore":
        """Load configuration as kubectl does (screener.settings.stores.kubeconfig_path):
        --kubeconfig, else $KUBECONFIG's files, else ~/.kube/config, else in-cluster inside a
        pod; `context` picks a kubeconfig context. Keyword arguments go to the constructor."""
        cfg = kubernetes.client.Configuration()
        path = kubeconfig_path(str(kubeconfig) if kubeconfig else None)
        in_cluster = path is None and in_pod()
        where = path or ("in-cluster service account" if in_cluster else "no kubeconfig")
        try:
            if path:
                for one in path.split(os.pathsep):
                    check_kubeconfig(one)
                # The path, not the loader's default: that one is read from $KUBECONFIG once,
                # when kubernetes is imported.
                kubernetes.config.load_kube_config(config_file=path, context=context,
                                                   client_configuration=cfg)
            elif in_cluster and not context:
                kubernetes.config.load_incluster_config(client_configuration=cfg)
            else:
                raise ConfigError(
                    f"no kubeconfig has context {context!r} (in-cluster configuration has none)"
                    if in_cluster else "no Kubernetes configuration: no --kubeconfig, $KUBECONFIG "
                    "names no file, no ~/.kube/config and not in a pod")
            check_loaded(cfg, where)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the loader parses hostile text; any failure is
            # the file's: a garbage kubeconfig raises AttributeError, TypeError, KeyError,
            # yaml errors, RecursionError... all one line and exit 2, never a traceback.
            text = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(f"{where}: cannot load Kubernetes configuration: {text}") from e
        # One layer of retries, ours, within the call's deadline: urllib3's own would retry a
        # timed-out GET three more times inside one of our attempts.
        cfg.retries = False
        spool = Spool(spool_path if spool_path is not None else default_state_dir() / "spool.db")
        return cls(kubernetes.client.ApiClient(cfg), spool=spool, **kwargs)

    # --- calling the API --------------------------------------------------------------------

    def _read_node(self, node: str) -> dict[str, Any]:
        try:
            return self._call(f"get node {node}", self.api.read_node, node)
        except KubeApiError as e:
            if e.status == 404:
                raise NodeNotFound(f"node {node!r} does not exist in the cluster") from e
            raise

    def _patch_node(self, node: str, body: Mapping[str, Any], status: bool = False) -> Optional[dict]:
        """Merge-patch the node (or its status); None on 409 (the caller reads again)."""
        fn = self.api.patch_node_status if status else self.api.patch_node
        try:
            return self._call(f"patch node {node}{'/status' if status else ''}", fn, node, dict(body),
                              _content_type=MERGE_PATCH)
        except KubeApiError as e:
            if e.status == 409:
                return None
            if e.status == 404:
                raise NodeNotFound(f"node {node!r} does not exist in the cluster") from e
            raise

    def _update_node(self, node: str, change: Callable[[dict[str, Any]], Optional[dict[str, Any]]],
                     *, status: bool = False, first: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Read-modify-write with the resourceVersion as precondition, re-reading on 409.

        `change(node_obj)` returns the merge patch to send (without resourceVersion), or None when
        there is nothing to write. `first`: a copy of the node just read, used for the first round.
        """
        for _ in range(self.retry.conflict_attempts):
            obj, first = (first if first is not None else self._read_node(node)), None
            body = change(obj)
            if body is None:
                return obj
            body = dict(body)
            body["metadata"] = {**dict(body.get("metadata") or {}),
                                "resourceVersion": obj["metadata"]["resourceVersion"]}
            result = self._patch_node(node, body, status=status)
            if result is not None:
                return result
            log.info("node %s changed under us (409); reading it again", node)
        raise KubeApiError(f"node {node}: still conflicting after {self.retry.conflict_attempts} "
                           "read-modify-write rounds", 409)

    # --- Store protocol ---------------------------------------------------------------------

    def get_state(self, node: str) -> Optional[NodeState]:
        pending = self.spool.entries(node)
        if pending:
            return pending[-1][1].to_state
        return _state_of(self._read_node(node))

    def record(self, transition: Transition) -> None:
        """Write now, or spool (after retries) and write later in order. Never drops a transition."""
        self._record(transition)

    def _record(self, transition: Transition, node_obj: Optional[dict[str, Any]] = None,
                cm: Any = ..., view: Optional[BudgetView] = None) -> bool:
        """record(), reusing objects just read; True when written now, False when spooled."""
        with self._lock:
            if len(self.spool):
                self.spool.append(transition)
                self.replay()
                return False
            try:
                self._write(transition, check_from=True, node_obj=node_obj, cm=cm, view=view)
                return True
            except TransientKubeError as e:
                self.spool.append(transition)
                log.warning("transition of %s to %s spooled (%d waiting): %s", transition.node,
                            transition.to_state.value, len(self.spool), e)
                return False

    def replay(self) -> int:
        """Write spooled transitions oldest first; stop at the first that still cannot be written.

        Returns how many were written. Call it periodically (the daemon does); record() also does.
        """
        done = 0
        superseded: set[str] = set()
        with self._lock:
            for seq, t in self.spool.entries():
                if t.node in superseded and not t.failure:
                    # Decided after the superseded one, on the state it led to: stale as well.
                    log.error("dropping spooled transition %s of %s: an earlier one of the node was "
                              "superseded by a person's decision", t.id, t.node)
                    self.spool.remove(seq)
                    continue
                try:
                    self._write(t, check_from=False)
                except TransientKubeError as e:
                    log.info("replay stopped, API still unavailable: %s", e)
                    break
                except (NodeNotFound, Superseded) as e:
                    # The node was deleted meanwhile, or a person decided about it after this was
                    # spooled: nothing to write it onto, or writing it would undo the person's
                    # decision; and keeping it would block every later transition behind it.
                    log.error("dropping spooled transition %s of %s: %s", t.id, t.node, e)
                    self.spool.remove(seq)
                    if isinstance(e, Superseded):
                        superseded.add(t.node)
                    continue
                # Other errors (RBAC, validation) propagate and keep the entry: a person must fix them.
                self.spool.remove(seq)
                done += 1
        if done:
            log.info("replayed %d spooled transition(s)", done)
        return done

    def pending(self) -> int:
        """How many transitions wait in the spool."""
        return len(self.spool)

    def history(self, node: str, since: Optional[float] = None) -> list[Transition]:
        obj = self._read_node(node)
        return self._history_from(node, obj, self._history_cm(node), since)

    def _history_from(self, node: str, obj: Mapping[str, Any], cm: Optional[Mapping[str, Any]],
                      since: Optional[float] = None) -> list[Transition]:
        on_node, _ = kf.parse_node_history(_annotation(obj, ANNOTATION_HISTORY), node)
        items = _transitions(kf.merge_entries(kf.history_entries(cm), on_node), node)
        return _merge_pending(items, [t for _, t in self.spool.entries(node)], since)

    def all_states(self) -> dict[str, NodeState]:
        """Every node with a screener state: one paginated, label-selected list of Node metadata."""
        out: dict[str, NodeState] = {}
        for obj in self._list_node_meta(LABEL_STATE):
            state = _state_of(obj)
            if state is not None:
                out[obj["metadata"]["name"]] = state
        for _, t in self.spool.entries():
            out[t.node] = t.to_state
        return dict(sorted(out.items()))

    def summaries(self) -> list[dict[str, Any]]:
        """State and last transition of every node, from one paginated list of Node metadata."""
        rows: dict[str, dict[str, Any]] = {}
        for obj in self._list_node_meta(LABEL_STATE):
            name = obj["metadata"]["name"]
            state = _state_of(obj)
            if state is None:
                continue
            entries, _ = kf.parse_node_history(_annotation(obj, ANNOTATION_HISTORY), name)
            rows[name] = summary_row(name, state, entries[-1] if entries else None)
        for _, t in self.spool.entries():
            rows[t.node] = summary_row(t.node, t.to_state, t.to_dict())
        return [rows[n] for n in sorted(rows)]

    def failures(self, since: float) -> list[Transition]:
        """Failures of every node at or after `since`: one paginated list of the history
        ConfigMaps, and one of Node metadata for nodes whose history is still in the old
        annotation format. Linear in the fleet (for `lemons`, the failure-rate estimate)."""
        entries: dict[str, dict[str, Any]] = {}
        for cm in self._pages(f"list configmaps in {self.namespace}",
                              self.api.list_namespaced_config_map, self.namespace,
                              label_selector=kf.LABEL_HISTORY):
            for e in kf.history_entries(cm):
                if e.get("failure"):
                    entries.setdefault(str(e["id"]), e)
        for obj in self._list_node_meta(LABEL_STATE):
            on_node, legacy = kf.parse_node_history(_annotation(obj, ANNOTATION_HISTORY),
                                                    obj["metadata"]["name"])
            for e in on_node if legacy else ():
                if e.get("failure"):
                    entries.setdefault(str(e["id"]), e)
        items = [t for t in _transitions(entries.values()) if t.time >= since]
        merged = _merge_pending(items, [t for _, t in self.spool.entries()], since)
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
        items = [t for t in _transitions(entries.values()) if t.time >= since]
        pending = [t for _, t in self.spool.entries()
                   if t.failure and wanted & set(t.gpu_serials)]
        return sorted(_merge_pending(items, pending, since), key=lambda t: t.time)

    @contextmanager
    def begin(self, node: str) -> Iterator["KubeTxn"]:
        """One read-decide-write of `node` against the budget (see NodeTxn)."""
        with self._lock:
            yield KubeTxn(self, node)


    def set_verdict(self, node: str, verdict: Mapping[str, Any]) -> None:
        self.set_annotations(node, {ANNOTATION_VERDICT: json.dumps(json_safe(dict(verdict)),
                                                                   sort_keys=True)})

    def get_verdict(self, node: str) -> Optional[dict[str, Any]]:
        raw = (self._read_node(node)["metadata"].get("annotations") or {}).get(ANNOTATION_VERDICT)
        if not raw:
            return None
        try:
            data = boundedjson.strict(raw)
        except ValueError:
            data = None
        # Anyone who may edit the Node may write it: what is not an object is unparsable.
        return data if isinstance(data, dict) else {"unparsable": raw[:200]}

    def close(self) -> None:
        self.spool.close()
        self.api.api_client.close()

    # --- what the daemon needs besides the protocol -----------------------------------------

    def get_node(self, node: str) -> dict[str, Any]:
        """The Node object as plain JSON (labels, annotations, taints, providerID, conditions)."""
        return self._read_node(node)

    def node_annotations(self, node: str) -> dict[str, str]:
        return dict(self._read_node(node)["metadata"].get("annotations") or {})

    def annotations_by_node(self, key: str, label_selector: str = "") -> dict[str, str]:
        """The value of annotation `key` on every node that has it (e.g. peers' KAT digests)."""
        out = {}
        for obj in self._list_node_meta(label_selector):
            value = (obj["metadata"].get("annotations") or {}).get(key)
            if value is not None:
                out[obj["metadata"]["name"]] = value
        return out

    def set_annotations(self, node: str, values: Mapping[str, Optional[str]]) -> None:
        """Set (or, with None, remove) our annotations; a merge patch leaves all others alone."""
        if self._patch_node(node, {"metadata": {"annotations": dict(values)}}) is None:
            raise KubeApiError(f"node {node}: unexpected conflict setting annotations", 409)

    def observe_only(self) -> None:
        """From now on add no taint of ours (the daemon's observe mode, issue 24.2): transitions
        still write the label, annotations, history, condition and Event, and a state taint left
        from an enforcing run is removed, so the taints never disagree with the mode."""
        self.write_taints = False

    def set_screening_taint(self, node: str, on: bool) -> None:
        """Add or remove `screener.io/screening=true:NoSchedule` (only during an idle-time screen;
        in observe mode only ever removed)."""
        on = on and self.write_taints

        def change(obj: dict[str, Any]) -> Optional[dict[str, Any]]:
            taints = list((obj.get("spec") or {}).get("taints") or [])
            others = [t for t in taints if t.get("key") != TAINT_SCREENING_KEY]
            new = others + ([{"key": TAINT_SCREENING_KEY, "value": "true", "effect": "NoSchedule"}]
                            if on else [])
            return None if new == taints else {"spec": {"taints": new}}

        self._update_node(node, change)

    def gpu_pods(self, node: str) -> list[dict[str, Any]]:
        """Pods on the node that request GPUs and have not finished: name, namespace, phase, gpus."""
        data = self._call(f"list pods on {node}", self.api.list_pod_for_all_namespaces,
                          field_selector=f"spec.nodeName={node}")
        out = []
        for pod in (data or {}).get("items") or []:
            phase = (pod.get("status") or {}).get("phase") or ""
            if phase in ("Succeeded", "Failed"):
                continue
            gpus = _gpus_requested(pod.get("spec") or {})
            if gpus:
                out.append({"name": pod["metadata"]["name"],
                            "namespace": pod["metadata"].get("namespace", ""), "phase": phase,
                            "gpus": gpus})
        return out

    # --- writing one transition -------------------------------------------------------------

    def _write(self, t: Transition, *, check_from: bool, node_obj: Optional[dict[str, Any]] = None,
               cm: Any = ..., view: Optional[BudgetView] = None) -> None:
        """Node (label, taint, summary) first, then the rest of the unit: the history ConfigMap,
        the budget (registration, slot), the condition and the Event. Each step re-checks the
        current objects, so a replay after a partial write completes it; and once the node is
        written, a failure of the rest is transient (TransientKubeError: spooled, replayed), never
        a transition left half-written."""
        if cm is ...:
            cm = self._history_cm(t.node)
        entry = self._entry(t)
        cm_ids = {e["id"] for e in kf.history_entries(cm)}
        seen: dict[str, Any] = {}

        def change_node(obj: dict[str, Any]) -> Optional[dict[str, Any]]:
            on_node, legacy = kf.parse_node_history(_annotation(obj, ANNOTATION_HISTORY), t.node)
            seen.update(on_node=on_node, legacy=legacy, done=False)
            if t.id in cm_ids or any(e["id"] == t.id for e in on_node):
                seen["done"] = True
                return None  # written before (a replay after a partial write)
            stored = _state_of(obj)
            seen["stored"] = stored
            if not check_from and stored != t.from_state:
                _refuse_superseded(t, stored, on_node)
            if check_from and stored != t.from_state:
                raise StaleTransition(
                    f"node {t.node}: transition {_name(t.from_state)} -> {t.to_state.value} not "
                    f"recorded: the node is {_name(stored)} now")
            taints = list((obj.get("spec") or {}).get("taints") or [])
            taints = [x for x in taints if x.get("key") != TAINT_STATE_KEY]
            if t.to_state != NodeState.HEALTHY and self.write_taints:
                taints.append({"key": TAINT_STATE_KEY, "value": t.to_state.value,
                               "effect": "NoSchedule"})
            summary = kf.summary_annotation(kf.merge_entries(on_node, [entry]))
            return {"metadata": {"labels": {LABEL_STATE: t.to_state.value},
                                 "annotations": {ANNOTATION_HISTORY: summary}},
                    "spec": {"taints": taints}}

        obj = self._update_node(t.node, change_node, first=node_obj)
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
        self._append_history(t.node, entry, cm, on_node)
        self._sync_budget(t, view)

        def change_status(obj: dict[str, Any]) -> Optional[dict[str, Any]]:
            conditions = list((obj.get("status") or {}).get("conditions") or [])
            old = next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)
            status = condition_status(t.to_state)
            cond = {"type": CONDITION_TYPE, "status": status,
                    "reason": t.code or "StateChanged",
                    "message": f"{t.to_state.value}: {t.reason}"[:1024],
                    "lastHeartbeatTime": _iso(self.clock()),
                    "lastTransitionTime": (old.get("lastTransitionTime") if old and
                                           old.get("status") == status and old.get("lastTransitionTime")
                                           else _iso(t.time))}
            rest = [c for c in conditions if c.get("type") != CONDITION_TYPE]
            # Merge patch replaces the list, so send all conditions; the resourceVersion makes it safe.
            return {"status": {"conditions": rest + [cond]}}

        # The status write must not reorder history: only write it when this transition is the
        # node's latest (a replayed older one must not overwrite a newer condition).
        latest, _ = kf.parse_node_history(_annotation(obj, ANNOTATION_HISTORY), t.node)
        if not latest or latest[-1].get("id") == t.id:
            self._update_node(t.node, change_status, status=True, first=obj)
        self._event(t, obj)

    def _entry(self, t: Transition) -> dict[str, Any]:
        d = t.to_dict()
        d["evidence"] = shrink_evidence(d["evidence"])
        return d

    def _history_cm(self, node: str) -> Optional[dict[str, Any]]:
        return self._cm_get(kf.history_configmap_name(node))

    def _append_history(self, node: str, entry: dict[str, Any], cm: Optional[dict[str, Any]],
                        on_node: list[dict[str, Any]]) -> None:
        for _ in range(self.retry.conflict_attempts):
            have = kf.history_entries(cm)
            ids = {e["id"] for e in have}
            missing = [e for e in on_node + [entry] if e["id"] not in ids]
            if not missing:
                return
            merged = kf.merge_entries(have, [entry], on_node)
            rv = (cm or {}).get("metadata", {}).get("resourceVersion") if cm else None
            body = kf.history_configmap(node, merged, namespace=self.namespace, resource_version=rv,
                                        keep=self.history_limit, max_bytes=self.history_bytes)
            if self._cm_write(body) is not None:
                return
            cm = self._history_cm(node)
        raise KubeApiError(f"history of {node}: still conflicting after "
                           f"{self.retry.conflict_attempts} rounds", 409)

    def _migrate(self, node: str, entries: list[dict[str, Any]], cm: Optional[dict[str, Any]]) -> None:
        """Move an old-format history annotation into the node's ConfigMap, leave the summary."""
        self._append_history(node, entries[-1], cm, entries)

        def change(obj: dict[str, Any]) -> Optional[dict[str, Any]]:
            on_node, legacy = kf.parse_node_history(_annotation(obj, ANNOTATION_HISTORY), node)
            if not legacy:
                return None
            return {"metadata": {"annotations": {ANNOTATION_HISTORY: kf.summary_annotation(on_node)}}}

        self._update_node(node, change)
        log.info("node %s: history moved from the Node annotation to ConfigMap %s/%s", node,
                 self.namespace, kf.history_configmap_name(node))

    # --- the quarantine budget (kubebudget.py) ----------------------------------------------

    def ledger(self) -> BudgetView:
        """The budget as it stands (fleet, out, counted): one list; counted again when stale."""
        return self.budget.view()

    def _sync_budget(self, t: Transition, view: Optional[BudgetView]) -> None:
        """After t's node write: register a new node, and make the slots agree with t. Every
        step is idempotent, so a replay after a partial write completes it."""
        into = t.to_state in BUDGET_STATES
        if t.from_state is not None and not into and t.from_state not in BUDGET_STATES:
            return  # healthy/burnin/suspect moves leave the budget alone
        view = view if view is not None else self.budget.view()
        if t.from_state is None:
            self.budget.register(view, t.node, t.time)
        if into and not view.claims_of(t.node):
            # Claimed before the node write when decided through begin(); here for a transition
            # recorded without one (or a claim a count freed meanwhile): it is decided already.
            self.budget.claim(view, t.node, t.to_state, limit=None)
        elif not into and t.node in view.out:
            self.budget.release(view, t.node)

    def _release_unless_out(self, node: str) -> None:
        """Free the node's slot unless its label says it is out (after a claim whose node write
        was refused)."""
        try:
            state = _state_of(self._read_node(node))
        except NodeNotFound:
            state = None
        if state not in BUDGET_STATES:
            self.budget.release(self.budget.view(), node)

    def _event(self, t: Transition, node_obj: dict[str, Any]) -> None:
        now = _iso(self.clock())
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{t.node}.screener.{t.id}", "namespace": self.event_namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": t.node,
                               "uid": node_obj["metadata"].get("uid", t.node)},
            "reason": t.code or "StateChanged",
            "message": f"{_name(t.from_state)} -> {t.to_state.value} by {t.actor}: {t.reason}"[:1024],
            "type": "Warning" if t.to_state in WARNING_STATES else "Normal",
            "source": {"component": self.component, "host": self.instance},
            "reportingComponent": f"screener.io/{self.component}",
            "reportingInstance": self.instance,
            "firstTimestamp": _iso(t.time), "lastTimestamp": now, "count": 1,
        }
        try:
            self._call(f"create event for {t.node}", self.api.create_namespaced_event,
                       self.event_namespace, body)
        except KubeApiError as e:
            if e.status == 404:
                raise KubeApiError(missing_namespace(self.event_namespace, "the Node Events"),
                                   404) from e
            if e.status != 409:  # 409: AlreadyExists, posted by an earlier attempt
                raise


# --- parsing Node objects -------------------------------------------------------------------------


def _name(state: Optional[NodeState]) -> str:
    return state.value if state else "(new)"


def _refuse_superseded(t: Transition, stored: Optional[NodeState],
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
        raise Superseded(f"node {t.node}: {_name(t.from_state)} -> {t.to_state.value} not "
                         f"written: a person set it {_name(stored)} afterwards "
                         f"({latest.get('reason') or 'no reason given'})")


def _state_of(obj: Mapping[str, Any]) -> Optional[NodeState]:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_STATE)
    try:
        return NodeState(value) if value else None
    except ValueError:
        log.warning("node %s: ignoring unknown %s label %r", obj.get("metadata", {}).get("name"),
                    LABEL_STATE, value)
        return None


def _annotation(obj: Mapping[str, Any], key: str) -> Optional[str]:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(key)


def _transitions(entries: Any, node: str = "") -> list[Transition]:
    out = []
    for item in entries:
        try:
            out.append(Transition.from_dict(item))
        except ValueError as e:
            log.warning("node %s: skipping a history entry: %s", item.get("node") or node, e)
    return out


def _merge_pending(written: list[Transition], pending: list[Transition],
                   since: Optional[float]) -> list[Transition]:
    seen = {t.id for t in written}
    items = written + [t for t in pending if t.id not in seen]
    return [t for t in items if since is None or t.time >= since]


class KubeTxn:
    """The NodeTxn of KubeStore: the node, its history and the budget, read once.

    The budget holds exactly however many decide at once: a transition that takes the node out of
    service automatically is written only after it has claimed a free slot below the limit it was
    decided under (kubebudget.py); when none is left, BudgetConflict makes apply_event decide
    again on fresh counts (the node is then held in suspect, tainted at once).
    """

    def __init__(self, store: KubeStore, node: str) -> None:
        self._store, self.node = store, node
        self._obj = store._read_node(node)
        self._cm = store._history_cm(node)
        self._view = store.budget.view()
        pending = store.spool.entries(node)
        labelled = _state_of(self._obj)
        self.state: Optional[NodeState] = pending[-1][1].to_state if pending else labelled
        self.history = store._history_from(node, self._obj, self._cm)
        self.fleet_total = self._view.fleet + (0 if labelled is not None or pending else 1)
        self.out_of_service = self._view.others_out(node)

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        return self._store.failures_for(serials, since)

    def commit(self, transitions: Sequence[Transition]) -> None:
        store = self._store
        if not transitions:
            # A node still carrying the old long history annotation moves it off the Node the
            # first time its daemon looks (at start-up: rolling out this version migrates the
            # fleet, one node per daemon), so the per-GPU lookup finds its failures too.
            on_node, legacy = kf.parse_node_history(_annotation(self._obj, ANNOTATION_HISTORY),
                                                    self.node)
            if legacy and on_node:
                store._migrate(self.node, on_node, self._cm)
            return
        first = True
        for t in transitions:
            if t.node != self.node:
                raise ValueError(f"a decision about {self.node} cannot record a transition of {t.node}")
            claimed = False
            if (t.to_state in BUDGET_STATES and t.from_state not in BUDGET_STATES
                    and not self._view.claims_of(self.node)):
                # An automatic decision claims below the limit it was made under; a person's is
                # not limited by the budget, but counts for others before the node leaves service.
                limit = _decided_limit(t, self._view) if t.actor == ACTOR_SCREENER else None
                self._view = store.budget.claim(self._view, self.node, t.to_state, limit)
                claimed = True
            try:
                store._record(t, node_obj=copy.deepcopy(self._obj) if first else None,
                              cm=self._cm if first else ..., view=self._view)
            except StaleTransition:
                if claimed:
                    store._release_unless_out(self.node)
                raise
            first = False


def _decided_limit(t: Transition, view: BudgetView) -> int:
    """The budget limit the lifecycle decided `t` under (its evidence carries it); without it,
    only the next slot: exact, though claims then queue."""
    for key in ("budget", "released_by_budget"):
        figures = t.evidence.get(key)
        if isinstance(figures, dict):
            limit = figures.get("limit")
            if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0:
                return limit
    return view.others_out(t.node) + 1


def _gpus_requested(spec: Mapping[str, Any]) -> int:
    total = 0
    for c in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(GPU_RESOURCE)
        try:
            total += int(value or 0)
        except (TypeError, ValueError):
            pass
    return total
