"""Deploying and re-deploying the base (issue 25.1, 25.6): `kubectl apply -k manifests/` creates
only what the screener needs, in its own namespace; a re-apply leaves the site's golden records
alone; the DaemonSet's priority and node selection are what docs/placement.md says; the example
training Job lives in examples/ and its podFailurePolicy is the one the docs show.

The re-apply test runs the official kubernetes client against the Kubernetes API test server
(tests/fakes/kubeapi.py) with kubectl's client-side apply: the last-applied-configuration annotation and
its three-way merge, which is what deleted the goldens. kubectl itself cannot talk to that server
(it needs the discovery and OpenAPI endpoints of a real kube-apiserver, which the server does not
serve), so the merge kubectl computes is written out below, as kubectl documents it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from fakes.kubeapi import KubeAPI
from manifests_util import by_kind, load_all, rendered

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "screener-system"
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
GOLDENS = {"gemm-fp32.0123456789abcdef.json": '{"schema": 2, "job": "gemm-fp32"}',
           "train-bf16.0123456789abcdef.json": '{"schema": 2, "job": "train-bf16"}'}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding"}
# Everything the base may create: the screener and its own tools, nothing of a user's.
EXPECTED_BASE = {
    ("Namespace", "screener-system"), ("ServiceAccount", "screener"), ("Role", "screener"),
    ("RoleBinding", "screener"), ("ClusterRole", "screener"), ("ClusterRoleBinding", "screener"),
    ("ConfigMap", "screener-config"), ("DaemonSet", "screener"),
    ("Job", "screener-burnin"), ("Job", "screener-peer-burnin"),
    ("Service", "screener-peer-burnin"), ("NetworkPolicy", "screener-burnin-no-ingress"),
    ("NetworkPolicy", "screener-daemon-metrics-only"),
    ("NetworkPolicy", "screener-peer-burnin-peers-only"),
    ("ValidatingAdmissionPolicy", "screener-node-fields"),
    ("ValidatingAdmissionPolicyBinding", "screener-node-fields"),
    # ConfigMaps the daemon may write (issue 23.1), and Events only in the namespace it uses
    ("ValidatingAdmissionPolicy", "screener-configmaps"),
    ("ValidatingAdmissionPolicyBinding", "screener-configmaps"),
    ("Role", "screener-events"), ("RoleBinding", "screener-events"),
    # Events only about the pod's own node (issue 36.5)
    ("ValidatingAdmissionPolicy", "screener-events"),
    ("ValidatingAdmissionPolicyBinding", "screener-events"),
    # The budget count's writes about other nodes only by its lease holder; a bound on how
    # many ConfigMaps the namespace holds (issue 36.1)
    ("ValidatingAdmissionPolicy", "screener-budget-lease"),
    ("ValidatingAdmissionPolicyBinding", "screener-budget-lease"),
    ("ResourceQuota", "screener-configmaps"),
    # DeviceTaintRules only for devices of the pod's own node's pool (issue 38.4)
    ("ValidatingAdmissionPolicy", "screener-device-taints"),
    ("ValidatingAdmissionPolicyBinding", "screener-device-taints"),
}
EVENT_NAMESPACE = "default"  # where the Node Events go (the daemon's event_namespace)


# --- kubectl's client-side apply ---------------------------------------------------------------


def three_way_patch(original: Any, modified: Any, current: Any) -> dict[str, Any]:
    """The patch `kubectl apply` sends for maps: what `modified` (the file) sets differently
    from `current` (the live object), and a null (delete) for every key the last apply
    (`original`, from the annotation) set and the file no longer has."""
    original = original if isinstance(original, dict) else {}
    current = current if isinstance(current, dict) else {}
    patch: dict[str, Any] = {}
    for key, want in modified.items():
        have = current.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            sub = three_way_patch(original.get(key), want, have)
            if sub:
                patch[key] = sub
        elif want != have:
            patch[key] = want
    for key in original:
        if key not in modified:
            patch[key] = None
    return patch


def kubectl_apply_configmap(core: Any, obj: dict[str, Any]) -> dict[str, Any]:
    """`kubectl apply -f` of one ConfigMap, with the official client: create it with the
    last-applied annotation, or patch it with the three-way merge (strategic merge patch, as
    kubectl sends for built-in kinds)."""
    import kubernetes.client

    meta = obj["metadata"]
    modified = json.loads(json.dumps(obj))
    modified["metadata"].setdefault("annotations", {})[LAST_APPLIED] = json.dumps(obj)
    try:
        live = core.api_client.sanitize_for_serialization(
            core.read_namespaced_config_map(meta["name"], meta["namespace"]))
    except kubernetes.client.ApiException as e:
        if e.status != 404:
            raise
        made = core.create_namespaced_config_map(meta["namespace"], modified)
        return core.api_client.sanitize_for_serialization(made)
    original = json.loads((live["metadata"].get("annotations") or {}).get(LAST_APPLIED, "{}"))
    patch = three_way_patch(original, modified, live)
    done = core.patch_namespaced_config_map(
        meta["name"], meta["namespace"], patch,
        _content_type="application/strategic-merge-patch+json")
    return core.api_client.sanitize_for_serialization(done)


def golden_configmap(data: dict[str, str]) -> dict[str, Any]:
    """What docs/deploy.md step 2 applies: `kubectl create configmap screener-golden --from-file=...
    --dry-run=client -o yaml`."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "screener-golden", "namespace": NAMESPACE}, "data": dict(data)}


