"""What one node event costs the Kubernetes API, and what the fleet-wide commands cost, by fleet size.

For each fleet size (default 100, 1,000 and 5,000 nodes) a fleet is loaded into the Kubernetes API
test server (tests/fakes/kubeapi.py, real HTTP, the official client) as screener leaves it: every Node
with its state label, the bounded history summary, a verdict and published known-answer digests,
plus 3 KB of other controllers' annotations; every node's history ConfigMap; 2% of the nodes with a
recorded failure naming a GPU serial; the budget record. Then, through KubeStore:

  * per event (apply_event): API requests, bytes on the wire (request + response) and wall time for
    a known node seen again (no transition), an unconfirmed mismatch (healthy -> suspect) and a
    confirmed one naming a GPU serial (suspect -> quarantined: the per-GPU lemon lookup and the
    budget claim);
  * `node status` of the fleet (one paginated list of Node metadata), `lemons` (the failures of
    every node, linear) and the cross-check lookup (peers' published digests), with their requests,
    bytes and time;
  * for contrast, one unpaginated LIST of full Node objects: what every event read before.

The same per-event figures on SQLite follow. The per-event figures must not grow with the fleet.

    python benchmarks/bench_store.py                    # 100, 1000, 5000
    python benchmarks/bench_store.py --sizes 100 1000 --race-rounds 200

--race-rounds N also runs the budget race of tests/test_budget_race.py (8 processes, one slot)
for N rounds on SQLite and on the API test server and prints the outcomes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from fakes.kubeapi import KubeAPI  # noqa: E402
from screener.lifecycle import machine  # noqa: E402
from screener.known_answer.verdict.crosscheck import peer_digests  # noqa: E402
from screener.lifecycle.apply import apply_event
from screener.lifecycle.records import lemon_counts  # noqa: E402
from screener.stores.kube import formats as kf  # noqa: E402
from screener.lifecycle.records import Transition  # noqa: E402
from screener.stores.kube import KubeStore  # noqa: E402
from screener.stores.local import LocalStore  # noqa: E402
from screener.types import (ANNOTATION_DIGESTS, ANNOTATION_HISTORY, ANNOTATION_VERDICT,  # noqa: E402
                            LABEL_STATE, NodeState, Outcome, Verdict)

S = NodeState
NOW = 1_900_000_000.0
NS = "screener-system"
DIGESTS = json.dumps({"3f9c1e2a7b": {f"job-{j}": f"{j:02d}" * 8 for j in range(8)}})


def node_history(name: str, failure_serial: str = "") -> list[dict[str, Any]]:
    ts = [Transition(node=name, time=NOW - 86400, from_state=None, to_state=S.BURNIN,
                     reason="new node: screened before it takes work", code="NewNode"),
          Transition(node=name, time=NOW - 80000, from_state=S.BURNIN, to_state=S.HEALTHY,
                     reason="full burn-in passed on 8 device(s)", code="KnownAnswerPassed",
                     evidence={"verdicts": [{"device": f"cuda:{d}", "outcome": "pass"}
                                            for d in range(8)]})]
    if failure_serial:
        ts += [Transition(node=name, time=NOW - 3600, from_state=S.HEALTHY, to_state=S.QUARANTINED,
                          reason="settled in-job alarm", code="RingReplayMismatch", failure=True,
                          gpu_serials=(failure_serial,)),
               Transition(node=name, time=NOW - 1800, from_state=S.QUARANTINED, to_state=S.BURNIN,
                          reason="remediation passed", code="RemediationPassed"),
               Transition(node=name, time=NOW - 900, from_state=S.BURNIN, to_state=S.HEALTHY,
                          reason="full burn-in passed", code="KnownAnswerPassed")]
    return [t.to_dict() for t in ts]


def load_fleet(api: KubeAPI, n: int) -> list[str]:
    """n nodes as screener leaves them, written straight into the server's state."""
    names = [f"gpu-{k:05d}" for k in range(n)]
    with api._lock:
        for k, name in enumerate(names):
            serial = f"SN-{k}" if k % 50 == 0 else ""  # a GPU seen failing on one node
            hist = node_history(name, serial)
            api.add_node(name, labels={LABEL_STATE: "healthy", "kubernetes.io/hostname": name,
                                       "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                         annotations={"other.io/blob": "x" * 3000, ANNOTATION_DIGESTS: DIGESTS,
                                      ANNOTATION_HISTORY: kf.summary_annotation(hist),
                                      ANNOTATION_VERDICT: json.dumps({"outcome": "pass",
                                                                      "time": NOW - 900})})
            # A real Node's status carries its images, capacity and addresses (kilobytes), which
            # a metadata-only list does not transfer.
            api.nodes[name]["status"].update(
                capacity={"cpu": "192", "memory": "2063731096Ki", "nvidia.com/gpu": "8"},
                addresses=[{"type": "InternalIP", "address": f"10.0.{k // 250}.{k % 250}"},
                           {"type": "Hostname", "address": name}],
                images=[{"names": [f"registry.example.com/team/image-{i}@sha256:{'ab' * 32}",
                                   f"registry.example.com/team/image-{i}:v{i}"],
                         "sizeBytes": 1_000_000_000 + i} for i in range(25)])
            cm = kf.history_configmap(name, hist, namespace=NS)
            api._store_configmap(NS, cm["metadata"]["name"], cm, None)
        record = kf.BudgetRecord(fleet=n, out={}, counted=NOW)
        api._store_configmap(NS, kf.BUDGET_CONFIGMAP, record.configmap(NS), None)
    return names


