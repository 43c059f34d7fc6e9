"""The Kubernetes store at fleet scale: O(1) API work per node event, history off the Node, the
budget record, and nodes still carrying the old long history annotation.

Against tests/fakes/kubeapi.py through the official client over HTTP. The API test server records every
request with its bytes, so "bounded per event" is a count, not a timing.
"""

from __future__ import annotations

import json

import pytest

from fakes.kubeapi import KubeAPI
from screener.lifecycle.machine import NodeSeen, Remediation
from screener.lifecycle.apply import apply_event, reconsider_held
from screener.stores.kube import budget as kb
from screener.stores.kube import formats as kf
from screener.lifecycle.records import Transition
from screener.stores.kube import KubeStore
from screener.types import ANNOTATION_HISTORY, LABEL_STATE, NodeState, Outcome, Verdict

S = NodeState
NOW = 1_900_000_000.0
NS = "screener-system"


def confirmed(serial: str = "") -> Verdict:
    return Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm-fp32",
                   evidence={"confirmed": True, **({"gpu_serial": serial} if serial else {})})


def unconfirmed() -> Verdict:
    return Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm-fp32")


def make_store(api: KubeAPI, **kw) -> KubeStore:
    return KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0,
                     clock=lambda: NOW, instance="test", **kw)


def fleet(api: KubeAPI, n: int, *, annotation_bytes: int = 3000) -> list[str]:
    """n healthy nodes, each with other controllers' annotations (real Nodes carry kilobytes)."""
    names = [f"gpu-{k:05d}" for k in range(n)]
    for name in names:
        api.add_node(name, labels={LABEL_STATE: "healthy", "kubernetes.io/hostname": name},
                     annotations={"other.io/blob": "x" * annotation_bytes})
    return names


def per_event(api: KubeAPI, store: KubeStore, node: str, event, now: float) -> tuple[list, int]:
    api.clear_calls()
    d = apply_event(store, node, event, now=now)
    calls = list(api.calls)
    return d, [(c.verb, c.resource, c.subresource) for c in calls], sum(
        c.request_bytes + c.response_bytes for c in calls)


@pytest.mark.parametrize("event,expected", [(unconfirmed(), S.SUSPECT),
                                            (confirmed("SN-1"), S.QUARANTINED)])
def test_one_event_costs_the_same_requests_and_bytes_in_a_small_and_a_large_fleet(event, expected):
    figures = []
    for size in (20, 400):
        with KubeAPI() as api:
            names = fleet(api, size)
            store = make_store(api)
            store.budget_view()  # the budget record exists (its creation, once, lists the fleet)
            d, calls, nbytes = per_event(api, store, names[7], event, NOW)
            assert d.state == expected
            assert ("list", "nodes", "") not in calls  # nothing on the per-event path lists Nodes
            figures.append((calls, nbytes))
            store.close()
    (small_calls, small_bytes), (large_calls, large_bytes) = figures
    assert small_calls == large_calls and len(small_calls) <= 12, small_calls
    # Only the fleet count's digits differ ("20" vs "400" in the budget record).
    assert abs(large_bytes - small_bytes) <= 64, (small_bytes, large_bytes)


def test_history_leaves_the_node_and_the_summary_stays_bounded():
    with KubeAPI() as api:
        (name,) = fleet(api, 1)
        store = make_store(api)
        from screener.lifecycle.machine import HumanCommand

        apply_event(store, name, confirmed("SN-29"), now=NOW)  # healthy -> quarantined
        apply_event(store, name, Remediation(passed=True, evidence={"log": "z" * 4000}), now=NOW + 1)
        for k in range(30):  # many transitions with bulky evidence
            apply_event(store, name, Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="m",
                                             job="gemm", expected="e" * 3000, observed="o" * 3000),
                        now=NOW + 10 * k + 2)
            apply_event(store, name, HumanCommand(S.BURNIN, f"checked {k}"), now=NOW + 10 * k + 3)
        node = api.node(name)
        summary = node["metadata"]["annotations"][ANNOTATION_HISTORY]
        assert len(summary) <= kf.SUMMARY_BYTES
        assert len(json.loads(summary)["last"]) == kf.SUMMARY_KEEP
        cm = api.configmap(NS, f"screener-history-{name}")
        assert len(json.loads(cm["data"]["history"])) == 62
        # The serials of its failures label the ConfigMap, for the per-GPU lemon lookup.
        assert kf.serial_label("SN-29") in cm["metadata"]["labels"]
        assert [t.node for t in store.failures_for(["SN-29"], NOW - 1)] == [name]
        assert len(store.history(name)) == 62
        assert len(json.dumps(node)) < 6000  # what every watcher of Nodes receives
        store.close()


