"""Fingerprints of CUDA tensors with Triton kernels that read every byte once.

The definition is the one in screener/fingerprint.py: for elements v_j (1-byte unsigned, wider signed,
widened to int64), S = sum_j v_j and W = sum_j (j + 1) v_j, both modulo 2**64. Each kernel program
sums one block of a tensor in int64 (whose wrapping is exact arithmetic modulo 2**64) into a partial
row (S_b, W_b) with positions counted from the start of the tensor; a tensor's rows are then added up
with integer torch ops, which are exact whatever their order. Nothing here uses floats or atomics, so
results are bit-identical to the definition on any GPU and under deterministic-algorithm mode.

- Large tensors: one launch per tensor of `_tensor_blocks`, which gets the tensor itself as an
  argument (so Triton sees its alignment and issues wide loads).
- Small tensors: one launch per element size of `_table_blocks` for all of them, driven by a table of
  (address, count, first position) rows, one per block: a model's thousands of biases and norms cost
  one launch, not thousands.

Run with TRITON_INTERPRET=1 (set before this module is imported), the same kernels run on the CPU on
CPU tensors: that is how the tests prove them bit-identical to the definition without a GPU.
Imported only when needed (importing Triton takes seconds).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

# Tensors with at least this many elements get their own launch.
LARGE = 1 << 16
# Elements per program: 16 KiB of a large tensor (enough work per program to run at bandwidth);
# smaller blocks for the table so that a 1 KiB bias is not mostly padding.
BLOCK_BYTES = 16 << 10
TABLE_BLOCK = 1024

_ELEM_DTYPE = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """Whether the kernels can run here: a CUDA device, or the interpreter."""
    return torch.cuda.is_available() or interpreting()


@triton.jit
def _tensor_blocks(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    # Program b: elements [b * BLOCK, (b + 1) * BLOCK) of one contiguous tensor.
    b = tl.program_id(0).to(tl.int64)
    idx = b * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + idx, mask=idx < n, other=0).to(tl.int64)  # masked lanes add 0
    tl.store(partial_ptr + 2 * b, tl.sum(v, axis=0))
    tl.store(partial_ptr + 2 * b + 1, tl.sum((idx + 1) * v, axis=0))


@triton.jit
def _table_blocks(table_ptr, partial_ptr, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    # Program b: table row b = (address of the block's first element, elements in the block,
    # 0-based position of that element in its tensor).
    b = tl.program_id(0).to(tl.int64)
    addr = tl.load(table_ptr + 3 * b)
    count = tl.load(table_ptr + 3 * b + 1)
    first = tl.load(table_ptr + 3 * b + 2)
    ptr = addr.to(tl.pointer_type(DTYPE))
    j = tl.arange(0, BLOCK).to(tl.int64)
    v = tl.load(ptr + j, mask=j < count, other=0).to(tl.int64)
    tl.store(partial_ptr + 2 * b, tl.sum(v, axis=0))
    tl.store(partial_ptr + 2 * b + 1, tl.sum((first + j + 1) * v, axis=0))


def _segment_sums(partial: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sum consecutive runs of rows of `partial` (run k has counts[k] rows) by differences of
    inclusive prefix sums: exact and deterministic for int64."""
    prefix = torch.cat([partial.new_zeros(1, 2), torch.cumsum(partial, 0)])
    ends = torch.cumsum(counts, 0).to(partial.device)
    return prefix[ends] - prefix[ends - counts.to(partial.device)]


def _large(bits: torch.Tensor) -> torch.Tensor:
    n = bits.numel()
    block = max(1024, BLOCK_BYTES // bits.element_size())
    nblocks = triton.cdiv(n, block)
    partial = torch.empty(nblocks, 2, dtype=torch.int64, device=bits.device)
    _tensor_blocks[(nblocks,)](bits, partial, n, BLOCK=block, num_warps=8)
    return partial.sum(0)


def _small(items: Sequence[torch.Tensor], size: int, device: torch.device) -> torch.Tensor:
    """Rows (S, W) of many small flat tensors of one element size, in one launch."""
    addr = torch.tensor([t.data_ptr() for t in items], dtype=torch.int64)
    numel = torch.tensor([t.numel() for t in items], dtype=torch.int64)
    nblocks = (numel + TABLE_BLOCK - 1) // TABLE_BLOCK
    total = int(nblocks.sum())
    if total == 0:
        return torch.zeros(len(items), 2, dtype=torch.int64, device=device)
    owner = torch.repeat_interleave(torch.arange(len(items)), nblocks)
    first_block = torch.cumsum(nblocks, 0) - nblocks
    start = (torch.arange(total) - first_block[owner]) * TABLE_BLOCK
    table = torch.stack([addr[owner] + start * size,
                         torch.clamp(numel[owner] - start, max=TABLE_BLOCK), start], 1)
    table = table.to(device)
    partial = torch.empty(total, 2, dtype=torch.int64, device=device)
    _table_blocks[(total,)](table, partial, DTYPE=_ELEM_DTYPE[size], BLOCK=TABLE_BLOCK, num_warps=4)
    return _segment_sums(partial, nblocks)


@torch.no_grad()
def fingerprints(bits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows (S, W) of flat contiguous tensors of dtype uint8/int16/int32/int64 (the raw bits of the
    tensors to fingerprint), as an int64 CPU tensor of shape (len(bits), 2); one device-to-host copy
    per device."""
    out = torch.zeros(len(bits), 2, dtype=torch.int64)
    by_device: dict[torch.device, list[int]] = {}
    for k, t in enumerate(bits):
        by_device.setdefault(t.device, []).append(k)
    for device, ks in by_device.items():
        rows = torch.zeros(len(ks), 2, dtype=torch.int64, device=device)
        small: dict[int, list[int]] = {}
        for i, k in enumerate(ks):
            t = bits[k]
            if t.numel() >= LARGE:
                rows[i] = _large(t)
            elif t.numel() > 0:
                small.setdefault(t.element_size(), []).append(i)
        for size, idx in small.items():
            rows[idx] = _small([bits[ks[i]] for i in idx], size, device)
        out[ks] = rows.cpu()
    return out
