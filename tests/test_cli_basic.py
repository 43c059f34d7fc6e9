"""The foundation's commands through the console entry point: output, JSON and exit codes.

Most run in this process (cli_util.screener); the real process is run where only it can show
something: the installed entry point's --version and --help, and a bad device's one line on a
real stderr with no traceback."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch

from cli_util import screener
from screener.known_answer.engine.platform import signature


def screener_process(*args):
    return subprocess.run([sys.executable, "-m", "screener.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    g = torch.Generator().manual_seed(0)
    sd = {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.zeros(4, dtype=torch.bfloat16)},
          "step": 7, "layers": [torch.arange(5)]}
    torch.save(sd, d / "a.pt")
    sd["model"]["w"].view(torch.int32)[3, 1] ^= 1  # one low mantissa bit
    del sd["layers"]
    sd["extra"] = torch.ones(2)
    torch.save(sd, d / "b.pt")
    from safetensors.torch import save_file
    save_file({"model.w": torch.load(d / "a.pt")["model"]["w"]}, str(d / "c.safetensors"))

    class Evil:
        def __reduce__(self):
            return (print, ("executed",))
    torch.save({"x": Evil()}, d / "evil.pt")
    with open(d / "evil.pkl", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    (d / "junk.pt").write_text("not a checkpoint")
    return d


def test_version_and_help():
    r = screener_process("--version")
    assert r.returncode == 0 and "screener" in r.stdout
    r = screener_process("--help")
    assert r.returncode == 0 and "Exit codes" in r.stdout and "75" in r.stdout
    for cmd in ("platform", "fingerprint", "report"):
        r = screener(cmd, "--help")
        assert r.returncode == 0 and "Usage" in r.stdout


def test_platform_json_matches_the_library():
    r = screener("platform", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kind"] == "cpu" and len(d["numeric_hash"]) == 16
    assert d["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_platform_hash_ignores_identity_but_not_numeric_fields():
    from dataclasses import replace
    p = signature("cpu")
    assert replace(p, hostname="other", serial="123", uuid="GPU-x").numeric_hash == p.numeric_hash
    assert replace(p, threads=(p.threads or 1) + 1).numeric_hash != p.numeric_hash
    assert replace(p, torch_version="0.0").numeric_hash != p.numeric_hash
    assert signature("cpu").numeric_hash == p.numeric_hash  # stable


@pytest.mark.slow
def test_platform_bad_device_is_exit_2_one_line():
    for dev in ("cuda:7" if not torch.cuda.is_available() else "cuda:99", "tpu:0", "banana"):
        r = screener("platform", "--device", dev)
        assert r.returncode == 2, (dev, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = screener_process("platform", "--device", "banana")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_fingerprint_one_checkpoint(checkpoints):
    r = screener("fingerprint", str(checkpoints / "a.pt"), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d["tensors"]) == {"model.w", "model.b", "layers.0"}
    from screener.fingerprint import fingerprint
    w = torch.load(checkpoints / "a.pt")["model"]["w"]
    assert (d["tensors"]["model.w"]["sum"], d["tensors"]["model.w"]["weighted"]) == fingerprint(w)
    r = screener("fingerprint", str(checkpoints / "c.safetensors"))
    assert r.returncode == 0 and "model.w" in r.stdout


def test_fingerprint_compare(checkpoints):
    r = screener("fingerprint", str(checkpoints / "a.pt"), str(checkpoints / "a.pt"))
    assert r.returncode == 0 and "bit-identical" in r.stdout
    r = screener("fingerprint", str(checkpoints / "a.pt"), str(checkpoints / "b.pt"), "--json")
    assert r.returncode == 75, r.stderr
    d = json.loads(r.stdout)
    assert d == {"equal": False, "differ": ["model.w"], "only_in_first": ["layers.0"],
                 "only_in_second": ["extra"], "compared": 2}


@pytest.mark.parametrize("name,needle", [("missing.pt", "no such file"),
                                         ("junk.pt", "not a PyTorch checkpoint"),
                                         ("evil.pt", "arbitrary code"),
                                         ("evil.pkl", "without running code")])
def test_fingerprint_bad_files_are_one_line_exit_2(checkpoints, name, needle):
    r = screener("fingerprint", str(checkpoints / name))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and name in lines[0], r.stderr
    assert "executed" not in r.stdout


def test_read_only_store_commands_refuse_a_missing_database_and_create_nothing(tmp_path):
    # A misspelt --db used to open a fresh, empty database: an empty fleet reads as "all clear".
    from click.testing import CliRunner

    from screener.cli import main

    missing = tmp_path / "nowhere" / "state.db"
    runner = CliRunner()
    for args in (["node", "status"], ["node", "history", "n1"], ["lemons"],
                 ["report", "fleet", "-o", str(tmp_path / "r.html")]):
        r = runner.invoke(main, [*args, "--store", "local", "--db", str(missing)])
        assert r.exit_code == 2, (args, r.output)
        assert "no state database there" in r.output and "Traceback" not in r.output
        assert not missing.parent.exists(), args
    # A person's decision may start a database; the readers then see it.
    r = runner.invoke(main, ["node", "set", "n1", "burnin", "--reason", "new rack", "--store",
                             "local", "--db", str(missing)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["node", "status", "--json", "--store", "local", "--db", str(missing)])
    assert r.exit_code == 0 and "burnin" in r.output
