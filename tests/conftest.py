"""Shared pytest setup: GPU-marked tests skip without CUDA; tests run with one torch thread."""

from __future__ import annotations

import os
import tempfile

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
