"""The in-job audit under pipeline parallel (torch.distributed.pipelining, FSDP2 per stage).

Six ranks on a real gloo group: a (pp=2, dp=3) grid, stage s of pipeline d is rank 3 s + d;
pipeline d runs on node n{d+1} (ranks d and 3 + d), so pipeline d + 1 replays pipeline d with
every stage on another node and pipeline d + 2 referees. All scenarios run in one start of the
ranks (tests/pipeline_workers.py); the rule that reads the records (pipeline_plan.py) is tested
pure below.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from ddp_util import run_ranks
import pipeline_workers
from screener.audit.pipeline_plan import RECORD, R_BWD, R_FINITE, R_FWD, R_GRAD, Pipelines, \
    first_difference, first_nonfinite, plan, settle_pipelines

NODES = ["n1", "n2", "n3", "n1", "n2", "n3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-pp")
    per_rank = run_ranks(pipeline_workers.everything, NODES, timeout=540, root=str(root))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def one_alarm(outs):
    alarms = [o["alarm"] for o in outs]
    assert alarms[0] is not None and all(a == alarms[0] for a in alarms), alarms
    assert all(o["numeric"] is None for o in outs)
    return alarms[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", ["gpipe_healthy", "1f1b_healthy"])
def test_healthy_pipelines_are_audited_every_step_without_an_alarm(runs, scenario):
    """GPipe, and 1F1B with activation checkpointing, dropout in every block: each step replayed
    by another pipeline and compared stage by stage, the first one by its own pipeline too."""
    for o in runs[scenario]:
        assert (o["alarm"], o["numeric"], o["usage"], o["steps_done"]) == (None, None, None, 3)
        assert o["counters"]["audits"] == 3 and o["counters"]["self_checks"] == 1, o
        assert o["counters"]["replays"] == 4 and not o["files"]
    # the inputs travelled to the replaying pipeline's first stage, the targets to its last
    assert all(o["counters"]["batch_bytes_received"] > 0 for o in runs[scenario])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario, step, rank, node, stage, part, verdicts", [
    ("forward_flip", 2, 4, "n2", 1, "forward", ["owner"]),
    ("backward_flip", 1, 0, "n1", 0, "backward", ["owner"]),
    # a unit wrong in its own step and in the replay it computes for the pipeline before it
    ("persistent", 1, 2, "n3", 0, "forward", ["replayer", "owner"]),
])
def test_a_flip_at_an_audit_step_is_pinned_to_its_stage_rank_and_node(runs, scenario, step, rank,
                                                                     node, stage, part,
                                                                     verdicts):
    a = one_alarm(runs[scenario])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", step,
                                                                         True, [rank])
    assert [n["node"] for n in a["suspect_nodes"]] == [node]
    cases = a["evidence"]["cases"]
    assert [c["verdict"] for c in cases] == verdicts
    assert all((c["stage"], c["part"]) == (stage, part) for c in cases)
    files = runs[scenario][0]["files"]
    assert [(f["node"], f["check"], f["settled"]) for f in files] == [(node, "ring_replay", True)]
    assert all(o["steps_done"] == step for o in runs[scenario])  # the step was not applied


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nan_is_located_along_the_data_flow_and_confirmed_by_another_pipeline(runs):
    a = one_alarm(runs["nan"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_local", 1,
                                                                         True, [3])
    (case,) = a["evidence"]["cases"]
    assert (case["stage"], case["part"], case["replayer_pipeline"], case["replay_finite"]) == \
        (1, "forward", 1, True)
    assert [f["node"] for f in runs["nan"][0]["files"]] == ["n1"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_flip_in_a_stored_shard_is_named_by_its_own_record(runs):
    a = one_alarm(runs["shard_flip"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("weights", 1, True, [5])
    assert a["evidence"]["stages"] == [1]
    assert [f["node"] for f in runs["shard_flip"][0]["files"]] == ["n3"]
    healthy = runs["gpipe_healthy"]
    assert all(o["counters"]["shard_records"] == 3 for o in healthy)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_sentinel_watches_the_steps_between_audits_without_an_alarm(runs):
    for o in runs["spike_healthy"]:
        assert (o["alarm"], o["numeric"], o["steps_done"]) == (None, None, 8)
        assert o["counters"]["audits"] == 3  # the warm-up guard: steps 0-2
        assert o["counters"].get("sentinel_fired", 0) == 0 and not o["files"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_transient_spike_between_audits_is_rerun_replayed_and_named_on_its_pipeline(runs):
    """The step's gradient jumps on rank 1; its pipeline's rerun and the two replays agree on
    another value: a fault of that step alone. Between audits the records carry no
    fingerprints, so the pipeline is named: here one node."""
    a = one_alarm(runs["spike_transient"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("spike_rerun", 5, True,
                                                                         [1, 4])
    ev = a["evidence"]
    assert (ev["verdict"], ev["spike"]["what"], ev["suspect"]) == ("transient", "grad", 1)
    assert (ev["confirmer_pipeline"], ev["referee_pipeline"]) == (2, 0)
    assert [n["node"] for n in a["suspect_nodes"]] == ["n2"]
    assert [f["node"] for f in runs["spike_transient"][0]["files"]] == ["n2"]
    assert all(o["steps_done"] == 5 for o in runs["spike_transient"])  # step 5 not applied


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_persistent_spike_is_pinned_to_the_stage_where_the_rerun_parts_from_the_replay(runs):
    a = one_alarm(runs["spike_persistent"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("spike_rerun", 5, True,
                                                                         [4])
    ev = a["evidence"]
    assert (ev["verdict"], ev["spike"]["what"]) == ("persistent", "loss")
    assert ev["cases"] == [{"pipeline": 1, "verdict": "owner", "stage": 1}]
    assert [f["node"] for f in runs["spike_persistent"][0]["files"]] == ["n2"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stage_not_sharded_with_fully_shard_is_refused_in_one_line_on_every_rank(runs):
    lines = {o["usage"] for o in runs["plain_stage"]}
    assert len(lines) == 1
    (line,) = lines
    assert "fully_shard" in line and "\n" not in line and "Stage" in line
    (ddp,) = {o["usage"] for o in runs["ddp_stage"]}
    assert "DDP per stage is not audited" in ddp and "static_graph" in ddp and "\n" not in ddp


# ---- tensor parallel inside the stages (pp 2 x dp 3 x tp 2) -----------------------------------

# rank 6 s + 2 d + t; pipeline 2 d + t; dp row d (both stages, both TP ranks) on node n{d+1}
TP_NODES = ["n1", "n1", "n2", "n2", "n3", "n3"] * 2


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-pp-tp")
    per_rank = run_ranks(pipeline_workers.everything, TP_NODES, timeout=540, root=str(root),
                         scenarios=pipeline_workers.TP_SCENARIOS)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pipelines_with_tensor_parallel_stages_are_audited_without_an_alarm(tp_runs):
    """Each TP group of pipelines replayed by another group, coordinate by coordinate (a shift
    that crossed coordinates compared different shards: a NumericFailure on every healthy
    step, before)."""
    for o in tp_runs["tp_healthy"]:
        assert (o["alarm"], o["numeric"], o["usage"], o["steps_done"]) == (None, None, None, 3)
        assert o["counters"]["audits"] == 3 and o["counters"]["self_checks"] == 1, o
        assert not o["files"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_flip_in_a_tensor_parallel_stage_is_settled_on_its_tp_group_and_node(tp_runs):
    a = one_alarm(tp_runs["tp_forward_flip"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 1, True,
                                                                         [8, 9])
    assert [n["node"] for n in a["suspect_nodes"]] == ["n2"]
    cases = a["evidence"]["cases"]
    assert sorted(c["owner_pipeline"] for c in cases) == [2, 3]  # the TP pair parted as one
    assert all((c["verdict"], c["stage"]) == ("owner", 1) for c in cases)
    assert {c["replayer_pipeline"] for c in cases} == {4, 5}
    files = tp_runs["tp_forward_flip"][0]["files"]
    assert [(f["node"], f["check"], f["settled"]) for f in files] == [("n2", "ring_replay", True)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_gradient_flip_on_one_tp_rank_is_refereed_with_its_partner_and_settled_on_it(tp_runs):
    """Only rank 2's records part; the referee pipeline's TP partner replays the partner's
    batch with it (left on its own batch, the pair's all-reduce mixed two steps and the referee
    agreed with nobody: unsettled)."""
    a = one_alarm(tp_runs["tp_backward_flip"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 1, True,
                                                                         [2])
    (case,) = a["evidence"]["cases"]
    assert (case["owner_pipeline"], case["verdict"], case["stage"], case["part"]) == \
        (2, "owner", 0, "backward")
    assert [f["node"] for f in tp_runs["tp_backward_flip"][0]["files"]] == ["n2"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nan_that_appears_downstream_of_its_cause_is_named_where_the_runs_part(tp_runs):
    """At an audit step the records carry fingerprints: the finite replay parts from the step at
    stage 0's forward, upstream of the first NaN/Inf (stage 1's backward, whose ranks were named
    before)."""
    a = one_alarm(tp_runs["tp_overflow"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_local", 1,
                                                                         True, [2, 3])
    assert {(c["stage"], c["part"]) for c in a["evidence"]["cases"]} == {(0, "forward")}
    assert [n["node"] for n in a["suspect_nodes"]] == ["n2"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_gpu_per_node_tp_stages_are_replayed_at_their_own_coordinate():
    """Every rank on a node of its own: the nearest node-disjoint pipeline is the TP partner's
    (another shard), which the replay must skip; before, every healthy step ended in a
    NumericFailure naming four nodes."""
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(pipeline_workers.everything, [f"n{r}" for r in range(12)],
                             timeout=540, root=root,
                             scenarios={"tp_healthy": pipeline_workers.TP_SCENARIOS["tp_healthy"]})
    for o in (r["tp_healthy"] for r in per_rank):
        assert (o["alarm"], o["numeric"], o["usage"], o["steps_done"]) == (None, None, None, 3)
        assert o["counters"]["audits"] == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nan_in_a_tensor_parallel_stage_is_confirmed_with_its_partner_replayed(tp_runs):
    a = one_alarm(tp_runs["tp_nan"])
    assert (a["check"], a["step"], a["settled"]) == ("nonfinite_local", 1, True)
    assert a["suspect_ranks"] == [2, 3] and [n["node"] for n in a["suspect_nodes"]] == ["n2"]
    assert all(c["replay_finite"] and c["stage"] == 0 for c in a["evidence"]["cases"])
    assert [f["node"] for f in tp_runs["tp_nan"][0]["files"]] == ["n2"]


# ---- the rule, pure --------------------------------------------------------------------------

def tp_grid(pp, dp, tp):
    """Pipelines of a (pp, dp, tp) mesh: rank s * dp * tp + d * tp + t."""
    at = lambda s, d, t: s * dp * tp + d * tp + t  # noqa: E731
    entries = [(at(s, d, t), s, pp, [at(u, d, t) for u in range(pp)])
               for s in range(pp) for d in range(dp) for t in range(tp)]
    groups = {at(s, d, t): [at(s, d, u) for u in range(tp)]
              for s in range(pp) for d in range(dp) for t in range(tp)}
    got = Pipelines.from_groups(entries, tp=groups)
    assert isinstance(got, Pipelines), got
    return got


def test_a_replay_moves_a_tp_group_of_pipelines_onto_a_group_coordinate_by_coordinate():
    pipes = tp_grid(2, 2, 2)
    assert pipes.groups == ((0, 1), (0, 1), (2, 3), (2, 3))
    assert pipes.close([2]) == [2, 3] and pipes.close([0, 3]) == [0, 1, 2, 3]
    assert pipes.aligned(2) and not pipes.aligned(1) and not pipes.aligned(3)
    # one GPU per node: shift 1 is node-disjoint but pairs TP coordinate 0 with 1
    alone = plan(pipes, lambda r: f"n{r}")
    assert not isinstance(alone, str) and (alone.shift, alone.referee_shift) == (2, None)
    three = plan(tp_grid(2, 3, 2), lambda r: f"n{(r % 6) // 2}")
    assert not isinstance(three, str) and (three.shift, three.referee_shift) == (2, 4)
    # two pipelines' worth of TP pairs on one node column: nothing to shift them onto
    stuck = plan(tp_grid(2, 1, 2), lambda r: f"n{r}")
    assert isinstance(stuck, str)


def test_tp_groups_that_cross_stages_or_change_partners_are_refused_with_the_reason():
    entries = [(0, 0, 2, [0, 2]), (1, 0, 2, [1, 3]), (2, 1, 2, [0, 2]), (3, 1, 2, [1, 3])]
    across = Pipelines.from_groups(entries, tp={0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]})
    assert isinstance(across, str) and "spans stages" in across
    entries = [(s * 4 + d, s, 2, [d, 4 + d]) for s in range(2) for d in range(4)]
    changing = Pipelines.from_groups(entries, tp={0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3],
                                                  4: [4, 6], 6: [4, 6], 5: [5, 7], 7: [5, 7]})
    assert isinstance(changing, str) and "from stage to stage" in changing
    plain = Pipelines.from_groups(entries, tp={r: [r] for r in range(8)})
    assert isinstance(plain, Pipelines) and plain.groups == ()



def grid(pp, dp):
    """Pipelines of a (pp, dp) mesh: stage s of pipeline d is rank s * dp + d."""
    got = Pipelines.from_groups([(s * dp + d, s, pp, [t * dp + d for t in range(pp)])
                                 for s in range(pp) for d in range(dp)])
    assert isinstance(got, Pipelines)
    return got


def test_the_replay_shift_keeps_every_stage_off_the_owners_node():
    pipes = grid(2, 4)
    # 2 ranks per node, pipelines 0-1 on nodes a (stage 0) / c (stage 1), 2-3 on b / d
    node = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c", 6: "d", 7: "d"}
    got = plan(pipes, node.__getitem__)
    assert not isinstance(got, str)
    assert got.shift == 2 and got.referee_shift is None  # only two node columns: no referee
    assert [got.replayer(d) for d in range(4)] == [2, 3, 0, 1]
    one_node = plan(pipes, lambda r: "a" if r < 4 else "b")
    assert isinstance(one_node, str) and "spread each stage's ranks" in one_node
    three = plan(grid(2, 3), lambda r: f"n{r % 3}")
    assert not isinstance(three, str) and (three.shift, three.referee_shift) == (1, 2)
    assert three.owner_replayed_by(0) == 2 and three.owner_refereed_by(0) == 1


def test_pipeline_groups_that_are_no_grid_are_refused_with_the_reason():
    assert "one stage per rank" in Pipelines.from_groups([(0, 0, 2, [0, 1, 2]),
                                                          (1, 1, 2, [0, 1, 2])])
    assert "disagree" in Pipelines.from_groups([(0, 0, 2, [0, 1]), (1, 1, 3, [0, 1])])
    assert "place" in Pipelines.from_groups([(0, 1, 2, [0, 1]), (1, 0, 2, [0, 1])])
    assert "one stage" in Pipelines.from_groups([(0, 0, 1, [0])])
    one = grid(2, 1)
    assert isinstance(plan(one, str), str)


def rec(fwd=0, bwd=0, grad=0, finite=(1, 1, 1)):
    row = [0] * RECORD
    row[R_FWD], row[R_BWD], row[R_GRAD] = fwd, bwd, grad
    row[R_FINITE:R_FINITE + 3] = finite
    return row


def test_where_two_runs_part_follows_the_data_flow():
    clean = [rec(1, 1, 1), rec(2, 2, 2), rec(3, 3, 3)]
    assert first_difference(clean, clean) is None
    # a forward fault at stage 1 changes everything downstream and every gradient upstream
    fwd1 = [rec(1, 9, 9), rec(8, 9, 9), rec(8, 9, 9)]
    assert first_difference(fwd1, clean) == (1, "forward")
    # a weight-gradient fault at stage 1 changes stage 1's gradient only
    grad1 = [rec(1, 1, 1), rec(2, 2, 7), rec(3, 3, 3)]
    assert first_difference(clean, grad1) == (1, "backward")
    # an input-gradient fault at stage 2 reaches stage 1 and 0 backward
    bwd2 = [rec(1, 5, 5), rec(2, 5, 5), rec(3, 5, 3)]
    assert first_difference(clean, bwd2) == (2, "backward")
    assert settle_pipelines(fwd1, clean, clean) == ("owner", 1)
    assert settle_pipelines(clean, fwd1, clean) == ("replayer", 1)
    assert settle_pipelines(fwd1, clean, None) == ("unsettled", 1)
    assert settle_pipelines(fwd1, clean, grad1) == ("unsettled", 1)


def test_a_nan_is_placed_where_it_first_appears():
    assert first_nonfinite([rec(), rec()]) is None
    assert first_nonfinite([rec(), rec(finite=(0, 0, 0))]) == (1, "forward")
    assert first_nonfinite([rec(finite=(1, 0, 0)), rec(finite=(1, 0, 1))]) == (1, "backward")
    assert first_nonfinite([rec(finite=(1, 1, 0)), rec()]) == (0, "backward")


def test_schedules_with_several_stages_per_rank_are_refused_by_name():
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleLoopedBFS

    from screener.audit.pipeline import _refusal, is_pipeline_schedule

    for cls in (ScheduleInterleaved1F1B, ScheduleLoopedBFS):
        schedule = object.__new__(cls)  # the class is what is refused: no stages needed
        assert is_pipeline_schedule(schedule)
        why, stage = _refusal(schedule)
        assert stage is None and cls.__name__ in why and "several stages per rank" in why
    assert not is_pipeline_schedule(torch.nn.Linear(2, 2))
