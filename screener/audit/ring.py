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
`torch.autograd.grad`, so the real .grad is untouched. It starts from the owner's RNG states and
uses the owner's loss scale (both travel with the audit payload, see capture.py), so dropout and a
GradScaler replay bit for bit; this rank's own RNG streams are put back afterwards, and so is every
buffer (a BatchNorm forward in training mode would otherwise update running statistics). For the
bits to match, loss_fn must hold everything the training step wraps the forward in (torch.autocast,
for one: a replay runs outside the training loop's context managers), with deterministic kernels
(CUDA: torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG) and the same intra-op thread
count on every rank (CPU). The auditor's self-check (auditor.py) finds a step that is not
reproducible anyway and says so, instead of blaming a node.

A record is an int64 tensor (1 + P, 2): row 0 = (bits of the loss as float64, 1), row 1 + k = the
fingerprint of parameter k's gradient (None counts as zeros, whose fingerprint is (0, 0)).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from screener.audit.capture import StepState, restored
from screener.audit.topology import Topology
from screener.fingerprint import fingerprints

__all__ = ["replayer_of", "referee_of", "replay_plan", "replay", "loss_of", "make_record", "loss_bits",
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
def _preserved_state(module: torch.nn.Module, device: torch.device,
                     state: Optional[StepState]) -> Iterator[None]:
    """Run from the owner's RNG states; leave the module's buffers and this rank's RNG streams as
    they were."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    with restored(state, device):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def loss_of(out: Any) -> torch.Tensor:
    """The loss in what a loss_fn returned: the tensor itself, the first element of a tuple or
    list, the "loss" entry of a mapping, or the .loss attribute (Hugging Face model outputs)."""
    value = out
    if isinstance(out, Mapping):
        value = out.get("loss")
    elif isinstance(out, (tuple, list)) and out:
        value = out[0]
    elif not isinstance(out, torch.Tensor) and hasattr(out, "loss"):
        value = out.loss
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(f"loss_fn must return a one-element loss tensor (alone, first in a tuple, "
                        f"or as 'loss'), not {type(out).__name__}")
    return value


def replay(module: torch.nn.Module, params: Sequence[torch.nn.Parameter],
           loss_fn: Callable[[torch.nn.Module, Any], Any], batch: Any, *,
           device: torch.device, state: Optional[StepState] = None,
           accumulation_steps: int = 1) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """Loss and gradients of `batch` with respect to `params`, without touching any .grad.

    state: the owner's RNG states and loss scale (capture.py). The gradient is that of the loss
    times the scale, computed as GradScaler.scale computes it, so it matches the owner's scaled
    gradient bit for bit. accumulation_steps > 1: batch is a sequence of that many micro-batches,
    replayed in order from the same starting RNG state; their gradients are added one after the
    other as .grad accumulation adds them, and the loss is the sum of the micro-batch losses
    (what the loop must pass to check_gradients).
    """
    micro = [batch]
    if accumulation_steps > 1:
        if not isinstance(batch, Sequence) or len(batch) != accumulation_steps:
            raise TypeError(f"with accumulation_steps={accumulation_steps}, batch_fn must return a "
                            f"sequence of that many micro-batches")
        micro = list(batch)
    scale = None if state is None or state.scale is None else \
        torch.full((1,), state.scale, dtype=torch.float32, device=device)
    total: Optional[torch.Tensor] = None
    acc: list[Optional[torch.Tensor]] = [None] * len(params)
    with _preserved_state(module, device, state), torch.enable_grad():
        for mb in micro:
            loss = loss_of(loss_fn(module, mb))
            total = loss.detach() if total is None else total + loss.detach()
            out = loss if scale is None else loss * scale.to(device=loss.device)
            grads = torch.autograd.grad(out.reshape(()), list(params), allow_unused=True)
            for k, g in enumerate(grads):
                if g is None:
                    continue
                acc[k] = g if acc[k] is None else acc[k] + g  # type: ignore[operator]
    assert total is not None
    return total, acc


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
