"""Train a small Llama-style model with FSDP2 x tensor parallel on a 2-D (dp, tp) mesh, or with
pipeline parallel x FSDP2 on a (dp, pp) mesh (--pp), under screener.audit.

Runs on CPU with gloo under torchrun; --nodes N simulates N Kubernetes nodes on this machine by
setting NODE_NAME per rank from LOCAL_RANK (HyperPod-style names, `hyperpod-i-<hex>`). The model
(RMSNorm, rotary position embeddings, causal scaled_dot_product_attention, a SwiGLU MLP, an untied
head) is split by tensor parallel along mesh["tp"] (`parallelize_module`, torchtitan's plan in
small), each block optionally compiled on its own (--compile), then sharded with `fully_shard` on
mesh["dp"], each block and the root. TP partners get the same batch (it follows the dp index);
the loop hands it to `check_gradients(step, loss, batch=batch)`.

    screener launch -- torchrun --nproc-per-node 6 examples/train_nd.py --nodes 3 --tp 2 \\
        --inject flip:rank=3,step=5
    # ... ALARM: SDC alarm ring_replay at step 5: rank 2, rank 3 on hyperpod-i-00000000000000002 ...
    # ... exit code 75

Layout: ranks are laid out row by row on the (dp, tp) mesh, so TP group d is ranks d*tp ..
d*tp + tp - 1; each simulated node must hold whole TP groups (nproc-per-node / nodes a multiple
of --tp), as the audit needs (its replays move whole TP groups from node to node).

Options: --sequence-parallel (the norms SequenceParallel, activations sharded on the sequence
between blocks), --loss-parallel (the head's logits left sharded on the vocabulary, the
cross-entropy and its backward under loss_parallel()), --compile (torch.compile of every block,
after TP and before fully_shard, as torchtitan does).

Pipeline parallel (--pp 2): the blocks are cut into stages (stage 0 with the
embedding, the last with the norm and the head), each stage sharded with fully_shard over the
ranks that hold it (mesh["dp"]), torch.distributed.pipelining runs --schedule (gpipe or 1f1b,
--microbatches) over mesh["pp"], and the Auditor is given the schedule: Auditor(schedule). Ranks
are laid out dp-major, so pipeline d is ranks d*pp .. d*pp + pp - 1: with as many ranks per node
as stages, a pipeline per node, and the audit replays pipeline d on pipeline d + 1.

    screener launch -- torchrun --nproc-per-node 6 examples/train_nd.py --nodes 3 --tp 1 \
        --pp 2 --inject flip:rank=3,step=5
    # ... ALARM: SDC alarm ring_replay at step 5: rank 3 on hyperpod-i-00000000000000002 ...

With --tp 2 as well (pp x tp inside each pipeline: ranks dp-major, then stage, then TP rank), each
block of a stage is split Megatron-style (attention and SwiGLU column- then row-wise) over
mesh["tp"]; the audit replays a TP group of pipelines on another group, coordinate by coordinate.

    screener launch -- torchrun --nproc-per-node 12 examples/train_nd.py --nodes 3 --tp 2 \
        --pp 2 --inject flip:rank=7,step=5
    # ... ALARM: SDC alarm ring_replay at step 5: rank 6, rank 7 on hyperpod-i-00000000000000002 ...

Faults (--inject KIND[:rank=R,step=S]): one element of rank R's token embedding output (the
residual stream entering block 0; under --pp, the residual stream entering rank R's stage) at
step S. Under TP rank R's TP partners compute with it through the group's collectives, so the
alarm names R's TP group, all on R's node; under PP it names rank R, at its stage.
    flip   mantissa bit 22 (the top one)   -> ring_replay, R's TP group, settled (3 nodes or more)
           (S must be an audit step: a multiple of --audit-every, or one of the first 20)
    nan    NaN                             -> nonfinite_local, R's TP group
    none   a healthy run (the default): exit code 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle,
                                               PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel,
                                               parallelize_module)

from screener.audit import Auditor, SDCAlarm, run_guarded, shutdown
from screener.alarmfile import AlarmRecord
from screener.types import ALARM_DIR_ENV, NODE_NAME_ENV

KINDS = ("none", "flip", "nan")
VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 64, 32, 4, 64, 2, 16, 2
PIPELINE = (f"--pp: the {LAYERS} blocks split evenly over the stages: --pp 2 (or 1, no "
            f"pipeline)")


# ---- the model: Llama in small -----------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq, head_dim)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = DIM // HEADS
        # -1 heads: under TP this rank's share of them (wq, wk, wv are ColwiseParallel)
        q, k, v = (w(x).view(b, t, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), SwiGLU()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def settled(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor for what enters the first compiled block. Under TP the embedding's output
    is an AsyncCollectiveTensor (its all-reduce or reduce-scatter not yet waited on), and torch
    2.13's AOTAutograd unwraps such an input of a compiled region without its requires_grad:
    the embedding's gradient is then silently zero, on every rank alike, which no audit can see
    (pytorch/pytorch#191113). An eager op waits on it with autograd intact."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return x.clone() if isinstance(x, AsyncCollectiveTensor) else x


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.fault: Callable[[torch.Tensor], torch.Tensor] = lambda x: x  # --inject, per step

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # a pipeline stage (stage_of) holds some of the parts: hidden states in, hidden out
        cos, sin = rotary(tokens.shape[1], DIM // HEADS)
        embed = self.tok_embeddings
        x = self.fault(settled(embed(tokens)) if embed is not None else tokens)
        for block in self.layers.values():
            x = block(x, cos, sin)
        if self.output is None:
            return x
        assert self.norm is not None
        return self.output(self.norm(x))


def stage_of(model: Llama, stage: int, stages: int) -> Llama:
    """The part of the model stage `stage` of `stages` runs (torchtitan's cut: the others
    deleted): an even share of the blocks; the embedding on the first, the head on the last."""
    per = LAYERS // stages
    for name in list(model.layers):
        if not stage * per <= int(name) < (stage + 1) * per:
            del model.layers[name]
    if stage:
        model.tok_embeddings = None  # type: ignore[assignment]
    if stage < stages - 1:
        model.norm = model.output = None  # type: ignore[assignment]
    return model


# ---- the parallel plan --------------------------------------------------------------------------

class Replicated(ParallelStyle):
    """A module TP leaves whole (a norm without sequence parallel): its weights replicated on
    the TP mesh, so that every parameter lives on the one (dp, tp) mesh (the audit refuses
    parameters left on the dp sub-mesh: it could not tell which ranks hold the same ones)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def inputs(_m: Any, args: tuple, m: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(a, m, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                         for a in args)

        def output(_m: Any, out: Any, m: DeviceMesh) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, mesh, input_fn=inputs, output_fn=output)


