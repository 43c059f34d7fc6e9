"""`screener preflight` (issue 24.1): the gate a training pod's init container runs.

The end-to-end cases run the real command in a subprocess, with its real known-answer child, on
one job (gemm-fp32) against goldens recorded here: one recorded clean (pass), one recorded with a
persistent fault injected (so a clean device differs from it bit for bit: suspect). The fast path
reads the node's verdict annotation from the environment, a file (as a downward API volume gives
it) and the Kubernetes store against the API test server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from screener.alarmfile import validate
from screener.agent.preflight import fast_path, parse_verdict_text
from screener.known_answer.engine.screen import record_goldens
from screener.known_answer.engine import workloads as w
from screener.known_answer.engine.fault_spec import parse_fault
from screener.alarmfile import CHECKS as ALARM_CHECK_REASONS
from screener.types import ExitCode, Reason
from fakes.kubeapi import KubeAPI

ROOT = Path(__file__).resolve().parents[1]
NOW = 1_800_000_000.0


def _spec(name: str) -> w.JobSpec:
    return next(s for s in w.load_jobs(ROOT / "jobs") if s.name == name)


@pytest.fixture(scope="module")
def goldens(cpu_goldens) -> str:
    """A golden of gemm-fp32 for this machine's CPU platform (conftest.cpu_goldens)."""
    return cpu_goldens("gemm-fp32")


@pytest.fixture(scope="module")
def wrong_goldens(tmp_path_factory) -> str:
    """A golden of gemm-fp32 recorded from a unit that flips bit 30 of every product from the
    third on: a healthy device now disagrees with it, as a bad device disagrees with a good one."""
    out = tmp_path_factory.mktemp("golden-bad")
    _, fault = parse_fault("op=mm,call=2,element=7,bit=30,persistent=true")
    rec = record_goldens([_spec("gemm-fp32")], ["cpu"], out_dir=str(out), repeat=1,
                             faults={"cpu": [fault]})
    assert rec.exit_code == ExitCode.PASS, rec.lines()
    return str(out)


