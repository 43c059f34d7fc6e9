"""Rank-side code of the audit's setup tests (tests/test_audit_tensor_parallel.py, _refusals,
_shard_flips, _accumulation) and of benchmarks/bench_audit_setups.py: the setups written as a
user would write them, each returning plain data.

- tensor parallel under FSDP2 (a (dp, tp) mesh) and pipeline stages sharded on their dp rows:
  refused at construction on every rank alike, one line;
- a gather of different sizes on different ranks: AuditError on every rank, no abort;
- HSDP, a bit flipped in one rank's weight shard between two votes: a settled weights alarm;
- gradient accumulation as loops really do it (FSDP2 reducing on every micro-step, HSDP with
  set_requires_all_reduce(False), DDP without no_sync): audited, no alarm.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from screener.audit import Auditor, AuditError, AuditUsageError, NumericFailure, SDCAlarm, classify
from screener.known_answer.engine import faults, synthetic

import fsdp_workers


def _refused(build: Any) -> dict[str, Any]:
    """What constructing the Auditor did: the refusal's line and exit code, or "accepted"."""
    try:
        auditor = build()
    except AuditUsageError as e:
        return {"refused": str(e), "exit": classify(e), "lines": len(str(e).splitlines())}
    auditor.close()
    return {"refused": None}


def tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    """The issue's setup: (dp=2, tp=2), Colwise then Rowwise on a Sequential, then fully_shard
    on the dp sub-mesh; Auditor(audit_every=1, weights_every=1) and two healthy steps (it used
    to be read as HSDP: a weights alarm on every node at step 0). Or the refusal."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, \
        parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum()

    out = _refused(lambda: Auditor(model, loss_fn=loss_fn, audit_every=1, weights_every=1,
                                   job="t"))
    if out["refused"] is None:
        auditor = Auditor(model, loss_fn=loss_fn, audit_every=1, weights_every=1, job="t",
                          alarm_dir=None)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dp = mesh["dp"].get_local_rank()
        out.update(alarm=None, numeric=None)
        try:
            for step in range(2):
                opt.zero_grad(set_to_none=True)
                x = torch.full((2, 8), float(dp + 1 + step))
                loss = loss_fn(model, x)
                loss.backward()
                auditor.check_gradients(step, loss, batch=x)
                opt.step()
                auditor.check_weights(step)
        except SDCAlarm as a:
            out["alarm"] = a.to_dict()
        except NumericFailure as e:
            out["numeric"] = e.reason
        out["counters"] = dict(auditor.counters)
        auditor.close()
    dist.barrier()  # every rank left the constructor: nobody waits in a gather
    return out


def pipeline_stages(rank: int, world: int) -> dict[str, Any]:
    """(pp=2, dp=2): a different Linear stack per stage, each fully_shard-ed on its dp row."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    torch.manual_seed(stage)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(stage + 1)])
    fully_shard(model, mesh=mesh["dp"])
    out = _refused(lambda: Auditor(model, loss_fn=None, job="t"))
    dist.barrier()
    return out


def uneven_gather(rank: int, world: int) -> dict[str, Any]:
    """A round whose payload size depends on the rank (a bug of ours or a diverged model)."""
    from screener.audit.protocol import Schedule

    walk = Schedule("test", ("a",)).walk(None, torch.device("cpu"))
    try:
        walk.gather("a", torch.zeros(3 + rank, dtype=torch.int64))
    except AuditError as e:
        out = {"error": str(e), "exit": classify(e)}
    else:
        out = {"error": None}
    dist.barrier()  # the group still works: nobody aborted
    return out


