"""The compiled CPU kernel and the Triton kernel give the plain definition's fingerprints bit for bit.

The native kernel is what fingerprints() runs on the CPU wherever the package was installed with a C
compiler (CI: `pip install -e '.[test]'`), so its absence is a failure here, not a skip. The Triton
kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1) in a subprocess, over the same cases.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import screener.fingerprint as fp_mod
from screener.fingerprint import backend, fingerprints
from screener.kernels import cpu as native

ROOT = pathlib.Path(__file__).resolve().parents[1]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.uint16,
          torch.uint32, torch.uint64, torch.complex32, torch.complex64, torch.bits8, torch.bits16]


def definition(t: torch.Tensor) -> tuple[int, int]:
    """The plain definition in torch int64 arithmetic (wrapping = modulo 2**64): fast enough for
    the large cases; test_fingerprint.py checks the same against pure Python integers."""
    v = t.detach().contiguous().reshape(-1).view(INT_VIEW[t.element_size()]).to(torch.int64)
    pos = torch.arange(1, v.numel() + 1, dtype=torch.int64)
    return int(v.sum()), int((v * pos).sum())


def random_bits(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def kernel() -> native.CpuKernel:
    k, why = native.load()
    assert k is not None, f"the native fingerprint kernel is not available: {why}"
    return k


def run_kernel(tensors: list[torch.Tensor], threads: int, piece_bytes: int,
               parallel_min_bytes: int = 0) -> list[tuple[int, int]]:
    """The C kernel called directly, with work split and thread count chosen by the test."""
    desc = array("q")
    for t in tensors:
        desc.extend((t.data_ptr(), t.numel(), t.element_size()))
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    kernel().run(desc, out.data_ptr(), threads, piece_bytes, parallel_min_bytes)
    return [tuple(r) for r in out.tolist()]


def test_native_kernel_is_built_and_is_the_cpu_backend(monkeypatch):
    assert kernel().path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert backend("cpu") == "native", fp_mod.native_unavailable_reason()
    assert fp_mod.native_unavailable_reason() is None
    # The reference path on request, with the same results.
    t = random_bits(5000, torch.float32, 1)
    monkeypatch.setenv(fp_mod.BACKEND_ENV, "torch")
    assert backend("cpu") == "torch"
    assert tuple(fingerprints([t])[0].tolist()) == definition(t)


# Sizes around every boundary of the kernel: its 16 lanes, the 4096-element block of the 32-bit lanes,
# and the pieces the threads share.
SIZES = [0, 1, 2, 15, 16, 17, 255, 4095, 4096, 4097, 8191, 3 * 4096 + 17, 65536 + 5, 300_001]


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_every_size_class_across_lane_block_and_piece_boundaries(size):
    dtype = INT_VIEW[size]
    tensors = [random_bits(n, dtype, seed=n * 8 + size) for n in SIZES]
    want = [definition(t) for t in tensors]
    for threads, piece in [(1, 1 << 20), (2, 4096), (3, 12_345), (8, 1)]:
        assert run_kernel(tensors, threads, piece) == want, (threads, piece)
    assert [tuple(r) for r in fingerprints(tensors).tolist()] == want


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_every_kernel_set_this_cpu_runs_matches_the_definition(size):
    # A CPU runs one set (AVX-512, else AVX2, else the portable vector extensions); each set is
    # checked on every machine that can run it, so an AVX-512 machine also checks the AVX2 and
    # portable kernels that other nodes run, and the sets cannot drift apart.
    dtype = INT_VIEW[size]
    cases = [random_bits(n, dtype, seed=n + size) for n in SIZES]
    cases += [torch.full((5 * 4096 + 3,), v, dtype=dtype) for v in
              ((0, 255) if size == 1 else (-(1 << (8 * size - 1)), (1 << (8 * size - 1)) - 1))]
    sets = kernel().runnable() + ["native"]
    assert sets[0] == "generic"
    for t in cases:
        want = definition(t)
        for kernels in sets:
            assert kernel().sums(t.data_ptr(), t.numel(), size, kernels) == want, (kernels, t.numel())


def test_the_kernel_set_a_cpu_runs_is_the_widest_it_has():
    # The choice follows the CPU's flags: the widest set it can run, and a set it cannot is refused
    # in one line rather than run (an AVX-512 instruction on an AVX2 CPU is SIGILL).
    k = kernel()
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    want = ("avx512" if "avx512f" in flags and "avx512bw" in flags else
            "avx2" if "avx2" in flags else "generic")
    if os.uname().machine != "x86_64":
        want = "generic"
    assert k.isa == want
    assert k.runnable()[-1] == want
    for missing in set(native.KERNEL_SETS) - set(k.runnable()) - {"native"}:
        with pytest.raises(ValueError, match=f"cannot run the {missing} kernels"):
            k.sums(0, 0, 1, missing)


@pytest.mark.parametrize("dtype,values", [
    (torch.int16, [-32768]), (torch.int16, [32767]), (torch.uint8, [255]), (torch.int32, [-2**31]),
    (torch.int32, [2**31 - 1]), (torch.int64, [-2**63]), (torch.int64, [2**63 - 1]),
    (torch.int16, [-32768, 32767]),
])
def test_extreme_values_in_long_runs_do_not_overflow_the_lanes(dtype, values):
    # The 32-bit lanes are flushed every 4096 elements because |t| <= 2**15 * 256 * 257 / 2 < 2**31
    # only holds that long: runs of the extreme values are the worst case of that bound.
    n = 5 * 4096 + 7
    t = torch.tensor(values, dtype=dtype).repeat(math.ceil(n / len(values)))[:n]
    assert run_kernel([t], 1, 1 << 20) == [definition(t)]
    assert tuple(fingerprints([t])[0].tolist()) == definition(t)


def test_bytes_past_the_flush_of_the_x86_byte_kernels():
    # The x86 byte kernels flush their 32-bit weighted lanes every 2**16 rows (of 32 bytes for AVX2,
    # 2 MiB; of 64 for AVX-512, 4 MiB): runs of 255 (the largest byte) past that, on one thread.
    for t in (torch.full(((9 << 20) + 13,), 255, dtype=torch.uint8), random_bits((9 << 20) + 31, torch.uint8, 7)):
        want = definition(t)
        for kernels in kernel().runnable():
            assert kernel().sums(t.data_ptr(), t.numel(), 1, kernels) == want, kernels
        assert run_kernel([t], 1, 1 << 30) == [want]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_nan_inf_and_signed_zero_bit_patterns(dtype):
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0, -1.0]
    base = torch.tensor(specials, dtype=torch.float32).to(dtype)
    bits = base.view(INT_VIEW[dtype.itemsize]).clone()
    # A NaN with a different payload and the negative NaN: raw patterns, not values, are summed.
    if dtype.itemsize >= 2:
        bits[0] = bits[0] | 1
    t = torch.cat([bits, -bits, bits.flip(0)]).repeat(700).view(dtype)
    got = fingerprints([t, t[::3], t[:0]])
    assert [tuple(r) for r in got.tolist()] == [definition(t), definition(t[::3]), (0, 0)]
    # -0.0 and +0.0 compare equal as values; their fingerprints differ.
    pos, neg = torch.zeros(3, dtype=dtype), torch.full((3,), -0.0, dtype=dtype)
    assert bool((pos == neg).all()) and fingerprints([pos])[0].tolist() != fingerprints([neg])[0].tolist()


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 700), st.integers(0, 3)),
                      min_size=1, max_size=60),
       threads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31 - 1))
def test_many_small_tensors_in_one_call_any_mix(specs, threads, seed):
    """Mixed dtypes and sizes, None, non-contiguous and conj/neg views, all in one call."""
    tensors = []
    for i, (dtype, n, kind) in enumerate(specs):
        t = random_bits(n + 4, dtype, seed + i)
        if kind == 1:
            t = t[1::2]  # strided
        elif kind == 2:
            t = t[:n].reshape(-1, 1).expand(-1, 2).t()  # stride 0, transposed
        elif kind == 3 and n % 3 == 0:
            t = None
        tensors.append(t)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = fingerprints(tensors).tolist()
    finally:
        torch.set_num_threads(before)
    want = [(0, 0) if t is None else definition(t) for t in tensors]
    assert [tuple(r) for r in got] == want


def test_conj_and_neg_views_are_read_as_their_logical_values():
    z = random_bits(999, torch.complex64, 3)
    conj = z.conj()  # a view with the conjugate bit: memory holds z, the logical value is conj(z)
    neg_view = conj.imag  # a real view with the negative bit
    assert conj.is_conj() and neg_view.is_neg()
    got = fingerprints([conj, neg_view]).tolist()
    assert [tuple(r) for r in got] == [definition(conj.resolve_conj()),
                                       definition(neg_view.resolve_neg())]


def test_ten_thousand_small_tensors_two_threads_match():
    g = torch.Generator().manual_seed(5)
    sizes = torch.randint(256, 1025, (10_000,), generator=g).tolist()
    tensors = [torch.randn(n, generator=g) for n in sizes]
    flat = torch.cat(tensors)
    want_total = int(flat.view(torch.int32).to(torch.int64).sum())
    for threads in (1, 2):
        got = run_kernel(tensors, threads, 1 << 16)
        assert sum(s for s, _ in got) % 2**64 == want_total % 2**64
        assert got[::997] == [definition(t) for t in tensors[::997]]


def test_large_tensor_with_threads_matches_single_thread():
    t = random_bits(3 * (1 << 20) + 11, torch.bfloat16, 9)  # ~6 MiB: above the parallel threshold
    want = definition(t)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert tuple(fingerprints([t])[0].tolist()) == want
    finally:
        torch.set_num_threads(before)
    assert run_kernel([t], 4, 1 << 16) == [want]


def test_concurrent_calls_from_many_threads_agree():
    # DDP comm hooks call fingerprints from autograd's threads: calls must not share state.
    tensors = [random_bits(n, torch.bfloat16, n) for n in (5, 4096 * 3 + 1, 1 << 21)]
    want = [definition(t) for t in tensors]
    results = []
    def work():
        for _ in range(5):
            results.append([tuple(r) for r in fingerprints(tensors).tolist()])
    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 20 and all(r == want for r in results)


@pytest.mark.slow
def test_without_the_built_kernel_the_torch_path_runs(tmp_path):
    # A copy of the package without the compiled library, as after an install without a compiler.
    shutil.copytree(ROOT / "screener", tmp_path / "screener",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    code = ("import torch, screener.fingerprint as f\n"
            "t = torch.arange(-5000, 5000, dtype=torch.int16)\n"
            "print(f.backend('cpu'), '|', f.native_unavailable_reason(), '|', f.fingerprint(t))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", fp_mod.BACKEND_ENV)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=dict(env, PYTHONPATH=str(tmp_path)), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, why, row = proc.stdout.strip().split(" | ")
    t = torch.arange(-5000, 5000, dtype=torch.int16)
    assert name == "torch" and "not built" in why and row == str(definition(t))


def test_bad_descriptor_is_refused_without_touching_the_output():
    desc = array("q", [0, 4, 3])  # element size 3
    out = torch.full((1, 2), 7, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="code -2"):
        kernel().run(desc, out.data_ptr(), 1)
    assert out.tolist() == [[7, 7]]


# The Triton kernels in the interpreter: the same cases, each checked against the definition.
_TRITON_SCRIPT = textwrap.dedent("""
    import math, torch
    from screener.kernels import triton_fp
    from screener.fingerprint import _flat_bits, _check_dtype, _INT_VIEW
    assert triton_fp.interpreting()
    DTYPES = {dtypes}
    def definition(t):
        v = t.contiguous().reshape(-1).view(_INT_VIEW[t.element_size()]).to(torch.int64)
        return int(v.sum()), int((v * torch.arange(1, v.numel() + 1)).sum())
    def rand(n, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    cases = []
    for i, dtype in enumerate(DTYPES):  # every dtype, odd sizes, views, empty
        for n in (0, 1, 7, 1023, 1025, 3001):
            cases.append(rand(n, dtype, 100 * i + n))
        cases.append(rand(64, dtype, i)[1::3])
        cases.append(rand(30, dtype, i).reshape(5, 6).t())
    for size, dt in ((1, torch.uint8), (2, torch.bfloat16), (4, torch.float32), (8, torch.float64)):
        cases.append(rand(triton_fp.LARGE + 12345, dt, size))  # large path, ragged last block
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0], dtype=torch.float32)
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        cases.append(specials.to(dt).repeat(300))
    cases.append(torch.full((5000,), -32768, dtype=torch.int16))
    cases.append(torch.full((triton_fp.LARGE + 1,), -2**63, dtype=torch.int64))
    bits = [_flat_bits(t, _check_dtype(t)).view(_INT_VIEW[t.element_size()]) for t in cases]
    got = triton_fp.fingerprints(bits).tolist()
    want = [definition(t) for t in cases]
    bad = [(str(c.dtype), c.numel()) for c, g, w in zip(cases, got, want) if tuple(g) != w]
    assert not bad, bad
    print("ok", len(cases))
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (the [test] extra installs it on Linux x86-64)")
def test_triton_kernels_match_the_definition_in_the_interpreter():
    names = [str(d).removeprefix("torch.") for d in DTYPES]
    script = _TRITON_SCRIPT.replace("{dtypes}", "[" + ", ".join(f"torch.{n}" for n in names) + "]")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok"), proc.stdout
