"""Golden records: format, validation (each way a file can be bad), recording, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cli_util

from screener.known_answer.engine import golden as g
from screener.known_answer.verdict import results
from screener.known_answer.engine import workloads as w
from screener.determinism import preserved
from screener.errors import GoldenError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def spec_and_result():
    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "gemm-fp32")
    with preserved():
        result = w.run_job(spec, "cpu")
    return spec, result


def _record(spec, result, tmp_path, phash="00aa11bb22cc33dd"):
    rec = g.record_from_results(spec, {"name": "test cpu", "numeric_hash": phash}, phash,
                                [("cpu", result), ("cpu", result)], repeats=2, host="h",
                                now=0.0)
    return rec, g.write(rec, tmp_path)


def test_roundtrip_and_format(spec_and_result, tmp_path):
    spec, result = spec_and_result
    rec, path = _record(spec, result, tmp_path)
    assert path.name == "gemm-fp32.00aa11bb22cc33dd.json"
    loaded = g.load(path, spec=spec, platform_hash="00aa11bb22cc33dd")
    assert loaded == rec and loaded.compare(result) is None
    d = json.loads(path.read_text())
    assert d["schema"] == g.SCHEMA and d["spec_hash"] == spec.spec_hash
    assert d["recorded"] == {"devices": ["cpu"], "repeats": 2, "host": "h",
                             "time": "1970-01-01T00:00:00Z", "screener_version": d["recorded"]["screener_version"],
                             "seconds": d["recorded"]["seconds"]}
    assert d["recorded"]["seconds"] > 0
    assert d["sha256"] == g.checksum(d) and d["digest"] == result.digest
    # diffable: one tensor per line
    lines = path.read_text().splitlines()
    assert sum('"product[' in line for line in lines) == sum(len(s.tensors) for s in result.steps)
    assert g.find(tmp_path, spec, "00aa11bb22cc33dd") == rec
    assert g.find(tmp_path, spec, "ffffffffffffffff") is None


def _expect(path, needle, **kw):
    with pytest.raises(GoldenError) as e:
        g.load(path, **kw)
    text = str(e.value)
    assert str(path) in text and needle in text, text
    assert "\n" not in text and e.value.exit_code == 2


def test_every_kind_of_bad_file_is_one_clear_error(spec_and_result, tmp_path):
    spec, result = spec_and_result
    _, path = _record(spec, result, tmp_path)
    good = path.read_text()

    path.write_text(good[: len(good) // 2])
    _expect(path, "not valid JSON")

    d = json.loads(good)
    d["steps"][1]["tensors"][0][1] += 1
    path.write_text(json.dumps(d))
    _expect(path, "checksum mismatch")

    d = json.loads(good)
    d["schema"] = 99
    path.write_text(json.dumps(d))
    _expect(path, "schema 99")

    d = json.loads(good)
    del d["platform"]
    d["sha256"] = g.checksum(d)
    path.write_text(json.dumps(d))
    _expect(path, "missing field")

    d = json.loads(good)
    d["steps"][0]["tensors"] = "nope"
    d["sha256"] = g.checksum(d)
    path.write_text(json.dumps(d))
    _expect(path, "tensors is not a list")

    path.write_bytes(b"\xff\xfe garbage")
    _expect(path, "not UTF-8")

    path.write_text(good)
    other = tmp_path / "gemm-fp32.1111111111111111.json"
    other.write_text(good)
    _expect(other, "file name does not match")

    path.write_text(good)
    stale = w.JobSpec.from_dict({**spec.to_dict(), "version": spec.version + 1})
    _expect(path, "the job changed", spec=stale)
    _expect(path, "is for platform", platform_hash="2222222222222222")
    g.load(path, spec=spec)  # and the good file is still good


def _resealed(good: str, edit) -> str:
    d = json.loads(good)
    edit(d)
    d["digest"] = results.steps_digest([w.Step.from_dict(x) for x in d["steps"]]) if d["steps"] and \
        all(isinstance(x, dict) for x in d["steps"]) else d["digest"]
    d["sha256"] = g.checksum(d)  # an attacker recomputes the checksum
    return json.dumps(d)


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.__setitem__("steps", []), "has no steps"),
    (lambda d: d["steps"][0]["tensors"][0].__setitem__(1, 2**63), "signed 64-bit"),
    (lambda d: d["steps"][0]["tensors"][0].__setitem__(2, -(2**63) - 1), "signed 64-bit"),
    (lambda d: d["steps"][0]["tensors"][0].__setitem__(1, 1.5), "signed 64-bit"),
    (lambda d: d["steps"][1].__setitem__("step", 7), "numbered 7"),
    (lambda d: d["steps"][0].__setitem__("loss", "1e3"), "float bit pattern"),
    (lambda d: d["steps"].pop(), "implies"),
    (lambda d: d["steps"][0]["tensors"].append(list(d["steps"][0]["tensors"][0])), "twice"),
    (lambda d: d["recorded"].__setitem__("seconds", -1), "job time"),
])
def test_content_is_validated_not_only_the_checksum(spec_and_result, tmp_path, edit, needle):
    spec, result = spec_and_result
    _, path = _record(spec, result, tmp_path)
    path.write_text(_resealed(path.read_text(), edit))
    _expect(path, needle, spec=spec)


def _train_record(tmp_path, phash="00aa11bb22cc33dd", loss="0x3f800000"):
    """A train-fp32 golden made from a result written out by hand (no run): 4 steps, each with a
    float32 loss and one weight fingerprint, sealed as `golden record` seals it."""
    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "train-fp32")
    steps = tuple(w.Step(i, f"step {i}", loss, (("w", (i, -i)),)) for i in range(4))
    result = w.JobResult(spec.name, spec.spec_hash, "cpu", steps)
    rec = g.record_from_results(spec, {"device": "cpu", "numeric_hash": phash}, phash,
                                [("cpu", result)], repeats=1, host="h", now=0.0)
    return spec, g.write(rec, tmp_path)


@pytest.mark.parametrize("loss,needle", [
    ("0x7fc00000", "NaN or an infinity"),          # float32 NaN
    ("0x7f800000", "NaN or an infinity"),          # float32 +inf
    ("0xff800000", "NaN or an infinity"),          # float32 -inf
    ("0x7ff8000000000000", "NaN or an infinity"),  # float64 NaN
    (None, "has no loss, but a train job records a 32-bit"),
    ("0x3c00", "16-bit loss 0x3c00, but a train job records a 32-bit"),
    ("0x3ff0000000000000", "64-bit loss"),
])
def test_a_loss_that_is_no_known_answer_is_refused(tmp_path, loss, needle):
    spec, path = _train_record(tmp_path)
    g.load(path, spec=spec)  # the control: the hand-made record is valid
    path.write_text(_resealed(path.read_text(),
                              lambda d: d["steps"][2].__setitem__("loss", loss)))
    _expect(path, needle, spec=spec)


def test_every_step_is_present_once(tmp_path):
    spec, path = _train_record(tmp_path)

    def copy_step(d):  # step 1 duplicated over step 2 (renumbered, count unchanged)
        d["steps"][2] = {**d["steps"][1], "step": 2}
    path.write_text(_resealed(path.read_text(), copy_step))
    _expect(path, "step 2 repeats the label 'step 1' of step 1", spec=spec)


def test_a_kind_without_a_loss_has_none(spec_and_result, tmp_path):
    spec, result = spec_and_result
    _, path = _record(spec, result, tmp_path)
    path.write_text(_resealed(path.read_text(),
                              lambda d: d["steps"][0].__setitem__("loss", "0x3f800000")))
    _expect(path, "has a 32-bit loss 0x3f800000, but a gemm job records no loss", spec=spec)


@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_duplicated_key_is_refused(tmp_path, where):
    spec, path = _train_record(tmp_path)
    good = path.read_text()
    d = json.loads(good)
    forged = json.loads(json.dumps(d["steps"]))
    forged[0]["loss"] = "0x7fc00000"
    if where == "top":  # a hidden first "steps" that json.loads would drop for the second
        text = '{"steps": ' + json.dumps(forged) + ", " + good.lstrip()[1:]
    else:
        text = good.replace('"repeats": 1', '"repeats": 1, "repeats": 9')
        assert text != good
    path.write_text(text)
    _expect(path, "duplicate key", spec=spec)


@pytest.mark.parametrize("text,needle", [
    ('{"schema": 1, "schema": 2}', "duplicate key 'schema'"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    ('{"schema": 1, "job_version": ' + "7" * 5000 + "}", "digits"),
    ('{"schema": 1, "job_version": Infinity}', "not a number JSON allows"),
    ('{"schema": 1, "job_version": 1e999}', "overflows"),
    ('{"schema": NaN}', "not a number JSON allows"),
])
def test_hostile_json_is_one_line(tmp_path, text, needle):
    path = tmp_path / "gemm-fp32.00aa11bb22cc33dd.json"
    path.write_text(text)
    _expect(path, needle)


def test_golden_verify_checks_content_against_the_spec(spec_and_result, tmp_path):
    spec, result = spec_and_result
    _, path = _record(spec, result, tmp_path)
    r = _cli("golden", "verify", str(tmp_path))
    assert r.returncode == 0, r.stderr
    path.write_text(_resealed(path.read_text(), lambda d: d["steps"].pop()))
    r = _cli("golden", "verify", str(tmp_path))
    assert r.returncode == 2 and "implies" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_recording_refuses_disagreeing_runs(spec_and_result):
    spec, result = spec_and_result
    steps = list(result.steps)
    name, (a, b) = steps[2].tensors[0]
    steps[2] = w.Step(2, steps[2].label, None, ((name, (a ^ 1, b)),) + steps[2].tensors[1:])
    bad = w.JobResult(result.job, result.spec_hash, "cpu", tuple(steps))
    with pytest.raises(GoldenError, match="refusing to record.*step 2"):
        g.record_from_results(spec, {}, "00", [("cpu", result), ("cpu", bad)], repeats=2)


def _cli(*args, cwd=ROOT):
    # In this process through the console entry point (exit codes and one-line errors as the
    # installed command; tests/test_kat.py and test_burnin.py run the real process).
    return cli_util.screener(*args, cwd=cwd)


def test_committed_goldens_verify():
    r = _cli("golden", "verify", str(ROOT / "golden"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ok ") >= len(list((ROOT / "golden").glob("*.json"))) >= 1


def test_cli_verify_and_kat_run_reject_a_corrupted_golden(spec_and_result, tmp_path):
    spec, result = spec_and_result
    from screener.known_answer.engine.screen import local_platform

    phash = local_platform("cpu").numeric_hash
    _, path = _record(spec, result, tmp_path, phash=phash)
    text = path.read_text()
    path.write_text(text.replace('"repeats": 2', '"repeats": 3'))  # tampered
    r = _cli("golden", "verify", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and str(path) in r.stderr
    assert "checksum mismatch" in r.stderr and "Traceback" not in r.stderr
    path.write_text(text[:-40])  # truncated
    r = _cli("kat", "run", "--job", "gemm-fp32", "--device", "cpu", "--golden-dir", str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "not valid JSON" in r.stderr and str(path) in r.stderr and "Traceback" not in r.stderr
    r = _cli("golden", "list", str(tmp_path))
    assert r.returncode == 2 and str(path) in r.stderr


def test_verify_and_a_screen_refuse_a_nan_golden_with_exit_2(tmp_path):
    """The issue-23 case: a NaN loss, resealed, passed verify and made `kat run` exit 75."""
    from screener.known_answer.engine.screen import local_platform

    phash = local_platform("cpu").numeric_hash
    spec, path = _train_record(tmp_path, phash=phash)
    path.write_text(_resealed(path.read_text(),
                              lambda d: d["steps"][0].__setitem__("loss", "0x7fc00000")))
    for args in (("golden", "verify", str(tmp_path)),
                 ("kat", "run", "--job", "train-fp32", "--device", "cpu",
                  "--golden-dir", str(tmp_path))):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.strip().splitlines()[-1].endswith("not a known answer"), r.stderr
        assert str(path) in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("job", ["gemm-fp32", "conv-fp32", "train-fp32"])
def test_verify_refuses_a_golden_whose_steps_compare_nothing(tmp_path, job):
    """Issue 36.6: a committed golden resealed with `tensors: []` in every step passed verify,
    and compared nothing for gemm and conv jobs (which record no loss). Exit 2, one line."""
    src = sorted((ROOT / "golden").glob(f"{job}.*.json"))[0]
    path = tmp_path / src.name
    path.write_text(_resealed(src.read_text(),
                              lambda d: [s.__setitem__("tensors", []) for s in d["steps"]]))
    r = _cli("golden", "verify", str(tmp_path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], r.stderr
    assert "step 0 records no tensor: a golden must compare something in every step" in lines[0]
    assert "Traceback" not in r.stderr


def test_verify_refuses_a_golden_label_that_is_not_printable(tmp_path):
    src = sorted((ROOT / "golden").glob("gemm-fp32.*.json"))[0]
    path = tmp_path / src.name
    path.write_text(_resealed(src.read_text(),
                              lambda d: d["steps"][0].__setitem__("label", "mm\u202e0")))
    r = _cli("golden", "verify", str(tmp_path))
    assert r.returncode == 2 and "U+202E" in r.stderr and len(r.stderr.strip().splitlines()) == 1
