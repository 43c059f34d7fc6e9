"""Golden records: format, validation (each way a file can be bad), recording, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cli_util

from screener.known_answer import golden as g
from screener.known_answer import results
from screener.known_answer import workloads as w
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


@pytest.mark.parametrize("text,needle", [
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
    from screener.known_answer.kat import local_platform

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
