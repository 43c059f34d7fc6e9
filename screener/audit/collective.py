"""Small collectives the checks use: gather one tensor from every rank of a process group.

Every verdict is computed from gathered data that is identical on all ranks, which is what makes it
collective: each rank raises the same alarm at the same step, or none does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["comm_device", "gather"]


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
