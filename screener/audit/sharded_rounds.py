"""FSDP2/HSDP replays: lockstep rounds through the sharded model, and the batches they need.

Under FSDP no rank holds the whole model, so a replay cannot be local: it runs through the same
sharded model on every rank at once. In a lockstep round every rank runs exactly one forward and
backward (its all-gathers and, for HSDP, the replicate all-reduce line up across ranks), with the
reduce-scatter recorders (fsdp_tap.py) taking the reduce-scatter input's fingerprint and skipping
the reduction; the sharded gradients and buffers are put back afterwards, bit for bit. A rank with
nothing to replay in a round reruns its own step, so that every rank is in the round.

The owner's micro-batch travels to its replayer point to point (`ship`): the `batch=` of
check_gradients, or `batch_fn(rank, step)`, serialised with torch.save. `offer` is the gather that
comes first: who has a batch, how many bytes, and every rank's step state.

The step's first gather (the head, one int64 row per rank) is laid out by the H_* columns below.
"""

from __future__ import annotations

import io
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from screener.audit import ring
from screener.audit.capture import StateCodec, StepState, restored
from screener.audit.collective import exchange
from screener.audit.fsdp_tap import Tap
from screener.audit.protocol import Walk
from screener.audit.tensor_parallel import TPGroups
from screener.audit.topology import Topology

__all__ = ["Lockstep", "Offer", "to_bits", "from_bits", "encode_batch", "decode_batch", "H_LOSS", "H_LOCAL",
           "H_REDUCED", "H_STATUS", "H_BYTES", "H_LOCAL_MAG", "H_REDUCED_MAG", "H_DRIFT", "HEAD",
           "OK",
           "NO_BATCH", "NOT_RECORDED"]

log = logging.getLogger("screener.audit")

# The head's columns: loss bits, local finite, reduced finite, audit status, batch bytes, local
# and reduced magnitude bits, whether this rank's weight shards changed since the last weight
# check (weight_check.ShardedWeightCheck.drifted).
H_LOSS, H_LOCAL, H_REDUCED, H_STATUS, H_BYTES, H_LOCAL_MAG, H_REDUCED_MAG, H_DRIFT = range(8)
HEAD = 8
OK, NO_BATCH, NOT_RECORDED = 0, 1, 2  # a rank's status on an audit step


def to_bits(x: float) -> int:
    """A float's float64 bits, as an int (what travels in the int64 head)."""
    return int(torch.tensor(float(x), dtype=torch.float64).view(torch.int64).item())


def from_bits(bits: Any) -> float:
    return float(torch.tensor(int(bits), dtype=torch.int64).view(torch.float64).item())


