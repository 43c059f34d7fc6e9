"""The DeviceTaintRule admission policy (issue 38.4) in its cel-python twin: a daemon pod may create
the store's rule for a device of its own node's pool (NoSchedule, a screener.io/ key, the store's
name) and delete its own node's rules, and nothing else."""

from __future__ import annotations

import copy

import pytest

from dra_policy import admit_rule, device_taint_policy
from manifests_util import rendered
from screener.stores.kube.devices import SliceDevice, rule_body

NODE = "n1"
KEY = "screener.io/gpu-suspect"


@pytest.fixture(scope="module")
def spec():
    return device_taint_policy(rendered())


def store_rule(node: str = NODE, device: str = "gpu-1", pool: str | None = None) -> dict:
    """The rule the store really writes (rule_body, not retyped)."""
    return rule_body(node, SliceDevice("gpu.nvidia.com", pool or node, device), key=KEY,
                     reason="KnownAnswerMismatch", gpu_uuid="GPU-1", gpu_serial="1650923000001",
                     evidence="known-answer screen: cuda:1 golden_mismatch")


def stored(rule: dict) -> dict:
    """The rule as the API server holds it (what a delete's oldObject is)."""
    out = copy.deepcopy(rule)
    out["metadata"].update(uid="u-1", resourceVersion="7", creationTimestamp="2026-01-01T00:00:00Z")
    out["spec"]["taint"]["timeAdded"] = "2026-01-01T00:00:00Z"
    return out


def edited(change) -> dict:
    rule = store_rule()
    change(rule)
    return rule


def test_the_stores_rule_for_its_own_node_is_admitted(spec):
    assert admit_rule(spec, "CREATE", store_rule(), None) == []
    assert admit_rule(spec, "DELETE", None, stored(store_rule())) == []
    # A node whose name is too long for screener.<pool>.<device> gets the hashed name.
    long = "n" * 250
    assert admit_rule(spec, "CREATE", store_rule(long), None, node=long) == []
    assert admit_rule(spec, "DELETE", None, stored(store_rule(long)), node=long) == []
    # People and other controllers are not matched.
    assert admit_rule(spec, "CREATE", store_rule("n2"), None, user="kubernetes-admin") is None


@pytest.mark.parametrize("rule,message", [
    (store_rule(pool="n2"), "pool named after its own node"),       # another node's device
    (store_rule("n2"), "pool named after its own node"),
    (edited(lambda r: r["spec"]["deviceSelector"].pop("pool")), "pool named after its own node"),
    (edited(lambda r: r["spec"]["deviceSelector"].pop("device")), "exactly one device"),
    (edited(lambda r: r["spec"]["deviceSelector"].pop("driver")), "exactly one device"),
    (edited(lambda r: r["spec"].pop("deviceSelector")), "pool named after its own node"),
    (edited(lambda r: r["metadata"].__setitem__("name", "screener.n1.gpu-0")), "exactly one device"),
    (edited(lambda r: r["metadata"].__setitem__("name", "gpu-1")), "exactly one device"),
    (edited(lambda r: r["spec"]["taint"].__setitem__("effect", "NoExecute")), "NoSchedule"),
    (edited(lambda r: r["spec"]["taint"].__setitem__("effect", "None")), "NoSchedule"),
    (edited(lambda r: r["spec"]["taint"].__setitem__("key", "nvidia.com/gpu")), "screener.io/"),
    (edited(lambda r: r["metadata"].__setitem__("ownerReferences", [
        {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "x"}])), "owner reference"),
    (edited(lambda r: r["metadata"].__setitem__("finalizers", ["x/y"])), "finalizer"),
])
def test_every_other_create_is_denied(spec, rule, message):
    messages = admit_rule(spec, "CREATE", rule, None)
    assert messages and any(message in m for m in messages), messages


def test_a_hashed_name_is_admitted_only_where_the_plain_one_would_not_fit(spec):
    rule = store_rule()
    rule["metadata"]["name"] = "screener." + "0" * 32 + ".gpu-1"
    messages = admit_rule(spec, "CREATE", rule, None)
    assert messages and "exactly one device" in messages[0], messages


def test_only_its_own_nodes_rules_are_deleted_and_none_rewritten(spec):
    for old in (stored(store_rule("n2")), stored(store_rule(pool="n2"))):
        messages = admit_rule(spec, "DELETE", None, old)
        assert messages and "own node" in messages[0], messages
    foreign = stored(store_rule())
    foreign["metadata"]["name"] = "gpu-maintenance"
    foreign["spec"]["taint"]["key"] = "example.com/maintenance"
    messages = admit_rule(spec, "DELETE", None, foreign)
    assert messages and "screener.io/" in messages[0], messages
    old = stored(store_rule())
    new = copy.deepcopy(old)
    new["spec"]["taint"]["value"] = "Other"
    messages = admit_rule(spec, "UPDATE", new, old)
    assert messages and "never rewrites" in messages[0], messages


def test_a_token_without_the_node_claim_writes_no_rule(spec):
    for extra in (None, {}, {"authentication.kubernetes.io/node-name": ["n2"]}):
        messages = admit_rule(spec, "CREATE", store_rule(), None, extra=extra)
        assert messages and ("node claim" in messages[0] or "own node" in messages[0]), (extra,
                                                                                          messages)
