"""Rank-side code of the distributed audit tests: a tiny DDP training loop with faults on cue.

Runs inside the processes that tests/ddp_util.py spawns; returns plain data (alarms as dicts, alarm
files as parsed JSON) for the test process to assert on.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch._dynamo  # torch.compile's setups; DDP's constructor imports it anyway
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from screener.known_answer.engine import faults
from screener.known_answer.engine import synthetic
from screener.audit import AuditError, AuditUsageError, Auditor, NumericFailure, SDCAlarm, \
    rollback_target
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


def huge_batch_fn(rank: int, step: int) -> tuple:
    """Batches carry a flag that gives one parameter a gradient of 1e38 (at step 2, every rank)."""
    tokens, targets = batch_fn(rank, step)
    return tokens, targets, step == 2


def huge_grad_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    tokens, targets, huge = batch
    loss = synthetic.compute_loss(model, (tokens, targets))
    if huge:  # adds exactly 0 to the loss and 1e38 to every element of the first weight's gradient
        w = next(model.parameters())
        loss = loss + (w - w.detach()).sum() * 1e38
    return loss


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
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks), "reason": e.reason}
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
    # The lowest mantissa bit of one matmul output (attention times values) flipped on rank 4 at
    # audit step 6. (The first matmul, q @ k^T, would not do: a 1-ulp change of one score is
    # absorbed by the softmax, and the backward of a matmul does not read its output.)
    run("mantissa_flip", steps=8, audit_every=3, weights_every=0,
        fault=_on(4, 6, faults.FaultSpec(op="matmul", call=1, element=9, bit=0, mode="flip")))

    # A bit flipped in rank 5's weights after optimizer.step of step 3.
    def flip_weight(r: int, step: int, model: torch.nn.Module) -> None:
        if r == 5 and step == 3:
            faults.corrupt_parameter(model, "blocks.0.fc1.weight", element=17, bit=13)
    run("weight_flip", steps=8, audit_every=0, weights_every=1, after_step=flip_weight)
    # The same flip found by the vote that verified_save runs: nothing is saved at step 4.
    run("refused_save", steps=8, audit_every=0, weights_every=0, save_every=2,
        after_step=flip_weight)

    # NaN written into rank 2's bucket inside the all-reduce from the hook's call 3 (step 3) on,
    # so the redo of that all-reduce is NaN too (a one-off: tests/test_audit_ddp_nonfinite_reduction.py).
    run("nan_allreduce", steps=6, audit_every=0, weights_every=1,
        reduce_hook=faults.corrupt_allreduce(rank=2, calls=range(3, 99), element=0))
    # NaN written into rank 3's reduced bucket after the all-reduce, on the hook's call 2 (step
    # 2): only rank 3 sees it, so only rank 3's node is a candidate (unsettled: which GPU made
    # it is not settled).
    run("nan_after_reduce", steps=4, audit_every=0, weights_every=1,
        reduce_hook=nan_after_reduce(3, 2))
    # Finite gradients of 1e38 on every rank at step 2: their sum overflows float32 in the
    # default hook (it sums before dividing), every local gradient is finite: an overflow, a
    # numeric failure, never a reduction fault (nonfinite_reduced) or a rank named.
    run("overflowing_sum", steps=4, audit_every=0, weights_every=0, loss_fn=huge_grad_loss,
        batches=huge_batch_fn)
    # A loss that is NaN because of the data: every replay reproduces it (numeric, not hardware).
    run("numeric", steps=6, audit_every=0, weights_every=0, loss_fn=poisoned_loss,
        batches=poisoned_batch_fn)

    # Rank 3 alone is told training starts at step 1, so it records no fingerprints for audit
    # step 0: every rank must skip that audit alike (not wait in a differently shaped gather).
    run("uneven_start", steps=6, audit_every=2, weights_every=3,
        start_step=1 if rank == 3 else None)

    _two_nodes(rank, root, results)
    return results


def _two_nodes(rank: int, root: str, results: dict[str, Any]) -> None:
    """Only two nodes: a sub-group of ranks 0-3; ranks 4 and 5 sit this one out."""
    sub = dist.new_group([0, 1, 2, 3])
    if rank < 4:
        run_two = os.path.join(root, "two_nodes")
        results["two_nodes"] = train(
            rank, alarm_dir=run_two, steps=6, audit_every=2, weights_every=0, group=sub,
            fault=_on(1, 4, faults.FaultSpec(op="gelu", element=11, mode="scale", factor=1e4)))
    dist.barrier()
    if rank < 4:
        results["two_nodes"]["files"] = read_alarm_dir(os.path.join(root, "two_nodes"))


def three_nodes_persistent(rank: int, world: int, root: str) -> dict[str, Any]:
    """One rank per node (n0, n1, n2) and a persistent fault on rank 1: every forward it computes,
    its training steps and the replay it does for rank 2. Two of the three owners disagree with
    their replayers, both because of rank 1."""
    d = os.path.join(root, "three")
    spec = faults.FaultSpec(op="gelu", element=11, mode="scale", factor=1e4)
    loss_fn = _faulty(compute_loss, spec, []) if rank == 1 else compute_loss
    out = train(rank, alarm_dir=d, steps=4, audit_every=2, weights_every=0, loss_fn=loss_fn)
    dist.barrier()
    out["files"] = read_alarm_dir(d)
    return out


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


# ---- the training setups people run (issue 11): one function builds each, one loop trains it ---

MATRIX_SETUPS = ("fp32", "bf16", "fp16_scaler", "dropout_unseeded", "dropout_rank_seeded",
                 "accumulation", "clipping", "batchnorm_broadcast", "batchnorm_local",
                 "extra_outputs",
                 # issue 28: setups a healthy job was killed in at step 0
                 "compiled_inner", "checkpoint_reentrant", "checkpoint_nonreentrant",
                 "bucket_view_huge", "clipping_huge")
FAULT_RANK = 3  # on node n1 of NODES = n0 n0 n1 n1 n2 n2
FORCED_OVERFLOW_STEP = 2  # fp16_scaler: the scale is set to 2**60 for this step (every rank)
DATA_OVERFLOW = (2, 3)  # fp16_scaler: (rank, step) whose batch overflows at any sane scale
ACCUMULATION = 3
HUGE_STEP, HUGE = 1, 1e20  # bucket_view_huge, clipping_huge: a finite spike on every rank
COMPILE_BACKEND = "aot_eager"  # the CI slice's; the benchmark compiles with inductor too


def mlp_batch(rank: int, step: int, *, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets rebuilt from (rank, step) alone (no RNG draw)."""
    key = synthetic.mix_key(SEED, 11, rank, step)
    x = synthetic.uniform(key, (n, 8)) * 2 - 1
    y = synthetic.uniform(key + 1, (n, 4)) * 2 - 1
    return x, y


