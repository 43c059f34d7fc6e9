"""A fleet failing at once, and an API server that stops answering (issue 22), against the
Kubernetes API test server through the official client over HTTP.

Each simulated daemon is a thread with its own KubeStore and connections, told apart on the server
by its User-Agent. The long runs (150 of 1,500, 300 of 3,000, before and after side by side) are
benchmarks/bench_fleet.py; these are their small slices. The outages go through a real TCP proxy
(tests/fakes/tcpproxy.py) that black-holes or resets connections.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from typing import Any

import kubernetes.client
import pytest

from fakes.kubeapi import KubeAPI
from fakes.tcpproxy import TcpProxy
from screener.lifecycle.apply import apply_event
from screener.lifecycle.machine import NodeSeen
from screener.lifecycle.records import Transition
from screener.stores.kube import formats as kf
from screener.stores.kube import KubeStore, KubeTimeouts, RetryPolicy, TransientKubeError
from screener.stores.spool import Spool
from screener.types import CONDITION_TYPE, LABEL_STATE, NodeState, Outcome, Verdict

S = NodeState
NS = "screener-system"
BAD = Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm-fp32",
              evidence={"confirmed": True})
QUICK = KubeTimeouts(connect_s=0.5, read_s=0.4, call_s=1.0, unreachable_s=5.0)


def daemon_store(url: str, node: str, **kw: Any) -> KubeStore:
    """A store as one node's daemon has it: its own client, its own name on the wire."""
    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.retries = url, False
    client = kubernetes.client.ApiClient(cfg)
    client.user_agent = f"daemon/{node}"
    kw.setdefault("sleep", lambda s: time.sleep(min(s, 0.05)))
    return KubeStore(client, namespace=NS, instance=node, **kw)


def healthy_fleet(api: KubeAPI, n: int, *, counted: float) -> list[str]:
    names = [f"gpu-{k:04d}" for k in range(n)]
    for name in names:
        api.add_node(name, labels={LABEL_STATE: "healthy"})
    rec = kf.BudgetRecord(fleet=n, counted=counted)
    api._store_configmap(NS, kf.BUDGET_CONFIGMAP, rec.configmap(NS), None)
    return names


