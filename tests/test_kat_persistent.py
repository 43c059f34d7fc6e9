"""A persistently or repeatedly bad unit is a hardware verdict, never "the screener failed".

The judgment sees every run of a job on a device. Against a golden (or a same-platform
majority, or what the node's earlier screens produced) a device that does not reproduce it is
suspect, whatever its repeats did among themselves: wrong in every run the same way, wrong in
some runs, wrong differently in each. Every verdict keeps expected = the reference's value and
observed = the device's first wrong one. Jobs that raise on a device are crashes when something
shows the job completes. Faults that never fire are said, and a drill that tested nothing
exits 2.

The matrix runs the real jobs in process with the real fault injector (fast: milliseconds a
run); a few cases go through the child processes and the CLI end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest

from screener.agent.screening.window import (KNOWN_DIGESTS, ScreenOptions, ScreenProcessRunner,
                                             ScreenRequest)
from screener.determinism import preserved
from screener.errors import ScreenerError
from screener.known_answer.engine import golden
from screener.known_answer.verdict import judgment
from screener.known_answer.engine.screen import golden_lookup
from screener.known_answer.engine import workloads as w
from screener.known_answer.engine.fault_spec import DeviceFault, parse_fault
from screener.known_answer.engine.faults import FaultSpec, inject
from screener.known_answer.verdict.results import JobResult, first_difference
from screener.known_answer.verdict.runs import MAX_DISTINCT, DeviceRun
from screener.types import ExitCode, KnownAnswerReason, Outcome, RunStatus

ROOT = Path(__file__).resolve().parents[1]

# Every op the known-answer jobs run that a wrong unit could corrupt, with an element that
# reaches the job's fingerprinted outputs (the last token of the first sequence: earlier
# positions of q and of the attention scores are masked by causal attention).
REPLAY_OPS = ("addmm", "bmm", "_softmax", "native_layer_norm", "gelu", "embedding",
              "_log_softmax", "mm")
MATRIX = [("gemm-fp32", "mm"), ("gemm-bf16", "mm"), ("gemm-fp16", "mm"),
          ("conv-fp32", "convolution")] + [("replay-fp32", op) for op in REPLAY_OPS]


@pytest.fixture(autouse=True)
def _restore_process_settings():
    with preserved():
        yield


def _spec(name: str) -> w.JobSpec:
    return next(s for s in w.load_jobs(ROOT / "jobs") if s.name == name)


def _element(spec: w.JobSpec, op: str) -> int:
    if spec.kind != "replay":
        return 7
    p = spec.params_for("cpu")
    t, d = p["seq"], p["d_model"]
    return {"addmm": (t - 1) * 3 * d + 1, "bmm": (t - 1) * t + 2, "_softmax": (t - 1) * t + 2,
            "native_layer_norm": (t - 1) * d + 3, "gelu": (t - 1) * p["d_ff"] + 5,
            "embedding": (t - 1) * d + 7, "_log_softmax": 11, "mm": 13}[op]


def _calls_per_step(spec: w.JobSpec, op: str, clean: JobResult) -> int:
    """How many calls of the op one step of the job makes (counted independently; every step
    of these jobs makes the same calls)."""
    counter = inject(FaultSpec(op, call=10 ** 9))
    w.run_job(spec, "cpu", injector=counter)
    total, steps = counter.counts[0], len(clean.steps)
    assert total and total % steps == 0, (spec.name, op, total, steps)
    return total // steps


def _bad(spec: w.JobSpec, op: str, call: int, *, persistent: bool = True, bit: int = 30,
         element: Optional[int] = None) -> JobResult:
    inj = inject(FaultSpec(op, call=call, element=_element(spec, op) if element is None
                           else element, bit=bit, persistent=persistent))
    r = w.run_job(spec, "cpu", injector=inj)
    assert inj.fired, (spec.name, op)
    return r


def _device(name: str, results: Sequence[JobResult], phash: str = "p1") -> DeviceRun:
    run = DeviceRun(name, platform={"name": "test"}, platform_hash=phash)
    for i, r in enumerate(results):
        run.add(i, r)
    run.iterations = len(results)
    return run


def _golden(spec: w.JobSpec, clean: JobResult, tmp: Path, phash: str = "p1") -> Any:
    rec = golden.record_from_results(spec, {"name": "test"}, phash, [("x", clean)], repeats=1)
    golden.write(rec, tmp)
    return golden_lookup(str(tmp))


def _no_golden(spec: Any, phash: str) -> None:
    return None


def _located(v: Any, clean: JobResult, first_bad: JobResult) -> None:
    """The verdict names where the first wrong run first differs from the golden, with the
    golden's value as expected and the device's as observed."""
    d = first_difference(clean.steps, first_bad.steps)
    assert d is not None
    assert (v.step, v.tensor, v.expected, v.observed) == (d.step, d.tensor, d.expected,
                                                          d.observed), v


# --- the matrix: persistent, repeated and late faults against a golden, one device ------------

@pytest.mark.parametrize("job, op", MATRIX)
def test_a_persistent_fault_from_mid_job_on_is_suspect_on_one_device(job, op, tmp_path):
    """Every call of the op from the middle of the job on is wrong, in every run."""
    spec = _spec(job)
    clean = w.run_job(spec, "cpu")
    call = _calls_per_step(spec, op, clean)  # the first call of step 1: it starts mid-job
    bad = _bad(spec, op, call)
    lookup = _golden(spec, clean, tmp_path)
    res = judgment.judge({"cpu": _device("cpu", [bad, bad, bad])}, [spec], lookup)
    v = res.verdict("cpu")
    assert res.exit_code == ExitCode.HARDWARE_SUSPECT
    assert (v.outcome, v.reason, v.job) == (Outcome.SUSPECT, KnownAnswerReason.GOLDEN_MISMATCH, job)
    assert v.step == 1
    _located(v, clean, bad)


@pytest.mark.parametrize("job, op", MATRIX)
def test_wrong_differently_in_each_run_is_suspect_not_our_bug(job, op, tmp_path):
    """The case that used to exit 1: every run wrong, each in its own way (a marginal unit
    hitting other elements), on a single device, with the golden present."""
    spec = _spec(job)
    clean = w.run_job(spec, "cpu")
    per_step = _calls_per_step(spec, op, clean)
    runs = [_bad(spec, op, call=k * per_step, persistent=False, bit=b)
            for k, b in ((0, 30), (1, 29), (2, 22))]  # each run wrong in another step
    assert len({r.digest for r in runs}) == 3
    res = judgment.judge({"cpu": _device("cpu", runs)}, [spec], _golden(spec, clean, tmp_path))
    v = res.verdict("cpu")
    assert res.exit_code == ExitCode.HARDWARE_SUSPECT
    assert (v.outcome, v.reason, v.job) == (Outcome.SUSPECT, KnownAnswerReason.GOLDEN_MISMATCH, job)
    _located(v, clean, runs[0])
    assert "3 of 3 runs differ from the golden" in v.evidence["detail"]
    assert "no run reproduces it" in v.evidence["detail"]


@pytest.mark.parametrize("job, op", [("gemm-fp32", "mm"), ("replay-fp32", "bmm"),
                                     ("conv-fp32", "convolution")])
def test_faults_in_the_first_two_runs_then_golden_runs_are_a_self_mismatch(job, op, tmp_path):
    """Iterations 0 and 1 wrong (differently), 2..9 reproduce the golden: suspect, and the
    later golden-equal runs are seen (before, only the first two runs were considered)."""
    spec = _spec(job)
    clean = w.run_job(spec, "cpu")
    first, second = _bad(spec, op, 1, persistent=False), _bad(spec, op, 2, persistent=False,
                                                                bit=0)
    runs = [first, second] + [clean] * 8
    res = judgment.judge({"cpu": _device("cpu", runs)}, [spec], _golden(spec, clean, tmp_path))
    v = res.verdict("cpu")
    assert (v.outcome, v.reason, v.job) == (Outcome.SUSPECT, KnownAnswerReason.SELF_MISMATCH, job)
    _located(v, clean, first)
    assert "2 of 10 runs differ from the golden (first: iteration 0" in v.evidence["detail"]
    assert "8 run(s) reproduce it" in v.evidence["detail"]


@pytest.mark.parametrize("job, op", [("gemm-bf16", "mm"), ("replay-fp32", "addmm")])
def test_a_fault_in_later_runs_only_is_located_in_the_first_wrong_run(job, op, tmp_path):
    spec = _spec(job)
    clean = w.run_job(spec, "cpu")
    late = _bad(spec, op, 4)
    later = _bad(spec, op, 6, bit=3)
    runs = [clean, clean, clean, late, later, later]
    res = judgment.judge({"cpu": _device("cpu", runs)}, [spec], _golden(spec, clean, tmp_path))
    v = res.verdict("cpu")
    assert (v.reason, v.job) == (KnownAnswerReason.SELF_MISMATCH, job)
    _located(v, clean, late)
    assert "3 of 6 runs differ from the golden (first: iteration 3" in v.evidence["detail"]


def test_several_devices_each_wrong_its_own_way_are_each_suspect(tmp_path):
    """Two of four devices persistently bad, one the same way every run, one differently:
    each is suspect with its own location; the healthy ones pass."""
    spec = _spec("gemm-fp32")
    clean = w.run_job(spec, "cpu")
    steady = _bad(spec, "mm", 2)
    shifting = [_bad(spec, "mm", c, persistent=False) for c in (7, 8)]
    runs = {"cuda:0": _device("cuda:0", [clean, clean]), "cuda:1": _device("cuda:1", [steady] * 2),
            "cuda:2": _device("cuda:2", shifting), "cuda:3": _device("cuda:3", [clean, clean])}
    res = judgment.judge(runs, [spec], _golden(spec, clean, tmp_path))
    assert res.exit_code == ExitCode.HARDWARE_SUSPECT
    assert [res.verdict(d).outcome for d in runs] == [Outcome.PASS, Outcome.SUSPECT,
                                                      Outcome.SUSPECT, Outcome.PASS]
    _located(res.verdict("cuda:1"), clean, steady)
    _located(res.verdict("cuda:2"), clean, shifting[0])
    # the same with no golden: three steady healthy devices of five are the majority reference
    runs["cuda:4"] = _device("cuda:4", [clean, clean])
    res = judgment.judge(runs, [spec], _no_golden)
    v = res.verdict("cuda:2")
    assert (v.outcome, v.reason) == (Outcome.SUSPECT, KnownAnswerReason.PEER_MISMATCH)
    _located(v, clean, shifting[0])
    assert res.verdict("cuda:1").outcome == Outcome.SUSPECT


def test_only_distinct_results_are_kept_and_every_run_is_counted():
    spec = _spec("gemm-fp32")
    clean = w.run_job(spec, "cpu")
    wrong = [_bad(spec, "mm", c, persistent=False) for c in range(MAX_DISTINCT + 2)]
    run = _device("cpu", [clean] + wrong + [clean])
    jr = run.jobs[spec.name]
    assert jr.runs == MAX_DISTINCT + 4 and len(jr.distinct) == MAX_DISTINCT
    assert jr.dropped == 3 and jr.iterations_of(clean.digest) == 2 and not jr.consistent


# --- no golden: what decides between a bad device and a bad job -----------------------------

def test_with_no_evidence_at_all_disagreement_is_inconclusive_saying_what_settles_it():
    """Issue 33.4: no golden, no peer, no earlier screen: a faulty device and a nondeterministic
    job look the same, so it is inconclusive (exit 3) with the record command, never exit 1."""
    spec = _spec("gemm-fp32")
    runs = [_bad(spec, "mm", c, persistent=False) for c in (1, 2)]
    res = judgment.judge({"cpu": _device("cpu", runs)}, [spec], _no_golden, golden_dir="g")
    v = res.verdict("cpu")
    assert res.exit_code == ExitCode.INCONCLUSIVE
    assert (v.outcome, v.reason, v.job) == (Outcome.INCONCLUSIVE, KnownAnswerReason.SELF_MISMATCH, spec.name)
    assert "nothing shows the job is deterministic" in v.evidence["detail"]
    assert v.evidence["command"] == f"screener golden record --job {spec.name} --device cpu --out g"


def test_earlier_screens_of_the_node_make_the_device_suspect_not_the_job():
    """No golden and one device whose repeats disagree: when this node's earlier screens on the
    platform produced a result (for the same spec), the device is suspect, located against the
    run that reproduces it; a stale entry (another spec hash) or a hostile one is ignored."""
    spec = _spec("gemm-fp32")
    clean = w.run_job(spec, "cpu")
    bad = _bad(spec, "mm", 5)
    runs = {"cpu": _device("cpu", [clean, bad, bad])}
    known = {"p1": {spec.name: {"digest": clean.digest, "spec_hash": spec.spec_hash}}}
    v = judgment.judge(runs, [spec], _no_golden, known=known).verdict("cpu")
    assert (v.outcome, v.reason) == (Outcome.SUSPECT, KnownAnswerReason.SELF_MISMATCH)
    _located(v, clean, bad)
    assert "earlier screens" in v.evidence["detail"]
    # the plain published form {platform: {job: digest}} works too
    v = judgment.judge(runs, [spec], _no_golden,
                       known={"p1": {spec.name: clean.digest}}).verdict("cpu")
    assert v.outcome == Outcome.SUSPECT
    for stale in ({"p1": {spec.name: {"digest": clean.digest, "spec_hash": "other"}}},
                  {"p2": {spec.name: clean.digest}}, {"p1": ["x"]}, {"p1": {spec.name: 7}}):
        res = judgment.judge(runs, [spec], _no_golden, known=stale)
        assert res.verdict("cpu").outcome == Outcome.INCONCLUSIVE, stale


def test_three_devices_all_different_with_earlier_screens_name_the_bad_ones():
    spec = _spec("gemm-fp32")
    clean = w.run_job(spec, "cpu")
    a, b = _bad(spec, "mm", 2), _bad(spec, "mm", 9)
    runs = {"x": _device("x", [clean]), "y": _device("y", [a]), "z": _device("z", [b])}
    res = judgment.judge(runs, [spec], _no_golden)
    assert res.exit_code == ExitCode.INCONCLUSIVE  # nothing says which of three is right
    assert {(v.outcome, v.reason) for v in res.verdicts} == {(Outcome.INCONCLUSIVE,
                                                              KnownAnswerReason.PEER_SPLIT)}
    res = judgment.judge(runs, [spec], _no_golden, known={"p1": {spec.name: clean.digest}})
    assert res.verdict("x").outcome == Outcome.INCONCLUSIVE  # no golden to pass it
    assert {res.verdict(d).reason for d in "yz"} == {KnownAnswerReason.PEER_SPLIT}


# --- jobs that raise on a device -----------------------------------------------------------------

def _raised(device: str, job: str, phash: Optional[str] = "p1") -> DeviceRun:
    return DeviceRun(device, status=RunStatus.JOB_ERROR, platform_hash=phash, current=(job, 0),
                     detail=f"job {job} iteration 0: IndexError: index out of range in self")


def test_a_job_that_raises_where_peers_or_the_golden_complete_it_is_a_crash(tmp_path):
    spec = _spec("replay-fp32")
    clean = w.run_job(spec, "cpu")
    # a peer of the platform completed it
    res = judgment.judge({"cuda:0": _device("cuda:0", [clean]), "cuda:1": _raised("cuda:1", spec.name)},
                         [spec], _no_golden)
    v = res.verdict("cuda:1")
    assert (v.outcome, v.reason, v.job) == (Outcome.SUSPECT, KnownAnswerReason.CRASH, spec.name)
    assert "IndexError: index out of range in self" in v.evidence["detail"]
    assert "peer device" in v.evidence["detail"]
    # every device raised, but a golden of the platform records completed runs
    lookup = _golden(spec, clean, tmp_path)
    res = judgment.judge({d: _raised(d, spec.name) for d in ("cuda:0", "cuda:1")}, [spec], lookup)
    assert {(v.outcome, v.reason) for v in res.verdicts} == {(Outcome.SUSPECT, KnownAnswerReason.CRASH)}
    assert "golden" in res.verdict("cuda:0").evidence["detail"]
    # it completed earlier on this very device
    run = _device("cpu", [clean])
    run.status, run.current = RunStatus.JOB_ERROR, (spec.name, 1)
    run.detail = "job replay-fp32 iteration 1: IndexError: index out of range in self"
    v = judgment.judge({"cpu": run}, [spec], _no_golden).verdict("cpu")
    assert (v.reason, v.outcome) == (KnownAnswerReason.CRASH, Outcome.SUSPECT)


def test_a_job_that_raises_with_nothing_to_show_it_completes_is_inconclusive():
    """Issue 33.4: a persistent corrupted index and a bug of ours look the same with nothing to
    show the job completes: inconclusive (exit 3) with the record command, never exit 1."""
    spec = _spec("replay-fp32")
    res = judgment.judge({"cpu": _raised("cpu", spec.name)}, [spec], _no_golden, golden_dir="g")
    v = res.verdict("cpu")
    assert res.exit_code == ExitCode.INCONCLUSIVE
    assert (v.outcome, v.reason, v.job) == (Outcome.INCONCLUSIVE, KnownAnswerReason.CRASH, spec.name)
    assert "nothing shows the job completes" in v.evidence["detail"]
    assert v.evidence["command"] == f"screener golden record --job {spec.name} --device cpu --out g"
    # a failure the child reports as ours is still exit 1
    ours = DeviceRun("cpu", status=RunStatus.SCREENER_ERROR, detail="KeyError: x")
    with pytest.raises(ScreenerError, match="the screener failed") as e:
        judgment.judge({"cpu": ours}, [spec], _no_golden)
    assert e.value.exit_code == ExitCode.SCREENER_ERROR


# --- end to end: child processes and the CLI ---------------------------------------------------

@pytest.fixture(scope="module")
def goldens(cpu_goldens) -> str:
    """Goldens of gemm-fp32 and replay-fp32 for this machine's CPU platform
    (conftest.cpu_goldens)."""
    return cpu_goldens("gemm-fp32", "replay-fp32")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "screener.cli", "kat", "run", "--device", "cpu",
                           "--json", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_the_issues_two_faults_in_two_runs_exit_75_not_1(goldens):
    r = _cli("--job", "gemm-fp32", "--golden-dir", goldens,
             "--inject", "op=mm,call=3,element=7,bit=0,job=gemm-fp32,iteration=0",
             "--inject", "op=mm,call=5,element=7,bit=0,job=gemm-fp32,iteration=1")
    assert r.returncode == int(ExitCode.HARDWARE_SUSPECT), r.stderr
    out = json.loads(r.stdout)
    v = out["verdicts"][0]
    assert (v["outcome"], v["reason"], v["job"]) == ("suspect", "golden_mismatch", "gemm-fp32")
    rec = golden.find(goldens, _spec("gemm-fp32"), v["platform_hash"])
    # expected is the golden's value at the place the device's first run went wrong
    step = next(s for s in rec.steps if s.step == v["step"])
    assert v["expected"] == "{:016x}:{:016x}".format(
        *[x & 0xFFFFFFFFFFFFFFFF for x in dict(step.tensors)[v["tensor"]]])
    assert v["observed"] != v["expected"]
    assert out["faults"]["cpu"]["fired"] == [0, 1] and out["warnings"] == []


@pytest.mark.slow
def test_a_persistent_fault_and_a_corrupted_index_through_the_child(goldens):
    r = _cli("--job", "gemm-fp32", "--job", "replay-fp32", "--golden-dir", goldens, "--repeat", "2",
             "--inject", "op=mm,call=4,element=7,bit=1,persistent=true,job=gemm-fp32",
             "--inject", "op=arange,call=1,element=3,bit=40,job=replay-fp32")
    assert r.returncode == int(ExitCode.HARDWARE_SUSPECT), r.stderr
    v = json.loads(r.stdout)["verdicts"][0]
    issues = {i["job"]: i for i in v["evidence"]["issues"]}
    assert issues["gemm-fp32"]["reason"] == "golden_mismatch"
    assert issues["gemm-fp32"]["step"] == 4 // len(_spec("gemm-fp32").params_for("cpu")["shapes"])
    assert issues["replay-fp32"]["reason"] == "crash"
    assert "IndexError: index out of range in self" in issues["replay-fp32"]["detail"]


@pytest.mark.slow
def test_an_injected_fault_that_never_fires_is_said_and_exits_2(goldens):
    r = _cli("--job", "gemm-fp32", "--golden-dir", goldens, "--repeat", "1",
             "--inject", "op=mm,call=3000,element=7,bit=0")
    assert r.returncode == int(ExitCode.USAGE), r.stderr
    out = json.loads(r.stdout)
    assert out["outcome"] == "pass" and out["faults_fired"] == {"cpu": []}
    assert out["faults"]["cpu"]["unfired"][0]["call"] == 3000
    assert "injected fault(s) never fired" in r.stderr and "call=3000" in r.stderr


def test_parse_fault_reads_persistent():
    assert parse_fault("op=mm,call=2,persistent=true")[1].persistent is True
    assert parse_fault("op=mm,persistent=0")[1].persistent is False
    for bad in ("op=mm,persistent=maybe",):
        with pytest.raises(Exception, match="persistent must be true or false"):
            parse_fault(bad)
    with pytest.raises(Exception, match="must be true or false"):
        DeviceFault(op="mm", persistent="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_daemons_runner_keeps_what_earlier_screens_produced(tmp_path):
    """The production runner remembers the digests of devices that reproduced themselves, and
    passes them to its next screen; with no golden, a device that then disagrees with itself
    is suspect, not 'the screener failed'."""
    empty = tmp_path / "nogolden"
    empty.mkdir()
    opts = ScreenOptions(jobs=("gemm-fp32",), devices=("cpu",), golden_dir=str(empty), repeat=2)
    runner = ScreenProcessRunner(opts, work_dir=tmp_path / "work")
    def request() -> ScreenRequest:
        return ScreenRequest(node="n1", cancel=threading.Event(), deadline=time.time() + 300)

    first = runner(request())
    assert first.outcome == Outcome.INCONCLUSIVE, first  # no golden: inconclusive
    known = json.loads((tmp_path / "work" / KNOWN_DIGESTS).read_text())
    (phash, jobs), = known.items()
    assert jobs["gemm-fp32"]["digest"] == first.digests["cpu"]["gemm-fp32"]
    faulty = ScreenProcessRunner(
        ScreenOptions(**{**opts.__dict__, "faults": {"cpu": [DeviceFault(
            op="mm", call=3, element=7, bit=0, iteration=1).to_dict()]}}),
        work_dir=tmp_path / "work")
    second = faulty(request())
    assert second.outcome == Outcome.SUSPECT, second
    v = second.verdicts[0]
    assert (v.reason, v.job) == (KnownAnswerReason.SELF_MISMATCH, "gemm-fp32")
    # the suspect screen did not overwrite what the node knows
    assert json.loads((tmp_path / "work" / KNOWN_DIGESTS).read_text()) == known


def test_every_device_flipping_between_the_golden_and_another_result_is_suspect(tmp_path):
    """Issue 33.4: eight devices, each giving [golden, other, golden]: the golden shows the job
    deterministic on the platform, so each device that disagrees with itself is suspect
    (self_mismatch, with counts), however many of them do; never "a screener bug". One device
    doing it among steady peers is suspect alone."""
    spec = _spec("gemm-fp32")
    clean = w.run_job(spec, "cpu")
    other = _bad(spec, "mm", 4, persistent=False)
    lookup = _golden(spec, clean, tmp_path)
    runs = {f"cuda:{i}": _device(f"cuda:{i}", [clean, other, clean]) for i in range(8)}
    res = judgment.judge(runs, [spec], lookup)
    assert res.exit_code == ExitCode.HARDWARE_SUSPECT
    assert {(v.outcome, v.reason) for v in res.verdicts} == {(Outcome.SUSPECT,
                                                              KnownAnswerReason.SELF_MISMATCH)}
    assert "1 of 3 runs differ from the golden" in res.verdict("cuda:0").evidence["detail"]
    runs = {f"cuda:{i}": _device(f"cuda:{i}", [clean, clean, clean]) for i in range(8)}
    runs["cuda:3"] = _device("cuda:3", [clean, other, clean])
    res = judgment.judge(runs, [spec], lookup)
    assert res.verdict("cuda:3").outcome == Outcome.SUSPECT
    assert [v.device for v in res.verdicts if v.outcome == Outcome.SUSPECT] == ["cuda:3"]


def test_an_earlier_screens_digest_no_run_reproduces_still_shows_the_job_deterministic():
    """Issue 33.4: the node's earlier screens reproduced a result on the platform; a device
    whose runs now disagree with each other (and with it) is suspect, not our bug."""
    spec = _spec("gemm-fp32")
    a, b = _bad(spec, "mm", 1, persistent=False), _bad(spec, "mm", 2, persistent=False)
    res = judgment.judge({"cpu": _device("cpu", [a, b])}, [spec], _no_golden,
                         known={"p1": {spec.name: "0123456789abcdef"}})
    v = res.verdict("cpu")
    assert (v.outcome, v.reason) == (Outcome.SUSPECT, KnownAnswerReason.SELF_MISMATCH)
    assert "which no run reproduces" in v.evidence["detail"]


@pytest.mark.parametrize("exc, kind", [
    (IndexError("index out of range in self"), "job"),
    (RuntimeError("probability tensor contains either inf, nan or element < 0"), "job"),
    (ValueError("math domain error"), "job"),
    (KeyError("x"), "screener"), (AssertionError(), "screener"), (OSError("disk"), "screener"),
    (MemoryError(), "screener"), (RuntimeError("CUDA out of memory. Tried to allocate"), "screener"),
    (RuntimeError("Deterministic behavior was enabled ... CUBLAS_WORKSPACE_CONFIG"), "screener"),
])
def test_which_exceptions_a_corrupted_value_can_cause(exc, kind):
    from screener.known_answer.engine.child import _job_kind

    try:
        raise exc
    except Exception as e:  # noqa: BLE001 - classified as the child does
        assert _job_kind(e) == kind
