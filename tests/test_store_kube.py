"""KubeStore through the official kubernetes client over HTTP, against tests/fakes/kubeapi.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import cli_util
from fakes.kubeapi import KubeAPI, json_patch, merge_patch, strategic_merge_patch
from screener.cli import main
from screener.lifecycle.machine import NodeSeen, decide
from screener.lifecycle.apply import apply_event
from screener.lifecycle.records import StaleTransition, Transition
from screener.stores.kube import (KubeApiError, KubeStore, NodeNotFound, RetryPolicy,
                                  TransientKubeError)
from screener.stores.spool import Spool
from screener.alarmfile import AlarmRecord
from screener.types import (ANNOTATION_HISTORY, ANNOTATION_VERDICT, CONDITION_TYPE, LABEL_STATE,
                            NodeState, SuspectNode)

S = NodeState
NOW = 1_800_000_000.0
FOREIGN_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
FOREIGN_CONDITION = {"type": "NetworkUnavailable", "status": "False", "reason": "RouteCreated",
                     "message": "ok", "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                     "lastTransitionTime": "2026-01-01T00:00:00Z"}
# What the DaemonSet's ClusterRole grants; every call screener makes must be in it.
RBAC = {("get", "nodes", ""), ("list", "nodes", ""), ("watch", "nodes", ""), ("patch", "nodes", ""),
        ("patch", "nodes", "status"), ("create", "events", ""), ("list", "pods", ""),
        ("get", "configmaps", ""), ("list", "configmaps", ""), ("create", "configmaps", ""),
        ("update", "configmaps", ""), ("delete", "configmaps", "")}


@pytest.fixture
def api():
    with KubeAPI() as server:
        server.add_node("gpu-1", labels={"team": "vision", "kubernetes.io/hostname": "gpu-1"},
                        taints=[FOREIGN_TAINT],
                        conditions=[{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                     "message": "ready", "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                                     "lastTransitionTime": "2026-01-01T00:00:00Z"}, FOREIGN_CONDITION])
        server.add_node("gpu-2")
        server.add_node("cpu-1", labels={"role": "cpu"})
        yield server


def make_store(api: KubeAPI, sleeps: list | None = None, **kw) -> KubeStore:
    sleeps = sleeps if sleeps is not None else []
    return KubeStore(api.api_client(), sleep=sleeps.append, rng=lambda: 0.0,
                     clock=lambda: NOW + 5, instance="test", **kw)


def tr(node: str, frm, to, when: float = NOW, **kw) -> Transition:
    return Transition(node=node, time=when, from_state=frm, to_state=to, reason=f"to {to.value}",
                      code=kw.pop("code", "Test"), **kw)


def summary(node: dict) -> list:
    """The bounded summary the Node carries: its last few transitions, without evidence."""
    data = json.loads(node["metadata"]["annotations"][ANNOTATION_HISTORY])
    assert data["v"] == 2 and len(node["metadata"]["annotations"][ANNOTATION_HISTORY]) <= 2048
    return data["last"]


def stored_history(api: KubeAPI, node: str) -> list:
    """The full history, in the node's ConfigMap in the screener namespace."""
    cm = api.configmap("screener-system", f"screener-history-{node}")
    return json.loads(cm["data"]["history"])


def our_taints(node: dict) -> list:
    return [t for t in node["spec"]["taints"] if t["key"].startswith("screener.io/")]


def condition(node: dict) -> dict:
    return next(c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE)