def test_a_node_with_the_old_long_history_annotation_keeps_working():
    """Written by an earlier version: the whole history as a JSON list on the Node."""
    def old_history(node: str) -> list:
        out, prev = [], None
        for k, to in enumerate([S.BURNIN, S.HEALTHY, S.QUARANTINED, S.BURNIN, S.HEALTHY,
                                S.QUARANTINED, S.BURNIN, S.HEALTHY]):
            t = Transition(node=node, time=NOW - 1000 + k, from_state=prev, to_state=to,
                           reason=f"step {k}", failure=to == S.QUARANTINED, gpu_serials=("SN-OLD",)
                           if to == S.QUARANTINED else (), evidence={"pad": "p" * 1500})
            out.append(t.to_dict())
            prev = to
        return out

    old = old_history("gpu-old")
    with KubeAPI() as api:
        api.add_node("gpu-old", labels={LABEL_STATE: "healthy"},
                     annotations={ANNOTATION_HISTORY: json.dumps(old)})
        api.add_node("gpu-new", labels={LABEL_STATE: "healthy"})
        store = make_store(api)
        # Read as before: history, failures (lemons), the fleet summary.
        assert [t.reason for t in store.history("gpu-old")] == [f"step {k}" for k in range(8)]
        assert [t.time for t in store.failures(0)] == [NOW - 998, NOW - 995]
        assert {r["node"]: r["reason"] for r in store.summaries()}["gpu-old"] == "step 7"
        # Its next transition moves the old entries into the ConfigMap and shrinks the annotation.
        d = apply_event(store, "gpu-old", unconfirmed(), now=NOW)
        assert d.state == S.SUSPECT
        annotation = api.node("gpu-old")["metadata"]["annotations"][ANNOTATION_HISTORY]
        assert len(annotation) <= kf.SUMMARY_BYTES and len(json.dumps(old)) > 10_000
        stored = json.loads(api.configmap(NS, "screener-history-gpu-old")["data"]["history"])
        assert [e["reason"] for e in stored][:8] == [f"step {k}" for k in range(8)]
        assert len(stored) == 9 and stored[0]["evidence"] == {"pad": "p" * 1500}
        assert [t.time for t in store.failures(0)] == [NOW - 998, NOW - 995]
        assert [t.time for t in store.failures_for(["SN-OLD"], 0)] == [NOW - 998, NOW - 995]
        # The lemon rule still counts the old failures: a third confirmed failure is a lemon.
        d = apply_event(store, "gpu-old", confirmed(), now=NOW + 1)
        assert d.state == S.REPAIR and d.transition.evidence["lemon"]["count"] == 3
        # A daemon starting on a node with the old format (no transition) moves it too.
        api.add_node("gpu-old-2", labels={LABEL_STATE: "healthy"},
                     annotations={ANNOTATION_HISTORY: json.dumps(old_history("gpu-old-2"))})
        assert apply_event(store, "gpu-old-2", NodeSeen(), now=NOW + 2).transitions == ()
        annotation = api.node("gpu-old-2")["metadata"]["annotations"][ANNOTATION_HISTORY]
        assert json.loads(annotation)["v"] == 2 and len(annotation) <= kf.SUMMARY_BYTES
        assert len(json.loads(api.configmap(NS, "screener-history-gpu-old-2")["data"]["history"])) == 8
        assert "gpu-old-2" in {t.node for t in store.failures_for(["SN-OLD"], 0)}
        store.close()


def slots(api: KubeAPI) -> dict[str, str]:
    """node -> slot ConfigMap name, from the server's own state."""
    with api._lock:
        return {cm["data"]["node"]: name for (ns, name), cm in api.configmaps.items()
                if ns == NS and name.startswith(kf.SLOT_PREFIX)}


