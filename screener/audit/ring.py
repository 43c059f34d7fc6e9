"""Ring replay: who recomputes whose micro-batch, and how a recomputation is done and recorded.

Assignment (pure functions of the topology, so every rank derives the same plan):

- replayer: with two or more nodes, the rank with index i on node n (ranks in ascending order) is
  replayed by the rank with index i (mod the node's size) on the node before it in node order, a
  ring over nodes. With equal node sizes that is "each rank recomputes the micro-batch of the same
  local rank on the next node". With one node, the previous rank on the same node (a different GPU,
  which can detect but never settle). With one rank, nobody.
- referee: a mismatch between owner and replayer is settled by a rank on a third node (the first node
  after the owner's in ring order that is neither the owner's nor the replayer's, same index rule).
  With fewer than three nodes there is none, and the mismatch stays unsettled.

Replay computes loss and gradients of another rank's micro-batch on the unwrapped module with
`torch.autograd.grad`, so the real .grad is untouched; it runs under `torch.random.fork_rng`, so the
training loop's RNG streams do not move, and restores every buffer afterwards (a BatchNorm forward in
training mode would otherwise update running statistics). For the bits to match, the forward must be
a deterministic function of weights and batch (no dropout, or dropout seeded from the batch), and
loss_fn must hold everything the training step wraps the forward in (torch.autocast, for one: a
replay runs outside the training loop's context managers, and the loss is not rescaled), with
deterministic kernels (CUDA: torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG) and the
same intra-op thread count on every rank (CPU).

A record is an int64 tensor (1 + P, 2): row 0 = (bits of the loss as float64, 1), row 1 + k = the
fingerprint of parameter k's gradient (None counts as zeros, whose fingerprint is (0, 0)).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from screener.audit.topology import Topology
from screener.fingerprint import fingerprints

__all__ = ["replayer_of", "referee_of", "replay_plan", "replay", "make_record", "loss_bits",
           "record_digest", "differing_rows"]


def _same_index(topo: Topology, rank: int, node: str) -> int:
    on = topo.ranks_on(topo.node_of(rank))
    target = topo.ranks_on(node)
    return target[on.index(rank) % len(target)]


def replayer_of(topo: Topology, owner: int) -> Optional[int]:
    """The rank that recomputes `owner`'s micro-batch on audit steps (see the module docstring)."""
    nodes = topo.nodes
    node = topo.node_of(owner)
    if len(nodes) >= 2:
        prev = nodes[(nodes.index(node) - 1) % len(nodes)]
        return _same_index(topo, owner, prev)
    ranks = topo.ranks_on(node)
    if len(ranks) < 2:
        return None
    return ranks[(ranks.index(owner) - 1) % len(ranks)]


def referee_of(topo: Topology, owner: int, replayer: Optional[int]) -> Optional[int]:
    """A rank on a third node that settles a mismatch between owner and replayer, or None."""
    nodes = topo.nodes
    exclude = {topo.node_of(owner)}
    if replayer is not None:
        exclude.add(topo.node_of(replayer))
    start = nodes.index(topo.node_of(owner))
    for k in range(1, len(nodes)):
        node = nodes[(start + k) % len(nodes)]
        if node not in exclude:
            return _same_index(topo, owner, node)
    return None


def replay_plan(topo: Topology) -> dict[int, Optional[int]]:
    """owner -> replayer for every rank of the topology."""
    return {r: replayer_of(topo, r) for r in sorted(topo.ranks)}


@contextlib.contextmanager
def _preserved_state(module: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Leave the module's buffers and the RNG streams as they were."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def replay(module: torch.nn.Module, params: Sequence[torch.nn.Parameter],
           loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any, *,
           device: torch.device) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """Loss and gradients of `batch` with respect to `params`, without touching any .grad."""
    with _preserved_state(module, device), torch.enable_grad():
        loss = loss_fn(module, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a one-element tensor, not {type(loss).__name__}")
        grads = torch.autograd.grad(loss.reshape(()), list(params), allow_unused=True)
    return loss.detach(), list(grads)


def loss_bits(loss: torch.Tensor | float) -> int:
    """The loss as the bits of a float64 (exact for float16/bfloat16/float32/float64 losses)."""
    value = loss.detach().double().reshape(()) if isinstance(loss, torch.Tensor) \
        else torch.tensor(float(loss), dtype=torch.float64)
    return int(value.cpu().view(torch.int64).item())


def bits_to_float(bits: int) -> float:
    return float(torch.tensor(bits, dtype=torch.int64).view(torch.float64).item())


def make_record(loss: torch.Tensor | float, grads: Optional[Sequence[Optional[torch.Tensor]]] = None,
                *, grad_fingerprints: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The (1 + P, 2) record of a loss and its gradients (or their precomputed fingerprints)."""
    fp = grad_fingerprints if grad_fingerprints is not None else fingerprints(list(grads or ()))
    head = torch.tensor([[loss_bits(loss), 1]], dtype=torch.int64)
    return torch.cat([head, fp.to(torch.int64)], dim=0)


def record_digest(records: torch.Tensor) -> torch.Tensor:
    """(..., 1 + P, 2) records -> (..., 4): loss bits, valid flag and a 2-int64 digest of the rest.

    The digest is the fingerprint of the gradient rows themselves, so two records with equal
    digests have equal gradient fingerprints but for a vanishing chance of collision.
    """
    flat = records.reshape(-1, records.shape[-2], 2)
    digests = fingerprints([r[1:] for r in flat])
    out = torch.cat([flat[:, 0, :], digests], dim=1)
    return out.reshape(*records.shape[:-2], 4)


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Row indices (0 = loss, 1 + k = parameter k) where two records differ."""
    return (a != b).any(dim=1).nonzero().flatten().tolist()
