"""Shared pytest setup: GPU-marked tests skip without CUDA; tests run with one torch thread; a
test that leaves a thread running is named in a warning; `cpu_goldens` gives every test that
screens the CPU against goldens one folder of them, recorded at most once a session."""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test may write into the user's real state directory (the local store's default location),
# including commands run in subprocesses: point it at a throwaway directory for the whole session.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="screener-test-state-")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _threads() -> int:
    """This process's threads, native ones (gloo, torch's pools) included, less pytest-timeout's
    per-test timers (a Python thread asleep on a condition, started and cancelled around each
    test)."""
    try:
        native = len(os.listdir("/proc/self/task"))
    except OSError:
        native = threading.active_count()
    return native - sum(1 for t in threading.enumerate() if isinstance(t, threading.Timer))


@pytest.fixture(autouse=True)
def _no_thread_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Warn, naming the test, when a test ends with more threads than it began with.

    A thread left running (a server not stopped, a loop not joined) makes tests/ddp_util.py spawn
    its ranks instead of forking them, seconds slower per test, with a warning far from the test
    that caused it; here the warning names the culprit.
    """
    before = _threads()
    yield
    if _threads() > before:
        gc.collect()  # a dead process group's threads go with its last reference
        after = _threads()
        if after > before:
            names = sorted(t.name for t in threading.enumerate()
                           if t is not threading.main_thread() and not isinstance(t, threading.Timer))
            warnings.warn(f"{request.node.nodeid} left {after - before} thread(s) running "
                          f"({', '.join(names) or 'native threads'}): stop and join what it starts",
                          stacklevel=1)


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cpu_goldens(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`cpu_goldens(*jobs)`: a golden folder holding those repository jobs' goldens for this
    machine's CPU platform. The committed golden/ where it covers them (CI's CPUs); elsewhere one
    folder for the whole session, each job recorded into it once (two agreeing runs) by whichever
    test asks first, instead of a recording per test module. Read-only to the tests: a test that
    needs a broken golden copies it first."""
    from screener.known_answer import golden
    from screener.known_answer import screen as kat
    from screener.types import ExitCode

    phash = kat.local_platform("cpu").numeric_hash
    recorded: list[Path] = []  # the session's folder, made on the first recording

    def goldens(*jobs: str) -> str:
        committed = ROOT / "golden"
        if all(golden.golden_path(committed, j, phash).exists() for j in jobs):
            return str(committed)
        if not recorded:
            recorded.append(tmp_path_factory.mktemp("cpu-goldens"))
        out = recorded[0]
        missing = [j for j in jobs if not golden.golden_path(out, j, phash).exists()]
        if missing:
            specs = kat.resolve_jobs(missing, str(ROOT / "jobs"))
            rec = kat.record_goldens(specs, ["cpu"], out_dir=str(out), repeat=2)
            assert rec.exit_code == ExitCode.PASS, rec.lines()
        return str(out)

    return goldens
