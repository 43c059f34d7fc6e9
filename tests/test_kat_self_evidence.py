"""Issue 33, point 4 (and point 3's last sentence), through real child processes.

No hardware fault is ever "a screener bug": a device that disagrees with itself is suspect
wherever something else shows the job deterministic on its platform (a golden, another device,
this node's earlier screens), whatever its own majority, and inconclusive (exit 3, saying what
would settle it) with nothing at all. A job that raises in one run is re-run before any
verdict. A node's memory of its earlier results (known-digests.json) never overrides a golden
and is never overwritten by a different result; the daemon's full burn-in uses it too.

Each case is the issue's symptom, reproduced with `--inject` faults on the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from screener.agent.burnin.rounds import run_burnin
from screener.agent.screening.window import (KNOWN_DIGESTS, ScreenOptions, ScreenProcessRunner,
                                             ScreenRequest)
from screener.known_answer.engine import golden
from screener.known_answer.verdict import node_memory
from screener.known_answer.engine.screen import resolve_jobs, run_screen
from screener.known_answer.engine.fault_spec import DeviceFault
from screener.lifecycle.events import KIND_FULL, KIND_QUICK
from screener.types import ExitCode, KnownAnswerReason, Outcome

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# A one-bit flip in the 4th matmul of gemm-fp32 (it fires in every run it is given).
FLIP = dict(op="mm", call=3, element=7, bit=0)
# A corrupted position id of replay-fp32: its embedding lookup raises IndexError.
BAD_INDEX = "op=arange,call=1,element=3,bit=40,job=replay-fp32"


@pytest.fixture
def no_golden(tmp_path: Path) -> str:
    d = tmp_path / "nogolden"
    d.mkdir()
    return str(d)


def _cli(*args: str) -> tuple[int, dict[str, Any], str]:
    r = subprocess.run([sys.executable, "-m", "screener.cli", "kat", "run", "--device", "cpu",
                        "--json", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}, r.stderr


def _request(kind: str = KIND_QUICK) -> ScreenRequest:
    return ScreenRequest(node="n1", cancel=threading.Event(), deadline=time.time() + 600,
                         kind=kind)


def _clean_digest(no_golden: str) -> str:
    res = run_screen(["gemm-fp32"], ["cpu"], golden_dir=no_golden, repeat=1)
    return res.digests["cpu"]["gemm-fp32"]


# --- `kat run --repeat 5` with 4 of 5 runs agreeing ---------------------------------------------

def test_four_of_five_runs_agreeing_without_a_golden_is_inconclusive_not_exit_1(no_golden):
    """The issue: exit 1 'a screener bug, not a hardware verdict'. Nothing shows the job
    deterministic on the platform: inconclusive (exit 3), the counts, what settles it."""
    code, out, err = _cli("--job", "gemm-fp32", "--golden-dir", no_golden, "--repeat", "5",
                          "--inject", "op=mm,call=3,element=7,bit=0,iteration=2")
    assert code == int(ExitCode.INCONCLUSIVE), err
    assert "screener bug" not in err
    v = out["verdicts"][0]
    assert (v["outcome"], v["reason"], v["job"]) == ("inconclusive", "self_mismatch", "gemm-fp32")
    detail = v["evidence"]["detail"]
    assert "4 of 5 runs agree; 1 run(s) differ (first: iteration 2" in detail
    assert "nothing shows the job is deterministic" in detail
    assert v["evidence"]["command"] == (f"screener golden record --job gemm-fp32 --device cpu "
                                        f"--out {no_golden}")


def test_four_of_five_runs_agreeing_with_a_golden_is_suspect_even_when_run_0_is_wrong(cpu_goldens):
    """Shown deterministic by the golden: suspect whatever the device's majority, and expected
    is the golden's value although run 0 is the wrong one."""
    goldens = cpu_goldens("gemm-fp32")
    code, out, err = _cli("--job", "gemm-fp32", "--golden-dir", goldens, "--repeat", "5",
                          "--inject", "op=mm,call=3,element=7,bit=0,iteration=0")
    assert code == int(ExitCode.HARDWARE_SUSPECT), err
    v = out["verdicts"][0]
    assert (v["outcome"], v["reason"]) == ("suspect", "self_mismatch")
    assert "1 of 5 runs differ from the golden (first: iteration 0" in v["evidence"]["detail"]
    rec = golden.find(goldens, resolve_jobs(["gemm-fp32"], str(ROOT / "jobs"))[0],
                      v["platform_hash"])
    step = next(s for s in rec.steps if s.step == v["step"])
    assert v["expected"] == "{:016x}:{:016x}".format(
        *[x & 0xFFFFFFFFFFFFFFFF for x in dict(step.tensors)[v["tensor"]]])


