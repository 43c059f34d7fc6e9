"""The quarantine budget holds however many daemons race for its last slot.

Eight real processes (each its own Python, its own store and connections) apply a confirmed failure
to eight different healthy nodes of a ten-node fleet at the same instant. The budget is 10% of the
fleet: one node. Every round exactly one node may end quarantined, the other seven held in suspect
(tainted, waiting for a slot), on SQLite (one BEGIN IMMEDIATE transaction around read-decide-write)
and against the Kubernetes API test server (a budget slot ConfigMap created per node out of service;
the server answers 409 AlreadyExists to the create of a taken slot, as a real API server does, and
is made slow to answer reads so that the racers really do read the same state).

benchmarks/bench_store.py --race-rounds N runs the same race for longer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from fakes.kubeapi import KubeAPI
from screener.stores.local import LocalStore
from screener.lifecycle.records import Transition
from screener.types import LABEL_STATE, NodeState

ROOT = Path(__file__).resolve().parents[1]
RACERS = 8
FLEET = 10  # budget: floor(10% of 10) = 1 node
ROUNDS = 20
NAMESPACE = "screener-system"

WORKER = textwrap.dedent("""
    import json, sys, threading, time
    from screener.lifecycle.apply import apply_event
    from screener.stores.local import LocalStore
    from screener.types import Outcome, Verdict

    node = sys.argv[1]
    kube = {}
    bad = Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm-fp32",
                  evidence={"confirmed": True})
    print("ready", flush=True)
    # Import the Kubernetes client while the SQLite rounds run (it takes a CPU-second).
    threading.Thread(target=__import__, args=("screener.stores.kube.store",), daemon=True).start()
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "quit":
            break
        if msg["kind"] == "local":
            store = LocalStore(msg["db"])
        else:
            if msg["url"] not in kube:
                import kubernetes.client  # only the Kubernetes rounds pay for importing it
                from screener.stores.kube import KubeStore
                cfg = kubernetes.client.Configuration()
                cfg.host, cfg.retries = msg["url"], False
                kube[msg["url"]] = KubeStore(kubernetes.client.ApiClient(cfg), instance=node,
                                             namespace=msg["namespace"])
            store = kube[msg["url"]]
        while time.time() < msg["start"]:  # every racer fires at the same instant
            time.sleep(min(0.001, max(0.0, msg["start"] - time.time())))
        t0 = time.perf_counter()
        try:
            decision = apply_event(store, node, bad, now=msg["now"])
            out = {"node": node, "state": decision.state.value, "s": time.perf_counter() - t0}
        except Exception as e:  # reported to the parent, which fails the round
            out = {"node": node, "error": f"{type(e).__name__}: {e}"}
        if msg["kind"] == "local":
            store.close()
        print(json.dumps(out), flush=True)
