"""Peer burn-in: three simulated nodes, real DDP over gloo, the real Auditor checking every step."""

from __future__ import annotations

import json

import pytest

from screener.known_answer.collective.peer_training import PeerFault, PeerOptions, judge, run_local
from screener.types import ExitCode, Outcome


@pytest.mark.slow
def test_a_fault_on_the_node_under_test_is_caught_and_named(tmp_path):
    # One run (three processes start slowly on a shared CPU): the all-reduce check first, clean,
    # with its bandwidth; then training with a fault on the node under test at step 1.
    opts = PeerOptions(under_test="new-node", steps=3, alarm_dir=str(tmp_path / "alarms"),
                       fault=PeerFault(step=1, op="gelu", element=11, mode="scale", factor=1e4))
    r = run_local(opts, peers=("good-a", "good-b"), timeout=180)
    assert r.collective["mismatched_nodes"] == [] and r.collective["busbw_gbps"] > 0
    assert r.exit_code == ExitCode.HARDWARE_SUSPECT and r.outcome == Outcome.SUSPECT
    assert r.named_nodes == ("new-node",)
    assert r.alarm["settled"] and r.alarm["step"] == 1 and r.alarm["check"] == "ring_replay"
    fired = [x["fault"] for x in r.ranks if x["fault"]]
    assert len(fired) == 1 and fired[0]["fired"], "the fault never fired"
    assert all(x["steps_done"] == 1 for x in r.ranks)  # step 0 passed the audit on every rank
    # Every rank pinned determinism like every known-answer job (make_deterministic's record).
    assert all(x["determinism"]["deterministic_algorithms"] is True
               and x["determinism"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" for x in r.ranks)
    # The alarm file for the DaemonSet of the node under test, and none for the peers.
    files = [json.loads(p.read_text()) for p in (tmp_path / "alarms").glob("*.json")]
    assert [f["node"] for f in files] == ["new-node"] and files[0]["settled"]
    v = r.verdict()
    assert v.outcome == Outcome.SUSPECT and v.device == "node:new-node"


def _rank(node, alarm=None, collective=None):
    return {"rank": 0, "node": node, "alarm": alarm, "numeric": None, "collective": collective}


def test_judging_whom_to_blame():
    settled_peer = {"check": "weights", "step": 4, "settled": True, "message": "m",
                    "suspect_nodes": [{"node": "good-a", "hostname": "h"}]}
    r = judge([_rank("new"), _rank("good-a", settled_peer), _rank("good-b")], "new")
    assert r.exit_code == ExitCode.PEER_FAILED and r.named_nodes == ("good-a",)
    assert r.verdict().outcome == Outcome.INCONCLUSIVE  # a bad peer says nothing about us
    unsettled = {**settled_peer, "settled": False, "suspect_nodes": []}
    assert judge([_rank("new", unsettled), _rank("a"), _rank("b")], "new").exit_code == \
        ExitCode.INCONCLUSIVE
    assert judge([_rank("new"), _rank("a"), _rank("b")], "new").exit_code == ExitCode.PASS
    coll = lambda bad: {"mismatches": bad, "seconds": 1.0, "bytes": 4, "iterations": 1}  # noqa: E731
    r = judge([_rank("new", collective=coll(2)), _rank("a", collective=coll(0)),
               _rank("b", collective=coll(0))], "new")
    assert r.exit_code == ExitCode.HARDWARE_SUSPECT and r.named_nodes == ("new",)
    from screener.errors import BadInputError
    with pytest.raises(BadInputError):
        judge([_rank("a"), _rank("b")], "new")