class CheckpointedMLP(torch.nn.Module):
    """Linear, then a checkpointed block with dropout (recomputed in backward from the stashed
    RNG state), then a head: activation checkpointing as Hugging Face models use it."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(8, 16)
        self.block = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Dropout(0.25),
                                         torch.nn.Linear(16, 16), torch.nn.GELU())
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.inp(x),
                                              use_reentrant=self.reentrant)
        return self.head(h)


def _mlp(kind: str) -> torch.nn.Module:
    if kind.startswith("checkpoint_"):
        return CheckpointedMLP(reentrant=kind == "checkpoint_reentrant")
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16)]
    if kind == "batchnorm":
        layers.append(torch.nn.BatchNorm1d(16))
    layers.append(torch.nn.GELU())
    if kind == "dropout":
        layers.append(torch.nn.Dropout(0.25))
    layers.append(torch.nn.Linear(16, 4))
    return torch.nn.Sequential(*layers)


def mlp_loss(model: torch.nn.Module, batch: Any, *, dtype: Optional[torch.dtype] = None
             ) -> torch.Tensor:
    x, y = batch
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def _lm_loss(dtype: Optional[torch.dtype]) -> Callable:
    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            return synthetic.compute_loss(model, batch)
    return loss


def _huge_spike(loss_fn: Callable) -> tuple[Callable, Callable]:
    """batch_fn and loss_fn giving every element of the first weight a finite gradient of HUGE
    at HUGE_STEP, on every rank: a flag in the batch, so replays reproduce it."""
    def batches(rank: int, step: int) -> Any:
        return (*mlp_batch(rank, step), step == HUGE_STEP)

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y, huge = batch
        out = loss_fn(model, (x, y))
        if huge:  # adds exactly 0 to the loss and HUGE to the gradient
            w = next(model.parameters())
            out = out + (w - w.detach()).sum() * HUGE
        return out
    return batches, loss


def _noting_ddp_context(loss_fn: Callable, seen: list) -> Callable:
    """loss_fn noting, for each replay (a call on DDP's module, not on the DDP model), whether it
    runs in DDP's forward context, where torch.compile compiles as the training step does."""
    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if not isinstance(model, DDP):
            seen.append(DDP._get_active_ddp_module() is not None)
        return loss_fn(model, batch)
    return loss


def build_setup(setup: str, rank: int, compile_backend: str = COMPILE_BACKEND) -> dict[str, Any]:
    """Model, loss_fn, batch_fn and the loop's options for one setup of the matrix."""
    lm_spec = faults.FaultSpec(op="matmul", call=1, element=9, bit=0)  # attention @ values
    # The last Linear's output, mantissa bit 8 of fp32 and fp16 (an exponent bit of bf16): a
    # lower bit of a small output can vanish in the loss's (output - target) and fault nothing.
    mlp_spec = faults.FaultSpec(op="addmm", call=1, element=5, bit=8)
    s: dict[str, Any] = {"scaler": None, "k": 1, "clip": False, "broadcast_buffers": True,
                         "fault": mlp_spec, "forced_overflow": None, "ddp": {},
                         "optimizer": torch.optim.SGD, "replay_contexts": []}
    if setup in ("fp32", "bf16", "clipping", "extra_outputs"):
        s["model"] = synthetic.make_model(SEED, **SHAPE)
        s["batch_fn"] = batch_fn
        s["loss_fn"] = _lm_loss(torch.bfloat16 if setup == "bf16" else None)
        s["fault"] = lm_spec
        s["clip"] = setup == "clipping"
        if setup == "extra_outputs":
            def with_extras(model: torch.nn.Module, batch: Any) -> tuple:
                tokens, targets = batch
                logits = model(tokens)
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                return loss, {"logits": logits.detach(), "tokens": int(tokens.numel())}
            s["loss_fn"] = with_extras
        return s
    if setup == "dropout_rank_seeded":
        torch.manual_seed(1000 + rank)  # different dropout masks on every rank
    # (dropout_unseeded: the default generator, the same start state everywhere)
    kind = "batchnorm" if setup.startswith("batchnorm") else \
        "dropout" if setup.startswith("dropout") else \
        setup if setup.startswith("checkpoint_") else "plain"
    s["model"] = _mlp(kind)
    s["batch_fn"] = mlp_batch
    s["loss_fn"] = mlp_loss
    s["broadcast_buffers"] = setup != "batchnorm_local"
    if setup == "fp16_scaler":
        def batches(r: int, step: int) -> Any:
            x, y = mlp_batch(r, step)
            return (x * 1e4, y) if (r, step) == DATA_OVERFLOW else (x, y)
        s["batch_fn"] = batches
        s["loss_fn"] = lambda m, b: mlp_loss(m, b, dtype=torch.float16)
        s["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        s["forced_overflow"] = FORCED_OVERFLOW_STEP
    if setup == "compiled_inner":  # DDP(torch.compile(model)): the replays run the compiled one
        torch._dynamo.reset()  # each run compiles afresh: no cache limit reached on some ranks
        s["model"] = torch.compile(s["model"], backend=compile_backend)
        s["loss_fn"] = _noting_ddp_context(s["loss_fn"], s["replay_contexts"])
    if setup in ("bucket_view_huge", "clipping_huge"):
        s["batch_fn"], s["loss_fn"] = _huge_spike(mlp_loss)
        s["optimizer"] = torch.optim.AdamW  # survives the spike, as plain DDP does
        s["ddp"] = {"gradient_as_bucket_view": setup == "bucket_view_huge"}
        s["clip"] = setup == "clipping_huge"  # clip_grad_norm_'s float32 norm is inf at 1e20
    if setup == "accumulation":
        s["k"] = ACCUMULATION
        s["batch_fn"] = lambda r, step: [mlp_batch(r, ACCUMULATION * step + i)
                                         for i in range(ACCUMULATION)]
        s["loss_fn"] = lambda m, b: mlp_loss(m, b) / ACCUMULATION
    return s


def _faulty(loss_fn: Callable, spec: faults.FaultSpec, fired: list) -> Callable:
    """loss_fn with a persistent fault: every forward this rank computes, training or replay."""
    def faulty(model: torch.nn.Module, batch: Any) -> Any:
        with faults.inject(spec) as inj:
            out = loss_fn(model, batch)
        fired.extend(inj.fired)
        return out
    return faulty


def matrix_run(rank: int, setup: str, *, steps: int, alarm_dir: str, fault_rank: Optional[int] = None,
               audit_every: int = 1, weights_every: int = 1, pass_scaler: bool = True,
               loss_override: Optional[Callable] = None, fault: Optional[faults.FaultSpec] = None,
               after_step: Optional[Callable[..., Any]] = None,
               topology: Any = None, compile_backend: str = COMPILE_BACKEND,
               compile_outer: bool = False) -> dict[str, Any]:
    """Train one setup of the matrix under an Auditor auditing and voting every step.

    compile_outer: the loop trains torch.compile(ddp) while the Auditor is given ddp (the
    Auditor must refuse at the first check_gradients: out["refused"])."""
    s = build_setup(setup, rank, compile_backend)
    model, scaler, k = s["model"], s["scaler"], s["k"]
    ddp = DDP(model, broadcast_buffers=s["broadcast_buffers"], **s["ddp"])
    opt = s["optimizer"](model.parameters(), lr=0.05)
    loss_fn = loss_override or s["loss_fn"]
    fired: list = []
    if fault_rank == rank:
        loss_fn = _faulty(loss_fn, fault or s["fault"], fired)
    out: dict[str, Any] = {"rank": rank, "alarm": None, "numeric": None, "steps_done": 0,
                           "refused": None, "error": None, "grad_max": 0.0}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    auditor = Auditor(ddp, loss_fn=loss_fn, batch_fn=s["batch_fn"], audit_every=audit_every,
                      weights_every=weights_every, alarm_dir=alarm_dir, job=setup,
                      scaler=scaler if pass_scaler else None, accumulation_steps=k,
                      check_reduced=not s["clip"], topology=topology)
    trained = torch.compile(ddp, backend=compile_backend) if compile_outer else ddp
    try:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            with _forced_overflow(scaler, s["forced_overflow"] == step):
                loss = _forward_backward(s, ddp, trained, loss_fn, rank, step)
                out["grad_max"] = max(out["grad_max"], max(float(p.grad.abs().max())
                                                           for p in model.parameters()
                                                           if p.grad is not None))
                norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5) if s["clip"] \
                    else None
                auditor.check_gradients(step, loss, grad_norm=norm)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            if after_step is not None:
                after_step(rank, step, model)
            auditor.check_weights(step)
            out["steps_done"] += 1
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
    except NumericFailure as e:
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks), "message": str(e)}
    except AuditUsageError as e:
        out["refused"] = str(e)
    except AuditError as e:  # reported, so that one setup's failure does not hide the others
        out["error"] = f"{type(e).__name__}: {e}"
    out.update(counters=dict(auditor.counters), fired=len(fired),
               compiled_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
               replay_contexts=s["replay_contexts"],
               replay_backward=auditor._replay_mode.backward)  # learnt from a reentrant checkpoint
    out.update(_state_after(model, scaler))
    auditor.close()
    return out