def steps_apart(rank: int, world: int) -> dict[str, Any]:
    """The Auditor's every-step round (a fixed width) called at different steps on different
    ranks: an audit step on one rank, none on the others."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(4, 2))

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum()

    auditor = Auditor(ddp, loss_fn=loss_fn, batch_fn=lambda r, s: torch.ones(1, 4),
                      audit_every=10, weights_every=0, job="t", start_step=1)
    loss = loss_fn(ddp, torch.ones(1, 4))
    loss.backward()
    try:
        auditor.check_gradients(10 if rank == 0 else 1, loss)
    except AuditError as e:
        out = {"error": str(e), "exit": classify(e)}
    else:
        out = {"error": None}
    auditor.close()
    dist.barrier()
    return out


def _files(directory: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]


def hsdp_shard_flip(rank: int, world: int, *, alarm_dir: str, target: int = 3,
                    parameter: str = "blocks.0.qkv.weight", bit: int = 31) -> dict[str, Any]:
    """HSDP 3 replicas x 2 shards (a node = a shard group), audit_every=4, weights_every=4; after
    step 2's optimizer step, bit 31 (the sign) of element 0 of rank 3's shard of the first
    block's first weight flips: every forward of its shard group (node n2) reads it."""
    def flip(r: int, s: int, model: torch.nn.Module) -> None:
        if (r, s) == (target, 2):
            weight = dict(model.named_parameters())[parameter]
            faults.apply_to_tensor(weight.to_local().data, 0, mode="flip", bit=bit)

    out = fsdp_workers.train(rank, world, steps=5, audit_every=4, weights_every=4, hsdp=True,
                             alarm_dir=alarm_dir, after_step=flip)
    dist.barrier()
    out["files"] = _files(alarm_dir)
    return out


def _loop_result(auditor: Any, run: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"alarm": None, "numeric": None, "steps_done": 0}
    try:
        out["steps_done"] = run()
    except SDCAlarm as a:
        out["alarm"] = a.to_dict()
    except NumericFailure as e:
        out["numeric"] = e.reason
    out["counters"] = dict(auditor.counters)
    auditor.close()
    dist.barrier()
    return out


