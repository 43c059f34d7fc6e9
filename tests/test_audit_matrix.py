"""The training setups people run, audited on a real gloo process group: six ranks on three
simulated nodes (n0 = {0, 1}, n1 = {2, 3}, n2 = {4, 5}), ring replay and weight vote every step.

Each setup of audit_workers.MATRIX_SETUPS trains healthy for a few steps (no alarm, no numeric
failure, nothing skipped but the GradScaler's overflow steps), then again with a persistent
single-bit fault in every forward rank 3 computes (its training step and its replays alike): the
alarm must be settled and name rank 3 on n1 alone, with one alarm file, on n1. Then the verdicts
that are no hardware verdict (exit 76, no file) and the setups refused (exit 2, one line). All of
it runs in one launch of six processes (starting them is the expensive part); the long campaign is
benchmarks/bench_audit_matrix.py.

Issue 28's setups, which healthy jobs were killed in at step 0: DDP(torch.compile(model))
(torch.compile with backend="aot_eager" here: inductor's C++ compile in six processes on a small
CI machine costs minutes; the benchmark runs inductor), reentrant and non-reentrant activation
checkpointing, gradient_as_bucket_view and clip_grad_norm_ with a +1e20 gradient spike on every
rank; torch.compile(DDP(model)) is refused.
"""

from __future__ import annotations

import pytest

import audit_workers
from ddp_util import run_ranks
from screener.audit import AuditUsageError, classify
from screener.audit.refusals import COMPILED_AROUND_DDP
from screener.alarmfile import AlarmRecord

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]
HEALTHY_STEPS = 4  # fp16_scaler: all ranks overflow at step 2, rank 2's data at step 3
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


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
        assert o["refused"] is None and o["error"] is None, (o["refused"], o["error"])
        assert o["files"] == [] and o["weights_finite"]
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


def test_issue28_setups_run_what_they_claim_to(runs):
    """The compiled setup trains and replays compiled code, its replays in DDP's forward context
    (where torch.compile compiles as the training step does); reentrant checkpointing is replayed
    by a backward pass, non-reentrant by autograd.grad; the spike is there, finite."""
    for o in runs["compiled_inner/healthy"]:
        assert o["compiled_graphs"] > 0
        assert o["replay_contexts"] and all(o["replay_contexts"])
    assert all(o["replay_backward"] for o in runs["checkpoint_reentrant/healthy"])
    assert not any(o["replay_backward"] for o in runs["checkpoint_nonreentrant/healthy"])
    for setup in ("bucket_view_huge", "clipping_huge"):
        assert all(o["grad_max"] >= audit_workers.HUGE for o in runs[f"{setup}/healthy"])


def test_torch_compile_around_ddp_is_refused_in_one_line_exit_2(runs):
    """Given to the Auditor: refused at construction. The Auditor given the DDP model while the
    loop trains torch.compile(ddp): refused at the first check_gradients, before any verdict."""
    msgs = runs["refused/compiled_outer"]
    assert msgs == [COMPILED_AROUND_DDP] * len(NODES)
    assert "\n" not in msgs[0] and "DDP(torch.compile(model))" in msgs[0]
    assert classify(AuditUsageError(msgs[0])) == 2
    for o in runs["refused/compiled_outer_trained"]:
        assert o["refused"] == COMPILED_AROUND_DDP
        assert o["alarm"] is None and o["numeric"] is None and o["error"] is None
        assert o["steps_done"] == 0 and o["counters"] == {} and o["files"] == []


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
