"""The fault matrix of the in-job audit on a real gloo process group: six ranks on three simulated
nodes (NODE_NAME n0, n1, n2; two ranks each), then a long healthy run auditing every step.

All scenarios run in one spawn (starting six processes that import torch and DDP is the expensive
part); each test below asserts on its scenario. Ranks: n0 = {0, 1}, n1 = {2, 3}, n2 = {4, 5}.
"""

from __future__ import annotations

import pytest

from ddp_util import run_ranks
import audit_workers
from screener.alarmfile import AlarmRecord

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]
HEALTHY_STEPS = 100
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-ddp")
    per_rank = run_ranks(audit_workers.everything, NODES, timeout=540, root=str(root),
                         healthy_steps=HEALTHY_STEPS)
    return {name: [r.get(name) for r in per_rank] for name in per_rank[0]}


def same_alarm_everywhere(outs):
    alarms = [o["alarm"] for o in outs]
    assert alarms[0] is not None
    assert all(a == alarms[0] for a in alarms), "the verdict must be collective"
    return alarms[0]


def files_of(outs):
    return [AlarmRecord.from_dict(f) for f in outs[0]["files"]]


def test_nan_in_one_local_gradient_names_that_rank_at_that_step(runs):
    a = same_alarm_everywhere(runs["nan_local"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_local", 2, True,
                                                                          [3])
    assert [n["node"] for n in a["suspect_nodes"]] == ["n1"]
    assert a["evidence"]["local_norm"] == {"3": "nan"}
    assert a["evidence"]["replays"]["3"]["replay_finite"] is True
    (rec,) = files_of(runs["nan_local"])
    assert (rec.node, rec.settled, rec.suspect_ranks, rec.check) == ("n1", True, (3,),
                                                                     "nonfinite_local")
    for o in runs["nan_local"]:
        assert o["stopped_at"] == 2 and o["weights_finite"]
        assert o["weights_after"] == o["weights_before_alarm"]  # step 2 was not applied


# audit_every=2 and 3, but the first 20 steps of a start are all audited (cadence.py): the
# last clean audit is the step before the fault's
@pytest.mark.parametrize("scenario,rank,node,step,last_clean_audit", [
    ("scaled_activation", 1, "n0", 4, 3),  # one activation times 10,000; audit_every=2
    ("mantissa_flip", 4, "n2", 6, 5),  # lowest mantissa bit of one matmul output; audit_every=3
])
def test_finite_wrong_value_is_settled_by_a_third_node(runs, scenario, rank, node, step,
                                                       last_clean_audit):
    a = same_alarm_everywhere(runs[scenario])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", step, True,
                                                                          [rank])
    assert [n["node"] for n in a["suspect_nodes"]] == [node]
    (case,) = a["evidence"]["mismatches"]
    assert case["owner"] == rank and case["verdict"] == "owner"
    assert case["referee"] not in (None, rank, case["replayer"])
    assert case["loss_bits"]["replayer"] == case["loss_bits"]["referee"]
    assert case["n_differ"] > 0
    (rec,) = files_of(runs[scenario])
    assert (rec.node, rec.settled, rec.suspect_ranks) == (node, True, (rank,))
    assert a["first_suspect_step"] == last_clean_audit + 1  # steps since the last clean audit
    assert all(o["weights_after"] == o["weights_before_alarm"] for o in runs[scenario])


def test_mantissa_flip_is_caught_by_gradient_fingerprints_even_with_an_equal_loss(runs):
    (case,) = runs["mantissa_flip"][0]["alarm"]["evidence"]["mismatches"]
    assert case["loss_bits"]["owner"] == case["loss_bits"]["replayer"]  # one low bit: same loss
    assert "loss" not in case["differs"] and case["n_differ"] > 0


