"""Rank-side code of the DDP sentinel tests: a tiny DDP loop with no audit step at all, faults
between audits, and a data spike. Runs in the processes tests/ddp_util.py starts (real gloo)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from screener.audit import Auditor, NumericFailure, SDCAlarm
from screener.audit.sentinel import SentinelConfig
from screener.known_answer.engine import faults, synthetic

SEED = 7
SHAPE = dict(vocab=32, d_model=16, n_heads=2, d_ff=32, seq=8, n_layers=1)


def batch_fn(rank: int, step: int) -> tuple:
    """Batches whose third element scales the loss: x1000 on rank 0 at step 6 (a data spike)."""
    tokens, targets = synthetic.batch_for(SEED, rank, step, batch=2, seq=SHAPE["seq"],
                                          vocab=SHAPE["vocab"])
    return tokens, targets, 1000.0 if (rank, step) == (0, 6) else 1.0


@dataclass(frozen=True)
class SpikyBatches:
    """batch_fn with the loss of the listed (rank, step) batches scaled by `factor`: real data
    spikes, which every replay reproduces (picklable, for spawned ranks)."""

    spikes: tuple[tuple[int, int], ...]
    factor: float = 1000.0

    def __call__(self, rank: int, step: int) -> tuple:
        tokens, targets = synthetic.batch_for(SEED, rank, step, batch=2, seq=SHAPE["seq"],
                                              vocab=SHAPE["vocab"])
        return tokens, targets, self.factor if (rank, step) in self.spikes else 1.0


def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    tokens, targets, scale = batch
    return synthetic.compute_loss(model, (tokens, targets)) * scale


def plain_batch_fn(rank: int, step: int) -> tuple:
    """The same batches without any spike."""
    tokens, targets = synthetic.batch_for(SEED, rank, step, batch=2, seq=SHAPE["seq"],
                                          vocab=SHAPE["vocab"])
    return tokens, targets, 1.0


# The top exponent bit of one element of the position embedding's gradient on rank 2 at step
# 6: a finite value near 1e36 that no non-finite check sees (row 0 is in every batch).
def exponent_flip() -> contextlib.AbstractContextManager:
    return faults.inject(faults.FaultSpec("embedding_dense_backward", call=0, element=5, bit=30))


def train(rank: int, world: int, *, alarm_dir: str, steps: int = 8, fault: bool = False,
          persistent: bool = False, data_spike: bool = False, bucket_view: bool = False,
          spec: Optional[dict[str, Any]] = None, sentinel: bool = True, warmup: int = 3,
          batches: Optional[Callable] = None, reduce_nan_at: Optional[int] = None
          ) -> dict[str, Any]:
    """Eight steps, no audit step (audit_every=1000 starting at step 1), the sentinel on.

    fault: the exponent flip on rank 2 at step 6 (or `spec`: rank, step, op, call, element, bit,
    as for faults.FaultSpec); persistent: the fault is still there when the step is rerun."""
    spec = spec or {"rank": 2, "step": 6}
    make = exponent_flip if "op" not in spec else (lambda: faults.inject(faults.FaultSpec(
        spec["op"], call=spec.get("call", 0), element=spec.get("element", 0), bit=spec["bit"])))
    model = synthetic.make_model(SEED, **SHAPE)
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = batches or (batch_fn if data_spike else plain_batch_fn)
    # NaN written into rank 3's bucket inside the all-reduce at step reduce_nan_at (one bucket
    # per step, hook calls counted from step 1): every local gradient stays finite.
    hook = faults.corrupt_allreduce(rank=3, calls={reduce_nan_at - 1}, element=5) \
        if reduce_nan_at else None
    auditor = Auditor(ddp, loss_fn=loss_fn, batch_fn=batches, audit_every=1000, weights_every=0,
                      reduce_hook=hook,
                      alarm_dir=alarm_dir, job="t", start_step=1,
                      sentinel=SentinelConfig(enabled=sentinel, warmup=warmup))
    out: dict[str, Any] = {"rank": rank, "alarm": None, "numeric": None, "steps_done": 0}
    try:
        for step in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            hit = fault and rank == spec["rank"] and step == spec["step"]
            with make() if hit else contextlib.nullcontext():
                loss = loss_fn(ddp, batches(rank, step))
                loss.backward()
            with make() if hit and persistent else contextlib.nullcontext():
                auditor.check_gradients(step, loss)
            opt.step()
            out["steps_done"] += 1
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
    except NumericFailure as e:
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks), "reason": e.reason}
    out["counters"] = dict(auditor.counters)
    auditor.close()
    dist.barrier()
    return out


SCENARIOS = {"transient": dict(fault=True), "persistent": dict(fault=True, persistent=True),
             "data": dict(data_spike=True), "bucket_view_transient": dict(fault=True,
                                                                         bucket_view=True),
             "reduced_nan": dict(reduce_nan_at=5)}


def everything(rank: int, world: int, *, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kwargs in SCENARIOS.items():
        directory = os.path.join(root, name)
        os.makedirs(directory, exist_ok=True)
        result = train(rank, world, alarm_dir=directory, **kwargs)
        dist.barrier()
        result["files"] = [json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]
        out[name] = result
    return out
