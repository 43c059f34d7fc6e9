"""Known-answer screening: time per job, and a detection campaign with random single-bit flips.

    python benchmarks/bench_kat.py [--device cpu] [--flips 200] [--seed 0] [--json]

Part 1 times every job in this process (after a warm-up run) and the whole quick screen as
`screener kat run` runs it (child process start-up included).

Part 2 injects N random single-bit flips per job, each drawn with screener.known_answer.engine.faults.random_flips
(op, the n-th call of it, the element and the bit all at random, over every call the job makes,
forward and backward), and counts:

- fired: the flip was applied (the call and element exist);
- KAT: the job's result differs bit for bit from the clean run (what `screener kat` checks);
- tol 1e-3: a comparison with relative tolerance 1e-3 would have noticed it (for GEMM and conv
  jobs, any product element off by more than 1e-3 relative, as DCGM's GEMM check does; for
  training and replay jobs, any step's loss off by more than 1e-3 relative, as loss-comparison
  tools do); non-finite values count as noticed;
- masked: the flip changed nothing at all (no check that looks at outputs could see it);
- for training jobs: how many flips reached the loss bits, and how many showed only in the
  gradient or weight fingerprints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from screener.known_answer.engine import faults
from screener.known_answer.engine.screen import quick_jobs  # noqa: E402
from screener.known_answer.engine import supervise  # noqa: E402
from screener.known_answer.engine import workloads as w  # noqa: E402

# The ops a campaign draws from, per job kind (the aten names the dispatcher sees).
CAMPAIGN_OPS = {
    "gemm": ["mm"],
    "conv": ["convolution"],
    "train": ["mm", "addmm", "bmm", "_softmax", "native_layer_norm", "gelu", "embedding",
              "_log_softmax", "add", "mul"],
    "replay": ["mm", "addmm", "bmm", "_softmax", "native_layer_norm", "gelu", "embedding",
               "_log_softmax"],
}
CAMPAIGN_JOBS = ["gemm-fp32", "gemm-bf16", "gemm-tf32", "conv-fp32", "train-fp32", "train-bf16",
                 "replay-fp32"]


def time_jobs(device: str, repeats: int = 3) -> list[dict[str, Any]]:
    rows = []
    for spec in w.load_jobs(ROOT / "jobs"):
        w.run_job(spec, device)  # warm-up
        times = [w.run_job(spec, device).seconds for _ in range(repeats)]
        rows.append({"job": spec.name, "kind": spec.kind, "quick": spec.quick,
                     "seconds": min(times), "steps": len(w.run_job(spec, device).steps)})
    return rows


def time_screen(device: str) -> dict[str, Any]:
    t0 = time.monotonic()
    runs = supervise.execute(quick_jobs(str(ROOT / "jobs")), [device], iterations=2)
    total = time.monotonic() - t0
    run = runs[device]
    jobs = sum(sum(r.seconds) for r in run.jobs.values())
    return {"device": device, "wall_seconds": round(total, 2), "job_seconds": round(jobs, 2),
            "startup_and_overhead_seconds": round(total - jobs, 2), "repeat": 2,
            "status": run.status}


def _op_calls(spec: w.JobSpec, device: str, ops: list[str]) -> dict[str, int]:
    counter = faults.inject(*[faults.FaultSpec(op, call=10 ** 9) for op in ops])
    w.run_job(spec, device, injector=counter)
    return dict(zip(ops, counter.counts))


def _tolerance_noticed(spec: w.JobSpec, clean: w.JobResult, r: w.JobResult) -> bool:
    if spec.kind in ("gemm", "conv"):
        for key, ref in clean.values.items():
            got = r.values[key]
            if not torch.isfinite(got).all():
                return True
            if ((got - ref).abs() > 1e-3 * ref.abs()).any():
                return True
        return False
    for key, ref in clean.values.items():
        got = r.values[key]
        if not math.isfinite(got) or abs(got - ref) > 1e-3 * abs(ref):
            return True
    return False


def campaign(spec: w.JobSpec, device: str, n: int, seed: int) -> dict[str, Any]:
    ops = CAMPAIGN_OPS[spec.kind]
    clean = w.run_job(spec, device, keep_values=True)
    calls = {op: c for op, c in _op_calls(spec, device, ops).items() if c > 0}
    p = spec.params_for(device)
    width = 16 if (spec.kind in ("gemm", "conv") and p["dtype"] != "float32") else 32
    # Draw op first (uniform over ops the job uses), then a call of that op.
    draws = faults.random_flips(n, seed=seed, ops=sorted(calls), max_call=1 << 30,
                                max_element=1 << 20, bits=width)
    counts = {"flips": n, "fired": 0, "kat": 0, "tol": 0, "masked": 0, "loss_bits": 0,
              "fingerprints_only": 0, "missed_by_kat": 0}
    by_op: dict[str, dict[str, int]] = {}
    for f in draws:
        f = faults.FaultSpec(f.op, call=f.call % calls[f.op], element=f.element, bit=f.bit)
        inj = faults.inject(f)
        r = w.run_job(spec, device, injector=inj, keep_values=True)
        o = by_op.setdefault(f.op, {"flips": 0, "kat": 0, "tol": 0, "masked": 0})
        o["flips"] += 1
        if not inj.fired:
            continue
        counts["fired"] += 1
        detected = r.digest != clean.digest
        tol = _tolerance_noticed(spec, clean, r)
        if detected:
            counts["kat"] += 1
            o["kat"] += 1
        else:
            counts["masked"] += 1
            o["masked"] += 1
        if tol:
            counts["tol"] += 1
            o["tol"] += 1
        if tol and not detected:
            counts["missed_by_kat"] += 1
        if spec.kind in ("train", "replay") and detected:
            if any(a.loss != b.loss for a, b in zip(clean.steps, r.steps)):
                counts["loss_bits"] += 1
            else:
                counts["fingerprints_only"] += 1
    return {"job": spec.name, "device": device, "ops": calls, **counts, "by_op": by_op}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--flips", type=int, default=200, help="random flips per job")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--job", action="append", help="campaign job (repeatable)")
    ap.add_argument("--skip-screen", action="store_true", help="do not time the child screen")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    out["jobs"] = time_jobs(args.device)
    if not args.skip_screen:
        out["screen"] = time_screen(args.device)
    specs = {s.name: s for s in w.load_jobs(ROOT / "jobs")}
    out["campaign"] = []
    for i, name in enumerate(args.job or CAMPAIGN_JOBS):
        t0 = time.monotonic()
        row = campaign(specs[name], args.device, args.flips, args.seed + i)
        row["seconds"] = round(time.monotonic() - t0, 1)
        out["campaign"].append(row)
        print(f"# {name}: {row['seconds']} s", file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"Time per job on {args.device} (torch {torch.__version__}, best of 3, in process)")
    print(f"  {'job':14s} {'kind':7s} {'steps':>5s} {'ms':>9s}")
    for r in out["jobs"]:
        print(f"  {r['job']:14s} {r['kind']:7s} {r['steps']:5d} {1000 * r['seconds']:9.1f}")
    if "screen" in out:
        s = out["screen"]
        print(f"Quick screen in a child process, repeat 2: {s['wall_seconds']} s wall "
              f"({s['job_seconds']} s in jobs, {s['startup_and_overhead_seconds']} s start-up "
              f"and overhead)")
    print()
    print(f"Detection campaign: {args.flips} random single-bit flips per job (seed {args.seed})")
    print(f"  {'job':12s} {'fired':>5s} {'KAT':>12s} {'tol 1e-3':>12s} {'masked':>7s} "
          f"{'loss bits':>9s} {'fp only':>7s}")
    for r in out["campaign"]:
        fired = max(r["fired"], 1)
        train = r["job"].startswith(("train", "replay"))
        print(f"  {r['job']:12s} {r['fired']:5d} {r['kat']:5d} ({100 * r['kat'] / fired:4.1f}%) "
              f"{r['tol']:5d} ({100 * r['tol'] / fired:4.1f}%) {r['masked']:7d} "
              f"{r['loss_bits'] if train else '-':>9} {r['fingerprints_only'] if train else '-':>7}")
    print("  (KAT: bit-exact result differs; tol: a 1e-3 relative comparison notices; masked: the "
          "flip changed no output bit; loss bits / fp only: detected flips that changed a loss vs "
          "only gradient or weight fingerprints)")
    for r in out["campaign"]:
        if len(r["by_op"]) > 1:
            parts = ", ".join(f"{op} {o['kat']}/{o['flips']}" for op, o in sorted(r["by_op"].items()))
            print(f"  {r['job']} detected per op: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
