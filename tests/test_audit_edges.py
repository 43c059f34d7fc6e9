"""The audit at its edges (issue 32): setups it must refuse rather than guess, a weight flip HSDP
must pin, and gradient accumulation as training loops really do it. Real gloo ranks on simulated
nodes (tests/edge_workers.py); each case as the issue writes it.
"""

from __future__ import annotations

import json

import pytest

from ddp_util import run_ranks
import edge_workers
import sentinel_workers

pytestmark = pytest.mark.timeout(600)


def _one(outs, key):
    values = [o[key] for o in outs]
    assert values[0] is not None and all(v == values[0] for v in values), values
    return values[0]


@pytest.mark.slow
def test_fsdp_over_tensor_parallel_as_the_issue_writes_it_is_audited_without_an_alarm():
    """(dp=2, tp=2), a TP group per node: it used to be read as HSDP and alarmed on every
    node at the first weight check; now audited, every step, without an alarm."""
    outs = run_ranks(edge_workers.tensor_parallel, ["a", "a", "b", "b"], timeout=240)
    for o in outs:
        assert (o["refused"], o["alarm"], o["numeric"]) == (None, None, None), o
        assert o["counters"]["audits"] == 2 and o["counters"]["weight_checks"] == 2


@pytest.mark.slow
def test_tensor_parallel_groups_that_span_nodes_are_refused_in_one_line():
    """TP partners on different nodes: the node-by-node ring would replay a rank without its
    TP partner (the issue's "three different results"): refused, every rank alike."""
    outs = run_ranks(edge_workers.tensor_parallel, ["a", "b", "a", "b"], timeout=240)
    line = _one(outs, "refused")
    assert all(o["exit"] == 2 and o["lines"] == 1 for o in outs)
    assert "tensor parallel" in line and "whole TP groups" in line


@pytest.fixture(scope="module")
def tensor_parallel_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-tp")
    per_rank = run_ranks(edge_workers.tensor_parallel_scenarios,
                         ["n1", "n1", "n2", "n2", "n3", "n3"], timeout=540, root=str(root))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@pytest.mark.slow
