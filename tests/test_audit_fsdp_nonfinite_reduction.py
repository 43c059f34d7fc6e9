"""FSDP2/HSDP: a reduced gradient that went NaN/Inf while every local one was finite (issue 21.5).

The auditor redoes the bad module's reduce-scatter (and HSDP's all-reduce) once, for real, on the
recomputed inputs, and the alarm names only what that supports: never every node. Six ranks on
three simulated nodes (n1 = {0, 1}, n2 = {2, 3}, n3 = {4, 5}) on a real gloo group, the TinyLM of
tests/fsdp_workers.py (two blocks and the root: three reduce-scatters per backward). The faults
are written into one rank's collective output, after the collective ran (the recorder's reduce-
scatter, or torch.distributed.all_reduce, which FSDP calls for HSDP), once or on every call from
then on. All scenarios run in one start of the ranks (about 8 s on two cores; process groups,
so marked slow); each test asserts on its own. The rule itself is tested without ranks below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import fsdp_workers
from ddp_util import run_ranks

NODES = ["n1", "n1", "n2", "n2", "n3", "n3"]
MODULES = 3  # reduce-scatters per backward: blocks.0, blocks.1, the root
pytestmark = pytest.mark.timeout(300)


@dataclass
class BadOutput:
    """Wraps a collective: on `rank`, from its `call`-th call (0-based, this rank's calls of it)
    on, once or for good, writes inf into element `element` of the output after it ran."""

    real: Any
    rank: int
    call: int
    persistent: bool = False
    element: int = 3
    output_arg: int = 0
    calls: list[int] = field(default_factory=lambda: [0])
    fired: list[int] = field(default_factory=list)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.real(*args, **kwargs)
        n = self.calls[0]
        self.calls[0] += 1
        if dist.get_rank() == self.rank and (n == self.call or (self.persistent and n > self.call)):
            flat = args[self.output_arg].reshape(-1)
            flat[self.element % flat.numel()] = float("inf")
            self.fired.append(n)
        return out


@dataclass(frozen=True)
class Fault:
    """Which collective goes bad, on which rank, at which step (first module's call), how long."""

    collective: str  # "reduce_scatter" or "all_reduce"
    rank: int
    step: int
    module: int = 1  # the module's place in the backward's order of reduce-scatters
    persistent: bool = False


def scenario(rank: int, world: int, *, alarm_dir: str, hsdp: bool, fault: Optional[Fault],
             steps: int = 4) -> dict[str, Any]:
    """One training run under the Auditor (check 1 every step; no audit, no weight check) with
    the fault's collective wrapped on every rank."""
    from screener.audit import fsdp_tap

    restore = []
    if fault is not None:
        call = fault.step * MODULES + fault.module
        if fault.collective == "reduce_scatter":
            bad = BadOutput(fsdp_tap._REDUCE_SCATTER, fault.rank, call, fault.persistent)
            restore.append((fsdp_tap, "_REDUCE_SCATTER", fsdp_tap._REDUCE_SCATTER))
            fsdp_tap._REDUCE_SCATTER = bad
        else:
            bad = BadOutput(dist.all_reduce, fault.rank, call, fault.persistent)
            restore.append((dist, "all_reduce", dist.all_reduce))
            dist.all_reduce = bad
    try:
        out = fsdp_workers.train(rank, world, steps=steps, audit_every=0, weights_every=0,
                                 alarm_dir=alarm_dir, hsdp=hsdp)
    finally:
        for owner, name, real in restore:
            setattr(owner, name, real)
    out["fired"] = list(bad.fired) if fault is not None else []
    out["files"] = fsdp_workers._files(alarm_dir)
    return out


SCENARIOS: dict[str, dict[str, Any]] = {
    "healthy": dict(hsdp=False, fault=None, steps=3),
    # rank 3's shard of blocks' reduce-scatter gets an inf once at step 2: every rank's values
    # went into that shard, its one holder saw it, the redo is finite -> nobody can be named
    "fsdp_once": dict(hsdp=False, fault=Fault("reduce_scatter", 3, 2)),
    # ... and on every reduce-scatter from then on, the redo's too -> rank 3 the candidate
    "fsdp_stays": dict(hsdp=False, fault=Fault("reduce_scatter", 3, 2, persistent=True)),
    # HSDP (3 replicas x 2 shards): rank 4's all-reduce output once -> its replicas 0 and 2
    # hold the same shard finite: made where seen, rank 4 the candidate
    "hsdp_all_reduce_once": dict(hsdp=True, fault=Fault("all_reduce", 4, 1)),
    # rank 1's reduce-scatter output for good: the all-reduce spreads it to replicas 3 and 5;
    # the redo shows it in rank 1's reduce-scatter, before the all-reduce -> rank 1
    "hsdp_reduce_scatter_stays": dict(hsdp=True, fault=Fault("reduce_scatter", 1, 1,
                                                             persistent=True)),
}


def everything(rank: int, world: int, *, root: str) -> dict[str, Any]:
    import os

    out = {}
    for name, kwargs in SCENARIOS.items():
        directory = os.path.join(root, name)
        os.makedirs(directory, exist_ok=True)
        out[name] = scenario(rank, world, alarm_dir=directory, **kwargs)
        dist.barrier()
        out[name]["files"] = fsdp_workers._files(directory)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-fsdp-redo")
    per_rank = run_ranks(everything, NODES, timeout=240, root=str(root))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def one_alarm(outs):
    alarms = [o["alarm"] for o in outs]
    assert alarms[0] is not None and all(a == alarms[0] for a in alarms), alarms
    assert all(o["numeric"] is None for o in outs)
    return alarms[0]


@pytest.mark.slow
def test_a_healthy_run_has_no_alarm_and_no_redo(runs):
    for o in runs["healthy"]:
        assert (o["alarm"], o["numeric"], o["steps_done"], o["files"]) == (None, None, 3, [])
        assert not any(k.startswith("reduction_") for k in o["counters"])


@pytest.mark.slow
def test_a_reduce_scatter_that_went_bad_once_names_and_suspects_nobody(runs):
    """Before: an unsettled alarm with every rank a candidate, a file on every node. Now the
    redo is finite, every rank's values went into the one shard that held the inf: the alarm
    says nothing names a rank or node, and no node gets a file."""
    outs = runs["fsdp_once"]
    assert outs[3]["fired"] == [2 * MODULES + 1]
    a = one_alarm(outs)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"], a["candidate_ranks"]) == (
        "nonfinite_reduced", 2, False, [], [])
    ev = a["evidence"]
    assert ev["verdict"] == "transient" and ev["ranks_seeing_nonfinite"] == [3]
    redo = ev["redo"]
    assert redo["done"] and redo["inputs_reproduced"] and redo["senders_finite_and_sum_finite"]
    (place,) = redo["places"]
    assert (place["shard"], place["element"], place["seen_by"]) == (3, 3, [3])
    assert len(place["sent"]) == 6 and all(isinstance(v, float) for v in place["sent"].values())
    assert list(place["redone_reduce_scatter"]) == ["3"]
    assert isinstance(place["redone_reduce_scatter"]["3"], float)
    assert "none is suspected" in redo["why"] and "none is suspected" in ev["why"]
    assert all(o["files"] == [] for o in outs)
    assert all(o["steps_done"] == 2 for o in outs)  # step 2 never applied


@pytest.mark.slow
def test_a_reduce_scatter_that_stays_bad_makes_its_receiver_the_one_candidate(runs):
    outs = runs["fsdp_stays"]
    a = one_alarm(outs)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"], a["candidate_ranks"]) == (
        "nonfinite_reduced", 2, False, [], [3])
    redo = a["evidence"]["redo"]
    assert a["evidence"]["verdict"] == "persistent" and redo["senders_finite_and_sum_finite"]
    assert "again at rank(s) 3" in redo["why"]
    assert all(not isinstance(p["redone_reduce_scatter"]["3"], float) for p in redo["places"])
    (rec,) = outs[0]["files"]
    assert (rec["node"], rec["settled"], rec["suspect_ranks"]) == ("n2", False, [])
    assert rec["evidence"]["candidate_ranks"] == [3]


