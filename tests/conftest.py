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
    from screener.known_answer.engine import golden
    from screener.known_answer.engine.screen import local_platform, record_goldens, resolve_jobs
    from screener.types import ExitCode

    phash = local_platform("cpu").numeric_hash
    recorded: list[Path] = []  # the session's folder, made on the first recording

    def goldens(*jobs: str) -> str:
        committed = ROOT / "golden"
        specs_all = resolve_jobs(list(jobs), str(ROOT / "jobs"))
        # a record may cover this platform in its 'also' list (bit-identical to another CPU's)
        if all(golden.find(committed, s, phash) is not None for s in specs_all):
            return str(committed)
        if not recorded:
            recorded.append(tmp_path_factory.mktemp("cpu-goldens"))
        out = recorded[0]
        missing = [j for j in jobs if not golden.golden_path(out, j, phash).exists()]
        if missing:
            specs = resolve_jobs(missing, str(ROOT / "jobs"))
            rec = record_goldens(specs, ["cpu"], out_dir=str(out), repeat=2)
            assert rec.exit_code == ExitCode.PASS, rec.lines()
        return str(out)

    return goldens


# --- a test that runs too long fails alone (issue 35.3) -----------------------------------------
# pytest-timeout's signal method (pyproject.toml) fails the test that ran past its budget and goes
# on, so the run still ends in its summary line; its thread method ended the whole run instead
# (22 minutes of results lost to one slow spawned group on a loaded machine). The signal's handler
# runs only when the main thread is back in Python, and a test can be stuck in native code waiting
# for the processes it spawned (a gloo join on a rank that hangs). This watchdog kills the
# processes the test started, once it is WATCHDOG_GRACE_S past its budget, so that the wait
# returns and the timeout fails that test; if even that does not free it, it ends the run as the
# thread method would, with every thread's stack, rather than hang until CI's own limit.
WATCHDOG_GRACE_S = float(os.environ.get("SCREENER_TEST_WATCHDOG_GRACE_S") or 30.0)


def _test_budget(request: pytest.FixtureRequest) -> float:
    marker = request.node.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    given = request.config.getoption("timeout", None)
    return float(given if given is not None else (request.config.getini("timeout") or 0))


def _kill_new_children(before: set[tuple[int, float]]) -> list[int]:
    """SIGKILL this process's descendants that were not there when the test began."""
    import psutil

    killed = []
    for child in psutil.Process().children(recursive=True):
        try:
            if (child.pid, child.create_time()) not in before:
                child.kill()
                killed.append(child.pid)
        except psutil.Error:
            pass  # gone already
    return killed


def _children() -> set[tuple[int, float]]:
    import psutil

    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            out.add((child.pid, child.create_time()))
        except psutil.Error:
            pass
    return out


@pytest.fixture(autouse=True)
def _watchdog(request: pytest.FixtureRequest) -> Iterator[None]:
    budget = _test_budget(request)
    if budget <= 0:
        yield
        return
    before = _children()
    nodeid = request.node.nodeid

    def last_resort() -> None:
        import faulthandler
        import sys

        sys.stderr.write(f"\n{nodeid}: still stuck after its processes were killed; ending "
                         "the run\n")
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    def fire() -> None:
        killed = _kill_new_children(before)
        import sys

        sys.stderr.write(f"\n{nodeid}: {budget + WATCHDOG_GRACE_S:.0f} s past its start and "
                         f"not back in Python: killed the processes it started {killed}\n")
        again = threading.Timer(WATCHDOG_GRACE_S, last_resort)
        again.daemon = True
        timers.append(again)
        again.start()

    timers = [threading.Timer(budget + WATCHDOG_GRACE_S, fire)]
    timers[0].daemon = True
    timers[0].start()
    try:
        yield
    finally:
        for t in timers:
            t.cancel()
            t.join()  # gone before the thread count of _no_thread_left_behind
