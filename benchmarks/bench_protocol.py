"""What the round protocol's size check costs: a checked gather against one all_gather.

    python benchmarks/bench_protocol.py [--world 3] [--rounds 30] [--gathers 200] [--numel 7]

Every gather of the audit goes through protocol.Walk.gather. Since issue 32 a round whose payload
shape is not fixed by what the ranks agreed at construction first gathers the round's number, the
payload's size and its dtype (three int64 per rank), so that ranks that diverged or bring payloads
of different sizes raise AuditError alike instead of a backend aborting the process (gloo) or
hanging (NCCL); a fixed round (the step's head, the one gather of every step) stays one gather,
with the round's number and the step appended. The baseline is what both replaced: one all_gather
of the payload with the round's number appended. Both run in the same process group, interleaved per
round; the figures are medians over rounds of the time per gather and of the paired ratio. The
step's head (check 1's gather on every step) is 7 int64 per rank (--numel 7).
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


def _ranks(rank: int, world: int, *, rounds: int, gathers: int, numel: int) -> dict[str, Any]:
    import torch

    from screener.audit.collective import gather
    from screener.audit.protocol import Schedule

    cpu = torch.device("cpu")
    schedule = Schedule("bench", ("head", "other"), repeatable=("head", "other"),
                        fixed=("head",))
    payload = torch.arange(numel, dtype=torch.int64) + rank
    checked: list[float] = []
    fixed: list[float] = []
    plain: list[float] = []
    for _ in range(rounds):
        walk = schedule.walk(None, cpu, 0)
        t = time.perf_counter()
        for _ in range(gathers):
            walk.gather("head", payload)
        t0 = time.perf_counter()
        fixed.append((t0 - t) / gathers)
        for _ in range(gathers):
            walk.gather("other", payload)
        t1 = time.perf_counter()
        for _ in range(gathers):  # the old form: the round's number rides as one more element
            tagged = torch.cat([payload, torch.full((1,), 1, dtype=torch.int64)])
            got = gather(tagged, None, cpu)
            assert int(got[0, -1]) == 1
        t2 = time.perf_counter()
        checked.append((t1 - t0) / gathers)
        plain.append((t2 - t1) / gathers)
    return {"checked": checked, "fixed": fixed, "plain": plain}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--gathers", type=int, default=200)
    ap.add_argument("--numel", type=int, default=7)
    args = ap.parse_args(argv)
    from ddp_util import run_ranks

    out = run_ranks(_ranks, [f"n{i}" for i in range(args.world)], timeout=600,
                    rounds=args.rounds, gathers=args.gathers, numel=args.numel)[0]
    checked = statistics.median(out["checked"]) * 1e6
    fixed = statistics.median(out["fixed"]) * 1e6
    plain = statistics.median(out["plain"]) * 1e6
    ratio = statistics.median(c / p for c, p in zip(out["checked"], out["plain"]))
    ratio_fixed = statistics.median(c / p for c, p in zip(out["fixed"], out["plain"]))
    print(f"world {args.world}, payload {args.numel} int64, {args.rounds} rounds x "
          f"{args.gathers} gathers (gloo, loopback)")
    print(f"fixed round (the step's head: tag and step ride along): {fixed:8.1f} us per gather")
    print(f"checked round (size and dtype gathered first):         {checked:8.1f} us per gather")
    print(f"one all_gather with the round tag (before issue 32):   {plain:8.1f} us per gather")
    print(f"paired medians: fixed / before x{ratio_fixed:.2f}, checked / before x{ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
