"""The admission policies and the roles on a real kube-apiserver (issue 23.1).

tests/test_manifests.py evaluates the policies' CEL with cel-python on every run (the twin). This
file starts etcd and a kube-apiserver (1.30 or later: the policies are admissionregistration/v1)
when both are on PATH or in $KUBEBUILDER_ASSETS (the envtest layout), applies manifests/ as an
administrator, and acts as the DaemonSet's service account with a token bound to a pod on node
n1 (so it carries the node claim) and with one that is not: what a real API server admits and
denies, RBAC and both policies together. Without the binaries it skips with the reason; nothing
is downloaded or built here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "screener-system"
ADMIN_TOKEN = "screener-test-admin"


def _binary(name: str) -> Optional[str]:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and os.access(Path(assets) / name, os.X_OK):
        return str(Path(assets) / name)
    return shutil.which(name)


APISERVER, ETCD = _binary("kube-apiserver"), _binary("etcd")
KUBECTL, OPENSSL = _binary("kubectl"), shutil.which("openssl")
_MISSING = [n for n, p in (("kube-apiserver", APISERVER), ("etcd", ETCD), ("kubectl", KUBECTL),
                           ("openssl", OPENSSL)) if p is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"no {', '.join(_MISSING)} on PATH or in $KUBEBUILDER_ASSETS: the "
                           f"policies ran only in their cel-python twin (test_manifests.py)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """etcd and a kube-apiserver in a temporary folder; kubectl as admin or with a token."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen] = []
        self.kubeconfig = work / "admin.kubeconfig"

    def start(self) -> None:
        w = self.work
        subprocess.run([OPENSSL, "genrsa", "-out", str(w / "sa.key"), "2048"], check=True,
                       capture_output=True, timeout=60)
        (w / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n')
        client, peer, secure = _port(), _port(), _port()
        log = open(w / "servers.log", "ab")
        self.procs.append(subprocess.Popen(
            [ETCD, "--data-dir", str(w / "etcd"), "--name", "default",
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
            stdout=log, stderr=log))
        self.procs.append(subprocess.Popen(
            [APISERVER, f"--etcd-servers=http://127.0.0.1:{client}", f"--secure-port={secure}",
             "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
             f"--cert-dir={w / 'certs'}", "--authorization-mode=RBAC",
             f"--token-auth-file={w / 'tokens.csv'}",
             "--service-account-issuer=https://kubernetes.default.svc",
             f"--service-account-key-file={w / 'sa.key'}",
             f"--service-account-signing-key-file={w / 'sa.key'}",
             "--service-cluster-ip-range=10.0.0.0/24"],
            stdout=log, stderr=log))
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "admin",
            "clusters": [{"name": "test", "cluster": {"server": f"https://127.0.0.1:{secure}",
                                                      "insecure-skip-tls-verify": True}}],
            "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
            "contexts": [{"name": "admin", "context": {"cluster": "test", "user": "admin"}}]}))
        deadline = time.monotonic() + 90
        while self.kubectl("get", "--raw", "/readyz").returncode != 0:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError("the API server did not come up: "
                                   + (w / "servers.log").read_text()[-2000:])
            time.sleep(0.5)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kubectl(self, *args: str, token: Optional[str] = None,
                stdin: Optional[str] = None) -> subprocess.CompletedProcess:
        cmd = [KUBECTL, "--kubeconfig", str(self.kubeconfig), *args]
        if token is not None:
            cmd.insert(3, f"--token={token}")
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)

    def admin(self, *args: str, stdin: Optional[str] = None) -> str:
        r = self.kubectl(*args, stdin=stdin)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout


def _server_minor(cluster: Cluster) -> int:
    version = json.loads(cluster.admin("version", "-o", "json"))["serverVersion"]
    return int("".join(c for c in version["minor"] if c.isdigit()))


