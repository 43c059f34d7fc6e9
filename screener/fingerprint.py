"""Exact tensor fingerprints: two wrapping 64-bit sums over a tensor's raw bit patterns.

A fingerprint reduces a tensor to two int64 numbers that change when any one or two elements change,
so replicas and known-answer results can be compared bit for bit by exchanging 16 bytes per tensor.
For tensor k, read in row-major logical order as raw bit patterns (1-byte elements as unsigned 8-bit,
2/4/8-byte elements as signed 16/32/64-bit integers, each widened to int64), row k holds

    (a) sum_i v_i           and     (b) sum_i i * v_i   (i the 1-based position),

both modulo 2**64. The weighted sum is what sees a swap of two elements.

Implementations (`backend()` says which one runs):

- "native", CPU tensors: a compiled C kernel (screener/kernels/fingerprint.c, built into the package
  at install time, loaded with ctypes on first use) reads every byte once, in one parallel region per
  call, without a multiply per element. It runs near memory bandwidth.
- "triton", CUDA tensors when Triton is installed: one kernel launch per element size reads every
  byte once (screener/kernels/triton_fp.py).
- "torch", the reference and fallback (no compiler at install, other devices, or
  SCREENER_FINGERPRINT_BACKEND=torch): pure torch, described next.

The torch path: the obvious implementation widens every element to int64 and multiplies by an index
tensor, and torch's CPU integer reductions are not vectorised, so it crawls at a fraction of a GB/s.
Here the bit patterns are copied in cache-sized chunks into a float buffer in which they are exactly
representable (16-bit patterns in float32, 32-bit ones in float64, 64-bit ones as two unsigned 32-bit
limbs in float64), laid out as blocks of R x C. Float sums of a block's rows and columns are exact,
because every partial sum is an integer below 2**24 (float32) or 2**53 (float64). The two fingerprint
sums are then assembled from those row and column sums in int64, whose wrapping arithmetic is exactly
arithmetic modulo 2**64:

    sum_i (o + i + 1) v_i  =  o * S  +  C * sum_r r * rowsum_r  +  sum_c (c + 1) * colsum_c

for a block starting at offset o. Everything runs on the tensor's device; a call makes one small
device-to-host copy of the result.

This module imports only torch, the standard library and screener.kernels.cpu (ctypes): training
jobs import it. The compiled kernel is opened on the first call, Triton when a CUDA tensor comes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import warnings
from array import array
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from screener.kernels import cpu as _cpu

__all__ = ["fingerprints", "fingerprint", "module_fingerprints", "digest", "backend",
           "UnsupportedDtypeError"]

# SCREENER_FINGERPRINT_BACKEND=torch forces the pure-torch reference path everywhere.
BACKEND_ENV = "SCREENER_FINGERPRINT_BACKEND"


class UnsupportedDtypeError(TypeError):
    """A tensor's dtype has no fixed element size of 1, 2, 4 or 8 bytes (or no raw bits to read)."""


# How each element size is read: the dtype its bits are viewed as, the float type it is summed in,
# the number of limbs per element and the block shape (rows, columns).
# Block sizes keep every float partial sum exact:
#   float32, |v| <= 2**15, 256 terms:          |sum| <= 2**23 < 2**24
#   float64, |v| <= 2**32, 1024 terms (x1024):  |weighted term| bounded well below 2**53
_PLANS = {
    1: (torch.uint8, torch.float32, 1, 256, 256),
    2: (torch.int16, torch.float32, 1, 256, 256),
    4: (torch.int32, torch.float64, 1, 256, 256),
    8: (torch.uint32, torch.float64, 2, 256, 256),  # two unsigned 32-bit limbs, little-endian
}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Sub-byte and packed dtypes report an element size but have no per-element bit pattern we can read.
_SUB_BYTE = {getattr(torch, n) for n in (
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "quint4x2", "quint2x4", "bits1x8", "bits2x4", "bits4x2") if hasattr(torch, n)}
_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32") if hasattr(torch, n)}

# Tensors of at most this many elements take the direct int64 path (see _small_fingerprints_into).
_SMALL = 4096

# Blocks per chunk. On the CPU: large enough to amortise Python overhead, small enough that the float
# buffer stays in cache between the copy and the two reductions. On a GPU the limit is kernel-launch
# overhead, so chunks are much larger (the buffer is 64-256 MiB).
_CHUNK_BLOCKS = 16
_CHUNK_BLOCKS_GPU = 256


def _check_dtype(t: torch.Tensor) -> int:
    dt = t.dtype
    if dt in _SUB_BYTE or dt in _QUANTIZED or t.is_quantized:
        raise UnsupportedDtypeError(f"cannot fingerprint dtype {dt}: it has no fixed element size "
                                    f"of whole bytes whose bits can be read")
    size = t.element_size()
    if size not in _PLANS:
        raise UnsupportedDtypeError(f"cannot fingerprint dtype {dt}: element size {size} bytes is "
                                    f"not 1, 2, 4 or 8")
    return size