def test_write_and_read_back_keeping_foreign_fields(api):
    store = make_store(api)
    assert store.get_state("gpu-1") is None
    alarm = AlarmRecord(alarm_id="a", check="ring_replay", step=9, settled=True, suspect_ranks=(2,),
                        suspect_nodes=(SuspectNode("gpu-1", "gpu-1"),), node="gpu-1", created=NOW)
    apply_event(store, "gpu-1", NodeSeen(), now=NOW)
    d = apply_event(store, "gpu-1", alarm, now=NOW + 60)
    assert d.state == S.QUARANTINED

    node = api.node("gpu-1")
    assert node["metadata"]["labels"] == {"team": "vision", "kubernetes.io/hostname": "gpu-1",
                                          LABEL_STATE: "quarantined"}
    assert FOREIGN_TAINT in node["spec"]["taints"]
    assert our_taints(node) == [{"key": "screener.io/state", "value": "quarantined",
                                 "effect": "NoSchedule"}]
    types = [c["type"] for c in node["status"]["conditions"]]
    assert types == ["Ready", "NetworkUnavailable", CONDITION_TYPE]
    assert FOREIGN_CONDITION in node["status"]["conditions"]
    cond = condition(node)
    assert (cond["status"], cond["reason"]) == ("True", "RingReplayMismatch")
    assert [(h["from"], h["to"]) for h in summary(node)] == [(None, "burnin"), ("burnin", "quarantined")]
    hist = stored_history(api, "gpu-1")
    assert [(h["from"], h["to"]) for h in hist] == [(None, "burnin"), ("burnin", "quarantined")]
    assert hist[1]["rollback"] == {"time": NOW, "step": 9, "job": None}

    # One Event per transition, Warning for quarantined, on the Node.
    assert [(e["type"], e["reason"], e["involvedObject"]["name"]) for e in api.events] == [
        ("Normal", "NewNode", "gpu-1"), ("Warning", "RingReplayMismatch", "gpu-1")]
    assert api.events[1]["involvedObject"]["uid"] == node["metadata"]["uid"]

    # Read back through the store.
    assert store.get_state("gpu-1") == S.QUARANTINED
    assert store.all_states() == {"gpu-1": S.QUARANTINED}
    assert [t.to_state for t in store.history("gpu-1")] == [S.BURNIN, S.QUARANTINED]
    assert [t.code for t in store.failures(NOW - 10)] == ["RingReplayMismatch"]

    # Back to healthy (through remediation and burn-in): our taint goes, the foreign one stays.
    store.record(tr("gpu-1", S.QUARANTINED, S.BURNIN, NOW + 100))
    store.record(tr("gpu-1", S.BURNIN, S.HEALTHY, NOW + 200, code="KnownAnswerPassed"))
    node = api.node("gpu-1")
    assert node["spec"]["taints"] == [FOREIGN_TAINT]
    assert condition(node)["status"] == "False" and node["metadata"]["labels"][LABEL_STATE] == "healthy"
    assert api.events[-1]["type"] == "Normal"
    assert api.verbs() <= RBAC


def test_concurrent_writer_409_is_retried_without_losing_its_update(api):
    store = make_store(api)
    store.record(tr("gpu-1", None, S.BURNIN))

    def other_controller(node):  # sneaks in between our read and our write
        node["metadata"]["labels"]["other/label"] = "x"
        node["spec"]["taints"].append({"key": "other/taint", "effect": "NoExecute"})

    api.on_next_write(other_controller)
    api.clear_calls()
    store.record(tr("gpu-1", S.BURNIN, S.SUSPECT, NOW + 1))
    node = api.node("gpu-1")
    assert node["metadata"]["labels"]["other/label"] == "x"
    assert {"key": "other/taint", "effect": "NoExecute"} in node["spec"]["taints"]
    assert FOREIGN_TAINT in node["spec"]["taints"]
    assert our_taints(node) == [{"key": "screener.io/state", "value": "suspect", "effect": "NoSchedule"}]
    statuses = [c.status for c in api.calls if c.verb == "patch" and c.subresource == ""]
    assert statuses == [409, 200]

    # Scripted conflicts on both the node and its status.
    api.conflict_next(3)
    store.record(tr("gpu-1", S.SUSPECT, S.QUARANTINED, NOW + 2))
    assert api.node("gpu-1")["metadata"]["labels"][LABEL_STATE] == "quarantined"
    assert condition(api.node("gpu-1"))["status"] == "True"


def test_two_stores_racing_lose_nothing(api):
    a, b = make_store(api), make_store(api)
    a.record(tr("gpu-2", None, S.BURNIN))
    errors = []

    def taint_loop(on_off):
        try:
            for k in range(8):
                b.set_screening_taint("gpu-2", on_off[k % 2])
                b.set_annotations("gpu-2", {f"screener.io/kat-digest-{k}": str(k)})
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    th = threading.Thread(target=taint_loop, args=((True, False),))
    th.start()
    a.record(tr("gpu-2", S.BURNIN, S.HEALTHY, NOW + 1))
    a.record(tr("gpu-2", S.HEALTHY, S.SUSPECT, NOW + 2))
    th.join()
    assert not errors
    node = api.node("gpu-2")
    assert node["metadata"]["labels"][LABEL_STATE] == "suspect"
    assert [t["key"] for t in node["spec"]["taints"]] == ["screener.io/state"]  # screening ended off
    assert all(f"screener.io/kat-digest-{k}" in node["metadata"]["annotations"] for k in range(8))
    assert len(summary(node)) == 3 and len(stored_history(api, "gpu-2")) == 3


