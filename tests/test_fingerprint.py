"""Fingerprints are bit-identical to the plain definition for every dtype, shape and stride, on
the path fingerprints() takes here (the compiled kernel, see test_fingerprint_kernels.py) and on the
pure-torch reference path."""

from __future__ import annotations

import hashlib
import re
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import screener.fingerprint as fp_mod
from screener.fingerprint import (UnsupportedDtypeError, digest, fingerprint, fingerprints,
                                  module_fingerprints)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MASK = (1 << 64) - 1

# fingerprints() as called (the native kernel where built) and the pure-torch reference path.
IMPLS = {"default": fingerprints, "torch": fp_mod._torch_fingerprints}


def reference(t):
    """The definition, in Python integers: no torch arithmetic at all."""
    if t is None:
        return (0, 0)
    values = t.detach().contiguous().reshape(-1).view(_INT_VIEW[t.element_size()]).tolist()
    s = sum(int(v) for v in values) & MASK
    w = sum((i + 1) * int(v) for i, v in enumerate(values)) & MASK
    signed = lambda x: x - (1 << 64) if x >= 1 << 63 else x  # noqa: E731
    return signed(s), signed(w)


DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.uint16, torch.uint32, torch.uint64,
          torch.complex64]


def random_bits(shape, dtype, seed):
    """A tensor of `dtype` whose bit patterns are uniformly random (NaNs and all)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES),
       shape=st.lists(st.integers(0, 7), min_size=0, max_size=4),
       seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_matches_definition_for_any_dtype_shape_and_view(impl, dtype, shape, seed, data):
    base = random_bits(tuple(s + 2 for s in shape), dtype, seed)
    # A non-contiguous view: a slice with a step, then a permutation of the dimensions.
    index = tuple(slice(data.draw(st.integers(0, 1)), None, data.draw(st.integers(1, 2)))
                  for _ in shape)
    view = base[index]
    if view.dim() > 1:
        perm = data.draw(st.permutations(list(range(view.dim()))))
        view = view.permute(*perm)
    got = IMPLS[impl]([view, None, base])
    assert got.dtype == torch.int64 and got.shape == (3, 2) and got.device.type == "cpu"
    assert tuple(got[0].tolist()) == reference(view)
    assert tuple(got[1].tolist()) == (0, 0)
    assert tuple(got[2].tolist()) == reference(base)


@pytest.mark.parametrize("dtype", [torch.uint8, *(pytest.param(d, marks=pytest.mark.slow) for d in
                                                 (torch.bfloat16, torch.float32, torch.float64))])
def test_larger_than_any_internal_chunk(dtype):
    # Several chunks plus a ragged tail, so chunk offsets and padding are exercised.
    size = torch.empty(0, dtype=dtype).element_size()
    _, _, _, rows, cols = fp_mod._PLANS[size]
    n = rows * cols * fp_mod._CHUNK_BLOCKS * 2 + 12345
    t = random_bits((n,), dtype, seed=n)
    want = reference(t)
    for name, impl in IMPLS.items():
        assert tuple(impl([t])[0].tolist()) == want, name


def test_empty_scalar_and_none():
    assert fingerprint(torch.empty(0, 3)) == (0, 0)
    assert fingerprint(None) == (0, 0)
    t = torch.tensor(-2.5)
    assert fingerprint(t) == reference(t)
    assert fingerprints([]).shape == (0, 2)


def test_sum_wraps_modulo_2_64():
    big = torch.full((4,), 2**62 + 12345, dtype=torch.int64)
    assert fingerprint(big) == reference(big)
    neg = torch.tensor([-1, -(2**63), 2**63 - 1], dtype=torch.int64)
    assert fingerprint(neg) == reference(neg)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.uint4, torch.int4, torch.quint8])
def test_dtypes_without_a_fixed_element_size_are_a_clear_type_error(dtype):
    if dtype == torch.quint8:
        t = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8)
    elif dtype == torch.complex128:
        t = torch.zeros(3, dtype=dtype)
    else:
        t = torch.zeros(4, dtype=torch.uint8).view(dtype)
    with pytest.raises(TypeError, match="cannot fingerprint"):
        fingerprints([t])
    assert issubclass(UnsupportedDtypeError, TypeError)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64]),
       n=st.integers(2, 3000), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_any_change_to_one_or_two_elements_changes_the_row(dtype, n, seed, data):
    t = random_bits((n,), dtype, seed)
    size = t.element_size()
    ints = t.view(_INT_VIEW[size])
    before = fingerprint(t)
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1).filter(lambda x: x != i))
    # One bit flipped in one element.
    bit = data.draw(st.integers(0, 8 * size - 1))
    one = ints.clone()
    one[i] ^= torch.tensor(1 << bit if bit < 8 * size - 1 else -(1 << bit), dtype=one.dtype) \
        if one.dtype != torch.uint8 else torch.tensor((1 << bit) & 0xFF, dtype=torch.uint8)
    assert fingerprint(one.view(dtype)) != before
    # A compensating change to two elements: +d and -d leaves the plain sum unchanged.
    two = ints.to(torch.int64).clone()
    two[i] += 1
    two[j] -= 1
    info_min = 0 if dtype == torch.uint8 else -(1 << (8 * size - 1))
    info_max = (1 << (8 * size)) - 1 if dtype == torch.uint8 else (1 << (8 * size - 1)) - 1
    if info_min <= int(two[i]) <= info_max and info_min <= int(two[j]) <= info_max:
        changed = two.to(ints.dtype).view(dtype)
        after = fingerprint(changed)
        assert after[0] == before[0] and after != before
    # A swap of two different elements: only the weighted sum sees it.
    if int(ints[i]) != int(ints[j]):
        swapped = ints.clone()
        swapped[i], swapped[j] = ints[j].clone(), ints[i].clone()
        after = fingerprint(swapped.view(dtype))
        assert after[0] == before[0] and after[1] != before[1]


def test_module_fingerprints_and_digest():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    fps = module_fingerprints(m)
    assert set(fps) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                        "1.running_var", "1.num_batches_tracked"}
    assert fps["0.weight"] == reference(m[0].weight)
    d = digest(fps)
    # The definition, computed here independently: sha256 over the rows in sorted-name order,
    # each its name, a NUL and the two sums as little-endian int64, truncated to 16 hex digits.
    tensors = m.state_dict()
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0" + struct.pack("<qq", *reference(tensors[name])))
    assert re.fullmatch(r"[0-9a-f]{16}", d) and d == h.hexdigest()[:16]
    assert digest(fps, length=64) == h.hexdigest()
    assert re.fullmatch(r"[0-9a-f]{32}", digest(fps, 32))
    one_bit = {**fps, "0.bias": (fps["0.bias"][0] ^ 1, fps["0.bias"][1])}
    assert digest(one_bit) != d  # one bit of one row flipped
    assert digest(dict(reversed(list(fps.items())))) == d  # order-independent for a mapping
    with torch.no_grad():
        m[0].weight[0, 0] += 1.0
    assert digest(module_fingerprints(m)) != d
    rows = fingerprints([m[0].weight, m[0].bias])
    assert digest(rows) == digest(rows.tolist())


@pytest.mark.gpu
def test_cuda_matches_cpu_and_stays_on_device():
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(1 << 20, generator=g).to(dt) for dt in
               (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
    tensors.append(torch.randint(0, 255, (777,), dtype=torch.uint8, generator=g))
    cpu = fingerprints(tensors)
    gpu = fingerprints([t.cuda() for t in tensors])
    assert gpu.device.type == "cpu"
    assert torch.equal(cpu, gpu)
