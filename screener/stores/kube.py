"""KubeStore: node states on the Kubernetes Node objects themselves (the only importer of kubernetes).

What a transition writes (the conventions of DESIGN.md):
  * label `screener.io/state=<state>`, and taint `screener.io/state=<state>:NoSchedule` on every
    state but healthy (replacing our previous taint, keeping everyone else's);
  * annotation `screener.io/history`: a bounded JSON list of transitions (newest last), which is also
    where history and lemon counts are read back from;
  * condition `GPUHardwareSuspect` (True for suspect/quarantined/repair) through nodes/status;
  * one Event on the Node (Warning for suspect, quarantined and repair), named after the
    transition's id so a replay cannot post it twice.

Only these API calls are made (the RBAC the DaemonSet needs): nodes get/list/patch, nodes/status
patch, events create, pods list. Writes are merge patches carrying the resourceVersion that was
read, so a concurrent writer makes ours fail with 409 and we read again and re-apply: nobody's
labels, taints or conditions are lost. Transient errors (5xx, 429, connection failures) are retried
with exponential backoff (sleep injectable); a transition that still cannot be written goes to the
spool and is replayed in order before anything newer is written.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, TypeVar

import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException

from screener import configs
from screener.errors import BadInputError, ConfigError, ExternalServiceError
from screener.stores.base import StaleTransition, Transition, _json_safe
from screener.stores.spool import Spool
from screener.types import (ANNOTATION_HISTORY, ANNOTATION_VERDICT, CONDITION_TYPE, LABEL_STATE,
                            TAINT_SCREENING_KEY, TAINT_STATE_KEY, NodeState)

log = logging.getLogger(__name__)

T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
GPU_RESOURCE = "nvidia.com/gpu"
WARNING_STATES = frozenset({NodeState.SUSPECT, NodeState.QUARANTINED, NodeState.REPAIR})
TRANSIENT_STATUS = frozenset({0, 429, 500, 502, 503, 504})


class KubeApiError(ExternalServiceError):
    """The Kubernetes API failed or refused a request (after retries, for transient errors)."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


class TransientKubeError(KubeApiError):
    """The API stayed unreachable or kept answering 5xx/429 through every retry."""


