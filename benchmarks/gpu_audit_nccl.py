"""The in-job audit under NCCL, one rank per GPU: a healthy run must end without an alarm, and a
fault injected on one rank must be caught by the ring replay and name that rank.

examples/train_ddp.py is the same loop on the CPU (gloo); this is its CUDA twin for the first
machine with more than one GPU (run by benchmarks/gpu_acceptance.sh):

    torchrun --nproc-per-node 2 benchmarks/gpu_audit_nccl.py                  # exit 0
    torchrun --nproc-per-node 2 benchmarks/gpu_audit_nccl.py --inject-rank 1  # exit 75

The fault scales one activation of the injecting rank's forward on an audit step (as
train_ddp.py's `scale`), so its gradients differ from what its ring neighbour recomputes. Each
worker exits with the code screener.audit.run_guarded chose (0 pass, 75 hardware suspect, 76
numeric, 77 a peer failed); rank 0 prints one JSON line: steps, alarm, suspect ranks, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from screener.audit import Auditor, SDCAlarm, run_guarded, shutdown
from screener.determinism import make_deterministic
from screener.known_answer.engine import faults, synthetic
from screener.types import ALARM_DIR_ENV

SHAPE = dict(vocab=64, d_model=64, n_heads=4, d_ff=128, seq=16, n_layers=2)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--audit-every", type=int, default=5)
    p.add_argument("--inject-rank", type=int, default=-1,
                   help="scale one activation on this rank at --inject-step (default: none)")
    p.add_argument("--inject-step", type=int, default=10, help="an audit step")
    return p.parse_args(argv)


def train(args: argparse.Namespace, device: torch.device) -> int:
    rank = dist.get_rank()
    model = synthetic.make_model(0, **SHAPE).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def batch_fn(r: int, step: int) -> Any:
        return synthetic.batch_for(0, r, step, batch=4, seq=SHAPE["seq"], vocab=SHAPE["vocab"],
                                   device=device)

    auditor = Auditor(ddp, loss_fn=synthetic.compute_loss, batch_fn=batch_fn,
                      audit_every=args.audit_every, weights_every=args.audit_every)
    spec = faults.FaultSpec(op="gelu", element=5, mode="scale", factor=1e4)
    t0 = time.monotonic()
    report: dict[str, Any] = {"world": dist.get_world_size(), "backend": dist.get_backend()}
    try:
        for step in range(args.steps):
            opt.zero_grad(set_to_none=True)
            if rank == args.inject_rank and step == args.inject_step:
                with faults.inject(spec):
                    loss = synthetic.compute_loss(ddp, batch_fn(rank, step))
                    loss.backward()
            else:
                loss = synthetic.compute_loss(ddp, batch_fn(rank, step))
                loss.backward()
            auditor.check_gradients(step, loss)
            opt.step()
            auditor.check_weights(step)
        report.update(steps=args.steps, alarm=None)
    except SDCAlarm as alarm:
        report.update(steps=alarm.step, alarm=alarm.check, suspect_ranks=list(alarm.suspect_ranks))
        raise
    finally:
        auditor.close()
        torch.cuda.synchronize(device)
        report["seconds"] = round(time.monotonic() - t0, 2)
        if rank == 0:
            print(json.dumps(report), flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    make_deterministic(device)  # the ring replay must recompute a neighbour's step bit for bit
    os.environ.setdefault(ALARM_DIR_ENV, tempfile.mkdtemp(prefix="screener-nccl-alarms-"))
    dist.init_process_group("nccl", device_id=device)
    try:
        code = run_guarded(train, args, device)
    except BaseException:
        shutdown(1)
        raise
    return shutdown(code)


if __name__ == "__main__":
    sys.exit(main())