@pytest.mark.slow
def test_hsdp_an_all_reduce_output_only_one_replica_holds_narrows_to_that_rank(runs):
    outs = runs["hsdp_all_reduce_once"]
    assert outs[4]["fired"] == [1 * MODULES + 1]
    a = one_alarm(outs)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"], a["candidate_ranks"]) == (
        "nonfinite_reduced", 1, False, [], [4])
    ev = a["evidence"]
    assert ev["verdict"] == "transient" and ev["ranks_seeing_nonfinite"] == [4]
    (place,) = ev["redo"]["places"]
    assert place["seen_by"] == [4] and sorted(place["redone_all_reduce"]) == ["0", "2", "4"]
    assert all(isinstance(v, float) for v in place["redone_all_reduce"].values())
    assert "made where it was seen" in ev["redo"]["why"]
    (rec,) = outs[0]["files"]
    assert (rec["node"], rec["suspect_ranks"], rec["evidence"]["candidate_ranks"]) == (
        "n3", [], [4])


@pytest.mark.slow
def test_hsdp_a_reduce_scatter_that_stays_bad_is_placed_before_the_all_reduce(runs):
    """The all-reduce spreads rank 1's bad shard to its replicas 3 and 5 (every holder sees it);
    the redo finds it already in rank 1's reduce-scatter output, so rank 1 is the candidate."""
    outs = runs["hsdp_reduce_scatter_stays"]
    a = one_alarm(outs)
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"], a["candidate_ranks"]) == (
        "nonfinite_reduced", 1, False, [], [1])
    ev = a["evidence"]
    assert ev["verdict"] == "persistent" and ev["ranks_seeing_nonfinite"] == [1, 3, 5]
    assert "the reduce-scatter, done again" in ev["redo"]["why"]
    (rec,) = outs[0]["files"]
    assert (rec["node"], rec["evidence"]["candidate_ranks"]) == ("n1", [1])


