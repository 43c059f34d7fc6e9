"""The fleet's slots and registrations whatever races (issue 36.7): one budget slot per node with
two daemons on one node, no registration lost from the fleet count while counts run, and a
takeover of expired reboot slots that fills the capacity.

Real processes (spawned interpreters, tests/fakes/race_workers.py), each its own KubeStore over
HTTP to the Kubernetes API test server, started together at barriers. Before: two daemons on one
node left it two slots; 1,500 registrations from 8 processes left the fleet 2 to 24 short until
the next count; 10 racers over 3 expired reboot slots once claimed 2 with one free.
"""

from __future__ import annotations

import multiprocessing
import queue
import time

import pytest

from fakes.race_workers import NAMESPACE, worker
from fakes.kubeapi import KubeAPI
from screener.stores.kube import formats as kf
from screener.stores.kube import KubeStore
from screener.stores.slots import KubeSlots
from screener.types import LABEL_STATE

WORKERS = 8
SAME_NODE_ROUNDS = 8
PER_WORKER = 12  # fresh nodes each worker gives a first state
TAKEOVER_ROUNDS = 4
CAPACITY = 3


def slots_by_node(api: KubeAPI, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with api._lock:
        for (ns, name), cm in api.configmaps.items():
            if ns == NAMESPACE and name.startswith(prefix):
                node = (cm.get("data") or {}).get("node", "")
                out[node] = out.get(node, 0) + 1
    return out


@pytest.mark.timeout(240)
def test_slots_and_registrations_hold_whatever_races(tmp_path):
    plan = {"same_node_rounds": SAME_NODE_ROUNDS, "max_registered": 5,
            "register": [[f"new-{w}-{k}" for k in range(PER_WORKER)] for w in range(WORKERS)],
            "takeover_rounds": TAKEOVER_ROUNDS, "capacity": CAPACITY}
    ctx = multiprocessing.get_context("spawn")
    phase, rounds, out = ctx.Barrier(WORKERS + 1), ctx.Barrier(WORKERS), ctx.Queue()
    with KubeAPI() as api:
        for i in range(100):
            api.add_node(f"fleet-{i}", labels={LABEL_STATE: "healthy"})
        for r in range(SAME_NODE_ROUNDS):
            api.add_node(f"twin-{r}", labels={LABEL_STATE: "healthy"})
        driver = KubeStore(api.api_client(), namespace=NAMESPACE, instance="driver")
        driver.budget_view()  # the record, counted
        procs = [ctx.Process(target=worker, args=(i, api.url, plan, phase, rounds, out))
                 for i in range(WORKERS)]
        for p in procs:
            p.start()
        results: dict[str, dict[int, object]] = {}

        def collect(name: str) -> dict[int, object]:
            got: dict[int, object] = {}
            while len(got) < WORKERS:
                kind, i, data = out.get(timeout=180)
                assert kind != "error", data
                got[i] = data
                assert kind == name, (kind, data)
            return got

        try:
            # 1. Two (eight) daemons on one node: reads held, so they all decide on healthy.
            api.slow(0.05, "get", "nodes")
            phase.wait(timeout=120)
            results["same_node"] = collect("same_node")
            phase.wait(timeout=120)
            api.slow(0, "get", "nodes")
            # 2. Registrations racing while counts run.
            for names in plan["register"]:
                for node in names:
                    api.add_node(node)
            phase.wait(timeout=120)
            results["register"] = collect("register")
            phase.wait(timeout=120)
            # 3. Every reboot slot expired, then the racers.
            for r in range(TAKEOVER_ROUNDS):
                pool = KubeSlots(driver.calls, f"reboot{r}", CAPACITY, ttl=60.0, clock=time.time)
                for k in range(CAPACITY):
                    assert driver.calls.cm_write(pool._body(k, f"gone-{k}", time.time() - 3600))
            phase.wait(timeout=120)
            results["takeover"] = collect("takeover")
            phase.wait(timeout=120)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()

        # 1: each twin quarantined, holding exactly one budget slot.
        slots = slots_by_node(api, kf.SLOT_PREFIX)
        for r in range(SAME_NODE_ROUNDS):
            node = f"twin-{r}"
            assert api.node(node)["metadata"]["labels"][LABEL_STATE] == "quarantined"
            assert slots.get(node) == 1, (node, slots, results["same_node"])
        assert sum(slots.values()) == SAME_NODE_ROUNDS

        # 2: the fleet as the budget reads it is every node with a state, none lost, none twice.
        assert not any(results["register"].values()), results["register"]
        labelled = sum(1 for n in api.nodes.values() if (n["metadata"].get("labels") or {})
                       .get(LABEL_STATE))
        assert labelled == 100 + SAME_NODE_ROUNDS + WORKERS * PER_WORKER
        view = driver.budget.read()
        assert view is not None and view.counted > 0
        assert view.fleet == labelled, (view.fleet, labelled, view.record)

        # 3: every round's capacity filled, by different racers, nobody twice.
        for r in range(TAKEOVER_ROUNDS):
            got = [results["takeover"][i][r] for i in range(WORKERS)]  # type: ignore[index]
            taken = [g for g in got if g is not None]
            assert sorted(taken) == list(range(CAPACITY)), (r, got)
            held = slots_by_node(api, f"screener-reboot{r}-slot-")
            assert len(held) == CAPACITY and all(v == 1 for v in held.values()), (r, held)
        driver.close()


def test_a_count_keeps_a_registration_that_is_still_in_flight():
    """A node registered (before its Node write) when a count lists the Nodes: the count finds
    its registration, counts the node once, and the node's label arriving next does not add it
    twice; a registration stamped after the count began stays one under the new record."""
    with KubeAPI() as api:
        for i in range(10):
            api.add_node(f"fleet-{i}", labels={LABEL_STATE: "healthy"})
        api.add_node("late")
        now = [1_800_000_000.0]
        store = KubeStore(api.api_client(), namespace=NAMESPACE, instance="a",
                          clock=lambda: now[0], sleep=lambda s: None)
        v = store.budget_view()
        assert v.fleet == 10
        store.budget.register_ahead_s = 0.0  # stamped now: the count below begins after it
        store.budget.register(v, "late")
        now[0] += 1
        counted = store.budget._count(store.budget.read())  # the label not written yet
        assert counted.fleet == 11, counted.record
        api.mutate("late", lambda n: n["metadata"]["labels"].update({LABEL_STATE: "burnin"}))
        now[0] += 1
        assert store.budget._count(store.budget.read()).fleet == 11
        store.close()