# --- `burnin -n 5` with 4 of 5 rounds agreeing ---------------------------------------------------

def test_a_burnin_with_four_of_five_rounds_agreeing(no_golden):
    """Without any evidence: inconclusive (exit 3). With this node's earlier screens, which
    reproduced the job on the platform: suspect, expected = the earlier (true) value."""
    fault = {"cpu": [DeviceFault(**FLIP, iteration=0)]}
    rep = run_burnin(["cpu"], ["gemm-fp32"], iterations=5, golden_dir=no_golden, faults=fault)
    v = rep.screen.verdict("cpu")
    assert rep.exit_code == ExitCode.INCONCLUSIVE
    assert (v.outcome, v.reason) == (Outcome.INCONCLUSIVE, KnownAnswerReason.SELF_MISMATCH)
    assert "4 of 5 runs agree" in v.evidence["detail"]
    assert "inconclusive (self_mismatch, gemm-fp32" in rep.table()
    clean = _clean_digest(no_golden)
    known = {v.platform_hash: {"gemm-fp32": clean}}
    rep = run_burnin(["cpu"], ["gemm-fp32"], iterations=5, golden_dir=no_golden, faults=fault,
                     known=known)
    v = rep.screen.verdict("cpu")
    assert rep.exit_code == ExitCode.HARDWARE_SUSPECT
    assert (v.outcome, v.reason) == (Outcome.SUSPECT, KnownAnswerReason.SELF_MISMATCH)
    assert "1 of 5 runs differ from the earlier screens (first: iteration 0" in v.evidence["detail"]


# --- a job that raises in one run -----------------------------------------------------------------

def test_a_corrupted_position_id_in_run_0_is_re_run_and_is_a_crash(no_golden):
    """The issue: IndexError in run 0, the child stopped, exit 1. Now the child re-runs the
    job; the runs that complete show it completes: a crash of the device (exit 75)."""
    code, out, err = _cli("--job", "replay-fp32", "--golden-dir", no_golden,
                          "--inject", BAD_INDEX + ",iteration=0")
    assert code == int(ExitCode.HARDWARE_SUSPECT), err
    v = out["verdicts"][0]
    assert (v["outcome"], v["reason"], v["job"]) == ("suspect", "crash", "replay-fp32")
    assert "IndexError: index out of range in self" in v["evidence"]["detail"]
    assert "it raised in 1 of 3 run(s)" in v["evidence"]["detail"]
    assert v["evidence"]["jobs"]["replay-fp32"]["runs"] == 2
    assert out["faults_fired"] == {"cpu": [0]}


def test_a_job_that_raises_in_every_run(no_golden, cpu_goldens):
    """Raised again in every re-run: with nothing to show the job completes, inconclusive
    (exit 3, the record command); with a golden that records completed runs, suspect."""
    fault = {"cpu": [DeviceFault(op="arange", call=1, element=3, bit=40, job="replay-fp32")]}
    res = run_screen(["replay-fp32"], ["cpu"], golden_dir=no_golden, faults=fault)
    v = res.verdict("cpu")
    assert res.exit_code == ExitCode.INCONCLUSIVE
    assert (v.outcome, v.reason) == (Outcome.INCONCLUSIVE, KnownAnswerReason.CRASH)
    assert "it raised in 3 of 3 run(s)" in v.evidence["detail"]
    assert v.evidence["command"].startswith("screener golden record --job replay-fp32")
    res = run_screen(["replay-fp32"], ["cpu"], golden_dir=cpu_goldens("replay-fp32"),
                         faults=fault)
    assert (res.verdict("cpu").outcome, res.verdict("cpu").reason) == (Outcome.SUSPECT,
                                                                       KnownAnswerReason.CRASH)


# --- the node's memory of its earlier results -------------------------------------------------

