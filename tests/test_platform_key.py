"""The platform key: exactly what changes the bits, nothing cosmetic; sibling platforms; and
`screener platform` shows the key the goldens and the screening children use."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from screener.known_answer.engine import golden
from screener.known_answer.engine import protocol
from screener.known_answer.engine.screen import local_platform
from screener.known_answer.engine.platform import Platform, cpu_math_paths, sibling_key, signature

ROOT = Path(__file__).resolve().parents[1]


def _cpu() -> Platform:
    return Platform(device="cpu", kind="cpu", name="AMD EPYC", cpu_capability="AVX2",
                    cpu_flags=("avx", "avx2", "fma"),
                    blas="mkl 2024.0 Intel Architecture processors",
                    onednn="onednn 3.12.0 Intel AVX2", threads=1, memory_bytes=1 << 34,
                    torch_version="2.13.0+cpu", torch_build="cf30153c4c13", hostname="a")


def test_a_cpu_key_covers_what_changes_bits_and_nothing_cosmetic():
    p = _cpu()
    cosmetic = [dict(name="Intel Xeon"), dict(cpu_flags=("avx", "avx2", "avx512f", "amx_tile")),
                dict(hostname="b"), dict(memory_bytes=1 << 30), dict(serial="x"), dict(uuid="y")]
    for change in cosmetic:
        assert replace(p, **change).numeric_hash == p.numeric_hash, change
    numeric = [dict(cpu_capability="AVX512"), dict(threads=2), dict(torch_version="2.12.0+cpu"),
               dict(torch_build="0123456789ab"), dict(onednn="onednn 3.12.0 Intel AVX-512"),
               dict(blas="mkl 2024.0 Intel AVX-512 enabled processors")]
    for change in numeric:
        assert replace(p, **change).numeric_hash != p.numeric_hash, change


def test_a_gpu_key_covers_model_sms_driver_and_libraries_not_identity():
    g = Platform(device="cuda:0", kind="cuda", name="NVIDIA H100 80GB HBM3",
                 compute_capability="9.0",
                 sm_count=132, driver_version="550.54", cuda_version="12.4", cublas_version="12.4",
                 cudnn_version="90100", uuid="GPU-1", serial="1", torch_version="2.13.0+cu124")
    for change in (dict(uuid="GPU-2"), dict(serial="2"), dict(hostname="n2"),
                   dict(memory_bytes=1), dict(device="cuda:3")):
        assert replace(g, **change).numeric_hash == g.numeric_hash, change
    for change in (dict(sm_count=114), dict(name="NVIDIA H200"), dict(driver_version="560.1"),
                   dict(cuda_version="12.6"), dict(cublas_version="12.6"), dict(cudnn_version="9")):
        assert replace(g, **change).numeric_hash != g.numeric_hash, change
    assert sibling_key(g) == sibling_key(replace(g, driver_version="560.1"))
    assert sibling_key(g) != sibling_key(replace(g, sm_count=114))


def test_siblings_share_torch_and_dispatch_level():
    p = _cpu()
    assert sibling_key(p) == sibling_key(replace(p, threads=4, blas="mkl other", onednn="x"))
    assert sibling_key(p) != sibling_key(replace(p, cpu_capability="AVX512"))
    assert sibling_key(p) != sibling_key(replace(p, torch_version="2.12.0+cpu"))
    # an old golden's stored signature (schema 1, before blas/onednn were recorded) still has one
    records, _ = golden.load_dir(ROOT / "golden")
    assert all(sibling_key(dict(r.platform)) is not None for r in records)
    assert sibling_key({"kind": "cpu"}) is None


def test_the_math_paths_come_from_the_libraries_torch_uses():
    blas, onednn = cpu_math_paths()
    if torch.backends.mkl.is_available():
        assert blas.startswith("mkl ") and not blas.endswith("unknown"), blas
    if torch.backends.mkldnn.is_available():
        assert onednn.startswith("onednn ") and not onednn.endswith("unknown"), onednn
    p = signature("cpu")
    assert (p.blas, p.onednn) == (blas, onednn) and p.name and p.cpu_capability


@pytest.mark.slow
def test_screener_platform_shows_the_key_the_goldens_use():
    r = subprocess.run([sys.executable, "-m", "screener.cli", "platform", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["threads"] == protocol.DEFAULT_THREADS  # pinned, as in a screening child
    assert d["numeric_hash"] == local_platform("cpu").numeric_hash
    assert "\nMKL_VERBOSE" not in r.stdout and "onednn_verbose" not in r.stdout