def test_flipped_weight_bit_after_the_step_is_named_by_the_vote(runs):
    a = same_alarm_everywhere(runs["weight_flip"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("weights", 3, True, [5])
    assert a["evidence"]["groups"] == [[0, 1, 2, 3, 4], [5]]
    assert a["evidence"]["differing"]["5"]["parameters"] == ["blocks.0.fc1.weight"]
    assert a["first_suspect_step"] == 3
    (rec,) = files_of(runs["weight_flip"])
    assert (rec.node, rec.settled, rec.suspect_ranks) == ("n2", True, (5,))


def test_verified_save_refuses_to_save_and_rollback_skips_the_suspect_window(runs):
    outs = runs["refused_save"]
    a = same_alarm_everywhere(outs)
    assert (a["check"], a["step"], a["suspect_ranks"], a["first_suspect_step"]) == ("weights", 4,
                                                                                    [5], 3)
    assert outs[0]["saved"] == [0, 2]  # step 4's save never ran
    assert outs[0]["rollback"] == "step0002.pt"


def test_nan_inside_the_allreduce_is_unsettled_and_the_step_is_not_applied(runs):
    outs = runs["nan_allreduce"]
    a = same_alarm_everywhere(outs)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_reduced", 3,
                                                                          False, [])
    assert a["candidate_ranks"] == list(range(6))
    for o in outs:
        assert o["weights_finite"] and o["weights_after"] == o["weights_before_alarm"]
    recs = files_of(outs)
    assert sorted(r.node for r in recs) == ["n0", "n1", "n2"]  # one file per node, about itself
    assert all(not r.settled and r.suspect_ranks == ()
               and [n.node for n in r.suspect_nodes] == [r.node] for r in recs)


def test_nan_only_one_rank_holds_after_the_allreduce_narrows_the_candidates_to_its_node(runs):
    """An all-reduce gives every rank the same result: a NaN in rank 3's reduced bucket alone was
    made where it is seen, so rank 3's node (n1) is the one candidate; nobody is named."""
    outs = runs["nan_after_reduce"]
    a = same_alarm_everywhere(outs)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_reduced", 2,
                                                                          False, [])
    assert a["candidate_ranks"] == [3] and a["evidence"]["ranks_seeing_nonfinite"] == [3]
    assert "only rank(s) 3 of 6" in a["evidence"]["why"]
    for o in outs:
        assert o["weights_finite"] and o["weights_after"] == o["weights_before_alarm"]
    (rec,) = files_of(outs)
    assert (rec.node, rec.settled, rec.suspect_ranks) == ("n1", False, ())
    assert rec.evidence["candidate_ranks"] == [3]


def test_nan_the_data_explains_is_numeric_not_hardware(runs):
    for o in runs["numeric"]:
        assert o["alarm"] is None and (o["numeric"]["step"], o["numeric"]["ranks"]) == (3, [2])
        assert o["files"] == []


def test_finite_gradients_whose_sum_overflows_are_numeric_not_a_reduction_fault(runs):
    """The default hook sums before it divides (hooks.py): gradients of 1e38 on every rank
    overflow the sum where DDP's own division first would not. Every rank's .grad was finite, so
    nobody is named, no alarm file is written, and the step is not applied."""
    for o in runs["overflowing_sum"]:
        assert o["alarm"] is None and o["files"] == []
        assert (o["numeric"]["step"], o["numeric"]["ranks"]) == (2, list(range(6)))
        assert "overflowed" in o["numeric"]["reason"]
        assert o["weights_finite"] and o["weights_after"] == o["weights_before_alarm"]


def test_a_rank_without_fingerprints_makes_every_rank_skip_that_audit_alike(runs):
    for o in runs["uneven_start"]:
        assert o["alarm"] is None and o["numeric"] is None and o["steps_done"] == 6
        # step 0 skipped alike; steps 1-5 audited (the first steps of a start, cadence.py)
        assert o["counters"]["audits_skipped"] == 1 and o["counters"]["audits"] == 5


def test_two_nodes_report_a_mismatch_unsettled_naming_nobody(runs):
    outs = [o for o in runs["two_nodes"] if o is not None]
    assert len(outs) == 4
    a = same_alarm_everywhere(outs)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"], a["suspect_nodes"]) == (
        "ring_replay", 4, False, [], [])
    assert a["candidate_ranks"] == [1, 3]
    (case,) = a["evidence"]["mismatches"]
    assert case["referee"] is None and case["verdict"].startswith("unsettled")
    recs = files_of(outs)
    assert sorted(r.node for r in recs) == ["n0", "n1"]
    assert all(not r.settled and r.suspect_ranks == () for r in recs)


def test_healthy_run_auditing_every_step_raises_nothing(runs):
    for o in runs["healthy"]:
        assert o["alarm"] is None and o["numeric"] is None and o["files"] == []
        assert o["steps_done"] == HEALTHY_STEPS
        assert o["counters"]["audits"] == HEALTHY_STEPS
        assert o["counters"].get("audits_skipped", 0) == 0
        assert o["counters"]["weight_checks"] == HEALTHY_STEPS // 10
        assert o["weights_finite"]
    assert len({o["weights_after"] for o in runs["healthy"]}) == 1
    assert runs["healthy"][0]["saved"] == list(range(0, HEALTHY_STEPS, 100))


def test_a_persistent_fault_among_three_single_rank_nodes_is_settled_not_called_numeric(tmp_path):
    # Rank 1's fault spoils its own record and its replay of rank 2: two of three owners
    # mismatch. That is one GPU, which the referees on the third nodes name.
    outs = run_ranks(audit_workers.three_nodes_persistent, ["n0", "n1", "n2"], timeout=240,
                     root=str(tmp_path))
    assert all(o["numeric"] is None for o in outs), outs[0]["numeric"]
    a = same_alarm_everywhere(outs)
    assert (a["check"], a["settled"], a["suspect_ranks"]) == ("ring_replay", True, [1])
    assert [n["node"] for n in a["suspect_nodes"]] == ["n1"]
    assert sorted(c["owner"] for c in a["evidence"]["mismatches"]) == [1, 2]
    (rec,) = files_of(outs)
    assert (rec.node, rec.settled, rec.suspect_ranks) == ("n1", True, (1,))
