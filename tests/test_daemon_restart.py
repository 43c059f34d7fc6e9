"""Restart hygiene: `screener daemon` killed with SIGKILL in the middle of a burn-in leaves its
screen worker and the worker's per-device child running (re-parented, nobody to report to), its
screen folder and the screening taint. The next start ends those processes, removes the folder
and clears the taint, before it would start a screen of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from screener.settings.daemon import DaemonConfig
from screener.agent.daemon.loop import Daemon
from screener.agent.screening.window import LocalTaint, reap_stale_screens
from screener.stores.local import LocalStore
from fakes.clock import FakeClock
from fakes.daemon import FnProbes, ScriptedRunner

ROOT = Path(__file__).resolve().parents[1]
NODE = "restart-node"


def wait_for(predicate, limit: float, what: str):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_daemon_killed_mid_screen_is_cleaned_up_by_the_next_start(tmp_path):
    state = tmp_path / "state"
    work = tmp_path / "screens"
    config = tmp_path / "d.toml"
    # A new node, idle at once: the daemon starts its full burn-in (an hour of the CPU job).
    config.write_text(f'metrics_port = -1\nidle_window_s = 0\ntick_s = 0.2\njobs = ["gemm-fp32"]\n'
                      f'devices = ["cpu"]\nburnin_duration_s = 3600\nwork_dir = "{work}"\n'
                      f'[probes]\nkmsg_path = "/nonexistent"\ndisk_paths = ["{tmp_path}"]\n'
                      'min_free_disk_fraction = 0.0\nmin_free_memory_fraction = 0.0\n')
    env = {**os.environ, "NODE_NAME": NODE, "SCREENER_ALARM_DIR": str(tmp_path / "alarms"),
           "XDG_STATE_HOME": str(state), "SCREENER_CONFIG": str(config)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    daemon = subprocess.Popen([sys.executable, "-m", "screener.cli", "daemon"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        record = wait_for(lambda: next((json.loads(p.read_text())
                                        for p in work.glob("screen-*/worker.json")), None),
                          60, "the screen worker")
        worker = psutil.Process(record["pid"])
        # The worker's per-device child (own session) is running too.
        children = wait_for(lambda: worker.children(recursive=True), 60, "the per-device child")
        family = [worker, *children]
        taint = LocalTaint(state / "screener")
        assert taint.present(NODE)
        os.kill(daemon.pid, signal.SIGKILL)  # no handler, no cleanup: like the OOM killer
        daemon.wait(10)
        # Re-parented: the kernel has finished the daemon's exit (a parent-death signal would
        # have been sent by now), so what is still running was not ended with it.
        wait_for(lambda: worker.ppid() != daemon.pid, 10, "the worker to be re-parented")
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)
        assert worker.ppid() != daemon.pid
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        daemon.stderr.close()

    # The next start, as the DaemonSet restarts the container.
    cfg = DaemonConfig.from_mapping({"node": NODE, "alarm_dir": str(tmp_path / "alarms"),
                                     "store": "local", "metrics_port": -1, "screens": False,
                                     "untaint_retry_s": 0.01})
    store = LocalStore(state / "screener" / "screener.db")
    try:
        d = Daemon(cfg, store=store, probes=FnProbes(lambda prev: None), runner=ScriptedRunner(),
                   taint=taint, clock=FakeClock(time.time()), reap=lambda: reap_stale_screens(work))
        d.start()
        assert set(d.reaped.killed) >= {p.pid for p in family}
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert alive == []
        assert list(work.glob("screen-*")) == []
        assert not taint.present(NODE)
        assert d.state.value == "burnin"
    finally:
        store.close()
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass
