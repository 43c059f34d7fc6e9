"""The README's quick start as a newcomer runs it: `screener burnin --quick` passes (exit 0) and
ends in lines that say what passed and what a full burn-in adds; a short burn-in that keeps a
node state still exits 4 and says the same; a fault is never such a pass. Real CLI processes,
real goldens (conftest.cpu_goldens), a HOME of their own (with a kubeconfig that no quick screen
may talk to) and a state folder of their own."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from screener.agent.burnin.summary import QUICK_SUMMARY, duration_flag, duration_words
from screener.known_answer.engine import golden
from screener.known_answer.engine.screen import local_platform, resolve_jobs
from screener.types import ExitCode

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REPORTS = ROOT / "docs" / "reports.md"  # the manual's page on `screener report`
JOBS = ["gemm-fp32", "train-bf16"]
OVERALL_QUICK = re.compile(r"overall: " + re.escape(QUICK_SUMMARY) + r" \(exit 0\) in \d+\.\d s")


@pytest.fixture(scope="module")
def golden_dir(cpu_goldens) -> str:
    return cpu_goldens(*JOBS)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A newcomer's environment: a HOME with a ~/.kube/config whose server refuses (every
    Kubernetes user has one; a quick screen must not touch it), no $KUBECONFIG, a fresh state
    folder."""
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "users: [{name: u, user: {token: t}}]\n")
    e = {k: v for k, v in os.environ.items()
         if k not in ("KUBECONFIG", "SCREENER_STORE", "SCREENER_DB", "NODE_NAME")}
    e.update(HOME=str(home), XDG_STATE_HOME=str(tmp_path / "state"), NODE_NAME="newcomer-1")
    return e


