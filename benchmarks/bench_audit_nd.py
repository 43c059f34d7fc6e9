"""The in-job audit on N-D parallel training: the long form of tests/test_audit_nd.py.

A Llama-style model (RMSNorm, rotary, causal SDPA, SwiGLU; tests/nd_workers.py) on real gloo:
FSDP2 x TP (dp 3 x tp 2, a TP group per node, sequence parallel as torchtitan runs it) plain,
with loss parallel, with activation checkpointing, with bf16 mixed precision, with per-block
torch.compile (and TP without sequence parallel, which leaves the norms' weights off the TP
mesh: refused in one line); HSDP x TP (2 x 2 x 2, four nodes); pipeline parallel x FSDP2 (pp 2 x dp 3, a
pipeline per node) under GPipe, 1F1B, and 1F1B with activation checkpointing; pipeline parallel x
FSDP2 x TP (pp 2 x dp 3 x tp 2, the SwiGLU split in each stage, a TP pair per node). Audits at every
step, the weight check (shard record, vote) at every step.

- healthy: --steps audited steps per setup: alarms, numeric failures and errors must be 0;
- faults: for every rank of --fault-setups in turn, a single-bit flip in a forward matmul output
  (one-off and persistent), in a backward matmul output (a gradient, one-off), and in the rank's
  stored weight shard after an update: caught = an alarm; settled; pinned = it names that
  rank's node only (the rank itself, or under TP its TP group on that node) and the alarm file
  is on that node only.

Prints a markdown table per setup and the totals; exit 1 if anything was missed or alarmed.

    python benchmarks/bench_audit_nd.py                          # 120 steps per setup
    python benchmarks/bench_audit_nd.py --steps 10 --fault-setups fsdp_tp,pp_1f1b --json
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
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

KINDS = ("forward", "forward_persistent", "gradient", "weight")


def faults_for(setup: str, world: int, kinds: tuple[str, ...] = KINDS) -> list[Any]:
    import nd_workers

    pp = setup in nd_workers.PP_SETUPS + nd_workers.PPTP_SETUPS
    out = []
    for rank in range(world):
        for kind in kinds:
            if kind == "weight":
                out.append(nd_workers.Fault("weight", rank, step=1))
            elif kind == "gradient":  # a matmul of the backward
                out.append(nd_workers.Fault("gradient", rank, step=1, call=24 if pp else 25,
                                            bit=20))
            else:
                out.append(nd_workers.Fault("forward", rank, step=1, call=2,
                                            persistent=kind == "forward_persistent"))
    return out


def judge(case: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    """One faulty run, per rank's outcomes: caught, settled, pinned (see the docstring)."""
    outs = case["outs"]
    target = case["fault"]["rank"]
    node = nodes[target]
    alarms = [o["alarm"] for o in outs]
    same = all(a == alarms[0] for a in alarms)
    a = alarms[0]
    caught = a is not None and same
    settled = caught and bool(a["settled"])
    named = set(a["suspect_ranks"]) if caught else set()
    pinned = settled and target in named and {nodes[r] for r in named} == {node} \
        and [n["node"] for n in a["suspect_nodes"]] == [node]
    files = outs[0]["files"]
    only_there = bool(files) and all(f["node"] == node for f in files)
    return {"caught": caught, "settled": settled, "pinned": pinned and only_there,
            "check": a["check"] if caught else None,
            "numeric": next((o["numeric"] for o in outs if o["numeric"]), None),
            "error": next((o["error"] for o in outs if o.get("error")), None)}


