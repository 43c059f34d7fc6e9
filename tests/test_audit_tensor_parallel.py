"""FSDP2 x TP and HSDP x TP audited (sequence and loss parallel included): healthy steps without an
alarm, every fault settled on its rank or its TP group and that node only, TP groups across
nodes refused in one line. Real gloo ranks on simulated nodes (tests/audit_setup_workers.py).
"""

from __future__ import annotations

import pytest

from ddp_util import agreed, run_ranks
import audit_setup_workers

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_fsdp_over_tensor_parallel_as_the_issue_writes_it_is_audited_without_an_alarm():
    """(dp=2, tp=2), a TP group per node: it used to be read as HSDP and alarmed on every
    node at the first weight check; now audited, every step, without an alarm."""
    outs = run_ranks(audit_setup_workers.tensor_parallel, ["a", "a", "b", "b"], timeout=240)
    for o in outs:
        assert (o["refused"], o["alarm"], o["numeric"]) == (None, None, None), o
        assert o["counters"]["audits"] == 2 and o["counters"]["weight_checks"] == 2


@pytest.mark.slow
def test_tensor_parallel_groups_that_span_nodes_are_refused_in_one_line():
    """TP partners on different nodes: the node-by-node ring would replay a rank without its
    TP partner (the issue's "three different results"): refused, every rank alike."""
    outs = run_ranks(audit_setup_workers.tensor_parallel, ["a", "b", "a", "b"], timeout=240)
    line = agreed(outs, "refused")
    assert all(o["exit"] == 2 and o["lines"] == 1 for o in outs)
    assert "tensor parallel" in line and "whole TP groups" in line


@pytest.fixture(scope="module")
def tensor_parallel_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-tp")
    per_rank = run_ranks(audit_setup_workers.tensor_parallel_scenarios,
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
    a = agreed(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == (check, step, True,
                                                                         ranks)
    assert [f["node"] for f in outs[0]["files"]] == ["n2"]


HSDP_TP_NODES = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]  # a TP group per node


@pytest.mark.slow
@pytest.mark.parametrize("fault, ranks", [
    (None, None),
    (audit_setup_workers.fsdp_workers.flip(5, 2, op="addmm", call=1, bit=22), [4, 5]),  # forward
    (audit_setup_workers.fsdp_workers.flip(5, 2, op="mm", call=1, bit=22), [5]),  # a weight gradient
])
def test_hsdp_x_tp_on_a_3d_mesh_is_audited(tmp_path, fault, ranks):
    """(replicate 2, shard 2, tp 2) on 8 ranks: healthy steps pass, a forward fault on rank 5 is
    settled on its TP group (node n3), a gradient fault on rank 5 alone; file on n3 only."""
    outs = run_ranks(audit_setup_workers.hsdp_tensor_parallel, HSDP_TP_NODES, timeout=300,
                     alarm_dir=str(tmp_path), fault=fault)
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    if fault is None:
        for o in outs:
            assert (o["alarm"], o["steps_done"]) == (None, 4) and not o["files"], o
            assert o["counters"]["audits"] == 4 and o["counters"]["weight_checks"] == 4
        return
    a = agreed(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 2, True,
                                                                         ranks)
    assert [f["node"] for f in outs[0]["files"]] == ["n3"]
