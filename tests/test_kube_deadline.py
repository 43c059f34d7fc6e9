"""A deadline per API call that no server behaviour can stretch, SIGTERM within the grace period,
and a daemon that starts while the API is out of reach (issue 36.4).

Real parts only: the Kubernetes API test server (tests/fakes/kubeapi.py) behind a real TCP proxy
(tests/fakes/tcpproxy.py) that drips the real answers one byte at a time or black-holes them; the
store through the official client over HTTP, and `screener daemon` as a child process.
Before: a dripped answer held a call (and `daemon --once`) for ever and SIGTERM did not end it;
a black hole took read_s per attempt past call_s; a daemon starting in an outage took no alarms.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest

from fakes.daemon import DaemonRig, ScriptedRunner, outcome
from fakes.kubeapi import KubeAPI
from fakes.tcpproxy import TcpProxy
from screener.audit.alarms import write_alarm_file
from screener.stores.kube import KubeStore, KubeTimeouts, RetryPolicy, TransientKubeError
from screener.alarmfile import AlarmRecord
from screener.node_answer import encode, parse_answer
from screener.stores.spool import Spool
from screener.types import ExitCode, LABEL_STATE, NodeState, Outcome, SuspectNode

ROOT = Path(__file__).resolve().parents[1]
NODE = "gpu-node-1"


def store_via(proxy: TcpProxy, timeouts: KubeTimeouts) -> KubeStore:
    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.retries = proxy.url, False
    return KubeStore(kubernetes.client.ApiClient(cfg), namespace="screener-system",
                     instance=NODE, timeouts=timeouts, retry=RetryPolicy(base_delay=0.05))


def timed(fn: Any, limit: float) -> tuple[float, BaseException | None]:
    """Run fn on a thread; (seconds it took, what it raised). A call still running after
    `limit` fails the test here instead of holding it (the old code never returned)."""
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out["error"] = e
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"the call was still running after {limit} s"
    return out["took"], out.get("error")


@pytest.fixture
def proxied():
    with KubeAPI() as api:
        api.add_node(NODE, labels={LABEL_STATE: "healthy"})
        proxy = TcpProxy(api.port, drip_s=0.2, hold_s=60.0)
        try:
            yield api, proxy
        finally:
            proxy.close()


def test_a_dripping_answer_ends_at_the_calls_deadline_not_after_it(proxied):
    api, proxy = proxied
    quick = KubeTimeouts(connect_s=1.0, read_s=1.0, call_s=1.5, unreachable_s=5.0)
    store = store_via(proxy, quick)
    try:
        assert store.get_state(NODE).value == "healthy"
        proxy.add("drip")  # a byte every 0.2 s: every read answers within read_s
        took, error = timed(lambda: store.get_state(NODE), 10.0)
        assert isinstance(error, TransientKubeError) and "timed out" in str(error), error
        assert took < quick.call_s + 1.0, took
        assert any(action == "drip" for _, action in proxy.seen)
        # The deadline counts as a timeout: the API is then unreachable for a while.
        took, error = timed(lambda: store.get_state(NODE), 5.0)
        assert isinstance(error, TransientKubeError) and "did not answer in time" in str(error)
        assert took < 0.2
        proxy.clear()
        store.calls._unreachable_until = 0.0
        assert store.get_state(NODE).value == "healthy"  # the pool is not left broken
    finally:
        store.close()


def test_a_black_hole_ends_within_call_s_not_read_s_per_attempt(proxied):
    api, proxy = proxied
    # Before: an attempt started with 0.45 s left ran its whole read timeout (2 s) past call_s.
    bound = KubeTimeouts(connect_s=1.0, read_s=2.0, call_s=2.5, unreachable_s=0.0)
    store = store_via(proxy, bound)
    try:
        proxy.add("blackhole")
        took, error = timed(lambda: store.get_state(NODE), 15.0)
        assert isinstance(error, TransientKubeError), error
        assert took < bound.call_s + 0.8, took
    finally:
        store.close()


def test_wind_down_ends_a_call_in_flight(proxied):
    api, proxy = proxied
    store = store_via(proxy, KubeTimeouts())  # call_s 45 s: only the wind-down can end it soon
    try:
        proxy.add("drip")
        threading.Timer(0.5, store.wind_down, args=(0.5,)).start()
        took, error = timed(lambda: store.get_state(NODE), 10.0)
        assert isinstance(error, TransientKubeError), error
        assert took < 2.5, took
        took, error = timed(lambda: store.get_state(NODE), 5.0)  # and no new call outlives it
        assert isinstance(error, TransientKubeError) and took < 0.2, (took, error)
    finally:
        store.close()


# --- `screener daemon` as a child process ---------------------------------------------------


def daemon_env(tmp_path: Path, proxy: TcpProxy, api: KubeAPI, **timeouts: float) -> tuple[dict, Path]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        **json.loads(api.write_kubeconfig(tmp_path / "k0").read_text()),
        "clusters": [{"name": "test", "cluster": {"server": proxy.url}}]}))
    config = tmp_path / "d.json"
    config.write_text(json.dumps({
        "store": "kube", "kubeconfig": str(kubeconfig), "screens": False, "metrics_port": -1,
        "spool": str(tmp_path / "spool.db"), "tick_s": 0.5, "kube_timeouts": timeouts,
        "probes": {"kmsg_path": None, "disk_paths": [str(tmp_path)], "min_free_disk_fraction": 0,
                   "min_free_memory_fraction": 0}}))
    env = {**os.environ, "NODE_NAME": NODE, "SCREENER_ALARM_DIR": str(tmp_path / "alarms"),
           "XDG_STATE_HOME": str(tmp_path / "state"), "SCREENER_CONFIG": str(config),
           "POD_NAMESPACE": "screener-system"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env, tmp_path / "spool.db"


def drop_alarm(tmp_path: Path, alarm_id: str) -> None:
    write_alarm_file(AlarmRecord(alarm_id=alarm_id, check="ring_replay", step=3, settled=True,
                                 suspect_ranks=(0,), suspect_nodes=(SuspectNode(NODE, NODE),),
                                 node=NODE, job="train"), tmp_path / "alarms")


def spooled(spool: Path) -> list[str]:
    with sqlite3.connect(spool) as db:
        return [json.loads(r)["to"] for (r,) in db.execute("SELECT record FROM spool")]


@pytest.mark.slow
def test_daemon_once_on_a_dripping_api_ends_in_bounded_time_and_spools_the_alarm(proxied, tmp_path):
    """The outage at start-up: a restarted daemon's first pass finds the API dripping. It ends within the
    call deadline (exit 1: the store failed), its probes ran, and the node's alarm was decided on
    what the store knew and spooled (held in suspect: no budget slot can be claimed). The next
    pass, the API answering, writes it and takes the budget slot: quarantined."""
    api, proxy = proxied
    env, spool = daemon_env(tmp_path, proxy, api, connect_s=1.0, read_s=1.0, call_s=3.0,
                            unreachable_s=30.0)
    cmd = [sys.executable, "-m", "screener.cli", "daemon", "--once", "--json"]
    # A pass with the API answering: the node is known (healthy) to this daemon's state disk.
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == int(ExitCode.PASS), r.stderr[-2000:]
    # The daemon restarts (a new pod) while the API drips.
    drop_alarm(tmp_path, "drip-1")
    proxy.add("drip")
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    took = time.monotonic() - t0
    assert took < 25.0, took  # before: not ended after 240 s
    assert r.returncode == int(ExitCode.SCREENER_ERROR), r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["probed"] is True
    assert report["alarms"]["applied"] == ["drip-1"], report["alarms"]
    assert any(e.startswith("start:") for e in report["errors"]), report["errors"]
    assert spooled(spool) == ["suspect"]
    assert not list((tmp_path / "alarms").glob("*.json"))  # taken in: the spool holds it
    assert api.node(NODE)["metadata"]["labels"][LABEL_STATE] == "healthy"

    proxy.clear()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == int(ExitCode.HARDWARE_SUSPECT), r.stderr[-2000:]
    assert spooled(spool) == []
    assert api.node(NODE)["metadata"]["labels"][LABEL_STATE] == "quarantined"


@pytest.mark.slow
def test_sigterm_during_a_dripping_call_ends_the_daemon_within_its_grace(proxied, tmp_path):
    """The DaemonSet's loop, the API dripping, the call's own deadline long (45 s): SIGTERM ends
    the process within stop_s plus the pass's wind-down, exit 0, far inside the pod's 60 s."""
    api, proxy = proxied
    env, _ = daemon_env(tmp_path, proxy, api, stop_s=2.0)
    proxy.add("drip")
    proc = subprocess.Popen([sys.executable, "-m", "screener.cli", "daemon"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not any(a == "drip" for _, a in proxy.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(a == "drip" for _, a in proxy.seen), "the daemon never called the API"
        time.sleep(1.0)  # in the middle of the dripping answer
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM did not end the daemon within 40 s")
        took = time.monotonic() - t0
        assert proc.returncode == 0, err[-2000:]
        # stop_s, then the screening taint tried twice (4 s each): ~10 s
        assert took < 20.0, (took, err[-3000:])
        assert '"event": "stopping"' in err or "API calls end within" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refusing_api_costs_a_pass_one_calls_retries_not_every_calls():
    """A closed port refuses every connection at once, so no call times out and the unreachable
    window stays shut; but each call used to back off through all its retries (call_s apiece: a
    daemon pass took 45 s against a real server). Now, once a call of a pass had no answer, the
    rest of the pass tries each call once; the next pass retries in full again."""
    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.retries = f"http://127.0.0.1:{_closed_port()}", False
    timeouts = KubeTimeouts(connect_s=1.0, read_s=1.0, call_s=3.0, unreachable_s=30.0)
    store = KubeStore(kubernetes.client.ApiClient(cfg), namespace="screener-system",
                      instance=NODE, timeouts=timeouts, retry=RetryPolicy(base_delay=0.3))

    def calls(n: int) -> list[float]:
        took = []
        for _ in range(n):  # on this thread: a pass is the thread's that opened it
            t0 = time.monotonic()
            with pytest.raises(TransientKubeError, match="attempt"):
                store.get_state(NODE)
            took.append(time.monotonic() - t0)
            assert took[-1] < 10.0  # call_s holds whatever happens
        return took

    try:
        for _ in range(2):  # two passes: each starts with a call that retries in full
            with store.one_pass():
                first, *rest = calls(8)
            assert first >= 0.3 + 0.6  # backed off at least twice: 0.3 s, then 0.6 s
            assert sum(rest) < 0.5, rest  # one refused connect each
        assert calls(2)[1] >= 0.9  # outside a pass, every call retries in full, as before
    finally:
        store.close()


def _point_at(tmp_path: Path, url: str) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    doc = json.loads(kubeconfig.read_text())
    doc["clusters"] = [{"name": "test", "cluster": {"server": url}}]
    kubeconfig.write_text(json.dumps(doc))


@pytest.mark.slow
def test_daemon_once_on_a_closed_port_takes_the_alarm_in_a_pass_of_one_calls_retries(proxied,
                                                                                      tmp_path):
    """A restarted daemon whose API refuses every connection (nothing listens on the port): its
    pass probes and spools the alarm in about one call's retries (call_s 3 s; before, 3 s for
    every call: 45 s against a real server), exit 1; the API back, the next pass writes it."""
    api, proxy = proxied
    env, spool = daemon_env(tmp_path, proxy, api, connect_s=1.0, read_s=1.0, call_s=3.0,
                            unreachable_s=30.0)
    cmd = [sys.executable, "-m", "screener.cli", "daemon", "--once", "--json"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == int(ExitCode.PASS), r.stderr[-2000:]
    drop_alarm(tmp_path, "refused-1")
    _point_at(tmp_path, f"http://127.0.0.1:{_closed_port()}")
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == int(ExitCode.SCREENER_ERROR), r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["probed"] is True
    assert report["alarms"]["applied"] == ["refused-1"], report["alarms"]
    assert spooled(spool) == ["suspect"]
    assert took < 15.0, took  # the process's start (torch) and one call's retries; was ~45 s

    _point_at(tmp_path, proxy.url)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == int(ExitCode.HARDWARE_SUSPECT), r.stderr[-2000:]
    assert spooled(spool) == []
    assert api.node(NODE)["metadata"]["labels"][LABEL_STATE] == "quarantined"


def test_a_first_start_in_an_outage_holds_jobs_back_for_the_alarm_it_could_not_decide(proxied,
                                                                                     tmp_path):
    """A daemon on a fresh state disk (its spool never saw the node) starts while every
    connection to the API is reset: it cannot know the node's state, so it decides nothing (a
    guess could put a serving node in burnin), but it probes, leaves the alarm in its file, and
    its health answer refuses jobs naming the alarm. The API back, the alarm is decided on the
    node's real state and the answer is that state's."""
    api, proxy = proxied
    timeouts = KubeTimeouts(connect_s=0.5, read_s=0.5, call_s=0.8, unreachable_s=0.0)
    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.retries = proxy.url, False
    store = KubeStore(kubernetes.client.ApiClient(cfg), namespace="screener-system",
                      instance=NODE, timeouts=timeouts, retry=RetryPolicy(base_delay=0.05),
                      spool=Spool(tmp_path / "spool.db"))
    store.decide_offline()  # as `screener daemon` does
    rig = DaemonRig(tmp_path, ScriptedRunner(outcome(Outcome.PASS)), store=store, node=NODE,
                    idle_window_s=0.0)
    try:
        proxy.add("reset-before")
        rig.drop_alarm("first-start-1")
        rig.nvml.gpus[1].remapped_rows = (0, 0, 1, 0)  # a row remap pending: suspect-level
        report = rig.tick(once=True)
        assert rig.probe_calls == 1  # probed although nothing could be decided
        assert report.intake.failed == ["first-start-1.json"], report.intake
        assert [p.name for p in rig.daemon.intake.pending()] == ["first-start-1.json"]
        assert len(store.spool) == 0  # no decision on an assumed state
        answer = parse_answer(encode(rig.daemon.answer.body()))
        assert answer.state is None and not answer.may_run_jobs
        assert answer.waiting.startswith("1 alarm file (first-start-1.json) and 1 finding "
                                         "(row_remap_pending on GPU GPU-00000001-"), answer.waiting
        assert answer.waiting.endswith("), held until decided (the node's state is not known "
                                       "yet)"), answer.waiting
        assert api.node(NODE)["metadata"]["labels"][LABEL_STATE] == "healthy"

        proxy.clear()
        report = rig.tick(advance=5.0)
        assert report.intake.failed == [] and rig.daemon.intake.pending() == []
        label = api.node(NODE)["metadata"]["labels"][LABEL_STATE]
        assert label in ("suspect", "quarantined"), label
        answer = parse_answer(encode(rig.daemon.answer.body()))
        assert answer.waiting == "" and answer.state == NodeState(label)
        assert not answer.may_run_jobs and answer.why.startswith(f"the node is {label}")
    finally:
        rig.close()
