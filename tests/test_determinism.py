"""make_deterministic pins every setting that changes result bits; preserved() undoes it."""

from __future__ import annotations

import os

import torch

from screener.determinism import make_deterministic, preserved


def test_sets_and_reports_every_knob():
    with preserved():
        torch.set_num_threads(2)
        got = make_deterministic("cpu")
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
        assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is False
        assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic
        assert torch.get_num_threads() == 1
        assert got["threads"] == 1 and got["tf32"] is False and got["deterministic_algorithms"]
        got = make_deterministic("cpu", tf32=True, threads=None)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert got["tf32"] is True and got["threads"] == 1  # threads=None leaves the count


def test_preserved_restores_the_process():
    det = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    with preserved():
        make_deterministic("cpu", tf32=not tf32, threads=max(1, threads % 2 + 1))
    assert torch.are_deterministic_algorithms_enabled() == det
    assert torch.get_num_threads() == threads
    assert torch.backends.cuda.matmul.allow_tf32 == tf32
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == env


def test_bad_thread_count():
    import pytest

    with preserved(), pytest.raises(ValueError):
        make_deterministic("cpu", threads=0)
