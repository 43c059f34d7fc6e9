"""The spike sentinel between audits: healthy runs with data spikes, and faults at steps that
are not audited, with the sentinel on and off side by side in one run (DDP).

    python benchmarks/bench_sentinel.py [--healthy-steps 150] [--fault-step 30] [--json]

Six gloo ranks on three simulated nodes (n1 = {0, 1}, n2 = {2, 3}, n3 = {4, 5}), the tiny LM of
tests/sentinel_workers.py, no audit step at all (audit_every=1000) and no weight check, so only
check 1 and the sentinel can see anything:

- healthy: --healthy-steps steps with three real data spikes (one batch's loss times 1000 on
  ranks 0, 3 and 5): alarms and numeric failures must be 0; the firings and their outcomes
  are counted.
- faults: one bit of one element flipped at --fault-step (after the 20-step warm-up), in the
  position embedding's gradient (a backward output) or in a forward matmul output, for each bit
  class (lowest and highest mantissa bit, lowest and highest exponent bit, sign), one-off (only in
  the training step) and persistent (still there when the step is rerun), each on another rank.
  Each fault runs twice, sentinel off ("before", the audit of issue 20 alone between audits) and
  on. Counted: caught (any alarm or numeric failure), attributed (a settled alarm naming exactly
  that rank and node), missed (the run finished with no alarm).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

NODES = ["n1", "n1", "n2", "n2", "n3", "n3"]
BITS = {"mant_low": 0, "mant_high": 22, "exp_low": 23, "exp_high": 30, "sign": 31}
SITES = {"grad": ("embedding_dense_backward", 0, 5), "forward": ("mm", 3, 5)}


def _faults(step: int) -> list[dict[str, Any]]:
    out, k = [], 0
    for site, (op, call, element) in SITES.items():
        for cls, bit in BITS.items():
            for persistent in (False, True):
                out.append({"site": site, "class": cls, "persistent": persistent,
                            "spec": {"rank": k % 6, "step": step, "op": op, "call": call,
                                     "element": element, "bit": bit}})
                k += 1
    return out


def _rank(rank: int, world: int, *, root: str, healthy_steps: int, fault_step: int
          ) -> dict[str, Any]:
    import torch.distributed as dist

    import sentinel_workers as sw

    spikes = sw.SpikyBatches(((0, 40), (3, 80), (5, 120)))
    out: dict[str, Any] = {"healthy": sw.train(rank, world, alarm_dir=os.path.join(root, "h"),
                                               steps=healthy_steps, batches=spikes, warmup=20),
                           "faults": []}
    for i, f in enumerate(_faults(fault_step)):
        for on in (False, True):
            d = os.path.join(root, f"f{i}-{int(on)}")
            os.makedirs(d, exist_ok=True)
            r = sw.train(rank, world, alarm_dir=d, steps=fault_step + 3, fault=True,
                         persistent=f["persistent"], spec=f["spec"], sentinel=on, warmup=20)
            dist.barrier()
            out["faults"].append({**f, "sentinel": on, "alarm": r["alarm"],
                                  "numeric": r["numeric"], "steps_done": r["steps_done"]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--healthy-steps", type=int, default=150)
    p.add_argument("--fault-step", type=int, default=30)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from ddp_util import run_ranks

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(_rank, NODES, timeout=3600, root=root,
                             healthy_steps=a.healthy_steps, fault_step=a.fault_step)
    h = per_rank[0]["healthy"]
    table: dict[str, Counter] = {}
    for f in per_rank[0]["faults"]:
        key = f"{'on ' if f['sentinel'] else 'off'} {f['site']:7} {f['class']:9} " \
              f"{'persistent' if f['persistent'] else 'one-off'}"
        c = table.setdefault(key, Counter())
        rank = f["spec"]["rank"]
        al = f["alarm"]
        c["caught"] += bool(al or f["numeric"])
        c["attributed"] += bool(al and al["settled"] and al["suspect_ranks"] == [rank]
                                and [n["node"] for n in al["suspect_nodes"]] == [NODES[rank]])
        c["missed"] += not (al or f["numeric"])
        c["check:" + (al["check"] if al else "numeric" if f["numeric"] else "-")] += 1
    result = {"healthy": {"steps": h["steps_done"], "alarm": h["alarm"], "numeric": h["numeric"],
                          "counters": h["counters"]},
              "faults": {k: dict(v) for k, v in sorted(table.items())},
              "seconds": round(time.monotonic() - t0, 1)}
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        c = h["counters"]
        print(f"healthy: {h['steps_done']} steps, 3 data spikes: alarms {int(bool(h['alarm']))}, "
              f"numeric failures {int(bool(h['numeric']))}, sentinel fired "
              f"{c.get('sentinel_fired', 0)} (data {c.get('sentinel_data', 0)})")
        print(f"\n{'sentinel site    class     kind':42} caught attributed missed  checks")
        for k, v in sorted(table.items()):
            checks = {x[6:]: n for x, n in v.items() if x.startswith("check:")}
            print(f"{k:42} {v['caught']:6d} {v['attributed']:10d} {v['missed']:6d}  {checks}")
        tot = {on: Counter() for on in ("off", "on ")}
        for k, v in table.items():
            tot[k[:3]].update(v)
        for on, v in tot.items():
            print(f"total sentinel {on.strip():3}: caught {v['caught']}, attributed "
                  f"{v['attributed']}, missed {v['missed']} of {sum(1 for k in table if k.startswith(on))}")
        print(f"{result['seconds']} s")
    bad = bool(h["alarm"] or h["numeric"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
