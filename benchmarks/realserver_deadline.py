"""The call deadline, SIGTERM and an outage at start-up (issue 36.4) on a real kube-apiserver.

    bash benchmarks/realserver-up.sh          # etcd + kube-apiserver 1.28.7 on 127.0.0.1:6443
    python benchmarks/realserver_deadline.py [--apiserver https://127.0.0.1:6443] [--token T]

tests/test_kube_deadline.py's scenarios with the real server's answers in place of the test
server's: `screener daemon` children act as the node's daemon pod (the DaemonSet's service account
with its node claim, by impersonation: benchmarks/realserver.py), their plain-HTTP connections
forwarded over TLS by tests/fakes/tcpproxy.py, which drips the real answers one byte every
--drip-s seconds when told. Printed, per scenario: seconds, exit code and what the pass did.

1. drip: a daemon restarts (`daemon --once`, an alarm waiting) while every answer drips: it must
   end within its call deadline (call_s 3 s), probe, take the alarm into the spool; the next pass,
   the server answering, writes it (quarantined).
2. sigterm: the DaemonSet's loop while every answer drips (call_s 45 s): SIGTERM must end it
   within its grace (stop_s 2 s, then the wind-down), exit 0.
3. outage: a daemon starting while the API is out of reach (a closed port), restarted (the
   node's state on its state disk) and on its first start: its pass probes and, where it knows
   the node's state, spools the alarm; once the API is back, the next pass writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

import realserver  # noqa: E402
from fakes.tcpproxy import TcpProxy  # noqa: E402
from screener.alarmfile import AlarmRecord  # noqa: E402
from screener.audit.alarms import write_alarm_file  # noqa: E402
from screener.types import LABEL_STATE, SuspectNode  # noqa: E402


def _env(home: Path, node: str, server: str, token: str, **timeouts: float) -> dict[str, str]:
    tag = uuid.uuid4().hex[:6]  # one home, several servers: each its own kubeconfig and config
    kubeconfig = home / f"kubeconfig-{tag}"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "real",
        "clusters": [{"name": "real", "cluster": {"server": server}}],
        "users": [{"name": "daemon", "user": {"token": token}}],
        "contexts": [{"name": "real", "context": {"cluster": "real", "user": "daemon"}}]}))
    config = home / f"d-{tag}.json"
    config.write_text(json.dumps({
        "store": "kube", "kubeconfig": str(kubeconfig), "screens": False, "metrics_port": -1,
        "spool": str(home / "spool.db"), "tick_s": 0.5, "kube_timeouts": timeouts,
        "probes": {"kmsg_path": None, "disk_paths": [str(home)], "min_free_disk_fraction": 0,
                   "min_free_memory_fraction": 0}}))
    env = {**os.environ, **realserver.child_env(node, home / "requests.jsonl"),
           "NODE_NAME": node, "SCREENER_ALARM_DIR": str(home / "alarms"),
           "XDG_STATE_HOME": str(home / "state"), "SCREENER_CONFIG": str(config),
           "POD_NAMESPACE": realserver.NS}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env


def _alarm(home: Path, node: str, alarm_id: str) -> None:
    write_alarm_file(AlarmRecord(alarm_id=alarm_id, check="ring_replay", step=3, settled=True,
                                 suspect_ranks=(0,), suspect_nodes=(SuspectNode(node, node),),
                                 node=node, job="train", created=time.time() - 1.0),
                     home / "alarms")


def _spooled(spool: Path) -> list[str]:
    if not spool.exists():
        return []
    with sqlite3.connect(spool) as db:
        return [json.loads(r)["to"] for (r,) in db.execute("SELECT record FROM spool")]


def _once(env: dict[str, str]) -> tuple[float, int, dict[str, Any]]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "screener.cli", "daemon", "--once", "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(r.stdout)
    except ValueError:
        report = {"stderr": r.stderr[-500:]}
    return time.monotonic() - t0, r.returncode, report


def _label(target: realserver.RealTarget, node: str) -> str:
    return str(target.node(node)["metadata"].get("labels", {}).get(LABEL_STATE))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--apiserver", default="https://127.0.0.1:6443")
    p.add_argument("--token", default="screener-admin")
    p.add_argument("--drip-s", type=float, default=0.5)
    a = p.parse_args(argv)
    port = int(a.apiserver.rsplit(":", 1)[1])
    target = realserver.RealTarget(a.apiserver, a.token)
    run = uuid.uuid4().hex[:6]
    proxy = TcpProxy(port, drip_s=a.drip_s, hold_s=120.0, upstream_tls=True)
    rows: list[tuple[str, str]] = []
    try:
        # 1. drip at start-up
        node = f"drip-{run}"
        target.add_node(node, labels={LABEL_STATE: "healthy"})
        home = Path(tempfile.mkdtemp(prefix="rs-drip-"))
        env = _env(home, node, proxy.url, a.token, connect_s=1.0, read_s=1.0, call_s=3.0,
                   unreachable_s=30.0)
        took, code, rep = _once(env)
        rows.append(("drip: a pass with the API answering", f"{took:.1f} s, exit {code}"))
        _alarm(home, node, "drip-1")
        proxy.add("drip")
        took, code, rep = _once(env)
        rows.append(("drip: daemon --once, every answer dripped",
                     f"{took:.1f} s, exit {code}, probed {rep.get('probed')}, alarms applied "
                     f"{(rep.get('alarms') or {}).get('applied')}, spooled "
                     f"{_spooled(home / 'spool.db')}, label {_label(target, node)}"))
        proxy.clear()
        took, code, rep = _once(env)
        rows.append(("drip: the next pass, the API answering",
                     f"{took:.1f} s, exit {code}, spooled {_spooled(home / 'spool.db')}, label "
                     f"{_label(target, node)}"))

        # 2. SIGTERM while dripping
        node = f"term-{run}"
        target.add_node(node, labels={LABEL_STATE: "healthy"})
        home = Path(tempfile.mkdtemp(prefix="rs-term-"))
        env = _env(home, node, proxy.url, a.token, stop_s=2.0)
        proxy.add("drip")
        proxy.seen.clear()  # the first scenario's drips are not this daemon's
        proc = subprocess.Popen([sys.executable, "-m", "screener.cli", "daemon"], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 60
        while not any(x == "drip" for _, x in proxy.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
            rows.append(("sigterm: the loop, every answer dripped",
                         f"ended {time.monotonic() - t0:.1f} s after SIGTERM, exit "
                         f"{proc.returncode}"))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            rows.append(("sigterm: the loop, every answer dripped", "NOT ended within 60 s"))
        proxy.clear()

        # 3. outage at start-up (a closed port): a restarted daemon (the node's state on its
        # state disk from an earlier pass) and a first start (nothing known)
        for known in (True, False):
            node = f"outage-{'known' if known else 'fresh'}-{run}"
            target.add_node(node, labels={LABEL_STATE: "healthy"})
            home = Path(tempfile.mkdtemp(prefix="rs-outage-"))
            up = _env(home, node, proxy.url, a.token, connect_s=1.0, read_s=1.0, call_s=3.0,
                      unreachable_s=30.0)
            if known:
                _once(up)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                closed = s.getsockname()[1]
            env = _env(home, node, f"http://127.0.0.1:{closed}", a.token, connect_s=1.0,
                       read_s=1.0, call_s=3.0, unreachable_s=30.0)
            _alarm(home, node, "outage-1")
            took, code, rep = _once(env)
            how = "restart" if known else "first start"
            rows.append((f"outage ({how}): a pass, API out of reach",
                         f"{took:.1f} s, exit {code}, probed {rep.get('probed')}, alarms applied "
                         f"{(rep.get('alarms') or {}).get('applied')}, spooled "
                         f"{_spooled(home / 'spool.db')}"))
            took, code, rep = _once(up)
            rows.append((f"outage ({how}): the next pass, the API back",
                         f"{took:.1f} s, exit {code}, spooled {_spooled(home / 'spool.db')}, "
                         f"label {_label(target, node)}"))
    finally:
        proxy.close()
    for what, result in rows:
        print(f"{what:50} {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
