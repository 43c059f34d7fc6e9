"""The kill -9 campaign (issue 36.7), in full: `screener daemon --once` killed with SIGKILL at
random moments of a quarantine, restarted (restarts killed too), then a clean restart; every node
audited: label, taint, condition, history entry, Event and budget slot whole or none, never half,
never twice.

    python benchmarks/bench_kill9.py [--kills 100] [--seed N] [--fresh] [--json]

Against the Kubernetes API test server (tests/fakes/kubeapi.py) with each write's answer held a random
moment, so a kill lands between writes (tests/fakes/kill9.py says how). Children come from a fork
server by default (the real console entry point without its 1-3 s of imports); --fresh starts
each as `python -m screener.cli`, start-up and all. The CI slice is
tests/test_intent_journal.py (30 kills).

    python benchmarks/bench_kill9.py --kills 30 --apiserver https://127.0.0.1:6443 --token T

On a real kube-apiserver (benchmarks/realserver.py, benchmarks/realserver-up.sh; a fresh server,
its budget record counted for --fleet) every child is a fresh interpreter acting as its node's
daemon pod through the RBAC and the admission policies, and the kills land at random moments
(a real server's answers cannot be held).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakes.kill9 import Campaign, CampaignTooLong, TappedAPI  # noqa: E402


def main() -> int:
    try:
        return campaign()
    except CampaignTooLong as e:
        print(f"bench_kill9: {e}", file=sys.stderr)
        return 2


def campaign() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kills-per", type=int, default=3, help="most kills of one transition")
    p.add_argument("--fleet", type=int, default=1200, help="healthy nodes besides the campaign's")
    p.add_argument("--fresh", action="store_true", help="a fresh interpreter per child")
    p.add_argument("--json", action="store_true")
    p.add_argument("--apiserver", default="", help="a real kube-apiserver's URL")
    p.add_argument("--token", default="", help="its admin token (system:masters)")
    args = p.parse_args()
    if args.apiserver:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from realserver import RealTarget

        seed = args.seed if args.seed is not None else random.randrange(1 << 30)
        with tempfile.TemporaryDirectory(prefix="bench-kill9-") as tmp:
            target = RealTarget(args.apiserver, args.token)
            figures = Campaign(target, Path(tmp), seed=seed, fleet=args.fleet).run(
                args.kills, kills_per=args.kills_per, fresh=True)
        return report(seed, "fresh interpreters on a real kube-apiserver", figures, args.json)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    with tempfile.TemporaryDirectory(prefix="bench-kill9-") as tmp, \
            TappedAPI(hold=(0.01, 0.08), seed=seed) as api:
        figures = Campaign(api, Path(tmp), seed=seed, fleet=args.fleet).run(
            args.kills, kills_per=args.kills_per, fresh=args.fresh)
    return report(seed, "fresh interpreters" if args.fresh else "fork server", figures,
                  args.json)


def report(seed: int, children: str, figures: Any, as_json: bool) -> int:
    data = {"seed": seed, "children": children, **figures.to_dict()}
    if as_json:
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
