"""Goldens that travel, and verdicts that read right.

A device with no golden of its own platform is compared with the goldens of sibling platforms
(same torch build and dispatch level): equal bits pass and name the golden, different bits are
inconclusive with the record command, never suspect. `golden record` on a platform whose bits
equal an existing golden adds the platform to that record. In every verdict `expected` is the
golden's (or the majority's) value and `observed` the device's, also for a fault in the first
repeat (in process and through `screener kat run --inject`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from screener.known_answer.engine import golden
from screener.known_answer.engine import recording, text
from screener.known_answer.verdict import judgment
from screener.known_answer.engine.screen import golden_lookup, local_platform
from screener.known_answer.verdict.results import first_difference
from screener.known_answer.verdict.runs import DeviceRun
from screener.known_answer.engine import workloads as w
from screener.determinism import preserved
from screener.known_answer.engine.faults import FaultSpec, inject
from screener.types import ExitCode, Outcome

ROOT = Path(__file__).resolve().parents[1]
FAULT = dict(call=3, element=9, bit=1)


@pytest.fixture(scope="module")
def setup():
    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "gemm-fp32")
    with preserved():
        plat = local_platform("cpu")
        good = w.run_job(spec, "cpu")
        bad = w.run_job(spec, "cpu", injector=inject(FaultSpec("mm", **FAULT)))
    assert good.digest != bad.digest
    return spec, plat, good, bad


def _run(device, results, plat):
    run = DeviceRun(device, platform=plat.to_dict(), platform_hash=plat.numeric_hash)
    for i, r in enumerate(results):
        run.add(i, r)
    run.iterations = len(results)
    return run


def _write(spec, plat, result, folder):
    rec = golden.record_from_results(spec, plat.to_dict(), plat.numeric_hash,
                                     [("cpu", result)], repeats=1)
    return golden.write(rec, folder)


def test_a_sibling_platforms_golden_passes_equal_bits_and_names_itself(setup, tmp_path):
    spec, plat, good, _ = setup
    sibling = replace(plat, threads=4, blas="mkl another path")  # same torch and dispatch level
    assert sibling.numeric_hash != plat.numeric_hash
    path = _write(spec, sibling, good, tmp_path)
    res = judgment.judge({"cpu": _run("cpu", [good, good], plat)}, [spec],
                    golden_lookup(str(tmp_path)), golden_dir=str(tmp_path))
    v = res.verdict("cpu")
    assert (res.outcome, res.exit_code) == (Outcome.PASS, ExitCode.PASS)
    assert v.evidence["jobs"]["gemm-fp32"]["golden"] == str(path)
    assert v.evidence["jobs"]["gemm-fp32"]["sibling"] is True
    assert str(path) in text.format_verdicts(res)


def test_a_sibling_platforms_golden_with_other_bits_is_inconclusive_never_suspect(setup, tmp_path):
    spec, plat, good, bad = setup
    _write(spec, replace(plat, onednn="onednn other"), good, tmp_path)
    res = judgment.judge({"cpu": _run("cpu", [bad, bad], plat)}, [spec],
                    golden_lookup(str(tmp_path)), golden_dir=str(tmp_path))
    v = res.verdict("cpu")
    assert (v.outcome, v.reason, res.exit_code) == (Outcome.INCONCLUSIVE, "sibling_golden_differs",
                                                   ExitCode.INCONCLUSIVE)
    diff = first_difference(good.steps, bad.steps)
    assert (v.expected, v.observed) == (diff.expected, diff.observed)  # golden's, device's
    assert v.evidence["command"].startswith("screener golden record --job gemm-fp32")
    assert "record a golden: screener golden record" in text.format_verdicts(res)


def test_a_golden_of_another_dispatch_level_is_not_a_sibling(setup, tmp_path):
    spec, plat, good, _ = setup
    other = "AVX512" if plat.cpu_capability != "AVX512" else "AVX2"
    _write(spec, replace(plat, cpu_capability=other), good, tmp_path)
    res = judgment.judge({"cpu": _run("cpu", [good], plat)}, [spec], golden_lookup(str(tmp_path)))
    assert (res.verdict("cpu").reason, res.exit_code) == ("no_golden", ExitCode.INCONCLUSIVE)


def test_expected_is_the_goldens_value_when_the_first_repeat_went_wrong(setup, tmp_path):
    spec, plat, good, bad = setup
    _write(spec, plat, good, tmp_path)
    res = judgment.judge({"cpu": _run("cpu", [bad, good], plat)}, [spec],
                    golden_lookup(str(tmp_path)))
    v = res.verdict("cpu")
    diff = first_difference(good.steps, bad.steps)
    assert (v.outcome, v.reason) == (Outcome.SUSPECT, "self_mismatch")
    assert (v.expected, v.observed) == (diff.expected, diff.observed)
    assert "first: iteration 0" in v.evidence["detail"] and "1 run(s) reproduce it" in \
        v.evidence["detail"]
    issue = next(i for i in v.evidence["issues"] if i["reason"] == "golden_mismatch")
    assert (issue["expected"], issue["observed"]) == (diff.expected, diff.observed)
    # the same when it is the second repeat that went wrong
    v2 = judgment.judge({"cpu": _run("cpu", [good, bad], plat)}, [spec],
                   golden_lookup(str(tmp_path))).verdict("cpu")
    assert (v2.expected, v2.observed) == (diff.expected, diff.observed)


def test_expected_is_the_majoritys_value_without_a_golden(setup):
    spec, plat, good, bad = setup
    runs = {"a": _run("a", [bad, good], plat), "b": _run("b", [good], plat),
            "c": _run("c", [good], plat)}
    v = judgment.judge(runs, [spec], lambda s, h: None).verdict("a")
    diff = first_difference(good.steps, bad.steps)
    assert v.outcome == Outcome.SUSPECT
    assert (v.expected, v.observed) == (diff.expected, diff.observed)


def test_record_adds_a_platform_with_equal_bits_to_the_existing_golden(setup, tmp_path):
    spec, plat, good, bad = setup
    first = replace(plat, threads=plat.threads + 1)  # a sibling: another thread count
    path = _write(spec, first, good, tmp_path)
    before = path.read_text()
    rec = recording.write_goldens({"cpu": _run("cpu", [good, good], plat)}, [spec], str(tmp_path),
                            repeat=2)
    assert rec.exit_code == ExitCode.PASS and not rec.written
    assert rec.added == (f"{path} (platform {plat.numeric_hash})",)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [path.name]  # no copy
    loaded = golden.load(path, spec=spec, platform_hash=plat.numeric_hash)
    assert loaded.platform_hashes == (first.numeric_hash, plat.numeric_hash)
    assert json.loads(path.read_text())["schema"] == golden.SCHEMA_ALSO
    assert before != path.read_text()
    assert golden.find(tmp_path, spec, plat.numeric_hash).path == str(path)
    again = recording.write_goldens({"cpu": _run("cpu", [good], plat)}, [spec], str(tmp_path), repeat=1)
    assert (again.added, again.unchanged) == ((), (str(path),))
    # other bits on a new platform: a file of its own
    third = replace(plat, threads=3)
    other = recording.write_goldens({"cpu": _run("cpu", [bad], third)}, [spec], str(tmp_path), repeat=1)
    assert other.written and not other.added
    # an edited `also` entry is caught by the checksum, a malformed one by the content checks
    d = json.loads(path.read_text())
    d["also"][0]["platform_hash"] = "zz"
    d["sha256"] = golden.checksum(d)
    path.write_text(json.dumps(d))
    with pytest.raises(golden.GoldenError, match="also"):
        golden.load(path)


def test_the_committed_goldens_still_load():
    records, errors = golden.load_dir(ROOT / "golden")
    assert not errors, errors
    files = sorted(p.name for p in (ROOT / "golden").glob("*.json"))
    assert sorted(Path(r.path).name for r in records) == files and len(files) >= 20


@pytest.mark.slow
def test_kat_run_with_a_fault_in_the_first_repeat_reads_right(setup, tmp_path):
    spec, plat, good, bad = setup
    _write(spec, plat, good, tmp_path)
    env = {**os.environ, "SCREENER_GOLDEN_DIR": str(tmp_path)}
    fault = ",".join(f"{k}={v}" for k, v in FAULT.items())
    r = subprocess.run([sys.executable, "-m", "screener.cli", "kat", "run", "-j", "gemm-fp32",
                        "--device", "cpu", "--repeat", "2", "--json", "--inject",
                        f"op=mm,{fault},iteration=0"],
                       capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert r.returncode == int(ExitCode.HARDWARE_SUSPECT), r.stderr
    out = json.loads(r.stdout)
    v = out["verdicts"][0]
    diff = first_difference(good.steps, bad.steps)
    assert (v["expected"], v["observed"]) == (diff.expected, diff.observed)
    # the child's platform key is the one `screener platform` and the goldens use
    assert out["platforms"]["cpu"]["numeric_hash"] == plat.numeric_hash
    # progress on stderr, not a terminal, --json: one JSON line per job run, with elapsed time
    lines = [json.loads(x) for x in r.stderr.splitlines() if x.startswith('{"event": "progress"')]
    steps = [x for x in lines if x["kind"] == "step"]
    assert [x["done"] for x in steps] == [1, 2] and all(x["total"] == 2 for x in steps)
    assert steps[0]["item"] == "cpu gemm-fp32 #0" and lines[-1]["kind"] == "end"
    assert all(x["elapsed_s"] >= 0 for x in lines)
