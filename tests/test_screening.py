"""The screening window against a real Kubernetes API test server: the screening taint is on while
a screen runs and always off afterwards (pass, exception, SIGTERM, stale at start), and a job that
lands mid-screen stops it at once as inconclusive, not a failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from fakes.kubeapi import KubeAPI
from screener.agent.screening.window import (ScreenOptions, ScreenProcessRunner, LocalTaint,
                                             ScreeningWindow, ScreenRequest)
from screener.stores.kube import KubeStore
from screener.stores.kube.bound import KubeNodeObject
from screener.types import (ANNOTATION_DIGESTS, ANNOTATION_VERDICT, LABEL_STATE,
                            TAINT_SCREENING_KEY, ExitCode, NodeState, Outcome)
from fakes.daemon import NODE, DaemonRig, FakeNodeObject, ScriptedRunner, outcome, wait_for_cancel

ROOT = Path(__file__).resolve().parents[1]
FOREIGN_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
SCREENING_TAINT = {"key": TAINT_SCREENING_KEY, "value": "true", "effect": "NoSchedule"}


def screening_tainted(api: KubeAPI, node: str = NODE) -> bool:
    return any(t["key"] == TAINT_SCREENING_KEY for t in api.node(node)["spec"].get("taints") or [])


@pytest.fixture
def api():
    with KubeAPI() as server:
        server.add_node(NODE, taints=[FOREIGN_TAINT])
        yield server


def kube_store(api: KubeAPI) -> KubeStore:
    return KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0, instance="test")


@pytest.fixture
def kube_rig(tmp_path, api):
    rigs = []

    def make(runner, **kw):
        store = kube_store(api)
        rig = DaemonRig(tmp_path, runner, store=store, taint=store,
                        node_object=KubeNodeObject(store, NODE), **kw)
        rigs.append(rig)
        return rig

    yield make
    for r in rigs:
        r.close()


def test_the_taint_is_on_during_the_screen_and_off_after_a_pass(api, kube_rig):
    seen = []

    def during(request: ScreenRequest):
        seen.append(screening_tainted(api))
        return None

    rig = kube_rig(ScriptedRunner(outcome(Outcome.PASS), during=during), idle_window_s=0.0)
    report = rig.tick()
    assert seen == [True]
    assert report.state == NodeState.HEALTHY
    node = api.node(NODE)
    assert not screening_tainted(api) and FOREIGN_TAINT in node["spec"]["taints"]
    assert node["metadata"]["labels"][LABEL_STATE] == "healthy"


def test_the_taint_is_removed_when_the_screen_raises(api, kube_rig):
    seen = []

    def explode(request: ScreenRequest):
        seen.append(screening_tainted(api))
        raise MemoryError("the runner itself fell over")

    rig = kube_rig(ScriptedRunner(during=explode), idle_window_s=0.0)
    report = rig.tick()
    assert seen == [True] and not screening_tainted(api)
    assert report.exit_code == ExitCode.SCREENER_ERROR and report.state == NodeState.BURNIN


def test_the_taint_removal_is_retried_through_api_errors(api, kube_rig):
    def fail_untaint(request: ScreenRequest):
        # Every attempt of the first removal round fails (5 tries x 5 transient retries).
        api.fail_next(25, status=503)
        return None

    rig = kube_rig(ScriptedRunner(outcome(Outcome.PASS), during=fail_untaint), idle_window_s=0.0)
    report = rig.tick()
    assert screening_tainted(api) and rig.daemon.window.taint_dirty
    assert report.screen.taint_removed is False
    rig.tick(advance=5.0)  # the next tick retries
    assert not screening_tainted(api) and not rig.daemon.window.taint_dirty


def test_a_stale_screening_taint_is_removed_at_start(api, kube_rig):
    api.mutate(NODE, lambda n: n["spec"]["taints"].append(dict(SCREENING_TAINT)))
    rig = kube_rig(ScriptedRunner(), idle_window_s=10_000.0)
    rig.daemon.start()
    assert not screening_tainted(api)
    assert FOREIGN_TAINT in api.node(NODE)["spec"]["taints"]
    assert rig.metrics.ready


def test_a_gpu_pod_landing_mid_screen_stops_it_at_once_as_inconclusive(api, kube_rig):
    def land(request: ScreenRequest):
        api.add_pod("trainer-0", NODE, namespace="ml", gpus=8)  # bound despite the taint
        return wait_for_cancel()(request)

    runner = ScriptedRunner(during=land)
    rig = kube_rig(runner, idle_window_s=0.0)
    t0 = time.monotonic()
    report = rig.tick()
    elapsed = time.monotonic() - t0
    assert report.screen.stopped == "yielded" and "ml/trainer-0" in report.screen.detail
    assert report.screen.outcome == Outcome.INCONCLUSIVE
    assert report.state == NodeState.BURNIN and report.transitions == []  # not a failure
    assert not screening_tainted(api)
    assert elapsed < 5.0
    samples = {s.name: s.value for m in rig.metrics.registry.collect() for s in m.samples
               if s.labels.get("reason") == "yielded"}
    assert samples["screener_screen_stops_total"] == 1.0
    # Busy now: no new screen while the pod is there.
    rig.tick(advance=60.0)
    assert len(runner.calls) == 1


def test_a_foreign_gpu_process_mid_screen_stops_it_but_our_own_does_not(tmp_path):
    mine = os.getpid()
    looked = threading.Event()  # set by each look for jobs (the pod list is its last step)

    def pods() -> list:
        looked.set()
        return []

    def land(request: ScreenRequest):
        rig.nvml.gpus[0].processes = [(mine, 2**30)]  # our own known-answer process
        # Two looks: the second began after the change, so it saw our process.
        for _ in range(2):
            looked.clear()
            assert looked.wait(10), "the window stopped looking for jobs"
        assert not request.cancel.is_set()
        rig.nvml.gpus[1].processes = [(999_999, 2**30)]  # someone else's
        return wait_for_cancel()(request)

    rig = DaemonRig(tmp_path, ScriptedRunner(during=land), idle_window_s=0.0,
                    own_pids=lambda: {mine}, node_object=FakeNodeObject(pods))
    try:
        report = rig.tick()
        assert report.screen.stopped == "yielded" and "999999" in report.screen.detail
        assert report.state == NodeState.BURNIN
        assert not rig.taint.present(NODE)
    finally:
        rig.close()


def test_the_time_cap_stops_a_screen_as_inconclusive(tmp_path):
    def slow(request: ScreenRequest):
        rig.clock.advance(1000.0)  # the screen takes longer than its cap of 900 s
        return wait_for_cancel()(request)

    rig = DaemonRig(tmp_path, ScriptedRunner(during=slow), idle_window_s=0.0)
    try:
        report = rig.tick()
        assert report.screen.stopped == "time_cap" and report.exit_code == ExitCode.INCONCLUSIVE
        assert not rig.taint.present(NODE)
    finally:
        rig.close()


def _sleepy_jobs(tmp_path: Path, seconds: float = 120.0) -> Path:
    jobs = tmp_path / "jobs"
    jobs.mkdir(exist_ok=True)
    (jobs / "sleepy.toml").write_text(
        f'name = "sleepy"\nversion = 1\nkind = "selftest"\n[params]\nsleep = {seconds}\n')
    return jobs


def test_the_real_known_answer_runner_is_killed_at_once_when_a_job_lands(tmp_path):
    """ScreenProcessRunner: a worker process with per-device children in sessions of their own; a
    job landing kills the whole family within the poll interval."""
    jobs = _sleepy_jobs(tmp_path)
    runner = ScreenProcessRunner(ScreenOptions(jobs=("sleepy",), devices=("cpu",), jobs_dir=str(jobs),
                                               golden_dir=str(tmp_path / "golden")), poll_s=0.05)
    me = psutil.Process()
    family: list = []

    def job_check():
        # Only the screen's own processes, the worker and the per-device children below it
        # (whatever module they run): pytest may have other long-lived children (such as
        # multiprocessing's resource tracker) that are none of the runner's business.
        try:
            workers = [k for k in me.children(recursive=True)
                       if "screener.agent.screening" in " ".join(k.cmdline())]
            kids = [c for w in workers for c in w.children(recursive=True) if c.is_running()]
        except psutil.Error:
            return None
        # Land the job once the per-device child (the worker's child) is running.
        if kids:
            family.extend(workers + kids)
            return "pod ml/trainer-0 (GPU pod)"
        return None

    taint = LocalTaint(tmp_path / "taint")
    window = ScreeningWindow(NODE, taint, runner, job_check, time_cap_s=60.0, poll_s=0.1)
    result = window.run()
    assert result.stopped == "yielded" and result.outcome == Outcome.INCONCLUSIVE
    assert family, "the known-answer child never started"
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, f"left running: {alive}"
    assert not taint.present(NODE)


def test_sigterm_mid_screen_removes_the_taint_and_exits_cleanly(tmp_path, api):
    """The real `screener daemon` process against the API server: SIGTERM during a screen."""
    jobs = _sleepy_jobs(tmp_path)
    config = tmp_path / "daemon.json"
    config.write_text(json.dumps({
        "store": "kube", "jobs": ["sleepy"], "jobs_dir": str(jobs),
        "golden_dir": str(tmp_path / "golden"), "idle_window_s": 0, "tick_s": 0.2,
        "job_poll_s": 0.1, "metrics_port": -1, "spool": str(tmp_path / "spool.db"),
        # The test server's Node is months old: without this it would be adopted healthy.
        "adopt": "off",
        "probes": {"kmsg_path": None, "disk_paths": [str(tmp_path)], "min_free_disk_fraction": 0,
                   "min_free_memory_fraction": 0}}))
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    env = {**os.environ, "NODE_NAME": NODE, "SCREENER_ALARM_DIR": str(tmp_path / "alarms"),
           "OMP_NUM_THREADS": "1", "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.Popen([sys.executable, "-m", "screener.cli", "daemon", "--config", str(config),
                             "--kubeconfig", str(kubeconfig)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not screening_tainted(api):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the daemon never opened a screening window"
            time.sleep(0.05)
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert not screening_tainted(api)
    assert api.node(NODE)["metadata"]["labels"][LABEL_STATE] == "burnin"  # not blamed
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
    lines = [json.loads(line) for line in err.decode().splitlines() if line.strip()]
    events = [x.get("event") for x in lines]
    assert "signal" in events and "stopped" in events
    done = [x for x in lines if x.get("event") == "screen_done"]
    assert done and done[0]["stopped"] == "shutdown"


def test_the_daemons_full_burnin_cross_checks_with_same_platform_peers(api, kube_rig):
    """On a cluster the daemon's full burn-in compares its digests with the nodes of the same
    platform (their annotations): agreeing peers make the cross-check part of a full burn-in;
    disagreeing ones make the node suspect instead of healthy."""
    for peer in ("peer-1", "peer-2", "peer-3"):
        api.add_node(peer, annotations={ANNOTATION_DIGESTS: json.dumps({"p1": {"gemm-fp32": "d1"}})})
    rig = kube_rig(ScriptedRunner(outcome(Outcome.PASS)), idle_window_s=0.0, adopt="off")
    report = rig.tick()
    assert report.state == NodeState.HEALTHY
    verdict = json.loads(api.node(NODE)["metadata"]["annotations"][ANNOTATION_VERDICT])
    assert verdict["kind"] == "full"
    assert "crosscheck" in [s["name"] for s in verdict["stages"]]


def test_digests_that_disagree_with_the_fleet_keep_the_node_out(api, kube_rig):
    for peer in ("peer-1", "peer-2", "peer-3"):
        api.add_node(peer, annotations={ANNOTATION_DIGESTS: json.dumps({"p1": {"gemm-fp32": "ee"}})})
    rig = kube_rig(ScriptedRunner(outcome(Outcome.PASS)), idle_window_s=0.0, adopt="off")
    report = rig.tick()
    assert report.state == NodeState.SUSPECT
    t = rig.store.history(NODE)[-1]
    assert t.evidence["verdicts"][-1]["reason"] == "fleet_digest_mismatch"


def test_a_peer_annotation_nested_past_the_parsers_limit_is_skipped_not_fatal(api, kube_rig):
    """Another node's digests annotation is not ours to trust: one nested 50,000 deep (json
    raises RecursionError, not ValueError) is skipped, and the burn-in's verdict still lands."""
    for peer in ("peer-1", "peer-2", "peer-3"):
        api.add_node(peer, annotations={ANNOTATION_DIGESTS: json.dumps({"p1": {"gemm-fp32": "d1"}})})
    api.add_node("peer-deep", annotations={ANNOTATION_DIGESTS: "[" * 50_000 + "]" * 50_000})
    rig = kube_rig(ScriptedRunner(outcome(Outcome.PASS)), idle_window_s=0.0, adopt="off")
    report = rig.tick()
    assert report.errors == [] and report.state == NodeState.HEALTHY
