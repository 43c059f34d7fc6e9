"""The in-job audit under the training setups people run: the long form of tests/test_audit_matrix.py.

Six gloo ranks on three simulated nodes (n0 = {0, 1}, n1 = {2, 3}, n2 = {4, 5}), ring replay and
weight vote at every step. For every setup (fp32, bf16 autocast, fp16 autocast + GradScaler with
forced overflow steps, unseeded and per-rank-seeded nn.Dropout, gradient accumulation under
no_sync, clipping, BatchNorm with and without broadcast_buffers, a loss_fn with extra outputs;
issue 28's: DDP(torch.compile(model)), reentrant and non-reentrant activation checkpointing,
gradient_as_bucket_view and clip_grad_norm_ under a +1e20 gradient spike on every rank):

- one healthy run of --steps steps: alarms, numeric failures, refusals and audit errors must be 0;
- one run per rank with a persistent single-bit fault in every forward that rank computes (its
  training step and its replays alike), --fault-steps steps: caught = an alarm, settled =
  settled, localised = it names exactly that rank and that rank's node.

Then the setup refused, torch.compile(DDP(model)): given to the Auditor, and trained while the
Auditor was given the DDP model; each must be refused on every rank, in one line (exit 2).

Prints the table (markdown) and the totals. The same setups and the same loop as the test, from
tests/audit_workers.py, only more of them. torch.compile uses --compile-backend (default inductor,
which needs a C++ compiler; the CI slice uses aot_eager).

    python benchmarks/bench_audit_matrix.py                    # 40 healthy steps per setup
    python benchmarks/bench_audit_matrix.py --steps 200 --json
    python benchmarks/bench_audit_matrix.py --setups compiled_inner,checkpoint_reentrant
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile pools in the ranks

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="healthy steps per setup")
    p.add_argument("--fault-steps", type=int, default=3, help="steps of each faulty run")
    p.add_argument("--setups", default="", help="comma-separated subset (default: all)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled setups (inductor, aot_eager, ...)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import audit_workers
    from ddp_util import run_ranks

    setups = tuple(x for x in args.setups.split(",") if x) or audit_workers.MATRIX_SETUPS
    unknown = sorted(set(setups) - set(audit_workers.MATRIX_SETUPS))
    if args.steps < 4 or args.fault_steps < 1 or unknown:
        print(f"--steps must be >= 4 (fp16_scaler's overflow steps are 2 and 3), --fault-steps "
              f">= 1, --setups from {', '.join(audit_workers.MATRIX_SETUPS)}"
              + (f" (unknown: {', '.join(unknown)})" if unknown else ""), file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(audit_workers.matrix, NODES, timeout=7200, root=root,
                             healthy_steps=args.steps, faults_too=False, setups=setups,
                             fault_ranks=tuple(range(len(NODES))), fault_steps=args.fault_steps,
                             compile_backend=args.compile_backend)
    seconds = time.perf_counter() - t0
    rows = [_row(setup, per_rank, args.steps) for setup in setups]
    refusals = _refusals(per_rank)
    return _report(rows, refusals, seconds, args)


def _row(setup: str, per_rank: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One setup's healthy run and its fault runs, counted."""
    healthy = [r[f"{setup}/healthy"] for r in per_rank]
    h = healthy[0]
    alarms = int(bool(h["alarm"] or h["files"]))
    numeric = int(bool(h["numeric"]))
    refused_or_failed = int(any(o["refused"] or o["error"] for o in healthy))
    audits = h["counters"].get("audits", 0)
    skipped = h["counters"].get("scaler_skipped", 0)
    injected = caught = settled = localised = 0
    detail = [f"healthy: {h[k]}" for k in ("numeric", "refused", "error") if h[k]]
    for r in range(len(NODES)):
        outs = [o[f"{setup}/fault{r}"] for o in per_rank]
        injected += 1
        a = outs[0]["alarm"]
        if a is None:
            detail.append(f"rank {r}: missed (fault fired {outs[r]['fired']} times)")
            continue
        caught += 1
        settled += bool(a["settled"])
        nodes = [n["node"] for n in a["suspect_nodes"]]
        files = [(f["node"], tuple(f["suspect_ranks"])) for f in outs[0]["files"]]
        ok = a["suspect_ranks"] == [r] and nodes == [NODES[r]] and files == [(NODES[r], (r,))]
        localised += ok
        if not ok:
            detail.append(f"rank {r}: named {a['suspect_ranks']} on {nodes}, files {files}")
    return {"setup": setup, "healthy_steps": steps, "audited": audits, "scaler_skipped": skipped,
            "alarms": alarms, "numeric": numeric, "refused_or_failed": refused_or_failed,
            "injected": injected, "caught": caught, "settled": settled,
            "localised": localised, "notes": _notes(healthy), "detail": detail}


