"""Requests per node of `screener daemon --once` passes that each take a settled alarm at the same
moment (issue 36.6: at most 12 per node), on the Kubernetes API test server or a real
kube-apiserver: the working tree ("after", with the pass's read-once rule, KubeStore.one_pass)
and, side by side in the same run, the code as of BASELINE ("before", exported from git into a
temporary folder that comes first on the children's PYTHONPATH).

    python benchmarks/bench_pass_requests.py                        # 30 of 600, the test server
    python benchmarks/bench_pass_requests.py --apiserver https://127.0.0.1:6443 --token T \
        --sides after                             # one side per fresh server (it keeps its Nodes)

Each child is a real `python -m screener.cli daemon --once` with an alarm file in its folder; all
start together. Per node: requests by verb and resource, exit code, and whether its quarantine is
whole (label, taint, condition, history entry, Event, one slot) or it was held in suspect past the
budget. On the real server (benchmarks/realserver.py) each child acts as the DaemonSet's service
account with its node claim, through the RBAC and admission policies; run it on a fresh server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "benchmarks")]

from screener.audit.alarms import write_alarm_file  # noqa: E402
from screener.lifecycle.records import Transition  # noqa: E402
from screener.stores.kube import formats as kf  # noqa: E402
from screener.alarmfile import AlarmRecord
from screener.types import ANNOTATION_HISTORY, LABEL_STATE, NodeState, SuspectNode  # noqa: E402

NS = "screener-system"
BASELINE = "6873301"  # the last commit before the read-once rule


def baseline_tree() -> Path:
    """BASELINE's screener package in a temporary folder (git archive)."""
    out = Path(tempfile.mkdtemp(prefix="bench-pass-base-"))
    archive = subprocess.run(["git", "archive", BASELINE, "screener", "jobs", "golden"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def resource_of(method: str, path: str) -> str:
    """'GET node', 'LIST configmaps', 'PATCH node/status' ... from a request's method and path."""
    parts = path.strip("/").split("/")
    if parts[:2] == ["api", "v1"]:
        parts = parts[2:]
    if parts[:1] == ["namespaces"] and len(parts) >= 3:
        parts = parts[2:]
    verb = {"GET": "GET", "POST": "CREATE", "PUT": "UPDATE", "PATCH": "PATCH",
            "DELETE": "DELETE"}.get(method, method)
    if verb == "GET" and len(parts) == 1:
        verb = "LIST"
    what = parts[0] if parts else path
    if len(parts) >= 3:
        what += "/" + parts[2]
    return f"{verb} {what}"


def history(name: str, now: float) -> list[dict[str, Any]]:
    return [Transition(node=name, time=now - 86400, from_state=None, to_state=NodeState.BURNIN,
                       reason="new", code="NewNode").to_dict(),
            Transition(node=name, time=now - 80000, from_state=NodeState.BURNIN,
                       to_state=NodeState.HEALTHY, reason="burn-in passed",
                       code="KnownAnswerPassed").to_dict()]


def daemon_config(home: Path, kubeconfig: Path) -> Path:
    (home / "alarms").mkdir(parents=True, exist_ok=True)
    config = home / "daemon.json"
    config.write_text(json.dumps({
        "store": "kube", "kubeconfig": str(kubeconfig), "screens": False, "metrics_port": -1,
        "spool": str(home / "state" / "spool.db"), "tick_s": 0.5,
        "probes": {"kmsg_path": None, "disk_paths": [str(home)], "min_free_disk_fraction": 0,
                   "min_free_memory_fraction": 0}}))
    return config


def run(failing: int, fleet: int, *, code: Path, real: tuple[str, str] | None,
        tag: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-pass-"))
    now = time.time()
    fleet_names = [f"{tag}-fleet-{k:05d}" for k in range(fleet - failing)]
    bad = [f"{tag}-bad-{k:03d}" for k in range(failing)]
    summary = {ANNOTATION_HISTORY: kf.summary_annotation(history("x", now))}
    api: Any = None
    if real is None:
        from fakes.kubeapi import KubeAPI

        api = KubeAPI(backlog=1024).start()
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
        for name in fleet_names + bad:
            api.add_node(name, labels={LABEL_STATE: "healthy"}, annotations=dict(summary))
        with api._lock:
            for name in bad:
                cm = kf.history_configmap(name, history(name, now), namespace=NS)
                api._store_configmap(NS, cm["metadata"]["name"], cm, None)
            rec = kf.BudgetRecord(fleet=fleet, counted=now)
            api._store_configmap(NS, kf.BUDGET_CONFIGMAP, rec.configmap(NS), None)
        api.clear_calls()
    else:
        import realserver

        url, token = real
        kubeconfig = realserver.kubeconfig(url, token, tmp / "kubeconfig")
        # The budget record is the server's already (realserver.py: it must exist before the
        # lease policy's binding, whose parameter it is), counted for this fleet.
        load = realserver.load_fleet(
            url, token, fleet_names + bad, labels={LABEL_STATE: "healthy"},
            annotations=summary,
            configmaps=[kf.history_configmap(n, history(n, now), namespace=NS) for n in bad])
        print(f"  loaded {fleet} Nodes in {load:.0f} s", file=sys.stderr)
    procs = {}
    for k, name in enumerate(bad):
        home = tmp / name
        config = daemon_config(home, kubeconfig)
        write_alarm_file(AlarmRecord(alarm_id=f"{tag}-alarm-{k}", check="ring_replay", step=3,
                                     settled=True, suspect_ranks=(0,),
                                     suspect_nodes=(SuspectNode(name, name),), node=name,
                                     job="train"), home / "alarms")
        env = {k2: v for k2, v in os.environ.items() if k2 != "KUBERNETES_SERVICE_HOST"}
        env.update(NODE_NAME=name, SCREENER_ALARM_DIR=str(home / "alarms"),
                   XDG_STATE_HOME=str(home / "xdg"), SCREENER_CONFIG=str(config),
                   POD_NAMESPACE=NS, PYTHONPATH=str(code))
        if real is not None:
            env.update(realserver.child_env(name, home / "requests.jsonl"))
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "impersonate"),
                                                 str(code)])
        procs[name] = env
    t0 = time.perf_counter()
    running = {}
    for name, env in procs.items():
        home = tmp / name
        running[name] = subprocess.Popen(
            [sys.executable, "-m", "screener.cli", "daemon", "--once", "--json"], env=env,
            cwd=code, stdout=open(home / "out.txt", "wb"), stderr=open(home / "err.txt", "wb"))
    codes = Counter(p.wait() for p in running.values())
    wall = time.perf_counter() - t0
    if api is not None:
        # The children share one User-Agent: every call counted once, spread over the nodes.
        total = Counter(f"{c.verb.upper()} {c.resource}{'/' + c.subresource if c.subresource else ''}"
                        for c in api.calls)
        states = {n: ((o["metadata"].get("labels") or {}).get(LABEL_STATE),
                      [t["value"] for t in (o["spec"].get("taints") or [])
                       if t["key"] == "screener.io/state"]) for n, o in api.nodes.items()}
        requests = [len(api.calls) / failing]
        api.stop()
    else:
        total = Counter()
        requests = []
        for name in bad:
            lines = (tmp / name / "requests.jsonl").read_text().splitlines()
            requests.append(len(lines))
            for line in lines:
                method, path, _status, _s = json.loads(line)
                total[resource_of(method, path)] += 1
        states = realserver.states(*real)
    out = sum(1 for n in bad if states[n][0] in ("quarantined", "repair"))
    held = sum(1 for n in bad if states[n][0] == "suspect" and states[n][1] == ["suspect"])
    errors = [(tmp / n / "err.txt").read_text()[-300:] for n in bad
              if '"level": "error"' in (tmp / n / "err.txt").read_text()][:2]
    limit = max(1, int(0.10 * fleet + 1e-9))
    return {"failing": failing, "fleet": fleet, "code": tag, "wall_s": round(wall, 1),
            "exit_codes": dict(codes), "requests_per_node_median": statistics.median(requests),
            "requests_per_node_max": max(requests),
            "by_kind_per_node": {k: round(v / failing, 2) for k, v in total.most_common()},
            "out": out, "held": held, "exact": out == min(limit, failing) and out + held == failing,
            "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--failing", type=int, default=30)
    ap.add_argument("--fleet", type=int, default=600)
    ap.add_argument("--apiserver", default="", help="a real kube-apiserver's URL")
    ap.add_argument("--token", default="", help="its admin token (system:masters)")
    ap.add_argument("--sides", default="before,after", help="before (BASELINE), after (the tree)")
    args = ap.parse_args()
    real = (args.apiserver, args.token) if args.apiserver else None
    for side in args.sides.split(","):
        code = baseline_tree() if side == "before" else ROOT
        r = run(args.failing, args.fleet, code=code, real=real, tag=side)
        print(json.dumps(r))


if __name__ == "__main__":
    main()
