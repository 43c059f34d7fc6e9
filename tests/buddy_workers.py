"""Rank-side code of the update buddy's tests: a small FSDP2 loop, an optimizer, faults on cue.

Runs inside the processes tests/ddp_util.py starts (real gloo); returns plain data. The model is a
two-layer MLP, each Linear and the root sharded with `fully_shard` on a 1-D mesh over every rank
(pure FSDP2: the optimizer update of a shard is made on one rank only). The loop:

    backward; check_gradients(step, loss, batch=x); optimizer.step(); [fault]; scheduler.step();
    check_weights(step)
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from screener.audit import Auditor, AuditUsageError, NumericFailure, SDCAlarm
from screener.audit.sentinel import SentinelConfig
from screener.audit.update_buddy import sample_plan
from screener.known_answer.engine import faults

SEED = 11
WIDTH = (16, 48, 8)


def build(world: int, *, bf16: bool = False, hsdp: bool = False) -> torch.nn.Module:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH[0], WIDTH[1]), torch.nn.Tanh(),
                                torch.nn.Linear(WIDTH[1], WIDTH[2]))
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard")) \
        if hsdp else init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def batch_for(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED * 10_007 + rank * 101 + step)
    return torch.randn(4, WIDTH[0], generator=g)


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().pow(2).mean()


def make_optimizer(kind: str, params: Any, **kw: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kw)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, **kw)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9, **kw)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-2)
    raise ValueError(kind)


@dataclass(frozen=True)
class Flip:
    """After optimizer.step() at `step` (every step from it on when persistent), flip `bit` of
    one element of parameter `param`'s shard on `rank`, or of its optimizer state `state`: an
    update computed wrong. sampled: the element the buddy samples at that step, or one it does
    not."""

    rank: int
    step: int
    bit: int = 22
    param: int = 0
    state: Optional[str] = None
    persistent: bool = False
    sampled: bool = True

    def __call__(self, rank: int, step: int, model: Any, opt: Any, auditor: Any) -> None:
        if rank != self.rank or not (step == self.step or (self.persistent and step > self.step)):
            return
        p = list(model.parameters())[self.param]
        where = sample_plan(step, auditor.buddy.sizes, auditor.buddy.sample)[self.param]
        if self.sampled:
            element = int(where[0])
        else:
            taken = set(where.tolist())
            element = next(i for i in range(p.to_local().numel()) if i not in taken)
        target = p if self.state is None else opt.state[p][self.state]
        faults.apply_to_tensor(target.to_local().data.view(-1), element, mode="flip",
                               bit=self.bit)


@dataclass(frozen=True)
class OpFault:
    """A fault in an op of the optimizer's own step (`where` = "step") on `rank` at `step`, or
    in the buddy's recomputation (`where` = "check", around check_weights)."""

    rank: int
    step: int
    where: str = "step"
    op: str = "addcdiv_"
    element: int = 0
    bit: int = 22
    sampled_param: Optional[int] = None  # aim at the first element the buddy samples of it

    def context(self, rank: int, step: int, where: str, auditor: Any
                ) -> contextlib.AbstractContextManager:
        if (rank, step, where) != (self.rank, self.step, self.where):
            return contextlib.nullcontext()
        element = self.element
        if self.sampled_param is not None:
            element = int(sample_plan(step, auditor.buddy.sizes,
                                      auditor.buddy.sample)[self.sampled_param][0])
        call = 0 if self.sampled_param is None else self.sampled_param
        return faults.inject(faults.FaultSpec(self.op, call=call, element=element,
                                              bit=self.bit))


@dataclass(frozen=True)
class Scenario:
    steps: int
    optimizer: str = "adamw"
    options: dict[str, Any] = field(default_factory=dict)
    audit_every: int = 1
    weights_every: int = 0  # the weight check (its all-gathers) off unless asked for
    bf16: bool = False
    hsdp: bool = False  # a (replicate, shard) mesh instead of pure FSDP2
    ring: bool = False  # the ring replay too (loss_fn given)
    schedule: bool = False  # an lr scheduler that changes lr every step
    sample: Optional[int] = None
    fault: Optional[Callable[..., None]] = None
    op_fault: Optional[OpFault] = None
    late_fault: Optional[Callable[..., None]] = None  # after check_weights: at rest


def train(rank: int, world: int, s: Scenario, alarm_dir: str) -> dict[str, Any]:
    model = build(world, bf16=s.bf16, hsdp=s.hsdp)
    opt = make_optimizer(s.optimizer, model.parameters(), **s.options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.37 * k)) \
        if s.schedule else None
    extra = {} if s.sample is None else {"update_sample": s.sample}
    out: dict[str, Any] = {"rank": rank, "alarm": None, "numeric": None, "usage": None,
                           "steps_done": 0}
    try:
        auditor = Auditor(model, loss_fn=loss_fn if s.ring else None, audit_every=s.audit_every,
                          weights_every=s.weights_every, alarm_dir=alarm_dir, job="b", optimizer=opt,
                          sentinel=SentinelConfig(enabled=False), **extra)
    except AuditUsageError as e:
        out["usage"] = str(e)
        return out
    try:
        for step in range(s.steps):
            opt.zero_grad(set_to_none=True)
            x = batch_for(rank, step)
            loss = loss_fn(model, x)
            loss.backward()
            auditor.check_gradients(step, loss, batch=x)
            op = s.op_fault
            with op.context(rank, step, "step", auditor) if op else contextlib.nullcontext():
                opt.step()
            if s.fault is not None:
                s.fault(rank, step, model, opt, auditor)
            if sched is not None:
                sched.step()
            with op.context(rank, step, "check", auditor) if op else contextlib.nullcontext():
                auditor.check_weights(step)
            if s.late_fault is not None:
                s.late_fault(rank, step, model, opt, auditor)
            out["steps_done"] += 1
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
    except NumericFailure as e:
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks), "reason": e.reason}
    out["counters"] = dict(auditor.counters)
    auditor.close()
    return out


def _files(directory: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]


def scenarios(rank: int, world: int, *, root: str, plan: dict[str, Scenario]
              ) -> dict[str, Any]:
    """Every scenario of `plan` in one process group (starting ranks is the expensive part)."""
    out: dict[str, Any] = {}
    for name, s in plan.items():
        directory = os.path.join(root, name)
        os.makedirs(directory, exist_ok=True)
        result = train(rank, world, s, directory)
        dist.barrier()
        result["files"] = _files(directory)
        out[name] = result
    return out


def ddp_refusal(rank: int, world: int) -> str:
    """Auditor(ddp_model, optimizer=...): the buddy is the sharded auditors'; a one-line refusal."""
    from screener.audit import Auditor, AuditUsageError

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    try:
        Auditor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    except AuditUsageError as e:
        return str(e)
    return "accepted"
