"""`screener preflight` with only sibling goldens (issue 35.4, item 7): goldens of this job exist
for sibling platforms (same torch build and dispatch level) and differ, none for this one. It
said "no golden record to compare with on this platform" and gave no record command; it now says
they exist and differ and prints the command `kat run` prints."""

from __future__ import annotations

import dataclasses
from pathlib import Path
import json

import pytest

from cli_util import screener
from screener.known_answer.engine import golden
from screener.known_answer.engine.screen import local_platform, resolve_jobs
from screener.known_answer.verdict.results import Step

SIBLING_HASH = "0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


def sibling_only(cpu_goldens, out) -> None:
    """This platform's gemm-fp32 golden as a sibling platform's (another hash, 2 threads) whose
    bits differ in one fingerprint: the folder then has no golden of this platform."""
    phash = local_platform("cpu").numeric_hash
    folder = cpu_goldens("gemm-fp32")
    # this platform's golden: its own file, or an entry in another CPU's record whose bits agree
    mine = golden.find(folder, resolve_jobs(["gemm-fp32"], str(ROOT / "jobs"))[0], phash)
    assert mine is not None, folder
    platform = dict(next(pl for h, pl in mine.platforms() if h == phash))
    first = mine.steps[0]
    (name, (a, b)), *rest = first.tensors
    flipped = Step(first.step, first.label, first.loss, ((name, (a ^ 1, b)), *rest))
    golden.write(dataclasses.replace(mine, platform={**platform, "threads": 2},
                                     platform_hash=SIBLING_HASH, also=(),
                                     steps=(flipped, *mine.steps[1:])), out)


@pytest.mark.slow
def test_preflight_with_only_sibling_goldens_says_so_and_prints_the_record_command(
        cpu_goldens, tmp_path):
    sibling_only(cpu_goldens, tmp_path)
    args = ("preflight", "--golden-dir", str(tmp_path), "-j", "gemm-fp32", "--fast-window", "0")
    r = screener(*args)
    assert r.returncode == 3, r.stdout + r.stderr
    command = f"screener golden record --job gemm-fp32 --device cpu --out {tmp_path}"
    assert f"  record a golden: {command}" in r.stdout.splitlines(), r.stdout
    warning = [line for line in r.stderr.splitlines() if "inconclusive" in line]
    assert len(warning) == 1, r.stderr
    assert "golden records of sibling platforms exist but differ" in warning[0], warning
    assert "no golden record to compare with" not in warning[0] and command in warning[0]
    doc = json.loads(screener(*args, "--json").stdout)
    assert doc["screen"]["verdicts"][0]["reason"] == "sibling_golden_differs", doc
