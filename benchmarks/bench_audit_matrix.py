"""The in-job audit under the training setups people run: the long form of tests/test_audit_matrix.py.

Six gloo ranks on three simulated nodes (n0 = {0, 1}, n1 = {2, 3}, n2 = {4, 5}), ring replay and
weight vote at every step. For every setup (fp32, bf16 autocast, fp16 autocast + GradScaler with
forced overflow steps, unseeded and per-rank-seeded nn.Dropout, gradient accumulation under
no_sync, clipping, BatchNorm with and without broadcast_buffers, a loss_fn with extra outputs):

- one healthy run of --steps steps: alarms and numeric failures must be 0;
- one run per rank with a persistent single-bit fault in every forward that rank computes (its
  training step and its replays alike), --fault-steps steps: caught = an alarm, settled =
  settled, localised = it names exactly that rank and that rank's node.

Prints the table (markdown) and the totals. The same setups and the same loop as the test, from
tests/audit_workers.py, only more of them.

    python benchmarks/bench_audit_matrix.py                    # 40 healthy steps per setup
    python benchmarks/bench_audit_matrix.py --steps 200 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="healthy steps per setup")
    p.add_argument("--fault-steps", type=int, default=3, help="steps of each faulty run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 4 or args.fault_steps < 1:
        print("--steps must be >= 4 (fp16_scaler's overflow steps are 2 and 3), --fault-steps "
              ">= 1", file=sys.stderr)
        return 2
    import audit_workers
    from ddp_util import run_ranks

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(audit_workers.matrix, NODES, timeout=7200, root=root,
                             healthy_steps=args.steps, faults_too=False,
                             fault_ranks=tuple(range(len(NODES))), fault_steps=args.fault_steps)
    seconds = time.perf_counter() - t0
    rows = []
    for setup in audit_workers.MATRIX_SETUPS:
        healthy = [r[f"{setup}/healthy"] for r in per_rank]
        alarms = sum(1 for o in healthy[:1] if o["alarm"] or o["numeric"] or o["files"])
        audits = healthy[0]["counters"].get("audits", 0)
        skipped = healthy[0]["counters"].get("scaler_skipped", 0)
        injected = caught = settled = localised = 0
        detail = []
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
            ok = a["suspect_ranks"] == [r] and nodes == [NODES[r]]
            files = [(f["node"], tuple(f["suspect_ranks"])) for f in outs[0]["files"]]
            ok = ok and files == [(NODES[r], (r,))]
            localised += ok
            if not ok:
                detail.append(f"rank {r}: named {a['suspect_ranks']} on {nodes}, files {files}")
        rows.append({"setup": setup, "healthy_steps": args.steps, "audited": audits,
                     "scaler_skipped": skipped, "alarms": alarms, "injected": injected,
                     "caught": caught, "settled": settled, "localised": localised,
                     "detail": detail})
    if args.json:
        print(json.dumps({"rows": rows, "seconds": seconds}, indent=2))
        return 0
    print(f"in-job audit matrix: 6 gloo ranks on 3 simulated nodes, audit + weight vote every "
          f"step; {seconds:.0f} s\n")
    print("| setup | healthy steps | audited | scaler-skipped | alarms | faults injected | caught "
          "| settled | localised |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setup']} | {r['healthy_steps']} | {r['audited']} | {r['scaler_skipped']} | "
              f"{r['alarms']} | {r['injected']} | {r['caught']} | {r['settled']} | "
              f"{r['localised']} |")
    tot = {k: sum(r[k] for r in rows) for k in ("healthy_steps", "alarms", "injected", "caught",
                                                 "settled", "localised")}
    print(f"| total | {tot['healthy_steps']} | | | {tot['alarms']} | {tot['injected']} | "
          f"{tot['caught']} | {tot['settled']} | {tot['localised']} |")
    for r in rows:
        for d in r["detail"]:
            print(f"  {r['setup']}: {d}")
    return 0 if tot["alarms"] == 0 and tot["localised"] == tot["injected"] else 1


if __name__ == "__main__":
    sys.exit(main())
