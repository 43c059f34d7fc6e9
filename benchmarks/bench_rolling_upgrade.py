"""A rolling upgrade of a fleet to a platform with no golden (issue 33.5), with the fleet quorum and
without it (quorum_nodes = 0, the screener before issue 33.3), side by side in one run.

N nodes (default 20), each a real Daemon on a fake clock, on one store the fleet shares: the
Kubernetes API test server (tests/fakes/kubeapi.py: real HTTP, the official client, one KubeStore per
node with its own User-Agent) or one SQLite file. They come up on the new platform one by one
(one pass each, in a shuffled order), then every node passes again each `retry_inconclusive_s`
(601 s on its clock) for up to --rounds rounds. The device boundary is tests/test_rolling_upgrade.py's
DeviceBoundary: two GPUs per node giving the real job's results (run in process), a planted node
giving a persistently faulty unit's, judged by the product's judge_runs with the fleet view the
daemon passes, as the screen worker does.

Per side: after how many rounds every healthy node is healthy and the bad one out of service
(suspect or quarantined), how many screens that took, the nodes still in burnin, the goldens
promoted (once per job), and on Kubernetes the API requests per node per pass.

    python benchmarks/bench_rolling_upgrade.py                 # 20 nodes, kube and sqlite
    python benchmarks/bench_rolling_upgrade.py --nodes 50 --stores kube
    python benchmarks/bench_rolling_upgrade.py --stores real --apiserver https://127.0.0.1:6443 \
        --token ADMIN_TOKEN                                    # a real kube-apiserver

With --apiserver (a real kube-apiserver with manifests/ applied: the namespace, RBAC and the
admission policies), the admin token creates the Nodes and each node's daemon acts as the
DaemonSet's service account with its node claim, by impersonation (Impersonate-User and
Impersonate-Extra-authentication.kubernetes.io/node-name), so every write goes through the RBAC
and the policies as a pod's would. Run it against a fresh server: it leaves its Nodes there.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import kubernetes.client  # noqa: E402

from fakes.daemon import DaemonRig  # noqa: E402
from fakes.kubeapi import KubeAPI  # noqa: E402
from screener.determinism import preserved  # noqa: E402
from screener.known_answer.engine import workloads as w  # noqa: E402
from screener.known_answer.engine.faults import FaultSpec, inject  # noqa: E402
from screener.stores.kube import KubeStore  # noqa: E402
from screener.stores.local import LocalStore  # noqa: E402
from screener.types import NodeState  # noqa: E402
from test_rolling_upgrade import JOB, NEW, NS, DeviceBoundary  # noqa: E402

OUT = (NodeState.SUSPECT, NodeState.QUARANTINED)


def answers() -> tuple[w.JobSpec, dict[str, Any]]:
    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == JOB)
    with preserved():
        clean = w.run_job(spec, "cpu")
        bad = w.run_job(spec, "cpu", injector=inject(FaultSpec("mm", call=0, element=11, bit=2,
                                                                persistent=True)))
    return spec, {"clean": clean, "bad": bad}


SA_USER = f"system:serviceaccount:{NS}:screener"


def _quiet_tls() -> None:
    """The test server's self-signed certificate is not verified: no warning per request."""
    import urllib3

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)


def real_client(url: str, token: str, node: str = "") -> Any:
    """A client of a real API server: the admin, or (node given) the service account of that
    node's daemon pod, with its node claim."""
    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.verify_ssl, cfg.retries = url, False, False
    cfg.api_key = {"authorization": f"Bearer {token}"}
    client = kubernetes.client.ApiClient(cfg)
    if node:
        client.set_default_header("Impersonate-User", SA_USER)
        client.set_default_header("Impersonate-Extra-authentication.kubernetes.io%2fnode-name",
                                  node)
        client.user_agent = f"daemon/{node}"
    return client


