"""manifests/ as the tests read it: the YAML documents, the rendered kustomization (kubectl's,
or a second-best resolver without it), an object by kind and name, and the ConfigMap admission
policy evaluated as the API server would (cel-python). Shared by test_manifests, test_deploy and
test_rbac."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

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
    from fakes.kubeapi import json_patch

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


NODE_CLAIM = "authentication.kubernetes.io/node-name"


def store_body(operation: str, name: str, node: str = "n1") -> tuple[Any, Any]:
    """(object, oldObject) of the write the store makes to ConfigMap `name` as node `node`'s
    daemon (its own history, slot, registration; the record's first count as the lease holder;
    a promoted golden added), built with the store's own format code: what a name-level check
    (does the policy admit this name at all, and in the store's shape?) evaluates."""
    from screener.stores.kube import formats as kf

    ns, t = "screener-system", 1.7e9
    body: Any = {"metadata": {"name": name}, "data": {}}
    old: Any = {"metadata": {"name": name}, "data": {}}
    if name.startswith(kf.HISTORY_PREFIX):
        owner = name[len(kf.HISTORY_PREFIX):]
        entry = {"id": "t1", "node": owner, "time": t, "from": None, "to": "burnin"}
        body = kf.history_configmap(owner, [entry], namespace=ns)
        old = kf.history_configmap(owner, [], namespace=ns)
    elif name.startswith(kf.SLOT_PREFIX) and name[len(kf.SLOT_PREFIX):].isdigit():
        body = old = kf.slot_configmap(int(name[len(kf.SLOT_PREFIX):]), node, "quarantined", t,
                                       namespace=ns)
    elif name.startswith("screener-reboot-slot-") and name.rpartition("-")[2].isdigit():
        body = old = {"metadata": {"name": name, "namespace": ns,
                                   "labels": {**kf.MANAGED_BY, "screener.io/slot-pool": "reboot"}},
                      "data": {"node": node, "since": repr(t)}}
    elif name.startswith(kf.SHARD_PREFIX) and name[len(kf.SHARD_PREFIX):].isdigit():
        index = int(name[len(kf.SHARD_PREFIX):])
        old = kf.shard_configmap(index, {}, namespace=ns)
        body = kf.shard_configmap(index, {node: t}, namespace=ns,
                                  base=None if operation == "CREATE" else old["data"])
    elif name == kf.BUDGET_CONFIGMAP:
        old = kf.BudgetRecord(fleet=0, counted=0.0, counter=node,
                              counting_until=t + 120).configmap(ns)
        body = old if operation == "CREATE" else kf.BudgetRecord(
            fleet=1500, counted=t, counter=node, counting_until=t + 120).configmap(ns)
    elif name.startswith("screener-quorum-"):
        labels = {**kf.MANAGED_BY, "screener.io/quorum": "true"}
        old = {"metadata": {"name": name, "labels": labels}, "data": {"gemm.json": "{}"}}
        body = {"metadata": {"name": name, "labels": labels},
                "data": {"gemm.json": "{}", "conv.json": "{}"}}
    return (None if operation == "DELETE" else body), (None if operation == "CREATE" else old)


def admit_configmap(spec, operation: str, name: str, *, user: str = SERVICE_ACCOUNT,
                    obj: Any = ..., old: Any = ..., extra: Any = ..., node: str = "n1",
                    params: Any = None):
    """The messages of the validations that deny a ConfigMap request ([] = admitted; None = not
    matched), as the API server evaluates them (cel-python): variables in order, a validation
    or match condition that ends in an error denies (failurePolicy: Fail).

    obj/old: the object and oldObject (default: store_body's, the store's own write of that
    name as `node`); extra: the token's userInfo.extra (default: the pod's node claim naming
    `node`; None: a token without any); params: the binding's parameter object (the budget
    record, for screener-budget-lease)."""
    import celpy
    from celpy import celtypes, json_to_cel

    rules = spec["matchConstraints"]["resourceRules"]
    assert any(operation in r["operations"] and "configmaps" in r["resources"] for r in rules)
    env = celpy.Environment()
    if name.startswith("screener-history-") and node == "n1":
        node = name[len("screener-history-"):]  # as the daemon of the node it belongs to
    made_obj, made_old = store_body(operation, name, node)
    obj = made_obj if obj is ... else obj
    old = made_old if old is ... else old
    extra = {NODE_CLAIM: [node]} if extra is ... else extra
    info: dict[str, Any] = {"username": user}
    if extra is not None:
        info["extra"] = extra
    act: dict[str, Any] = {
        "object": json_to_cel(obj), "oldObject": json_to_cel(old),
        "params": json_to_cel(params),
        "request": json_to_cel({"userInfo": info, "operation": operation, "name": name,
                                "namespace": "screener-system"})}

    return evaluate_policy(env, spec, act)


def evaluate_policy(env: Any, spec: Any, act: dict[str, Any]) -> Optional[list[str]]:
    """A ValidatingAdmissionPolicy's spec on one request's activation (object, oldObject,
    request, params) as the API server evaluates it: None when a match condition is false, else
    the messages of the validations that deny ([] = admitted); variables in order, and a match
    condition or validation that ends in an error denies (failurePolicy: Fail)."""
    from celpy import celtypes

    def run(expr):
        return env.program(env.compile(expr)).evaluate(act)

    matched = [run(m["expression"]) for m in spec["matchConditions"]]
    if any(m == celtypes.BoolType(False) for m in matched):
        return None
    errors = [f"match condition error: {m}" for m in matched if not isinstance(m, celtypes.BoolType)]
    variables: dict[Any, Any] = {}
    for v in spec.get("variables", []):
        act["variables"] = celtypes.MapType(variables)
        variables[celtypes.StringType(v["name"])] = run(v["expression"])
    act["variables"] = celtypes.MapType(variables)
    return errors + [v["message"] for v in spec.get("validations", [])
                     if run(v["expression"]) != celtypes.BoolType(True)]
