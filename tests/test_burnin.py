"""`screener burnin`: repeated screening with a progress bar, a table, --json and --report."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from screener.agent.burnin import full as burnin
from screener.errors import BadInputError
from screener.known_answer.engine.screen import DeviceFault
from screener.types import ExitCode, Outcome

ROOT = Path(__file__).resolve().parents[1]
JOBS = ["gemm-fp32", "train-bf16"]


@pytest.fixture(scope="module")
def golden_dir(cpu_goldens) -> str:
    """Goldens of JOBS for this machine's CPU platform (conftest.cpu_goldens)."""
    return cpu_goldens(*JOBS)


@pytest.mark.slow
def test_cli_burnin_for_a_duration_passes_with_report(golden_dir, tmp_path):
    report = tmp_path / "r.json"
    args = [sys.executable, "-m", "screener.cli", "burnin", "--device", "cpu", "--duration", "1s",
            "--golden-dir", golden_dir, "--json", "--report", str(report)]
    for j in JOBS:
        args += ["--job", j]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    # A second is a partial burn-in: every stage passed, and the new node stays in burnin, which
    # is exit 4, never 0 (issue 25.4).
    assert r.returncode == ExitCode.PARTIAL == 4, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out == json.loads(report.read_text())
    assert out["outcome"] == "pass" and out["requested"] == {"duration": 1.0, "iterations": None}
    assert out["burnin_kind"] == "partial" and out["state_after"] == "burnin"
    assert out["summary"].startswith("partial: node stays in burnin (missing: ")
    rows = out["rows"]
    assert [(x["device"], x["job"], x["result"]) for x in rows] == [("cpu", j, "pass") for j in JOBS]
    assert rows[0]["runs"] >= 1 and rows[0]["runs"] == rows[1]["runs"]
    assert "job runs" in r.stderr  # the progress bar went to stderr


@pytest.mark.slow
def test_a_fault_in_a_later_iteration_is_caught(golden_dir):
    fault = DeviceFault(op="mm", call=2, element=5, bit=4, job="gemm-fp32", iteration=1)
    rep = burnin.run_burnin(["cpu"], JOBS, iterations=2, golden_dir=golden_dir,
                            faults={"cpu": [fault]})
    assert rep.exit_code == ExitCode.HARDWARE_SUSPECT and rep.outcome == Outcome.SUSPECT
    v = rep.screen.verdict("cpu")
    assert (v.reason, v.job, v.step) == ("self_mismatch", "gemm-fp32", 1)
    rows = {r.job: r for r in rep.rows}
    assert rows["gemm-fp32"].result == "self_mismatch" and rows["gemm-fp32"].runs == 2
    assert rows["gemm-fp32"].where.startswith("step 1 ")
    assert rows["train-bf16"].result == "pass"
    table = rep.table()
    assert "self_mismatch" in table and "known-answer stage: suspect in " in table
    assert rep.to_dict()["exit_code"] == 75


def test_bad_arguments():
    with pytest.raises(BadInputError):
        burnin.run_burnin(["cpu"], JOBS, iterations=0)
    with pytest.raises(BadInputError):
        burnin.run_burnin(["cpu"], JOBS, duration=-1)
    with pytest.raises(BadInputError):
        burnin.run_burnin(["tpu:0"], JOBS, iterations=1)


def test_text_progress():
    s = io.StringIO()
    bar = burnin.TextProgress(total_runs=4, stream=s)
    for i in range(4):
        bar({"event": "start", "device": "cpu", "job": "j", "iteration": i})
        bar({"event": "result", "device": "cpu", "job": "j", "iteration": i})
    bar.close()
    assert "4/4 job runs" in s.getvalue() and "#" * 30 in s.getvalue()