def encode_batch(batch: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(batch, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _loss_parallel_backward(loss: Any, scale: Optional[float]) -> None:
    """The backward of a loss computed under tensor parallel's loss_parallel (a DTensor): it
    runs under the same context, as the loop's own backward must (the vocabulary-sharded
    cross-entropy's backward is loss_parallel's)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        out = loss if scale is None else loss * scale
        out.backward()


def decode_batch(data: torch.Tensor, device: torch.device) -> Any:
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location=device,
                      weights_only=False)


@dataclass
class Offer:
    """What every rank offered for a replay round: this rank's batch (and its bytes), whether
    every rank has one, the byte counts and every rank's step state."""

    batch: Any
    data: Optional[torch.Tensor]
    ready: bool
    sizes: dict[int, int]
    states: dict[int, StepState]


class Lockstep:
    """Replays through the sharded model on every rank at once; who replays whom."""

    def __init__(self, model: torch.nn.Module, root: Any, params: list[Any], tap: Tap,
                 topology: Topology, rank: int, *, device: torch.device, codec: StateCodec,
                 counters: Counter[str], loss_fn: Optional[Callable[[torch.nn.Module, Any], Any]],
                 batch_fn: Optional[Callable[[int, int], Any]], accumulation_steps: int,
                 audit_every: int, replicas: Optional[list[set[int]]] = None,
                 tp: Optional[TPGroups] = None) -> None:
        self.model, self.root, self.params, self.tap = model, root, params, tap
        # HSDP: the ranks of each replica (a shard group, which all-gathers the same weights); a
        # confirmation must run in another one, or a corrupted shard corrupts it alike
        self.replica_of = {r: k for k, group in enumerate(replicas or []) for r in group}
        # tensor parallel: who replays with whom (tensor_parallel.py); None without TP
        self.tp = tp
        self.topology, self.rank, self.device = topology, rank, device
        self.codec, self.counters = codec, counters
        self.loss_fn, self.batch_fn = loss_fn, batch_fn
        self.accumulation_steps = accumulation_steps
        self.plan = ring.replay_plan(topology)
        self.owners_of: dict[int, list[int]] = {}
        for owner, replayer in sorted(self.plan.items()):
            if replayer is not None:
                self.owners_of.setdefault(replayer, []).append(owner)
        self.rounds = max((len(v) for v in self.owners_of.values()), default=0)
        self.can_replay = loss_fn is not None and self.rounds > 0
        if audit_every and not self.can_replay:
            log.warning("screener.audit: ring replay is off (%s)", "needs loss_fn"
                        if loss_fn is None else "a single rank has nobody to replay")

    def decode_states(self, rows: torch.Tensor) -> dict[int, StepState]:
        return {r: self.codec.decode(rows[k]) for k, r in enumerate(self.topology.ranks)}

    def offer(self, walk: Walk, round_: str, step: int, batch: Any,
              data: Optional[torch.Tensor], state: StepState) -> Offer:
        """One gather before a replay round off an audit step: whether each rank has its batch
        (this rank's from batch_fn when the loop passed none), its size, and its step state."""
        if data is None and (batch is not None or self.batch_fn is not None):
            if batch is None:
                assert self.batch_fn is not None
                batch = self.batch_fn(self.rank, step)
            data = encode_batch(batch)
        head = torch.cat([torch.tensor([int(data is not None),
                                        0 if data is None else data.numel()]),
                          self.codec.encode(state)])
        got = walk.gather(round_, head)
        return Offer(batch, data, bool(got[:, 0].all()),
                     {r: int(got[k, 1]) for k, r in enumerate(self.topology.ranks)},
                     self.decode_states(got[:, 2:]))

    def ship(self, walk: Walk, round_: str, send_to: Any, data: Optional[torch.Tensor],
             sizes: dict[int, int]) -> dict[int, Any]:
        """Point to point: each owner's batch to the rank(s) send_to names ({owner: rank} or a
        list of (owner, rank) pairs). Returns the batches this rank received, by owner."""
        walk.enter(round_)
        pairs = send_to.items() if isinstance(send_to, dict) else send_to
        inbox = exchange(pairs, self.rank, data, sizes, walk.comm)
        self.counters["batch_bytes_received"] += sum(t.numel() for t in inbox.values())
        return {o: decode_batch(t, self.device) for o, t in inbox.items()}

    def replay(self, walk: Walk, round_: str, batch: Any, state: StepState) -> torch.Tensor:
        """One lockstep replay: forward and backward of `batch` through the model from `state`,
        on every rank at once; the reduce-scatter inputs are recorded and not reduced, and the
        sharded gradients and buffers are put back. Returns the record (1 + modules, 2): loss
        bits, largest magnitude bits, one fingerprint per FSDP module."""
        assert self.loss_fn is not None
        walk.enter(round_)
        grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in self.params]
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        micro = list(batch) if self.accumulation_steps > 1 else [batch]
        tap = self.tap
        tap.start_replay()
        total: Optional[torch.Tensor] = None
        try:
            with restored(state, self.device), torch.enable_grad():
                for i, mb in enumerate(micro):
                    # reduce-scatter on the micro-steps the step did: every one, or the last
                    self.root.set_requires_gradient_sync(tap.sync_at(i, len(micro)))
                    loss = ring.loss_of(self.loss_fn(self.model, mb))
                    value = ring.scalar_of(loss)
                    total = value if total is None else total + value
                    if hasattr(loss, "placements"):  # a DTensor loss: loss parallel's backward
                        _loss_parallel_backward(loss, state.scale)
                        continue
                    out = loss if state.scale is None else loss * torch.full(
                        (1,), state.scale, dtype=torch.float32, device=loss.device)
                    out.reshape(()).backward()
        finally:
            tap.replaying = False
            self.root.set_requires_gradient_sync(True)
            with torch.no_grad():
                for p, saved in grads:
                    p.grad = saved
                for b, saved_b in buffers:
                    b.copy_(saved_b)
        assert total is not None
        return torch.cat([torch.tensor([[ring.loss_bits(total), 1], [to_bits(tap.replay_mag), 1]]),
                          tap.replay_fps.clone()])

    def confirm_plan(self, flagged: list[int]) -> dict[int, Optional[int]]:
        """owner -> the rank that replays it to confirm a NaN/Inf (confirmer); under tensor
        parallel the flagged owners' TP partners come along, each replayed by the confirmer's
        partner at its coordinate (a partner not flagged is replayed, not judged)."""
        if self.tp is None:
            return {o: self.confirmer(o, set(flagged)) for o in flagged}
        owners = self.tp.close(flagged)
        plan: dict[int, Optional[int]] = {}
        for o in owners:
            if o in plan:
                continue
            helper = self.confirmer(o, set(owners))
            if helper is None or self.tp.group_of(helper) == self.tp.group_of(o):
                plan.update({m: None for m in self.tp.group_of(o)})
            else:
                plan.update(self.tp.spread(o, helper))
        return plan

    def _apart(self, a: int, b: int) -> bool:
        """Whether b computes independently of a: another node and, under HSDP, another
        replica."""
        topo = self.topology
        return topo.node_of(a) != topo.node_of(b) and (
            a not in self.replica_of or self.replica_of.get(b) != self.replica_of[a])

    def confirmer(self, owner: int, flagged: set[int]) -> Optional[int]:
        """Who replays a non-finite owner: its ring replayer, else a clean rank on another node
        (the first in node order); under HSDP one of another replica when there is one."""
        first = self.plan.get(owner)
        topo = self.topology
        if first is not None and first not in flagged and self._apart(owner, first):
            return first
        candidates = [r for node in topo.nodes if node != topo.node_of(owner)
                      for r in topo.ranks_on(node) if r not in flagged]
        apart = [r for r in candidates if self._apart(owner, r)]
        return apart[0] if apart else candidates[0] if candidates else first