def measure(api: KubeAPI, fn: Callable[[], Any]) -> dict[str, Any]:
    api.clear_calls()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    calls = list(api.calls)
    # ms: the client's side (wall time less the test server's own work: a Python server filtering
    # thousands of objects per label-selected list is not what a real API server's cache costs).
    server = sum(c.server_seconds for c in calls)
    return {"requests": len(calls), "bytes": sum(c.request_bytes + c.response_bytes for c in calls),
            "ms": (dt - server) * 1000, "server_ms": server * 1000,
            "lists": sum(1 for c in calls if c.verb == "list"),
            "node_lists": sum(1 for c in calls if c.verb == "list" and c.resource == "nodes")}


def kube_figures(n: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    with KubeAPI() as api:
        names = load_fleet(api, n)
        store = KubeStore(api.api_client(), namespace=NS, clock=lambda: NOW, instance="bench",
                          sleep=lambda s: None)
        seen, suspect, failure = [], [], []
        for k in range(9):  # nine different nodes, median of each
            node = names[(k * 37 + 11) % n]
            seen.append(measure(api, lambda: apply_event(store, node, machine.NodeSeen(),
                                                         now=NOW + k)))
            suspect.append(measure(api, lambda: apply_event(
                store, node, Verdict(device="cuda:3", outcome=Outcome.SUSPECT, reason="mismatch",
                                     job="gemm-fp32"), now=NOW + k + 0.1)))
            failure.append(measure(api, lambda: apply_event(
                store, node, Verdict(device="cuda:3", outcome=Outcome.SUSPECT, reason="mismatch",
                                     job="gemm-fp32", evidence={"confirmed": True,
                                                                "gpu_serial": "SN-0"}),
                now=NOW + k + 0.2)))
        for label, rows in (("event: seen again", seen), ("event: -> suspect", suspect),
                            ("event: -> quarantined/held", failure)):
            out[label] = {key: statistics.median(r[key] for r in rows)
                          for key in ("requests", "bytes", "ms", "server_ms")}
            out[label]["lists"] = max(r["node_lists"] for r in rows)
        out["node status (fleet)"] = measure(api, store.summaries)

        def lemons() -> None:
            failures = store.failures(NOW - 30 * 86400)
            lemon_counts(failures)
            store.all_states()

        out["lemons"] = measure(api, lemons)
        out["cross-check lookup"] = measure(api, lambda: peer_digests(store, names[0]))
        import kubernetes.client

        v1 = kubernetes.client.CoreV1Api(api.api_client())
        out["(one full Node LIST)"] = measure(api, lambda: v1.list_node(_preload_content=False).data)
        store.close()
    return out


def local_figures(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        store = LocalStore(Path(d) / "bench.db")
        with store._lock:  # bulk load in one transaction (a benchmark shortcut)
            store._db.execute("BEGIN IMMEDIATE")
            for k in range(n):
                name = f"gpu-{k:05d}"
                for e in node_history(name, f"SN-{k}" if k % 50 == 0 else ""):
                    store._insert(Transition.from_dict(e))
            store._db.execute("COMMIT")
        times = []
        for k in range(15):
            node = f"gpu-{(k * 37 + 11) % n:05d}"
            t0 = time.perf_counter()
            apply_event(store, node, Verdict(device="cuda:3", outcome=Outcome.SUSPECT,
                                             reason="mismatch", job="gemm-fp32",
                                             evidence={"confirmed": True, "gpu_serial": "SN-0"}),
                        now=NOW + k)
            times.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        store.summaries()
        status_ms = (time.perf_counter() - t0) * 1000
        store.close()
    return {"event ms": statistics.median(times), "node status ms": status_ms}


def race(rounds: int) -> None:
    import test_budget_race as race_test

    racers = race_test.Racers()
    try:
        with tempfile.TemporaryDirectory() as d:
            template = Path(d) / "fleet.db"
            store = LocalStore(template)
            for name in race_test.fleet_names(racers):
                for t in race_test.healthy(name, NOW - 1000):
                    store.record(t)
            store.close()
            winners: dict[str, int] = {}
            t0 = time.perf_counter()
            for r in range(rounds):
                result = race_test.local_round(racers, template, Path(d) / f"r{r % 4}.db", NOW + r)
                w = race_test.check_round(result, racers)
                winners[w] = winners.get(w, 0) + 1
            print(f"sqlite race: {rounds} rounds x {len(racers.nodes)} processes, exactly one "
                  f"quarantined every round ({time.perf_counter() - t0:.1f} s); wins per node "
                  f"{dict(sorted(winners.items()))}")
        with KubeAPI() as api:
            for name in race_test.fleet_names(racers):
                api.add_node(name, labels={LABEL_STATE: "healthy"})
            api.slow(0.02, verb="get", resource="configmaps")
            winners, conflicts = {}, []
            t0 = time.perf_counter()
            for r in range(rounds):
                result = race_test.kube_round(racers, api, NOW + r)
                w = race_test.check_round(result, racers)
                winners[w] = winners.get(w, 0) + 1
                conflicts.append(result["conflicts"])
            print(f"kubernetes race: {rounds} rounds x {len(racers.nodes)} processes, exactly one "
                  f"quarantined every round ({time.perf_counter() - t0:.1f} s); wins per node "
                  f"{dict(sorted(winners.items()))}; 409 answers per round: median "
                  f"{statistics.median(conflicts)}, min {min(conflicts)}, max {max(conflicts)}")
    finally:
        racers.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--race-rounds", type=int, default=0)
    args = ap.parse_args()

    results = {n: kube_figures(n) for n in args.sizes}
    rows = list(next(iter(results.values())))
    print("Kubernetes store (API test server over HTTP); per fleet size: requests, KB (request +"
          " response), client ms (wall time less the test server's own)")
    print(f"{'':28}" + "".join(f"{f'{n:,} nodes':>26}" for n in args.sizes))
    for row in rows:
        cells = "".join(f"{results[n][row]['requests']:>5.0f} {results[n][row]['bytes'] / 1024:>10.1f}"
                        f" {results[n][row]['ms']:>9.1f}" for n in args.sizes)
        print(f"{row:28}{cells}")
    print("Node lists on the per-event path:",
          {n: int(max(results[n][r]["lists"] for r in rows if r.startswith("event"))) for n in args.sizes},
          "(a failure naming a GPU serial adds one LIST of ConfigMaps selected by the serial's label)")
    print("test server's own ms per event (median):",
          {n: {r.split(": ")[1]: round(results[n][r]["server_ms"], 1) for r in rows
               if r.startswith("event")} for n in args.sizes})
    local = {n: local_figures(n) for n in args.sizes}
    print("\nSQLite store, per fleet size: ms (an event is one fsync'd transaction: disk-bound)")
    for key in ("event ms", "node status ms"):
        print(f"{key:30}" + "".join(f"{local[n][key]:>24.2f}" for n in args.sizes))
    if args.race_rounds:
        print()
        race(args.race_rounds)


if __name__ == "__main__":
    main()
