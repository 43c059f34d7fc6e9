"""The pipeline-parallel audit's cost, side by side with the plain job in one process group.

    python benchmarks/bench_audit_pp.py [--rounds 10] [--steps 3] [--schedule 1f1b]

Six gloo ranks, pp 2 x dp 3 (a pipeline per simulated node), the Llama-style stages of
tests/pipeline_workers.py at d_model 128, seq 64, batch 8 (4 micro-batches), FSDP2 per stage.
Three copies of the job train in the same process group: plain (the schedule alone), the
Auditor with no audit due (check 1, the spike sentinel and the shard record every step: the
cost of a step without an audit) and the Auditor auditing every step (a replay through the schedule and the
comparison). Rounds interleave the three (the order reversed every other round); printed: the
median per-step time of each and the median of the paired ratios to plain, with the quartiles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = dict(D=128, HEADS=4, SEQ=64, BATCH=8, VOCAB=512, MICRO=4)


def _rank(rank: int, world: int, *, rounds: int, steps: int, schedule: str) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import pipeline_workers as pw
    from screener.audit import Auditor
    from screener.audit.sentinel import SentinelConfig

    for k, v in SHAPE.items():  # the workers' module constants: a bigger model than the tests'
        setattr(pw, k, v)
    pp = 2
    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    jobs: dict[str, dict[str, Any]] = {}
    for kind in ("plain", "check1", "audit"):
        model = pw.Stage(s, pp, dropout=0.0)
        fully_shard(model.block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        stage = PipelineStage(model, s, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        sched = cls(stage, n_microbatches=pw.MICRO, loss_fn=pw.loss_fn)
        # the sentinel's warm-up (the steps audited while it has no baseline) inside the
        # untimed warm-up run below, so that "no audit due" times steps without an audit
        auditor = None if kind == "plain" else Auditor(
            sched, audit_every=1 if kind == "audit" else 10 ** 6, weights_every=100,
            self_check_every=0, sentinel=SentinelConfig(warmup=max(3, steps)))
        jobs[kind] = {"model": model, "sched": sched, "auditor": auditor, "step": 1,
                      "opt": torch.optim.AdamW(model.parameters(), lr=1e-4)}

    def run(kind: str) -> float:
        j = jobs[kind]
        t0 = time.perf_counter()
        for _ in range(steps):
            step = j["step"]
            tokens, target = pw.batch_for(d, step)
            losses: list[Any] = []
            if s == 0:
                j["sched"].step(tokens)
            else:
                j["sched"].step(target=target, losses=losses)
            if j["auditor"] is not None:
                j["auditor"].check_gradients(step, losses, batch=tokens if s == 0 else target)
            j["opt"].step()
            j["opt"].zero_grad(set_to_none=True)
            if j["auditor"] is not None:
                j["auditor"].check_weights(step)
            j["step"] += 1
        return (time.perf_counter() - t0) / steps

    for kind in jobs:  # warm-up (the schedules' shape inference, the first audit)
        run(kind)
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for r in range(rounds):
        for kind in (list(jobs) if r % 2 == 0 else list(reversed(jobs))):
            times[kind].append(run(kind))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=3, help="steps per timed run")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    a = p.parse_args(argv)
    from ddp_util import run_ranks

    nodes = ["n0", "n1", "n2", "n0", "n1", "n2"]
    t = run_ranks(_rank, nodes, timeout=3600, rounds=a.rounds, steps=a.steps,
                  schedule=a.schedule)[0]

    def q(xs: list[float], f: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]

    print(f"pipeline parallel x FSDP2, pp 2 x dp 3, {a.schedule}, {a.rounds} rounds x {a.steps} "
          f"steps, stages {SHAPE}")
    print(f"plain step: median {statistics.median(t['plain']) * 1e3:.1f} ms")
    for k, label in (("check1", "Auditor, no audit due"), ("audit", "Auditor, audit step")):
        xs = [x / y for x, y in zip(t[k], t["plain"])]
        print(f"{label:24} x{statistics.median(xs):.3f} [{q(xs, .25):.3f}-{q(xs, .75):.3f}] "
              f"(median {statistics.median(t[k]) * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