@pytest.fixture
def no_goldens(tmp_path: Path) -> str:
    """An empty golden folder: known-answer jobs run against it end inconclusive (exit 3), so a
    preflight that exits 0 with it ran none (cheaper than recording wrong goldens to show it)."""
    empty = tmp_path / "no-goldens"
    empty.mkdir()
    return str(empty)


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("SCREENER_NODE_VERDICT", "SCREENER_VERDICT_FILE")}
    full.update({"NODE_NAME": "gpu-7", "SCREENER_ALARM_DIR": str(tmp_path / "alarms"),
                 **(env or {})})
    return subprocess.run([sys.executable, "-m", "screener.cli", "preflight", "--device", "cpu",
                           "--job", "gemm-fp32", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=full)


def _alarms(tmp_path: Path) -> list[Path]:
    d = tmp_path / "alarms"
    return sorted(d.glob("*.json")) if d.exists() else []


# --- the fast path's rule ---------------------------------------------------------------------

@pytest.mark.parametrize("verdict, taken", [
    ({"time": NOW - 600, "outcome": "pass"}, True),
    ({"time": NOW - 7 * 3600, "outcome": "pass"}, False),  # older than the window
    ({"time": NOW - 600, "outcome": "suspect"}, False),
    ({"time": NOW - 600, "outcome": "pass", "stopped": "busy"}, False),  # the screen never ended
    ({"time": NOW + 3600, "outcome": "pass"}, False),  # from the future: not trusted
    ({"time": "yesterday", "outcome": "pass"}, False),
    ({"time": float("nan"), "outcome": "pass"}, False),
    ({"outcome": "pass"}, False),
    (None, False),
])
def test_fast_path_only_for_a_recent_passing_screen(verdict: Any, taken: bool):
    fp = fast_path(verdict, NOW, 6 * 3600)
    assert fp.taken is taken, fp.reason
    assert fp.reason


def test_fast_path_off_with_a_zero_window():
    assert not fast_path({"time": NOW, "outcome": "pass"}, NOW, 0).taken


def test_verdict_text_empty_is_none_and_garbage_is_a_problem():
    assert parse_verdict_text("") == (None, None)  # a downward API file for a missing annotation
    assert parse_verdict_text("{not json")[1]
    assert parse_verdict_text("[1, 2]")[1]
    assert parse_verdict_text('{"time": 1, "outcome": "pass"}') == ({"time": 1, "outcome": "pass"},
                                                                      None)


def test_the_preflight_alarm_check_is_one_the_intake_accepts():
    assert ALARM_CHECK_REASONS["preflight"] == Reason.PREFLIGHT


# --- end to end ------------------------------------------------------------------------------

def test_pass_runs_probes_and_the_subset_and_writes_no_alarm(tmp_path, goldens):
    r = _run(tmp_path, "--golden-dir", goldens, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["outcome"] == "pass" and out["node"] == "gpu-7"
    assert out["fast_path"]["taken"] is False and out["jobs"] == ["gemm-fp32"]
    assert out["probes"]["exit_code"] == 0 and out["screen"]["outcome"] == "pass"
    assert out["screen"]["verdicts"][0]["evidence"]["jobs"]["gemm-fp32"]["golden"]
    assert out["alarm_file"] is None and _alarms(tmp_path) == []


@pytest.mark.slow
def test_a_mismatch_exits_75_and_leaves_an_unsettled_alarm_about_its_own_node(tmp_path,
                                                                            wrong_goldens):
    r = _run(tmp_path, "--golden-dir", wrong_goldens, "--json", "--job-name", "llm-train")
    assert r.returncode == int(ExitCode.HARDWARE_SUSPECT), r.stderr
    out = json.loads(r.stdout)
    (path,) = _alarms(tmp_path)
    assert out["outcome"] == "suspect" and out["alarm_file"] == str(path)
    record = validate(json.loads(path.read_text()))  # as the daemon's intake reads it
    assert (record.check, record.settled, record.node, record.job) == (
        "preflight", False, "gpu-7", "llm-train")
    assert [n.node for n in record.suspect_nodes] == ["gpu-7"] and record.suspect_ranks == ()
    (v,) = record.evidence["verdicts"]
    assert (v["reason"], v["job"]) == ("golden_mismatch", "gemm-fp32")
    assert v["expected"] != v["observed"]
    assert not list((tmp_path / "alarms").glob(".*.tmp"))  # written whole, then renamed


@pytest.mark.slow
def test_no_golden_is_inconclusive_and_allow_inconclusive_lets_the_pod_start(tmp_path):
    empty = tmp_path / "no-goldens"
    empty.mkdir()
    r = _run(tmp_path, "--golden-dir", str(empty), "--allow-inconclusive", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["outcome"] == "inconclusive" and out["exit_code"] == 3
    assert "inconclusive" in r.stderr and "the pod starts" in r.stderr
    assert _alarms(tmp_path) == []


def test_fast_path_from_the_environment_runs_only_the_probes(tmp_path, no_goldens):
    verdict = json.dumps({"time": time.time() - 60, "outcome": "pass", "kind": "quick"})
    t0 = time.monotonic()
    # no goldens: the known-answer jobs would end inconclusive (3), so a pass shows they did not run
    r = _run(tmp_path, "--golden-dir", no_goldens, "--json",
             env={"SCREENER_NODE_VERDICT": verdict})
    seconds = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fast_path"]["taken"] is True and out["jobs"] == [] and out["screen"] is None
    assert "known_answer" not in out["seconds"] and out["probes"] is not None
    assert seconds < 30  # no child process, no torch: the probes alone


@pytest.mark.slow
def test_an_old_verdict_in_a_downward_api_file_means_the_full_preflight(tmp_path, wrong_goldens):
    f = tmp_path / "verdict"
    f.write_text(json.dumps({"time": time.time() - 3 * 3600, "outcome": "pass"}))
    r = _run(tmp_path, "--golden-dir", wrong_goldens, "--verdict-file", str(f),
             "--fast-window", "1h", "--json")
    assert r.returncode == int(ExitCode.HARDWARE_SUSPECT), r.stderr
    assert json.loads(r.stdout)["fast_path"]["taken"] is False
    assert len(_alarms(tmp_path)) == 1


def test_fast_path_from_the_node_annotation_in_the_kube_store(tmp_path, no_goldens):
    verdict = json.dumps({"time": time.time() - 60, "outcome": "pass"})
    with KubeAPI() as api:
        api.add_node("gpu-7", annotations={"screener.io/verdict": verdict})
        cfg = api.write_kubeconfig(tmp_path / "kubeconfig")
        r = _run(tmp_path, "--golden-dir", no_goldens, "--verdict-store", "kube",
                 "--kubeconfig", str(cfg), "--json")
        gets = [c for c in api.calls if (c.verb, c.resource, c.name) == ("get", "nodes", "gpu-7")]
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fast_path"]["taken"] is True
    assert gets  # the verdict came from the Node object


@pytest.mark.slow
def test_an_unreadable_verdict_is_a_warning_and_the_full_preflight(tmp_path, goldens):
    r = _run(tmp_path, "--golden-dir", goldens, "--json",
             env={"SCREENER_NODE_VERDICT": "{truncated"})
    assert r.returncode == 0, r.stderr
    assert "node verdict unreadable" in r.stderr
    assert json.loads(r.stdout)["fast_path"]["taken"] is False


@pytest.mark.slow
def test_fast_window_0_turns_the_fast_path_off_as_its_help_says(tmp_path, no_goldens):
    """A fresh passing verdict, but --fast-window 0: the jobs run (here: no goldens, so 3)."""
    verdict = json.dumps({"time": time.time() - 60, "outcome": "pass", "kind": "quick"})
    r = _run(tmp_path, "--golden-dir", no_goldens, "--fast-window", "0", "--json",
             env={"SCREENER_NODE_VERDICT": verdict})
    assert r.returncode == int(ExitCode.INCONCLUSIVE), r.stderr
    fast = json.loads(r.stdout)["fast_path"]
    assert fast["taken"] is False and fast["reason"] == "fast path off (window 0)"


@pytest.mark.parametrize("args", [("--fast-window", "soon"), ("--time-cap", "-3s"),
                                  ("--verdict-store", "etcd")])
def test_bad_options_are_one_line_and_exit_2(tmp_path, args):
    r = _run(tmp_path, *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_a_broken_golden_is_one_line_and_exit_2(tmp_path, goldens):
    bad = tmp_path / "golden"
    bad.mkdir()
    for p in Path(goldens).glob("*.json"):
        (bad / p.name).write_text(p.read_text()[:-40])
    r = _run(tmp_path, "--golden-dir", str(bad))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert _alarms(tmp_path) == []  # bad input is never a hardware verdict