def test_transient_500_is_retried_with_backoff(api):
    sleeps: list = []
    store = make_store(api, sleeps, retry=RetryPolicy(attempts=4, base_delay=0.1, max_delay=1))
    api.fail_next(3, 500)
    store.record(tr("gpu-1", None, S.BURNIN))
    assert sleeps == [0.1, 0.2, 0.4]
    assert store.pending() == 0 and api.node("gpu-1")["metadata"]["labels"][LABEL_STATE] == "burnin"
    api.fail_next(1, 503, verb="list")
    assert store.all_states() == {"gpu-1": S.BURNIN}


def test_api_down_spools_then_replays_in_order(api, tmp_path):
    sleeps: list = []
    spool = Spool(tmp_path / "spool.db")
    store = make_store(api, sleeps, spool=spool, retry=RetryPolicy(attempts=3, base_delay=0.01))
    store.record(tr("gpu-1", None, S.BURNIN))
    api.down()
    store.record(tr("gpu-1", S.BURNIN, S.HEALTHY, NOW + 1))
    store.record(tr("gpu-1", S.HEALTHY, S.SUSPECT, NOW + 2))
    assert store.pending() == 2
    # The lifecycle keeps deciding on the spooled state while the API is away.
    assert store.get_state("gpu-1") == S.SUSPECT
    assert store.replay() == 0
    store.close()

    # A restarted daemon finds the spool on disk.
    api.up()
    store = make_store(api, sleeps, spool=Spool(tmp_path / "spool.db"))
    store.record(tr("gpu-1", S.SUSPECT, S.QUARANTINED, NOW + 3))
    assert store.pending() == 0
    node = api.node("gpu-1")
    hist = stored_history(api, "gpu-1")
    assert [h["to"] for h in summary(node)] == ["burnin", "healthy", "suspect", "quarantined"]
    assert [h["to"] for h in hist] == ["burnin", "healthy", "suspect", "quarantined"]
    assert [h["time"] for h in hist] == [NOW, NOW + 1, NOW + 2, NOW + 3]
    assert node["metadata"]["labels"][LABEL_STATE] == "quarantined"
    assert condition(node)["status"] == "True"
    assert [e["message"].split(" by ")[0] for e in api.events] == [
        "(new) -> burnin", "burnin -> healthy", "healthy -> suspect", "suspect -> quarantined"]


def test_partial_write_is_replayed_once(api):
    store = make_store(api, retry=RetryPolicy(attempts=2, base_delay=0))
    store.record(tr("gpu-1", None, S.BURNIN))
    api.fail_next(2, 503, verb="patch", subresource="status")  # the node patch lands, status does not
    store.record(tr("gpu-1", S.BURNIN, S.SUSPECT, NOW + 1))
    assert store.pending() == 1
    assert condition(api.node("gpu-1"))["status"] == "False"
    assert store.replay() == 1
    node = api.node("gpu-1")
    assert len(summary(node)) == 2 and len(stored_history(api, "gpu-1")) == 2
    assert condition(node)["status"] == "True" and len(api.events) == 2
    # A replay whose event was already posted is not posted twice (AlreadyExists is fine).
    store.spool.append(tr("gpu-1", S.BURNIN, S.SUSPECT, NOW + 1))
    assert store.replay() == 1 and len(api.events) == 2


def test_refusals_and_missing_nodes(api):
    store = make_store(api)
    store.record(tr("gpu-1", None, S.BURNIN))
    with pytest.raises(StaleTransition, match="the node is burnin now"):
        store.record(tr("gpu-1", S.HEALTHY, S.SUSPECT, NOW + 1))
    with pytest.raises(NodeNotFound, match="nope"):
        store.get_state("nope")
    with pytest.raises(NodeNotFound):
        store.record(tr("nope", None, S.BURNIN))
    # A spooled transition of a node deleted meanwhile is dropped, not left blocking the rest.
    store.spool.append(tr("deleted-node", None, S.BURNIN))
    store.spool.append(tr("gpu-2", None, S.BURNIN))
    assert store.replay() == 1 and store.pending() == 0
    assert api.node("gpu-2")["metadata"]["labels"][LABEL_STATE] == "burnin"
    api.fail_next(1, 403)
    with pytest.raises(KubeApiError) as e:  # not transient: raised, not spooled
        store.record(tr("gpu-1", S.BURNIN, S.HEALTHY, NOW + 2))
    assert e.value.status == 403 and store.pending() == 0
    api.fail_next(5, 500, verb="get")  # as many as the default RetryPolicy's attempts
    with pytest.raises(TransientKubeError, match="unavailable after 5 attempts: 500"):
        store.get_state("gpu-1")
    assert store.get_state("gpu-1") == S.BURNIN  # the failures ran out; the state was never lost


