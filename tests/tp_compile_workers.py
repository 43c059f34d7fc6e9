"""Rank-side code of tests/test_audit_tp_compile.py: FSDP2 x tensor parallel with every
transformer block compiled on its own (torchtitan's order: parallelize_module on mesh["tp"],
then torch.compile(block) or block.compile(), then fully_shard on mesh["dp"]), audited.

A fault cannot come from screener.known_answer.engine.faults here: its TorchDispatchMode is refused
inside torch.compile ("non-infra torch dispatch mode present"). So every block calls an identity
op of ours, `screener_test::fault_point`, which inductor leaves as an extern call between its
own kernels (the same op, the same graph, on healthy and faulty steps alike); armed, it flips a
bit of its output on one rank at one step, in the forward or, through its backward op
`screener_test::fault_point_grad`, in the gradient flowing back through it. The fault lands
inside the compiled graph, and nothing recompiles when it is armed.

Sites: block i's entry (2 i) and the Colwise output shard inside it (2 i + 1). A forward flip
at site 1 reaches the whole TP group through the RowwiseParallel all-reduce; a gradient flip
at site 0 (block 0's entry, going back into the RowwiseParallel token embedding) changes only
this rank's shard of the embedding's gradient.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from screener.audit import Auditor, AuditUsageError, NumericFailure, SDCAlarm
from screener.known_answer.engine import faults


@dataclass(frozen=True)
class Armed:
    """A fault at one site: in the forward or the backward, on one rank at one step."""

    rank: int
    step: int
    site: int
    backward: bool = False
    element: Optional[int] = 3  # None: in a position whose token this rank's embedding holds
    bit: Optional[int] = 22
    mode: str = "flip"


_ARMED: dict[str, Any] = {"fault": None, "rank": -1, "step": -1, "fired": []}


def _maybe(t: torch.Tensor, site: int, backward: bool) -> torch.Tensor:
    out = t.clone()
    f: Optional[Armed] = _ARMED["fault"]
    if (f is not None and f.site == site and f.backward == backward
            and (_ARMED["rank"], _ARMED["step"]) == (f.rank, f.step)):
        _ARMED["fired"].append(faults.apply_to_tensor(out, f.element, mode=f.mode, bit=f.bit))
    return out


@torch.library.custom_op("screener_test::fault_point_grad", mutates_args=())
def fault_point_grad(g: torch.Tensor, site: int) -> torch.Tensor:
    return _maybe(g, site, True)


@fault_point_grad.register_fake
def _(g: torch.Tensor, site: int) -> torch.Tensor:
    return torch.empty_like(g)


@torch.library.custom_op("screener_test::fault_point", mutates_args=())
def fault_point(x: torch.Tensor, site: int) -> torch.Tensor:
    return _maybe(x, site, False)


@fault_point.register_fake
def _(x: torch.Tensor, site: int) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.site = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return fault_point_grad(grad, ctx.site), None


fault_point.register_autograd(_backward, setup_context=_setup)


def settled(x: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a plain tensor. Under tensor parallel it is an
    AsyncCollectiveTensor (the RowwiseParallel all-reduce, or SP's reduce-scatter, not yet
    waited on), and torch 2.13's AOTAutograd unwraps such an input of a compiled block without
    its requires_grad: the block's graph is traced as not needing the input's gradient and the
    embedding's gradient is silently zero on every rank (pytorch/pytorch#191113). An eager op
    waits on it with autograd intact."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return x.clone() if isinstance(x, AsyncCollectiveTensor) else x


class Block(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.norm = torch.nn.RMSNorm(8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = fault_point(x, 2 * self.index)
        h = fault_point(self.up(self.norm(x)), 2 * self.index + 1)
        return x + self.down(torch.nn.functional.silu(h))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.blocks = torch.nn.ModuleList([Block(0), Block(1)])
        self.norm = torch.nn.RMSNorm(8)
        self.out = torch.nn.Linear(8, 32, bias=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = settled(self.emb(t))
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def build(mesh: Any, *, how: str, sequence_parallel: bool) -> Net:
    """TP on mesh["tp"] (sequence parallel: the norms SequenceParallel, activations sharded on
    the sequence between blocks), each block compiled (how: "wrap" is torch.compile(block)
    registered in its place, torchtitan's; "method" is block.compile(); "eager" compiles
    nothing), then fully_shard on mesh["dp"], each block and the root. Without sequence parallel
    the norms' weights are replicated on mesh["tp"] (every parameter on the one 2-D mesh: the
    audit refuses parameters TP left alone on the dp sub-mesh)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, \
        SequenceParallel, parallelize_module

    torch.manual_seed(0)
    model = Net()
    tp = mesh["tp"]
    sp = sequence_parallel
    norm = SequenceParallel() if sp else Replicated()
    parallelize_module(model, tp, {
        "emb": RowwiseParallel(input_layouts=Replicate(),
                               output_layouts=Shard(1) if sp else Replicate()),
        "norm": norm,
        "out": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                               output_layouts=Replicate())})
    for i, block in enumerate(model.blocks):
        parallelize_module(block, tp, {
            "norm": SequenceParallel() if sp else Replicated(),
            "up": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate()),
            "down": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())})
        if how == "wrap":
            block = torch.compile(block, fullgraph=True)
            model.blocks.register_module(str(i), block)
        elif how == "method":
            block.compile(fullgraph=True)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


