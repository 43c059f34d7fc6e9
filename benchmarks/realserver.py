"""A real kube-apiserver for the benchmarks' `--apiserver URL --token TOKEN` modes.

../shared/REAL-APISERVER.md builds one (v1.28.7) with etcd; `benchmarks/realserver-up.sh` starts it
as described next. Start it with a token file whose
admin token is in the system:masters group, apply manifests/ (the namespace, RBAC and the
admission policies; on 1.28 the policies as v1beta1: tests/test_admission_apiserver.py's
`_manifests(28)`), and pass its URL and that token. The admin token loads the fleet; every
daemon acts as the DaemonSet's service account with its node claim, by impersonation
(Impersonate-User and Impersonate-Extra-authentication.kubernetes.io/node-name), as a pod-bound
token of 1.30+ carries it, so each write goes through the RBAC and the policies as a pod's would.

Requests are counted on the client side (`Counted`: the client's own request method, each
answer's status), since the real server does not tell its clients apart in its metrics. For
`screener daemon --once` children, `child_env` puts `impersonate/` first on their PYTHONPATH:
its sitecustomize gives every kubernetes client of the child the impersonation headers and
appends each request to a file (the counts of a child's pass).
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import kubernetes.client
import urllib3

HERE = Path(__file__).resolve().parent
NS = "screener-system"
SA_USER = f"system:serviceaccount:{NS}:screener"
NODE_CLAIM_HEADER = "Impersonate-Extra-authentication.kubernetes.io%2fnode-name"

urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)


class Counted(kubernetes.client.ApiClient):
    """An ApiClient that appends (agent, method, path, status, seconds, answered) of every request
    to `log` (a list shared by the benchmark's clients); answered: time.perf_counter() when the
    answer came."""

    def __init__(self, configuration: Any, log: list[tuple[str, str, str, int, float, float]],
                 agent: str) -> None:
        super().__init__(configuration)
        self.log, self.agent = log, agent

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        t0, status = time.perf_counter(), 0
        try:
            out = super().request(method, url, *args, **kwargs)
            status = getattr(out, "status", 200)
            return out
        except kubernetes.client.ApiException as e:
            status = int(e.status or 0)
            raise
        finally:
            path = url.split("://", 1)[-1].split("/", 1)[-1].split("?", 1)[0]
            t1 = time.perf_counter()
            self.log.append((self.agent, method, "/" + path, status, t1 - t0, t1))


def client(url: str, token: str, node: str = "",
           log: Optional[list[tuple[str, str, str, int, float, float]]] = None) -> Any:
    """The admin (no node), or the daemon of `node`: the service account with its node claim."""
    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.verify_ssl, cfg.retries = url, False, False
    cfg.api_key = {"authorization": f"Bearer {token}"}
    c = Counted(cfg, log if log is not None else [], f"daemon/{node}" if node else "admin")
    if node:
        c.set_default_header("Impersonate-User", SA_USER)
        c.set_default_header(NODE_CLAIM_HEADER, node)
        c.user_agent = f"daemon/{node}"
    return c


def load_fleet(url: str, token: str, names: list[str], *, labels: dict[str, str],
               annotations: dict[str, str], configmaps: list[dict[str, Any]],
               threads: int = 12) -> float:
    """Create the Nodes (as the admin, then their labels and annotations) and the ConfigMaps;
    returns the seconds it took."""
    t0 = time.perf_counter()
    local = threading.local()

    def api() -> Any:
        if not hasattr(local, "api"):
            local.api = kubernetes.client.CoreV1Api(client(url, token))
        return local.api

    def node(name: str) -> None:
        api().create_node({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": name,
                                        "labels": {**labels, "kubernetes.io/hostname": name},
                                        "annotations": dict(annotations)}})

    def cm(body: dict[str, Any]) -> None:
        api().create_namespaced_config_map(NS, body)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(node, names))
        list(pool.map(cm, configmaps))
    return time.perf_counter() - t0


def states(url: str, token: str) -> dict[str, tuple[Optional[str], list[str]]]:
    """Every Node's screener state label and screener.io/state taint values."""
    api = kubernetes.client.CoreV1Api(client(url, token))
    out: dict[str, tuple[Optional[str], list[str]]] = {}
    token_ = None
    while True:
        page = api.list_node(limit=500, _continue=token_) if token_ else api.list_node(limit=500)
        for n in page.items:
            out[n.metadata.name] = ((n.metadata.labels or {}).get("screener.io/state"),
                                    [t.value for t in (n.spec.taints or [])
                                     if t.key == "screener.io/state"])
        token_ = page.metadata._continue
        if not token_:
            return out


def configmaps(url: str, token: str, prefix: str) -> list[dict[str, Any]]:
    """The namespace's ConfigMaps whose name starts with `prefix`, as plain JSON."""
    api = kubernetes.client.CoreV1Api(client(url, token))
    items = api.list_namespaced_config_map(NS).items
    return [kubernetes.client.ApiClient().sanitize_for_serialization(cm) for cm in items
            if cm.metadata.name.startswith(prefix)]


def child_env(node: str, counts: Path) -> dict[str, str]:
    """What a `screener daemon --once` child needs to act as `node`'s daemon pod on the real
    server, its requests appended to `counts` (one JSON line each)."""
    return {"SCREENER_BENCH_NODE": node,
            "SCREENER_BENCH_COUNTS": str(counts),
            "PYTHONPATH": os.pathsep.join([str(HERE / "impersonate"), str(HERE.parent)])}


def kubeconfig(url: str, token: str, path: Path) -> Path:
    """A kubeconfig with the server and the admin token (child_env's sitecustomize adds the
    impersonation of the node's daemon)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "real",
        "clusters": [{"name": "real", "cluster": {"server": url,
                                                  "insecure-skip-tls-verify": True}}],
        "users": [{"name": "daemon", "user": {"token": token}}],
        "contexts": [{"name": "real", "context": {"cluster": "real", "user": "daemon"}}]}))
    return path


class RealTarget:
    """The real server as tests/fakes/kill9.py's Campaign sees its API: Nodes added by the admin,
    the children acting as their daemon pods, the audit's reads as the admin. No write can be
    held, so kills land at random moments (`tapped` False)."""

    tapped = False
    hold = (0.0, 0.0)

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.core = kubernetes.client.CoreV1Api(client(url, token))
        self._plain = kubernetes.client.ApiClient()

    def write_kubeconfig(self, path: Path) -> Path:
        return kubeconfig(self.url, self.token, Path(path))

    def add_node(self, name: str, *, labels: Optional[dict[str, str]] = None) -> None:
        self.core.create_node({"apiVersion": "v1", "kind": "Node",
                               "metadata": {"name": name, "labels": dict(labels or {})}})

    def reset(self, on_write: Any = None) -> None:
        assert on_write is None, "a real server's writes cannot be tapped"

    def child_env(self, node: str, home: Path) -> dict[str, str]:
        return child_env(node, Path(home) / "requests.jsonl")

    def node(self, name: str) -> dict[str, Any]:
        return dict(self._plain.sanitize_for_serialization(self.core.read_node(name)))

    def configmap(self, namespace: str, name: str) -> Optional[dict[str, Any]]:
        try:
            cm = self.core.read_namespaced_config_map(name, namespace)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return dict(self._plain.sanitize_for_serialization(cm))

    def events_about(self, node: str, reason: str) -> int:
        items = self.core.list_event_for_all_namespaces(
            field_selector=f"involvedObject.name={node}").items
        return sum(1 for e in items if e.reason == reason)

    def slots_naming(self, namespace: str, node: str) -> int:
        items = self.core.list_namespaced_config_map(namespace).items
        return sum(1 for cm in items if cm.metadata.name.startswith("screener-budget-slot-")
                   and (cm.data or {}).get("node") == node)