def test_history_is_bounded(api):
    store = make_store(api, history_limit=5)
    cycle = [S.BURNIN, S.HEALTHY, S.SUSPECT, S.QUARANTINED]
    prev = None
    for k in range(9):
        nxt = cycle[k % 4]
        store.record(tr("gpu-2", prev, nxt, NOW + k, evidence={"blob": "z" * 5000}))
        prev = nxt
    hist = store.history("gpu-2")
    assert [t.time for t in hist] == [NOW + k for k in range(4, 9)]
    assert hist[-1].evidence == {"blob": "z" * 160 + "...", "truncated": True}
    # Bulky evidence loses its bulk but keeps what identifies it (the daemon finds applied alarms
    # by alarm_id in the history).
    alarm = AlarmRecord(alarm_id="alarm-77", check="weights", step=3, settled=True, suspect_ranks=(1,),
                        suspect_nodes=(SuspectNode("gpu-2", "gpu-2"),), node="gpu-2", created=NOW,
                        evidence={"fingerprints": [[k, k * 7] for k in range(5000)]})
    d = apply_event(store, "gpu-2", alarm, now=NOW + 20)
    assert len(json.dumps(d.transition.evidence)) > 50_000
    stored = store.history("gpu-2")[-1].evidence
    assert stored["alarm"]["alarm_id"] == "alarm-77" and stored["truncated"] is True
    assert len(json.dumps(stored)) <= 2048


def test_daemon_helpers(api):
    api.add_pod("train-0", "gpu-1", gpus=8)
    api.add_pod("done-0", "gpu-1", gpus=8, phase="Succeeded")
    api.add_pod("sidecar", "gpu-1", gpus=0)
    api.add_pod("elsewhere", "gpu-2", gpus=1)
    store = make_store(api)
    assert store.gpu_pods("gpu-1") == [{"name": "train-0", "namespace": "default", "phase": "Running",
                                        "gpus": 8}]
    store.set_screening_taint("gpu-1", True)
    store.set_screening_taint("gpu-1", True)  # idempotent
    taints = api.node("gpu-1")["spec"]["taints"]
    assert taints == [FOREIGN_TAINT, {"key": "screener.io/screening", "value": "true",
                                      "effect": "NoSchedule"}]
    store.set_screening_taint("gpu-1", False)
    assert api.node("gpu-1")["spec"]["taints"] == [FOREIGN_TAINT]
    store.set_annotations("gpu-2", {"screener.io/kat-digests": "abc"})
    assert store.annotations_by_node("screener.io/kat-digests") == {"gpu-2": "abc"}
    store.set_verdict("gpu-2", {"outcome": "pass", "device": "cuda:0"})
    assert json.loads(api.node("gpu-2")["metadata"]["annotations"][ANNOTATION_VERDICT])["outcome"] == "pass"
    assert store.get_verdict("gpu-2")["outcome"] == "pass" and store.get_verdict("gpu-1") is None
    store.set_annotations("gpu-2", {"screener.io/kat-digests": None})
    assert "screener.io/kat-digests" not in store.node_annotations("gpu-2")
    assert store.get_node("cpu-1")["metadata"]["labels"] == {"role": "cpu"}
    store.history("gpu-1"), store.failures(0), store.all_states()
    # Every call made in this module's scenarios is one the DaemonSet's RBAC grants.
    assert api.verbs() <= RBAC, api.verbs() - RBAC


def test_cli_against_the_api(api, tmp_path):
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    runner = CliRunner()
    base = ["--kubeconfig", str(kubeconfig), "--spool", str(tmp_path / "spool.db")]
    r = runner.invoke(main, ["node", "set", "gpu-2", "repair", "--reason", "PSU swap", *base])
    assert r.exit_code == 0, r.output
    assert api.node("gpu-2")["metadata"]["labels"][LABEL_STATE] == "repair"
    r = runner.invoke(main, ["node", "status", "--json", "--store", "kube", *base])
    assert json.loads(r.output)["nodes"] == [
        {"node": "gpu-2", "state": "repair", "since": json.loads(r.output)["nodes"][0]["since"],
         "reason": "PSU swap", "actor": "human", "last_screen": None}]
    r = runner.invoke(main, ["node", "history", "gpu-2", "--json", *base])
    assert [h["to"] for h in json.loads(r.output)["transitions"]] == ["repair"]
    r = runner.invoke(main, ["lemons", "--json", *base])
    assert json.loads(r.output)["nodes"] == []
    # Unknown node: one line, exit 2 (tests/test_store_local.py runs the real process).
    p = cli_util.screener("node", "status", "ghost", *base)
    assert p.returncode == 2 and "ghost" in p.stderr and "Traceback" not in p.stderr