class NodeNotFound(BadInputError):
    """No Node of that name exists in the cluster."""


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for transient errors and the bound on 409 re-reads. Unknown keys are an error."""

    attempts: int = 5  # tries per API call for transient errors
    base_delay: float = 0.2  # seconds before the first retry; doubles each time
    max_delay: float = 5.0
    jitter: float = 0.5  # each delay is scaled by a random factor in [1 - jitter, 1]
    conflict_attempts: int = 10  # read-modify-write rounds before giving up on 409s

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.conflict_attempts < 1:
            raise ConfigError("retry attempts must be >= 1")
        if self.base_delay < 0 or self.max_delay < 0 or not 0 <= self.jitter <= 1:
            raise ConfigError("retry delays must be >= 0 and jitter within [0, 1]")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "RetryPolicy":
        return configs.from_mapping(cls, d, "kube retry")

    def delay(self, attempt: int, rng: Callable[[], float]) -> float:
        d = min(self.max_delay, self.base_delay * (2 ** attempt))
        return d * (1 - self.jitter * rng())


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_status(state: NodeState) -> str:
    """GPUHardwareSuspect is True while the node is out of normal service for hardware reasons."""
    return "True" if state in WARNING_STATES else "False"


class KubeStore:
    """A Store on Node objects. Pass an ApiClient (tests point one at a loopback server)."""

    def __init__(self, api_client: Any, *, spool: Optional[Spool] = None,
                 event_namespace: str = "default", history_limit: int = 50,
                 history_bytes: int = 64 * 1024, retry: RetryPolicy = RetryPolicy(),
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 rng: Callable[[], float] = random.random, component: str = "screener",
                 instance: Optional[str] = None) -> None:
        self.api = kubernetes.client.CoreV1Api(api_client)
        self.spool = spool if spool is not None else Spool(":memory:")
        self.event_namespace = event_namespace
        self.history_limit = history_limit
        self.history_bytes = history_bytes
        self.retry = retry
        self.clock, self.sleep, self.rng = clock, sleep, rng
        self.component = component
        self.instance = instance or os.environ.get("NODE_NAME") or os.uname().nodename
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, *, kubeconfig: Optional[str] = None, context: Optional[str] = None,
                    spool_path: Optional[os.PathLike[str] | str] = None, **kwargs: Any) -> "KubeStore":
        """Load configuration: --kubeconfig if given, else in-cluster when running in a pod, else
        $KUBECONFIG or ~/.kube/config."""
        from screener.stores import default_state_dir

        cfg = kubernetes.client.Configuration()
        try:
            if kubeconfig:
                kubernetes.config.load_kube_config(config_file=str(kubeconfig), context=context,
                                                   client_configuration=cfg)
            elif os.environ.get("KUBERNETES_SERVICE_HOST"):
                kubernetes.config.load_incluster_config(client_configuration=cfg)
            else:
                kubernetes.config.load_kube_config(context=context, client_configuration=cfg)
        except (kubernetes.config.ConfigException, OSError, ValueError, TypeError) as e:
            where = kubeconfig or ("in-cluster service account" if os.environ.get(
                "KUBERNETES_SERVICE_HOST") else os.environ.get("KUBECONFIG") or "~/.kube/config")
            raise ConfigError(f"{where}: cannot load Kubernetes configuration: {e}") from e
        spool = Spool(spool_path if spool_path is not None else default_state_dir() / "spool.db")
        return cls(kubernetes.client.ApiClient(cfg), spool=spool, **kwargs)

    # --- calling the API --------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the API and return the parsed JSON body; retry transient errors with backoff."""
        kwargs["_preload_content"] = False
        last: Optional[BaseException] = None
        for attempt in range(self.retry.attempts):
            if attempt:
                self.sleep(self.retry.delay(attempt - 1, self.rng))
            try:
                resp = fn(*args, **kwargs)
                data = resp.data
                return json.loads(data) if data else None
            except ApiException as e:
                if e.status in TRANSIENT_STATUS:
                    last = e
                    log.info("%s: transient API error %s (attempt %d)", what, e.status, attempt + 1)
                    continue
                raise KubeApiError(f"{what}: Kubernetes API answered {e.status} {e.reason}: "
                                   f"{_message(e)}", e.status) from e
            except (urllib3.exceptions.HTTPError, OSError) as e:
                last = e
                log.info("%s: API unreachable: %s (attempt %d)", what, e, attempt + 1)
        brief = (f"{last.status} {last.reason}: {_message(last)}" if isinstance(last, ApiException)
                 else str(last))
        raise TransientKubeError(f"{what}: Kubernetes API unavailable after {self.retry.attempts} "
                                 f"attempts: {brief}") from last

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
                     *, status: bool = False) -> dict[str, Any]:
        """Read-modify-write with the resourceVersion as precondition, re-reading on 409.

        `change(node_obj)` returns the merge patch to send (without resourceVersion), or None when
        there is nothing to write.
        """
        for _ in range(self.retry.conflict_attempts):
            obj = self._read_node(node)
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
        with self._lock:
            if len(self.spool):
                self.spool.append(transition)
                self.replay()
                return
            try:
                self._write(transition, check_from=True)
            except TransientKubeError as e:
                self.spool.append(transition)
                log.warning("transition of %s to %s spooled (%d waiting): %s", transition.node,
                            transition.to_state.value, len(self.spool), e)

    def replay(self) -> int:
        """Write spooled transitions oldest first; stop at the first that still cannot be written.

        Returns how many were written. Call it periodically (the daemon does); record() also does.
        """
        done = 0
        with self._lock:
            for seq, t in self.spool.entries():
                try:
                    self._write(t, check_from=False)
                except TransientKubeError as e:
                    log.info("replay stopped, API still unavailable: %s", e)
                    break
                except NodeNotFound as e:
                    # The node was deleted meanwhile: there is nothing left to write this onto, and
                    # keeping it would block every later transition behind it.
                    log.error("dropping spooled transition %s of %s: %s", t.id, t.node, e)
                    self.spool.remove(seq)
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
        items = _history_of(self._read_node(node))
        return _merge_pending(items, [t for _, t in self.spool.entries(node)], since)

    def all_states(self) -> dict[str, NodeState]:
        out: dict[str, NodeState] = {}
        for obj in self._list_nodes(LABEL_STATE):
            state = _state_of(obj)
            if state is not None:
                out[obj["metadata"]["name"]] = state
        for _, t in self.spool.entries():
            out[t.node] = t.to_state
        return dict(sorted(out.items()))

    def failures(self, since: float) -> list[Transition]:
        items: list[Transition] = []
        for obj in self._list_nodes(LABEL_STATE):
            items.extend(_history_of(obj))
        merged = _merge_pending(items, [t for _, t in self.spool.entries()], since)
        return sorted((t for t in merged if t.failure), key=lambda t: t.time)

    def set_verdict(self, node: str, verdict: Mapping[str, Any]) -> None:
        self.set_annotations(node, {ANNOTATION_VERDICT: json.dumps(_json_safe(dict(verdict)),
                                                                   sort_keys=True)})

    def get_verdict(self, node: str) -> Optional[dict[str, Any]]:
        raw = (self._read_node(node)["metadata"].get("annotations") or {}).get(ANNOTATION_VERDICT)
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"unparsable": raw[:200]}

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
        for obj in self._list_nodes(label_selector):
            value = (obj["metadata"].get("annotations") or {}).get(key)
            if value is not None:
                out[obj["metadata"]["name"]] = value
        return out

    def set_annotations(self, node: str, values: Mapping[str, Optional[str]]) -> None:
        """Set (or, with None, remove) our annotations; a merge patch leaves all others alone."""
        if self._patch_node(node, {"metadata": {"annotations": dict(values)}}) is None:
            raise KubeApiError(f"node {node}: unexpected conflict setting annotations", 409)

    def set_screening_taint(self, node: str, on: bool) -> None:
        """Add or remove `screener.io/screening=true:NoSchedule` (only during an idle-time screen)."""
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

    def _write(self, t: Transition, *, check_from: bool) -> None:
        entry = self._entry(t)

        def change_node(obj: dict[str, Any]) -> Optional[dict[str, Any]]:
            history = _raw_history(obj)
            if any(h.get("id") == t.id for h in history):
                return None  # written before (a replay after a partial write)
            stored = _state_of(obj)
            if check_from and stored != t.from_state:
                raise StaleTransition(
                    f"node {t.node}: transition {_name(t.from_state)} -> {t.to_state.value} not "
                    f"recorded: the node is {_name(stored)} now")
            taints = list((obj.get("spec") or {}).get("taints") or [])
            taints = [x for x in taints if x.get("key") != TAINT_STATE_KEY]
            if t.to_state != NodeState.HEALTHY:
                taints.append({"key": TAINT_STATE_KEY, "value": t.to_state.value,
                               "effect": "NoSchedule"})
            return {"metadata": {"labels": {LABEL_STATE: t.to_state.value},
                                 "annotations": {ANNOTATION_HISTORY: self._bounded(history + [entry])}},
                    "spec": {"taints": taints}}

        obj = self._update_node(t.node, change_node)

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
        latest = _raw_history(obj)[-1:] if obj else []
        if not latest or latest[0].get("id") == t.id:
            self._update_node(t.node, change_status, status=True)
        self._event(t, obj)

    def _entry(self, t: Transition) -> dict[str, Any]:
        d = t.to_dict()
        d["evidence"] = shrink_evidence(d["evidence"])
        return d

    def _bounded(self, history: list[dict[str, Any]]) -> str:
        history = history[-self.history_limit:]
        text = json.dumps(history, separators=(",", ":"), sort_keys=True)
        while len(history) > 1 and len(text) > self.history_bytes:
            history = history[1:]
            text = json.dumps(history, separators=(",", ":"), sort_keys=True)
        return text

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
            if e.status != 409:  # 409: AlreadyExists, posted by an earlier attempt
                raise

    def _list_nodes(self, label_selector: str = "") -> list[dict[str, Any]]:
        data = self._call("list nodes", self.api.list_node, label_selector=label_selector)
        return list((data or {}).get("items") or [])


