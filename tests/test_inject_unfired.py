"""An --inject fault that never fires (issue 35.4, item 4): `kat run` exits 2, its printed verdict
says so (it said "pass (exit 0)"), and the warning names the fault as it was given (it added a
`step=0` nobody gave)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cli_util import screener
from screener.commands._known_answer import unfired_warnings
from screener.known_answer.engine.fault_spec import parse_fault


def unfired(*specs: str, device: str = "cpu") -> SimpleNamespace:
    """A screen's result as unfired_warnings reads it: the faults its child never fired."""
    return SimpleNamespace(unfired_faults={device: [parse_fault(s)[1].to_dict() for s in specs]})


def test_the_warning_names_only_what_was_given():
    given = ["device=cpu,op=mm,call=3000", "op=mm,call=9,step=0,bit=3"]
    lines = unfired_warnings(unfired("op=mm,call=3000", "op=mm,call=9,step=0,bit=3"), given)
    assert lines == ["cpu: 2 injected fault(s) never fired (the job never reached them): "
                     "op=mm,call=3000; op=mm,call=9,step=0,bit=3"]
    # A fault no --inject text matches (a drill's) shows its fields that differ from the defaults.
    assert unfired_warnings(unfired("op=mm,call=3000"), ()) == [
        "cpu: 1 injected fault(s) never fired (the job never reached them): op=mm,call=3000"]
    assert unfired_warnings(None, given) == []


@pytest.mark.slow
def test_kat_run_with_a_fault_that_never_fires_prints_what_it_exits(cpu_goldens):
    args = ("kat", "run", "-j", "gemm-fp32", "-r", "1", "--golden-dir", cpu_goldens("gemm-fp32"),
            "--inject", "device=cpu,op=mm,call=3000")
    r = screener(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("not a test (exit 2): injected fault(s) never fired"), r.stdout
    assert "(exit 0)" not in r.stdout, r.stdout
    warning = [line for line in r.stderr.splitlines() if "never fired" in line]
    assert warning == ["screener: warning: cpu: 1 injected fault(s) never fired (the job never "
                       "reached them): op=mm,call=3000"], r.stderr
    r = screener(*args, "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2, r.stdout


@pytest.mark.slow
def test_burnin_with_a_fault_that_never_fires_prints_what_it_exits(tmp_path, cpu_goldens):
    """The table's last line said "(exit 4)" above an exit 2 (issue 35 item 4, for burnin)."""
    args = ("burnin", "--quick", "-n", "1", "--no-hbm", "--no-collective", "--no-probes",
            "--golden-dir", cpu_goldens("gemm-fp32"), "-j", "gemm-fp32",
            "--inject", "device=cpu,op=mm,call=3000")
    r = screener(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("not a test (exit 2): injected fault(s) never fired"), r.stdout
    assert "(exit 0)" not in r.stdout and "(exit 4)" not in r.stdout, r.stdout
    r = screener(*args, "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2, r.stdout