def test_kubernetes_is_imported_only_by_the_kube_store():
    code = ("import sys, screener.lifecycle.machine, screener.stores, screener.stores.local, "
            "screener.stores.spool, screener.commands.node; "
            "print([m for m in sys.modules if m.split('.')[0] == 'kubernetes'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


# --- the test server's patch semantics (it must behave like the real API server) ---------------------


def test_patch_semantics():
    base = {"metadata": {"labels": {"a": "1", "b": "2"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"},
                                      {"type": "X", "status": "False"}]},
            "spec": {"taints": [{"key": "t1", "effect": "NoSchedule"}]}}
    smp = strategic_merge_patch(base, {"metadata": {"labels": {"b": None, "c": "3"}},
                                       "status": {"conditions": [{"type": "X", "status": "True"},
                                                                 {"type": "Y", "status": "True"}]},
                                       "spec": {"taints": [{"key": "t2", "effect": "NoSchedule"}]}})
    assert smp["metadata"]["labels"] == {"a": "1", "c": "3"}
    assert [(c["type"], c["status"]) for c in smp["status"]["conditions"]] == [
        ("Ready", "True"), ("X", "True"), ("Y", "True")]
    assert smp["spec"]["taints"] == [{"key": "t2", "effect": "NoSchedule"}]  # no merge key: replaced
    mp = merge_patch(base, {"status": {"conditions": [{"type": "Z", "status": "True"}]}})
    assert mp["status"]["conditions"] == [{"type": "Z", "status": "True"}]
    jp = json_patch(base, [{"op": "add", "path": "/metadata/labels/screener.io~1state", "value": "x"},
                           {"op": "remove", "path": "/spec/taints/0"}])
    assert jp["metadata"]["labels"]["screener.io/state"] == "x" and jp["spec"]["taints"] == []


def test_server_speaks_strategic_merge_and_conflicts_to_the_client(api):
    import kubernetes.client
    from kubernetes.client.exceptions import ApiException

    v1 = kubernetes.client.CoreV1Api(api.api_client())
    node = v1.read_node("gpu-1")
    v1.patch_node_status("gpu-1", {"status": {"conditions": [{"type": "Z", "status": "True"}]}},
                         _content_type="application/strategic-merge-patch+json")
    assert [c.type for c in v1.read_node_status("gpu-1").status.conditions] == [
        "Ready", "NetworkUnavailable", "Z"]
    with pytest.raises(ApiException) as e:
        v1.patch_node("gpu-1", {"metadata": {"resourceVersion": node.metadata.resource_version,
                                             "labels": {"x": "y"}}},
                      _content_type="application/merge-patch+json")
    assert e.value.status == 409
    v1.patch_node("gpu-1", [{"op": "add", "path": "/metadata/labels/x", "value": "y"}])
    assert v1.read_node("gpu-1").metadata.labels["x"] == "y"
    assert [c.status for c in api.calls][-3:] == [409, 200, 200]


def test_cli_refusal_against_the_api(api, tmp_path):
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    store = make_store(api)
    store.record(decide("gpu-1", None, NodeSeen(), now=NOW).transition)
    p = cli_util.screener("node", "set", "gpu-1", "healthy", "--reason", "x", "--kubeconfig",
                          str(kubeconfig), "--spool", str(tmp_path / "s.db"))
    assert p.returncode == 2 and "refused" in p.stderr and "Traceback" not in p.stderr
    assert api.node("gpu-1")["metadata"]["labels"][LABEL_STATE] == "burnin"


def test_in_cluster_configuration_is_detected(monkeypatch, tmp_path):
    from screener.errors import ConfigError
    from screener.stores import open_store

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ConfigError, match="in-cluster"):  # no service-account token in this sandbox
        open_store("kube", spool=tmp_path / "s.db")


# --- the placement-gate example Job ----------------------------------------------------------------


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _has(obj, path):
    for p in path:
        try:
            obj = obj[p]
        except (KeyError, IndexError, TypeError):
            return False
    return True


