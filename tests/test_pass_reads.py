"""A daemon pass reads each object once (issue 36.6), and a copy that went stale within the pass
costs a conflict and a fresh read, never a lost change.

Before: one `screener daemon --once` taking a settled alarm made 21 requests on the API test server
(8 GETs of its Node, 5 of its history ConfigMap: every step read them again); on a real server 30
of them failing together made 23-24 each. The pass (KubeStore.one_pass) now answers a read from
what it has read or written of the object, and forgets the object when a write to it fails.

Real parts: the Kubernetes API test server (tests/fakes/kubeapi.py) over HTTP through the official
client, and a real `screener daemon --once` process for the pass.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from fakes.kill9 import NAMESPACE, Campaign, TappedAPI, audit
from fakes.kubeapi import KubeAPI
from screener.audit.alarms import write_alarm_file
from screener.lifecycle.apply import apply_event
from screener.lifecycle.records import Transition
from screener.stores.kube import formats as kf
from screener.stores.kube import KubeStore
from screener.alarmfile import AlarmRecord
from screener.types import LABEL_STATE, NodeState, SuspectNode

ROOT = Path(__file__).resolve().parents[1]
NOW = 1_800_000_000.0
WRITES = ("create", "update", "patch", "delete")


def reads(api: KubeAPI, verb: str, resource: str) -> int:
    return sum(1 for c in api.calls if c.verb == verb and c.resource == resource)


def alarm(node: str, alarm_id: str = "a-1") -> AlarmRecord:
    return AlarmRecord(alarm_id=alarm_id, check="ring_replay", step=3, settled=True,
                       suspect_ranks=(0,), suspect_nodes=(SuspectNode(node, node),), node=node,
                       job="train")


@pytest.mark.slow
def test_a_daemon_pass_that_takes_an_alarm_reads_its_node_and_history_once(tmp_path):
    """The whole pass of a real `daemon --once` (start-up, probes, intake, the quarantine) on a
    fleet of 100: its Node and its history ConfigMap are each read once, at most 12 requests in
    all (the five writes of the quarantine among them), and the transition is whole."""
    with TappedAPI(hold=(0.0, 0.0)) as api:
        campaign = Campaign(api, tmp_path, seed=0, fleet=100)
        node = "gpu-bad"
        api.add_node(node, labels={LABEL_STATE: "healthy"})
        env = campaign.env(node)
        write_alarm_file(alarm(node), Path(env["SCREENER_ALARM_DIR"]))
        api.clear_calls()
        done = subprocess.run([sys.executable, "-m", "screener.cli", "daemon", "--once", "--json"],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 75, done.stderr[-2000:]
        calls = Counter((c.verb, c.resource, c.subresource, c.name) for c in api.calls)
        assert calls[("get", "nodes", "", node)] == 1, calls
        assert calls[("get", "configmaps", "", f"screener-history-{node}")] == 1, calls
        assert len(api.calls) <= 12, calls
        assert audit(api, node).whole, audit(api, node)


@pytest.fixture
def api():
    with TappedAPI(hold=(0.0, 0.0)) as server:
        server.add_node("gpu-1", labels={LABEL_STATE: "healthy", "team": "a"})
        for i in range(20):
            server.add_node(f"fleet-{i}", labels={LABEL_STATE: "healthy"})
        yield server


def store_of(api: KubeAPI) -> KubeStore:
    return KubeStore(api.api_client(), namespace=NAMESPACE, clock=lambda: NOW,
                     sleep=lambda s: None, instance="gpu-1")


def test_within_a_pass_a_read_is_answered_from_what_the_pass_read_or_wrote(api):
    store = store_of(api)
    with store.one_pass():
        store.get_state("gpu-1")
        store.history("gpu-1")
        store.get_verdict("gpu-1")
        store.set_screening_taint("gpu-1", True)  # the patch's answer is the pass's copy now
        assert store.history("gpu-1") == []
        store.get_state("gpu-1")
    assert reads(api, "get", "nodes") == 1
    assert reads(api, "get", "configmaps") == 1
    store.get_state("gpu-1")  # outside a pass every read asks the server
    store.get_state("gpu-1")
    assert reads(api, "get", "nodes") == 3
    store.close()


def test_a_copy_gone_stale_in_the_pass_costs_a_conflict_and_a_fresh_read_not_a_change(api):
    """Another writer changes the Node after the pass read it: the pass's write carries the old
    resourceVersion, is refused (409), reads afresh and writes again; the other writer's label
    stays, and the quarantine that follows decides on the fresh Node."""
    store = store_of(api)
    with store.one_pass():
        assert store.get_state("gpu-1").value == "healthy"
        api.mutate("gpu-1", lambda n: n["metadata"]["labels"].update({"team": "b"}))
        store.set_screening_taint("gpu-1", True)
        node = api.node("gpu-1")
        assert node["metadata"]["labels"]["team"] == "b"
        assert any(t["key"] == "screener.io/screening" for t in node["spec"].get("taints") or [])
        assert reads(api, "get", "nodes") == 2
        assert [c.status for c in api.calls if c.verb == "patch"] == [409, 200]
        api.mutate("gpu-1", lambda n: n["metadata"]["labels"].update({LABEL_STATE: "suspect"}))
        # Decided on the pass's copy (healthy); the Node write is refused, and the decision is
        # made again on the fresh Node (suspect): confirmed suspect -> quarantined.
        decision = apply_event(store, "gpu-1", alarm("gpu-1"), now=NOW)
        assert decision.transitions[-1].from_state.value == "suspect"
    assert audit(api, "gpu-1").whole, audit(api, "gpu-1")
    store.close()


def test_a_failed_configmap_write_forgets_the_copy(api):
    """The pass wrote the node's history; another writer then adds an entry to the ConfigMap. The
    pass's next history write carries the old resourceVersion, is refused (409), reads the
    ConfigMap afresh once and merges: both entries are kept."""
    store = store_of(api)
    name = kf.history_configmap_name("gpu-1")
    with store.one_pass():
        apply_event(store, "gpu-1", alarm("gpu-1"), now=NOW)
        with api._lock:
            cm = copy.deepcopy(api.configmaps[(NAMESPACE, name)])
            entries = kf.history_entries(cm)
            foreign = {**entries[-1], "id": "foreign-1", "time": NOW + 1, "reason": "by hand"}
            body = kf.history_configmap("gpu-1", entries + [foreign], namespace=NAMESPACE)
            api._store_configmap(NAMESPACE, name, body, cm)
        got = reads(api, "get", "configmaps")
        store.record(Transition(node="gpu-1", time=NOW + 2, from_state=NodeState.QUARANTINED,
                                to_state=NodeState.REPAIR, reason="sent to repair",
                                code="SentToRepair", actor="person"))
        assert reads(api, "get", "configmaps") == got + 1
    ids = [e["id"] for e in kf.history_entries(api.configmap(NAMESPACE, name))]
    assert "foreign-1" in ids and len(ids) == 3, ids
    store.close()


def test_another_thread_does_not_see_the_pass(api):
    store = store_of(api)
    with store.one_pass():
        store.get_state("gpu-1")
        t = threading.Thread(target=lambda: [store.get_state("gpu-1") for _ in range(2)])
        t.start()
        t.join()
        store.get_state("gpu-1")
    assert reads(api, "get", "nodes") == 3
    store.close()
