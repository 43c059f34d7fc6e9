"""Rank-side code of the pipeline-parallel audit tests: a small Llama-style model cut into stages.

Runs inside the processes tests/ddp_util.py starts (real gloo); returns plain data. The job is a
(pp, dp) grid from init_device_mesh: stage s of pipeline d is rank s * dp + d; each stage's
module is sharded with fully_shard over mesh["dp"] (per block, then the stage), and
torch.distributed.pipelining runs ScheduleGPipe or Schedule1F1B over mesh["pp"]. Stage 0 holds the
embedding, the last stage the final norm and the head; every stage a pre-norm block (RMSNorm,
causal SDPA with rotary positions, SwiGLU), with dropout and optional activation checkpointing.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel

from screener.audit import Auditor, AuditUsageError, NumericFailure, SDCAlarm
from screener.audit.sentinel import SentinelConfig
from screener.known_answer.engine import faults

VOCAB, D, HEADS, SEQ, BATCH, MICRO = 32, 16, 2, 8, 4, 2


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (batch, seq, heads, head_dim)."""
    t, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    cos, sin = ang.cos()[None, :, None, :].to(x.dtype), ang.sin()[None, :, None, :].to(x.dtype)
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.gate, self.up = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(2 * D, D, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, HEADS, D // HEADS).unbind(2)
        q, k = rotary(q), rotary(k)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + F.dropout(self.o(a.transpose(1, 2).reshape(b, t, D)), self.dropout, self.training)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Stage(nn.Module):
    def __init__(self, s: int, stages: int, *, dropout: float = 0.1,
                 checkpointing: bool = False) -> None:
        super().__init__()
        torch.manual_seed(100 + s)
        self.embed = nn.Embedding(VOCAB, D) if s == 0 else None
        self.block = Block(dropout)
        self.norm = nn.RMSNorm(D) if s == stages - 1 else None
        self.head = nn.Linear(D, VOCAB, bias=False) if s == stages - 1 else None
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        if self.checkpointing:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        if self.head is not None:
            assert self.norm is not None
            return self.head(self.norm(h))
        return h


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1))