def at_once(nodes: list[str], work: Any) -> dict[str, str]:
    """Run work(node) in one thread per node, released together; node -> error text."""
    barrier = threading.Barrier(len(nodes))
    errors: dict[str, str] = {}

    def run(node: str) -> None:
        barrier.wait()
        try:
            work(node)
        except Exception as e:  # noqa: BLE001 - collected and asserted empty
            errors[node] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_thirty_of_two_hundred_failing_at_once_claim_in_parallel_and_the_budget_is_exact():
    """The small slice of bench_fleet: claims do not queue on one object, the budget (20 of 200)
    holds exactly, the 10 past it are held in suspect and tainted, and per node the work is a
    handful of requests with few conflicts."""
    with KubeAPI() as api:
        names = healthy_fleet(api, 200, counted=time.time())
        failing = names[::200 // 30][:30]
        stores = {n: daemon_store(api.url, n) for n in failing}
        api.clear_calls()
        errors = at_once(failing, lambda n: apply_event(stores[n], n, BAD, now=time.time()))
        assert not errors, errors
        states = {n: api.node(n) for n in failing}
        out = [n for n, o in states.items() if o["metadata"]["labels"][LABEL_STATE] == "quarantined"]
        held = [n for n, o in states.items() if o["metadata"]["labels"][LABEL_STATE] == "suspect"
                and {"key": "screener.io/state", "value": "suspect", "effect": "NoSchedule"}
                in o["spec"]["taints"]]
        assert len(out) == 20 and len(held) == 10, (len(out), len(held))
        with api._lock:
            slot_nodes = sorted(cm["data"]["node"] for (ns, name), cm in api.configmaps.items()
                                if name.startswith(kf.SLOT_PREFIX))
        assert slot_nodes == sorted(out)
        requests = Counter(c.agent for c in api.calls)
        conflicts = Counter(c.agent for c in api.calls if c.status == 409)
        agents = [f"daemon/{n}" for n in failing]
        assert statistics.median(requests[a] for a in agents) <= 12, requests
        assert statistics.median(conflicts[a] for a in agents) <= 3, conflicts
        assert not any(c.verb == "list" and c.resource == "nodes" for c in api.calls)
        for s in stores.values():
            s.close()


def test_a_stale_record_is_recounted_by_one_daemon_the_others_use_it():
    with KubeAPI() as api:
        names = healthy_fleet(api, 60, counted=time.time() - 7200)
        daemons = names[:20]
        stores = {n: daemon_store(api.url, n, page_size=25) for n in daemons}
        api.clear_calls()
        errors = at_once(daemons, lambda n: apply_event(stores[n], n, NodeSeen(), now=time.time()))
        assert not errors, errors
        counters = {c.agent for c in api.calls if c.verb == "list" and c.resource == "nodes"}
        assert len(counters) == 1, counters  # one daemon paid for the count (3 pages of 25)
        assert sum(1 for c in api.calls if c.verb == "list" and c.resource == "nodes") == 3
        record = kf.BudgetRecord.from_configmap(api.configmap(NS, kf.BUDGET_CONFIGMAP))
        assert record.fleet == 60 and time.time() - record.counted < 60 and not record.counter
        for s in stores.values():
            s.close()


@pytest.mark.slow
def test_concurrent_registrations_each_count_once_with_condition_and_event():
    """30 daemons registering 90 new nodes at once (3 each): the fleet count, the condition and
    the Event of every node, none lost to conflicts, none counted twice."""
    with KubeAPI() as api:
        names = [f"new-{k:03d}" for k in range(90)]
        for n in names:
            api.add_node(n)
        api._store_configmap(NS, kf.BUDGET_CONFIGMAP,
                             kf.BudgetRecord(fleet=0, counted=time.time() - 1).configmap(NS), None)
        groups = {names[k]: names[k::30] for k in range(30)}
        stores = {g: daemon_store(api.url, g) for g in groups}

        def register(g: str) -> None:
            for n in groups[g]:
                apply_event(stores[g], n, NodeSeen(), now=time.time())

        errors = at_once(list(groups), register)
        assert not errors, errors
        view = stores[names[0]].budget_view()
        assert view.fleet == 90 and len(view.registered) == 90
        for n in names:
            node = api.node(n)
            assert node["metadata"]["labels"][LABEL_STATE] == "burnin"
            assert [c["status"] for c in node["status"]["conditions"]
                    if c["type"] == CONDITION_TYPE] == ["False"]
        assert sorted(e["involvedObject"]["name"] for e in api.events) == names
        for s in stores.values():
            s.close()


# --- an API server that stops answering -------------------------------------------------------------


@pytest.fixture
def proxied():
    with KubeAPI() as api:
        api.add_node("gpu-1", labels={LABEL_STATE: "healthy"})
        api.add_node("gpu-2", labels={LABEL_STATE: "healthy"})
        api._store_configmap(NS, kf.BUDGET_CONFIGMAP,
                             kf.BudgetRecord(fleet=2, counted=time.time()).configmap(NS), None)
        proxy = TcpProxy(api.port)
        yield api, proxy
        proxy.close()


@pytest.mark.slow
def test_a_black_holed_api_fails_within_the_timeout_and_the_transition_is_spooled(proxied, tmp_path):
    api, proxy = proxied
    store = daemon_store(proxy.url, "gpu-1", timeouts=QUICK, spool=Spool(tmp_path / "spool.db"),
                         retry=RetryPolicy(base_delay=0.05))
    # Every request black-holed: a read fails within call_s, not after minutes.
    proxy.add("blackhole")
    t0 = time.monotonic()
    with pytest.raises(TransientKubeError, match="unavailable"):
        store.get_state("gpu-1")
    assert time.monotonic() - t0 < QUICK.call_s + 1.0
    # Then the API counts as unreachable for a while: calls fail at once, not each its timeout.
    t0 = time.monotonic()
    with pytest.raises(TransientKubeError, match="did not answer in time"):
        store.get_state("gpu-2")
    assert time.monotonic() - t0 < 0.1
    proxy.clear()
    store.calls._unreachable_until = 0.0  # (the window's length is tested above; skip the wait)

    # Reads answered, the node's write black-holed: the decided transition is spooled.
    proxy.add("blackhole", rb"^PATCH /api/v1/nodes/gpu-1 ")
    t0 = time.monotonic()
    d = apply_event(store, "gpu-1", BAD, now=time.time())
    assert d.state == S.QUARANTINED and store.pending() == 1
    assert time.monotonic() - t0 < QUICK.call_s + 1.5
    assert api.node("gpu-1")["metadata"]["labels"][LABEL_STATE] == "healthy"
    proxy.clear()
    store.calls._unreachable_until = 0.0
    assert store.replay() == 1 and store.pending() == 0
    node = api.node("gpu-1")
    assert node["metadata"]["labels"][LABEL_STATE] == "quarantined"
    assert [e["reason"] for e in api.events] == ["KnownAnswerMismatch"]
    store.close()


@pytest.mark.slow
def test_the_daemons_tick_goes_on_while_the_api_is_black_holed(proxied, tmp_path):
    from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome
    from screener.stores.kube.bound import KubeNodeObject

    api, proxy = proxied
    api.add_node(NODE, labels={LABEL_STATE: "healthy"})
    store = daemon_store(proxy.url, NODE, timeouts=QUICK, spool=Spool(tmp_path / "spool.db"),
                         retry=RetryPolicy(base_delay=0.05))
    rig = DaemonRig(tmp_path, ScriptedRunner(outcome(Outcome.PASS)), store=store, taint=store,
                    idle_window_s=10_000.0, node_object=KubeNodeObject(store, NODE))
    try:
        rig.tick()
        probes = rig.probe_calls
        proxy.add("blackhole")
        rig.drop_alarm("blackholed-1", settled=False)
        t0 = time.monotonic()
        report = rig.tick(advance=120.0)  # intake, replay, budget, probes: all due
        took = time.monotonic() - t0
        assert took < 2 * QUICK.call_s + 2.0, took
        assert rig.probe_calls == probes + 1  # the probes ran
        assert any(e.startswith("intake:") and "blackholed-1" in e for e in report.errors), \
            report.errors
        assert list((tmp_path / "alarms").glob("*.json"))  # the alarm waits, not lost
        proxy.clear()
        store.calls._unreachable_until = 0.0
        rig.tick(advance=5.0)
        assert api.node(NODE)["metadata"]["labels"][LABEL_STATE] == "suspect"
    finally:
        rig.close()


def test_writes_whose_answers_are_lost_are_completed_not_doubled(proxied, tmp_path):
    """The proxy forwards each write and resets the connection before its answer: the node patch,
    the slot claim, the registration, the condition and the Event each applied once, the unit
    complete."""
    api, proxy = proxied
    api.add_node("gpu-3")
    store = daemon_store(proxy.url, "gpu-3", timeouts=QUICK, spool=Spool(tmp_path / "spool.db"),
                         retry=RetryPolicy(base_delay=0.01))
    for pattern in (rb"^PATCH /api/v1/nodes/gpu-3 ", rb"^POST /api/v1/namespaces/\S+/events",
                    rb"^PATCH /api/v1/nodes/gpu-3/status", rb"^(PUT|POST) \S+/configmaps"):
        proxy.add("reset-after", pattern, count=1)
    apply_event(store, "gpu-3", NodeSeen(), now=time.time())  # registration: new -> burnin
    proxy.add("reset-after", rb"^POST \S+/configmaps", count=1)  # the slot claim
    proxy.add("reset-after", rb"^PATCH /api/v1/nodes/gpu-3 ", count=1)
    d = apply_event(store, "gpu-3", BAD, now=time.time() + 1)
    assert d.state == S.QUARANTINED
    resets = [line for line, action in proxy.seen if action == "reset-after"]
    assert len(resets) == 6, proxy.seen
    store.replay()
    assert store.pending() == 0
    node = api.node("gpu-3")
    assert node["metadata"]["labels"][LABEL_STATE] == "quarantined"
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE] == ["True"]
    assert [e["reason"] for e in api.events if e["involvedObject"]["name"] == "gpu-3"] == [
        "NewNode", "KnownAnswerMismatch"]
    view = store.budget_view()
    assert view.fleet == 3 and [c.node for c in view.claims.values()] == ["gpu-3"]
    hist = [e["to"] for e in kf.history_entries(api.configmap(NS, "screener-history-gpu-3"))]
    assert hist == ["burnin", "quarantined"]
    store.close()


