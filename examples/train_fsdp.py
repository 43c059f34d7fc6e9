"""Train a tiny language model with FSDP2 (bf16 mixed precision) under screener.audit, no batch_fn.

Runs on CPU with gloo under torchrun; --nodes N simulates N Kubernetes nodes on this machine by
setting NODE_NAME per rank from LOCAL_RANK (HyperPod-style names, `hyperpod-i-<hex>`). The model
is sharded with `fully_shard` per block and at the root (on a 1-D mesh, or with --hsdp on a 2-D
replicate x shard mesh); parameters compute in bf16 and gradients reduce in fp32
(MixedPrecisionPolicy). The loop never rebuilds a batch for the audit: it hands its own batch to
`check_gradients(step, loss, batch=batch)`, and on audit steps the batch travels to the rank that
replays it.

    screener launch -- torchrun --nproc-per-node 6 examples/train_fsdp.py --nodes 3 \\
        --inject flip:rank=3,step=10
    # ... ALARM: SDC alarm ring_replay at step 10: rank 3 on hyperpod-i-00000000000000002 ...
    # ... exit code 75

Faults (--inject KIND[:rank=R,step=S]):
    flip   exponent bit 30 of one forward matmul output on rank R at step S -> ring_replay, rank R
           (S must be an audit step: a multiple of --audit-every)
    nan    NaN in one forward matmul output on rank R at step S             -> nonfinite_local, rank R
    none   a healthy run (the default): exit code 0
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from screener.audit import Auditor, SDCAlarm, run_guarded, shutdown
from screener.known_answer.engine import faults, synthetic
from screener.alarmfile import AlarmRecord
from screener.types import ALARM_DIR_ENV, NODE_NAME_ENV

KINDS = ("none", "flip", "nan")


def parse_inject(text: str) -> dict[str, Any]:
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"--inject {text!r}: kind must be one of {', '.join(KINDS)}")
    spec: dict[str, Any] = {"kind": kind, "rank": 1, "step": 10}
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key not in ("rank", "step") or not value.isdigit():
            raise argparse.ArgumentTypeError(f"--inject {text!r}: expected rank=R,step=S")
        spec[key] = int(value)
    return spec


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=0,
                   help="simulate this many nodes (sets NODE_NAME per rank); 0 keeps NODE_NAME")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--audit-every", type=int, default=5)
    p.add_argument("--weights-every", type=int, default=10)
    p.add_argument("--hsdp", action="store_true", help="a 2-D (replicate, shard) mesh")
    p.add_argument("--alarm-dir", default=None, help=f"sets {ALARM_DIR_ENV}; default: a temp dir")
    p.add_argument("--inject", type=parse_inject, default=parse_inject("none"),
                   metavar="KIND[:rank=R,step=S]", help="a fault to inject (see below)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def say(*parts: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(*parts, flush=True)


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The TinyLM, each block and the root sharded with fully_shard, bf16 compute, fp32 reduce."""
    world = dist.get_world_size()
    model = synthetic.make_model(args.seed, vocab=64, d_model=32, n_heads=4, d_ff=64, seq=16,
                                 n_layers=2)
    if args.hsdp:
        if world % 2:
            raise SystemExit("--hsdp needs an even number of ranks (2 shards per replica)")
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def loader(seed: int, rank: int):
    """A data loader the audit cannot rebuild from (rank, step): it just yields batches."""
    step = 0
    while True:
        yield synthetic.batch_for(seed, rank, step, batch=4, seq=16, vocab=64)
        step += 1


def train(args: argparse.Namespace) -> int:
    rank = dist.get_rank()
    inject = args.inject
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    auditor = Auditor(model, loss_fn=synthetic.compute_loss, audit_every=args.audit_every,
                      weights_every=args.weights_every)
    say(f"topology: {json.dumps(auditor.topology.to_dict()['nodes'])}")
    specs = {"flip": faults.FaultSpec(op="mm", call=3, element=5, bit=30),
             "nan": faults.FaultSpec(op="mm", call=2, element=5, mode="nan")}
    batches = loader(args.seed, rank)
    try:
        for step in range(args.steps):
            opt.zero_grad(set_to_none=True)
            batch = next(batches)
            mine = rank == inject["rank"] and step == inject["step"] and inject["kind"] in specs
            ctx = faults.inject(specs[inject["kind"]]) if mine else None
            if ctx is not None:
                with ctx:
                    loss = synthetic.compute_loss(model, batch)
                    loss.backward()
                for f in ctx.fired:
                    print(f"rank {rank} step {step}: fault in {f['op']} output element "
                          f"{f['element']}: {f['before']} -> {f['after']}", flush=True)
            else:
                loss = synthetic.compute_loss(model, batch)
                loss.backward()
            auditor.check_gradients(step, loss, batch=batch)
            opt.step()
            auditor.check_weights(step)
            if step % 5 == 0:
                say(f"step {step:4d}  loss {loss.detach().item():.4f}")
    except SDCAlarm as alarm:
        dist.barrier()  # every rank is here; their alarm files are written
        say(f"\nALARM: {alarm}")
        if rank == 0:
            for f in sorted(Path(os.environ[ALARM_DIR_ENV]).glob("*.json")):
                rec = AlarmRecord.from_dict(json.loads(f.read_text()))
                print(f"alarm file {f}: node {rec.node} settled={rec.settled} "
                      f"suspect_ranks={list(rec.suspect_ranks)}", flush=True)
        raise
    finally:
        auditor.close()
    say(f"done: {args.steps} steps, no alarm; counters {dict(auditor.counters)}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
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