def _screener(args: list[str], env: dict[str, str], cwd: Path,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "screener.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def _jobs() -> list[str]:
    return [a for j in JOBS for a in ("--job", j)]


@pytest.mark.slow
def test_quick_screen_passes_and_says_what_a_full_burnin_adds(golden_dir, env, tmp_path):
    r = _screener(["burnin", "--quick", "--device", "cpu", *_jobs(), "--golden-dir", golden_dir,
                   "--no-progress"], env, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == ExitCode.PASS, out
    lines = r.stdout.rstrip("\n").splitlines()
    assert OVERALL_QUICK.fullmatch(lines[-1]), lines[-1]
    assert lines[-2].startswith("a full burn-in adds 1 h of these jobs under sustained load "
                                "(here: "), lines[-2]
    assert lines[-2].endswith("s) and, when it passes, moves this node to healthy: "
                              "screener burnin --duration 1h"), lines[-2]
    assert re.fullmatch(r"passed: health probes before and after; 2 known-answer jobs x 10 runs "
                        r"on cpu, bit for bit equal to their golden records; memory pattern test "
                        r"\(\d+\.\d\d GiB\)", lines[-3]), lines[-3]
    assert lines[-4] == "node newcomer-1: no node state kept (a quick screen)", lines[-4]
    # The per-job table above is unchanged, and nothing reads as a failure.
    assert [ln.split()[-1] for ln in lines if ln.startswith("cpu      ")] == ["pass", "pass"]
    assert not [ln for ln in lines if "partial" in ln or "inconclusive" in ln]
    # No store was opened: no local database, and the kubeconfig's refusing server never asked.
    assert not (tmp_path / "state").exists() or not list((tmp_path / "state").rglob("*.db"))
    assert "not recorded" not in r.stderr and "Kubernetes" not in r.stderr


@pytest.mark.slow
def test_quick_screen_json_and_report_say_the_same(golden_dir, env, tmp_path):
    rep = tmp_path / "quick.json"
    r = _screener(["burnin", "--quick", "--device", "cpu", "--job", "gemm-fp32", "--golden-dir",
                   golden_dir, "--no-progress", "--json", "--report", str(rep),
                   "--iterations", "2"], env, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d == json.loads(rep.read_text())
    assert d["exit_code"] == 0 and d["outcome"] == "pass" and d["summary"] == QUICK_SUMMARY
    # Honest about what it was: not a full burn-in, and why.
    assert d["burnin_kind"] == "partial" and d["state_after"] is None
    assert any(m.startswith("the known-answer jobs ran ") for m in d["missing"]), d["missing"]


@pytest.mark.slow
def test_a_fault_in_a_quick_screen_is_no_pass(golden_dir, env, tmp_path):
    r = _screener(["burnin", "--quick", "--device", "cpu", *_jobs(), "--golden-dir", golden_dir,
                   "--no-progress", "--iterations", "2",
                   "--inject", "op=mm,call=2,element=5,bit=4,job=gemm-fp32"], env, tmp_path)
    assert r.returncode == ExitCode.HARDWARE_SUSPECT, r.stdout + r.stderr
    lines = r.stdout.rstrip("\n").splitlines()
    assert re.fullmatch(r"overall: suspect \(exit 75\) in \d+\.\d s", lines[-1]), lines[-1]
    assert not [ln for ln in lines if ln.startswith(("passed:", "a full burn-in adds"))]


@pytest.mark.slow
def test_a_short_burnin_that_keeps_the_node_state_exits_4_and_says_what_passed(golden_dir, env,
                                                                               tmp_path):
    db = tmp_path / "s.db"
    r = _screener(["burnin", "--device", "cpu", *_jobs(), "--golden-dir", golden_dir,
                   "--no-progress", "--iterations", "2", "--store", "local", "--db", str(db)],
                  env, tmp_path)
    assert r.returncode == ExitCode.PARTIAL == 4, r.stdout + r.stderr
    lines = r.stdout.rstrip("\n").splitlines()
    assert lines[-1].startswith("overall: partial: node stays in burnin (missing: "), lines[-1]
    assert re.search(r"\(exit 4\) in \d+\.\d s$", lines[-1]), lines[-1]
    assert lines[-2].startswith("a full burn-in adds 1 h of these jobs"), lines[-2]
    assert lines[-2].endswith("and, when it passes, moves node newcomer-1 to healthy: "
                              "screener burnin --duration 1h"), lines[-2]
    assert lines[-3].startswith("passed: health probes before and after; 2 known-answer jobs x "
                                "2 runs on cpu, bit for bit equal to their golden records"), lines
    assert "node newcomer-1: (new) -> burnin" in r.stdout
    assert db.exists()


@pytest.mark.parametrize("extra", [["--store", "kube"], ["--store", "local"],
                                   ["--db", "x.db"], ["--kubeconfig", "kc"],
                                   ["--context", "c"], ["--duration", "10s"]])
def test_quick_refuses_what_contradicts_it(extra, env, tmp_path):
    """A quick screen keeps no node state and runs a number of iterations: asking it for a store
    or a duration is a usage error (exit 2, one line naming the option), before anything runs."""
    r = _screener(["burnin", "--quick", "--device", "cpu", *extra], env, tmp_path, timeout=60)
    assert r.returncode == ExitCode.USAGE, r.stdout + r.stderr
    assert r.stdout == ""
    assert extra[0] in r.stderr and "--quick" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_readme_quick_start_is_the_quick_screen():
    """The quick start's command is `screener burnin --quick` (exit 0 when it passes), and the
    README shows the last line a newcomer sees."""
    text = README.read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert block.strip().endswith(".venv/bin/screener burnin --quick"), block
    assert f"overall: {QUICK_SUMMARY} (exit 0)" in text.split("## Exit codes", 1)[0]


@pytest.mark.slow
def test_the_readme_quick_start_passes_on_a_covered_cpu(env, tmp_path):
    """The README's quick-start command, as written, from a folder of its own, against the
    committed goldens: exit 0 wherever they cover this CPU's platform."""
    specs = resolve_jobs(None, str(ROOT / "jobs"))  # the quick screen's, what --quick runs
    phash = local_platform("cpu").numeric_hash
    uncovered = [s.name for s in specs if golden.find(ROOT / "golden", s, phash) is None]
    if uncovered:
        pytest.skip(f"the committed goldens do not cover CPU platform {phash} "
                    f"({', '.join(uncovered)}): record them (screener golden record --device cpu)")
    text = README.read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    args = shlex.split(block.strip().rsplit(".venv/bin/screener ", 1)[1])
    r = _screener(args, env, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert OVERALL_QUICK.fullmatch(r.stdout.rstrip("\n").splitlines()[-1]), r.stdout


@pytest.mark.slow
def test_the_readme_report_line_reaches_the_report(golden_dir, env, tmp_path):
    """`screener burnin --report burnin.json; screener report burnin ...` as docs/reports.md
    writes it renders the report whatever the burn-in's exit code (4 here: a short run)."""
    line = next(ln.strip() for ln in REPORTS.read_text().splitlines()
                if "screener report burnin burnin.json" in ln)
    assert " && " not in line, line
    (Path(env["HOME"]) / ".kube" / "config").unlink()  # the node's state goes to a local store
    venv_bin = str(Path(sys.executable).parent)
    env = {**env, "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
           "SCREENER_GOLDEN_DIR": golden_dir}
    # Two jobs and two rounds instead of the default eight jobs and ten: the same stages.
    cmd = line.replace("screener burnin ", "screener burnin -n 2 --job gemm-fp32 --no-progress ",
                       1)
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "burnin.json").read_text())["exit_code"] == 4
    assert (tmp_path / "burnin.html").read_text().lstrip().lower().startswith("<!doctype html")


def test_duration_words_and_flags_read_back():
    from screener.settings.durations import parse_duration

    for s, words, flag in ((3600.0, "1 h", "1h"), (5400.0, "1.5 h", "90m"), (600.0, "10 min", "10m"),
                           (90.0, "90 s", "90s"), (7200.0, "2 h", "2h")):
        assert (duration_words(s), duration_flag(s)) == (words, flag)
        assert parse_duration(duration_flag(s)) == s


def test_the_readme_names_the_cpu_platforms_the_committed_goldens_cover():
    """The README's list of covered CPU platforms is the golden files' own: every CPU platform
    hash a committed record names (its own or in `also`) and nothing else, each with its
    dispatch level and make as the files record them."""
    text = " ".join(README.read_text().split())
    para = text.split("The committed golden records cover x86-64 CPUs", 1)[1].split(
        "On such a machine the quick start passes", 1)[0]
    named = {h: (make.strip(), level) for make, level, h in
             re.findall(r"(AMD EPYC|Intel Xeon) at (AVX2|AVX512)[^(]*\(`([0-9a-f]{16})`", para)}
    records, errors = golden.load_dir(ROOT / "golden")
    assert not errors, errors
    covered = {h: pl for r in records for h, pl in r.platforms() if pl.get("kind") == "cpu"}
    assert set(named) == set(covered), (named, sorted(covered))
    for h, (make, level) in named.items():
        pl = covered[h]
        assert pl["cpu_capability"] == level, (h, pl["cpu_capability"])
        assert pl["name"].replace("(R)", "").split()[:2] == make.split(), (h, pl["name"])
        assert pl["threads"] == 1, (h, pl["threads"])
