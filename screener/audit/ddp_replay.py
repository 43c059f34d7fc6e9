"""DDP's replays: any rank's step recomputed on this rank, outside the training step (ring.replay).

Under DDP every rank holds the whole model, so a replay is local: this rank runs loss_fn on the
unwrapped module with another rank's micro-batch (batch_fn(owner, step)) from that rank's RNG
states and loss scale, and nobody else takes part. Every check that needs a recomputation (check
1's confirmation and its redone reduction, check 2's ring and referee replays and the self-check,
the sentinel's rerun) goes through `LocalReplayer.replay`; who replays whom is ring.py's plan.

`Parameters` is what the checks look at: the weights the vote fingerprints and the gradients the
replays compare (DDP's ignored parameters excluded).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from screener.audit import ring
from screener.audit.alarms import AuditUsageError
from screener.audit.capture import StepState
from screener.audit.topology import Topology

__all__ = ["Parameters", "select_parameters", "LocalReplayer"]

log = logging.getLogger("screener.audit")


@dataclass(frozen=True)
class Parameters:
    """The parameters the checks see, with their names, and the dtype bounding a gradient sum."""

    weight_names: list[str]
    weights: list[torch.nn.Parameter]
    grad_names: list[str]  # the parameters that take gradients, in record order
    grad_params: list[torch.nn.Parameter]
    device: torch.device
    grad_dtype: torch.dtype  # the narrowest gradient dtype: a sum past its largest value overflows

    @property
    def grad_max(self) -> float:
        return float(torch.finfo(self.grad_dtype).max)


def select_parameters(model: torch.nn.Module, module: torch.nn.Module) -> Parameters:
    """The weights the vote checks and the gradients the replay compares (DDP's ignored
    parameters excluded), and the dtype whose range bounds a gradient sum."""
    ignore = set(getattr(model, "parameters_to_ignore", None) or ())
    named = [(n, p) for n, p in module.named_parameters() if n not in ignore]
    if not named:
        raise AuditUsageError("screener.audit: the model has no parameters to audit")
    weights = [p for _, p in named]
    grad_params = [p for _, p in named if p.requires_grad]
    return Parameters(weight_names=[n for n, _ in named], weights=weights,
                      grad_names=[n for n, p in named if p.requires_grad],
                      grad_params=grad_params, device=weights[0].device,
                      grad_dtype=min((p.dtype for p in grad_params or weights),
                                     key=lambda d: torch.finfo(d).max))


def _ddp_forward_context(model: torch.nn.Module) -> Any:
    """The context DDP's own forward runs its module in (DDP._inside_ddp_forward: it names the
    active DDP model to torch.compile). A replay that compiles a new graph of a compiled module
    (a shape the step has not run here) then compiles it as the training step did, split at
    DDP's buckets by dynamo's DDPOptimizer; outside it, one unsplit graph, whose fused kernels
    may round differently. No effect on an eager module."""
    inside = getattr(model, "_inside_ddp_forward", None)
    if inside is None or getattr(model, "_use_python_reducer", False):
        return contextlib.nullcontext()
    return inside()


class LocalReplayer:
    """Recomputes any rank's step here (DDP: replays are local), and knows who replays whom."""

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, params: Parameters,
                 topology: Topology, rank: int, *,
                 loss_fn: Optional[Callable[[torch.nn.Module, Any], Any]],
                 batch_fn: Optional[Callable[[int, int], Any]],
                 accumulation_steps: int, audit_every: int) -> None:
        self.model, self.module, self.params = model, module, params
        self.topology, self.rank = topology, rank
        self.loss_fn, self.batch_fn = loss_fn, batch_fn
        self.accumulation_steps = accumulation_steps
        self.mode = ring.ReplayMode()  # learns once that replays need a backward pass
        # Who replays whose micro-batch (ring.replay_plan), and this rank's share of it.
        self.plan = ring.replay_plan(topology)
        by_replayer: dict[int, list[int]] = {}
        for owner, replayer in sorted(self.plan.items()):
            if replayer is not None:
                by_replayer.setdefault(replayer, []).append(owner)
        self.slot = {o: i for owners in by_replayer.values() for i, o in enumerate(owners)}
        self.my_replays = by_replayer.get(rank, [])
        self.max_replays = max((len(v) for v in by_replayer.values()), default=0)
        self.can_replay = loss_fn is not None and batch_fn is not None and self.max_replays > 0
        if audit_every and not self.can_replay:
            log.warning("screener.audit: ring replay is off (%s)",
                        "needs loss_fn and batch_fn" if loss_fn is None or batch_fn is None
                        else "a single rank has nobody to replay")

    def replay(self, owner: int, step: int, state: Optional[StepState]
               ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """Loss and gradients of `owner`'s step, recomputed here from its states."""
        assert self.batch_fn is not None and self.loss_fn is not None
        batch = self.batch_fn(owner, step)
        with _ddp_forward_context(self.model):
            return ring.replay(self.module, self.params.grad_params, self.loss_fn, batch,
                               device=self.params.device, state=state,
                               accumulation_steps=self.accumulation_steps, mode=self.mode)

    def confirmer(self, owner: int, flagged: set[int]) -> Optional[int]:
        """Who replays a non-finite owner: its ring replayer, else a clean rank on the nearest
        node before the owner's."""
        first = self.plan.get(owner)
        if first is None:
            return None
        topo = self.topology
        home = topo.node_of(owner)
        if first not in flagged and topo.node_of(first) != home:
            return first
        nodes = topo.nodes
        start = nodes.index(home)
        for k in range(1, len(nodes)):
            for r in topo.ranks_on(nodes[(start - k) % len(nodes)]):
                if r not in flagged:
                    return r
        return first
