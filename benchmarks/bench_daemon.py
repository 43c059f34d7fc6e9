"""The daemon's idle footprint and its alarm-to-label latency.

Run:  python benchmarks/bench_daemon.py [--idle-seconds 30] [--samples 5] [--json]

1. Idle footprint: `screener daemon` as its own process, on a node that is healthy and was screened
   a moment ago (so no screen is due), with the metrics server on, probes every 15 s and the loop
   ticking every 5 s (the ConfigMap's tick). After a warm-up, the RSS of the process and its CPU
   time over the window (CPU share = CPU seconds / wall seconds, of one core).
2. Alarm-to-label latency: the daemon running (screens off: only the path of the alarm is timed),
   an alarm file dropped as the in-job audit drops it (temp file, rename), and the time until the
   node's new state is readable in the store: the local SQLite store, and the Kubernetes store
   against tests/fakes/kubeapi.py (the label on the Node object). Alarms are dropped at random phases of
   the tick, so the latency is the wait for the next tick (uniform over one tick) plus the cost of
   the path itself, which the minimum approaches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from screener.audit.alarms import write_alarm_file
from screener.lifecycle import machine
from screener.lifecycle.apply import apply_event
from screener.stores.local import LocalStore
from screener.alarmfile import AlarmRecord
from screener.types import LABEL_STATE, NodeState, Outcome, SuspectNode, Verdict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the Kubernetes API test server
from fakes.kubeapi import KubeAPI  # noqa: E402 - found through the line above

NODE = "bench-node"
PHASE = random.Random(0)  # when, within a tick, each alarm is dropped


def _config(path: Path, **kw: Any) -> Path:
    base = {"probes": {"kmsg_path": None, "disk_paths": [str(path.parent)],
                       "min_free_disk_fraction": 0, "min_free_memory_fraction": 0}}
    base.update(kw)
    path.write_text(json.dumps(base))
    return path


def _start(config: Path, work: Path, *extra: str, env_extra: Optional[dict] = None) -> subprocess.Popen:
    env = {**os.environ, "NODE_NAME": NODE, "SCREENER_ALARM_DIR": str(work / "alarms"),
           "OMP_NUM_THREADS": "1", "XDG_STATE_HOME": str(work / "state"), **(env_extra or {})}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.Popen([sys.executable, "-m", "screener.cli", "daemon", "--config", str(config),
                             *extra], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(work / "daemon.log", "ab"))


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def idle_footprint(seconds: float, kind: str = "local") -> dict[str, Any]:
    """kind "local": the SQLite store; "kube": the Kubernetes store against tests/fakes/kubeapi.py (the
    DaemonSet's case: the kubernetes client loaded, the node's pods listed at every probe)."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        now = time.time()
        # A node that passed its full burn-in a moment ago: healthy, no screen due.
        seed = machine.KnownAnswerScreen((Verdict("cuda:0", Outcome.PASS),), kind=machine.KIND_FULL)
        extra: tuple[str, ...] = ()
        if kind == "kube":
            # Here: the kubernetes client is an optional install, and only the kube mode needs it.
            from screener.stores.kube import KubeStore

            api = stack.enter_context(KubeAPI())
            api.add_node(NODE)
            store: Any = KubeStore(api.api_client(), instance="bench")
            where: dict[str, Any] = {"store": "kube", "spool": str(work / "spool.db")}
            extra = ("--kubeconfig", str(api.write_kubeconfig(work / "kubeconfig")))
        else:
            store = LocalStore(work / "state.db")
            where = {"store": "local", "db": str(work / "state.db")}
        apply_event(store, NODE, seed, now=now)
        store.set_verdict(NODE, {"time": now, "outcome": "pass", "kind": "full"})
        store.close()
        cfg = _config(work / "d.json", metrics_port=0, tick_s=5, probe_interval_s=15,
                      idle_window_s=0, **where)
        proc = _start(cfg, work, *extra)
        try:
            time.sleep(8.0)  # imports, start-up, first probe
            p = psutil.Process(proc.pid)
            assert proc.poll() is None, (work / "daemon.log").read_text()
            t0, c0 = time.monotonic(), p.cpu_times()
            rss_max = p.memory_info().rss
            while time.monotonic() - t0 < seconds:
                time.sleep(1.0)
                rss_max = max(rss_max, p.memory_info().rss)
            t1, c1 = time.monotonic(), p.cpu_times()
            cpu = (c1.user - c0.user) + (c1.system - c0.system)
            port = next(json.loads(line)["port"] for line in (work / "daemon.log").read_text()
                        .splitlines() if '"event": "metrics"' in line)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                scraped = r.status == 200
            rss = p.memory_info().rss
            threads = p.num_threads()
        finally:
            _stop(proc)
    return {"window_s": round(t1 - t0, 1), "rss_mib": round(rss / 2**20, 1),
            "rss_max_mib": round(rss_max / 2**20, 1), "cpu_s": round(cpu, 3),
            "cpu_share_pct": round(100 * cpu / (t1 - t0), 3), "threads": threads,
            "metrics_scraped": scraped, "tick_s": 5, "probe_interval_s": 15, "store": kind}