def _manifests() -> str:
    """The RBAC, the policies, the namespace, service account and ConfigMap of manifests/."""
    files = ("namespace.yaml", "serviceaccount.yaml", "clusterrole.yaml",
             "clusterrolebinding.yaml", "role.yaml", "rbac-events.yaml", "admission-policy.yaml",
             "configmap.yaml")
    return "\n---\n".join((ROOT / "manifests" / f).read_text() for f in files)


NODE = {"apiVersion": "v1", "kind": "Node",
        "metadata": {"labels": {"kubernetes.io/hostname": "x"}, "annotations": {"team": "a"}},
        "spec": {"providerID": "aws:///z/i-1",
                 "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}
POD = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "screener-n1", "namespace": NAMESPACE},
       "spec": {"nodeName": "n1", "serviceAccountName": "screener",
                "containers": [{"name": "c", "image": "registry.invalid/screener:0"}]}}


def _set_up(cluster: Cluster) -> dict[str, str]:
    cluster.admin("apply", "-f", "-", stdin=_manifests())
    cluster.admin("-n", NAMESPACE, "create", "configmap", "screener-golden",
                  "--from-literal=gemm.p1.json={}")
    for name in ("n1", "n2"):
        node = json.loads(json.dumps(NODE))
        node["metadata"]["name"] = name
        cluster.admin("apply", "-f", "-", stdin=json.dumps(node))
        cluster.admin("patch", "node", name, "--subresource=status", "--type=merge", "-p",
                      json.dumps({"status": {"addresses": [{"type": "InternalIP",
                                                            "address": "10.0.0.1"}]}}))
    cluster.admin("apply", "-f", "-", stdin=json.dumps(POD))
    uid = cluster.admin("-n", NAMESPACE, "get", "pod", "screener-n1", "-o",
                        "jsonpath={.metadata.uid}")
    bound = cluster.admin("-n", NAMESPACE, "create", "token", "screener",
                          "--bound-object-kind=Pod", "--bound-object-name=screener-n1",
                          f"--bound-object-uid={uid}").strip()
    unbound = cluster.admin("-n", NAMESPACE, "create", "token", "screener").strip()
    return {"bound": bound, "unbound": unbound}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, dict[str, str]]]:
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(Path(tmp))
        try:
            c.start()
            minor = _server_minor(c)
            if minor < 30:
                pytest.skip(f"kube-apiserver 1.{minor}: the policies need 1.30 or later "
                            f"(admissionregistration.k8s.io/v1 and the pod's node claim)")
            tokens = _set_up(c)
            _wait_for_policies(c, tokens["bound"])
            yield c, tokens
        finally:
            c.stop()


def _wait_for_policies(c: Cluster, token: str) -> None:
    """Policies take effect once the API server's policy cache has them: wait for a denial."""
    deadline = time.monotonic() + 30
    while True:
        r = c.kubectl("-n", NAMESPACE, "patch", "configmap", "screener-golden", "--type=merge",
                      "-p", '{"data":{"x":"1"}}', token=token)
        if r.returncode != 0 and "read-only" in r.stderr:
            c.admin("-n", NAMESPACE, "get", "configmap", "screener-golden")
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ConfigMap policy never denied: {r.stdout} {r.stderr}")
        time.sleep(0.5)


def _json(value: object) -> str:
    return json.dumps(value)


LABEL = _json({"metadata": {"labels": {"screener.io/state": "suspect"}}})
OWN_TAINT = _json([{"op": "add", "path": "/spec/taints/-",
                    "value": {"key": "screener.io/state", "value": "suspect",
                              "effect": "NoSchedule"}}])
