"""A fleet to report on: a burn-in report written by a real run, and a LocalStore holding five
nodes' three weeks of transitions and verdicts (test_report and test_report_browser draw them)."""

from __future__ import annotations

from pathlib import Path

from screener.lifecycle.records import Transition
from screener.stores.local import LocalStore
from screener.types import NodeState

# Written by `screener burnin --iterations 1 --store none --report` on the development machine.
BURNIN = Path(__file__).resolve().parents[1] / "data" / "burnin-report-cpu.json"
DAY = 86400.0
NOW = 1_796_000_000.0


def fleet_store(path: Path) -> LocalStore:
    """Five nodes with real transitions through the store's API over three weeks: one lemon."""
    s = LocalStore(path)

    def go(node, t, frm, to, failure=False, serials=()):
        s.record(Transition(node=node, time=NOW - t * DAY, from_state=frm, to_state=to,
                            reason=f"test {to.value}", failure=failure, gpu_serials=serials))

    B, H, S, Q, R = (NodeState.BURNIN, NodeState.HEALTHY, NodeState.SUSPECT,
                     NodeState.QUARANTINED, NodeState.REPAIR)
    for i, n in enumerate(["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e"]):
        go(n, 20 - i, None, B)
        go(n, 19.5 - i, B, H)
    go("gpu-c", 10, H, S, failure=True, serials=("S1",))
    go("gpu-c", 9, S, H)
    go("gpu-c", 5, H, S, failure=True, serials=("S1",))
    go("gpu-c", 4.5, S, Q, failure=True, serials=("S1",))
    go("gpu-c", 2, Q, R)
    go("gpu-d", 1, H, S, failure=True, serials=("S7",))
    for i, n in enumerate(["gpu-a", "gpu-b", "gpu-d", "gpu-e"]):
        jobs = {"gemm-fp32": {"seconds": 0.30 + 0.01 * i, "runs": 2},
                "train-bf16": {"seconds": 0.9 + 0.05 * i, "runs": 2}}
        s.set_verdict(n, {"time": NOW - DAY, "outcome": "pass", "kind": "full", "verdicts": [
            {"device": f"cuda:{g}", "outcome": "pass", "job": "", "evidence": {"jobs": jobs}}
            for g in range(2)] + [{"device": "cuda:0", "outcome": "pass", "job": "hbm",
                                   "evidence": {"bandwidth_gbps": 3100.0 + i}}]})
    return s
