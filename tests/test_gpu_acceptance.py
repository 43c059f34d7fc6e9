"""benchmarks/gpu_acceptance.sh, the first-GPU acceptance run, checked where no GPU is: it parses,
its dry run names every step, the screener flags it passes exist, and without CUDA it stops at once
saying so (rather than recording a table of failures)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.sh"
STEPS = ("gpu-tests", "golden-record", "quick-screen", "preflight", "fp-bandwidth", "audit-nccl")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_the_dry_run_lists_every_step_and_runs_nothing():
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines()[1:] if line and line[0] != "("]
    for step in STEPS:
        assert step in listed
    assert "one table" in r.stdout


def test_every_screener_flag_it_passes_is_one_the_cli_takes():
    """A renamed CLI option must fail here, not on the day a GPU is lent."""
    r = _run("--dry-run")
    commands = [re.search(r"\(limit \d+s\)\s+(.*)", line).group(1)  # type: ignore[union-attr]
                for line in r.stdout.splitlines() if " screener.cli " in line]
    assert len(commands) == 3  # golden record, kat run, preflight
    for command in commands:
        words = shlex.split(command.replace("<a new temp folder>", "TMP"))
        sub = words[words.index("screener.cli") + 1:]
        path = [w for w in sub if not w.startswith("-")][:2 if sub[0] in ("golden", "kat") else 1]
        helptext = subprocess.run([sys.executable, "-m", "screener.cli", *path, "--help"],
                                  capture_output=True, text=True, timeout=60).stdout
        for flag in re.findall(r"(?<!\S)--[a-z][a-z-]*", " ".join(sub)):
            assert flag in helptext, f"{' '.join(path)} has no {flag}"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_without_cuda_it_stops_at_once_and_says_why():
    r = _run()
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr and "step" not in r.stdout
