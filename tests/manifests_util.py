"""manifests/ as the tests read it: the YAML documents, the rendered kustomization (kubectl's,
or a second-best resolver without it), an object by kind and name, and the ConfigMap admission
policy evaluated as the API server would (cel-python). Shared by test_manifests, test_deploy and
test_rbac."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
KUBECTL = shutil.which("kubectl")


def load_all(path: Path) -> list[dict[str, Any]]:
    """Every YAML document in `path` (empty ones dropped)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def resolve_kustomization() -> list[dict[str, Any]]:
    """The second-best renderer, used only where kubectl is missing: the resources listed in
    kustomization.yaml, its JSON6902 patches and image tags, nothing else of kustomize."""
    from kubeapi import json_patch

    k = load_all(MANIFESTS / "kustomization.yaml")[0]
    objs = [d for r in k["resources"] for d in load_all(MANIFESTS / r)]
    for p in k.get("patches", []):
        t = p["target"]
        ops = yaml.safe_load(p["patch"])
        objs = [json_patch(o, ops) if o["kind"] == t["kind"] and o["metadata"]["name"] == t["name"]
                else o for o in objs]
    return objs


def rendered() -> list[dict[str, Any]]:
    """The objects `kubectl kustomize manifests/` renders (resolve_kustomization without kubectl)."""
    if KUBECTL is None:
        return resolve_kustomization()
    out = subprocess.run([KUBECTL, "kustomize", str(MANIFESTS)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


def by_kind(objs, kind: str, name: str) -> dict[str, Any]:
    """The object of `kind` named `name` among `objs`."""
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


# The ConfigMap policy (issue 23.1): the service account writes only the store's ConfigMaps.

SERVICE_ACCOUNT = "system:serviceaccount:screener-system:screener"
VERBS = {"create": "CREATE", "update": "UPDATE", "patch": "UPDATE", "delete": "DELETE"}


def configmap_policy(objs):
    """The ConfigMap admission policy's spec (issue 23.1), its binding checked on the way."""
    pol = by_kind(objs, "ValidatingAdmissionPolicy", "screener-configmaps")
    binding = by_kind(objs, "ValidatingAdmissionPolicyBinding", "screener-configmaps")
    assert pol["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"] == {"policyName": "screener-configmaps", "validationActions": ["Deny"]}
    assert pol["spec"]["failurePolicy"] == "Fail"
    return pol["spec"]


def admit_configmap(spec, operation: str, name: str, *, user: str = SERVICE_ACCOUNT):
    """The messages of the validations that deny a ConfigMap request ([] = admitted; None = not
    matched), as the API server evaluates them (cel-python)."""
    import celpy
    from celpy import celtypes, json_to_cel

    rules = spec["matchConstraints"]["resourceRules"]
    assert any(operation in r["operations"] and "configmaps" in r["resources"] for r in rules)
    env = celpy.Environment()
    obj = None if operation == "DELETE" else {"metadata": {"name": name}, "data": {}}
    old = None if operation == "CREATE" else {"metadata": {"name": name}, "data": {}}
    act = {"object": json_to_cel(obj), "oldObject": json_to_cel(old),
           "request": json_to_cel({"userInfo": {"username": user}, "operation": operation,
                                   "name": name, "namespace": "screener-system"})}

    def run(expr):
        return env.program(env.compile(expr)).evaluate(act)

    if not all(run(m["expression"]) for m in spec["matchConditions"]):
        return None
    return [v["message"] for v in spec.get("validations", [])
            if run(v["expression"]) != celtypes.BoolType(True)]