def _notes(healthy: list[dict[str, Any]]) -> str:
    """What shows that a healthy run exercised what its setup is about."""
    notes = []
    graphs = min(o["compiled_graphs"] for o in healthy)
    if graphs:
        notes.append(f"{graphs} compiled graph(s) per rank, replays in DDP's forward context: "
                     f"{all(all(o['replay_contexts']) and o['replay_contexts'] for o in healthy)}")
    if any(o["replay_backward"] for o in healthy):
        notes.append("replayed by a backward pass (reentrant checkpoint) on "
                     f"{sum(o['replay_backward'] for o in healthy)} of {len(healthy)} ranks")
    grad_max = min(o["grad_max"] for o in healthy)
    if grad_max >= 1e19:
        notes.append(f"largest gradient element {grad_max:.3g}, weights finite: "
                     f"{all(o['weights_finite'] for o in healthy)}")
    return "; ".join(notes)


def _refusals(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch.compile(DDP(model)): refused on every rank, in one line, before any step ran."""
    from screener.audit.refusals import COMPILED_AROUND_DDP

    given = [r["refused/compiled_outer"] for r in per_rank]
    trained = [r["refused/compiled_outer_trained"] for r in per_rank]
    return [
        {"setup": "torch.compile(DDP(model)) given to the Auditor",
         "refused": sum(m == COMPILED_AROUND_DDP for m in given), "ranks": len(given)},
        {"setup": "torch.compile(DDP(model)) trained, the Auditor given DDP(model)",
         "refused": sum(o["refused"] == COMPILED_AROUND_DDP and o["steps_done"] == 0
                        and o["alarm"] is None and o["numeric"] is None for o in trained),
         "ranks": len(trained)}]


def _report(rows: list[dict[str, Any]], refusals: list[dict[str, Any]], seconds: float,
            args: argparse.Namespace) -> int:
    """The table (or JSON) on stdout; 0 when every count is what it must be."""
    tot = {k: sum(r[k] for r in rows) for k in ("healthy_steps", "alarms", "numeric",
                                                 "refused_or_failed", "injected", "caught",
                                                 "settled", "localised")}
    ok = (tot["alarms"] == tot["numeric"] == tot["refused_or_failed"] == 0
          and tot["localised"] == tot["injected"]
          and all(r["refused"] == r["ranks"] for r in refusals))
    if args.json:
        print(json.dumps({"rows": rows, "refusals": refusals, "seconds": seconds,
                          "compile_backend": args.compile_backend}, indent=2))
        return 0 if ok else 1
    print(f"in-job audit matrix: 6 gloo ranks on 3 simulated nodes, audit + weight vote every "
          f"step, torch.compile backend {args.compile_backend}; {seconds:.0f} s\n")
    print("| setup | healthy steps | audited | scaler-skipped | alarms | numeric failures | "
          "refused/failed | faults injected | caught | settled | localised |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setup']} | {r['healthy_steps']} | {r['audited']} | {r['scaler_skipped']} | "
              f"{r['alarms']} | {r['numeric']} | {r['refused_or_failed']} | {r['injected']} | "
              f"{r['caught']} | {r['settled']} | {r['localised']} |")
    print(f"| total | {tot['healthy_steps']} | | | {tot['alarms']} | {tot['numeric']} | "
          f"{tot['refused_or_failed']} | {tot['injected']} | {tot['caught']} | "
          f"{tot['settled']} | {tot['localised']} |")
    print()
    for r in refusals:
        print(f"refused: {r['setup']}: on {r['refused']} of {r['ranks']} ranks, one line, "
              f"exit 2")
    for r in rows:
        for d in ([r["notes"]] if r["notes"] else []) + r["detail"]:
            print(f"  {r['setup']}: {d}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