def test_a_persistent_fault_never_overwrites_the_nodes_memory(tmp_path, no_golden):
    """The issue: a persistently bad lane overwrote the good digest, and the next screen blamed
    the healthy run (expected = the faulty value). Now the conflict is said (inconclusive,
    earlier_screens_differ), the good digest is kept, and the next screen's expected is it."""
    work = tmp_path / "work"
    opts = ScreenOptions(jobs=("gemm-fp32",), devices=("cpu",), golden_dir=no_golden, repeat=2)

    def runner(*faults: DeviceFault) -> ScreenProcessRunner:
        return ScreenProcessRunner(ScreenOptions(**{**opts.__dict__, "faults": {
            "cpu": [f.to_dict() for f in faults]}}), work_dir=work)

    first = runner()(_request())
    assert first.outcome == Outcome.INCONCLUSIVE  # no golden
    good = first.digests["cpu"]["gemm-fp32"]
    kept = json.loads((work / KNOWN_DIGESTS).read_text())
    (phash, jobs), = kept.items()
    assert jobs["gemm-fp32"]["digest"] == good
    stuck = runner(DeviceFault(**FLIP, persistent=True))(_request())
    v = stuck.verdicts[0]
    assert (v.outcome, v.reason) == (Outcome.INCONCLUSIVE, KnownAnswerReason.EARLIER_SCREENS_DIFFER)
    assert good in v.evidence["detail"] and stuck.digests["cpu"]["gemm-fp32"] != good
    assert json.loads((work / KNOWN_DIGESTS).read_text()) == kept  # not overwritten
    # the next screen: wrong in run 0 only; expected is the true value, observed the faulty one
    once = runner(DeviceFault(**FLIP, persistent=True, iteration=0))(_request())
    v = once.verdicts[0]
    assert (once.outcome, v.reason) == (Outcome.SUSPECT, KnownAnswerReason.SELF_MISMATCH)
    assert "1 of 2 runs differ from the earlier screens (first: iteration 0" in v.evidence["detail"]
    issue = v.evidence["issues"][0]
    faulty = stuck.verdicts[0].evidence["jobs"]["gemm-fp32"]["digest"]
    assert faulty != good and (issue["expected"], issue["observed"]) == (v.expected, v.observed)
    assert json.loads((work / KNOWN_DIGESTS).read_text()) == kept


def test_the_daemons_full_burnin_uses_the_nodes_memory(tmp_path, no_golden):
    """The issue: the full burn-in never used the memory. With it, a device wrong in one round
    of its burn-in is suspect (the earlier screens reproduced the job), not inconclusive."""
    work = tmp_path / "work"
    opts = ScreenOptions(jobs=("gemm-fp32",), devices=("cpu",), golden_dir=no_golden, repeat=2,
                         burnin_seconds=0.0, burnin_min_iterations=4, hbm_max_bytes=1 << 20)
    assert ScreenProcessRunner(opts, work_dir=work)(_request()).outcome == Outcome.INCONCLUSIVE
    faulty = ScreenProcessRunner(ScreenOptions(**{**opts.__dict__, "faults": {"cpu": [
        DeviceFault(**FLIP, iteration=1).to_dict()]}}), work_dir=work)
    out = faulty(_request(KIND_FULL))
    assert out.outcome == Outcome.SUSPECT, out
    v = next(v for v in out.verdicts if v.reason == KnownAnswerReason.SELF_MISMATCH)
    assert "from the earlier screens" in v.evidence["detail"]


def test_the_memory_keeps_only_clean_reproduced_results_and_reports_conflicts():
    """node_memory.remember, the rule: reproduced, nothing against the job, never replaced."""
    def screen(digest: str, *, runs: int = 2, results: int = 1, outcome: str = "inconclusive",
               issues: tuple[dict[str, Any], ...] = ({"reason": "no_golden", "job": "j"},)
               ) -> dict[str, Any]:
        return {"verdicts": [{"device": "cpu", "outcome": outcome, "platform_hash": "p",
                              "evidence": {"issues": list(issues), "jobs": {"j": {
                                  "digest": digest, "spec_hash": "s", "runs": runs,
                                  "results": results}}}}]}

    kept, conflicts = node_memory.remember({}, screen("aa"))
    assert kept == {"p": {"j": {"digest": "aa", "spec_hash": "s"}}} and conflicts == []
    assert node_memory.remember(kept, screen("aa")) == (kept, [])
    again, conflicts = node_memory.remember(kept, screen("bb"))
    assert again == kept and len(conflicts) == 1 and "kept aa" in conflicts[0]
    for bad in (screen("cc", runs=1), screen("cc", results=2), screen("cc", outcome="suspect"),
                screen("cc", issues=({"reason": "golden_disagrees_with_peers", "job": "j"},))):
        assert node_memory.remember({}, bad) == ({}, []), bad