def parallelize(model: Llama, mesh: DeviceMesh, args: argparse.Namespace) -> Llama:
    """TP on mesh["tp"], each block compiled (--compile), then fully_shard on mesh["dp"]."""
    tp, sp = mesh["tp"], args.sequence_parallel
    seq = Shard(1) if sp else Replicate()  # the residual stream between blocks
    norm: Callable[[], ParallelStyle] = SequenceParallel if sp else Replicated
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": norm(),
        "output": ColwiseParallel(input_layouts=seq,
                                  output_layouts=Shard(-1) if args.loss_parallel else Replicate(),
                                  use_local_output=not args.loss_parallel)})
    for name, block in list(model.layers.items()):
        plan: dict[str, ParallelStyle] = {
            "attention_norm": norm(),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "ffn_norm": norm(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:  # the norms hand on sequence shards: all-gather them before the projections
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                   desired_input_layouts=(Replicate(), None,
                                                                          None),
                                                   use_local_output=True)
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
        parallelize_module(block, tp, plan)
        if args.compile:  # per block, as torchtitan: after TP, before fully_shard
            model.layers[name] = torch.compile(block, fullgraph=True)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


# ---- the loop -----------------------------------------------------------------------------------

def parse_inject(text: str) -> dict[str, Any]:
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"--inject {text!r}: kind must be one of "
                                         f"{', '.join(KINDS)}")
    spec: dict[str, Any] = {"kind": kind, "rank": 1, "step": 5}
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key not in ("rank", "step") or not value.isdigit():
            raise argparse.ArgumentTypeError(f"--inject {text!r}: expected rank=R,step=S")
        spec[key] = int(value)
    return spec


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    head, _, rest = (__doc__ or "").partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=0,
                   help="simulate this many nodes (sets NODE_NAME per rank); 0 keeps NODE_NAME")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (the mesh's tp)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (2): pipeline parallel x FSDP2 (x TP with --tp 2)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b",
                   help="the pipeline schedule under --pp")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per step (--pp)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--loss-parallel", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile every block")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--audit-every", type=int, default=5)
    p.add_argument("--weights-every", type=int, default=10)
    p.add_argument("--alarm-dir", default=None, help=f"sets {ALARM_DIR_ENV}; default: a temp dir")
    p.add_argument("--inject", type=parse_inject, default=parse_inject("none"),
                   metavar="KIND[:rank=R,step=S]", help="a fault to inject (see below)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def say(*parts: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(*parts, flush=True)


def batch_for(seed: int, dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dp index's micro-batch of a step (TP partners share it): tokens and next tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + dp * 10_007 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_context(args: argparse.Namespace) -> Callable[[], Any]:
    return loss_parallel if args.loss_parallel else contextlib.nullcontext


def make_loss_fn(args: argparse.Namespace) -> Callable[[nn.Module, Any], torch.Tensor]:
    ctx = loss_context(args)

    def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        tokens, targets = batch
        logits = model(tokens)
        with ctx():  # loss parallel: the cross-entropy of vocabulary-sharded logits
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return compute_loss


def fault_for(kind: str, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """One element of this rank's embedding output, flipped (mantissa bit 22: a value up to
    twice as large, never an overflow) or made NaN."""
    def fault(x: torch.Tensor) -> torch.Tensor:
        bad = x.detach().clone().reshape(-1)
        before = bad[5].item()
        if kind == "flip":
            bad[5:6].view(torch.int32).bitwise_xor_(1 << 22)
        else:
            bad[5] = float("nan")
        print(f"rank {rank}: fault in the embedding output element 5: {before!r} -> "
              f"{bad[5].item()!r}", flush=True)
        where = torch.zeros(bad.numel(), dtype=torch.bool)
        where[5] = True
        return torch.where(where.view_as(x), bad.view_as(x), x)  # out of place, exact bits

    return fault


def value_of(loss: torch.Tensor) -> float:
    return float(loss.to_local() if isinstance(loss, DTensor) else loss)


def train_pipeline(args: argparse.Namespace) -> int:
    """--pp: the blocks cut into stages, FSDP2 per stage, the Auditor given the schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    tp = max(1, args.tp)
    if world % (args.pp * tp):
        print(f"--pp {args.pp} --tp {tp}: the {world} ranks do not split into pipelines of "
              f"{args.pp} stages of {tp} ranks", file=sys.stderr, flush=True)
        return 2
    if tp > 1:  # dp-major, then the stage, then the TP rank: a stage's TP group side by side
        mesh = init_device_mesh("cpu", (world // (args.pp * tp), args.pp, tp),
                                mesh_dim_names=("dp", "pp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
    dp, s = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    first, last = s == 0, s == args.pp - 1
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = stage_of(Llama(), s, args.pp)
    for block in model.layers.values():
        if tp > 1:  # Megatron's split inside each block; norms, embedding and head left whole
            parallelize_module(block, mesh["tp"], {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    stage = PipelineStage(model, s, args.pp, torch.device("cpu"), group=mesh["pp"].get_group())
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=args.microbatches,
                    loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    auditor = Auditor(schedule, audit_every=args.audit_every, weights_every=args.weights_every)
    say(f"topology: {json.dumps(auditor.topology.to_dict()['nodes'])}")
    say(f"mesh ({', '.join(mesh.mesh_dim_names or ())}) = {tuple(mesh.mesh.shape)}; "
        f"pipelines {mesh.mesh.tolist()}; {args.schedule}, {args.microbatches} micro-batches")
    inject = args.inject
    try:
        for step in range(args.steps):
            tokens, targets = batch_for(args.seed, dp, step)
            mine = inject["kind"] != "none" and (rank, step) == (inject["rank"], inject["step"])
            model.fault = fault_for(inject["kind"], rank) if mine else (lambda x: x)
            losses: list[torch.Tensor] = []
            if first:
                schedule.step(tokens)
            elif last:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            model.fault = lambda x: x  # the audit's replays of this step run clean
            batch = tokens if first else targets if last else None
            auditor.check_gradients(step, losses, batch=batch)
            opt.step()
            opt.zero_grad(set_to_none=True)
            auditor.check_weights(step)
            if last and dp == 0 and step % 5 == 0:
                mean = float(torch.stack([x.detach() for x in losses]).mean())
                print(f"step {step:4d}  loss {mean:.4f}", flush=True)
    except SDCAlarm as alarm:
        report_alarm(alarm)
        raise
    finally:
        auditor.close()
    say(f"done: {args.steps} steps, no alarm; counters {dict(auditor.counters)}")
    return 0


def report_alarm(alarm: SDCAlarm) -> None:
    """Rank 0 prints the alarm and the alarm files (every rank is at the barrier: written)."""
    dist.barrier()
    say(f"\nALARM: {alarm}")
    if dist.get_rank() == 0:
        for f in sorted(Path(os.environ[ALARM_DIR_ENV]).glob("*.json")):
            rec = AlarmRecord.from_dict(json.loads(f.read_text()))
            print(f"alarm file {f}: node {rec.node} settled={rec.settled} "
                  f"suspect_ranks={list(rec.suspect_ranks)}", flush=True)


def train(args: argparse.Namespace) -> int:
    if args.pp > 1:
        return train_pipeline(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.tp < 1 or world % args.tp:
        print(f"--tp {args.tp}: the {world} ranks do not split into TP groups of {args.tp}",
              file=sys.stderr, flush=True)
        return 2
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = parallelize(Llama(), mesh, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compute_loss = make_loss_fn(args)
    auditor = Auditor(model, loss_fn=compute_loss, audit_every=args.audit_every,
                      weights_every=args.weights_every)
    say(f"topology: {json.dumps(auditor.topology.to_dict()['nodes'])}")
    say(f"mesh (dp, tp) = {tuple(mesh.mesh.shape)}; TP groups {mesh.mesh.tolist()}")
    inject, ctx = args.inject, loss_context(args)
    try:
        for step in range(args.steps):
            opt.zero_grad(set_to_none=True)
            batch = batch_for(args.seed, dp, step)
            mine = inject["kind"] != "none" and (rank, step) == (inject["rank"], inject["step"])
            model.fault = fault_for(inject["kind"], rank) if mine else (lambda x: x)
            loss = compute_loss(model, batch)
            with ctx():
                loss.backward()
            model.fault = lambda x: x  # the audit's replays of this step run clean
            auditor.check_gradients(step, loss, batch=batch)
            opt.step()
            auditor.check_weights(step)
            if step % 5 == 0:
                say(f"step {step:4d}  loss {value_of(loss.detach()):.4f}")
    except SDCAlarm as alarm:
        report_alarm(alarm)
        raise
    finally:
        auditor.close()
    say(f"done: {args.steps} steps, no alarm; counters {dict(auditor.counters)}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.pp < 1 or LAYERS % args.pp:
        # before any process group: one line, exit 2 (a usage error)
        print(PIPELINE, file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(1)  # bit-identical replays need the same thread count on every rank
    if args.nodes:
        local, nproc = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        os.environ[NODE_NAME_ENV] = f"hyperpod-i-{local * args.nodes // nproc + 1:017x}"
    dist.init_process_group("gloo")
    created: list[str] = []  # a temporary alarm folder of ours, removed at the end
    try:
        if ALARM_DIR_ENV not in os.environ or args.alarm_dir:
            box = [args.alarm_dir]
            if box[0] is None and dist.get_rank() == 0:
                box = [tempfile.mkdtemp(prefix="screener-alarms-")]
                created.append(box[0])
            dist.broadcast_object_list(box, src=0)
            Path(box[0]).mkdir(parents=True, exist_ok=True)
            os.environ[ALARM_DIR_ENV] = box[0]
        say(f"alarm directory: {os.environ[ALARM_DIR_ENV]}")
        code = run_guarded(train, args)
        say(f"exit code {code}")
        for d in created:
            shutil.rmtree(d, ignore_errors=True)
            say(f"removed {d} (pass --alarm-dir to keep the alarm files)")
    except BaseException:
        shutdown(1)
        raise
    return shutdown(code)


if __name__ == "__main__":
    sys.exit(main())