@contextlib.contextmanager
def _forced_overflow(scaler: Any, on: bool) -> Any:
    """fp16_scaler's forced overflow: the step runs at a scale of 2**60 (every rank overflows),
    and the scaler's own scale is put back after its update."""
    if not on:
        yield
        return
    normal = scaler.get_scale()
    scaler.update(new_scale=2.0 ** 60)
    yield
    scaler.update(new_scale=normal)


def _forward_backward(s: dict[str, Any], ddp: DDP, trained: torch.nn.Module, loss_fn: Callable,
                      rank: int, step: int) -> Any:
    """One step's forward and backward (k micro-batches, all but the last under no_sync), through
    `trained` (the DDP model, or a compiled wrapper of it); returns what check_gradients takes."""
    k, scaler = s["k"], s["scaler"]
    micro = s["batch_fn"](rank, step) if k > 1 else [s["batch_fn"](rank, step)]
    losses = []
    for i, mb in enumerate(micro):
        with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
            result = loss_fn(trained, mb)
            loss = result[0] if isinstance(result, tuple) else result
            (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(result if k == 1 else loss.detach())
    return losses[0] if k == 1 else sum(losses)


def _state_after(model: torch.nn.Module, scaler: Any) -> dict[str, Any]:
    return {"weights_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "weights": digest(fingerprints(list(model.parameters()))),
            "scale": scaler.get_scale() if scaler is not None else None}


def _refusal(rank: int, build: Callable[[], Any]) -> Optional[str]:
    """The message of the AuditUsageError build() raises (exit 2), or None when it raised none."""
    try:
        build()
    except AuditUsageError as e:
        return str(e)
    return None


def refuse_compiled_around(rank: int, root: str, results: dict[str, Any],
                           compile_backend: str) -> None:
    """torch.compile(DDP(model)) is refused in one line: given to the Auditor (at construction),
    or trained while the Auditor was given the DDP model (at the first check_gradients)."""
    import gc

    results["refused/compiled_outer"] = _refusal(rank, lambda: Auditor(
        torch.compile(DDP(_mlp("plain")), backend=compile_backend), loss_fn=mlp_loss,
        batch_fn=mlp_batch, alarm_dir=root))
    gc.collect()
    d = os.path.join(root, "compiled_outer_trained")
    torch._dynamo.reset()
    t0 = time.perf_counter()
    results["refused/compiled_outer_trained"] = matrix_run(
        rank, "dropout_unseeded", steps=2, alarm_dir=d, compile_backend=compile_backend,
        compile_outer=True)
    results["refused/compiled_outer_trained"]["seconds"] = time.perf_counter() - t0
    dist.barrier()
    results["refused/compiled_outer_trained"]["files"] = read_alarm_dir(d)
    torch._dynamo.reset()
    gc.collect()


def nan_after_reduce(target_rank: int, call: int) -> Callable:
    """A reduce hook: torch's all-reduce, then NaN written into target_rank's reduced bucket on
    the hook's call number `call` (counted on every rank)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = {"n": 0}

    def hook(state, bucket):  # no annotations: DDP checks them against GradBucket
        n = calls["n"]
        calls["n"] += 1

        def poison(fut: Any) -> torch.Tensor:
            reduced = fut.value()[0] if isinstance(fut.value(), list) else fut.value()
            if dist.get_rank() == target_rank and n == call:
                reduced.view(-1)[0] = float("nan")
            return reduced
        return allreduce_hook(state, bucket).then(poison)
    return hook


def matrix(rank: int, world: int, root: str, healthy_steps: int,
           setups: tuple[str, ...] = MATRIX_SETUPS, faults_too: bool = True,
           fault_ranks: tuple[int, ...] = (FAULT_RANK,), fault_steps: int = 2,
           compile_backend: str = COMPILE_BACKEND) -> dict[str, Any]:
    """Every setup healthy, then with a persistent fault on FAULT_RANK; the refusals and the
    numeric failures no node is blamed for. One process group for all of it."""
    import gc

    from screener.audit import gather_topology

    results: dict[str, Any] = {}
    topology = gather_topology()  # once: every run below uses the same group

    def run(name: str, setup: str, **kw: Any) -> None:
        d = os.path.join(root, name)
        t0 = time.perf_counter()
        results[name] = matrix_run(rank, setup, alarm_dir=d, topology=topology,
                                   compile_backend=compile_backend, **kw)
        results[name]["seconds"] = time.perf_counter() - t0
        dist.barrier()  # every rank has written its files before anyone reads
        results[name]["files"] = read_alarm_dir(d)
        gc.collect()  # free the reducers while the group lives

    for setup in setups:
        run(f"{setup}/healthy", setup, steps=healthy_steps)
        for r in fault_ranks:
            run(f"{setup}/fault{r}", setup, steps=fault_steps, fault_rank=r)
    refuse_compiled_around(rank, root, results, compile_backend)
    if not faults_too:
        return results

    # fp16 + GradScaler: a NaN in rank 3's forward is not an overflow the scaler owns: the replay
    # at the same scale on another node is finite, which names rank 3.
    run("fp16_scaler/nan", "fp16_scaler", steps=2, fault_rank=FAULT_RANK,
        fault=faults.FaultSpec(op="addmm", call=0, element=3, mode="nan"))

    # Not a hardware verdict: a GradScaler the auditor was not told about (the self-check), a
    # code path that depends on the rank, weights that differ on two nodes.
    run("numeric/unpassed_scaler", "fp16_scaler", steps=2, pass_scaler=False)

    def rank_dependent(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = mlp_loss(model, batch)
        return loss * (1 + 2 ** -10) if dist.get_rank() in (1, 4) else loss
    run("numeric/rank_dependent", "dropout_unseeded", steps=2,
        loss_override=rank_dependent)

    def flip_two(r: int, step: int, model: torch.nn.Module) -> None:
        if r in (1, 4) and step == 1:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0].mul_(1 + 2 ** -20)
    run("numeric/weights_two_nodes", "fp32", steps=3, audit_every=0, after_step=flip_two)

    # Refused at construction, with one line.
    torch.set_num_threads(2 if rank == 0 else 1)
    results["refused/threads"] = _refusal(rank, lambda: Auditor(
        DDP(_mlp("plain")), loss_fn=mlp_loss, batch_fn=mlp_batch, alarm_dir=root))
    torch.set_num_threads(1)
    gc.collect()
    dist.barrier()
    return results
