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

from screener.stores.kube import formats as kf

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
        self.minor = _binary_minor()
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
             "--service-cluster-ip-range=10.0.0.0/24",
             # 1.28-1.29 (the recipe in ../shared/REAL-APISERVER.md builds 1.28.7): the policy
             # API is v1beta1 behind its feature gate; _manifests converts the apiVersion
             *(["--feature-gates=ValidatingAdmissionPolicy=true",
                "--runtime-config=admissionregistration.k8s.io/v1beta1=true"]
               if self.minor < 30 else [])],
            stdout=log, stderr=log))
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "admin",
            "clusters": [{"name": "test", "cluster": {"server": f"https://127.0.0.1:{secure}",
                                                      "insecure-skip-tls-verify": True}}],
            "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}},
                      # Before 1.30 a pod-bound token carries no node claim: act as the service
                      # account with it by impersonation from the admin (as the issue's
                      # campaign on 1.28.7 did), and without it for the unbound case.
                      *({"name": who, "user": {"token": ADMIN_TOKEN, "as": SA_USER,
                                               "as-groups": SA_GROUPS,
                                               **({"as-user-extra": {NODE_CLAIM: ["n1"]}}
                                                  if who == "bound" else {})}}
                        for who in ("bound", "unbound"))],
            "contexts": [{"name": "admin", "context": {"cluster": "test", "user": "admin"}},
                         *({"name": who, "context": {"cluster": "test", "user": who}}
                           for who in ("bound", "unbound"))]}))
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
        if token is not None and token.startswith(CONTEXT):
            cmd.insert(3, f"--context={token[len(CONTEXT):]}")
        elif token is not None:
            cmd.insert(3, f"--token={token}")
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)

    def admin(self, *args: str, stdin: Optional[str] = None) -> str:
        r = self.kubectl(*args, stdin=stdin)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout


SA_USER = f"system:serviceaccount:{NAMESPACE}:screener"
SA_GROUPS = ["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}", "system:authenticated"]
NODE_CLAIM = "authentication.kubernetes.io/node-name"
CONTEXT = "context:"  # a "token" that names a kubeconfig context (impersonation) instead


def _binary_minor() -> int:
    """The minor version the kube-apiserver binary reports (before it starts: its flags differ)."""
    r = subprocess.run([APISERVER, "--version"], capture_output=True, text=True, timeout=60)
    digits = r.stdout.strip().rsplit("v1.", 1)[-1].split(".", 1)[0]
    return int(digits) if digits.isdigit() else 0


def _patch_status(c: "Cluster", token: str, node: str, body: object,
                  kind: str) -> subprocess.CompletedProcess:
    """PATCH nodes/<node>/status as `token` (a bearer token, or CONTEXT + a context that
    impersonates), the request the store makes; the answer as kubectl's would read."""
    import urllib.request
    import ssl

    cfg = yaml.safe_load(c.kubeconfig.read_text())
    server = cfg["clusters"][0]["cluster"]["server"]
    headers = {"Content-Type": {"merge": "application/merge-patch+json",
                                "strategic": "application/strategic-merge-patch+json",
                                "json": "application/json-patch+json"}[kind]}
    if token.startswith(CONTEXT):
        user = next(u["user"] for u in cfg["users"] if u["name"] == token[len(CONTEXT):])
        headers["Authorization"] = f"Bearer {user['token']}"
        headers["Impersonate-User"] = user["as"]
        for key, values in (user.get("as-user-extra") or {}).items():
            headers[f"Impersonate-Extra-{key.replace('/', '%2f')}"] = values[0]
    else:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"{server}/api/v1/nodes/{node}/status", method="PATCH",
                                 data=json.dumps(body).encode(), headers=headers)
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            return subprocess.CompletedProcess([], 0, resp.read().decode(), "")
    except urllib.error.HTTPError as e:
        detail = json.loads(e.read().decode() or "{}").get("message", "")
        return subprocess.CompletedProcess([], 1, "", f"Error from server: {detail}")


def _server_minor(cluster: Cluster) -> int:
    version = json.loads(cluster.admin("version", "-o", "json"))["serverVersion"]
    return int("".join(c for c in version["minor"] if c.isdigit()))


def _manifests(minor: int = 30) -> str:
    """The RBAC, the policies, the namespace, service account and ConfigMap of manifests/ (the
    policies as v1beta1 for a server before 1.30)."""
    files = ("namespace.yaml", "serviceaccount.yaml", "clusterrole.yaml",
             "clusterrolebinding.yaml", "role.yaml", "rbac-events.yaml", "admission-policy.yaml",
             "configmap.yaml", "resourcequota.yaml")
    text = "\n---\n".join((ROOT / "manifests" / f).read_text() for f in files)
    if minor >= 30:
        return text
    docs = [d for d in yaml.safe_load_all(text) if d]
    for d in docs:
        if d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            d["apiVersion"] = "admissionregistration.k8s.io/v1beta1"
    return yaml.safe_dump_all(docs)


