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
`torch.autograd.grad`, so the real .grad is untouched. Reentrant activation checkpointing
(`torch.utils.checkpoint(..., use_reentrant=True)`, still the default of many Hugging Face models)
refuses autograd.grad: its backward runs a backward pass of its own, into .grad. A replay whose
graph holds such a checkpoint (found by walking the graph before the gradients are taken) runs
instead with every parameter swapped for an alias, a new leaf sharing its storage, and takes a
plain backward pass into the aliases' .grad: the same graph on the same values, so the same bits,
while the real .grad, the hooks on the real parameters and DDP's reducer see nothing. ReplayMode
remembers the discovery, so it costs one extra forward once. It starts from the owner's RNG states and
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
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from screener.audit.alarms import AuditUsageError
from screener.audit.capture import StepState, restored
from screener.audit.topology import Topology
from screener.fingerprint import fingerprints

__all__ = ["replayer_of", "referee_of", "replay_plan", "replay", "ReplayMode", "loss_of",
           "settle", "make_record", "loss_bits", "record_digest", "differing_rows",
           "has_reentrant_checkpoint"]


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
        raise AuditUsageError(f"screener.audit: loss_fn must return a one-element loss tensor "
                              f"(alone, first in a tuple, or as 'loss'), not "
                              f"{type(out).__name__}")
    return value


@dataclass
class ReplayMode:
    """How replays take gradients, kept across an Auditor's replays: torch.autograd.grad until a
    replay's graph shows a reentrant checkpoint, a backward pass into parameter aliases after."""

    backward: bool = False


class _NeedsBackward(Exception):
    """The replay's graph holds a reentrant checkpoint: autograd.grad would be refused."""


def has_reentrant_checkpoint(out: torch.Tensor) -> bool:
    """Whether the autograd graph behind `out` holds a reentrant checkpoint node.

    torch's, Megatron's and DeepSpeed's reentrant checkpoints are all autograd Functions named
    CheckpointFunction, whose backward runs a backward pass of its own; use_reentrant=False
    leaves no such node. One visit per node: cheap next to the forward that built the graph.
    """
    stack = [out.grad_fn]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__.endswith("CheckpointFunctionBackward"):
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


@contextlib.contextmanager
def _aliased_parameters(module: torch.nn.Module) -> Iterator[dict[int, torch.nn.Parameter]]:
    """For the body, every parameter of module swapped for an alias: a new leaf Parameter sharing
    its storage (no copy), one per parameter however often it is registered (tied weights).
    Returns id(real parameter) -> alias. setattr, not the _parameters dict, so that modules that
    cache their parameters (an RNN's flat weights) follow."""
    alias: dict[int, torch.nn.Parameter] = {}
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is None:
                    continue
                a = alias.get(id(p))
                if a is None:
                    a = alias[id(p)] = torch.nn.Parameter(p.detach(),
                                                          requires_grad=p.requires_grad)
                swapped.append((m, name, p))
                setattr(m, name, a)
        yield alias
    finally:
        for m, name, p in reversed(swapped):
            setattr(m, name, p)


def _micro_batches(batch: Any, accumulation_steps: int) -> list[Any]:
    if accumulation_steps == 1:
        return [batch]
    if not isinstance(batch, Sequence) or len(batch) != accumulation_steps:
        raise AuditUsageError(f"screener.audit: with accumulation_steps={accumulation_steps}, "
                              f"batch_fn must return a sequence of that many micro-batches")
    return list(batch)


