"""The alarm intake under a flood of bulky files about another node (issue 23.2's campaign case).

Run:  python benchmarks/bench_intake.py [--files 2000] [--watch 30] [--drain] [--json]

`screener daemon` runs as its own process (local store, screens off, a tick of 5 s, the metrics
server on a free port) over an alarm folder holding `--files` valid alarms about another node of
~241 KB each (a long suspect_ranks list), written before it starts. Then:

1. the node's own alarm is dropped and timed until it is in processed/;
2. for `--watch` seconds /healthz is asked every 0.5 s with the kubelet's probe timeout (5 s),
   and the daemon's CPU seconds are read;
3. SIGTERM is sent while bulky files are still waiting, and timed until the process is gone;
4. with `--drain`, a second daemon waits until no alarm file is left and reports the CPU seconds
   of 30 s after that (what a pass costs once the files are moved aside).

Before issue 23.2 the files were re-parsed on every pass (about 35 ms of CPU each) and neither
/healthz nor SIGTERM was served until a pass ended.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
NODE = "bench-node"
OWN = {"schema": 1, "alarm_id": "own", "check": "weights", "step": 3, "settled": False,
       "suspect_ranks": [], "suspect_nodes": [{"node": NODE, "hostname": NODE}], "node": NODE,
       "job": "j", "created": time.time(), "evidence": {}}


def _files(alarms: Path, n: int) -> int:
    alarms.mkdir(parents=True)
    body = json.dumps({**OWN, "alarm_id": "ID", "node": "another-node", "suspect_nodes": [],
                       "suspect_ranks": list(range(10_000, 44_500))})
    for i in range(n):
        p = alarms / f"foreign-{i:05d}.json"
        p.write_text(body.replace('"ID"', f'"f{i}"', 1))
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    return len(body)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(work: Path, port: int) -> subprocess.Popen:
    config = work / "daemon.json"
    config.write_text(json.dumps({
        "screens": False, "tick_s": 5.0, "metrics_host": "127.0.0.1", "metrics_port": port,
        "liveness_s": 60.0, "probes": {"kmsg_path": None, "disk_paths": [str(work)],
                                       "min_free_disk_fraction": 0, "min_free_memory_fraction": 0}}))
    env = {**os.environ, "NODE_NAME": NODE, "SCREENER_ALARM_DIR": str(work / "alarms"),
           "XDG_STATE_HOME": str(work / "state"), "OMP_NUM_THREADS": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.Popen([sys.executable, "-m", "screener.cli", "daemon", "--config",
                             str(config)], cwd=work, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(work / "daemon.log", "ab"))


def _healthz(port: int) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            code = r.status
    except urllib.error.HTTPError as e:
        code = e.code
    except OSError:
        code = 0  # refused or timed out: the kubelet counts a failure
    return code, time.monotonic() - t0


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _wait_up(port: int, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if _healthz(port)[0]:
            return
        time.sleep(0.2)
    raise SystemExit("the daemon never answered /healthz")


def flood(n: int, watch: float) -> dict[str, Any]:
    """Steps 1-3 of the module docstring."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        size = _files(work / "alarms", n)
        port = _port()
        proc = _start(work, port)
        ps = psutil.Process(proc.pid)
        _wait_up(port)
        cpu0, t0 = _cpu(ps), time.monotonic()
        (work / "alarms" / ".own.tmp").write_text(json.dumps(OWN))
        os.replace(work / "alarms" / ".own.tmp", work / "alarms" / "own.json")
        own_s, codes, worst = None, [], 0.0
        while time.monotonic() - t0 < watch:
            code, took = _healthz(port)
            codes.append(code)
            worst = max(worst, took)
            if own_s is None and (work / "alarms" / "processed" / "own.json").exists():
                own_s = time.monotonic() - t0
            time.sleep(0.5)
        cpu = _cpu(ps) - cpu0
        left = len(list((work / "alarms").glob("foreign-*.json")))
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return {"files": n, "file_bytes": size, "watch_s": watch, "cpu_s": round(cpu, 2),
                "own_alarm_s": None if own_s is None else round(own_s, 1),
                "healthz_ok": sum(1 for c in codes if c == 200), "healthz_asked": len(codes),
                "healthz_slowest_s": round(worst, 2), "left_at_sigterm": left,
                "sigterm_s": round(time.monotonic() - t1, 2)}


def drain(n: int, limit: float = 900.0) -> dict[str, Any]:
    """Step 4: how long the flood takes to move aside, and a pass's CPU after it."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _files(work / "alarms", n)
        port = _port()
        proc = _start(work, port)
        ps = psutil.Process(proc.pid)
        try:
            _wait_up(port)
            t0 = time.monotonic()
            while list((work / "alarms").glob("foreign-*.json")):
                if time.monotonic() - t0 > limit:
                    return {"drained": False, "after_s": limit}
                time.sleep(1.0)
            drained = time.monotonic() - t0
            cpu0 = _cpu(ps)
            time.sleep(30.0)
            return {"drained": True, "drain_s": round(drained, 1),
                    "cpu_per_pass_after_s": round((_cpu(ps) - cpu0) / 6, 3)}
        finally:
            proc.terminate()
            proc.wait(300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--watch", type=float, default=30.0)
    ap.add_argument("--drain", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = {"flood": flood(args.files, args.watch)}
    if args.drain:
        out["drain"] = drain(args.files)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