def sharded_accumulation(rank: int, world: int, *, pattern: str, alarm_dir: str,
                         steps: int = 6, fault: Optional[fsdp_workers.flip] = None,
                         audit_every: int = 5) -> dict[str, Any]:
    """FSDP2 or HSDP, two micro-batches a step, accumulated as `pattern` says:
    "every" (FSDP2 reduces on every micro-step, the memory-saving default), "no_sync"
    (set_requires_gradient_sync(False) on the first), "no_all_reduce" (HSDP:
    set_requires_all_reduce(False) on the first)."""
    hsdp = pattern == "no_all_reduce"
    torch.manual_seed(fsdp_workers.SEED)
    model = fsdp_workers.build(world, hsdp=hsdp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    k = 2

    def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:  # as backpropagated: divided by k
        return fsdp_workers.compute_loss(m, b) / k

    auditor = Auditor(model, loss_fn=loss_fn, audit_every=audit_every, weights_every=audit_every,
                      alarm_dir=alarm_dir, job="t", accumulation_steps=k)

    def run() -> int:
        done = 0
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            micro = [fsdp_workers.batch_for(rank, step * 10 + i) for i in range(k)]
            total: Any = 0.0
            ctx = (fault(rank, step) if fault else None) or contextlib.nullcontext()
            with ctx:
                for i, mb in enumerate(micro):
                    last = i == k - 1
                    if pattern == "no_sync":
                        model.set_requires_gradient_sync(last)
                    elif pattern == "no_all_reduce":
                        model.set_requires_all_reduce(last)
                    loss = loss_fn(model, mb)
                    loss.backward()
                    total = total + loss.detach()
            auditor.check_gradients(step, total, batch=micro)
            opt.step()
            auditor.check_weights(step)
            done += 1
        return done

    return _loop_result(auditor, run)


def ddp_accumulation(rank: int, world: int, *, pattern: str, alarm_dir: str, steps: int = 6,
                     fault: Optional[fsdp_workers.flip] = None, audit_every: int = 5
                     ) -> dict[str, Any]:
    """DDP, two micro-batches a step: "every" (no no_sync: every backward all-reduces) or
    "no_sync" (the first under ddp.no_sync())."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(fsdp_workers.SEED)
    model = synthetic.make_model(fsdp_workers.SEED, **fsdp_workers.SHAPE)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    k = 2

    def batches(r: int, step: int) -> list[Any]:
        return [fsdp_workers.batch_for(r, step * 10 + i) for i in range(k)]

    def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return fsdp_workers.compute_loss(m, b) / k

    auditor = Auditor(ddp, loss_fn=loss_fn, batch_fn=batches, audit_every=audit_every,
                      weights_every=audit_every, alarm_dir=alarm_dir, job="t",
                      accumulation_steps=k)

    def run() -> int:
        done = 0
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            total: Any = 0.0
            ctx = (fault(rank, step) if fault else None) or contextlib.nullcontext()
            with ctx:
                for i, mb in enumerate(batches(rank, step)):
                    sync = pattern == "every" or i == k - 1
                    with contextlib.nullcontext() if sync else ddp.no_sync():
                        loss = loss_fn(ddp, mb)
                        loss.backward()
                    total = total + loss.detach()
            auditor.check_gradients(step, total)
            opt.step()
            auditor.check_weights(step)
            done += 1
        return done

    return _loop_result(auditor, run)


PATTERNS = (("fsdp", sharded_accumulation, "every"), ("fsdp", sharded_accumulation, "no_sync"),
            ("hsdp", sharded_accumulation, "no_all_reduce"), ("ddp", ddp_accumulation, "every"),
            ("ddp", ddp_accumulation, "no_sync"))


def campaign(rank: int, world: int, *, root: str, steps: int, faults_per_pattern: int
             ) -> list[dict[str, Any]]:
    """benchmarks/bench_audit_setups.py: every accumulation pattern for `steps` healthy steps,
    audited every 5th; then forward faults at audit step 5 on ranks 0.. in turn; then an HSDP
    shard flip on every rank in turn. One row per run (rank 0's view, identical on all)."""
    import os

    rows: list[dict[str, Any]] = []

    def note(kind: str, name: str, target: Optional[int], result: dict[str, Any],
             directory: str) -> None:
        dist.barrier()
        files = _files(directory)
        a = result["alarm"]
        rows.append({"kind": kind, "setup": name, "target": target,
                     "steps": result["steps_done"], "audits": result["counters"].get("audits", 0),
                     "alarm": None if a is None else a["check"],
                     "settled": bool(a and a["settled"]),
                     "suspects": [] if a is None else a["suspect_ranks"],
                     "numeric": result["numeric"] is not None,
                     "file_nodes": sorted(f["node"] for f in files)})

    for n, (kind, fn, pattern) in enumerate(PATTERNS):
        name = f"{kind}_{pattern}"
        d = os.path.join(root, f"healthy_{name}")
        os.makedirs(d, exist_ok=True)
        note("healthy", name, None, fn(rank, world, pattern=pattern, alarm_dir=d, steps=steps), d)
        for target in range(min(faults_per_pattern, world)):
            d = os.path.join(root, f"fault_{name}_{target}")
            os.makedirs(d, exist_ok=True)
            fault = fsdp_workers.flip(target, 5, op="mm", call=3, bit=30)
            note("fault", name, target, fn(rank, world, pattern=pattern, alarm_dir=d, steps=6,
                                           fault=fault), d)
    rows.extend(shard_flips(rank, world, root=root))
    rows.extend(tensor_parallel_campaign(rank, world, root=root, steps=steps))
    return rows


def tensor_parallel_campaign(rank: int, world: int, *, root: str, steps: int
                             ) -> list[dict[str, Any]]:
    """FSDP2 x TP ((dp, tp=2), a TP group per node): `steps` healthy steps audited every 5th
    (and the first 20), then on every rank in turn a forward fault (a mantissa bit of the last
    Rowwise output, which no ReLU can mask) and a gradient fault (a backward matmul) at audit
    step 5, one run each."""
    import os

    rows: list[dict[str, Any]] = []

    def one(name: str, target: Optional[int], **kwargs: Any) -> None:
        d = os.path.join(root, f"tp_{name}_{target}")
        os.makedirs(d, exist_ok=True)
        out = tensor_parallel_train(rank, world, alarm_dir=d, **kwargs)
        dist.barrier()
        a = out["alarm"]
        rows.append({"kind": "healthy" if target is None else "tp_fault", "setup": f"fsdp_tp "
                     f"{name}", "target": target, "steps": out["steps_done"],
                     "audits": out["counters"].get("audits", 0),
                     "alarm": None if a is None else a["check"],
                     "settled": bool(a and a["settled"]),
                     "suspects": [] if a is None else a["suspect_ranks"],
                     "numeric": out["numeric"] is not None,
                     "file_nodes": sorted(f["node"] for f in _files(d))})

    one("healthy", None, steps=steps, audit_every=5)
    for target in range(world):
        one("forward", target, steps=6, audit_every=5,
            fault=fsdp_workers.flip(target, 5, op="addmm", call=3, bit=22))
        one("gradient", target, steps=6, audit_every=5,
            fault=fsdp_workers.flip(target, 5, op="mm", call=1, bit=22))
    return rows


def shard_flips(rank: int, world: int, *, root: str, label: str = "hsdp") -> list[dict[str, Any]]:
    """Every SHARD_FLIPS weight flipped in every rank's HSDP shard in turn (one run each)."""
    import os

    rows = []
    for parameter, bit in SHARD_FLIPS:
        for target in range(world):
            d = os.path.join(root, f"shard_{label}_{parameter}_{bit}_{target}")
            os.makedirs(d, exist_ok=True)
            out = hsdp_shard_flip(rank, world, alarm_dir=d, target=target, parameter=parameter,
                                  bit=bit)
            a = out["alarm"]
            rows.append({"kind": "shard_flip", "setup": f"{label} {parameter} b{bit}",
                         "target": target, "steps": out["steps_done"],
                         "audits": out["counters"].get("audits", 0),
                         "alarm": None if a is None else a["check"],
                         "settled": bool(a and a["settled"]),
                         "suspects": [] if a is None else a["suspect_ranks"],
                         "numeric": out["numeric"] is not None,
                         "file_nodes": sorted(f["node"] for f in out["files"])})
    return rows


# The weight flips of the campaign: a block's first weight (read by every forward), the position
# embedding (every sequence reads every row) and the token embedding (a row only some batches
# read), in the sign bit and in an exponent bit.
SHARD_FLIPS = (("blocks.0.qkv.weight", 31), ("blocks.0.qkv.weight", 30), ("pos.weight", 31),
               ("tok.weight", 30), ("blocks.1.proj.weight", 22))


def accumulation(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Every accumulation pattern, healthy and with a forward fault on rank 3 at audit step 5."""
    import os

    out: dict[str, Any] = {}
    fault = fsdp_workers.flip(3, 5, op="mm", call=3, bit=30)
    for kind, fn, pattern in PATTERNS:
        for faulty in (False, True):
            name = f"{kind}_{pattern}{'_fault' if faulty else ''}"
            directory = os.path.join(root, name)
            os.makedirs(directory, exist_ok=True)
            result = fn(rank, world, pattern=pattern, alarm_dir=directory,
                        fault=fault if faulty else None)
            dist.barrier()
            result["files"] = _files(directory)
            out[name] = result
    return out


def _tp_model(mesh: Any, sequence_parallel: bool = False) -> torch.nn.Module:
    """Two tensor-parallel MLP blocks (Colwise then Rowwise), sharded with fully_shard on dp."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, \
        parallelize_module

    torch.manual_seed(fsdp_workers.SEED)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                           "4": ColwiseParallel(), "6": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _tp_batch(dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dp + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _tp_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def tensor_parallel_train(rank: int, world: int, *, alarm_dir: str, steps: int = 4,
                          audit_every: int = 1, fault: Optional[fsdp_workers.flip] = None,
                          fault_in_check: bool = False, warmup: int = 20
                          ) -> dict[str, Any]:
    """FSDP2 x TP on a (dp = world / 2, tp = 2) mesh, a TP group per node: the data-parallel
    index picks the batch, so TP partners share it."""
    from screener.audit.sentinel import SentinelConfig

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model = _tp_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    auditor = Auditor(model, loss_fn=_tp_loss, audit_every=audit_every, weights_every=1,
                      alarm_dir=alarm_dir, job="t", sentinel=SentinelConfig(warmup=warmup))

    def run() -> int:
        done = 0
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            batch = _tp_batch(dp, step)
            ctx = (fault(rank, step) if fault else None) or contextlib.nullcontext()
            with ctx:
                loss = _tp_loss(model, batch)
                loss.backward()
            again = (fault(rank, step) if fault and fault_in_check else None) \
                or contextlib.nullcontext()
            with again:
                auditor.check_gradients(step, loss, batch=batch)
            opt.step()
            auditor.check_weights(step)
            done += 1
        return done

    out = _loop_result(auditor, run)
    out["files"] = _files(alarm_dir)
    return out


def tensor_parallel_scenarios(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """The TP scenarios of tests/test_audit_tensor_parallel.py in one process group."""
    import os

    cases: dict[str, dict[str, Any]] = {
        "healthy": dict(steps=6),
        # a forward (Colwise output), a mantissa bit: the TP group computes it as one
        "flip": dict(fault=fsdp_workers.flip(3, 2, op="addmm", call=1, bit=22)),
        "persistent": dict(fault=fsdp_workers.flip(3, 2, op="addmm", call=1, bit=22,
                                                   persistent=True), fault_in_check=True),
        # a backward matmul (a weight gradient of rank 3's own TP shard)
        "grad": dict(fault=fsdp_workers.flip(3, 2, op="mm", call=1, bit=22)),
        "nan": dict(fault=fsdp_workers.flip(3, 1, op="addmm", call=1, bit=None, mode="nan")),
        # between audits: one output element x 10,000, the sentinel's (warm after 3 steps)
        "spike": dict(steps=8, audit_every=1000, warmup=3,
                      fault=fsdp_workers.flip(3, 6, op="addmm", call=3, bit=None,
                                              mode="scale")),
        "spike_persistent": dict(steps=8, audit_every=1000, warmup=3, fault_in_check=True,
                                 fault=fsdp_workers.flip(3, 6, op="addmm", call=3, bit=None,
                                                         mode="scale", persistent=True)),
    }
    out: dict[str, Any] = {}
    for name, kwargs in cases.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        out[name] = tensor_parallel_train(rank, world, alarm_dir=d, **kwargs)
        dist.barrier()
        out[name]["files"] = _files(d)
    grad = fsdp_workers.flip(3, 2, op="mm", call=1, bit=22)
    for name, lp, fault in (("sp_healthy", False, None), ("sp_grad", False, grad),
                            ("lp_healthy", True, None), ("lp_grad", True, grad)):
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        out[name] = sequence_parallel_train(rank, world, alarm_dir=d, loss_parallel=lp,
                                            fault=fault)
        dist.barrier()
        out[name]["files"] = _files(d)
    return out


class _SPBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _SPNet(torch.nn.Module):
    """A token model for sequence parallel: embedding, two residual MLP blocks, the head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.blocks = torch.nn.ModuleList([_SPBlock(), _SPBlock()])
        self.norm = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 32, bias=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.emb(t)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def sequence_parallel_train(rank: int, world: int, *, alarm_dir: str, loss_parallel: bool,
                            fault: Optional[fsdp_workers.flip] = None, steps: int = 4
                            ) -> dict[str, Any]:
    """FSDP2 x TP with sequence parallel (the norms SequenceParallel, activations sharded on the
    sequence between blocks, torchtitan's plan in small) and, with loss_parallel, the head's
    logits left sharded on the vocabulary and the cross-entropy under loss_parallel()."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, \
        SequenceParallel, parallelize_module
    from torch.distributed.tensor.parallel import loss_parallel as lp

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    model = _SPNet()
    parallelize_module(model, mesh["tp"], {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1),
                               output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)})
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"norm": SequenceParallel(),
                                           "up": ColwiseParallel(input_layouts=Shard(1)),
                                           "down": RowwiseParallel(output_layouts=Shard(1))})
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ctx_lp = lp if loss_parallel else contextlib.nullcontext

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        t, y = batch
        logits = m(t)
        with ctx_lp():
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    auditor = Auditor(model, loss_fn=loss_fn, audit_every=1, weights_every=1,
                      alarm_dir=alarm_dir, job="t")

    def run() -> int:
        done = 0
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            g = torch.Generator().manual_seed(100 * dp + step)
            batch = (torch.randint(0, 32, (2, 8), generator=g),
                     torch.randint(0, 32, (2, 8), generator=g))
            ctx = (fault(rank, step) if fault else None) or contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model, batch)
                with ctx_lp():
                    loss.backward()
            auditor.check_gradients(step, loss, batch=batch)
            opt.step()
            auditor.check_weights(step)
            done += 1
        return done

    return _loop_result(auditor, run)


def fsdp_shard_drift(rank: int, world: int, *, alarm_dir: str, target: Optional[int],
                     every_rank: bool = False, bit: int = 30, steps: int = 5) -> dict[str, Any]:
    """Pure FSDP (a 1-D mesh, no replicas to vote); after check_weights(2), one bit of element
    0 of `target`'s first shard flips (or, every_rank, the loop scales every rank's weights in
    place after check_weights: a loop bug, not hardware)."""
    torch.manual_seed(fsdp_workers.SEED)
    model = fsdp_workers.build(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    auditor = Auditor(model, loss_fn=fsdp_workers.compute_loss, audit_every=0, weights_every=1,
                      alarm_dir=alarm_dir, job="t")

    def run() -> int:
        done = 0
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            batch = fsdp_workers.batch_for(rank, step)
            loss = fsdp_workers.compute_loss(model, batch)
            loss.backward()
            auditor.check_gradients(step, loss, batch=batch)
            opt.step()
            auditor.check_weights(step)
            if step == 2 and every_rank:
                with torch.no_grad():
                    next(model.parameters()).to_local().mul_(0.999)
            elif step == 2 and rank == target:
                faults.apply_to_tensor(next(model.parameters()).to_local().data, 0,
                                       mode="flip", bit=bit)
            done += 1
        return done

    out = _loop_result(auditor, run)
    out["files"] = _files(alarm_dir)
    return out


def hsdp_tensor_parallel(rank: int, world: int, *, alarm_dir: str,
                         fault: Optional[fsdp_workers.flip] = None, steps: int = 4
                         ) -> dict[str, Any]:
    """HSDP x TP on a 3-D (replicate = 2, shard = 2, tp = 2) mesh of 8 ranks, a TP group per
    node; the batch follows the (replicate, shard) index."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp = mesh["replicate"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, \
        parallelize_module

    torch.manual_seed(fsdp_workers.SEED)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["replicate", "shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    auditor = Auditor(model, loss_fn=_tp_loss, audit_every=1, weights_every=1,
                      alarm_dir=alarm_dir, job="t")

    def run() -> int:
        done = 0
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            batch = _tp_batch(dp, step)
            ctx = (fault(rank, step) if fault else None) or contextlib.nullcontext()
            with ctx:
                loss = _tp_loss(model, batch)
                loss.backward()
            auditor.check_gradients(step, loss, batch=batch)
            opt.step()
            auditor.check_weights(step)
            done += 1
        return done

    out = _loop_result(auditor, run)
    out["files"] = _files(alarm_dir)
    return out