def _scaled(loss: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The loss as it is backpropagated: times the scale, as GradScaler.scale computes it."""
    out = loss if scale is None else loss * scale.to(device=loss.device)
    return out.reshape(())


def _by_grad(module: torch.nn.Module, params: Sequence[torch.nn.Parameter], loss_fn: Callable[..., Any],
             micro: list[Any], scale: Optional[torch.Tensor]
             ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """The usual replay: torch.autograd.grad per micro-batch, added up as .grad adds them."""
    total: Optional[torch.Tensor] = None
    acc: list[Optional[torch.Tensor]] = [None] * len(params)
    for mb in micro:
        loss = loss_of(loss_fn(module, mb))
        total = loss.detach() if total is None else total + loss.detach()
        out = _scaled(loss, scale)
        if has_reentrant_checkpoint(out):
            raise _NeedsBackward()
        grads = torch.autograd.grad(out, list(params), allow_unused=True)
        for k, g in enumerate(grads):
            if g is not None:
                acc[k] = g if acc[k] is None else acc[k] + g  # type: ignore[operator]
    assert total is not None
    return total, acc


def _by_backward(module: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                 loss_fn: Callable[..., Any], micro: list[Any], scale: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """The replay reentrant checkpointing accepts: a backward pass per micro-batch into the
    parameters' aliases, whose .grad accumulates over the micro-batches as the real .grad does."""
    total: Optional[torch.Tensor] = None
    with _aliased_parameters(module) as alias:
        for mb in micro:
            loss = loss_of(loss_fn(module, mb))
            total = loss.detach() if total is None else total + loss.detach()
            _scaled(loss, scale).backward()
        grads = [alias[id(p)].grad if id(p) in alias else None for p in params]
    assert total is not None
    return total, grads


def replay(module: torch.nn.Module, params: Sequence[torch.nn.Parameter],
           loss_fn: Callable[[torch.nn.Module, Any], Any], batch: Any, *,
           device: torch.device, state: Optional[StepState] = None,
           accumulation_steps: int = 1, mode: Optional[ReplayMode] = None
           ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """Loss and gradients of `batch` with respect to `params`, without touching any .grad.

    state: the owner's RNG states and loss scale (capture.py). The gradient is that of the loss
    times the scale, computed as GradScaler.scale computes it, so it matches the owner's scaled
    gradient bit for bit. accumulation_steps > 1: batch is a sequence of that many micro-batches,
    replayed in order from the same starting RNG state; their gradients are added one after the
    other as .grad accumulation adds them, and the loss is the sum of the micro-batch losses
    (what the loop must pass to check_gradients). mode: how gradients are taken (see the module
    docstring); updated when this replay finds a reentrant checkpoint.
    """
    micro = _micro_batches(batch, accumulation_steps)
    mode = mode if mode is not None else ReplayMode()
    scale = None if state is None or state.scale is None else \
        torch.full((1,), state.scale, dtype=torch.float32, device=device)
    if not mode.backward:
        try:
            with _preserved_state(module, device, state), torch.enable_grad():
                return _by_grad(module, params, loss_fn, micro, scale)
        except _NeedsBackward:
            mode.backward = True  # and again from the owner's states: the forward drew from them
    with _preserved_state(module, device, state), torch.enable_grad():
        return _by_backward(module, params, loss_fn, micro, scale)


def scalar_of(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain detached tensor: a DTensor's (loss parallel's, replicated) full value,
    else the tensor itself."""
    value = loss.detach()
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


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


def settle(owner: int, replayer: int, referee: Optional[int], a: torch.Tensor, b: torch.Tensor,
           c: Optional[torch.Tensor], suspects: set[int], unsettled: set[int]) -> str:
    """Who a referee's record `c` agrees with, between the owner's `a` and the replayer's `b`
    (the one rule both auditors settle a mismatch by): the one it does not agree with is added to
    `suspects`; with no referee, or three different records, the ranks go to `unsettled`.
    Returns the case's verdict for the alarm's evidence."""
    if referee is None or c is None:  # c is None exactly when the referee is
        unsettled.update((owner, replayer))
        return "unsettled: fewer than three nodes"
    if torch.equal(c, a):
        suspects.add(replayer)
        return "replayer"
    if torch.equal(c, b):
        suspects.add(owner)
        return "owner"
    unsettled.update((owner, replayer, referee))
    return "unsettled: three different results"


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Row indices (0 = loss, 1 + k = parameter k) where two records differ."""
    return (a != b).any(dim=1).nonzero().flatten().tolist()