def test_training_job_manifest_is_valid_and_gated():
    import types

    import kubernetes.client
    import yaml

    path = Path(__file__).resolve().parents[1] / "examples" / "training-job.yaml"
    raw = yaml.safe_load(path.read_text())
    client = kubernetes.client.ApiClient()
    job = client.deserialize(types.SimpleNamespace(data=json.dumps(raw)), "V1Job")
    back = client.sanitize_for_serialization(job)
    # Every field in the file is a field of the real batch/v1 Job schema (none silently dropped).
    missing = [p for p in _paths(raw) if not _has(back, p)]
    assert missing == []

    spec = job.spec.template.spec
    assert spec.restart_policy == "Never"  # required by podFailurePolicy
    (term,) = spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution \
        .node_selector_terms
    assert [(e.key, e.operator, e.values) for e in term.match_expressions] == [
        (LABEL_STATE, "In", ["healthy"])]
    assert not spec.tolerations  # never tolerate the screener.io/state taints
    names = {c.name for c in spec.containers + (spec.init_containers or [])}
    rules = {(r.action, r.on_exit_codes.container_name, tuple(r.on_exit_codes.values))
             for r in job.spec.pod_failure_policy.rules if r.on_exit_codes}
    # 75 hardware suspect and 76 numeric failure fail the Job; 77 (a peer failed) is requeued;
    # 75 from the preflight init container fails only its pod (issue 24.1).
    assert rules == {("FailJob", "trainer", (75, 76)), ("Ignore", "trainer", (77,)),
                     ("Ignore", "preflight", (75,))}
    assert [c.name for c in spec.init_containers] == ["preflight"]
    assert spec.init_containers[0].command[:2] == ["screener", "preflight"]
    for r in job.spec.pod_failure_policy.rules:
        if r.on_exit_codes:
            assert r.on_exit_codes.container_name in names and r.on_exit_codes.operator == "In"
            assert 0 not in r.on_exit_codes.values
            assert r.on_exit_codes.values == sorted(set(r.on_exit_codes.values))
    env = {e.name for e in spec.containers[0].env}
    assert {"NODE_NAME", "SCREENER_ALARM_DIR"} <= env


def test_server_watch_streams_node_changes(api):
    import kubernetes.client
    import kubernetes.watch

    v1 = kubernetes.client.CoreV1Api(api.api_client())
    seen = []
    timer = threading.Timer(0.3, lambda: api.mutate("gpu-2", lambda n: n["metadata"]["labels"]
                                                    .update({"x": "1"})))
    timer.start()
    for ev in kubernetes.watch.Watch().stream(v1.list_node, timeout_seconds=1):
        seen.append((ev["type"], ev["object"].metadata.name))
        if ev["type"] == "MODIFIED":
            break
    timer.join()
    assert seen[:3] == [("ADDED", "gpu-1"), ("ADDED", "gpu-2"), ("ADDED", "cpu-1")]
    assert seen[-1] == ("MODIFIED", "gpu-2")
    assert ("watch", "nodes", "") in api.verbs()


# --- hostile kubeconfigs: one line naming the file, exit 2, never a traceback ---------------------

GOOD_CONTEXT = ("current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
                "users: [{name: u, user: {token: t}}]\n")
KUBECONFIGS = {
    "words": b"garbage",
    "binary": b"\x00\xff\xfe\x80 binary",
    "empty": b"",
    "unclosed": b"a: [1, 2",
    "list": b"- 1\n- 2\n",
    "number": b"42",
    "clusters-int": b"apiVersion: v1\nclusters: 5\n",
    "clusters-strings": b"clusters: [a, b]\n",
    "cluster-not-map": b"clusters: [{name: c, cluster: 7}]\n",
    "context-int": b"current-context: x\ncontexts: [{name: x, context: 7}]\n",
    "users-map": b"users: {u: 1}\n",
    "name-int": b"clusters: [{name: 5, cluster: {server: http://h}}]\n",
    "server-int": ("clusters: [{name: c, cluster: {server: 5}}]\n" + GOOD_CONTEXT).encode(),
    "server-list": ("clusters: [{name: c, cluster: {server: [1]}}]\n" + GOOD_CONTEXT).encode(),
    "deep-flow": b"a: " + b"[" * 5000 + b"]" * 5000,
    "deep-map": b"a: " + b"{b: " * 3000 + b"1" + b"}" * 3000,
    "anchor-bomb": b"a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nd: [*c, *c]\ne: [",
    "tab-indent": b"clusters:\n\t- name: c\n",
    "no-context": b"clusters: [{name: c, cluster: {server: http://h}}]\ncurrent-context: nope\n",
    "context-missing-cluster": b"current-context: x\ncontexts: [{name: x, context: {cluster: c}}]\n"
                               b"clusters: [{name: other, cluster: {server: http://h}}]\n",
    "bad-exec": ("clusters: [{name: c, cluster: {server: http://h}}]\ncurrent-context: x\n"
                 "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
                 "users: [{name: u, user: {exec: 5}}]\n").encode(),
    "python-tag": b"!!python/object/apply:os.system ['true']\n",
    "huge": b"a: " + b"x" * (1024 * 1024 + 10),
}