def test_fsdp_x_tp_healthy_steps_are_audited_without_an_alarm(tensor_parallel_runs):
    for o in tensor_parallel_runs["healthy"]:
        assert (o["alarm"], o["numeric"], o["steps_done"]) == (None, None, 6), o
        assert o["counters"]["audits"] == 6 and o["counters"]["weight_checks"] == 6
        assert not o["files"]
    # sequence parallel (norms SequenceParallel, activations sharded on the sequence), and with
    # loss parallel (the cross-entropy on vocabulary-sharded logits, its backward under
    # loss_parallel() in the replays too)
    for name in ("sp_healthy", "lp_healthy"):
        for o in tensor_parallel_runs[name]:
            assert (o["alarm"], o["numeric"], o["steps_done"]) == (None, None, 4), (name, o)
            assert o["counters"]["audits"] == 4 and not o["files"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario, check, step, ranks", [
    ("flip", "ring_replay", 2, [2, 3]),  # a forward fault reaches the whole TP group
    ("persistent", "ring_replay", 2, [2, 3]),
    ("grad", "ring_replay", 2, [3]),  # a weight gradient of rank 3's own TP shard
    ("nan", "nonfinite_local", 1, [2, 3]),
    ("spike", "spike_rerun", 6, [2, 3]),
    ("spike_persistent", "spike_rerun", 6, [2, 3]),
    ("sp_grad", "ring_replay", 2, [3]),  # sequence parallel
    ("lp_grad", "ring_replay", 2, [3]),  # sequence parallel and loss parallel
])
def test_fsdp_x_tp_faults_are_settled_on_the_tp_group_and_its_node_only(
        tensor_parallel_runs, scenario, check, step, ranks):
    """Rank 3 (node n2, TP partner of rank 2): each fault settled, naming rank 3 or its TP
    group (one node), the alarm file on n2 only; never an unsettled alarm on every node."""
    outs = tensor_parallel_runs[scenario]
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    a = _one(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == (check, step, True,
                                                                         ranks)
    assert [f["node"] for f in outs[0]["files"]] == ["n2"]


@pytest.mark.slow
def test_pipeline_stages_each_sharded_on_their_row_are_refused_not_aborted():
    outs = run_ranks(edge_workers.pipeline_stages, ["a", "a", "b", "b"], timeout=240)
    line = _one(outs, "refused")
    assert all(o["exit"] == 2 and o["lines"] == 1 for o in outs)
    assert "do not hold the same model" in line and "pipeline" in line
    assert "rank(s) 0, 1" in line and "rank(s) 2, 3" in line


@pytest.mark.slow
def test_a_gather_of_different_sizes_is_an_audit_error_on_every_rank_not_an_abort():
    outs = run_ranks(edge_workers.uneven_gather, ["a", "b", "c"], timeout=120)
    err = _one(outs, "error")
    assert all(o["exit"] == 1 for o in outs)
    assert "different sizes" in err and "{0: (3, 'int64'), 1: (4, 'int64'), 2: (5, 'int64')}" \
        in err


@pytest.mark.slow
def test_ranks_at_different_steps_raise_alike_instead_of_gathering_different_widths():
    """Rank 0 calls check_gradients at an audit step, the others at a plain one: the step's
    head has one width on every step and its tag carries the step, so every rank raises."""
    outs = run_ranks(edge_workers.steps_apart, ["a", "b", "c"], timeout=120)
    err = _one(outs, "error")
    assert all(o["exit"] == 1 for o in outs)
    assert "different steps ([1, 10])" in err


@pytest.mark.slow
def test_hsdp_weight_shard_flip_between_votes_is_pinned_to_its_rank(tmp_path):
    """3 replicas x 2 shards, a node a shard group; bit 31 of rank 3's first shard after step 2:
    at the next audit (step 3: the first steps of a start are all audited, cadence.py; the issue
    saw it at step 4) the ring replay's mismatches all point at node n2's ranks, the weight vote
    runs before the blast-radius rule and names rank 3, settled, file on n2 only."""
    outs = run_ranks(edge_workers.hsdp_shard_flip, ["n1", "n1", "n2", "n2", "n3", "n3"],
                     timeout=300, alarm_dir=str(tmp_path))
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    a = _one(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("weights", 3, True, [3])
    assert [n["node"] for n in a["suspect_nodes"]] == ["n2"]
    assert a["evidence"]["prompted_by"]["alarm"] == "ring_replay"
    assert a["evidence"]["prompted_by"]["suspects"] == [2, 3]  # what the referees said
    assert [(f["node"], f["check"], f["settled"]) for f in outs[0]["files"]] == [
        ("n2", "weights", True)]
    assert all(o["steps_done"] == 3 for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("nodes, node", [
    (["n1", "n1", "n2", "n2", "n3", "n3"], "n1"),  # a node = a shard group
    (["n1", "n2", "n1", "n2", "n3", "n3"], "n1"),  # the shard group {0, 1} spans n1 and n2
])
def test_a_shard_flip_that_makes_a_partner_nonfinite_names_the_shard_not_the_partner(
        tmp_path, nodes, node):
    """An exponent bit of rank 0's token-embedding shard: rank 1, which all-gathers it and whose
    batch reads that row, computes a NaN/Inf gradient that a replay elsewhere does not. Naming
    rank 1 would name the wrong GPU (and, when the shard group spans nodes, the wrong node): the
    shard vote runs first and names rank 0."""
    outs = run_ranks(edge_workers.hsdp_shard_flip, nodes, timeout=300, alarm_dir=str(tmp_path),
                     target=0, parameter="tok.weight", bit=30)
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    a = _one(outs, "alarm")
    assert (a["check"], a["settled"], a["suspect_ranks"]) == ("weights", True, [0])
    assert a["evidence"]["prompted_by"]["alarm"] == "nonfinite_local"
    assert a["evidence"]["prompted_by"]["suspects"] == [1]
    assert [(f["node"], f["check"]) for f in outs[0]["files"]] == [(node, "weights")]


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-accumulation")
    per_rank = run_ranks(edge_workers.accumulation, ["n1", "n1", "n2", "n2", "n3", "n3"],
                         timeout=540, root=str(root))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


PATTERNS = ["fsdp_every", "fsdp_no_sync", "hsdp_no_all_reduce", "ddp_every", "ddp_no_sync"]


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_accumulation_pattern_is_audited_without_an_alarm(accumulated, pattern):
    for o in accumulated[pattern]:
        assert (o["alarm"], o["numeric"], o["steps_done"]) == (None, None, 6), o
        # audit_every=5, and every step of the first 20 of a start (cadence.py): all 6
        assert o["counters"]["audits"] == 6 and o["counters"].get("audits_skipped", 0) == 0
        assert o["counters"]["self_checks"] == 1 and not o["files"]


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_forward_fault_under_every_accumulation_pattern_is_pinned(accumulated, pattern):
    outs = accumulated[f"{pattern}_fault"]
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    a = _one(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 5,
                                                                         True, [3])
    assert [f["node"] for f in outs[0]["files"]] == ["n2"]


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_a_fault_before_the_sentinel_is_warm_is_caught_by_the_guard_audits(tmp_path, persistent):
    """Issue 34.6's scenario: the default 20-step warm-up, no audit due (audit_every=1000), an
    exponent flip on rank 2 at step 6 (of a start at step 1). It used to pass unseen and end as a
    NumericFailure at step 8 with no node named; the first 20 steps of a start are audit steps,
    so the ring replay pins it at step 6."""
    outs = run_ranks(sentinel_workers.train, ["n1", "n1", "n2", "n2", "n3", "n3"], timeout=240,
                     alarm_dir=str(tmp_path), fault=True, persistent=persistent, warmup=20)
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    a = _one(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 6, True,
                                                                         [2])
    files = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert [f["node"] for f in files] == ["n2"]
    assert all(o["counters"]["audits"] == 5 for o in outs)  # steps 1-5 audited, clean


@pytest.mark.slow
@pytest.mark.parametrize("bit", [30, 0])  # an exponent bit, the lowest mantissa bit
def test_a_pure_fsdp_shard_that_changes_after_the_weight_check_is_pinned_to_its_rank(
        tmp_path, bit):
    """Pure FSDP has no replica to vote: a bit flipped in rank 4's shard after check_weights(2)
    reaches every rank through the all-gather alike. The rank's own record of its shards, taken
    at the weight check and compared at the next check_gradients, names it, settled."""
    outs = run_ranks(edge_workers.fsdp_shard_drift, ["n1", "n1", "n2", "n2", "n3", "n3"],
                     timeout=240, alarm_dir=str(tmp_path), target=4, bit=bit)
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    a = _one(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("weights", 3, True, [4])
    assert [f["node"] for f in outs[0]["files"]] == ["n3"]


@pytest.mark.slow
def test_a_loop_that_writes_to_the_weights_after_the_weight_check_is_no_hardware_verdict(
        tmp_path):
    outs = run_ranks(edge_workers.fsdp_shard_drift, ["n1", "n1", "n2", "n2", "n3", "n3"],
                     timeout=240, alarm_dir=str(tmp_path), target=None, every_rank=True)
    assert all(o["alarm"] is None for o in outs)
    assert all("writes to the weights after check_weights" in (o["numeric"] or "")
               for o in outs), [o["numeric"] for o in outs]
    assert not outs[0]["files"]


HSDP_TP_NODES = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]  # a TP group per node


@pytest.mark.slow
@pytest.mark.parametrize("fault, ranks", [
    (None, None),
    (edge_workers.fsdp_workers.flip(5, 2, op="addmm", call=1, bit=22), [4, 5]),  # forward
    (edge_workers.fsdp_workers.flip(5, 2, op="mm", call=1, bit=22), [5]),  # a weight gradient
])
def test_hsdp_x_tp_on_a_3d_mesh_is_audited(tmp_path, fault, ranks):
    """(replicate 2, shard 2, tp 2) on 8 ranks: healthy steps pass, a forward fault on rank 5 is
    settled on its TP group (node n3), a gradient fault on rank 5 alone; file on n3 only."""
    outs = run_ranks(edge_workers.hsdp_tensor_parallel, HSDP_TP_NODES, timeout=300,
                     alarm_dir=str(tmp_path), fault=fault)
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    if fault is None:
        for o in outs:
            assert (o["alarm"], o["steps_done"]) == (None, 4) and not o["files"], o
            assert o["counters"]["audits"] == 4 and o["counters"]["weight_checks"] == 4
        return
    a = _one(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 2, True,
                                                                         ranks)
    assert [f["node"] for f in outs[0]["files"]] == ["n3"]
