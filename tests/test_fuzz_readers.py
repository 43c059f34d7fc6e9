"""Every reader of outside input, fed a corpus of hostile inputs: each is refused cleanly.

Readers: golden records, job specs, alarm files, the daemon config, the kernel log, checkpoints,
kubeconfigs and numbers on the command line. For each case the reader must answer with exit 2
and one line naming the input (CLI readers, run in-process through the console entry point), or
a clean refusal (ConfigError, a file moved to rejected/, a kernel-log read that skips what is not
an Xid), never a traceback, never a hang: every case has a time bound. The cases include every
one reported in issue 13.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest

from screener.cli import run as cli_run

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 20.0  # per case; the slowest (a checkpoint through torch.load) takes well under 1 s
DEEP = 100_000
PHASH = "00aa11bb22cc33dd"


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """Run `screener ARGS` in this process through the console entry point; (exit code, stderr).
    Anything but SystemExit escaping it is a traceback, and fails the test."""
    monkeypatch.setattr(sys, "argv", ["screener", *args])
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        cli_run()
    assert time.monotonic() - t0 < BOUND_S, f"screener {' '.join(args)[:200]} took too long"
    err = capsys.readouterr().err
    return int(e.value.code or 0), err


def one_line_refusal(code: int, err: str) -> None:
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    # ours: "screener: <file>: <problem>"; click's usage errors end in one "Error: ..." line
    assert lines and (lines[-1].startswith(("screener:", "Error:"))), err[-2000:]


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


# --- golden records ----------------------------------------------------------------------------

def _golden_record() -> dict[str, Any]:
    from screener.known_answer.engine import golden as g
    from screener.known_answer.engine import workloads as w

    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "gemm-fp32")
    steps = tuple(w.Step(i, f"link {i}", None, (("product[192x256x256]", (i + 1, -i - 7)),))
                  for i in range(w.expected_steps(spec, "cpu")))
    result = w.JobResult(spec.name, spec.spec_hash, "cpu", steps, seconds=0.1)
    rec = g.record_from_results(spec, {"device": "cpu"}, PHASH, [("cpu", result)], repeats=1,
                                host="h", now=0.0)
    return rec.to_dict()


def _resealed(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        from screener.known_answer.engine import golden as g

        d = _golden_record()
        edit(d)
        d["sha256"] = g.checksum(d)  # whoever edits a golden can recompute its checksum
        path.write_text(json.dumps(d))
    return write


def _text(s: str | bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(s if isinstance(s, bytes) else s.encode())
    return write


def _set_fp(d: dict, value: Any) -> None:
    d["steps"][0]["tensors"][0][1] = value


GOLDEN_CASES: dict[str, Callable[[Path], None]] = {
    "nested-100k-brackets": _text("[" * DEEP + "]" * DEEP),
    "nested-100k-objects": _text('{"a":' * DEEP + "1" + "}" * DEEP),
    "integer-5000-digits": _text('{"schema": 1, "job_version": ' + "7" * 5000 + "}"),
    "Infinity": _text('{"schema": 1, "job_version": Infinity}'),
    "minus-Infinity": _text('{"schema": -Infinity}'),
    "NaN": _text('{"schema": NaN}'),
    "1e999": _text('{"schema": 1e999}'),
    "inf-bare": _text("inf"),
    "empty": _text(b""),
    "invalid-utf8": _text(b'{"schema": 1, "job": "\xff\xfe"}'),
    "null": _text("null"),
    "list": _text("[]"),
    "truncated": lambda p: p.write_text(json.dumps(_golden_record())[:500]),
    "steps-empty": _resealed(lambda d: d.__setitem__("steps", [])),
    "fingerprint-2**64": _resealed(lambda d: _set_fp(d, 2**64)),
    "fingerprint-float": _resealed(lambda d: _set_fp(d, 1.5)),
    "fingerprint-string": _resealed(lambda d: _set_fp(d, "12")),
    "fingerprint-bool": _resealed(lambda d: _set_fp(d, True)),
    "step-misnumbered": _resealed(lambda d: d["steps"][1].__setitem__("step", 0)),
    "step-missing": _resealed(lambda d: d["steps"].pop()),
    "loss-text": _resealed(lambda d: d["steps"][0].__setitem__("loss", "nan")),
    "tensor-pair": _resealed(lambda d: d["steps"][0]["tensors"].__setitem__(0, ["x", 1])),
    "unknown-field": _resealed(lambda d: d.__setitem__("extra", 1)),
    "recorded-seconds-negative": _resealed(lambda d: d["recorded"].__setitem__("seconds", -3)),
    "sparse-70MiB": lambda p: _sparse(p, 70 * 1024 * 1024),
    "fifo": _fifo,
    "symlink-to-dev-zero": lambda p: p.symlink_to("/dev/zero"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_verify_refuses(case, tmp_path, monkeypatch, capsys):
    path = tmp_path / f"gemm-fp32.{PHASH}.json"
    GOLDEN_CASES[case](path)
    code, err = cli(monkeypatch, capsys, "golden", "verify", str(tmp_path),
                    "--jobs-dir", str(ROOT / "jobs"))
    one_line_refusal(code, err)
    assert str(path) in err


def test_the_golden_corpus_control_is_accepted(tmp_path, monkeypatch, capsys):
    """The unedited record of the corpus passes, so each refusal above is about its edit."""
    (tmp_path / f"gemm-fp32.{PHASH}.json").write_text(json.dumps(_golden_record()))
    code, err = cli(monkeypatch, capsys, "golden", "verify", str(tmp_path),
                    "--jobs-dir", str(ROOT / "jobs"))
    assert code == 0, err


# --- job specs -----------------------------------------------------------------------------------

def _spec(kind: str, params: str = "", extra: str = "", name: str = "x") -> str:
    return f'name = "{name}"\nversion = 1\nkind = "{kind}"\n{extra}\n[params]\n{params}\n'


SPEC_CASES: dict[str, Callable[[Path], None]] = {
    "invalid-utf8": _text(b'name = "x\xff"\nversion = 1\nkind = "gemm"\n'),
    "nested-100k": _text("a = " + "[" * DEEP + "]" * DEEP),
    "inline-tables-deep": _text("a = " + "{b = " * 2000 + "1" + "}" * 2000),
    "integer-5000-digits": _text('name = "x"\nversion = ' + "9" * 5000 + '\nkind = "gemm"\n'),
    "steps-1e9": _text(_spec("train", "steps = 1000000000")),
    "lr-nan": _text(_spec("train", "lr = nan")),
    "lr-inf": _text(_spec("train", "lr = inf")),
    "gemm-1e6x1e6": _text(_spec("gemm", "shapes = [[1000000, 1000000]]")),
    "gemm-8TB": _text(_spec("gemm", "chain = 1000\nshapes = " + json.dumps([[65536, 65536]] * 16))),
    "gemm-100-shapes": _text(_spec("gemm", "shapes = " + json.dumps([[8, 8]] * 100))),
    "gemm-shape-float": _text(_spec("gemm", "shapes = [[8.5, 8]]")),
    "conv-size-1e5": _text(_spec("conv", "size = 100000")),
    "selftest-sleep-1e9": _text(_spec("selftest", "sleep = 1e9")),
    "seed-negative": _text(_spec("train", "seed = -1")),
    "version-negative": _text('name = "x"\nversion = -1\nkind = "gemm"\n'),
    "version-bool": _text('name = "x"\nversion = true\nkind = "gemm"\n'),
    "name-not-stem": _text(_spec("gemm", name="other")),
    "name-slash": _text(_spec("gemm", name="../x")),
    "kind-unknown": _text(_spec("fft")),
    "key-unknown": _text(_spec("gemm", extra="owner = 'me'")),
    "param-unknown": _text(_spec("gemm", "bogus = 1")),
    "params-not-table": _text('name = "x"\nversion = 1\nkind = "gemm"\nparams = 5\n'),
    "dtype-float64": _text(_spec("gemm", 'dtype = "float64"')),
    "heads-do-not-divide": _text(_spec("train", "d_model = 30\nn_heads = 4")),
    "tf32-bf16": _text(_spec("gemm", 'dtype = "bfloat16"\ntf32 = true')),
    "empty": _text(""),
    "binary": _text(bytes(range(256)) * 4),
    "sparse-1MiB": lambda p: _sparse(p, 1024 * 1024),
    "fifo": _fifo,
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_job_spec_readers_refuse(case, tmp_path, monkeypatch, capsys):
    path = tmp_path / "x.toml"
    SPEC_CASES[case](path)
    code, err = cli(monkeypatch, capsys, "kat", "list", "--jobs-dir", str(tmp_path))
    one_line_refusal(code, err)
    assert str(path) in err


# --- alarm files ---------------------------------------------------------------------------------

NODE = "gpu-node-1"


def _alarm(**over: Any) -> dict[str, Any]:
    d = {"schema": 1, "alarm_id": "a-1", "check": "ring_replay", "step": 7, "settled": True,
         "suspect_ranks": [3], "suspect_nodes": [{"node": NODE, "hostname": NODE,
                                                  "instance_id": None}],
         "node": NODE, "job": "train", "created": 1700000000.0, "evidence": {"rows": [1]}}
    d.update(over)
    return d


def _alarm_text(**over: Any) -> Callable[[Path], None]:
    return _text(json.dumps(_alarm(**over)))


ALARM_CASES: dict[str, Callable[[Path], None]] = {
    "nested-100k": _text("[" * DEEP + "]" * DEEP),
    "nested-evidence": _text(json.dumps(_alarm())[:-1] + ', "x": ' + "[" * 50 + "]" * 50 + "}"),
    "step-10**4000": _text(json.dumps(_alarm()).replace('"step": 7', '"step": ' + "1" + "0" * 4000)),
    "step-2**64": _alarm_text(step=2**64),
    "step-negative": _alarm_text(step=-1),
    "step-float": _alarm_text(step=7.0),
    "created-NaN": _text(json.dumps(_alarm()).replace('"created": 1700000000.0', '"created": NaN')),
    "created-Infinity": _text(json.dumps(_alarm()).replace('"created": 1700000000.0', '"created": Infinity')),
    "created-negative": _alarm_text(created=-1.0),
    "created-string": _alarm_text(created="yesterday"),
    "alarm_id-integer": _alarm_text(alarm_id=12345),
    "alarm_id-300-chars": _alarm_text(alarm_id="a" * 300),
    "alarm_id-path": _alarm_text(alarm_id="../../etc/passwd"),
    "alarm_id-newline": _alarm_text(alarm_id="a\nb"),
    "evidence-4MiB": _alarm_text(evidence={"blob": "x" * (4 * 1024 * 1024)}),
    "evidence-200KiB": _alarm_text(evidence={"blob": "x" * (200 * 1024)}),
    "evidence-list": _alarm_text(evidence=[1, 2]),
    "other-node-named": _alarm_text(suspect_nodes=[{"node": "victim", "hostname": "victim",
                                                    "instance_id": None}]),
    "ranks-not-list": _alarm_text(suspect_ranks="3"),
    "rank-huge": _alarm_text(suspect_ranks=[2**40]),
    "check-unknown": _alarm_text(check="rm -rf"),
    "settled-string": _alarm_text(settled="yes"),
    "schema-2": _alarm_text(schema=2),
    "unknown-field": _alarm_text(action="repair"),
    "invalid-utf8": _text(b'{"schema": 1, "alarm_id": "\xff"}'),
    "not-object": _text("[1, 2, 3]"),
    # issue 36.6: hostile alarm files that passed before
    "job-lone-surrogate": _text(json.dumps(_alarm()).replace('"job": "train"',
                                                             '"job": "tr\\ud800ain"')),
    "job-bidi-override": _alarm_text(job="train\u202egnp.exe"),
    "job-c1-control": _alarm_text(job="train\x9b31m"),
    "job-del": _alarm_text(job="train\x7f"),
    "job-line-separator": _alarm_text(job="train\u2028FORGED: healthy"),
    "job-newline": _alarm_text(job="train\nFORGED"),
    "evidence-lone-surrogate": _text(json.dumps(_alarm()).replace('"rows": [1]',
                                                                  '"rows": ["\\udc80"]')),
    "evidence-key-bidi": _alarm_text(evidence={"rows\u202e": [1]}),
    "straggler-slowdown-1e308": _alarm_text(check="straggler", settled=False, suspect_ranks=[],
                                            evidence={"slowdown": 1e308, "consecutive": 5}),
    "straggler-slowdown-negative": _alarm_text(check="straggler", settled=False,
                                               suspect_ranks=[], evidence={"slowdown": -0.5}),
    "straggler-consecutive-object": _alarm_text(check="straggler", settled=False,
                                                suspect_ranks=[],
                                                evidence={"slowdown": 0.2,
                                                          "consecutive": {"x": 1}}),
    "straggler-consecutive-negative": _alarm_text(check="straggler", settled=False,
                                                  suspect_ranks=[],
                                                  evidence={"consecutive": -3}),
    "straggler-consecutive-bool": _alarm_text(check="straggler", settled=False,
                                              suspect_ranks=[], evidence={"consecutive": True}),
    "created-year-5138": _alarm_text(created=99_999_999_999.0),
    "created-next-week": _alarm_text(created=time.time() + 7 * 86400),
    "created-1999": _alarm_text(created=915148800.0),
    "other-json-file": _text(json.dumps({"name": "some-app", "version": "1.0", "node": NODE})),
    "other-json-list": _text(json.dumps([{"alarm": "not ours"}])),
    "empty": _text(b""),
    "fifo": _fifo,
    "symlink-to-fifo": lambda p: (_fifo(p.parent.parent / "target-fifo"),
                                  p.symlink_to(p.parent.parent / "target-fifo")),
    "symlink-to-dev-zero": lambda p: p.symlink_to("/dev/zero"),
    "sparse-8MiB": lambda p: _sparse(p, 8 * 1024 * 1024),
}


NOT_ALARMS = {"not-object", "other-json-file", "other-json-list"}


@pytest.mark.parametrize("case", sorted(ALARM_CASES))
def test_alarm_intake_moves_hostile_files_aside_and_goes_on(case, tmp_path):
    from screener.audit.alarms import write_alarm_file
    from screener.agent.daemon.intake import AlarmIntake
    from screener.alarmfile import AlarmRecord

    alarms = tmp_path / "alarms"
    alarms.mkdir()
    name = f"0-{case}.json"
    ALARM_CASES[case](alarms / name)
    write_alarm_file(AlarmRecord.from_dict(_alarm(alarm_id="good")), alarms)
    applied: list[str] = []
    t0 = time.monotonic()
    result = AlarmIntake(alarms, NODE, lambda r: applied.append(r.alarm_id)).run()
    assert time.monotonic() - t0 < BOUND_S
    assert applied == ["good"] and not result.stuck and not result.stalled
    if case in NOT_ALARMS:  # JSON that is no alarm at all is not ours to move (issue 36.6)
        assert result.not_ours == [name] and result.rejected == [], result
        assert os.path.lexists(alarms / name)
        return
    assert result.rejected == [name], result
    assert os.path.lexists(alarms / "rejected" / name)


# --- the daemon config ---------------------------------------------------------------------------

CONFIG_CASES: dict[str, tuple[str, Callable[[Path], None]]] = {
    "alarm_dir-5": ("toml", _text("alarm_dir = 5")),
    "metrics_host-5": ("toml", _text("metrics_host = 5")),
    "metrics_host-space": ("toml", _text('metrics_host = "0.0.0.0 evil"')),
    "tick_s-inf": ("toml", _text("tick_s = inf")),
    "tick_s-nan": ("toml", _text("tick_s = nan")),
    "tick_s-negative": ("toml", _text("tick_s = -1")),
    "screen_interval_s-nan": ("toml", _text("screen_interval_s = nan")),
    "idle_window_s-nan": ("toml", _text("idle_window_s = nan")),
    "retry_inconclusive_s-inf": ("toml", _text("retry_inconclusive_s = inf")),
    "metrics_port-70000": ("toml", _text("metrics_port = 70000")),
    "metrics_port-string": ("toml", _text('metrics_port = "9500"')),
    "store-s3": ("toml", _text('store = "s3"')),
    "unknown-key": ("toml", _text("tick = 5")),
    "jobs-string": ("toml", _text('jobs = "gemm"')),
    "processed_keep-bool": ("toml", _text("processed_keep = true")),
    "db-int": ("toml", _text("db = 3")),
    "node-int": ("toml", _text("node = 5")),
    "probes-not-table": ("toml", _text("probes = 5")),
    "lifecycle-nan": ("toml", _text("[lifecycle]\nquarantine_budget = nan")),
    "hyperpod-int": ("toml", _text("hyperpod = 5")),
    "toml-deep": ("toml", _text("a = " + "[" * 20_000 + "]" * 20_000)),
    "toml-invalid-utf8": ("toml", _text(b'node = "\xff"')),
    "json-deep": ("json", _text("[" * DEEP + "]" * DEEP)),
    "json-NaN": ("json", _text('{"tick_s": NaN}')),
    "json-5000-digits": ("json", _text('{"metrics_port": ' + "9" * 5000 + "}")),
    "json-list": ("json", _text("[1]")),
    "json-1e999": ("json", _text('{"tick_s": 1e999}')),
    "fifo": ("toml", _fifo),
    "sparse-2MiB": ("toml", lambda p: _sparse(p, 2 * 1024 * 1024)),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_daemon_config_refuses(case, tmp_path):
    from screener.settings.daemon import DaemonConfig
    from screener.errors import ConfigError

    suffix, write = CONFIG_CASES[case]
    path = tmp_path / f"daemon.{suffix}"
    write(path)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        DaemonConfig.load(path, environ={})
    assert time.monotonic() - t0 < BOUND_S
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2 and len(msg) < 2000, msg


@pytest.mark.parametrize("var,value", [("SCREENER_DAEMON_TICK_S", "nan"),
                                       ("SCREENER_DAEMON_TICK_S", "inf"),
                                       ("SCREENER_DAEMON_IDLE_WINDOW_S", "NaN"),
                                       ("SCREENER_DAEMON_METRICS_PORT", "9" * 5000)])
def test_daemon_config_from_the_environment_refuses(var, value):
    from screener.settings.daemon import DaemonConfig
    from screener.errors import ConfigError

    with pytest.raises(ConfigError, match=var):
        DaemonConfig.load(None, environ={"NODE_NAME": "n", var: value})


def test_config_dev_zero_is_refused_not_read_forever():
    from screener.settings.daemon import read_file
    from screener.errors import ConfigError

    with pytest.raises(ConfigError, match="not a regular file"):
        read_file("/dev/zero")


# --- the kernel log ------------------------------------------------------------------------------

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."

KMSG_CASES: dict[str, bytes] = {
    "random-1MiB": os.urandom(1024 * 1024),
    "prio-5000-digits": ("9" * 5000 + ",1,1,-;" + XID + "\n").encode(),
    "seq-5000-digits": ("6," + "9" * 5000 + ",1,-;" + XID + "\n").encode(),
    "pid-5000-digits": (XID.replace("pid=1234", "pid=" + "1" * 5000) + "\n").encode(),
    "pid-unicode-digits": (XID.replace("pid=1234", "pid=²³") + "\n").encode(),
    "nul-bytes": b"\x00" * 100_000 + b"\n",
    "line-10MiB": b"a" * (10 * 1024 * 1024) + b"\n",
    "xid-code-6-digits": (XID.replace(": 79,", ": 123456,") + "\n").encode(),
    "pci-garbage": (XID.replace("0000:3b:00", "zz:zz") + "\n").encode(),
    "crlf": (XID + "\r\n") .encode() * 1000,
    "newlines-200k": b"\n" * 200_000,
    "syslog-spaces": ("Jan  1 host " + "a " * 200_000 + "\n").encode(),
    "brackets": ("[" * 200_000 + "\n").encode(),
    "pci-prefix-long": ("NVRM: Xid (PCI:" + "0" * 200_000 + "\n").encode(),
    "invalid-utf8-xid": XID.encode().replace(b"python3", b"py\xff\xfe") + b"\n",
    "kmsg-user-facility": ("14,1,1,-;" + XID + "\n").encode(),
    "name-1MiB": (XID.replace("name=python3", "name=" + "n" * (1024 * 1024)) + "\n").encode(),
    "many-xids": (XID + "\n").encode() * 5_000,
    "comma-storm": ("NVRM: Xid (PCI:0000:3b:00): 79" + ", " * 200_000 + "\n").encode(),
}


@pytest.mark.parametrize("case", sorted(KMSG_CASES) + ["no-newline-65MiB"])
def test_kernel_log_reader_survives(case, tmp_path):
    from screener.health.sources.kmsg import KernelLogReader

    path = tmp_path / "kern.log"
    if case == "no-newline-65MiB":  # one "line" longer than a whole read: skipped, not re-read
        _sparse(path, 65 * 1024 * 1024)
    else:
        path.write_bytes(KMSG_CASES[case])
    t0 = time.monotonic()
    got = KernelLogReader(str(path), state_file=str(tmp_path / "state.json")).read_new()
    assert time.monotonic() - t0 < BOUND_S
    for ev in got.events:  # whatever was an Xid carries bounded evidence
        assert len(ev.raw) <= 1024 and len(ev.text) <= 512
    # and the position was saved: a second read starts where this one stopped
    again = KernelLogReader(str(path), state_file=str(tmp_path / "state.json")).read_new()
    assert len(again.events) <= len(got.events)


@pytest.mark.parametrize("state", ["[" * DEEP, '{"kind": "file", "offset": 1e999}',
                                   '{"kind": "file", "offset": ' + "9" * 5000 + "}",
                                   '{"kind": "file", "offset": -5}', '{"kind": "file", "inode": "x"}',
                                   "[]", "\xff", "fifo"])
def test_kernel_log_state_file_garbage_starts_over(state, tmp_path):
    from screener.health.sources.kmsg import KernelLogReader

    log = tmp_path / "kern.log"
    log.write_text(XID + "\n")
    st = tmp_path / "state.json"
    if state == "fifo":
        _fifo(st)
    else:
        st.write_text(state, errors="surrogateescape")
    t0 = time.monotonic()
    got = KernelLogReader(str(log), state_file=str(st) if state != "fifo" else None).read_new()
    assert time.monotonic() - t0 < BOUND_S
    assert [e.code for e in got.events] == [79]


@pytest.mark.parametrize("kind", ["dev-zero", "dev-null", "fifo", "directory", "missing"])
def test_kernel_log_paths_that_are_not_logs_are_one_line_exit_2(kind, tmp_path, monkeypatch,
                                                                capsys):
    path = {"dev-zero": "/dev/zero", "dev-null": "/dev/null", "fifo": str(tmp_path / "f"),
            "directory": str(tmp_path), "missing": str(tmp_path / "nope")}[kind]
    if kind == "fifo":
        _fifo(Path(path))
    code, err = cli(monkeypatch, capsys, "probe", "--kmsg", path, "--json")
    one_line_refusal(code, err)


# --- checkpoints ---------------------------------------------------------------------------------

def _torch_zip(path: Path, data_pkl: bytes) -> None:
    import io

    import torch

    buf = io.BytesIO()
    torch.save([1], buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as out:
        for n in src.namelist():
            out.writestr(n, data_pkl if n.endswith("data.pkl") else src.read(n))


def _deep_pickle(n: int) -> bytes:
    return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."


class _Evil:
    def __reduce__(self):  # would run a command when unpickled without weights_only
        return (os.system, ("touch /tmp/screener-fuzz-pwned",))


def _torch_save(obj: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        import torch

        torch.save(obj, path)
    return write


def _nested_dict(depth: int) -> dict:
    import torch

    d: Any = {"w": torch.zeros(1)}
    for _ in range(depth):
        d = {"n": d}
    return d


CHECKPOINT_CASES: dict[str, Callable[[Path], None]] = {
    "nested-100k-list-zip": lambda p: _torch_zip(p, _deep_pickle(DEEP)),
    "nested-100k-raw-pickle": _text(_deep_pickle(DEEP)),
    "nested-dict-100": _torch_save(_nested_dict(100)),
    "evil-reduce-zip": lambda p: _torch_zip(p, pickle.dumps({"x": _Evil()}, protocol=2)),
    "evil-reduce-raw": _text(pickle.dumps({"x": _Evil()}, protocol=2)),
    "text": _text("not a checkpoint"),
    "empty": _text(b""),
    "pickle-header-only": _text(b"\x80\x02"),
    "random-64KiB": _text(os.urandom(65536)),
    "truncated-zip": lambda p: (_torch_save({"w": __import__("torch").zeros(100)})(p),
                                p.write_bytes(p.read_bytes()[:300])),
    "zip-of-junk": lambda p: zipfile.ZipFile(p, "w").writestr("a/data.pkl", b"junk"),
    "safetensors-huge-header": _text(struct.pack("<Q", 2**62) + b"{}"),
    "safetensors-bad-json": _text(struct.pack("<Q", 5) + b"{abc}"),
    "safetensors-bad-offsets": _text(struct.pack("<Q", 60) + json.dumps(
        {"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).ljust(60).encode()),
    "safetensors-nested": _text(struct.pack("<Q", 2 * DEEP) + ("[" * DEEP + "]" * DEEP).encode()),
    "a-plain-int": _torch_save(5),
    "a-string": _torch_save("weights"),
    "legacy-magic": _text(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + b"junk"),
    "fifo": _fifo,
    "symlink-to-dev-zero": lambda p: p.symlink_to("/dev/zero"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_fingerprint_refuses_hostile_checkpoints(case, tmp_path, monkeypatch, capsys):
    path = tmp_path / "ckpt.pt"
    CHECKPOINT_CASES[case](path)
    code, err = cli(monkeypatch, capsys, "fingerprint", str(path))
    one_line_refusal(code, err)
    assert str(path) in err
    assert not os.path.exists("/tmp/screener-fuzz-pwned")


# --- kubeconfigs ---------------------------------------------------------------------------------

_KC = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
       "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
       "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
       "users": [{"name": "u", "user": {"token": "t"}}]}


def _kc(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        import copy

        d = copy.deepcopy(_KC)
        edit(d)
        path.write_text(json.dumps(d))  # JSON is YAML
    return write


KUBECONFIG_CASES: dict[str, Callable[[Path], None]] = {
    "invalid-yaml": _text("garbage: [\n"),
    "invalid-utf8": _text(b"\xff\xfe\x00"),
    "binary": _text(os.urandom(4096)),
    "empty": _text(""),
    "null": _text("null"),
    "list": _text("[1, 2]"),
    "scalar": _text("just words"),
    "nested-100k": _text("[" * DEEP + "]" * DEEP),
    "alias-bomb": _text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}]\n" for i in range(5))),
    "clusters-int": _kc(lambda d: d.__setitem__("clusters", 5)),
    "contexts-missing": _kc(lambda d: d.pop("contexts")),
    "current-context-missing": _kc(lambda d: d.__setitem__("current-context", "nope")),
    "cluster-without-server": _kc(lambda d: d["clusters"][0]["cluster"].pop("server")),
    "server-not-a-url": _kc(lambda d: d["clusters"][0]["cluster"].__setitem__("server", "::::")),
    "ca-data-garbage": _kc(lambda d: d["clusters"][0]["cluster"].__setitem__(
        "certificate-authority-data", "!!!not base64!!!")),
    "client-cert-garbage": _kc(lambda d: d["users"][0]["user"].update(
        {"client-certificate-data": "Zm9v", "client-key-data": "YmFy"})),
    "users-not-list": _kc(lambda d: d.__setitem__("users", {"u": 1})),
    "number-5000-digits": _text("apiVersion: v1\nclusters: " + "9" * 5000 + "\n"),
    "yaml-nan": _text("apiVersion: v1\nclusters: .nan\n"),
    "fifo": _fifo,
    "sparse-64MiB": lambda p: _sparse(p, 64 * 1024 * 1024),
    "directory": lambda p: p.mkdir(),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(KUBECONFIG_CASES))
def test_kubeconfig_readers_refuse(case, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = tmp_path / "kubeconfig"
    KUBECONFIG_CASES[case](path)
    code, err = cli(monkeypatch, capsys, "node", "status", "n1", "--store", "kube",
                    "--kubeconfig", str(path))
    one_line_refusal(code, err)


# --- numbers on the command line ---------------------------------------------------------------

NUMBER_CASES: list[tuple[str, ...]] = [
    ("kat", "run", "--timeout", "nan"),
    ("kat", "run", "--timeout", "inf"),
    ("kat", "run", "--timeout", "-inf"),
    ("kat", "run", "--timeout", "-1"),
    ("kat", "run", "--timeout", "0"),
    ("kat", "run", "--timeout", "1e400"),
    ("kat", "run", "--timeout", "NaN"),
    ("kat", "run", "--timeout", " nan "),
    ("kat", "run", "--timeout", "ten"),
    ("kat", "run", "--timeout", "1e9"),
    ("kat", "run", "--repeat", "9" * 5000),
    ("kat", "run", "--repeat", "0"),
    ("golden", "record", "--timeout", "nan"),
    ("burnin", "--timeout", "nan"),
    ("burnin", "--duration", "nan"),
    ("burnin", "--duration", "9" * 400),
    ("burnin", "--duration", "-5m"),
    ("burnin", "--duration", "999999d"),
    ("burnin", "--hbm-fraction", "nan"),
    ("burnin", "--hbm-fraction", "inf"),
    ("burnin", "--iterations", "-1"),
    ("lemons", "--days", "nan"),
    ("lemons", "--days", "inf"),
    ("lemons", "--days", "0"),
    ("lemons", "--days", "-3"),
    ("lemons", "--days", "1e300"),
    ("node", "history", "n1", "--days", "nan"),
    ("probe", "--expected-gpus", "nan"),
    ("daemon", "--metrics-port", "nan"),
    ("daemon", "--metrics-port", "70000"),
    ("plan", "--checkpoint-minutes", "nan", "--mttf-hours", "10"),
    ("plan", "--checkpoint-minutes", "10", "--mttf-hours", "inf"),
    ("plan", "--checkpoint-minutes", "10", "--mttf-hours", "10", "--interval-minutes", "nan"),
]


@pytest.mark.parametrize("args", NUMBER_CASES, ids=lambda a: " ".join(a)[:60])
def test_cli_numbers_refuse(args, monkeypatch, capsys):
    code, err = cli(monkeypatch, capsys, *args)
    one_line_refusal(code, err)