def test_hostile_kubeconfigs_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Through the console entry point (screener.cli.run), in this process to keep it quick."""
    import os

    from screener.cli import run

    paths = {}
    for name, data in KUBECONFIGS.items():
        paths[name] = tmp_path / name
        paths[name].write_bytes(data)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    paths["fifo"] = fifo
    assert len(paths) >= 20
    for name, path in paths.items():
        started = time.monotonic()
        monkeypatch.setattr(sys, "argv", ["screener", "node", "status", "--kubeconfig", str(path),
                                          "--spool", str(tmp_path / "spool.db")])
        with pytest.raises(SystemExit) as e:
            run()
        out = capsys.readouterr()
        assert e.value.code == 2, (name, out.err)
        lines = [ln for ln in out.err.splitlines() if ln.strip()]
        assert len(lines) == 1 and str(path) in lines[0], (name, out.err)
        assert "Traceback" not in out.err and out.out == ""
        assert time.monotonic() - started < 10, name


def test_a_garbled_history_annotation_on_the_node_does_not_stop_its_events(api):
    """The Node's annotation is writable by more than screener: entries with a time that is no
    number, or serials that are no list, are skipped, and the node's events are still recorded."""
    junk = [{"id": "junk-time", "time": "yesterday", "to": "healthy"},
            {"id": "junk-list", "time": ["x"], "to": "healthy"},
            {"id": "junk-serials", "time": NOW - 10, "to": "healthy", "failure": True,
             "gpu_serials": 5}]
    for name, raw in (("gpu-2", {"v": 2, "last": junk}), ("cpu-1", junk)):  # summary, old format
        node = api.nodes[name]
        node["metadata"]["labels"][LABEL_STATE] = "healthy"
        node["metadata"].setdefault("annotations", {})[ANNOTATION_HISTORY] = json.dumps(raw)
        store = make_store(api)
        alarm = AlarmRecord(alarm_id=f"a-{name}", check="ring_replay", step=3, settled=False,
                            suspect_ranks=(), suspect_nodes=(SuspectNode(name, name),),
                            node=name)
        assert apply_event(store, name, alarm, now=NOW).state == S.SUSPECT
        assert store.get_state(name) == S.SUSPECT
        assert stored_history(api, name)[-1]["to"] == "suspect"


def test_node_annotations_nested_past_the_parsers_limit_are_unparsable_not_fatal(api):
    deep = "[" * 50_000 + "]" * 50_000  # json raises RecursionError here, not ValueError
    api.nodes["gpu-2"]["metadata"]["annotations"][ANNOTATION_HISTORY] = deep
    api.nodes["gpu-1"]["metadata"]["annotations"][ANNOTATION_VERDICT] = deep
    store = make_store(api)
    assert apply_event(store, "gpu-2", NodeSeen(), now=NOW).state == S.BURNIN
    assert store.get_state("gpu-2") == S.BURNIN
    assert "unparsable" in store.get_verdict("gpu-1")
    api.nodes["gpu-1"]["metadata"]["annotations"][ANNOTATION_VERDICT] = "[1]"  # not an object
    assert "unparsable" in store.get_verdict("gpu-1")


def test_a_replay_never_undoes_a_persons_later_decision(api, tmp_path):
    """While this daemon could not write, it spooled decisions taken on the node's state then. A
    person who meanwhile set the node (from a machine that could reach the API) decided later and
    knew more: the replay drops the stale transitions, and the person's state stands."""
    from screener.lifecycle.records import ACTOR_HUMAN

    sleeps: list = []
    daemon = make_store(api, sleeps, spool=Spool(tmp_path / "spool.db"),
                        retry=RetryPolicy(attempts=2, base_delay=0.01))
    daemon.record(tr("gpu-1", None, S.BURNIN))
    daemon.record(tr("gpu-1", S.BURNIN, S.HEALTHY, NOW + 1))
    api.down()
    daemon.record(tr("gpu-1", S.HEALTHY, S.SUSPECT, NOW + 2))
    daemon.record(tr("gpu-1", S.SUSPECT, S.QUARANTINED, NOW + 3))
    assert daemon.pending() == 2
    api.up()
    person = make_store(api, sleeps)
    person.record(tr("gpu-1", S.HEALTHY, S.REPAIR, NOW + 4, actor=ACTOR_HUMAN))
    assert daemon.replay() == 0 and daemon.pending() == 0
    node = api.node("gpu-1")
    assert node["metadata"]["labels"][LABEL_STATE] == "repair"
    assert [h["to"] for h in stored_history(api, "gpu-1")] == ["burnin", "healthy", "repair"]
    # Hardware evidence is never dropped: the person could not see it while it was spooled.
    daemon.record(tr("gpu-2", None, S.BURNIN))
    api.down()
    daemon.record(tr("gpu-2", S.BURNIN, S.QUARANTINED, NOW + 5, failure=True))
    api.up()
    person.record(tr("gpu-2", S.BURNIN, S.HEALTHY, NOW + 6, actor=ACTOR_HUMAN))
    assert daemon.replay() == 1
    assert api.node("gpu-2")["metadata"]["labels"][LABEL_STATE] == "quarantined"
    daemon.close()
    person.close()