def test_the_budget_holds_claims_and_recounts_the_fleet():
    with KubeAPI() as api:
        names = fleet(api, 10)
        clock = [NOW]
        store = KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0,
                          clock=lambda: clock[0], instance="test")
        assert apply_event(store, names[0], confirmed(), now=NOW).state == S.QUARANTINED
        held = apply_event(store, names[1], confirmed(), now=NOW + 1)
        assert held.state == S.SUSPECT and held.transition.evidence["budget"] == {
            "limit": 1, "out_of_service": 1, "fleet": 10}
        node = api.node(names[1])  # held: suspect, and tainted
        assert node["metadata"]["labels"][LABEL_STATE] == "suspect"
        assert {"key": "screener.io/state", "value": "suspect", "effect": "NoSchedule"} in \
            node["spec"]["taints"]
        assert store.budget_view().fleet == 10 and slots(api) == {names[0]: "screener-budget-slot-0"}

        # A person's quarantine is not limited by the budget but counts in it.
        from screener.lifecycle.machine import HumanCommand
        apply_event(store, names[2], HumanCommand(S.QUARANTINED, "smells of smoke"), now=NOW + 2)
        assert sorted(slots(api)) == [names[0], names[2]]  # past the limit: slot 1
        apply_event(store, names[0], Remediation(passed=True), now=NOW + 3)
        assert sorted(slots(api)) == [names[2]] and sorted(store.budget_view().out) == [names[2]]
        assert reconsider_held(store, names[1], S.SUSPECT, now=NOW + 4) == S.SUSPECT  # still full
        apply_event(store, names[2], HumanCommand(S.BURNIN, "false alarm"), now=NOW + 5)
        assert reconsider_held(store, names[1], S.SUSPECT, now=NOW + 60) == S.QUARANTINED
        assert api.node(names[1])["metadata"]["labels"][LABEL_STATE] == "quarantined"
        assert sorted(slots(api)) == [names[1]]

        # A new node is counted when it gets its first state (in its registration shard).
        api.add_node("gpu-late")
        clock[0] = NOW + 70
        apply_event(store, "gpu-late", NodeSeen(), now=NOW + 70)
        assert store.budget_view().fleet == 11
        assert kf.BudgetRecord.from_configmap(api.configmap(NS, kf.BUDGET_CONFIGMAP)).fleet == 10

        # The hourly recount: a deleted node leaves the count, a lost claim (a writer that died
        # between its claim and its node write) is freed once older than the grace period, and
        # the registrations it counted leave the shards.
        with api._lock:
            del api.nodes[names[9]]
            for k, (who, since) in enumerate([("gpu-ghost", NOW - 7200), ("gpu-fresh", NOW - 5)]):
                body = kf.slot_configmap(5 + k, who, "quarantined", since, namespace=NS)
                api._store_configmap(NS, body["metadata"]["name"], body, None)
            rec = api.configmaps[(NS, kf.BUDGET_CONFIGMAP)]
            rec["data"]["counted"] = repr(NOW + 70 - 4000)
        clock[0] = NOW + 100
        recounted = store.budget_view()
        assert recounted.fleet == 10 and recounted.counted == NOW + 100
        # gpu-late's registration was stamped REGISTER_AHEAD_S past its writer's clock (a write
        # may still be in flight that long), so it outlives this count: counted once, as a
        # registration over a record of 9, until a count after its stamp prunes it
        assert recounted.record.fleet == 9 and recounted.registered == {"gpu-late"}
        assert sorted(recounted.out) == sorted([names[1], "gpu-fresh"])
        assert sorted(slots(api)) == sorted([names[1], "gpu-fresh"])
        with api._lock:
            api.configmaps[(NS, kf.BUDGET_CONFIGMAP)]["data"]["counted"] = repr(NOW + 100 - 4000)
        clock[0] = NOW + 70 + kb.REGISTER_AHEAD_S + 10
        later = store.budget_view()
        assert later.fleet == 10 and later.record.fleet == 10 and not later.registered
        assert api.configmap(NS, "screener-fleet-5")["data"] == {"nodes": "{}"}
        store.close()