# ---- the rule itself (screener.audit.reduction), the DDP auditor's too ------------------------

def test_the_rule_without_a_redone_collective_is_ddps_old_one():
    from screener.audit.reduction import ReductionEvidence, reduction_verdict

    every = list(range(6))
    v = reduction_verdict(ReductionEvidence(every, every, every, "all-reduce", True, True))
    assert (v.verdict, v.candidates) == ("unplaced", tuple(every))
    assert "the all-reduce does not say which, so no rank is named" in v.why
    v = reduction_verdict(ReductionEvidence([3], every, every, "all-reduce"))
    assert (v.verdict, v.candidates) == ("unplaced", (3,))
    v = reduction_verdict(ReductionEvidence(every, every, every, "all-reduce", False, True))
    assert (v.verdict, v.candidates) == ("data", tuple(every))


def test_the_rule_with_a_redo_names_no_more_than_it_shows():
    from screener.audit.reduction import ReductionEvidence, reduction_verdict

    every = list(range(6))
    once = [("reduce-scatter", []), ("all-reduce", [])]
    v = reduction_verdict(ReductionEvidence([1, 3, 5], [1, 3, 5], every, "x", True, True, once))
    assert (v.verdict, v.candidates) == ("transient", ())
    v = reduction_verdict(ReductionEvidence([5], [1, 3, 5], every, "x", True, True, once))
    assert (v.verdict, v.candidates) == ("transient", (5,))
    later = [("reduce-scatter", []), ("all-reduce", [3])]
    v = reduction_verdict(ReductionEvidence([1, 3, 5], [1, 3, 5], every, "x", True, True, later))
    assert (v.verdict, v.candidates) == ("persistent", (3,)) and "the all-reduce, done" in v.why
    v = reduction_verdict(ReductionEvidence([1], [1], every, "x", True, False, once))
    assert v.verdict == "data"