def batch_for(pipeline: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * pipeline + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@dataclass(frozen=True)
class Fault:
    """One bit of one op output on one rank at one step (persistent: every step from then on,
    the auditor's replays included); picklable."""

    rank: int
    step: int
    op: str = "mm"
    call: int = 1
    element: int = 3
    bit: Optional[int] = 30
    mode: str = "flip"
    persistent: bool = False
    factor: float = 2.0  # mode "scale"
    value: float = 0.0  # mode "set"
    every_call: bool = False  # every call from `call` on, in its step alone (not persistent)

    def at(self, r: int, s: int) -> Optional[contextlib.AbstractContextManager]:
        if r == self.rank and (s == self.step or (self.persistent and s >= self.step)):
            return faults.inject(faults.FaultSpec(self.op, call=self.call, element=self.element,
                                                  bit=self.bit, mode=self.mode,
                                                  persistent=self.persistent or self.every_call,
                                                  factor=self.factor, value=self.value))
        return None


def train(rank: int, world: int, *, pp: int, steps: int, schedule: str = "gpipe",
          audit_every: int = 1, alarm_dir: str, fault: Optional[Fault] = None,
          checkpointing: bool = False, plain_stage: bool = False, ddp: bool = False,
          weights_every: int = 1, shard_flip: Optional[tuple[int, int]] = None, tp: int = 1,
          sentinel: Optional[SentinelConfig] = None) -> dict[str, Any]:
    dp = world // pp // tp
    if tp > 1:  # rank s * dp * tp + d * tp + t; the TP partners of a stage share its batch
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = Stage(s, pp, checkpointing=checkpointing)
    wrapped: nn.Module = model
    if tp > 1:  # the SwiGLU split Megatron-style: gate and up by columns, down by rows
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        parallelize_module(model.block, mesh["tp"], {
            "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    if ddp:
        wrapped = DistributedDataParallel(model, process_group=mesh["dp"].get_group(),
                                          static_graph=True)  # pipelining needs it (torch 2.13)
    elif not plain_stage:
        fully_shard(model.block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    stage = PipelineStage(wrapped, s, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {"rank": rank, "stage": s, "pipeline": d, "alarm": None,
                           "numeric": None, "usage": None, "steps_done": 0, "counters": {}}
    try:
        auditor = Auditor(sched, audit_every=audit_every, weights_every=weights_every,
                          alarm_dir=alarm_dir, job="pp", sentinel=sentinel)
    except AuditUsageError as e:
        out["usage"] = str(e)
        return out
    try:
        for step in range(steps):
            tokens, target = batch_for(d, step)
            losses: list[torch.Tensor] = []
            with (fault.at(rank, step) if fault else None) or contextlib.nullcontext():
                if s == 0:
                    sched.step(tokens)
                elif s == pp - 1:
                    sched.step(target=target, losses=losses)
                else:
                    sched.step()
            batch = tokens if s == 0 else target if s == pp - 1 else None
            again = (fault.at(rank, step) if fault and fault.persistent else None) \
                or contextlib.nullcontext()
            with again:
                auditor.check_gradients(step, losses, batch=batch)
            opt.step()
            opt.zero_grad(set_to_none=True)
            auditor.check_weights(step)
            if shard_flip is not None and (rank, step) == shard_flip:  # a bit of a stored shard
                faults.apply_to_tensor(next(model.parameters()).to_local().data, 0,
                                       mode="flip", bit=30)
            out["steps_done"] += 1
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
    except NumericFailure as e:
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks), "reason": e.reason}
    out["counters"] = dict(auditor.counters)
    auditor.close()
    return out


SCENARIOS: dict[str, dict[str, Any]] = {
    "gpipe_healthy": dict(pp=2, steps=3, schedule="gpipe"),
    "1f1b_healthy": dict(pp=2, steps=3, schedule="1f1b", checkpointing=True),
    # stage 1 of pipeline 1 (node n2): a forward matmul output, exponent bit, at step 2
    "forward_flip": dict(pp=2, steps=3, schedule="1f1b", fault=Fault(4, 2, call=1)),
    # stage 0 of pipeline 0 (node n1): a backward matmul (a weight gradient), mantissa bit
    "backward_flip": dict(pp=2, steps=2, schedule="gpipe", fault=Fault(0, 1, call=25, bit=20)),
    # stage 0 of pipeline 2 (node n3): the same unit wrong from step 1 on, in its replays too
    "persistent": dict(pp=2, steps=2, schedule="1f1b",
                       fault=Fault(2, 1, call=2, bit=27, persistent=True)),
    # a NaN in stage 1 of pipeline 0 (node n1) at step 1, no audits
    "nan": dict(pp=2, steps=2, schedule="gpipe", audit_every=0,
                fault=Fault(3, 1, call=2, bit=None, mode="nan")),
    # a flip in rank 5's stored shard (stage 1, pipeline 2, node n3) after step 0's update
    "shard_flip": dict(pp=2, steps=2, audit_every=0, shard_flip=(5, 0)),
    # the spike sentinel between audits (audits: the 3 warm-up steps; step 0 self-checks)
    "spike_healthy": dict(pp=2, steps=8, audit_every=100, sentinel=SentinelConfig(warmup=3)),
    # every matmul output of rank 1 (stage 0, pipeline 1, node n2) x 1e4 in step 5's schedule
    # step alone: its reruns are clean (the gradient spikes; transient)
    "spike_transient": dict(pp=2, steps=8, audit_every=100, sentinel=SentinelConfig(warmup=3),
                            fault=Fault(1, 5, call=1, bit=None, mode="scale", factor=1e4,
                                        every_call=True)),
    # the same on rank 4 (stage 1, pipeline 1, node n2) from step 5 on, its replays too (the
    # loss spikes; persistent)
    "spike_persistent": dict(pp=2, steps=8, audit_every=100, sentinel=SentinelConfig(warmup=3),
                             fault=Fault(4, 5, call=1, bit=None, mode="scale", factor=1e4,
                                         persistent=True)),
    "plain_stage": dict(pp=2, steps=1, plain_stage=True),
    "ddp_stage": dict(pp=2, steps=1, ddp=True),
}


# pp 2 x dp 3 x tp 2 (rank 6 s + 2 d + t): the TP pair of a stage on one node
TP_SCENARIOS: dict[str, dict[str, Any]] = {
    "tp_healthy": dict(pp=2, tp=2, steps=3, schedule="1f1b"),
    # rank 9 (stage 1, dp 1, tp 1; node n2): its up projection's output shard, exponent bit,
    # at step 1: the RowwiseParallel all-reduce hands it to rank 8, its TP partner
    "tp_forward_flip": dict(pp=2, tp=2, steps=2, schedule="gpipe",
                            fault=Fault(9, 1, call=2, bit=30)),
    # a weight-gradient bit of rank 2 (stage 0, dp 1, tp 0; node n2) at step 1: its partner's
    # records stay clean, and the referee replays the pair as one all the same
    "tp_backward_flip": dict(pp=2, tp=2, steps=2, schedule="gpipe",
                             fault=Fault(2, 1, call=10, bit=20)),
    # an exponent bit of rank 3's (stage 0, dp 1, tp 1; node n2) second matmul from
    # step 1 on, its replays too: finite in its forward, it overflows in stage 1's backward
    "tp_overflow": dict(pp=2, tp=2, steps=2, schedule="1f1b",
                        fault=Fault(3, 1, call=2, bit=30, persistent=True)),
    # a NaN from rank 2's (stage 0, dp 1, tp 0; node n2) first matmul at step 1, no audits
    "tp_nan": dict(pp=2, tp=2, steps=2, schedule="gpipe", audit_every=0,
                   fault=Fault(2, 1, call=1, bit=None, mode="nan")),
}


def everything(rank: int, world: int, *, root: str, only: Optional[list[str]] = None,
               scenarios: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Any]:
    """Every scenario in one process group (starting ranks is the expensive part)."""
    out: dict[str, Any] = {}
    for name, kwargs in (SCENARIOS if scenarios is None else scenarios).items():
        if only and name not in only:
            continue
        directory = os.path.join(root, name)
        os.makedirs(directory, exist_ok=True)
        result = train(rank, world, alarm_dir=directory, **kwargs)
        dist.barrier()
        result["files"] = [json.loads(p.read_text())
                           for p in sorted(Path(directory).glob("*.json"))]
        out[name] = result
    return out