def run(setups: list[str], fault_setups: list[str], steps: int, *, kinds: tuple[str, ...] = KINDS,
        ranks: int | None = None, extra: tuple[tuple[str, Any], ...] = ()) -> dict[str, Any]:
    """Healthy runs and faults (every kind on every rank of fault_setups, below `ranks`, and the
    (setup, Fault) pairs of `extra`), one process group per group of setups; plain data back."""
    import nd_workers
    from ddp_util import run_ranks

    result: dict[str, Any] = {"healthy": {}, "faults": []}
    for group in ("tp", "hsdp", "pp", "pptp"):
        mine = [s for s in setups if nd_workers.group_of(s) == group]
        mine_faults = [(s, f) for s in fault_setups if nd_workers.group_of(s) == group
                       for f in faults_for(s, len(nd_workers.NODES[group]), kinds)
                       if ranks is None or f.rank < ranks]
        mine_faults += [(s, f) for s, f in extra if nd_workers.group_of(s) == group]
        if not mine and not mine_faults:
            continue
        nodes = nd_workers.NODES[group]
        with tempfile.TemporaryDirectory() as root:
            per_rank = run_ranks(nd_workers.campaign, nodes, timeout=3600, root=root,
                                 setups=mine, steps=steps, faults=mine_faults)
        for setup in mine:
            outs = [r["healthy"][setup] for r in per_rank]
            if setup in nd_workers.REFUSED:
                lines = sorted({o["error"] or "" for o in outs})
                result.setdefault("refused", {})[setup] = {
                    "refused": len(lines) == 1 and lines[0].startswith("AuditUsageError")
                    and "\n" not in lines[0], "line": lines[0][:300]}
                continue
            result["healthy"][setup] = {
                "steps": min(o["steps_done"] for o in outs),
                "audits": min(o["counters"].get("audits", 0) for o in outs),
                "alarms": sum(o["alarm"] is not None for o in outs[:1]),
                "numeric": sum(o["numeric"] is not None for o in outs[:1]),
                "errors": sorted({o["error"] for o in outs if o.get("error")}),
                "files": len(outs[0]["files"])}
        for k, (setup, fault) in enumerate(mine_faults):
            outs = [r["faults"][k] for r in per_rank]
            case = {"setup": setup, "fault": fault.__dict__, "outs": outs}
            result["faults"].append({"setup": setup, "fault": fault.__dict__,
                                     **judge(case, nodes)})
    return result


def _report(result: dict[str, Any], seconds: float) -> str:
    lines = ["| setup | healthy audited steps | alarms | numeric | errors | faults | caught | "
             "settled | pinned |", "|---|---|---|---|---|---|---|---|---|"]
    setups = list(dict.fromkeys(list(result["healthy"]) + [f["setup"] for f in result["faults"]]))
    for s in setups:
        h = result["healthy"].get(s, {})
        fs = [f for f in result["faults"] if f["setup"] == s]
        lines.append(f"| {s} | {h.get('audits', '-')} | {h.get('alarms', '-')} | "
                     f"{h.get('numeric', '-')} | {len(h.get('errors', []))} | {len(fs)} | "
                     f"{sum(f['caught'] for f in fs)} | {sum(f['settled'] for f in fs)} | "
                     f"{sum(f['pinned'] for f in fs)} |")
    healthy = sum(h["audits"] for h in result["healthy"].values())
    fs = result["faults"]
    lines.append(f"\ntotal: {healthy} healthy audited steps, "
                 f"{sum(h['alarms'] + h['numeric'] for h in result['healthy'].values())} "
                 f"alarms or numeric failures; {len(fs)} faults, {sum(f['caught'] for f in fs)} "
                 f"caught, {sum(f['settled'] for f in fs)} settled, "
                 f"{sum(f['pinned'] for f in fs)} pinned to the rank's node; {seconds:.0f} s")
    for s, r in result.get("refused", {}).items():
        lines.append(f"refused ({'one line, every rank' if r['refused'] else 'NOT REFUSED'}): "
                     f"{s}: {r['line']}")
    missed = [f for f in fs if not f["pinned"]]
    for f in missed:
        lines.append(f"  not pinned: {f['setup']} {f['fault']} -> {f['check']} "
                     f"numeric={f['numeric']} error={f['error']}")
    return "\n".join(lines)


def failed(result: dict[str, Any]) -> bool:
    bad_healthy = any(h["alarms"] or h["numeric"] or h["errors"] or h["files"]
                      for h in result["healthy"].values())
    not_refused = not all(r["refused"] for r in result.get("refused", {}).values())
    return bad_healthy or not_refused or not all(f["pinned"] for f in result["faults"])


def main(argv: list[str] | None = None) -> int:
    import nd_workers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120, help="healthy audited steps per setup")
    p.add_argument("--setups", default=",".join(nd_workers.SETUPS))
    p.add_argument("--fault-setups", default="tp_sp,tp_sp_lp,pp_1f1b")
    p.add_argument("--fault-ranks", type=int, default=None,
                   help="faults on ranks below this only (default: every rank)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    fault_setups = [s for s in args.fault_setups.split(",") if s]
    unknown = sorted(set(setups + fault_setups) - set(nd_workers.SETUPS))
    if unknown or args.steps < 1:
        print(f"bench_audit_nd: unknown setup(s) {', '.join(unknown)} (known: "
              f"{', '.join(nd_workers.SETUPS)}) or --steps < 1", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    result = run(setups, fault_setups, args.steps, ranks=args.fault_ranks)
    seconds = time.monotonic() - t0
    print(json.dumps(result, indent=1) if args.json else _report(result, seconds))
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