# (what, kubectl arguments, token, the denial's words or "" when admitted)
CASES = [
    ("own label", ["patch", "node", "n1", "--type=merge", "-p", LABEL], "bound", ""),
    ("own taint", ["patch", "node", "n1", "--type=json", "-p", OWN_TAINT], "bound", ""),
    ("own condition", ["patch", "node", "n1", "--subresource=status", "--type=strategic", "-p",
                       _json({"status": {"conditions": [{"type": "GPUHardwareSuspect",
                                                          "status": "True",
                                                          "reason": "KnownAnswerMismatch",
                                                          "message": "m"}]}})], "bound", ""),
    ("NoExecute taint", ["patch", "node", "n1", "--type=json", "-p", _json(
        [{"op": "add", "path": "/spec/taints/-",
          "value": {"key": "screener.io/x", "value": "y", "effect": "NoExecute"}}])],
     "bound", "effect NoSchedule"),
    ("owner reference", ["patch", "node", "n1", "--type=merge", "-p", _json(
        {"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap",
                                           "name": "gone", "uid": "0000"}]}})],
     "bound", "owner references"),
    ("finalizer", ["patch", "node", "n1", "--type=merge", "-p",
                   _json({"metadata": {"finalizers": ["example.com/hold"]}})],
     "bound", "finalizers"),
    ("other label", ["patch", "node", "n1", "--type=merge", "-p",
                     _json({"metadata": {"labels": {"team": "b"}}})], "bound", "labels"),
    ("cordon", ["patch", "node", "n1", "--type=merge", "-p",
                _json({"spec": {"unschedulable": True}})], "bound", "cordon"),
    ("addresses", ["patch", "node", "n1", "--subresource=status", "--type=merge", "-p",
                   _json({"status": {"addresses": [{"type": "InternalIP",
                                                    "address": "10.9.9.9"}]}})],
     "bound", "addresses"),
    ("another node", ["patch", "node", "n2", "--type=merge", "-p", LABEL], "bound",
     "only the node it runs on"),
    ("no node claim", ["patch", "node", "n1", "--type=merge", "-p", LABEL], "unbound",
     "only the node it runs on"),
    ("delete a node", ["delete", "node", "n2"], "bound", "forbidden"),
    ("history", ["-n", NAMESPACE, "create", "configmap", "screener-history-n1",
                 "--from-literal=k=v"], "bound", ""),
    ("budget slot", ["-n", NAMESPACE, "create", "configmap", "screener-budget-slot-0",
                     "--from-literal=k=v"], "bound", ""),
    ("screener-config", ["-n", NAMESPACE, "patch", "configmap", "screener-config",
                         "--type=merge", "-p", '{"data":{"x":"1"}}'], "bound", "read-only"),
    ("screener-golden", ["-n", NAMESPACE, "delete", "configmap", "screener-golden"], "bound",
     "read-only"),
    ("another ConfigMap", ["-n", NAMESPACE, "create", "configmap", "other",
                           "--from-literal=k=v"], "bound", "read-only"),
    ("delete a history", ["-n", NAMESPACE, "delete", "configmap", "screener-history-n1"],
     "bound", "delete only budget slots"),
    ("event in default", ["-n", "default", "create", "-f", "-"], "bound", ""),
    ("event elsewhere", ["-n", "kube-system", "create", "-f", "-"], "bound", "forbidden"),
]
EVENT = _json({"apiVersion": "v1", "kind": "Event",
               "metadata": {"generateName": "n1."},
               "involvedObject": {"kind": "Node", "name": "n1", "apiVersion": "v1"},
               "reason": "KnownAnswerMismatch", "message": "m", "type": "Warning",
               "source": {"component": "screener"}})


@pytest.mark.parametrize("what,args,token,denied", CASES, ids=[c[0] for c in CASES])
def test_the_api_server_enforces_what_the_screener_may_do(cluster, what, args, token, denied):
    c, tokens = cluster
    r = c.kubectl(*args, token=tokens[token], stdin=EVENT if "event" in what else None)
    if not denied:
        assert r.returncode == 0, (what, r.stderr)
        return
    assert r.returncode != 0, (what, r.stdout)
    # RBAC's refusal says "forbidden"; a policy's names the rule that denied.
    assert denied in (r.stderr.lower() if denied == "forbidden" else r.stderr), (what, r.stderr)
