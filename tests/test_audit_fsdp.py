"""The in-job audit on FSDP2 and HSDP models, through the one entry point `Auditor(...)`.

Six ranks on three simulated nodes (NODE_NAME n1, n2, n3; two ranks each) on a real gloo process
group; the TinyLM sharded with `fully_shard` per block and at the root, on a 1-D mesh (FSDP) or a
(3 replicate x 2 shard) mesh (HSDP). No batch_fn: the loop hands its batch to check_gradients
(but for one scenario, which gives batch_fn). All scenarios run in one start of the ranks
(tests/fsdp_workers.py); each test asserts on its own. Ranks: n1 = {0, 1}, n2 = {2, 3},
n3 = {4, 5}.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ddp_util import run_ranks
import fsdp_workers
from screener.audit import Auditor, AuditUsageError
from screener.audit.fsdp_tap import finite as _finite
from screener.audit.sharded import is_sharded

NODES = ["n1", "n1", "n2", "n2", "n3", "n3"]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-fsdp")
    per_rank = run_ranks(fsdp_workers.everything, NODES, timeout=540, root=str(root))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def one_alarm(outs):
    alarms = [o["alarm"] for o in outs]
    assert alarms[0] is not None and all(a == alarms[0] for a in alarms), alarms
    assert all(o["numeric"] is None for o in outs)
    return alarms[0]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fsdp_healthy", "hsdp_healthy"])
def test_healthy_sharded_training_is_audited_every_step_without_an_alarm(runs, scenario):
    """FSDP with dropout (the owner's RNG state replayed), activation checkpointing and
    reshard_after_forward=False; HSDP with bf16 parameters and fp32 reduction, gradient
    accumulation without sync, and a batch_fn: four audited steps each, no alarm."""
    for o in runs[scenario]:
        assert (o["alarm"], o["numeric"], o["steps_done"]) == (None, None, 4), o
        assert o["counters"]["audits"] == 4 and o["counters"]["self_checks"] == 1
        assert o["counters"]["weight_checks"] == 4 and not o["files"]
        assert o["counters"].get("audits_skipped", 0) == 0
    # the batches travelled (no batch_fn for FSDP): every rank received its owner's
    assert all(o["counters"]["batch_bytes_received"] > 0 for o in runs["fsdp_healthy"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario, step, rank, node", [
    ("fsdp_flip", 2, 3, "n2"),  # a forward matmul output, exponent bit
    ("hsdp_flip_backward", 1, 0, "n1"),  # a backward matmul output, mantissa bit
])
def test_a_flip_at_an_audit_step_is_settled_and_pinned(runs, scenario, step, rank, node):
    a = one_alarm(runs[scenario])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", step,
                                                                         True, [rank])
    assert [n["node"] for n in a["suspect_nodes"]] == [node]
    (case,) = a["evidence"]["mismatches"]
    assert case["owner"] == rank and case["verdict"] == "owner" and case["n_differ"] >= 1
    files = runs[scenario][0]["files"]
    assert [(f["node"], f["check"], f["settled"]) for f in files] == [(node, "ring_replay", True)]
    assert all(o["steps_done"] == step for o in runs[scenario])  # the step was not applied


@pytest.mark.slow
def test_a_nan_in_one_local_gradient_is_confirmed_elsewhere_and_named(runs):
    a = one_alarm(runs["fsdp_nan"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_local", 1,
                                                                         True, [4])
    assert a["evidence"]["confirmed_by_replay"] == [4]
    assert a["evidence"]["confirmers"]["4"] not in (4, 5)  # replayed on another node
    assert [f["node"] for f in runs["fsdp_nan"][0]["files"]] == ["n3"]


@pytest.mark.slow
def test_hsdp_replicas_vote_on_each_shard(runs):
    a = one_alarm(runs["hsdp_weights"])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("weights", 1, True, [5])
    assert a["evidence"]["differing"]["5"]["parameters"] == ["tok.weight"]
    assert [f["node"] for f in runs["hsdp_weights"][0]["files"]] == ["n3"]


def test_finiteness_is_read_from_the_values_never_from_a_norm():
    """A norm overflows at about 1.9e19 in float32; min and max never do."""
    for dtype, big in ((torch.float32, 1e19), (torch.float32, 1e30), (torch.float32, 3e38),
                       (torch.bfloat16, 3e38), (torch.float16, 65504.0)):
        t = torch.zeros(5000, dtype=dtype)
        t[7] = big
        t[9] = -big
        assert _finite(t), (dtype, big)
        for bad in (float("nan"), float("inf"), float("-inf")):
            u = t.clone()
            u[11] = bad
            assert not _finite(u), (dtype, bad)
    assert _finite(torch.zeros(0))


def test_a_model_that_is_not_sharded_goes_to_the_ddp_auditor_and_is_refused_there():
    assert not is_sharded(nn.Linear(2, 2))
    with pytest.raises((TypeError, AuditUsageError), match="DistributedDataParallel model, or one sharded with fully_shard"):
        Auditor(nn.Linear(2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("scenario, verdict", [("spike_transient", "transient"),
                                               ("spike_persistent", "persistent")])
def test_a_spike_between_audits_is_attributed_before_the_update(runs, scenario, verdict):
    """No audit step at all: the sentinel sees the gradient's magnitude jump (an exponent flip
    on rank 2 at step 6, finite), the rank reruns its step and two other nodes replay it; a
    rerun that comes out clean is a transient fault, one that reproduces the bad value while
    the others agree on another is a persistent one. Either way: rank 2, node n2, settled, and
    the update never ran."""
    a = one_alarm(runs[scenario])
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("spike_rerun", 6, True,
                                                                         [2])
    assert a["evidence"]["verdict"] == verdict and a["evidence"]["spike"]["what"] == "grad"
    assert a["evidence"]["spike"]["ratio"] > 5
    assert [f["node"] for f in runs[scenario][0]["files"]] == ["n2"]
    assert all(o["steps_done"] == 6 for o in runs[scenario])
    assert all(o["counters"]["sentinel_fired"] == 1 for o in runs[scenario])


@pytest.mark.slow
def test_a_data_spike_is_the_datas_and_the_step_proceeds(runs):
    """A batch whose loss is 1000 times the others' (rank 0, step 6): every rerun reproduces
    it, so it is no hardware verdict: no alarm, no file, training goes on."""
    for o in runs["spike_data"]:
        assert (o["alarm"], o["numeric"], o["steps_done"], o["files"]) == (None, None, 8, [])
        assert o["counters"]["sentinel_fired"] == 1 and o["counters"]["sentinel_data"] == 1


@pytest.mark.parametrize("scaler", [False, True])
def test_an_fp16_reduction_that_overflows_is_no_alarm(tmp_path, scaler):
    """Finite local gradients whose fp16 sum overflows: with a GradScaler the scaler skips the
    step; without one it is a numeric failure. No node gets an alarm file either way."""
    outs = run_ranks(fsdp_workers.fp16_overflow, ["n0", "n1", "n2", "n3"], timeout=200,
                     alarm_dir=str(tmp_path), scaler=scaler)
    for o in outs:
        assert o["alarm"] is None
        if scaler:
            assert o["numeric"] is None and o["counters"]["scaler_skipped"] == 1
            assert o["events"].count("scaler_skipped_step") == 1  # said, not only counted
        else:
            assert "overflowed torch.float16" in o["numeric"]
    assert not list(tmp_path.iterdir())