def apply_base(core: Any, objs: list[dict[str, Any]]) -> int:
    """Apply the base's objects of the kinds the API test server serves; return how many."""
    applied = [kubectl_apply_configmap(core, o) for o in objs if o["kind"] == "ConfigMap"]
    return len(applied)


@pytest.fixture(scope="module")
def objs() -> list[dict[str, Any]]:
    return rendered()


def test_goldens_survive_applying_the_base_twice(objs):
    import kubernetes.client

    with KubeAPI() as api:
        core = kubernetes.client.CoreV1Api(api.api_client())
        kubectl_apply_configmap(core, golden_configmap(GOLDENS))  # docs/deploy.md step 2
        assert apply_base(core, objs) >= 1  # step 3, and a later re-apply (an upgrade)
        assert apply_base(core, objs) >= 1
        assert api.configmap(NAMESPACE, "screener-golden")["data"] == GOLDENS
        assert "daemon.toml" in api.configmap(NAMESPACE, "screener-config")["data"]


def test_the_apply_above_is_kubectls_a_base_owning_the_goldens_wipes_them():
    # The same apply with the old base's `screener-golden` (data: {}) deletes the recorded keys,
    # as kubectl did on a real kube-apiserver: the test above would catch that base.
    import kubernetes.client

    with KubeAPI() as api:
        core = kubernetes.client.CoreV1Api(api.api_client())
        kubectl_apply_configmap(core, golden_configmap(GOLDENS))
        kubectl_apply_configmap(core, golden_configmap({}))
        assert api.configmap(NAMESPACE, "screener-golden")["data"] == {}


def test_the_base_creates_only_what_the_screener_needs_in_its_namespace(objs):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert kinds == EXPECTED_BASE
    for o in objs:
        ns: Optional[str] = o["metadata"].get("namespace")
        if o["kind"] in CLUSTER_SCOPED:
            assert ns is None, o["metadata"]["name"]
        elif o["metadata"]["name"] == "screener-events":  # Events are written there only
            assert ns == EVENT_NAMESPACE, o["kind"]
        else:  # never the namespace of whoever applies it
            assert ns == NAMESPACE, (o["kind"], o["metadata"]["name"])
    ds = by_kind(objs, "DaemonSet", "screener")["spec"]["template"]["spec"]
    golden = next(v for v in ds["volumes"] if v["name"] == "golden")
    assert golden["configMap"] == {"name": "screener-golden", "optional": True}


def test_daemonset_priority_and_documented_node_selection(objs):
    spec = by_kind(objs, "DaemonSet", "screener")["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert "nodeSelector" not in spec  # the affinity's terms are the whole rule
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    labels = {f"{e['key']}={e['values'][0]}" for t in terms for e in t["matchExpressions"]}
    assert all(len(t["matchExpressions"]) == 1 for t in terms)  # ORed: any one label suffices
    assert "nvidia.com/gpu.present=true" in labels  # GPU Feature Discovery
    doc = (ROOT / "docs" / "placement.md").read_text()
    documented = set(re.findall(r"\| `([a-z0-9./-]+=true)` \|", doc))
    assert documented == labels
    assert "system-node-critical" in doc


def test_the_example_training_job_is_in_examples_and_its_policy_is_the_docs(objs):
    assert not (ROOT / "manifests" / "training-job.yaml").exists()
    job = load_all(ROOT / "examples" / "training-job.yaml")[0]
    assert job["metadata"]["name"] not in {o["metadata"]["name"] for o in objs}
    doc = (ROOT / "docs" / "placement.md").read_text()
    block = re.search(r"```yaml\n(podFailurePolicy:.*?)```", doc, re.S)
    assert block, "docs/placement.md shows no podFailurePolicy"
    assert yaml.safe_load(block.group(1))["podFailurePolicy"] == job["spec"]["podFailurePolicy"]