# --- parsing Node objects -------------------------------------------------------------------------


def _name(state: Optional[NodeState]) -> str:
    return state.value if state else "(new)"


def _message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body).get("message"))
    except (TypeError, ValueError, AttributeError):
        return str(e.body)[:200] if e.body else ""


def _state_of(obj: Mapping[str, Any]) -> Optional[NodeState]:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_STATE)
    try:
        return NodeState(value) if value else None
    except ValueError:
        log.warning("node %s: ignoring unknown %s label %r", obj.get("metadata", {}).get("name"),
                    LABEL_STATE, value)
        return None


def _raw_history(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_HISTORY)
    if not raw:
        return []
    try:
        items = json.loads(raw)
    except ValueError:
        log.warning("node %s: %s annotation is not JSON; starting a new history",
                    obj.get("metadata", {}).get("name"), ANNOTATION_HISTORY)
        return []
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _history_of(obj: Mapping[str, Any]) -> list[Transition]:
    out = []
    for item in _raw_history(obj):
        try:
            out.append(Transition.from_dict(item))
        except ValueError as e:
            log.warning("node %s: skipping a history entry: %s", obj.get("metadata", {}).get("name"), e)
    return out


def _merge_pending(written: list[Transition], pending: list[Transition],
                   since: Optional[float]) -> list[Transition]:
    seen = {t.id for t in written}
    items = written + [t for t in pending if t.id not in seen]
    return [t for t in items if since is None or t.time >= since]


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
