"""The kill -9 campaign (issue 36.7), in full: `screener daemon --once` killed with SIGKILL at
random moments of a quarantine, restarted (restarts killed too), then a clean restart; every node
audited: label, taint, condition, history entry, Event and budget slot whole or none, never half,
never twice.

    python benchmarks/bench_kill9.py [--kills 100] [--seed N] [--fresh] [--json]

Against the Kubernetes API test server (tests/kubeapi.py) with each write's answer held a random
moment, so a kill lands between writes (tests/fakes/kill9.py says how). Children come from a fork
server by default (the real console entry point without its 1-3 s of imports); --fresh starts
each as `python -m screener.cli`, start-up and all. The CI slice is
tests/test_intent_journal.py (30 kills). A run on a real kube-apiserver is ../shared/REAL-APISERVER.md's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakes.kill9 import Campaign, TappedAPI  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kills-per", type=int, default=3, help="most kills of one transition")
    p.add_argument("--fleet", type=int, default=1200, help="healthy nodes besides the campaign's")
    p.add_argument("--fresh", action="store_true", help="a fresh interpreter per child")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    with tempfile.TemporaryDirectory(prefix="bench-kill9-") as tmp, \
            TappedAPI(hold=(0.01, 0.08), seed=seed) as api:
        figures = Campaign(api, Path(tmp), seed=seed, fleet=args.fleet).run(
            args.kills, kills_per=args.kills_per, fresh=args.fresh)
    data = {"seed": seed, "children": "fresh interpreters" if args.fresh else "fork server",
            **figures.to_dict()}
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(f"kill -9 campaign (seed {seed}, {data['children']}): {figures.kills} kills "
              f"({figures.missed} children ended first) on {figures.nodes} quarantines in "
              f"{figures.seconds:.0f} s")
        print(f"  left mid-transition by a kill: {figures.half_after_kill} "
              f"(without an intent on file: {figures.uncovered})")
        print(f"  after the restart: half transitions {figures.half}, doubles {figures.doubles} "
              f"(Events, history entries or budget slots twice); restart exit codes "
              f"{data['restart_exit_codes']}")
        for line in figures.bad[:5]:
            print("  BAD", line[:300])
    return 0 if figures.half == 0 and figures.doubles == 0 and not figures.bad else 1


if __name__ == "__main__":
    sys.exit(main())