NODE = {"apiVersion": "v1", "kind": "Node",
        "metadata": {"labels": {"kubernetes.io/hostname": "x"}, "annotations": {"team": "a"}},
        "spec": {"providerID": "aws:///z/i-1",
                 "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}
POD = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "screener-n1", "namespace": NAMESPACE},
       "spec": {"nodeName": "n1", "serviceAccountName": "screener",
                "containers": [{"name": "c", "image": "registry.invalid/screener:0"}]}}


def _set_up(cluster: Cluster) -> dict[str, str]:
    cluster.admin("apply", "-f", "-", stdin=_manifests(cluster.minor))
    cluster.admin("-n", NAMESPACE, "create", "configmap", "screener-golden",
                  "--from-literal=gemm.p1.json={}")
    # The budget record (counted, nobody's lease: the lease policy's parameter) and a slot of n2.
    for body in (RECORD.configmap(NAMESPACE),
                 kf.slot_configmap(2, "n2", "quarantined", T, namespace=NAMESPACE)):
        cluster.admin("create", "-f", "-", stdin=json.dumps(body))
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
    if cluster.minor < 30:  # the node claim by impersonation (see Cluster.start)
        return {"bound": CONTEXT + "bound", "unbound": CONTEXT + "unbound"}
    return {"bound": bound, "unbound": unbound}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, dict[str, str]]]:
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(Path(tmp))
        try:
            c.start()
            minor = _server_minor(c)
            if minor < 28:
                pytest.skip(f"kube-apiserver 1.{minor}: the policies need 1.28 or later "
                            f"(ValidatingAdmissionPolicy v1beta1; v1 and the pod's node claim "
                            f"from 1.30)")
            tokens = _set_up(c)
            _wait_for_policies(c, tokens["bound"])
            yield c, tokens
        finally:
            c.stop()


def _wait_for_policies(c: Cluster, token: str) -> None:
    """Policies take effect once the API server's policy cache has them: wait for a denial."""
    deadline = time.monotonic() + 30
    while True:
        # An update (the Role grants update, not patch: a patch is RBAC's refusal, not the
        # policy's) of screener-golden, which the policy keeps read-only to the daemon.
        golden = json.loads(c.admin("-n", NAMESPACE, "get", "configmap", "screener-golden",
                                    "-o", "json"))
        golden["data"] = {**(golden.get("data") or {}), "x": "1"}
        r = c.kubectl("replace", "-f", "-", token=token, stdin=json.dumps(golden))
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
    # issue 36.1: every object a daemon writes is bound to its node (bodies: BODIES below)
    ("history", ["create", "-f", "-"], "bound", ""),
    ("history update", ["replace", "-f", "-"], "bound", ""),
    ("another node's history", ["create", "-f", "-"], "bound", "only its own node's history"),
    ("900 KB history of no node", ["create", "-f", "-"], "bound", "only its own node's history"),
    ("history without the claim", ["replace", "-f", "-"], "unbound", "node claim"),
    ("budget slot", ["create", "-f", "-"], "bound", ""),
    ("slot naming another node", ["create", "-f", "-"], "bound", "only the budget's lease holder"),
    ("slot 999999", ["create", "-f", "-"], "bound", "at most 5 digits"),
    ("delete another node's slot", ["-n", NAMESPACE, "delete", "configmap",
                                    "screener-budget-slot-2"], "bound",
     "only the budget's lease holder"),
    ("reboot slot", ["create", "-f", "-"], "bound", ""),
    ("delete own budget slot", ["-n", NAMESPACE, "delete", "configmap",
                                "screener-budget-slot-0"], "bound", ""),
    ("record raising the count", ["replace", "-f", "-"], "bound", "only the budget's lease holder"),
    ("take the lease", ["replace", "-f", "-"], "bound", ""),
    ("raise past the step", ["replace", "-f", "-"], "bound", "at most 4,096"),
    ("own registration", ["create", "-f", "-"], "bound", ""),
    ("another's registration", ["replace", "-f", "-"], "bound", "only its own registration"),
    ("quorum golden", ["create", "-f", "-"], "bound", ""),
    ("quorum key added", ["replace", "-f", "-"], "bound", ""),
    ("quorum key changed", ["replace", "-f", "-"], "bound", "only ever added"),
    ("quorum delete", ["-n", NAMESPACE, "delete", "configmap",
                       "screener-quorum-0123456789abcdef"], "bound", "delete only slots"),
    ("screener-config", ["-n", NAMESPACE, "patch", "configmap", "screener-config",
                         "--type=merge", "-p", '{"data":{"x":"1"}}'], "bound", "read-only"),
    ("screener-golden", ["-n", NAMESPACE, "delete", "configmap", "screener-golden"], "bound",
     "read-only"),
    ("another ConfigMap", ["-n", NAMESPACE, "create", "configmap", "other",
                           "--from-literal=k=v"], "bound", "read-only"),
    ("delete a history", ["-n", NAMESPACE, "delete", "configmap", "screener-history-n1"],
     "bound", "delete only slots"),
    ("event in default", ["-n", "default", "create", "-f", "-"], "bound", ""),
    ("event elsewhere", ["-n", "kube-system", "create", "-f", "-"], "bound", "forbidden"),
]
EVENT = _json({"apiVersion": "v1", "kind": "Event",
               "metadata": {"name": "n1.screener.0123456789abcdef"},
               "involvedObject": {"kind": "Node", "name": "n1", "apiVersion": "v1"},
               "reason": "KnownAnswerMismatch", "message": "m", "type": "Warning",
               "source": {"component": "screener"}})