def run_side(store_kind: str, quorum: int, n: int, bad: int, rounds: int, seed: int,
             spec: w.JobSpec, results: dict[str, Any], real: Any = None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-rolling-"))
    goldens = tmp / "golden"
    goldens.mkdir()
    api = KubeAPI().start() if store_kind == "kube" else None
    admin = kubernetes.client.CoreV1Api(real_client(*real)) if store_kind == "real" else None
    shared = tmp / "fleet.db"
    nodes = []
    t0 = time.perf_counter()
    try:
        for k in range(n):
            name = f"gpu-{k:03d}" if admin is None else f"q{quorum}-gpu-{k:03d}"
            folder = tmp / name
            folder.mkdir()
            if admin is not None:
                admin.create_node({"apiVersion": "v1", "kind": "Node",
                                   "metadata": {"name": name}})
                store = KubeStore(real_client(*real, node=name), namespace=NS, instance=name)
            elif api is not None:
                api.add_node(name)
                cfg = kubernetes.client.Configuration()
                cfg.host, cfg.retries = api.url, False
                client = kubernetes.client.ApiClient(cfg)
                client.user_agent = f"daemon/{name}"
                store: Any = KubeStore(client, namespace=NS, instance=name)
            else:
                store = LocalStore(shared)
            runner = DeviceBoundary(spec, results["bad" if k == bad else "clean"], goldens)
            rig = DaemonRig(folder, runner, store=store,
                            taint=store if isinstance(store, KubeStore) else None,
                            node=name, idle_window_s=0.0, golden_dir=str(goldens), jobs=[JOB],
                            quorum_nodes=quorum)
            nodes.append((name, rig, runner))
        order = list(range(n))
        random.Random(seed).shuffle(order)
        passes = 0
        for k in order:
            nodes[k][1].tick()
            passes += 1
        settled_round = None
        for r in range(1, rounds + 1):
            states = {name: rig.store.get_state(name) for name, rig, _ in nodes}
            if _settled(states, nodes[bad][0]):
                settled_round = r - 1
                break
            for name, rig, _ in nodes:
                rig.tick(advance=601.0)
                passes += 1
        states = {name: rig.store.get_state(name) for name, rig, _ in nodes}
        if settled_round is None and _settled(states, nodes[bad][0]):
            settled_round = rounds
        seconds = time.perf_counter() - t0
        screens = sum(len(runner.requests) for _, _, runner in nodes)
        promoted = nodes[0][1].store.promoted_goldens() if quorum else {}
        requests = len(api.calls) if api is not None else None
        return {"store": store_kind, "quorum": quorum, "nodes": n,
                "settled_after_rounds": settled_round,
                "healthy": sum(1 for s in states.values() if s == NodeState.HEALTHY),
                "out": sum(1 for s in states.values() if s in OUT),
                "burnin": sum(1 for s in states.values() if s == NodeState.BURNIN),
                "bad_node": str(states[nodes[bad][0]].value if states[nodes[bad][0]] else None),
                "screens": screens, "passes": passes,
                "promoted": sum(len(j) for j in promoted.values()),
                "requests_per_pass": round(requests / passes, 1) if requests else None,
                "seconds": round(seconds, 1)}
    finally:
        for _, rig, _ in nodes:
            rig.close()
        if api is not None:
            api.stop()


def _settled(states: dict[str, Any], bad: str) -> bool:
    return states[bad] in OUT and all(s == NodeState.HEALTHY for n, s in states.items() if n != bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6, help="retry rounds after the roll-out")
    ap.add_argument("--stores", default="kube,sqlite")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--apiserver", default="", help="a real kube-apiserver's URL (--stores real)")
    ap.add_argument("--token", default="", help="its admin bearer token")
    args = ap.parse_args()
    real = (args.apiserver, args.token) if args.apiserver else None
    if real:
        _quiet_tls()
    spec, results = answers()
    bad = args.nodes // 3
    rows = []
    for store in args.stores.split(","):
        for quorum in (0, 3):
            row = run_side(store, quorum, args.nodes, bad, args.rounds, args.seed, spec, results,
                           real)
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    print()
    for store in args.stores.split(","):
        before = next(r for r in rows if r["store"] == store and r["quorum"] == 0)
        after = next(r for r in rows if r["store"] == store and r["quorum"] == 3)
        print(f"{store}: without a quorum {before['healthy']}/{args.nodes - 1} healthy nodes "
              f"healthy, {before['burnin']} left in burnin after {args.rounds} retry rounds; "
              f"with it {after['healthy']}/{args.nodes - 1} healthy and the bad node "
              f"{after['bad_node']} after {after['settled_after_rounds']} retry round(s), "
              f"{after['screens']} screens ({after['screens'] / max(before['screens'], 1):.2f}x "
              f"of the baseline's), {after['promoted']} golden(s) promoted"
              + (f", {after['requests_per_pass']} API requests per pass "
                 f"(baseline {before['requests_per_pass']}, "
                 f"x{after['requests_per_pass'] / before['requests_per_pass']:.2f})"
                 if after["requests_per_pass"] and before["requests_per_pass"] else ""))
    counts = Counter(r["bad_node"] for r in rows if r["quorum"])
    print(f"bad node ends: {dict(counts)}")


if __name__ == "__main__":
    main()