def _drop(alarm_dir: Path, i: int, settled: bool) -> float:
    rec = AlarmRecord(alarm_id=f"bench-{i}-{time.time_ns()}", check="ring_replay", step=i,
                      settled=settled, suspect_ranks=(0,) if settled else (),
                      suspect_nodes=(SuspectNode(NODE, NODE),), node=NODE, job="bench",
                      created=time.time())
    t = time.perf_counter()
    write_alarm_file(rec, alarm_dir)
    return t


def _latencies(state_of: Callable[[], Optional[str]], reset: Callable[[], None], alarm_dir: Path,
               samples: int) -> list[float]:
    out = []
    for i in range(samples):
        reset()
        t0 = _drop(alarm_dir, i, settled=True)
        deadline = time.perf_counter() + 30
        while state_of() not in ("quarantined", "repair"):  # repair: the lemon rule, from the 3rd
            if time.perf_counter() > deadline:
                raise TimeoutError("the daemon never took the alarm in")
            time.sleep(0.005)
        out.append(time.perf_counter() - t0)
    return out


def latency_local(samples: int, tick_s: float) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        db = work / "state.db"
        cfg = _config(work / "d.json", store="local", db=str(db), metrics_port=-1, tick_s=tick_s,
                      screens=False, probe_interval_s=3600)
        proc = _start(cfg, work)
        store = LocalStore(db)
        try:
            while store.get_state(NODE) is None:
                time.sleep(0.05)

            def reset() -> None:
                if store.get_state(NODE) in (NodeState.QUARANTINED, NodeState.REPAIR):
                    apply_event(store, NODE, machine.HumanCommand(NodeState.BURNIN, "bench reset"),
                                now=time.time())
                time.sleep(PHASE.uniform(0.05, tick_s))  # a random phase against the tick

            return _latencies(lambda: (s.value if (s := store.get_state(NODE)) else None), reset,
                              work / "alarms", samples)
        finally:
            _stop(proc)
            store.close()


def latency_kube(samples: int, tick_s: float) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp, KubeAPI() as api:
        work = Path(tmp)
        api.add_node(NODE)
        cfg = _config(work / "d.json", store="kube", metrics_port=-1, tick_s=tick_s, screens=False,
                      probe_interval_s=3600, spool=str(work / "spool.db"))
        proc = _start(cfg, work, "--kubeconfig", str(api.write_kubeconfig(work / "kubeconfig")))
        try:
            label = lambda: api.node(NODE)["metadata"]["labels"].get(LABEL_STATE)  # noqa: E731
            while label() is None:
                time.sleep(0.05)

            def reset() -> None:
                if label() in ("quarantined", "repair"):
                    # Here: the kubernetes client is an optional install (see idle_footprint).
                    from screener.stores.kube import KubeStore

                    s = KubeStore(api.api_client(), instance="bench")
                    apply_event(s, NODE, machine.HumanCommand(NodeState.BURNIN, "bench reset"),
                                now=time.time())
                    s.close()
                time.sleep(PHASE.uniform(0.05, tick_s))

            return _latencies(label, reset, work / "alarms", samples)
        finally:
            _stop(proc)


def _summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "median_s": round(statistics.median(xs), 3), "min_s": round(min(xs), 3),
            "max_s": round(max(xs), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results: dict[str, Any] = {"idle_local": idle_footprint(args.idle_seconds, "local"),
                               "idle_kube": idle_footprint(args.idle_seconds, "kube")}
    for tick in (5.0, 1.0):
        results[f"alarm_to_state_local_tick{tick:g}"] = _summary(latency_local(args.samples, tick))
        results[f"alarm_to_label_kube_tick{tick:g}"] = _summary(latency_kube(args.samples, tick))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for key in ("idle_local", "idle_kube"):
        i = results[key]
        print(f"idle daemon ({i['store']} store): RSS {i['rss_mib']} MiB (max {i['rss_max_mib']}), "
              f"CPU {i['cpu_s']} s over {i['window_s']} s = {i['cpu_share_pct']}% of one core, "
              f"{i['threads']} threads (tick {i['tick_s']} s, probes every {i['probe_interval_s']} s)")
    for k, v in results.items():
        if not k.startswith("idle"):
            print(f"{k}: median {v['median_s']} s (min {v['min_s']}, max {v['max_s']}, n={v['n']})")


if __name__ == "__main__":
    main()
