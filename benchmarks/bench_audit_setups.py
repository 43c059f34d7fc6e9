"""The audit on the training setups it used to get wrong: a campaign (accumulation, shard flips).

    python benchmarks/bench_audit_setups.py [--steps 60] [--faults 6] [--json]

Six gloo ranks on three simulated nodes (n1 = {0, 1}, n2 = {2, 3}, n3 = {4, 5}), the TinyLM of
tests/fsdp_workers.py. For each gradient-accumulation pattern (FSDP2 reducing on every
micro-step, FSDP2 under set_requires_gradient_sync(False), HSDP under set_requires_all_reduce(False),
DDP without no_sync, DDP under no_sync; two micro-batches a step, audited every 5th step):
--steps healthy steps, which must give no alarm and no numeric failure; then a forward fault
(one bit of a matmul output) at audit step 5 on ranks 0 .. --faults-1, which must be caught,
settled and pinned to that rank with the alarm file on its node only. Then an HSDP weight shard
(3 replicas x 2 shards) flipped between two votes on every rank in turn (five weights and bits),
with a node = a shard group and again with every shard group spanning two nodes: the rank whose
shard flipped must be named, settled, its node only. The refusals (FSDP2 x tensor parallel,
pipeline stages) are counted too. tests/test_audit_accumulation.py and tests/test_audit_shard_flips.py are its CI slice.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

NODES = ["n1", "n1", "n2", "n2", "n3", "n3"]
# HSDP's shard groups {0, 1}, {2, 3}, {4, 5} each spanning two nodes
SPANNING = ["n1", "n2", "n2", "n3", "n3", "n1"]


def _node(row: dict[str, Any]) -> str:
    return (SPANNING if row["setup"].startswith("spanning") else NODES)[row["target"]]


def judge(row: dict[str, Any]) -> str:
    """What a row says: "ok" when the run did what it must, else what went wrong."""
    if row["kind"] == "healthy":
        bad = row["alarm"] or row["numeric"]
        return "false alarm" if bad else "ok"
    # a fault at an audit step is the ring replay's; a flipped weight shard is named by the vote,
    # or, when it makes the gradient NaN/Inf first, by check 1's confirmed replay: either way the
    # one rank, settled
    want = ("ring_replay",) if row["kind"] in ("fault", "tp_fault") else \
        ("weights", "nonfinite_local")
    if row["numeric"]:
        return "numeric failure"
    if row["alarm"] is None:
        return "missed"
    if row["alarm"] not in want or not row["settled"]:
        return f"{row['alarm']}{'' if row['settled'] else ' unsettled'}"
    # under tensor parallel a forward fault reaches the whole TP group (a node here): the
    # group may be named, never a rank outside it
    group = [row["target"] - row["target"] % 2, row["target"] - row["target"] % 2 + 1]
    named_ok = row["suspects"] == [row["target"]] or (row["kind"] == "tp_fault"
                                                      and row["suspects"] == group)
    if not named_ok or row["file_nodes"] != [_node(row)]:
        return f"wrong rank {row['suspects']} files {row['file_nodes']}"
    return "ok"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="healthy steps per pattern")
    ap.add_argument("--faults", type=int, default=6, help="faulty runs per pattern (ranks 0..)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)

    from ddp_util import run_ranks
    import audit_setup_workers

    start = time.monotonic()
    refusals = [run_ranks(audit_setup_workers.tensor_parallel, ["a", "b", "a", "b"], timeout=240)[0],
                run_ranks(audit_setup_workers.pipeline_stages, NODES[:4], timeout=240)[0]]
    with tempfile.TemporaryDirectory() as root:
        rows = run_ranks(audit_setup_workers.campaign, NODES, timeout=3600, root=root,
                         steps=args.steps, faults_per_pattern=args.faults)[0]
        rows += run_ranks(audit_setup_workers.shard_flips, SPANNING, timeout=3600, root=root,
                          label="spanning")[0]
    for row in rows:
        row["verdict"] = judge(row)
    if args.json:
        print(json.dumps({"rows": rows, "refusals": refusals}, indent=1))
    table: dict[tuple[str, str], list[Any]] = {}
    for row in rows:
        t = table.setdefault((row["kind"], row["setup"]), [0, 0, 0, set()])
        t[0] += 1
        t[1] += row["verdict"] == "ok"
        t[2] += row["audits"] if row["kind"] == "healthy" else 0
        if row["alarm"]:
            t[3].add(row["alarm"])
    print(f"{'kind':<11} {'setup':<30} {'runs':>4} {'right':>5} {'audits':>6}  alarms")
    for (kind, setup), (n, ok, audits, checks) in table.items():
        print(f"{kind:<11} {setup:<30} {n:>4} {ok:>5} {audits if kind == 'healthy' else '':>6}"
              f"  {', '.join(sorted(checks))}")
    for row in rows:
        if row["verdict"] != "ok":
            print(f"WRONG: {row['kind']} {row['setup']} rank {row['target']}: {row['verdict']}")
    refused = sum(r["refused"] is not None and r["exit"] == 2 for r in refusals)
    healthy_steps = sum(r["steps"] for r in rows if r["kind"] == "healthy")
    wrong = sum(r["verdict"] != "ok" for r in rows)
    print(f"refused in one line: {refused} of {len(refusals)} (TP groups across nodes, "
          f"pipeline stages)")
    print(f"healthy steps {healthy_steps}, runs {len(rows)}, wrong verdicts {wrong}, "
          f"in {time.monotonic() - start:.0f} s")
    return 0 if wrong == 0 and refused == len(refusals) else 1


if __name__ == "__main__":
    sys.exit(main())
