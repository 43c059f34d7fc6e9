"""Rank-side code of the N-D parallel matrix: a Llama-style model under FSDP2 x TP, HSDP x TP and
pipeline parallel x FSDP2, healthy runs and single-bit faults on every rank in turn.

Runs inside the processes tests/ddp_util.py starts (real gloo); returns plain data. The model:
an embedding, blocks of RMSNorm, causal SDPA with rotary positions, SwiGLU, a final norm and the
head (the pipeline setups cut it into stages: tests/pipeline_workers.py). Tensor parallel is
torchtitan's plan in small (wq/wk/wv and w1/w3 column-wise, wo and w2 row-wise, the norms
SequenceParallel and activations sharded on the sequence between blocks; with loss parallel the
logits stay sharded on the vocabulary; tp_no_sp leaves the norms alone, which is refused). tests/test_audit_nd.py runs a slice,
benchmarks/bench_audit_nd.py the campaign.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import pipeline_workers
from pipeline_workers import rotary
from screener.audit import Auditor, AuditError, AuditUsageError, NumericFailure, SDCAlarm
from screener.known_answer.engine import faults

VOCAB, D, HEADS, SEQ, BATCH, LAYERS = 32, 16, 4, 8, 2, 2

# setup -> (process-group shape, what it runs); the shape names the ranks' nodes
TP_SETUPS = ("tp_sp", "tp_sp_lp", "tp_checkpoint", "tp_bf16", "tp_compile", "tp_no_sp")
HSDP_SETUPS = ("hsdp_tp",)
PP_SETUPS = ("pp_gpipe", "pp_1f1b", "pp_checkpoint")
PPTP_SETUPS = ("pp_tp",)  # pp 2 x dp 3 x tp 2, 1F1B, the SwiGLU split inside each stage
SETUPS = TP_SETUPS + HSDP_SETUPS + PP_SETUPS + PPTP_SETUPS
# refused on purpose, in one line: TP without sequence parallel leaves the norms' weights plain
# (on FSDP's dp mesh only, unlike every TP-placed parameter)
REFUSED = ("tp_no_sp",)
# nodes: a TP group per node (dp x tp = 3 x 2); HSDP x TP (2 x 2 x 2): a TP group per node;
# pipelines (pp x dp = 2 x 3): pipeline d on node d
NODES = {"tp": ["n0", "n0", "n1", "n1", "n2", "n2"],
         "hsdp": ["n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3"],
         "pp": ["n0", "n1", "n2", "n0", "n1", "n2"],
         # rank 6 s + 2 d + t: the dp row d (both stages, both TP ranks) on node d
         "pptp": ["n0", "n0", "n1", "n1", "n2", "n2"] * 2}


def group_of(setup: str) -> str:
    return "tp" if setup in TP_SETUPS else "hsdp" if setup in HSDP_SETUPS else \
        "pptp" if setup in PPTP_SETUPS else "pp"


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = D // HEADS
        q, k, v = (w(x).view(b, t, -1, hd) for w in (self.wq, self.wk, self.wv))  # local heads
        q, k = rotary(q), rotary(k)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False)
        self.w2 = nn.Linear(2 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)
        self.checkpointing = checkpointing

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # one eager op before the (compiled) blocks: torch 2.13 drops the gradient of a pending
        # collective's result (an AsyncCollectiveTensor) handed to a compiled block (#191113)
        h = self.tok_embeddings(tokens).clone()
        for layer in self.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False) \
                if self.checkpointing else layer(h)
        return self.output(self.norm(h))


def batch_for(dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dp + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build_tp(setup: str, world: int) -> tuple[nn.Module, Any, int, bool]:
    """The model of a TP setup, parallelized and sharded; (model, mesh, dp index, loss parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, \
        SequenceParallel, parallelize_module

    hsdp = setup in HSDP_SETUPS
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("rep", "shard", "tp"))
        dp_mesh = mesh["rep", "shard"]
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    dp = dp_mesh.get_coordinate()
    dp_index = dp[0] * dp_mesh.mesh.shape[-1] + dp[1] if hsdp and dp else (dp[0] if dp else 0)
    sp = setup != "tp_no_sp"  # torchtitan's plan: sequence parallel whenever TP is on
    lp = setup == "tp_sp_lp"
    torch.manual_seed(0)
    model = Llama(checkpointing=setup == "tp_checkpoint")
    tp = mesh["tp"]
    if sp:
        parallelize_module(model, tp, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1),
                                      output_layouts=Shard(-1) if lp else Replicate(),
                                      use_local_output=not lp)})
    else:
        parallelize_module(model, tp, {"output": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.layers:
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention.wq": ColwiseParallel(input_layouts=Shard(1)),
                "attention.wk": ColwiseParallel(input_layouts=Shard(1)),
                "attention.wv": ColwiseParallel(input_layouts=Shard(1)),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w1": ColwiseParallel(input_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(input_layouts=Shard(1)),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
        parallelize_module(layer, tp, plan)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if setup == "tp_bf16" else MixedPrecisionPolicy()
    for k, layer in enumerate(model.layers):
        if setup == "tp_compile":
            layer.compile(backend=os.environ.get("ND_COMPILE_BACKEND", "aot_eager"))
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model, mesh, dp_index, lp


@dataclass(frozen=True)
class Fault:
    """A fault on one rank: "forward" / "gradient" (a bit of one matmul output at `step`; with
    persistent, every matmul call from then on, the auditor's replays included) or "weight" (a
    bit of the rank's first stored weight shard after the update of `step`). Picklable."""

    kind: str
    rank: int
    step: int = 1
    persistent: bool = False
    call: int = 2
    bit: int = 30

    def op_fault(self, r: int, s: int) -> Optional[contextlib.AbstractContextManager]:
        if self.kind == "weight" or r != self.rank or not (
                s == self.step or (self.persistent and s >= self.step)):
            return None
        return faults.inject(faults.FaultSpec("mm", call=self.call, element=3, bit=self.bit,
                                              persistent=self.persistent))


def _result(out: dict[str, Any], run: Callable[[], None]) -> dict[str, Any]:
    try:
        run()
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
    except NumericFailure as e:
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks), "reason": e.reason}
    except (AuditUsageError, AuditError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def train_tp(rank: int, world: int, *, setup: str, steps: int, alarm_dir: str,
             fault: Optional[Fault] = None) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import loss_parallel

    model, mesh, dp, lp = build_tp(setup, world)
    ctx_lp = loss_parallel if lp else contextlib.nullcontext

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        tokens, target = batch
        logits = m(tokens)
        with ctx_lp():
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {"rank": rank, "alarm": None, "numeric": None, "error": None,
                           "steps_done": 0, "counters": {}}
    try:
        auditor = Auditor(model, loss_fn=loss_fn, audit_every=1, weights_every=1,
                          alarm_dir=alarm_dir, job="nd")
    except AuditUsageError as e:
        out["error"] = f"AuditUsageError: {e}"
        return out

    def run() -> None:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            batch = batch_for(dp, step)
            with (fault.op_fault(rank, step) if fault else None) or contextlib.nullcontext():
                loss = loss_fn(model, batch)
                with ctx_lp():
                    loss.backward()
            again = (fault.op_fault(rank, step) if fault and fault.persistent else None) \
                or contextlib.nullcontext()
            with again:
                auditor.check_gradients(step, loss, batch=batch)
            opt.step()
            auditor.check_weights(step)
            if fault and fault.kind == "weight" and (rank, step) == (fault.rank, fault.step):
                shard = next(model.parameters()).to_local()
                faults.apply_to_tensor(shard.data, 0, mode="flip", bit=fault.bit)
            out["steps_done"] += 1

    _result(out, run)
    out["counters"] = dict(auditor.counters)
    auditor.close()
    return out


def train_pp(rank: int, world: int, *, setup: str, steps: int, alarm_dir: str,
             fault: Optional[Fault] = None) -> dict[str, Any]:
    schedule = "gpipe" if setup == "pp_gpipe" else "1f1b"
    pf = None
    if fault is not None and fault.kind != "weight":
        pf = pipeline_workers.Fault(fault.rank, fault.step, call=fault.call, bit=fault.bit,
                                    persistent=fault.persistent)
    flip = (fault.rank, fault.step) if fault is not None and fault.kind == "weight" else None
    got = pipeline_workers.train(rank, world, pp=2, steps=steps, schedule=schedule,
                                 alarm_dir=alarm_dir, fault=pf, shard_flip=flip,
                                 checkpointing=setup == "pp_checkpoint",
                                 tp=2 if setup in PPTP_SETUPS else 1)
    got["error"] = got.pop("usage")
    return got


def run_setup(rank: int, world: int, *, setup: str, steps: int, alarm_dir: str,
              fault: Optional[Fault] = None) -> dict[str, Any]:
    train = train_pp if setup in PP_SETUPS + PPTP_SETUPS else train_tp
    out = train(rank, world, setup=setup, steps=steps, alarm_dir=alarm_dir, fault=fault)
    dist.barrier()
    out["files"] = [json.loads(p.read_text()) for p in sorted(Path(alarm_dir).glob("*.json"))]
    return out


def campaign(rank: int, world: int, *, root: str, setups: list[str], steps: int,
             faults: list[tuple[str, Fault]]) -> dict[str, Any]:
    """Every healthy setup for `steps` steps, then every (setup, fault), in one process group."""
    out: dict[str, Any] = {"healthy": {}, "faults": []}
    for setup in setups:
        d = os.path.join(root, f"healthy-{setup}")
        os.makedirs(d, exist_ok=True)
        out["healthy"][setup] = run_setup(rank, world, setup=setup, steps=steps, alarm_dir=d)
    for k, (setup, fault) in enumerate(faults):
        d = os.path.join(root, f"fault-{k}")
        os.makedirs(d, exist_ok=True)
        got = run_setup(rank, world, setup=setup, steps=fault.step + 2, alarm_dir=d, fault=fault)
        out["faults"].append({"setup": setup, "fault": fault.__dict__, **got})
    return out
