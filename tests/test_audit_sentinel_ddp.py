"""The sentinel between audits on DDP: six gloo ranks on three simulated nodes, no audit step at
all; an exponent flip in one rank's gradient (transient, or still there when the step is rerun)
and a data spike (one batch's loss times 1000). Ranks: n1 = {0, 1}, n2 = {2, 3}, n3 = {4, 5}."""

from __future__ import annotations

import json

import pytest

from ddp_util import agreed, run_ranks
import sentinel_workers

NODES = ["n1", "n1", "n2", "n2", "n3", "n3"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentinel-ddp")
    per_rank = run_ranks(sentinel_workers.everything, NODES, timeout=540, root=str(root))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("scenario, verdict", [("transient", "transient"),
                                               ("persistent", "persistent"),
                                               ("bucket_view_transient", "transient")])
def test_a_fault_between_audits_is_attributed_to_its_rank_before_the_update(runs, scenario,
                                                                            verdict):
    alarms = [o["alarm"] for o in runs[scenario]]
    a = alarms[0]
    assert a is not None and all(x == a for x in alarms), alarms
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("spike_rerun", 6, True,
                                                                         [2])
    assert [n["node"] for n in a["suspect_nodes"]] == ["n2"]
    assert a["evidence"]["verdict"] == verdict and a["evidence"]["spike"]["what"] == "grad"
    assert a["evidence"]["largest_gradient"]["original"] > 1e30
    assert [f["node"] for f in runs[scenario][0]["files"]] == ["n2"]
    assert all(o["steps_done"] == 5 for o in runs[scenario])  # steps 1-5; step 6 not applied


def test_a_data_spike_is_no_hardware_verdict(runs):
    for o in runs["data"]:
        assert (o["alarm"], o["numeric"], o["steps_done"], o["files"]) == (None, None, 8, [])
        assert o["counters"]["sentinel_fired"] == 1 and o["counters"]["sentinel_data"] == 1


def test_a_nan_made_by_the_reduction_is_explained_not_blamed_on_everyone(runs):
    """NaN written into rank 3's bucket inside the all-reduce at step 5: every local gradient
    was finite, every rank receives NaN. The alarm redoes the reduction where the NaN is: each
    rank's recomputed gradient there is finite and so is their sum, so the reduction itself went
    bad, which the all-reduce cannot pin on a rank; it says so and names nobody."""
    alarms = [o["alarm"] for o in runs["reduced_nan"]]
    a = alarms[0]
    assert a is not None and all(x == a for x in alarms)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_reduced", 5,
                                                                         False, [])
    redo = a["evidence"]["redo"]
    assert redo["done"] and redo["senders_finite_and_sum_finite"] is True
    (place,) = redo["places"]
    assert place["element"] == 5 and len(place["sent"]) == 6
    assert all(isinstance(v, float) for v in place["sent"].values())
    assert "no rank is named" in redo["why"]


@pytest.mark.parametrize("persistent", [False, True])
def test_a_fault_before_the_sentinel_is_warm_is_caught_by_the_guard_audits(tmp_path, persistent):
    """The default 20-step warm-up, no audit due (audit_every=1000), an exponent flip on rank 2
    at step 6 (of a start at step 1). It used to pass unseen and end as a NumericFailure at step
    8 with no node named; the first 20 steps of a start are audit steps, so the ring replay pins
    it at step 6."""
    outs = run_ranks(sentinel_workers.train, ["n1", "n1", "n2", "n2", "n3", "n3"], timeout=240,
                     alarm_dir=str(tmp_path), fault=True, persistent=persistent, warmup=20)
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    a = agreed(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 6, True,
                                                                         [2])
    files = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert [f["node"] for f in files] == ["n2"]
    assert all(o["counters"]["audits"] == 5 for o in outs)  # steps 1-5 audited, clean
