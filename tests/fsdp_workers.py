"""Rank-side code of the FSDP2/HSDP audit tests: a tiny sharded training loop with faults on cue.

Runs inside the processes tests/ddp_util.py starts (real gloo); returns plain data. The model is
the synthetic TinyLM, each block and the root sharded with `fully_shard` on a 1-D mesh (FSDP) or
a 2-D (replicate, shard) mesh (HSDP). No batch_fn: the loop hands its batch to check_gradients.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from screener.audit import Auditor, NumericFailure, SDCAlarm
from screener.audit.sentinel import SentinelConfig
from screener.known_answer.engine import faults, synthetic

SEED = 7
SHAPE = dict(vocab=32, d_model=16, n_heads=2, d_ff=32, seq=8, n_layers=2)


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic.batch_for(SEED, rank, step, batch=2, seq=SHAPE["seq"], vocab=SHAPE["vocab"])


def compute_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return synthetic.compute_loss(model, batch)


def spiky_batch_for(rank: int, step: int) -> tuple:
    """Batches whose third element scales the loss: x1000 on rank 0 at step 6 (a data spike
    every replay reproduces)."""
    return (*batch_for(rank, step), 1000.0 if (rank, step) == (0, 6) else 1.0)


def spiky_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    tokens, targets, scale = batch
    return synthetic.compute_loss(model, (tokens, targets)) * scale


def dropout_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Dropout on the logits: the replay must start from the owner's RNG state."""
    tokens, targets = batch
    logits = torch.nn.functional.dropout(model(tokens), p=0.1, training=True)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             targets.reshape(-1))


def build(world: int, *, hsdp: bool = False, reshard_after_forward: bool = True,
          bf16: bool = False, checkpointing: bool = False,
          shape: Optional[dict[str, int]] = None) -> torch.nn.Module:
    """The TinyLM (SHAPE unless `shape`) sharded with fully_shard (per block, then the root)."""
    model = synthetic.make_model(SEED, **(shape or SHAPE))
    if checkpointing:
        from torch.utils.checkpoint import checkpoint

        for block in model.blocks:
            fwd = block.forward
            block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False,
                                                                  **k))(fwd)
    mesh = (init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh("cpu", (world,)))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


Fault = Callable[[int, int], Optional[contextlib.AbstractContextManager]]


@dataclass(frozen=True)
class flip:
    """A fault on one rank at one step: one bit of one op output flipped (forward or backward);
    picklable, so spawned ranks get it too."""

    rank: int
    step: int
    op: str = "mm"
    call: int = 3
    element: int = 5
    bit: Optional[int] = 30
    persistent: bool = False
    mode: str = "flip"

    def __call__(self, r: int, s: int) -> Optional[contextlib.AbstractContextManager]:
        if r == self.rank and (s == self.step or (self.persistent and s >= self.step)):
            return faults.inject(faults.FaultSpec(self.op, call=self.call, element=self.element,
                                                  bit=self.bit, mode=self.mode))
        return None


def train(rank: int, world: int, *, steps: int, audit_every: int = 1, weights_every: int = 1,
          alarm_dir: str, fault: Optional[Fault] = None, hsdp: bool = False,
          reshard_after_forward: bool = True, bf16: bool = False, checkpointing: bool = False,
          loss_fn: Callable = compute_loss, accumulation: int = 1,
          after_step: Optional[Callable[..., Any]] = None, scaler: bool = False,
          with_batch_fn: bool = False, batches: Callable = batch_for,
          sentinel: Optional[dict[str, Any]] = None, fault_in_check: bool = False
          ) -> dict[str, Any]:
    """Train under the Auditor; report the alarm or numeric failure, counters and steps done."""
    torch.manual_seed(SEED)
    model = build(world, hsdp=hsdp, reshard_after_forward=reshard_after_forward, bf16=bf16,
                  checkpointing=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    extra = {"sentinel": SentinelConfig(**sentinel)} if sentinel is not None else {}
    auditor = Auditor(model, loss_fn=loss_fn, audit_every=audit_every, scaler=amp, **extra,
                      weights_every=weights_every, alarm_dir=alarm_dir, job="t",
                      accumulation_steps=accumulation,
                      batch_fn=(lambda r, s: [batch_for(r, s * 10 + i) for i in range(accumulation)]
                                if accumulation > 1 else batch_for(r, s)) if with_batch_fn else None)
    out: dict[str, Any] = {"rank": rank, "alarm": None, "numeric": None, "steps_done": 0}
    try:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            ctx = (fault(rank, step) if fault else None) or contextlib.nullcontext()
            with ctx:
                if accumulation > 1:
                    micro = [batch_for(rank, step * 10 + i) for i in range(accumulation)]
                    total = 0.0
                    for i, mb in enumerate(micro):
                        model.set_requires_gradient_sync(i == accumulation - 1)
                        loss = loss_fn(model, mb)
                        (amp.scale(loss) if amp else loss).backward()
                        total = total + loss.detach()
                    batch: Any = micro
                    loss = total
                else:
                    batch = batches(rank, step)
                    loss = loss_fn(model, batch)
                    (amp.scale(loss) if amp else loss).backward()
            again = (fault(rank, step) if fault and fault_in_check else None) \
                or contextlib.nullcontext()
            with again:  # a persistent fault is still there when the step is rerun
                auditor.check_gradients(step, loss, batch=None if with_batch_fn else batch)
            if amp:
                amp.step(opt)
                amp.update()
            else:
                opt.step()
            if after_step is not None:
                after_step(rank, step, model)
            auditor.check_weights(step)
            out["steps_done"] += 1
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
    except NumericFailure as e:
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks), "reason": e.reason}
    out["counters"] = dict(auditor.counters)
    auditor.close()
    dist.barrier()
    return out


