"""A fleet failing at once, against the Kubernetes API test server: this store and the one before
issue 22, side by side in one run.

The API test server (tests/fakes/kubeapi.py: real HTTP, the real wire protocol, 409 on a stale
resourceVersion or a taken name) runs in its own process with the fleet loaded as screener leaves
it (every Node labelled healthy with its summary, its history ConfigMap, the budget record). Then
N of its nodes fail at once: one thread per failing node, each with its own KubeStore and its own
connections (a daemon of its own), all released by one barrier, each applying a confirmed failure
(apply_event). Per node: requests and 409 conflicts (the server tells the daemons apart by their
User-Agent), and alarm to label (the barrier to the moment apply_event returns, the Node then
labelled quarantined or, past the budget, suspect and tainted). At the end the server's state is
checked: every failing node labelled, exactly min(N, budget) out of service, the rest held.

"before" is the store as of BASELINE (loaded from git: the single budget ConfigMap), "after" is
the working tree's. Absolute times depend on the machine (both sides share the same 2 cores and
Python's GIL with the server's threads); compare the two columns of one run.

    python benchmarks/bench_fleet.py            # 150 and 200 of 1,500, 300 of 3,000: both stores
    python benchmarks/bench_fleet.py --runs 150/1500 --sides after
    python benchmarks/bench_fleet.py --recount 1500           # a stale record: who recounts
    python benchmarks/bench_fleet.py --runs 300/3000 --sides after \
        --apiserver https://127.0.0.1:6443 --token T              # a real kube-apiserver

With --apiserver (benchmarks/realserver.py; a fresh server per run, its budget record already
counted for the run's fleet): the admin loads the fleet (Nodes labelled healthy with their
summary and a 3 KB foreign annotation, the failing nodes' history ConfigMaps), and each failing
node's store acts as its daemon pod (the service account with its node claim, through the RBAC
and the admission policies). Requests are counted on the client side.

Figures come from the test server only (no kube-apiserver here): request and conflict counts are
what a real API server would see from the same client; its latency and etcd costs are not modelled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from fakes.kubeapi import KubeAPI  # noqa: E402
from screener.lifecycle.apply import apply_event  # noqa: E402
from screener.lifecycle.records import Transition  # noqa: E402
from screener.stores.kube import formats as kf  # noqa: E402
from screener.types import ANNOTATION_HISTORY, LABEL_STATE, NodeState, Outcome, Verdict  # noqa: E402

BASELINE = "29ec35c"  # the last commit before issue 22's budget
NS = "screener-system"
BAD = Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm-fp32",
              evidence={"confirmed": True})


# --- the server, in its own process ---------------------------------------------------------------


def _serve(conn: Any, n: int, stale: bool) -> None:
    api = KubeAPI(backlog=4096).start()
    now = time.time()
    with api._lock:
        for k in range(n):
            name = f"gpu-{k:05d}"
            hist = [Transition(node=name, time=now - 86400, from_state=None,
                               to_state=NodeState.BURNIN, reason="new", code="NewNode").to_dict(),
                    Transition(node=name, time=now - 80000, from_state=NodeState.BURNIN,
                               to_state=NodeState.HEALTHY, reason="burn-in passed",
                               code="KnownAnswerPassed").to_dict()]
            api.add_node(name, labels={LABEL_STATE: "healthy", "kubernetes.io/hostname": name},
                         annotations={"other.io/blob": "x" * 3000,
                                      ANNOTATION_HISTORY: kf.summary_annotation(hist)})
            cm = kf.history_configmap(name, hist, namespace=NS)
            api._store_configmap(NS, cm["metadata"]["name"], cm, None)
        rec = kf.BudgetRecord(fleet=n, out={}, counted=now - (7200 if stale else 0))
        api._store_configmap(NS, kf.BUDGET_CONFIGMAP, rec.configmap(NS), None)
    conn.send(api.url)
    while True:
        op = conn.recv()
        if op == "stop":
            api.stop()
            return
        with api._lock:
            if op == "calls":
                conn.send([(c.agent, c.verb, c.resource, c.status, c.request_bytes + c.response_bytes,
                            c.server_seconds) for c in api.calls])
            elif op == "states":
                conn.send({n: (o["metadata"]["labels"].get(LABEL_STATE),
                               [t["value"] for t in o["spec"].get("taints") or []
                                if t["key"] == "screener.io/state"]) for n, o in api.nodes.items()})


class Server:
    """The test server in a child process (its threads do not share our GIL)."""

    def __init__(self, n: int, stale: bool = False) -> None:
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("fork").Process(target=_serve, args=(child, n, stale), daemon=True)
        self.proc.start()
        self.url = self.conn.recv()

    def ask(self, op: str) -> Any:
        self.conn.send(op)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)


# --- the two stores -------------------------------------------------------------------------------


def baseline_store_class() -> type:
    """KubeStore as of BASELINE, loaded from git next to the working tree's."""
    mods = {}
    package = sys.modules.setdefault("screener_baseline", types.ModuleType("screener_baseline"))
    package.__path__ = []  # a package: its modules are the ones put in sys.modules below
    for name in ("kubeformat", "kube"):
        text = subprocess.run(["git", "show", f"{BASELINE}:screener/stores/{name}.py"], cwd=ROOT,
                              check=True, capture_output=True, text=True).stdout
        text = text.replace("from screener.stores.kube import formats as kf",
                            "import screener_baseline.kubeformat as kf")
        text = text.replace("from screener.stores.kube.formats import",
                            "from screener_baseline.kubeformat import")
        # stores/base.py is stores/common.py since (issue 26.3).
        text = text.replace("from screener.stores.base import", "from screener.stores.common import")
        mod = types.ModuleType(f"screener_baseline.{name}")
        mod.__file__ = f"<{BASELINE}:{name}.py>"
        sys.modules[mod.__name__] = mod
        setattr(package, name, mod)
        exec(compile(text, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - our own history
        mods[name] = mod
    return mods["kube"].KubeStore


def make_store(cls: type, url: str, node: str) -> Any:
    import kubernetes.client

    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.retries = url, False
    client = kubernetes.client.ApiClient(cfg)
    client.user_agent = f"bench/{node}"
    return cls(client, namespace=NS, instance=node)


# --- one mass failure -----------------------------------------------------------------------------


def fail_together(stores: dict[str, Any], warm: Any = None, warmed: Any = None
                  ) -> tuple[dict[str, float], dict[str, str], float, dict[str, float], float]:
    """Each node's store applies BAD on its own thread, all released by one barrier; `warm(node)`
    runs on the thread first, and `warmed()` once every thread has warmed, before the release.
    Returns alarm to the transition's end (apply_event returned: label, taint, history,
    condition and Event written), errors, wall time, each thread's release
    (time.perf_counter()), and this process's CPU seconds from the release to the end (the
    daemons' own work, which on one machine the API server does not get)."""
    ready = threading.Barrier(len(stores) + 1)
    barrier = threading.Barrier(len(stores) + 1)
    took: dict[str, float] = {}
    errors: dict[str, str] = {}
    released: dict[str, float] = {}

    def daemon(node: str) -> None:
        if warm is not None:
            warm(node)
        ready.wait()
        barrier.wait()
        t0 = released[node] = time.perf_counter()
        try:
            # As the daemon applies it: inside a pass, which reads each object once.
            with getattr(stores[node], "one_pass", contextlib.nullcontext)():
                apply_event(stores[node], node, BAD, now=time.time())
            took[node] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - counted, reported
            errors[node] = f"{type(e).__name__}: {e}"[:200]

    threads = [threading.Thread(target=daemon, args=(n,)) for n in stores]
    for t in threads:
        t.start()
    ready.wait()
    if warmed is not None:
        warmed()
    barrier.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for st in stores.values():
        st.close()
    return took, errors, wall, released, cpu


def figures(nodes: list[str], fleet: int, took: dict[str, float], errors: dict[str, str],
            wall: float, calls: list[tuple[str, str, str, int, int, float]],
            states: dict[str, tuple[Any, list[str]]], agent: str,
            labelled: Optional[dict[str, float]] = None, cpu: float = float("nan")
            ) -> dict[str, Any]:
    """What a mass failure did: `calls` as (agent, verb, resource, status, bytes, server s), the
    agent of node n being agent.format(n); `states` every Node's label and state taints;
    `labelled` (where the client saw it) alarm to the server's answer to the Node write that
    put the label and taint on."""
    per = Counter(a for a, *_ in calls)
    conflicts = Counter(a for a, _, _, status, *_ in calls if status == 409)
    node_lists = Counter(a for a, verb, res, *_ in calls if verb == "list" and res == "nodes")
    nbytes: Counter = Counter()
    for a, _, _, _, b, _ in calls:
        nbytes[a] += b
    agents = [agent.format(n) for n in nodes]
    failing = len(nodes)
    limit = max(1, int(0.10 * fleet + 1e-9))
    out = sorted(n for n in nodes if states[n][0] in ("quarantined", "repair"))
    held = sorted(n for n in nodes if states[n][0] == "suspect" and states[n][1] == ["suspect"])
    times = sorted(took.values())
    held_times = sorted(took[n] for n in held if n in took)
    on = labelled or {}
    on_times = sorted(on.values())
    on_held = sorted(on[n] for n in held if n in on)
    return {
        "failing": failing, "fleet": fleet, "limit": limit, "wall": wall, "errors": errors,
        "client_cpu": cpu,
        "requests": len(calls), "server_s": sum(c[5] for c in calls), "server_cpu": float("nan"),
        "out": len(out), "held": len(held), "unlabelled": failing - len(out) - len(held),
        "exact": len(out) == min(limit, failing) and len(out) + len(held) == failing,
        "req_p50": statistics.median(per[a] for a in agents), "req_max": max(per[a] for a in agents),
        "conf_p50": statistics.median(conflicts[a] for a in agents),
        "conf_total": sum(conflicts.values()),
        "node_lists": sum(node_lists.values()),
        "kb_p50": statistics.median(nbytes[a] for a in agents) / 1024,
        "p50": _q(times, 0.5), "p90": _q(times, 0.9), "max": times[-1] if times else float("nan"),
        "held_p50": _q(held_times, 0.5), "held_p90": _q(held_times, 0.9),
        "on_p50": _q(on_times, 0.5), "on_p90": _q(on_times, 0.9),
        "on_max": on_times[-1] if on_times else float("nan"), "on_held_p90": _q(on_held, 0.9),
    }


def mass_failure(cls: type, fleet: int, failing: int, stale: bool = False) -> dict[str, Any]:
    server = Server(fleet, stale=stale)
    try:
        nodes = [f"gpu-{(k * 7919) % fleet:05d}" for k in range(failing)]  # spread over the fleet
        took, errors, wall, _, cpu = fail_together({n: make_store(cls, server.url, n) for n in nodes})
        calls = server.ask("calls")
        states = server.ask("states")
    finally:
        server.close()
    return figures(nodes, fleet, took, errors, wall, calls, states, "bench/{}", cpu=cpu)


def mass_failure_real(url: str, token: str, fleet: int, failing: int) -> dict[str, Any]:
    """mass_failure on a real kube-apiserver (the working tree's store only). The request counts
    are the client's (no bytes, no server time)."""
    import kubernetes.client
    import realserver
    from screener.stores.kube import KubeStore

    now = time.time()
    names = [f"gpu-{k:05d}" for k in range(fleet)]
    nodes = [f"gpu-{(k * 7919) % fleet:05d}" for k in range(failing)]
    hist = {n: [Transition(node=n, time=now - 86400, from_state=None, to_state=NodeState.BURNIN,
                           reason="new", code="NewNode").to_dict(),
                Transition(node=n, time=now - 80000, from_state=NodeState.BURNIN,
                           to_state=NodeState.HEALTHY, reason="burn-in passed",
                           code="KnownAnswerPassed").to_dict()] for n in nodes}
    load = realserver.load_fleet(
        url, token, names, labels={LABEL_STATE: "healthy"},
        annotations={"other.io/blob": "x" * 3000,
                     ANNOTATION_HISTORY: kf.summary_annotation(hist[nodes[0]])},
        configmaps=[kf.history_configmap(n, hist[n], namespace=NS) for n in nodes])
    print(f"  loaded {fleet} Nodes in {load:.0f} s", file=sys.stderr)
    log: list[Any] = []
    stores = {n: KubeStore(realserver.client(url, token, n, log), namespace=NS, instance=n)
              for n in nodes}
    def warm(node: str) -> None:
        # A running daemon's connection is open already (it talks to the API every pass): the
        # TLS handshake is not part of alarm to label, and its request is not counted.
        kubernetes.client.VersionApi(stores[node].api.api_client).get_code()

    server0 = _local_server_cpu()
    took, errors, wall, released, cpu = fail_together(stores, warm, warmed=lambda: log.clear())
    server_cpu = _local_server_cpu() - server0
    # The label and taint are on the Node (what the scheduler acts on) when the server answers
    # the node's first successful write of the Node itself (not its status): write.py writes
    # the Node first, after the budget slot.
    labelled: dict[str, float] = {}
    for a, method, path, status, _, answered in log:
        node = a.removeprefix("daemon/")
        if (method == "PATCH" and path == f"/api/v1/nodes/{node}" and status == 200
                and node in released and node not in labelled):
            labelled[node] = answered - released[node]
    kinds: dict[str, list[float]] = {}
    for _, method, path, _, seconds, _ in log:
        parts = path.strip("/").split("/")
        verb = "LIST" if method == "GET" and parts[-1] in ("configmaps", "nodes") else method
        kind = f"{verb} {'/'.join(p for p in parts[2:] if not p.startswith(('gpu-', 'screener-')))}"
        kinds.setdefault(kind, []).append(seconds)
    for kind, xs in sorted(kinds.items()):
        print(f"  {kind:50} {len(xs):5d} requests, mean {statistics.mean(xs) * 1e3:7.1f} ms, "
              f"max {max(xs) * 1e3:7.1f} ms", file=sys.stderr)
    verbs = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
    calls = [(a, "list" if (m, p) == ("GET", "/api/v1/nodes") else verbs.get(m, m),
              "nodes" if p == "/api/v1/nodes" else p, status, 0, 0.0)
             for a, m, p, status, _, _ in log]
    result = figures(nodes, fleet, took, errors, wall, calls, realserver.states(url, token),
                     "daemon/{}", labelled, cpu)
    result["server_cpu"] = server_cpu
    return result


def _local_server_cpu() -> float:
    """CPU seconds so far of this machine's kube-apiserver and etcd processes (NaN when none
    runs here): on one box they share the cores with the daemons."""
    total, found = 0.0, False
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                exe = os.path.basename(f.read().split(b"\0")[0]).decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if exe in ("kube-apiserver", "etcd"):
            found = True
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total if found else float("nan")


def _q(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


ROWS = [("requests per node, median", "req_p50", "{:.0f}"), ("requests per node, max", "req_max", "{:.0f}"),
        ("409 conflicts per node, median", "conf_p50", "{:.0f}"),
        ("409 conflicts in all", "conf_total", "{:.0f}"),
        ("Node lists (recounts) in all", "node_lists", "{:.0f}"), ("KB per node, median", "kb_p50", "{:.1f}"),
        ("alarm to label on the Node P50 (s)", "on_p50", "{:.2f}"),
        ("alarm to label on the Node P90 (s)", "on_p90", "{:.2f}"),
        ("alarm to label on the Node max (s)", "on_max", "{:.2f}"),
        ("held: alarm to taint on Node P90 (s)", "on_held_p90", "{:.2f}"),
        ("alarm to transition done P50 (s)", "p50", "{:.2f}"),
        ("alarm to transition done P90 (s)", "p90", "{:.2f}"),
        ("alarm to transition done max (s)", "max", "{:.2f}"),
        ("held: transition done P50 (s)", "held_p50", "{:.2f}"),
        ("held: transition done P90 (s)", "held_p90", "{:.2f}"), ("requests in all", "requests", "{}"),
        ("wall time (s)", "wall", "{:.1f}"), ("the daemons' CPU (s)", "client_cpu", "{:.1f}"),
        ("test server's own work (s)", "server_s", "{:.1f}"),
        ("API server + etcd CPU, here (s)", "server_cpu", "{:.1f}"),
        ("quarantined (budget)", "out", "{}"),
        ("held, suspect and tainted", "held", "{}"), ("unlabelled (lost)", "unlabelled", "{}"),
        ("errors", "errors", "{}"), ("budget exact", "exact", "{}")]


def table(title: str, results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'':34}" + "".join(f"{side:>14}" for side in results))
    for label, key, fmt in ROWS:
        cells = []
        for r in results.values():
            v = len(r[key]) if key == "errors" else r[key]
            cells.append(f"{fmt.format(v):>14}")
        print(f"{label:34}" + "".join(cells))
    for side, r in results.items():
        for node, err in list(r["errors"].items())[:3]:
            print(f"  {side} error on {node}: {err}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", default=["150/1500", "200/1500", "300/3000"],
                    help="FAILING/FLEET pairs")
    ap.add_argument("--sides", nargs="+", default=["before", "after"], choices=["before", "after"])
    ap.add_argument("--recount", type=int, default=0, metavar="FLEET",
                    help="also: 50 failing at once with a budget record two hours old")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--apiserver", default="", help="a real kube-apiserver's URL (one run)")
    ap.add_argument("--token", default="", help="its admin token (system:masters)")
    args = ap.parse_args()
    if args.apiserver:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        failing, fleet = (int(x) for x in args.runs[0].split("/"))
        result = mass_failure_real(args.apiserver, args.token, fleet, failing)
        table(f"{failing:,} of {fleet:,} failing at once on a real kube-apiserver "
              f"(budget {max(1, fleet // 10)})", {"after": result})
        if args.json:
            print(json.dumps(result, default=str))
        return

    from screener.stores.kube import KubeStore

    classes = {"before": baseline_store_class() if "before" in args.sides else None,
               "after": KubeStore}
    everything = {}
    for run in args.runs:
        failing, fleet = (int(x) for x in run.split("/"))
        results = {side: mass_failure(classes[side], fleet, failing) for side in args.sides}
        everything[run] = results
        table(f"{failing:,} of {fleet:,} nodes failing at once (budget {max(1, fleet // 10)})",
              results)
    if args.recount:
        results = {side: mass_failure(classes[side], args.recount, 50, stale=True)
                   for side in args.sides}
        everything[f"recount/{args.recount}"] = results
        table(f"50 of {args.recount:,} failing at once, the budget record two hours old", results)
    if args.json:
        print(json.dumps(everything, default=str))


if __name__ == "__main__":
    main()