def test_a_claim_that_loses_a_race_reads_the_slot_names_not_the_budget_again():
    """A slot taken since the budget was read (here one no list shows: it carries no labels) is
    a 409 on create; the claimer asks the slot, then which names are taken, as a Table without
    objects, not the whole budget again (issue 36.6: the lists were most of a mass failure's
    bytes), and takes the next free slot."""
    with KubeAPI() as api:
        names = fleet(api, 20)  # budget 2
        store = make_store(api)
        store.budget_view()  # the record
        body = kf.slot_configmap(0, "gpu-racer", "quarantined", NOW, namespace=NS)
        body["metadata"].pop("labels")
        api._store_configmap(NS, body["metadata"]["name"], body, None)
        api.clear_calls()
        assert apply_event(store, names[0], confirmed(), now=NOW).state == S.QUARANTINED
        assert slots(api) == {"gpu-racer": "screener-budget-slot-0",
                               names[0]: "screener-budget-slot-1"}
        cms = [(c.verb, c.name, c.status, c.kind) for c in api.calls if c.resource == "configmaps"]
        at = cms.index(("create", "", 409, "Status"))  # the name is in the body, not the path
        assert cms[at + 1:at + 3] == [("get", "screener-budget-slot-0", 200, "ConfigMap"),
                                      ("list", "", 200, "Table")], cms
        assert [c for c in cms if c[3] == "ConfigMapList"] == [("list", "", 200, "ConfigMapList")]
        table = [c for c in api.calls if c.kind == "Table"][0]
        assert table.cached
        store.close()


def test_the_names_of_a_plain_list_are_read_as_a_tables():
    """A server that answers the Table request with the plain list (the Accept header offers
    it as the fallback) gives the same names; a Table without a name column is an error."""
    from screener.stores.kube.calls import KubeApiError, _names
    items = [{"metadata": {"name": "screener-budget-slot-3"}}, {"metadata": {"name": "b"}}]
    assert _names({"kind": "ConfigMapList", "items": items}) == ["screener-budget-slot-3", "b"]
    assert _names({"kind": "Table", "columnDefinitions": [{"name": "Data", "format": ""},
                                                          {"name": "Name", "format": "name"}],
                   "rows": [{"cells": [3, "screener-budget-slot-3"]}]}) == ["screener-budget-slot-3"]
    with pytest.raises(KubeApiError, match="without a name column"):
        _names({"kind": "Table", "columnDefinitions": [{"name": "Data"}], "rows": []})


def test_node_status_of_the_fleet_is_one_paginated_list(tmp_path):
    from click.testing import CliRunner

    from screener.cli import main

    with KubeAPI() as api:
        names = fleet(api, 1200, annotation_bytes=10)
        store = make_store(api)
        apply_event(store, names[3], unconfirmed(), now=NOW)
        store.close()
        api.clear_calls()
        r = CliRunner().invoke(main, ["node", "status", "--json", "--kubeconfig",
                                      str(api.write_kubeconfig(tmp_path / "kc")),
                                      "--spool", str(tmp_path / "spool.db")])
        assert r.exit_code == 0, r.output
        out = json.loads(r.output)
        assert len(out["nodes"]) == 1200 and out["counts"]["suspect"] == 1
        row = next(n for n in out["nodes"] if n["node"] == names[3])
        assert row["state"] == "suspect" and row["reason"].startswith("known-answer mismatch")
        # One list of Node metadata, in pages of 500: no per-node reads.
        assert [(c.verb, c.resource) for c in api.calls] == [("list", "nodes")] * 3


@pytest.mark.parametrize("field,value", [
    ("fleet", "1000000000000"),  # would let every node be quarantined
    ("fleet", "-3"),
    ("counted", "inf"),  # would never be recounted
    ("counted", "nan"),
    ("outOfService", "[" * 5000),  # json's RecursionError
    ("outOfService", '{"gpu-0": {"state": "healthy", "since": 1}}'),
    ("outOfService", '{"gpu-0": 7}'),
    ("outOfService", '{"gpu-0": {"state": "quarantined", "since": "NaN"}}'),
])
def test_a_tampered_budget_record_is_recounted_not_trusted(field, value):
    """The budget record is a ConfigMap anyone with namespace write access can edit: a field out
    of shape makes the next read recount it from the Nodes' labels, and the budget still holds."""
    with KubeAPI() as api:
        names = fleet(api, 10)
        store = make_store(api)
        assert apply_event(store, names[0], confirmed(), now=NOW).state == S.QUARANTINED
        with api._lock:
            api.configmaps[(NS, kf.BUDGET_CONFIGMAP)]["data"][field] = value
        view = store.budget_view()
        assert view.fleet == 10 and sorted(view.out) == [names[0]]
        assert NOW <= view.counted < NOW + 60  # recounted now, so recounted again in an hour
        held = apply_event(store, names[1], confirmed(), now=NOW + 1)
        assert held.state == S.SUSPECT
        assert held.transition.evidence["budget"] == {"limit": 1, "out_of_service": 1, "fleet": 10}
        store.close()
