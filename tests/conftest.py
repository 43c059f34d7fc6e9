"""Shared pytest setup: GPU-marked tests skip without CUDA; tests run with one torch thread; a
test that leaves a thread running is named in a warning."""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import warnings
from typing import Iterator

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