T = 1.7e9
RECORD = kf.BudgetRecord(fleet=2, counted=T)
_ENTRY = {"id": "t1", "node": "n1", "time": T, "from": None, "to": "burnin", "reason": "new"}
_HISTORY = kf.history_configmap("n1", [_ENTRY], namespace=NAMESPACE)
_GHOST = kf.history_configmap("ghost", [], namespace=NAMESPACE)
_GHOST["data"]["history"] = "x" * 900_000
_REBOOT = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "screener-reboot-slot-0", "namespace": NAMESPACE,
                        "labels": {**kf.MANAGED_BY, "screener.io/slot-pool": "reboot"}},
           "data": {"node": "n1", "since": repr(T)}}
_QUORUM = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "screener-quorum-0123456789abcdef", "namespace": NAMESPACE,
                        "labels": {**kf.MANAGED_BY, "screener.io/quorum": "true"}},
           "data": {"gemm-fp32.json": "{}"}}
_SHARD = kf.shard_configmap(0, {"n1": T}, namespace=NAMESPACE)
BODIES = {
    "history": _HISTORY,
    "history update": kf.history_configmap("n1", [_ENTRY, {**_ENTRY, "id": "t2"}],
                                           namespace=NAMESPACE),
    "another node's history": kf.history_configmap("n2", [], namespace=NAMESPACE),
    "900 KB history of no node": _GHOST,
    "history without the claim": _HISTORY,
    "budget slot": kf.slot_configmap(0, "n1", "quarantined", T, namespace=NAMESPACE),
    "slot naming another node": kf.slot_configmap(1, "n2", "quarantined", T, namespace=NAMESPACE),
    "slot 999999": kf.slot_configmap(999999, "n1", "quarantined", T, namespace=NAMESPACE),
    "reboot slot": _REBOOT,
    "record raising the count": kf.BudgetRecord(fleet=100_000, counted=T, counter="n1",
                                                counting_until=T + 120).configmap(NAMESPACE),
    "take the lease": kf.BudgetRecord(fleet=2, counted=T, counter="n1",
                                      counting_until=T + 120).configmap(NAMESPACE),
    "raise past the step": kf.BudgetRecord(fleet=2 + 4097, counted=T, counter="n1",
                                           counting_until=T + 120).configmap(NAMESPACE),
    "own registration": _SHARD,
    "another's registration": kf.shard_configmap(0, {"n2": T}, namespace=NAMESPACE,
                                                 base=_SHARD["data"]),
    "quorum golden": _QUORUM,
    "quorum key added": {**_QUORUM, "data": {**_QUORUM["data"], "conv-fp16.json": "{}"}},
    "quorum key changed": {**_QUORUM, "data": {"gemm-fp32.json": '{"x": 1}',
                                               "conv-fp16.json": "{}"}},
}


@pytest.mark.parametrize("what,args,token,denied", CASES, ids=[c[0] for c in CASES])
def test_the_api_server_enforces_what_the_screener_may_do(cluster, what, args, token, denied):
    c, tokens = cluster
    stdin = json.dumps(BODIES[what]) if what in BODIES else EVENT if "event" in what else None
    if "--subresource=status" in args:
        # kubectl reads nodes/status before it patches it, which the ClusterRole does not grant
        # (the store only patches it): send the patch itself, as the store does.
        r = _patch_status(c, tokens[token], args[2], json.loads(args[args.index("-p") + 1]),
                          args[args.index("-p") - 1].split("=", 1)[1])
    elif what in ("screener-config",):
        # an update (the Role grants update, not patch: a patch would be RBAC's refusal)
        cm = json.loads(c.admin("-n", NAMESPACE, "get", "configmap", what, "-o", "json"))
        cm["data"] = {**(cm.get("data") or {}), "x": "1"}
        r = c.kubectl("replace", "-f", "-", token=tokens[token], stdin=json.dumps(cm))
    else:
        r = c.kubectl(*args, token=tokens[token], stdin=stdin)
    if not denied:
        assert r.returncode == 0, (what, r.stderr)
        return
    assert r.returncode != 0, (what, r.stdout)
    # RBAC's refusal says "forbidden"; a policy's names the rule that denied.
    assert denied in (r.stderr.lower() if denied == "forbidden" else r.stderr), (what, r.stderr)
