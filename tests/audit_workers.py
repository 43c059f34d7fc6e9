"""Rank-side code of the distributed audit tests: a tiny DDP training loop with faults on cue.

Runs inside the processes that tests/ddp_util.py spawns; returns plain data (alarms as dicts, alarm
files as parsed JSON) for the test process to assert on.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from screener import faults, synthetic
from screener.audit import Auditor, NumericFailure, SDCAlarm, rollback_target
from screener.fingerprint import digest, fingerprints

SEED = 7
SHAPE = dict(vocab=32, d_model=16, n_heads=2, d_ff=32, seq=8, n_layers=1)


def batch_fn(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic.batch_for(SEED, rank, step, batch=2, seq=SHAPE["seq"], vocab=SHAPE["vocab"])


def compute_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return synthetic.compute_loss(model, batch)


def poisoned_batch_fn(rank: int, step: int) -> tuple:
    """Batches carry a flag that makes the loss NaN: a data problem every replay reproduces."""
    tokens, targets = batch_fn(rank, step)
    return tokens, targets, (rank == 2 and step == 3)


def poisoned_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    tokens, targets, poison = batch
    loss = synthetic.compute_loss(model, (tokens, targets))
    return loss * float("nan") if poison else loss


Fault = Callable[[int, int], Optional[contextlib.AbstractContextManager]]


def train(rank: int, *, steps: int, audit_every: int, weights_every: int, alarm_dir: str,
          fault: Optional[Fault] = None, after_step: Optional[Callable[..., Any]] = None,
          reduce_hook: Optional[Callable] = None, group: Optional[dist.ProcessGroup] = None,
          loss_fn: Callable = compute_loss, batches: Callable = batch_fn,
          start: int = 0, lr: float = 0.05, save_every: int = 0,
          start_step: Optional[int] = None) -> dict[str, Any]:
    """Train the tiny LM under an Auditor; report the alarm (if any) and the state after it."""
    model = synthetic.make_model(SEED, **SHAPE)
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    auditor = Auditor(ddp, loss_fn=loss_fn, batch_fn=batches, audit_every=audit_every,
                      weights_every=weights_every, process_group=group, reduce_hook=reduce_hook,
                      alarm_dir=alarm_dir, job="t", start_step=start_step)
    out: dict[str, Any] = {"rank": rank, "alarm": None, "numeric": None, "steps_done": 0,
                           "weights_before_alarm": None, "saved": [], "rollback": None}
    ckpt_dir = Path(alarm_dir).parent / (Path(alarm_dir).name + "-ckpt")

    def save(step: int) -> Optional[Path]:
        if rank != 0:
            return None
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = ckpt_dir / f"step{step:04d}.pt"
        torch.save(model.state_dict(), path)
        out["saved"].append(step)
        return path

    step = start
    before: list[torch.Tensor] = []
    try:
        for step in range(start, start + steps):
            opt.zero_grad(set_to_none=True)
            ctx = (fault(rank, step) if fault else None) or contextlib.nullcontext()
            with ctx:
                loss = loss_fn(ddp, batches(rank, step))
                loss.backward()
            before = [p.detach().clone() for p in model.parameters()]  # cheaper than a digest
            auditor.check_gradients(step, loss)
            opt.step()
            if after_step is not None:
                after_step(rank, step, model)
            auditor.check_weights(step)
            if save_every and step % save_every == 0:
                auditor.verified_save(lambda: save(step), step)
            out["steps_done"] += 1
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
        out["alarm_message"] = str(a)
        if rank == 0 and ckpt_dir.is_dir():
            target = rollback_target(str(ckpt_dir), a.first_suspect_step)
            out["rollback"] = None if target is None else Path(target).name
    except NumericFailure as e:
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks)}
    out["stopped_at"] = step
    out["weights_before_alarm"] = digest(fingerprints(before))
    out["weights_after"] = digest(fingerprints(list(model.parameters())))
    out["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out["counters"] = dict(auditor.counters)
    out["replays"] = list(auditor._my_replays)
    return out


def read_alarm_dir(path: str) -> list[dict[str, Any]]:
    d = Path(path)
    if not d.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(d.iterdir())]


def _on(target_rank: int, target_step: int, *specs: faults.FaultSpec) -> Fault:
    def fault(rank: int, step: int):
        if rank == target_rank and step == target_step:
            return faults.inject(*specs)
        return None
    return fault


def fault_matrix(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every fault of the matrix on three simulated nodes of two ranks, one after the other."""
    results: dict[str, Any] = {}

    def run(name: str, **kw: Any) -> None:
        d = os.path.join(root, name)
        results[name] = train(rank, alarm_dir=d, **kw)
        dist.barrier()  # every rank has written its files before anyone reads
        results[name]["files"] = read_alarm_dir(d)

    # NaN in rank 3's local gradient (inside backward) at step 2.
    run("nan_local", steps=6, audit_every=4, weights_every=2,
        fault=_on(3, 2, faults.FaultSpec(op="gelu_backward", element=5, mode="nan")))
    # One activation times 10,000 on rank 1 at audit step 4.
    run("scaled_activation", steps=8, audit_every=2, weights_every=0,
        fault=_on(1, 4, faults.FaultSpec(op="gelu", element=11, mode="scale", factor=1e4)))
    # The lowest mantissa bit of one matmul output flipped on rank 4 at audit step 6.
    run("mantissa_flip", steps=8, audit_every=3, weights_every=0,
        fault=_on(4, 6, faults.FaultSpec(op="matmul", call=0, element=9, bit=0, mode="flip")))

    # A bit flipped in rank 5's weights after optimizer.step of step 3.
    def flip_weight(r: int, step: int, model: torch.nn.Module) -> None:
        if r == 5 and step == 3:
            faults.corrupt_parameter(model, "blocks.0.fc1.weight", element=17, bit=13)
    run("weight_flip", steps=8, audit_every=0, weights_every=1, after_step=flip_weight)
    # The same flip found by the vote that verified_save runs: nothing is saved at step 4.
    run("refused_save", steps=8, audit_every=0, weights_every=0, save_every=2,
        after_step=flip_weight)

    # NaN written into rank 2's bucket inside the all-reduce, on the hook's call 3 (step 3).
    run("nan_allreduce", steps=6, audit_every=0, weights_every=1,
        reduce_hook=faults.corrupt_allreduce(rank=2, calls={3}, element=0))
    # A loss that is NaN because of the data: every replay reproduces it (numeric, not hardware).
    run("numeric", steps=6, audit_every=0, weights_every=0, loss_fn=poisoned_loss,
        batches=poisoned_batch_fn)

    # Rank 3 alone is told training starts at step 1, so it records no fingerprints for audit
    # step 0: every rank must skip that audit alike (not wait in a differently shaped gather).
    run("uneven_start", steps=6, audit_every=2, weights_every=3,
        start_step=1 if rank == 3 else None)

    # Only two nodes: a sub-group of ranks 0-3; ranks 4 and 5 sit this one out.
    sub = dist.new_group([0, 1, 2, 3])
    if rank < 4:
        run_two = os.path.join(root, "two_nodes")
        results["two_nodes"] = train(
            rank, alarm_dir=run_two, steps=6, audit_every=2, weights_every=0, group=sub,
            fault=_on(1, 4, faults.FaultSpec(op="gelu", element=11, mode="scale", factor=1e4)))
    dist.barrier()
    if rank < 4:
        results["two_nodes"]["files"] = read_alarm_dir(os.path.join(root, "two_nodes"))
    return results


def healthy(rank: int, world: int, root: str, steps: int) -> dict[str, Any]:
    """A long healthy run auditing every step (weights every tenth): must raise nothing."""
    out = train(rank, alarm_dir=os.path.join(root, "healthy"), steps=steps, audit_every=1,
                weights_every=10, save_every=100, lr=0.02)
    dist.barrier()
    out["files"] = read_alarm_dir(os.path.join(root, "healthy"))
    return out


def everything(rank: int, world: int, root: str, healthy_steps: int) -> dict[str, Any]:
    """The fault matrix, then the healthy run, in one process group (process start-up is costly)."""
    results = fault_matrix(rank, world, root)
    results["healthy"] = healthy(rank, world, root, healthy_steps)
    return results


def peer_vanishes(rank: int, world: int) -> Any:
    """Rank 1 leaves the group mid-training; rank 0's run_guarded must say 77 (peer failed)."""
    from screener.audit import run_guarded

    def loop() -> int:
        t = torch.ones(4)
        for i in range(50):
            if rank == 1 and i == 3:
                dist.destroy_process_group()  # closes its connections, like a crashed peer
                return 0
            dist.all_reduce(t)
        return 0

    return run_guarded(loop)
