"""Elapsed times are wall times from the command's start, and the first progress line comes
before the heavy imports (issue 35.4, item 8: `golden record` said 7.8 s of a 17.5 s run, and
6.7 s passed before its first line, torch's import on a cold machine).

Real processes, with torch's import made slow as on a cold machine: a `torch` package first on
PYTHONPATH that sleeps in the command's own process (not in the screening children) and then
hands over to the real torch."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes.clock import FakeClock
from screener.output.progress import Progress

SLOW_IMPORT_S = 3.0
MARK = "shadow torch: importing"

SHADOW = f'''
import os, sys, time
if sys.argv and sys.argv[0].endswith("cli.py"):  # the command itself, not a screening child
    sys.stderr.write("{MARK}\\n")
    sys.stderr.flush()
    time.sleep({SLOW_IMPORT_S})
_here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["torch"]
import torch as _real
sys.modules["torch"] = _real
'''


def slow_torch_command(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text(SHADOW)
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "screener.cli", *args], capture_output=True,
                       text=True, timeout=300, env=env)
    return r, time.monotonic() - t0


@pytest.mark.slow
def test_kat_run_says_something_before_torch_and_its_summary_is_the_wall_time(tmp_path,
                                                                            cpu_goldens):
    r, wall = slow_torch_command(tmp_path, "kat", "run", "-j", "gemm-fp32", "-r", "1",
                                 "--golden-dir", cpu_goldens("gemm-fp32"))
    assert r.returncode == 0, r.stdout + r.stderr
    err = r.stderr.splitlines()
    assert err[0].startswith("screener: kat run: loading torch"), err
    assert err[1] == MARK, err  # the first line came before torch's import began
    seconds = float(re.search(r"on 1 device\(s\) in ([0-9.]+) s", r.stdout).group(1))
    # From the command's start: torch's slow import is in it, and no more than the wall.
    assert SLOW_IMPORT_S <= seconds <= wall, (seconds, wall)


@pytest.mark.slow
def test_golden_record_counts_from_the_command_start(tmp_path):
    r, wall = slow_torch_command(tmp_path, "golden", "record", "-j", "gemm-fp32", "-r", "2",
                                 "--out", str(tmp_path / "golden"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    events = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert events[0]["kind"] == "start" and "loading torch" in events[0]["item"], events
    assert r.stderr.index('"kind": "start"') < r.stderr.index(MARK), r.stderr
    last = events[-1]
    assert last["kind"] == "end"
    assert SLOW_IMPORT_S <= last["total_elapsed_s"] <= wall, (last, wall)


def test_progress_measures_in_all_from_the_given_start_and_announces_before_any_stage():
    out, clock = io.StringIO(), FakeClock(100.0)
    p = Progress(out, tty=False, clock=clock, t0=93.0)  # the command began 7 s before
    p.announce("kat run: loading torch and the job specs")
    p.begin("known-answer", 1, unit="job runs")
    clock.t += 2.0
    p.step("cpu gemm-fp32 #0")
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "screener: kat run: loading torch and the job specs (7.0 s)"
    assert lines[-1].endswith("(2.0 s, 9.0 s in all)"), lines