""")


class Racers:
    """RACERS worker processes, each owning one node, started once and reused every round."""

    def __init__(self, n: int = RACERS) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.nodes = [f"gpu-{k:02d}" for k in range(n)]
        self.procs = [subprocess.Popen([sys.executable, "-c", WORKER, node], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
                      for node in self.nodes]
        for p in self.procs:
            assert p.stdout.readline().strip() == "ready"

    def race(self, **msg: Any) -> list[dict[str, Any]]:
        """Send every worker the same round and collect their answers."""
        msg = {**msg, "op": "race", "start": time.time() + 0.08}
        for p in self.procs:
            p.stdin.write(json.dumps(msg) + "\n")
            p.stdin.flush()
        return [json.loads(p.stdout.readline()) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def racers() -> Iterator[Racers]:
    r = Racers()
    yield r
    r.close()


def healthy(node: str, when: float) -> list[Transition]:
    return [Transition(node=node, time=when, from_state=None, to_state=NodeState.BURNIN, reason="new"),
            Transition(node=node, time=when + 1, from_state=NodeState.BURNIN,
                       to_state=NodeState.HEALTHY, reason="burn-in passed")]


def fleet_names(racers: Racers) -> list[str]:
    return racers.nodes + [f"gpu-spare-{k}" for k in range(FLEET - len(racers.nodes))]


def local_round(racers: Racers, template: Path, db: Path, now: float) -> dict[str, Any]:
    shutil.copyfile(template, db)  # a fresh fleet of healthy nodes
    answers = racers.race(kind="local", db=str(db), now=now)
    store = LocalStore(db)
    states = store.all_states()
    store.close()
    return {"answers": answers, "states": {n: s.value for n, s in states.items()}}


def kube_round(racers: Racers, api: KubeAPI, now: float) -> dict[str, Any]:
    api.delete_configmaps(NAMESPACE)  # the budget record too: the racers also race to create it
    for name in fleet_names(racers):
        def reset(n: dict[str, Any]) -> None:
            n["metadata"]["labels"] = {LABEL_STATE: "healthy"}
            n["metadata"]["annotations"] = {}
            n["spec"]["taints"] = []
        api.mutate(name, reset)
    api.clear_calls()
    answers = racers.race(kind="kube", url=api.url, namespace=NAMESPACE, now=now)
    states = {name: api.node(name)["metadata"]["labels"].get(LABEL_STATE) for name in api.nodes}
    budget = api.configmap(NAMESPACE, "screener-budget")
    conflicts = sum(1 for c in api.calls if c.resource == "configmaps" and c.status == 409)
    with api._lock:  # the budget slots: one ConfigMap per node out of service
        out = sorted(cm["data"]["node"] for (ns, name), cm in api.configmaps.items()
                     if ns == NAMESPACE and name.startswith("screener-budget-slot-"))
    return {"answers": answers, "states": states, "conflicts": conflicts,
            "out": out, "fleet": budget["data"]["fleet"]}


def check_round(result: dict[str, Any], racers: Racers) -> str:
    """Exactly one racer quarantined, the rest held in suspect; returns the winner."""
    errors = [a["error"] for a in result["answers"] if "error" in a]
    assert not errors, errors
    claimed = sorted(a["node"] for a in result["answers"] if a["state"] == "quarantined")
    held = sorted(a["node"] for a in result["answers"] if a["state"] == "suspect")
    assert len(claimed) == 1 and len(held) == len(racers.nodes) - 1, result["answers"]
    # What the store says, not only what the racers believe.
    stored_out = sorted(n for n, s in result["states"].items() if s in ("quarantined", "repair"))
    assert stored_out == claimed, result["states"]
    assert sorted(n for n, s in result["states"].items() if s == "suspect") == held
    return claimed[0]


@pytest.mark.slow
def test_eight_processes_race_for_one_slot_on_sqlite(racers, tmp_path):
    template = tmp_path / "fleet.db"
    store = LocalStore(template)
    for name in fleet_names(racers):
        for t in healthy(name, 1_899_999_000.0):
            store.record(t)
    store.close()
    winners = []
    for r in range(ROUNDS):
        result = local_round(racers, template, tmp_path / f"race-{r}.db", now=1_900_000_000.0 + r)
        winners.append(check_round(result, racers))
    print(f"sqlite: {ROUNDS} rounds of {RACERS} racers, one winner each; winners {winners}")


@pytest.mark.slow
def test_eight_processes_race_for_one_slot_on_kubernetes(racers):
    with KubeAPI() as api:
        for name in fleet_names(racers):
            api.add_node(name, labels={LABEL_STATE: "healthy"})
        # Reads of the budget record answer 20 ms late: every racer decides on the same version.
        api.slow(0.02, verb="get", resource="configmaps")
        winners, conflicts = [], []
        for r in range(ROUNDS):
            result = kube_round(racers, api, now=1_900_000_000.0 + r)
            winners.append(check_round(result, racers))
            assert result["out"] == [winners[-1]] and result["fleet"] == str(FLEET)
            conflicts.append(result["conflicts"])
    # The race was real: racers lost on the server's 409s, not by arriving one after another.
    assert sum(conflicts) >= ROUNDS, conflicts
    print(f"kubernetes: {ROUNDS} rounds of {RACERS} racers, one winner each; winners {winners}; "
          f"409s per round {conflicts}")