def test_a_missing_namespace_is_named_with_how_to_create_it(api, tmp_path):
    """A create in a namespace that does not exist is a 404; taken for a lost race it read
    'budget record: still conflicting' (issue 23.7)."""
    api.namespaces = {"default"}
    store = make_store(api, namespace="screener-nowhere")
    with pytest.raises(KubeApiError) as e:
        store.record(tr("gpu-1", None, S.REPAIR))
    text = str(e.value)
    assert "namespace 'screener-nowhere' does not exist" in text, text
    assert "kubectl create namespace screener-nowhere" in text and "conflicting" not in text
    events = make_store(api, namespace="default", event_namespace="events-nowhere")
    with pytest.raises(KubeApiError, match="namespace 'events-nowhere' does not exist .*Events"):
        events.record(tr("gpu-2", None, S.BURNIN))
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    p = cli_util.screener("node", "set", "gpu-2", "repair", "--reason", "x", "--store", "kube",
                          "--kubeconfig", str(kubeconfig), "--spool", str(tmp_path / "spool.db"),
                          env={"POD_NAMESPACE": "screener-nowhere"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "kubectl create namespace screener-nowhere" in lines[0], p.stderr


# --- the budget record's bounds (issue 36.1, 36.2) ---------------------------------------------


def test_a_count_raises_the_record_by_at_most_the_policys_step_and_a_future_stamp_is_counted():
    """The admission policy admits a count that raises the fleet by at most RECORD_MAX_RAISE a
    write: a fleet that grew by more within one count is recorded that far, the rest at the next
    counts (a smaller budget meanwhile, the safe direction). A record counted in the future
    (rewritten, or a clock far off) is counted again at once instead of never growing stale."""
    from screener.stores.kube import formats as kf

    step = kf.RECORD_MAX_RAISE
    with KubeAPI() as server:
        for k in range(step + 20):
            server.add_node(f"n-{k:05d}", labels={LABEL_STATE: "healthy"})
        rec = kf.BudgetRecord(fleet=10, counted=NOW - 7200)
        server._store_configmap("screener-system", kf.BUDGET_CONFIGMAP,
                                rec.configmap("screener-system"), None)
        store = make_store(server)
        assert store.budget_view().fleet == 10 + step
        written = kf.BudgetRecord.from_configmap(server.configmap("screener-system",
                                                                  kf.BUDGET_CONFIGMAP))
        assert written.fleet == 10 + step and written.counter == "" and written.counted == NOW + 5
        # Stamped a day ahead: counted again now, all of the fleet this time (10 + step is the
        # record's count, so the rest is within one step).
        with server._lock:
            server.configmaps[("screener-system", kf.BUDGET_CONFIGMAP)]["data"]["counted"] = \
                repr(NOW + 86400)
        assert store.budget_view().fleet == step + 20
        store.close()


def test_a_lease_longer_than_any_the_store_takes_holds_nobody_off():
    """A record rewritten with a lease far in the future (admission has no clock to refuse it)
    would stop every honest count for ever; the store counts a stale record anyway."""
    from screener.stores.kube import formats as kf

    with KubeAPI() as server:
        for k in range(3):
            server.add_node(f"n-{k}", labels={LABEL_STATE: "healthy"})
        rec = kf.BudgetRecord(fleet=500, counted=NOW - 7200, counter="gpu-hostile",
                              counting_until=NOW + 10**6)
        server._store_configmap("screener-system", kf.BUDGET_CONFIGMAP,
                                rec.configmap("screener-system"), None)
        store = make_store(server)
        assert store.budget_view().fleet == 3
        store.close()