class Replicated(torch.distributed.tensor.parallel.ParallelStyle):
    """A module TP leaves whole (a norm without sequence parallel): its parameters replicated
    on the TP mesh, its input taken as replicated and its output handed back local."""

    def _apply(self, module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        def inputs(_m: Any, args: tuple, m: Any) -> tuple:
            return tuple(DTensor.from_local(a, m, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                         for a in args)

        def output(_m: Any, out: Any, m: Any) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, mesh, input_fn=inputs, output_fn=output)


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    tokens, targets = batch
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _batch(dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * dp + step)
    return (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))


def _files(directory: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]


def _in_own_rows(fault: Armed, tokens: torch.Tensor, tp: Any) -> Armed:
    """The fault moved to the first position whose token is in this rank's rows of the
    RowwiseParallel embedding (a gradient there reaches this rank's shard; elsewhere it is
    masked out, and the fault changes nothing)."""
    rows = 32 // tp.size()
    lo = tp.get_local_rank() * rows
    flat = tokens.flatten().tolist()
    position = next(i for i, t in enumerate(flat) if lo <= t < lo + rows)
    return replace(fault, element=position * 8 + 3)


def scenarios(rank: int, world: int, *, root: str, how: str = "wrap",
              sequence_parallel: bool = False,
              cases: tuple[tuple[str, Optional[Armed], int], ...] = ()) -> dict[str, Any]:
    """One model, compiled once, through every case in turn: (name, fault, steps), each under
    a fresh Auditor (audit and weight check every step) with its own alarm folder."""
    from torch._dynamo.utils import counters

    # a forked rank inherits the parent's dynamo counters and caches (another test's compiles):
    # count this model's graphs only
    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model = build(mesh, how=how, sequence_parallel=sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {}
    step = 0
    for name, fault, steps in cases:
        directory = os.path.join(root, name)
        os.makedirs(directory, exist_ok=True)
        result: dict[str, Any] = {"alarm": None, "numeric": None, "refused": None,
                                  "steps_done": 0, "fired": []}
        try:
            auditor = Auditor(model, loss_fn=loss_fn, audit_every=1, weights_every=1,
                              alarm_dir=directory, job="t", start_step=step)
        except AuditUsageError as e:
            result["refused"] = str(e)
            out[name] = result
            dist.barrier()
            continue
        _ARMED.update(fault=fault, fired=[], rank=rank)
        times: list[float] = []
        first = step
        try:
            for step in range(first, first + steps):
                _ARMED["step"] = step - first
                opt.zero_grad(set_to_none=True)
                batch = _batch(dp, step)
                if fault is not None and fault.element is None:  # see Armed.element
                    _ARMED["fault"] = _in_own_rows(fault, batch[0], mesh["tp"])
                began = time.monotonic()
                loss = loss_fn(model, batch)
                loss.backward()
                _ARMED["step"] = -1  # replays of this step run clean
                auditor.check_gradients(step, loss, batch=batch)
                opt.step()
                auditor.check_weights(step)
                times.append(round(time.monotonic() - began, 2))
                result["steps_done"] += 1
            step += 1
        except SDCAlarm as a:
            result["alarm"] = a.to_dict()
            result["alarm"]["step"] -= first
            step += 1
        except NumericFailure as e:
            result["numeric"] = e.reason
            step += 1
        result["fired"] = list(_ARMED["fired"])
        result["seconds"] = times
        _ARMED.update(fault=None, fired=[])
        result["counters"] = dict(auditor.counters)
        auditor.close()
        dist.barrier()
        result["files"] = _files(directory)
        out[name] = result
    # a replay that recompiled a block would add a graph (whose kernels could round otherwise)
    out["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                     "graph_breaks": sum(counters["graph_break"].values())}
    return out