def corrupt_shard(rank: int, step: int):
    """After the optimizer step at `step`, flip a high bit of the first element of one local
    weight shard on `rank` (HSDP's replicas then differ)."""
    return _ShardFlip(rank, step)


@dataclass(frozen=True)
class _ShardFlip:
    rank: int
    step: int

    def __call__(self, r: int, s: int, model: torch.nn.Module) -> None:
        if r == self.rank and s == self.step:
            p = next(model.parameters())
            faults.apply_to_tensor(p.to_local().data, 0, mode="flip", bit=30)


def _files(directory: str) -> list[dict[str, Any]]:
    import json
    from pathlib import Path

    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]


# The top exponent bit of one element of the position embedding's gradient on rank 2 at step 6:
# a finite value near 1e36 that no non-finite check sees (row 0 is in every batch).
EXPONENT_FLIP = flip(2, 6, op="embedding_dense_backward", call=0, element=5, bit=30)

SCENARIOS: dict[str, dict[str, Any]] = {
    # healthy: the setups of the issue, each with the audit on every step
    "fsdp_healthy": dict(steps=4, loss_fn=dropout_loss, checkpointing=True,
                         reshard_after_forward=False),
    "hsdp_healthy": dict(steps=4, hsdp=True, bf16=True, accumulation=2, with_batch_fn=True),
    # faults at audit steps
    "fsdp_flip": dict(steps=4, fault=flip(3, 2, op="mm", call=5, bit=30)),
    "hsdp_flip_backward": dict(steps=4, hsdp=True, fault=flip(0, 1, op="mm", call=12, bit=22)),
    "fsdp_nan": dict(steps=4, fault=flip(4, 1, op="mm", call=2, bit=None, mode="nan")),
    "hsdp_weights": dict(steps=4, hsdp=True, audit_every=0, after_step=corrupt_shard(5, 1)),
    # between audits: the sentinel fires on a jump and a rerun attributes it
    "spike_transient": dict(steps=8, audit_every=0, weights_every=0, sentinel=dict(warmup=3),
                            fault=EXPONENT_FLIP),
    "spike_persistent": dict(steps=8, audit_every=0, weights_every=0, sentinel=dict(warmup=3),
                             fault=EXPONENT_FLIP, fault_in_check=True),
    "spike_data": dict(steps=8, audit_every=0, weights_every=0, sentinel=dict(warmup=3),
                       batches=spiky_batch_for, loss_fn=spiky_loss),
}


def everything(rank: int, world: int, *, root: str, only: Optional[list[str]] = None
               ) -> dict[str, Any]:
    """Every scenario in one process group (starting ranks is the expensive part)."""
    import os

    out: dict[str, Any] = {}
    for name, kwargs in SCENARIOS.items():
        if only and name not in only:
            continue
        directory = os.path.join(root, name)
        os.makedirs(directory, exist_ok=True)
        result = train(rank, world, alarm_dir=directory, **kwargs)
        dist.barrier()
        result["files"] = _files(directory)
        out[name] = result
    return out


def fp16_overflow(rank: int, world: int, *, alarm_dir: str, scaler: bool) -> dict[str, Any]:
    """fp16 reduction (MixedPrecisionPolicy(reduce_dtype=float16)) of finite local gradients
    whose sum overflows at step 2: the loss scaler's business, or a numeric failure; never an
    alarm on every node."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float16))
    amp = torch.amp.GradScaler("cpu", init_scale=1.0) if scaler else None
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum()

    auditor = Auditor(model, loss_fn=loss_fn, audit_every=0, weights_every=0,
                      alarm_dir=alarm_dir, job="t", scaler=amp)
    out: dict[str, Any] = {"alarm": None, "numeric": None, "events": []}

    class Events(logging.Handler):  # the audit's JSON lines, by event name
        def emit(self, record: logging.LogRecord) -> None:
            out["events"].append(json.loads(record.getMessage()).get("event"))

    audit_log = logging.getLogger("screener.audit")
    handler = Events(level=logging.INFO)
    audit_log.addHandler(handler)
    audit_log.setLevel(logging.INFO)
    try:
        for step in range(3):
            x = torch.full((1, 8), 40000.0 if step == 2 else 1.0)
            loss = loss_fn(model, x)
            (amp.scale(loss) if amp else loss).backward()
            auditor.check_gradients(step, loss, batch=x)
            if amp:
                amp.step(opt)
                amp.update()
            opt.zero_grad(set_to_none=True)
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
    except NumericFailure as e:
        out["numeric"] = e.reason
    out["counters"] = dict(auditor.counters)
    audit_log.removeHandler(handler)
    auditor.close()
    dist.barrier()
    return out
