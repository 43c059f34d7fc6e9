"""Small collectives the checks use: gather one tensor from every rank of a process group, and
send byte payloads point to point (a batch or a snapshot to the rank that replays it).

Every verdict is computed from gathered data that is identical on all ranks, which is what makes it
collective: each rank raises the same alarm at the same step, or none does.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

__all__ = ["comm_device", "gather", "exchange"]


def comm_device(group: Optional[dist.ProcessGroup], compute: torch.device) -> torch.device:
    """Where tensors for the group's collectives must live: CPU for gloo, the GPU for NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "gloo" or "cpu:" in backend or compute.type == "cpu":
        return torch.device("cpu")
    if compute.index is None and compute.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return compute


# One output tensor rather than a list of them; torch 2.13 renamed all_gather_into_tensor.
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather(t: torch.Tensor, group: Optional[dist.ProcessGroup],
           device: torch.device) -> torch.Tensor:
    """all_gather of one same-shaped tensor per rank: (world, *t.shape) on the CPU, in group-rank
    order."""
    flat = t.to(device).contiguous().reshape(-1)  # gloo takes the concatenated form only
    world = dist.get_world_size(group)
    out = torch.empty(world * flat.numel(), dtype=t.dtype, device=device)
    _GATHER_INTO(out, flat, group=group)
    return out.cpu().reshape(world, *t.shape)


def exchange(pairs: Iterable[tuple[int, Optional[int]]], rank: int,
             data: Optional[torch.Tensor], sizes: dict[int, int],
             device: torch.device) -> dict[int, torch.Tensor]:
    """Point to point: each (source, destination) pair's payload, `data` on the source (uint8,
    `sizes[source]` bytes). Every rank passes the same pairs; pairs without a destination or to
    themselves are skipped, a payload arrives once. Returns what this rank received, by source."""
    ops: list[dist.P2POp] = []
    inbox: dict[int, torch.Tensor] = {}
    for src, dst in sorted({(s, d) for s, d in pairs if d is not None and d != s}):
        if src == rank and data is not None:
            ops.append(dist.P2POp(dist.isend, data.to(device), dst))
        if dst == rank and src not in inbox:
            inbox[src] = torch.empty(sizes[src], dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, inbox[src], src))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return inbox