def test_a_registration_cut_short_is_completed_by_the_replay(proxied, tmp_path):
    """The node patch lands, then every other write fails: the transition is spooled whole, and
    the replay writes the history, the count, the condition and the Event, not the node again."""
    api, proxy = proxied
    api.add_node("gpu-4")
    store = daemon_store(proxy.url, "gpu-4", timeouts=QUICK, spool=Spool(tmp_path / "spool.db"),
                         retry=RetryPolicy(attempts=2, base_delay=0.01))
    proxy.add("reset-before", rb"^(PUT|POST|PATCH) /api/v1/(namespaces|nodes/gpu-4/status)")
    t = Transition(node="gpu-4", time=time.time(), from_state=None, to_state=S.BURNIN,
                   reason="new", code="NewNode")
    store.record(t)
    assert store.pending() == 1
    assert api.node("gpu-4")["metadata"]["labels"][LABEL_STATE] == "burnin"
    assert api.configmap(NS, "screener-history-gpu-4") is None and not api.events
    proxy.clear()
    patches = sum(1 for line, _ in proxy.seen if line.startswith(b"PATCH /api/v1/nodes/gpu-4 "))
    assert store.replay() == 1 and store.pending() == 0
    assert sum(1 for line, _ in proxy.seen if line.startswith(b"PATCH /api/v1/nodes/gpu-4 ")) \
        == patches  # the node was not written twice
    assert store.budget_view().fleet == 3
    assert [e["reason"] for e in api.events] == ["NewNode"]
    node = api.node("gpu-4")
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE] == ["False"]
    assert [e["id"] for e in kf.history_entries(api.configmap(NS, "screener-history-gpu-4"))] == [t.id]
    store.close()


def test_the_serial_lookup_reads_from_the_cache_and_histories_stay_bounded():
    from screener.stores.kube import KubeStore as Store

    with KubeAPI() as api:
        api.add_node("gpu-1", labels={LABEL_STATE: "healthy"})
        store = Store(api.api_client(), namespace=NS, sleep=lambda s: None, instance="t")
        api.clear_calls()
        store.failures_for(["SN-1"], 0.0)
        lists = [c for c in api.calls if c.verb == "list"]
        assert len(lists) == 1 and lists[0].cached
        # Bounded by entries and bytes, a node's recent failures dropped last.
        entries = [{"id": f"t{k}", "time": k, "failure": k % 10 == 0, "pad": "p" * 900}
                   for k in range(300)]
        kept = kf.bounded_entries(entries, kf.HISTORY_KEEP, kf.HISTORY_BYTES)
        assert len(kept) <= kf.HISTORY_KEEP and kept[-1]["id"] == "t299"
        assert sum(1 for e in kept if e["failure"]) == 30  # every failure kept, older others gone
        body = kf.history_configmap("gpu-1", entries, namespace=NS)
        assert len(body["data"]["history"]) <= kf.HISTORY_BYTES
        store.close()
