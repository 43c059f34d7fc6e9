"""The test command always ends in pytest's summary line (issue 35.3): a test past its budget
fails alone (pytest-timeout's signal method, pyproject.toml), and one stuck where no signal
reaches it, waiting on a process it started, is freed by tests/conftest.py's watchdog, which
kills that process. A real pytest run of three small tests, with this suite's settings and
conftest, a 2 s budget and a 1 s watchdog grace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

INNER = '''
import signal, subprocess, time

def test_runs_too_long():
    time.sleep(30)

def test_passes():
    assert True

def test_stuck_where_no_signal_reaches(tmp_path):
    # As a gloo join in native code: the alarm cannot act until the wait returns.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    child = subprocess.Popen(["sleep", "600"])
    (tmp_path.parent / "child.pid").write_text(str(child.pid))
    child.wait()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    time.sleep(5)
'''


@pytest.mark.slow
def test_a_test_past_its_budget_fails_alone_and_the_run_ends_in_its_summary(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "SCREENER_TEST_WATCHDOG_GRACE_S": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "conftest", "-c", str(ROOT / "pyproject.toml"),
                        "--rootdir", str(inner), "-o", "timeout=2", "--basetemp",
                        str(tmp_path / "base"), str(inner / "test_inner.py")],
                       capture_output=True, text=True, timeout=120, env=env, cwd=inner)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    summary = r.stdout.strip().splitlines()[-1]
    assert "2 failed, 1 passed" in summary, out
    assert "FAILED test_inner.py::test_runs_too_long" in r.stdout, out
    assert "FAILED test_inner.py::test_stuck_where_no_signal_reaches" in r.stdout, out
    assert "Timeout" in r.stdout, out
    pid = int(next((tmp_path / "base").rglob("child.pid")).read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
