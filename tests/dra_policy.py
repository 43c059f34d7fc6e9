"""The DeviceTaintRule admission policy (manifests/admission-policy.yaml, screener-device-taints)
evaluated as the API server would (cel-python): shared by test_dra_admission and test_rbac."""

from __future__ import annotations

from typing import Any, Optional

from manifests_util import NODE_CLAIM, SERVICE_ACCOUNT, by_kind, evaluate_policy

POLICY = "screener-device-taints"


def device_taint_policy(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The policy's spec, its binding checked on the way."""
    pol = by_kind(objs, "ValidatingAdmissionPolicy", POLICY)
    binding = by_kind(objs, "ValidatingAdmissionPolicyBinding", POLICY)
    assert pol["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}
    assert pol["spec"]["failurePolicy"] == "Fail"
    return pol["spec"]


def admit_rule(spec: dict[str, Any], operation: str, obj: Optional[dict[str, Any]],
               old: Optional[dict[str, Any]], *, node: Optional[str] = "n1",
               user: str = SERVICE_ACCOUNT, extra: Any = ...) -> Optional[list[str]]:
    """The messages of the validations that deny the request ([] = admitted; None = not
    matched): match conditions, variables in order, and a validation that ends in an error
    denies (failurePolicy: Fail). extra: the token's userInfo.extra (default: the pod's node
    claim naming `node`; None: a token without any)."""
    import celpy
    from celpy import json_to_cel

    rules = spec["matchConstraints"]["resourceRules"]
    assert any(operation in r["operations"] and "devicetaintrules" in r["resources"]
               and "resource.k8s.io" in r["apiGroups"] for r in rules)
    env = celpy.Environment()
    extra = {NODE_CLAIM: [node]} if extra is ... else extra
    info: dict[str, Any] = {"username": user}
    if extra is not None:
        info["extra"] = extra
    name = (obj or old or {}).get("metadata", {}).get("name", "")
    act: dict[str, Any] = {"object": json_to_cel(obj), "oldObject": json_to_cel(old),
                           "request": json_to_cel({"userInfo": info, "operation": operation,
                                                   "name": name, "namespace": ""})}
    return evaluate_policy(env, spec, act)
