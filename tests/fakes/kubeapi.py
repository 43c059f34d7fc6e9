"""A small Kubernetes API server for tests: nodes, nodes/status, events and pods over real HTTP.

Why our own: kmock (the maintained PyPI mock) merges every patch as plain dicts, has no strategic
merge or resourceVersion conflicts, and needs aiohttp; the official client must be tested against
the real wire protocol. This server speaks it for the handful of resources screener touches:

  GET    /api/v1/nodes[?labelSelector=..][&limit=&continue=][&watch=true]   list / watch
  GET    /api/v1/nodes/NAME                                 get
  PATCH  /api/v1/nodes/NAME[/status]                        json-patch, merge-patch, strategic-merge
  PUT    /api/v1/nodes/NAME[/status]                        update (resourceVersion required)
  POST   /api/v1/namespaces/NS/events                       create (409 if the name exists)
  GET    /api/v1/pods, /api/v1/namespaces/NS/pods           list (fieldSelector spec.nodeName=)
  GET    /api/v1/namespaces/NS/configmaps[?labelSelector=..][&limit=&continue=]   list
  GET|PUT|PATCH|DELETE /api/v1/namespaces/NS/configmaps/NAME, POST .../configmaps
                                                            (DELETE honours preconditions uid /
                                                            resourceVersion: 409 on a mismatch)
  GET    /apis/resource.k8s.io/v1/resourceslices[?fieldSelector=spec.nodeName=..,spec.driver=..]
         [&labelSelector=..][&limit=&continue=], .../resourceslices/NAME     list / get
  POST   /apis/resource.k8s.io/v1/devicetaintrules          create (409 AlreadyExists; the body
                                                            validated against the published 1.37
                                                            schema, strict: 422 when it fails)
  GET    /apis/resource.k8s.io/v1/devicetaintrules[?labelSelector=..][&limit=&continue=], .../NAME
  DELETE /apis/resource.k8s.io/v1/devicetaintrules/NAME     (preconditions uid / resourceVersion)

Semantics kept from the real API server: a global resourceVersion that increases on every write; a
PATCH or PUT that carries a stale metadata.resourceVersion gets 409 Conflict (nodes and
configmaps; a ConfigMap PUT without one is an unconditional update), a POST of an existing name
409 AlreadyExists; writes to the node ignore .status and writes to nodes/status change only
.status; strategic merge merges status.conditions and status.addresses by `type` and replaces
other lists (spec.taints has no merge key); lists page with limit/continue in name order (with
metadata.remainingItemCount when no selector is given); a node list asked for with
`Accept: application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1` returns only
metadata; a configmap list asked for `as=Table` returns a meta.k8s.io/v1 Table with the columns
kubectl prints (Name, Data, Age) and, per row, the object as includeObject says (None, Metadata: the
default, or Object); label selectors take `k=v`, `k!=v`, `k` and `!k`; Status objects as error bodies. A list
with resourceVersion=0 is served "from the cache", as kube-apiserver (through v1.32) serves it:
any version, `limit` ignored, everything in one page without a continue token (Call.cached records
it).

DRA (resource.k8s.io/v1, as Kubernetes 1.37 serves it): ResourceSlices are cluster-scoped and
listed with the field selectors spec.nodeName and spec.driver (any other field is 400, as the real
server refuses it); a DeviceTaintRule create gets metadata.uid, resourceVersion, creationTimestamp
and, when its taint has none, spec.taint.timeAdded, as the API server sets them; its name must be
a DNS subdomain and its taint's effect None, NoSchedule or NoExecute. add_resource_slice() is the
DRA driver publishing a node's devices (validated against the same schema). A Call of a group
other than the core one names it in `group`.

Test controls: fail_next(n, status) answers the next n requests with an error, conflict_next(n)
answers the next n writes with 409, down()/up() stop and restart listening on the same port,
mutate() changes a node as another controller would, slow() delays answers (after the state was
read, outside the server's lock, so racing clients really do read the same version), and `calls`
records every request as (verb, resource, subresource) with its request and response bytes, for
RBAC checks and benchmarks. Use as a context manager:

    with KubeAPI() as api:
        api.add_node("gpu-1")
        client = api.api_client()        # a kubernetes.client.ApiClient pointed at it
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterable, Optional
from urllib.parse import parse_qs, unquote, urlparse


@dataclass(frozen=True)
class Call:
    """One request as RBAC sees it: verb (get/list/watch/create/update/patch/delete), resource,
    subresource ("" for none), plus name and namespace for assertions."""

    verb: str
    resource: str
    subresource: str = ""
    name: str = ""
    namespace: str = ""
    status: int = 0
    request_bytes: int = 0
    response_bytes: int = 0
    server_seconds: float = 0.0  # time the server spent answering (its own work, not the client's)
    cached: bool = False  # a list served from the cache (resourceVersion=0)
    agent: str = ""  # the client's User-Agent (benchmarks set one per simulated daemon)
    group: str = ""  # the API group ("" for the core group, e.g. "resource.k8s.io")
    kind: str = ""  # the kind of the answer's body ("ConfigMapList", "Table", "Status", ...)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


# The Kubernetes version whose published OpenAPI schemas (kubernetes-validate) bodies are checked
# against: 1.37 is the first to serve resource.k8s.io/v1 DeviceTaintRules.
SCHEMA_VERSION = "1.37.0"


def validate_published(obj: dict[str, Any], kind: str = "", api: str = "") -> None:
    """Validate `obj` against the published strict schema of its kind (or `kind` in group-version
    file part `api`, e.g. "deleteoptions", "meta-v1": a kind kubernetes-validate does not look
    up by apiVersion); ApiError 422 naming the first problem."""
    import kubernetes_validate
    import kubernetes_validate.utils

    try:
        if not kind:
            kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
            return
        import jsonschema
        from referencing import Registry, Resource

        base = f"kubernetes-json-schema/v{SCHEMA_VERSION}-local-strict"
        schema = kubernetes_validate.utils.schema_contents(f"{base}/{kind}-{api}.json",
                                                           SCHEMA_VERSION)
        defs = kubernetes_validate.utils.schema_contents(f"{base}/_definitions.json",
                                                         SCHEMA_VERSION)
        registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
        jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(obj)
    except Exception as e:  # noqa: BLE001 - a schema's ValidationError, or jsonschema's
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ApiError(422, "Invalid", f"the body does not meet the {SCHEMA_VERSION} schema: "
                                       f"{first}") from None


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DRA_GROUP = "resource.k8s.io"
# The field selectors the API server supports on ResourceSlices (besides metadata.name).
SLICE_FIELDS = ("spec.nodeName", "spec.driver", "metadata.name")


# --- patch semantics ------------------------------------------------------------------------------

# Lists that strategic merge patch merges by key (from the Kubernetes Node/Pod types).
MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type",
              ("metadata", "ownerReferences"): "uid"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Kubernetes strategic merge patch, for the fields a Node has (see MERGE_KEYS)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):  # $setElementOrder/..., $retainKeys, $deleteFromPrimitiveList/...
            continue
        sub = path + (k,)
        if v is None:
            result.pop(k, None)
        elif isinstance(v, list) and sub in MERGE_KEYS:
            key = MERGE_KEYS[sub]
            items = [copy.deepcopy(x) for x in (result.get(k) or [])]
            for item in v:
                if not isinstance(item, dict) or key not in item:
                    raise ApiError(422, "Invalid", f"{'.'.join(sub)}: element lacks merge key {key}")
                idx = next((i for i, x in enumerate(items) if x.get(key) == item[key]), None)
                if item.get("$patch") == "delete":
                    if idx is not None:
                        items.pop(idx)
                elif idx is None:
                    items.append({a: b for a, b in item.items() if not a.startswith("$")})
                else:
                    items[idx] = strategic_merge_patch(items[idx], item, sub)
            result[k] = items
        else:
            result[k] = strategic_merge_patch(result.get(k), v, sub)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, test, move, copy."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json patch must be a list of operations")
    doc = copy.deepcopy(doc)

    def parent(parts: list[str]) -> tuple[Any, str]:
        cur = doc
        for p in parts[:-1]:
            if isinstance(cur, list):
                cur = cur[int(p)]
            elif isinstance(cur, dict) and p in cur:
                cur = cur[p]
            else:
                raise ApiError(422, "Invalid", f"path /{'/'.join(parts)} does not exist")
        return cur, parts[-1]

    def get(parts: list[str]) -> Any:
        cur = doc
        for p in parts:
            try:
                cur = cur[int(p)] if isinstance(cur, list) else cur[p]
            except (KeyError, IndexError, ValueError, TypeError):
                raise ApiError(422, "Invalid", f"path /{'/'.join(parts)} does not exist") from None
        return cur

    def add(parts: list[str], value: Any) -> None:
        nonlocal doc
        if not parts:
            doc = value
            return
        obj, last = parent(parts)
        if isinstance(obj, list):
            obj.insert(len(obj) if last == "-" else int(last), value)
        else:
            obj[last] = value

    def remove(parts: list[str]) -> Any:
        obj, last = parent(parts)
        try:
            return obj.pop(int(last)) if isinstance(obj, list) else obj.pop(last)
        except (KeyError, IndexError, ValueError):
            raise ApiError(422, "Invalid", f"path /{'/'.join(parts)} does not exist") from None

    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        if kind == "add":
            add(parts, copy.deepcopy(op["value"]))
        elif kind == "remove":
            remove(parts)
        elif kind == "replace":
            get(parts)
            remove(parts)
            add(parts, copy.deepcopy(op["value"]))
        elif kind == "test":
            if get(parts) != op.get("value"):
                raise ApiError(422, "Invalid", f"test of {op['path']} failed")
        elif kind == "move":
            add(parts, remove(_pointer(op["from"])))
        elif kind == "copy":
            add(parts, copy.deepcopy(get(_pointer(op["from"]))))
        else:
            raise ApiError(400, "BadRequest", f"unknown json patch op {kind!r}")
    return doc


def _table(page: list[dict[str, Any]], meta: dict[str, Any], include: str) -> dict[str, Any]:
    """A configmap list as the API server converts it for `Accept: ...;as=Table`."""
    if include not in ("None", "Metadata", "Object"):
        raise ApiError(400, "BadRequest", f'includeObject: Unsupported value: "{include}": supported '
                       'values: "None", "Metadata", "Object"')
    columns = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0},
               {"name": "Data", "type": "string", "format": "", "description": "", "priority": 0},
               {"name": "Age", "type": "string", "format": "", "description": "", "priority": 0}]
    rows = []
    for cm in page:
        obj: Any = None
        if include == "Metadata":
            obj = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                   "metadata": copy.deepcopy(cm["metadata"])}
        elif include == "Object":
            obj = copy.deepcopy(cm)
        rows.append({"cells": [cm["metadata"]["name"],
                               len(cm.get("data") or {}) + len(cm.get("binaryData") or {}), "0s"],
                     "object": obj})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
            "columnDefinitions": columns, "rows": rows}


def _match_labels(labels: dict[str, str], selector: str) -> bool:
    for key, op, val in _selector_terms(selector):
        if op == "exists":
            if key not in labels:
                return False
        elif op == "!exists":
            if key in labels:
                return False
        elif (labels.get(key) == val) != (op != "!="):
            return False
    return True


@functools.lru_cache(maxsize=256)
def _selector_terms(selector: str) -> tuple[tuple[str, str, str], ...]:
    """A label selector parsed once (a list filters thousands of objects with it)."""
    out = []
    for term in filter(None, (s.strip() for s in selector.split(","))):
        m = re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(\S*)", term)
        if m:
            out.append((m.group(1), m.group(2), m.group(3)))
        elif term.startswith("!"):
            out.append((term[1:], "!exists", ""))
        else:
            out.append((term, "exists", ""))
    return tuple(out)


# --- the server -----------------------------------------------------------------------------------


class KubeAPI:
    """The test server. Thread-safe; all state is plain JSON-like dicts."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backlog: int = 256) -> None:
        self.host, self.port, self.backlog = host, port, backlog
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.configmaps: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> object
        self.resource_slices: dict[str, dict[str, Any]] = {}  # name -> ResourceSlice
        self.device_taint_rules: dict[str, dict[str, Any]] = {}  # name -> DeviceTaintRule
        # Every DeviceTaintRule write the server took: (operation, object, oldObject) as an
        # admission policy sees it (the body as sent on CREATE; the object as stored on DELETE).
        self.dra_writes: list[tuple[str, Optional[dict[str, Any]], Optional[dict[str, Any]]]] = []
        # The namespaces that exist; None: every one does. When a set, a create in any other is
        # 404 'namespaces "NS" not found', as the API server answers (a get or list there is the
        # usual 404 or empty list).
        self.namespaces: Optional[set[str]] = None
        self.calls: list[Call] = []
        self._slow: list[tuple[Optional[str], Optional[str], float]] = []  # (verb, resource, s)
        self._rv = 100
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._watch_log: list[tuple[int, str, dict[str, Any]]] = []  # (rv, type, object)
        # (status, verb, subresource, resource)
        self._fail: list[tuple[int, Optional[str], Optional[str], Optional[str]]] = []
        self._sneak: list[Callable[[dict[str, Any]], None]] = []
        self._conflicts = 0
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> "KubeAPI":
        api = self

        class Handler(_Handler):
            server_api = api

        class Server(ThreadingHTTPServer):
            request_queue_size = api.backlog  # the default 5 makes racing clients wait a 1 s SYN retry

        self._server = Server((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="kubeapi")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            self._changed.notify_all()

    def down(self) -> None:
        """Stop listening: clients get connection refused until up()."""
        self.stop()

    def up(self) -> None:
        """Listen again on the same port."""
        deadline = time.monotonic() + 5
        while True:
            try:
                self.start()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def is_up(self) -> bool:
        return self._server is not None

    def __enter__(self) -> "KubeAPI":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- clients ----------------------------------------------------------------------------

    def configuration(self) -> Any:
        """A kubernetes.client.Configuration pointed at this server (no retries inside urllib3,
        so tests see each failure)."""
        import kubernetes.client

        cfg = kubernetes.client.Configuration()
        cfg.host = self.url
        cfg.retries = False
        return cfg

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient talking to this server."""
        import kubernetes.client

        return kubernetes.client.ApiClient(self.configuration())

    def write_kubeconfig(self, path: Path | str, namespace: str = "default") -> Path:
        """A kubeconfig file for this server (for --kubeconfig in CLI tests)."""
        path = Path(path)
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                      "namespace": namespace}}],
        }))
        return path

    # --- fixtures and controls --------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def add_node(self, name: str, *, labels: Optional[dict[str, str]] = None,
                 annotations: Optional[dict[str, str]] = None,
                 taints: Optional[list[dict[str, Any]]] = None,
                 conditions: Optional[list[dict[str, Any]]] = None,
                 provider_id: Optional[str] = None) -> dict[str, Any]:
        with self._lock:
            node: dict[str, Any] = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": dict(labels or {}),
                             "annotations": dict(annotations or {}),
                             "creationTimestamp": "2026-01-01T00:00:00Z",
                             "resourceVersion": self._next_rv()},
                "spec": {"taints": list(taints or [])},
                "status": {"conditions": list(conditions or [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady",
                     "message": "kubelet is posting ready status",
                     "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                     "lastTransitionTime": "2026-01-01T00:00:00Z"}])},
            }
            if provider_id:
                node["spec"]["providerID"] = provider_id
            self.nodes[name] = node
            self._notify("ADDED", node)
            return copy.deepcopy(node)

    def add_pod(self, name: str, node: str, *, namespace: str = "default", gpus: int = 1,
                phase: str = "Running") -> dict[str, Any]:
        res = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
        with self._lock:
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                                "resourceVersion": self._next_rv()},
                   "spec": {"nodeName": node,
                            "containers": [{"name": "main", "image": "x", "resources": res}]},
                   "status": {"phase": phase}}
            self.pods.append(pod)
            return copy.deepcopy(pod)

    def add_resource_slice(self, node: str, devices: list[dict[str, Any]], *,
                           driver: str = "gpu.nvidia.com", pool: Optional[str] = None,
                           generation: int = 1, name: Optional[str] = None) -> dict[str, Any]:
        """The DRA driver on `node` publishing `devices` (spec.devices[] as the driver writes
        them: name, attributes {"uuid": {"string": ...}}, capacity) in pool `pool` (default: the
        node's name, as node-local drivers such as NVIDIA's name it)."""
        with self._lock:
            obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                   "metadata": {"name": name or f"{node}-{driver}-{len(self.resource_slices)}",
                                "uid": str(uuid.uuid4()), "resourceVersion": self._next_rv(),
                                "creationTimestamp": "2026-01-01T00:00:00Z"},
                   "spec": {"driver": driver, "nodeName": node,
                            "pool": {"name": pool or node, "generation": generation,
                                     "resourceSliceCount": 1},
                            "devices": copy.deepcopy(devices)}}
            validate_published(obj)
            self.resource_slices[obj["metadata"]["name"]] = obj
            return copy.deepcopy(obj)

    def device_taint_rule(self, name: str) -> Optional[dict[str, Any]]:
        with self._lock:
            rule = self.device_taint_rules.get(name)
            return copy.deepcopy(rule) if rule is not None else None

    def node(self, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self.nodes[name])

    def mutate(self, name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Change a node as another controller would (bumps its resourceVersion)."""
        with self._lock:
            change(self.nodes[name])
            self.nodes[name]["metadata"]["resourceVersion"] = self._next_rv()
            self._notify("MODIFIED", self.nodes[name])
            return copy.deepcopy(self.nodes[name])

    def fail_next(self, n: int = 1, status: int = 500, verb: Optional[str] = None,
                  subresource: Optional[str] = None, resource: Optional[str] = None) -> None:
        """Answer the next n requests (only those of `verb` / `subresource` / `resource`, if
        given) with `status`."""
        with self._lock:
            self._fail.extend([(status, verb, subresource, resource)] * n)

    def on_next_write(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Just before the next PATCH/PUT of a node is applied, let another writer change the node
        (bumping its resourceVersion): the write then meets a real concurrent update."""
        with self._lock:
            self._sneak.append(change)

    def conflict_next(self, n: int = 1) -> None:
        """Answer the next n PATCH/PUT requests with 409, as if another writer had just written."""
        with self._lock:
            self._conflicts += n

    def slow(self, seconds: float, verb: Optional[str] = None,
             resource: Optional[str] = None) -> None:
        """Hold every answer to `verb` on `resource` (None: any) for `seconds` after the state was
        read, outside the lock: a slow API server under which concurrent readers see one version."""
        with self._lock:
            self._slow = [x for x in self._slow if (x[0], x[1]) != (verb, resource)]
            if seconds > 0:
                self._slow.append((verb, resource, seconds))

    def configmap(self, namespace: str, name: str) -> Optional[dict[str, Any]]:
        with self._lock:
            cm = self.configmaps.get((namespace, name))
            return copy.deepcopy(cm) if cm is not None else None

    def delete_configmaps(self, namespace: Optional[str] = None) -> None:
        """Remove ConfigMaps (of one namespace, or all), as a person's kubectl delete would."""
        with self._lock:
            for key in [k for k in self.configmaps if namespace is None or k[0] == namespace]:
                del self.configmaps[key]

    def clear_calls(self) -> None:
        with self._lock:
            self.calls.clear()

    def verbs(self) -> set[tuple[str, str, str]]:
        """The distinct (verb, resource, subresource) triples seen so far."""
        with self._lock:
            return {(c.verb, c.resource, c.subresource) for c in self.calls}

    def _notify(self, kind: str, obj: dict[str, Any]) -> None:
        self._watch_log.append((int(obj["metadata"]["resourceVersion"]), kind, copy.deepcopy(obj)))
        self._changed.notify_all()

    # --- request handling (called from handler threads) -------------------------------------

    def handle(self, method: str, path: str, query: dict[str, list[str]], headers: Any,
               body: bytes) -> tuple[int, Any, Optional[Iterable[bytes]]]:
        """Return (status, JSON body, or a streaming iterator for watch)."""
        parts = [unquote(p) for p in path.strip("/").split("/")]
        q = {k: v[-1] for k, v in query.items()}
        call = self._route(method, parts, q)
        with self._lock:
            started = time.perf_counter()  # its own work, not the wait for the lock
            if self._fail and self._fail[0][1] in (None, call.verb) and \
                    self._fail[0][2] in (None, call.subresource) and \
                    self._fail[0][3] in (None, call.resource):
                status = self._fail.pop(0)[0]
                out = status_body(status, "InternalError" if status >= 500 else "Error",
                                  f"scripted failure {status}")
                self.calls.append(Call(call.verb, call.resource, call.subresource, call.name,
                                       call.namespace, status, len(body), len(json.dumps(out)),
                                       agent=headers.get("User-Agent") or "", group=call.group))
                return status, out, None
            try:
                code, out, stream = self._dispatch(call, method, q, headers, body)
            except ApiError as e:
                code, out, stream = e.code, status_body(e.code, e.reason, e.message), None
            data = json.dumps(out).encode() if stream is None else b""
            self.calls.append(Call(call.verb, call.resource, call.subresource, call.name,
                                   call.namespace, code, len(body), len(data),
                                   time.perf_counter() - started,
                                   cached=call.verb == "list" and q.get("resourceVersion") == "0",
                                   agent=headers.get("User-Agent") or "", group=call.group,
                                   kind=str(out.get("kind") or "") if isinstance(out, dict) else ""))
            delay = max([d for v, r, d in self._slow if v in (None, call.verb)
                         and r in (None, call.resource)], default=0.0)
        if delay:
            time.sleep(delay)
        return code, (data if stream is None else out), stream

    def _route(self, method: str, parts: list[str], q: dict[str, str]) -> Call:
        verb = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete"}.get(method, method.lower())
        group = ""
        if parts[:1] == ["apis"] and len(parts) >= 4 and parts[1] == DRA_GROUP and parts[2] == "v1":
            group, rest = DRA_GROUP, parts[3:]
        elif parts[:2] != ["api", "v1"]:
            return Call(verb, "/" + "/".join(parts))
        else:
            rest = parts[2:]
        ns = ""
        if len(rest) >= 2 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        resource = rest[0] if rest else ""
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        if verb == "get" and not name:
            verb = "watch" if (q.get("watch") or "").lower() in ("true", "1") else "list"
        return Call(verb, resource, sub, name, ns, group=group)

    def _dispatch(self, call: Call, method: str, q: dict[str, str], headers: Any,
                  body: bytes) -> tuple[int, Any, Optional[Iterable[bytes]]]:
        if call.group == DRA_GROUP:
            return self._dra(call, q, body)
        if call.resource == "nodes":
            if call.verb == "list":
                items = [n for n in self.nodes.values()
                         if _match_labels(n["metadata"].get("labels") or {}, q.get("labelSelector", ""))]
                meta_only = "as=PartialObjectMetadataList" in (headers.get("Accept") or "")
                page, meta = self._page(items, q)
                if meta_only:
                    return 200, {"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": meta,
                                 "items": [{"kind": "PartialObjectMetadata",
                                            "apiVersion": "meta.k8s.io/v1",
                                            "metadata": copy.deepcopy(n["metadata"])} for n in page]}, None
                return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": meta,
                             "items": [copy.deepcopy(n) for n in page]}, None
            if call.verb == "watch":
                return 200, None, self._watch(q)
            if call.name not in self.nodes:
                raise ApiError(404, "NotFound", f'nodes "{call.name}" not found')
            if call.verb == "get" and call.subresource in ("", "status"):
                return 200, copy.deepcopy(self.nodes[call.name]), None
            if call.verb in ("patch", "update") and call.subresource in ("", "status"):
                return 200, self._write_node(call, headers, body), None
        if call.verb == "create" and call.namespace and self.namespaces is not None \
                and call.namespace not in self.namespaces:
            raise ApiError(404, "NotFound", f'namespaces "{call.namespace}" not found')
        if call.resource == "configmaps" and call.namespace:
            return self._configmaps(call, q, headers, body)
        if call.resource == "events" and call.verb == "create":
            return 201, self._create_event(call.namespace, body), None
        if call.resource == "pods" and call.verb == "list":
            fs = q.get("fieldSelector", "")
            want = dict(t.split("=", 1) for t in fs.split(",") if "=" in t)
            items = [copy.deepcopy(p) for p in self.pods
                     if (not call.namespace or p["metadata"]["namespace"] == call.namespace)
                     and all(_field(p, k) == v.lstrip("=") for k, v in want.items())]
            return 200, {"kind": "PodList", "apiVersion": "v1",
                         "metadata": {"resourceVersion": str(self._rv)}, "items": items}, None
        raise ApiError(404, "NotFound", f"the server could not find the requested resource "
                                        f"({call.verb} {call.resource} {call.subresource})")

    def _page(self, items: list[dict[str, Any]], q: dict[str, str]) -> tuple[list[dict[str, Any]],
                                                                           dict[str, Any]]:
        """limit/continue paging in name order (a continue token is the last name, opaque)."""
        items = sorted(items, key=lambda o: o["metadata"]["name"])
        meta: dict[str, Any] = {"resourceVersion": str(self._rv)}
        token = q.get("continue") or ""
        if token:
            try:
                after = base64.urlsafe_b64decode(token.encode()).decode()
            except (ValueError, UnicodeDecodeError):
                raise ApiError(400, "BadRequest", "invalid continue token") from None
            items = [o for o in items if o["metadata"]["name"] > after]
        try:
            limit = int(q.get("limit") or 0)
        except ValueError:
            raise ApiError(400, "BadRequest", f"invalid limit {q.get('limit')!r}") from None
        if q.get("resourceVersion") == "0":
            limit = 0  # served from the watch cache, which (through v1.32) ignores limit
        if limit > 0 and len(items) > limit:
            page = items[:limit]
            meta["continue"] = base64.urlsafe_b64encode(page[-1]["metadata"]["name"].encode()).decode()
            if not q.get("labelSelector") and not q.get("fieldSelector"):
                meta["remainingItemCount"] = len(items) - limit
            return page, meta
        return items, meta

    def _configmaps(self, call: Call, q: dict[str, str], headers: Any,
                    body: bytes) -> tuple[int, Any, None]:
        ns, name = call.namespace, call.name
        if call.verb == "list":
            items = [cm for (n, _), cm in self.configmaps.items() if n == ns and
                     _match_labels(cm["metadata"].get("labels") or {}, q.get("labelSelector", ""))]
            page, meta = self._page(items, q)
            if "as=Table" in (headers.get("Accept") or ""):
                return 200, _table(page, meta, q.get("includeObject") or "Metadata"), None
            return 200, {"kind": "ConfigMapList", "apiVersion": "v1", "metadata": meta,
                         "items": [copy.deepcopy(c) for c in page]}, None
        if call.verb == "create":
            obj = _json_object(body)
            meta = obj.setdefault("metadata", {})
            if not meta.get("name"):
                raise ApiError(422, "Invalid", "metadata.name: Required value")
            if meta.get("namespace") not in (None, "", ns):
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the URL")
            if (ns, meta["name"]) in self.configmaps:
                raise ApiError(409, "AlreadyExists", f'configmaps "{meta["name"]}" already exists')
            if meta.get("resourceVersion"):
                raise ApiError(422, "Invalid", "metadata.resourceVersion: must be empty on create")
            return 201, self._store_configmap(ns, meta["name"], obj, None), None
        current = self.configmaps.get((ns, name))
        if current is None:
            raise ApiError(404, "NotFound", f'configmaps "{name}" not found')
        if call.verb == "get":
            return 200, copy.deepcopy(current), None
        if call.verb == "delete":
            pre = (json.loads(body or b"{}") or {}).get("preconditions") or {}
            for key, have in (("uid", current["metadata"]["uid"]),
                              ("resourceVersion", current["metadata"]["resourceVersion"])):
                if pre.get(key) is not None and str(pre[key]) != have:
                    what = "UID" if key == "uid" else "ResourceVersion"
                    raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on configmaps '
                                   f'"{name}": Precondition failed: {what} in precondition: '
                                   f'{pre[key]}, {what} in object meta: {have}')
            del self.configmaps[(ns, name)]
            return 200, status_body(200, "", "deleted") | {"status": "Success"}, None
        if call.verb in ("update", "patch"):
            data = _json_object(body)
            ctype = (headers.get("Content-Type") or "").split(";")[0].strip()
            if call.verb == "patch" and ctype not in ("application/merge-patch+json",
                                                      "application/strategic-merge-patch+json"):
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch content type {ctype!r}")
            sent_rv = (data.get("metadata") or {}).get("resourceVersion")
            if sent_rv is not None and str(sent_rv) != current["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on configmaps "{name}": '
                               "the object has been modified; please apply your changes to the latest "
                               "version and try again")
            new = data if call.verb == "update" else merge_patch(current, data)
            if (new.get("metadata") or {}).get("name", name) != name:
                raise ApiError(400, "BadRequest", "the name of the object does not match the URL")
            return 200, self._store_configmap(ns, name, new, current), None
        raise ApiError(405, "MethodNotAllowed", f"{call.verb} configmaps")

    def _dra(self, call: Call, q: dict[str, str], body: bytes) -> tuple[int, Any, None]:
        """resource.k8s.io/v1: ResourceSlices (read) and DeviceTaintRules (create, get, list,
        delete), cluster-scoped both."""
        if call.namespace:
            raise ApiError(404, "NotFound", f"{call.resource} are cluster-scoped")
        if call.resource == "resourceslices":
            if call.verb == "list":
                want: dict[str, str] = {}
                for term in filter(None, (q.get("fieldSelector") or "").split(",")):
                    key, eq, value = term.partition("=")
                    if not eq or key not in SLICE_FIELDS or value.startswith("="):
                        raise ApiError(400, "BadRequest", f'"{key}" is not a known field selector: '
                                       f'only "{", ".join(SLICE_FIELDS)}"')
                    want[key] = value
                items = [sl for sl in self.resource_slices.values()
                         if all(_field(sl, k) == v for k, v in want.items())
                         and _match_labels(sl["metadata"].get("labels") or {},
                                           q.get("labelSelector", ""))]
                page, meta = self._page(items, q)
                return 200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                             "metadata": meta, "items": [copy.deepcopy(x) for x in page]}, None
            if call.verb == "get" and call.name in self.resource_slices:
                return 200, copy.deepcopy(self.resource_slices[call.name]), None
            if call.verb == "get":
                raise ApiError(404, "NotFound", f'resourceslices.resource.k8s.io "{call.name}" not found')
        if call.resource != "devicetaintrules" or call.subresource:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource "
                                            f"({call.verb} {call.resource})")
        rules = self.device_taint_rules
        what = f'devicetaintrules.resource.k8s.io "{call.name}"'
        if call.verb == "list":
            items = [r for r in rules.values()
                     if _match_labels(r["metadata"].get("labels") or {}, q.get("labelSelector", ""))]
            page, meta = self._page(items, q)
            return 200, {"kind": "DeviceTaintRuleList", "apiVersion": "resource.k8s.io/v1",
                         "metadata": meta, "items": [copy.deepcopy(x) for x in page]}, None
        if call.verb == "create":
            obj = _json_object(body)
            validate_published(obj)
            meta = obj.setdefault("metadata", {})
            name = meta.get("name") or ""
            if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
                raise ApiError(422, "Invalid", f"metadata.name: Invalid value: {name!r}: a "
                                               "lowercase RFC 1123 subdomain must consist of ...")
            if meta.get("resourceVersion"):
                raise ApiError(422, "Invalid", "metadata.resourceVersion: must be empty on create")
            taint = (obj.get("spec") or {}).get("taint") or {}
            if taint.get("effect") not in ("None", "NoSchedule", "NoExecute"):
                raise ApiError(422, "Invalid", f"spec.taint.effect: Unsupported value: "
                                               f"{taint.get('effect')!r}")
            if name in rules:
                raise ApiError(409, "AlreadyExists", f"{what} already exists")
            self.dra_writes.append(("CREATE", copy.deepcopy(obj), None))
            taint.setdefault("timeAdded", "2026-01-01T00:00:00Z")
            meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(),
                        creationTimestamp="2026-01-01T00:00:00Z", generation=1)
            obj["apiVersion"], obj["kind"] = "resource.k8s.io/v1", "DeviceTaintRule"
            rules[name] = obj
            return 201, copy.deepcopy(obj), None
        current = rules.get(call.name)
        if current is None:
            raise ApiError(404, "NotFound", f"{what} not found")
        if call.verb == "get":
            return 200, copy.deepcopy(current), None
        if call.verb == "delete":
            options = json.loads(body or b"{}") or {}
            validate_published(options, "deleteoptions", "meta-v1")
            pre = options.get("preconditions") or {}
            for key, have in (("uid", current["metadata"]["uid"]),
                              ("resourceVersion", current["metadata"]["resourceVersion"])):
                if pre.get(key) is not None and str(pre[key]) != have:
                    label = "UID" if key == "uid" else "ResourceVersion"
                    raise ApiError(409, "Conflict", f"Operation cannot be fulfilled on {what}: "
                                   f"Precondition failed: {label} in precondition: {pre[key]}, "
                                   f"{label} in object meta: {have}")
            del rules[call.name]
            self.dra_writes.append(("DELETE", None, copy.deepcopy(current)))
            return 200, copy.deepcopy(current), None
        raise ApiError(405, "MethodNotAllowed", f"{call.verb} devicetaintrules")

    def _store_configmap(self, ns: str, name: str, obj: dict[str, Any],
                         current: Optional[dict[str, Any]]) -> dict[str, Any]:
        data = obj.get("data") or {}
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ApiError(422, "Invalid", "data: values must be strings")
        if sum(len(k) + len(v) for k, v in data.items()) > 1024 * 1024:
            raise ApiError(422, "Invalid", "data: Too long: must have at most 1048576 bytes")
        for k, v in ((obj.get("metadata") or {}).get("labels") or {}).items():
            if not isinstance(v, str) or len(v) > 63 or len(k.rpartition("/")[2]) > 63:
                raise ApiError(422, "Invalid", f"metadata.labels: invalid label {k}={v!r}")
        meta = copy.deepcopy(obj.get("metadata") or {})
        meta.update(name=name, namespace=ns, resourceVersion=self._next_rv(),
                    uid=current["metadata"]["uid"] if current else str(uuid.uuid4()),
                    creationTimestamp=(current["metadata"]["creationTimestamp"] if current
                                       else "2026-01-01T00:00:00Z"))
        stored = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                  "data": copy.deepcopy(data)}
        self.configmaps[(ns, name)] = stored
        return copy.deepcopy(stored)

    def _write_node(self, call: Call, headers: Any, body: bytes) -> dict[str, Any]:
        try:
            data = json.loads(body or b"null")
        except ValueError as e:
            raise ApiError(400, "BadRequest", f"body is not JSON: {e}") from None
        if self._sneak:
            self.mutate(call.name, self._sneak.pop(0))
        current = self.nodes[call.name]
        if self._conflicts:
            self._conflicts -= 1
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on nodes "{call.name}": '
                           "the object has been modified; please apply your changes to the latest "
                           "version and try again")
        ctype = (headers.get("Content-Type") or "").split(";")[0].strip()
        if call.verb == "update":
            if not isinstance(data, dict):
                raise ApiError(400, "BadRequest", "update body must be an object")
            new = data
            sent_rv = (data.get("metadata") or {}).get("resourceVersion")
            if not sent_rv:
                raise ApiError(422, "Invalid", "metadata.resourceVersion: must be specified for an update")
        elif ctype == "application/json-patch+json":
            new = json_patch(current, data)
            sent_rv = new["metadata"].get("resourceVersion")
            if sent_rv == current["metadata"]["resourceVersion"]:
                sent_rv = None  # untouched by the patch: no precondition
        elif ctype == "application/merge-patch+json":
            if not isinstance(data, dict):
                raise ApiError(400, "BadRequest", "merge patch body must be an object")
            sent_rv = (data.get("metadata") or {}).get("resourceVersion")
            new = merge_patch(current, data)
        elif ctype == "application/strategic-merge-patch+json":
            if not isinstance(data, dict):
                raise ApiError(400, "BadRequest", "strategic merge patch body must be an object")
            sent_rv = (data.get("metadata") or {}).get("resourceVersion")
            new = strategic_merge_patch(current, data)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"unsupported patch content type {ctype!r}")
        if sent_rv is not None and str(sent_rv) != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on nodes "{call.name}": '
                           "the object has been modified; please apply your changes to the latest "
                           "version and try again")
        result = copy.deepcopy(current)
        if call.subresource == "status":
            result["status"] = copy.deepcopy(new.get("status") or {})
        else:
            meta = copy.deepcopy(new.get("metadata") or {})
            for fixed in ("name", "uid", "creationTimestamp"):
                meta[fixed] = current["metadata"][fixed]
            result["metadata"] = meta
            result["spec"] = copy.deepcopy(new.get("spec") or {})
        _validate_node(result)
        result["metadata"]["resourceVersion"] = self._next_rv()
        self.nodes[call.name] = result
        self._notify("MODIFIED", result)
        return copy.deepcopy(result)

    def _create_event(self, namespace: str, body: bytes) -> dict[str, Any]:
        ev = json.loads(body or b"{}")
        meta = ev.setdefault("metadata", {})
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            else:
                raise ApiError(422, "Invalid", "metadata.name: Required value")
        if meta.get("namespace") and meta["namespace"] != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the object does not match the URL")
        meta["namespace"] = namespace
        if any(e["metadata"]["name"] == meta["name"] and e["metadata"]["namespace"] == namespace
               for e in self.events):
            raise ApiError(409, "AlreadyExists", f'events "{meta["name"]}" already exists')
        if not ev.get("involvedObject"):
            raise ApiError(422, "Invalid", "involvedObject: Required value")
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = self._next_rv()
        self.events.append(ev)
        return copy.deepcopy(ev)

    def _watch(self, q: dict[str, str]) -> Iterable[bytes]:
        """Events after resourceVersion (or ADDED for all nodes), until timeoutSeconds pass."""
        timeout = float(q.get("timeoutSeconds") or 2)
        since = int(q.get("resourceVersion") or 0)
        selector = q.get("labelSelector", "")
        if since == 0:
            backlog = [(int(n["metadata"]["resourceVersion"]), "ADDED", copy.deepcopy(n))
                       for n in self.nodes.values()]
            since = self._rv
        else:
            backlog = [e for e in self._watch_log if e[0] > since]
            since = max([since] + [e[0] for e in backlog])

        def stream() -> Iterable[bytes]:
            nonlocal since
            pending = list(backlog)
            deadline = time.monotonic() + timeout
            while True:
                for _, kind, obj in pending:
                    if obj.get("kind") == "Node" and _match_labels(
                            obj["metadata"].get("labels") or {}, selector):
                        yield (json.dumps({"type": kind, "object": obj}) + "\n").encode()
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_up:
                    return
                with self._changed:
                    self._changed.wait(min(left, 0.2))
                    pending = [e for e in self._watch_log if e[0] > since]
                    if pending:
                        since = max(e[0] for e in pending)

        return stream()


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"null")
    except ValueError as e:
        raise ApiError(400, "BadRequest", f"body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "BadRequest", "body must be an object")
    return data


def _field(obj: dict[str, Any], dotted: str) -> Any:
    cur: Any = obj
    for p in dotted.split("."):
        cur = cur.get(p) if isinstance(cur, dict) else None
    return cur


def _validate_node(node: dict[str, Any]) -> None:
    """The checks the real API server makes that our writes could plausibly break."""
    for t in (node.get("spec") or {}).get("taints") or []:
        if not t.get("key") or t.get("effect") not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ApiError(422, "Invalid", f"spec.taints: invalid taint {t!r}")
    seen = set()
    for t in (node.get("spec") or {}).get("taints") or []:
        if (t["key"], t["effect"]) in seen:
            raise ApiError(422, "Invalid", f"spec.taints: duplicate taint {t['key']}:{t['effect']}")
        seen.add((t["key"], t["effect"]))
    types = [c.get("type") for c in (node.get("status") or {}).get("conditions") or []]
    if len(types) != len(set(types)) or not all(types):
        raise ApiError(422, "Invalid", f"status.conditions: duplicate or empty type in {types}")
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("status") not in ("True", "False", "Unknown"):
            raise ApiError(422, "Invalid", f"status.conditions: bad status {c.get('status')!r}")
        if c.get("reason") and not re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", c["reason"]):
            raise ApiError(422, "Invalid", f"status.conditions: reason {c['reason']!r} is not CamelCase")
    for k, v in ((node.get("metadata") or {}).get("labels") or {}).items():
        if not isinstance(v, str) or len(v) > 63:
            raise ApiError(422, "Invalid", f"metadata.labels: invalid value for {k}")
    size = sum(len(k) + len(v) for k, v in ((node.get("metadata") or {}).get("annotations") or {}).items())
    if size > 256 * 1024:
        raise ApiError(422, "Invalid", "metadata.annotations: Too long: must have at most 262144 bytes")


class _Handler(BaseHTTPRequestHandler):
    server_api: KubeAPI
    protocol_version = "HTTP/1.0"  # one request per connection: down() cannot leave stale sockets

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    def _serve(self) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        code, out, stream = self.server_api.handle(self.command, url.path, parse_qs(url.query),
                                                   self.headers, body)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        if stream is not None:
            self.end_headers()
            try:
                for chunk in stream:
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, socket.error):
                pass
            return
        data = out if isinstance(out, bytes) else json.dumps(out).encode()
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve
