"""Train a tiny language model with DDP under screener.audit, inject a fault, watch the alarm.

Runs on CPU with gloo under torchrun; --nodes N simulates N Kubernetes nodes on this machine by
setting NODE_NAME per rank from LOCAL_RANK (named like HyperPod nodes, `hyperpod-i-<hex>`, so the
alarm shows the instance ID a replacement would target):

    screener launch -- torchrun --nproc-per-node 6 examples/train_ddp.py --nodes 3 \
        --inject flip:rank=3,step=20
    # ... ALARM: SDC alarm ring_replay at step 20: rank 3 on hyperpod-i-00000000000000002 ...
    # ... exit code 75 (the workers' and, through screener launch, the job's)

Faults (--inject KIND[:rank=R,step=S], from screener.known_answer.engine.faults):
    nan        NaN in one element of a backward op on rank R at step S   -> nonfinite_local, rank R
    scale      one activation times 10,000 on rank R at step S           -> ring_replay, rank R
               (S must be an audit step: a multiple of --audit-every)
    flip       mantissa bit 12 of one attention-times-values output     -> ring_replay, rank R
               (audit step; the loss often keeps every bit, the gradients do not.
               The lowest bit of the first matmul, q @ k^T, would be masked: one
               ulp of one score vanishes in the softmax, whose backward never
               reads the matmul's output)
    weight     a bit of one weight flipped after optimizer.step          -> weights, rank R
               (at the next weight check or verified save; an audit step that comes
               first sees the changed gradient and reports ring_replay, rank R)
    allreduce  NaN written into rank R's gradient bucket inside the all-reduce -> nonfinite_reduced
    none       a healthy run (the default): exit code 0

Rank 0 prints the alarm, the alarm files in SCREENER_ALARM_DIR (--alarm-dir; a fresh temporary
directory by default), the checkpoint to roll back to, and the exit code; the injecting rank prints
what its fault changed. Every rank logs JSON lines to stderr. Each worker exits with the code
screener.audit.run_guarded chose: 75 hardware suspect, 76 numeric, 77 a peer failed. torchrun alone
exits 1 when a worker fails; `screener launch -- torchrun ...` exits with the workers' code.

Teardown order (screener.audit.shutdown): the models and the Auditor are dropped and their
reference cycles collected before the process group is destroyed, so a healthy run never dies with
SIGABRT at exit.
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
from torch.nn.parallel import DistributedDataParallel as DDP

from screener.known_answer.engine import faults
from screener.known_answer.engine import synthetic
from screener.audit import Auditor, SDCAlarm, rollback_target, run_guarded, shutdown
from screener.alarmfile import AlarmRecord
from screener.types import ALARM_DIR_ENV, NODE_NAME_ENV

KINDS = ("none", "nan", "scale", "flip", "weight", "allreduce")


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
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--audit-every", type=int, default=5)
    p.add_argument("--weights-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=None, help="default: a temporary directory")
    p.add_argument("--alarm-dir", default=None, help=f"sets {ALARM_DIR_ENV}; default: a temp dir")
    p.add_argument("--inject", type=parse_inject, default=parse_inject("none"),
                   metavar="KIND[:rank=R,step=S]", help="a fault to inject (see below)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    return p.parse_args(argv)


def say(*parts: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(*parts, flush=True)


def simulated_node(local_rank: int, nproc: int, nodes: int) -> str:
    # Ranks split evenly over the nodes; HyperPod-style names carry a (made-up) instance ID.
    return f"hyperpod-i-{local_rank * nodes // nproc + 1:017x}"


CREATED: list[str] = []  # temporary directories this run made (rank 0 removes them at the end)


def shared_dir(path: Optional[str], what: str) -> Path:
    """A directory every rank agrees on: the given one, or one rank 0 creates and broadcasts."""
    box = [path]
    if path is None and dist.get_rank() == 0:
        box = [tempfile.mkdtemp(prefix=f"screener-{what}-")]
        CREATED.append(box[0])
    dist.broadcast_object_list(box, src=0)
    Path(box[0]).mkdir(parents=True, exist_ok=True)
    return Path(box[0])


def train(args: argparse.Namespace) -> int:
    rank = dist.get_rank()
    inject = args.inject
    vocab = 64
    model = synthetic.make_model(args.seed, vocab=vocab, d_model=args.d_model, n_heads=4,
                                 d_ff=2 * args.d_model, seq=args.seq, n_layers=args.layers)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    def batch_fn(r: int, step: int):
        return synthetic.batch_for(args.seed, r, step, batch=args.batch, seq=args.seq, vocab=vocab)

    reduce_hook = None
    if inject["kind"] == "allreduce":
        # The hook counts calls (one per gradient bucket): this model has one bucket per step.
        reduce_hook = faults.corrupt_allreduce(rank=inject["rank"], calls={inject["step"]})
    auditor = Auditor(ddp, loss_fn=synthetic.compute_loss, batch_fn=batch_fn,
                      audit_every=args.audit_every, weights_every=args.weights_every,
                      reduce_hook=reduce_hook)
    say(f"topology: {json.dumps(auditor.topology.to_dict()['nodes'])}")
    ckpt_dir = shared_dir(args.ckpt_dir, "ckpt")
    alarm_dir = Path(os.environ[ALARM_DIR_ENV])

    def save(step: int) -> Optional[Path]:
        if rank != 0:
            return None
        path = ckpt_dir / f"step{step:06d}.pt"
        torch.save(model.state_dict(), path)
        return path

    specs = {"nan": faults.FaultSpec(op="gelu_backward", element=3, mode="nan"),
             "scale": faults.FaultSpec(op="gelu", element=5, mode="scale", factor=1e4),
             "flip": faults.FaultSpec(op="matmul", call=1, element=9, bit=12, mode="flip")}
    try:
        for step in range(args.steps):
            opt.zero_grad(set_to_none=True)
            mine = rank == inject["rank"] and step == inject["step"]
            ctx = faults.inject(specs[inject["kind"]]) if mine and inject["kind"] in specs else None
            if ctx is not None:
                with ctx:
                    loss = synthetic.compute_loss(ddp, batch_fn(rank, step))
                    loss.backward()
                for f in ctx.fired:
                    print(f"rank {rank} step {step}: fault in {f['op']} output element "
                          f"{f['element']}: {f['before']} -> {f['after']}", flush=True)
            else:
                loss = synthetic.compute_loss(ddp, batch_fn(rank, step))
                loss.backward()
            auditor.check_gradients(step, loss)
            opt.step()
            if mine and inject["kind"] == "weight":
                faults.corrupt_parameter(model, "blocks.0.fc1.weight", element=7, bit=12)
            auditor.check_weights(step)
            if step % args.ckpt_every == 0:
                auditor.verified_save(lambda: save(step), step)
            if step % 10 == 0:
                loss = loss.detach()
                say(f"step {step:4d}  loss {loss.item():.4f}")
    except SDCAlarm as alarm:
        dist.barrier()  # collective verdict: every rank is here; their alarm files are written
        say(f"\nALARM: {alarm}")
        say(json.dumps(alarm.to_dict(), indent=2))
        if rank == 0:
            for f in sorted(alarm_dir.glob("*.json")):
                rec = AlarmRecord.from_dict(json.loads(f.read_text()))
                print(f"alarm file {f}: node {rec.node} settled={rec.settled} "
                      f"suspect_ranks={list(rec.suspect_ranks)}", flush=True)
            target = rollback_target(str(ckpt_dir), alarm.first_suspect_step)
            print(f"roll back to: {target} (first suspect step {alarm.first_suspect_step})",
                  flush=True)
        raise
    finally:
        auditor.close()  # drops the forward pre-hook: the DDP model can go with train()'s frame
    say(f"done: {args.steps} steps, no alarm; counters {dict(auditor.counters)}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(1)  # bit-identical replays need the same thread count on every rank
    if args.nodes:
        local, nproc = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        os.environ[NODE_NAME_ENV] = simulated_node(local, nproc, args.nodes)
    dist.init_process_group("gloo")
    try:
        if ALARM_DIR_ENV not in os.environ or args.alarm_dir:
            os.environ[ALARM_DIR_ENV] = str(shared_dir(args.alarm_dir, "alarms"))
        say(f"alarm directory: {os.environ[ALARM_DIR_ENV]}")
        code = run_guarded(train, args)  # train's models are gone when it returns
        say(f"exit code {code}")
        for d in CREATED:  # a demo leaves nothing behind in /tmp; pass --alarm-dir to keep them
            shutil.rmtree(d, ignore_errors=True)
            say(f"removed {d} (pass --alarm-dir / --ckpt-dir to keep the files)")
    except BaseException:
        shutdown(1)  # a bug of ours: still tear down in order, then show the traceback
        raise
    return shutdown(code)  # collect the DDP/Auditor cycles, then destroy the group


if __name__ == "__main__":
    sys.exit(main())
