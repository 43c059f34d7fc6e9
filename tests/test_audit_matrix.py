"""The training setups people run, audited on a real gloo process group: six ranks on three
simulated nodes (n0 = {0, 1}, n1 = {2, 3}, n2 = {4, 5}), ring replay and weight vote every step.

Each setup of audit_workers.MATRIX_SETUPS trains healthy for a few steps (no alarm, no numeric
failure, nothing skipped but the GradScaler's overflow steps), then again with a persistent
single-bit fault in every forward rank 3 computes (its training step and its replays alike): the
alarm must be settled and name rank 3 on n1 alone, with one alarm file, on n1. Then the verdicts
that are no hardware verdict (exit 76, no file) and a setup refused at construction. All of it runs
in one launch of six processes (starting them is the expensive part); the long campaign is
benchmarks/bench_audit_matrix.py.
"""

from __future__ import annotations

import pytest

import audit_workers
from ddp_util import run_ranks
from screener.types import AlarmRecord

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]
HEALTHY_STEPS = 4  # fp16_scaler: all ranks overflow at step 2, rank 2's data at step 3
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-matrix")
    per_rank = run_ranks(audit_workers.matrix, NODES, timeout=360, root=str(root),
                         healthy_steps=HEALTHY_STEPS)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("setup", audit_workers.MATRIX_SETUPS)
def test_healthy_setup_raises_nothing(runs, setup):
    outs = runs[f"{setup}/healthy"]
    skipped = 2 if setup == "fp16_scaler" else 0  # the forced overflow and the data's overflow
    for o in outs:
        assert o["alarm"] is None and o["numeric"] is None, (o["alarm"], o["numeric"])
        assert o["files"] == []
        assert o["steps_done"] == HEALTHY_STEPS
        c = o["counters"]
        assert c["audits"] == HEALTHY_STEPS - skipped and c.get("audits_skipped", 0) == 0
        assert c.get("scaler_skipped", 0) == skipped
        assert c["self_checks"] == 1 and c["weight_checks"] == HEALTHY_STEPS
    assert len({o["weights"] for o in outs}) == 1


@pytest.mark.parametrize("setup", audit_workers.MATRIX_SETUPS)
def test_persistent_bit_flip_on_one_rank_is_caught_settled_and_localised(runs, setup):
    outs = runs[f"{setup}/fault{audit_workers.FAULT_RANK}"]
    assert outs[audit_workers.FAULT_RANK]["fired"] > 0 and sum(o["fired"] for o in outs) == \
        outs[audit_workers.FAULT_RANK]["fired"]
    alarms = [o["alarm"] for o in outs]
    a = alarms[0]
    assert a is not None and all(x == a for x in alarms), "the verdict must be collective"
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 0, True,
                                                                          [3])
    assert [n["node"] for n in a["suspect_nodes"]] == ["n1"]
    recs = [AlarmRecord.from_dict(f) for f in outs[0]["files"]]
    assert [(r.node, r.settled, r.suspect_ranks) for r in recs] == [("n1", True, (3,))]


def test_scaler_overflow_steps_are_skipped_and_counted_not_alarmed(runs):
    outs = runs["fp16_scaler/healthy"]
    # step 2 ran at 2**60 (forced, then put back to 2**8); rank 2's data overflowed step 3 at 2**8
    # on every rank's reduced gradient, so the scaler halved its scale once and trained on
    for o in outs:
        assert o["scale"] == 2.0 ** 7


def test_nan_on_one_rank_under_a_scaler_is_settled_by_a_finite_replay(runs):
    outs = runs["fp16_scaler/nan"]
    a = outs[0]["alarm"]
    assert a is not None and all(o["alarm"] == a for o in outs)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_local", 0,
                                                                          True, [3])
    assert a["evidence"]["replays"]["3"]["replay_finite"] is True
    assert a["evidence"]["replays"]["3"]["scale"] == 2.0 ** 8


def _numeric(outs):
    for o in outs:
        assert o["alarm"] is None and o["numeric"] is not None and o["files"] == []
    n = outs[0]["numeric"]
    assert all(o["numeric"] == n for o in outs)
    return n


def test_a_scaler_the_auditor_does_not_know_fails_the_self_check_not_a_node(runs):
    n = _numeric(runs["numeric/unpassed_scaler"])
    assert n["step"] == 0 and n["ranks"] == list(range(6))
    assert "does not reproduce on the rank that ran it" in n["message"]
    assert "Auditor(scaler=...)" in n["message"]


def test_a_rank_dependent_code_path_is_no_hardware_verdict(runs):
    n = _numeric(runs["numeric/rank_dependent"])
    assert n["step"] == 0 and "disagree with their replays" in n["message"]
    assert "depends on the rank" in n["message"]


def test_a_weight_vote_naming_two_nodes_is_no_hardware_verdict(runs):
    n = _numeric(runs["numeric/weights_two_nodes"])
    assert (n["step"], n["ranks"]) == (1, [1, 4])
    assert "span 2 nodes (n0, n2)" in n["message"]


def test_unequal_thread_counts_are_refused_at_construction_in_one_line(runs):
    msgs = runs["refused/threads"]
    assert all(m == msgs[0] for m in msgs) and msgs[0] is not None
    assert "\n" not in msgs[0] and "torch.set_num_threads" in msgs[0]