def _flat_bits(t: torch.Tensor, size: int) -> torch.Tensor:
    """The tensor's raw bits as a flat contiguous tensor of the plan's integer view dtype."""
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedDtypeError(f"cannot fingerprint a tensor with layout {t.layout}")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.contiguous().reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # torch calls a 0- or 1-element tensor contiguous whatever its stride, but a dtype view
        # to a narrower type needs stride 1.
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(_PLANS[size][0])


class _Workspace:
    """Per-device scratch: the float buffer and the int64 weight vectors, reused across calls."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._ranges: dict[torch.device, torch.Tensor] = {}
        self._limbs: dict[torch.device, torch.Tensor] = {}

    def buffer(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]

    def limb_weights(self, device: torch.device) -> torch.Tensor:
        """int64 [1, 2**32]: the weights of the two 32-bit limbs of an 8-byte element."""
        w = self._limbs.get(device)
        if w is None:
            w = torch.tensor([1, 1 << 32], dtype=torch.int64).to(device)
            self._limbs[device] = w
        return w

    def arange(self, device: torch.device, n: int) -> torch.Tensor:
        """int64 [0, 1, ..., n-1] on the device (cached, sliced)."""
        r = self._ranges.get(device)
        if r is None or r.numel() < n:
            r = torch.arange(max(n, 4096), dtype=torch.int64, device=device)
            self._ranges[device] = r
        return r[:n]


_LOCAL = threading.local()


def _workspace() -> _Workspace:
    # One workspace per thread: DDP comm hooks may run on autograd's device threads.
    ws = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = _Workspace()
    return ws


def _fingerprint_into(bits: torch.Tensor, size: int, out: torch.Tensor) -> None:
    """Accumulate the fingerprint of flat `bits` (view dtype of the plan) into out (2,) int64."""
    _, fdtype, limbs, rows, cols = _PLANS[size]
    ws = _workspace()
    n = bits.numel() // limbs  # elements
    if n == 0:
        return
    device = bits.device
    # Small tensors use a smaller block so that padding does not dominate the work.
    rows = min(rows, -(-n // cols))
    block = rows * cols
    chunk_blocks = _CHUNK_BLOCKS if device.type == "cpu" else _CHUNK_BLOCKS_GPU
    chunk = block * chunk_blocks
    idx = ws.arange(device, max(rows, cols, chunk_blocks) + 1)
    row_w = idx[:rows] * cols  # 0-based element offset of each row inside a block
    col_w = idx[1:cols + 1]  # 1-based position of each column inside a row
    limb_w = ws.limb_weights(device) if limbs > 1 else None
    total = torch.zeros(limbs, dtype=torch.int64, device=device)
    weighted = torch.zeros(limbs, dtype=torch.int64, device=device)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        nblocks = -(-m // block)
        padded = nblocks * block
        buf = ws.buffer(device, fdtype, padded * limbs)
        buf[:m * limbs].copy_(bits[start * limbs:(start + m) * limbs])
        if padded > m:
            buf[m * limbs:].zero_()  # zeros add nothing to either sum
        grid = buf.view(nblocks, rows, cols, limbs)
        # Exact float sums (see module docstring), then exact int64 from here on.
        rowsum = grid.sum(dim=2).to(torch.int64)  # (nblocks, rows, limbs)
        colsum = grid.sum(dim=1).to(torch.int64)  # (nblocks, cols, limbs)
        blocksum = rowsum.sum(dim=1)  # (nblocks, limbs)
        block_off = idx[:nblocks] * block + start  # nblocks <= chunk_blocks < idx.numel()
        total += blocksum.sum(dim=0)
        weighted += (block_off.unsqueeze(1) * blocksum).sum(dim=0)
        weighted += (row_w.view(1, rows, 1) * rowsum).sum(dim=(0, 1))
        weighted += (col_w.view(1, cols, 1) * colsum).sum(dim=(0, 1))
    if limb_w is not None:
        total = (total * limb_w).sum().reshape(1)
        weighted = (weighted * limb_w).sum().reshape(1)
    out[0] += total[0]
    out[1] += weighted[0]


def _readable_sizes() -> dict[torch.dtype, int]:
    """Element size of every dtype whose raw bits fingerprints can read: the same rule as
    _check_dtype, as a lookup table for the hot loop."""
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return {dt: dt.itemsize for dt in dtypes
            if dt not in _SUB_BYTE and dt not in _QUANTIZED and dt.itemsize in _PLANS}


_ELEMENT_SIZE = _readable_sizes()
# Tensor types whose data_ptr() is their own dense storage: what the C kernel may read directly.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) if hasattr(torch.nn, "Buffer") \
    else (torch.Tensor, torch.nn.Parameter)


def backend(device: Union[str, torch.device] = "cpu") -> str:
    """Which implementation fingerprints tensors on this kind of device.

    "native" (the compiled C kernel, CPU), "triton" (CUDA, when Triton is installed) or "torch" (the
    pure-torch reference, used when the others are unavailable or SCREENER_FINGERPRINT_BACKEND=torch).
    Results are bit-identical whichever runs; only speed differs. Loads the kernel if not yet loaded.
    """
    kind = torch.device(device).type
    if os.environ.get(BACKEND_ENV) == "torch":
        return "torch"
    if kind == "cpu":
        return "native" if _cpu.load()[0] is not None else "torch"
    if kind == "cuda" and _triton() is not None:
        return "triton"
    return "torch"


def native_unavailable_reason() -> Optional[str]:
    """Why the native CPU kernel is not used, or None when it is."""
    if os.environ.get(BACKEND_ENV) == "torch":
        return f"{BACKEND_ENV}=torch"
    kernel, why = _cpu.load()
    return None if kernel is not None else why


_TRITON_STATE: list[Any] = []  # [module or None], filled on first use


def _triton() -> Any:
    """screener.kernels.triton_fp if Triton imports, else None (checked once per process)."""
    if not _TRITON_STATE:
        try:
            from screener.kernels import triton_fp
            _TRITON_STATE.append(triton_fp if triton_fp.available() else None)
        except Exception:  # not installed, or broken: the torch path gives the same results
            _TRITON_STATE.append(None)
    return _TRITON_STATE[0]


def fingerprints(tensors: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """Fingerprint each tensor: an int64 CPU tensor of shape (len(tensors), 2); None gives (0, 0).

    Results are bit-identical to the plain definition (see the module docstring) for every dtype
    with 1, 2, 4 or 8-byte elements, any strides, empty and 0-dim tensors. Work happens on each
    tensor's own device; the result is copied to the host once per device.
    Raises UnsupportedDtypeError (a TypeError) for dtypes without a fixed whole-byte element size.
    """
    # No torch.no_grad() here: it costs microseconds per call, and every path reads detached bits.
    tensors = list(tensors)
    if os.environ.get(BACKEND_ENV) == "torch":
        return _torch_fingerprints(tensors)
    return _fingerprints(tensors, _cpu.load()[0], use_triton=True)


def _fingerprints(tensors: list[Optional[torch.Tensor]], kernel: Optional[_cpu.CpuKernel],
                  use_triton: bool) -> torch.Tensor:
    """Dispatch: CPU tensors to the C kernel (when loaded), CUDA ones to Triton (when installed;
    imported only once a CUDA tensor comes), the rest to the torch reference path."""
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    desc = array("q")
    keep: list[torch.Tensor] = []  # contiguous copies must outlive the kernel call
    others: list[int] = []
    sizes = _ELEMENT_SIZE
    strided = torch.strided
    plain = _PLAIN_TYPES
    # Hot loop: a model has thousands of small tensors, so each costs only a few attribute reads.
    for k, t in enumerate(tensors):
        if t is None:
            desc.extend((0, 0, 1))
            continue
        size = sizes.get(t.dtype)
        if size is None:
            size = _check_dtype(t)  # raises: no readable fixed-size bits
        # Subclasses (DTensor, fake tensors) may have no storage of their own: torch path.
        if kernel is None or type(t) not in plain or not t.is_cpu:
            others.append(k)
            desc.extend((0, 0, 1))
            continue
        if t.layout is not strided or not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = _flat_bits(t, size).view(_INT_VIEW[size])  # one element per element
            keep.append(t)
        desc.extend((t.data_ptr(), t.numel(), size))
    if kernel is not None and len(others) < len(tensors):
        kernel.run(desc, out.data_ptr(), torch.get_num_threads())
    if others:
        rest = [t for t in (tensors[k] for k in others) if t is not None]  # others are never None
        triton_mod = _triton() if use_triton and any(t.is_cuda for t in rest) else None
        out[others] = _device_fingerprints(rest, triton_mod)
    return out


def _device_fingerprints(tensors: list[torch.Tensor], triton_mod: Any) -> torch.Tensor:
    """Fingerprints of tensors the C kernel does not take: CUDA ones by Triton when given, the rest
    by the torch reference path."""
    if triton_mod is None:
        return _torch_fingerprints(tensors)
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    cuda = [k for k, t in enumerate(tensors) if t.is_cuda]
    rest = [k for k, t in enumerate(tensors) if not t.is_cuda]
    if cuda:
        sizes = [_check_dtype(tensors[k]) for k in cuda]
        bits = [_flat_bits(tensors[k], size).view(_INT_VIEW[size]) for k, size in zip(cuda, sizes)]
        try:
            out[cuda] = triton_mod.fingerprints(bits)
        except Exception as exc:  # noqa: BLE001 - e.g. no C compiler for Triton's launcher stub
            # Triton compiles at first use and can fail where it imports (no host compiler, an
            # unsupported GPU). That is our failure, not the device's: fall back for this process.
            _TRITON_STATE[:] = [None]
            warnings.warn(f"fingerprints: the Triton kernel failed ({type(exc).__name__}: {exc}); "
                          f"using the torch path from now on", RuntimeWarning, stacklevel=3)
            out[cuda] = _torch_fingerprints([tensors[k] for k in cuda])
    if rest:
        out[rest] = _torch_fingerprints([tensors[k] for k in rest])
    return out


@torch.no_grad()
def _torch_fingerprints(tensors: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """The pure-torch reference path: same contract as fingerprints()."""
    tensors = list(tensors)
    sizes = [None if t is None else _check_dtype(t) for t in tensors]
    per_device: dict[torch.device, torch.Tensor] = {}
    small: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for k, (t, size) in enumerate(zip(tensors, sizes)):
        if t is None or size is None:  # size is None exactly when t is
            continue
        dev = t.device
        if dev not in per_device:
            per_device[dev] = torch.zeros(len(tensors), 2, dtype=torch.int64, device=dev)
            small[dev] = []
        bits = _flat_bits(t, size)
        if t.numel() <= _SMALL:
            small[dev].append((k, bits.view(_INT_VIEW[size]) if size == 8 else bits))
        else:
            _fingerprint_into(bits, size, per_device[dev][k])
    for dev, items in small.items():
        if items:
            _small_fingerprints_into(items, per_device[dev])
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    for dev, acc in per_device.items():
        out += acc.cpu()  # rows of other devices are zero in acc
    return out


def _small_fingerprints_into(items: list[tuple[int, torch.Tensor]], out: torch.Tensor) -> None:
    """Fingerprint many small tensors at once, straight from the definition.

    For a few thousand elements the fixed cost of the blocked float path (a dozen kernel launches
    per tensor) outweighs its per-byte speed, so small tensors are widened to int64, concatenated,
    and reduced per segment in one pass: a handful of ops for the whole set instead of per tensor.
    """
    device = out.device
    wide = torch.cat([bits.to(torch.int64) for _, bits in items])
    if wide.numel() == 0:
        return
    lengths = torch.tensor([bits.numel() for _, bits in items], dtype=torch.int64).to(device)
    rows = torch.tensor([k for k, _ in items], dtype=torch.int64).to(device)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    pos = torch.arange(1, wide.numel() + 1, dtype=torch.int64, device=device)
    pos -= torch.repeat_interleave(starts, lengths)
    # Segment sums as differences of inclusive prefix sums (integer scans are deterministic on
    # every device, unlike scatter-adds, and int64 wraps exactly modulo 2**64).
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    for col, values in ((0, wide), (1, wide * pos)):
        prefix = torch.cat([zero, torch.cumsum(values, 0)])
        out[rows, col] += prefix[ends] - prefix[starts]


def fingerprint(tensor: Optional[torch.Tensor]) -> tuple[int, int]:
    """The fingerprint of one tensor as two Python ints (signed int64 values)."""
    row = fingerprints([tensor])[0]
    return int(row[0]), int(row[1])


def module_fingerprints(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Fingerprints of a module's parameters and buffers, by their state_dict-style names."""
    names: list[str] = []
    tensors: list[Optional[torch.Tensor]] = []
    for name, p in module.named_parameters():
        names.append(name)
        tensors.append(p)
    for name, b in module.named_buffers():
        names.append(name)
        tensors.append(b)
    rows = fingerprints(tensors).tolist()
    return {n: (r[0], r[1]) for n, r in zip(names, rows)}


def digest(rows: Union[Mapping[str, Sequence[int]], torch.Tensor, Iterable[Sequence[int]]],
           length: int = 16) -> str:
    """A short hex digest (sha256, truncated) of a set of fingerprints.

    A mapping is digested in sorted-name order with its names, so two sets with the same tensors
    under the same names give the same digest whatever order they were gathered in.
    """
    h = hashlib.sha256()
    if isinstance(rows, Mapping):
        for name in sorted(rows):
            a, b = rows[name]
            h.update(name.encode() + b"\0" + struct.pack("<qq", int(a), int(b)))
    else:
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        for a, b in rows:
            h.update(struct.pack("<qq", int(a), int(b)))
    return h.hexdigest()[:length]
