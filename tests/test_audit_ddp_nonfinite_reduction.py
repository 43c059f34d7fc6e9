"""DDP: a reduced gradient that went NaN/Inf while every local one was finite (issue 21.5).

The auditor replays every rank's step and redoes the bad bucket's all-reduce once, for real, on
the recomputed gradients, through the reduction the job uses (the comm hook's fused sum and
division, or the caller's reduce hook), and the alarm names only what that supports. Four ranks
on two simulated nodes (n0 = {0, 1}, n1 = {2, 3}) on a real gloo group, the tiny LM of
tests/audit_workers.py (one bucket per backward, so the hook's call n is step n). Faults go into
the caller's reduce hook, or into torch.distributed.all_reduce itself (the fused path calls it),
once or on every call from then on. All scenarios run in one start of the ranks; each test
asserts on its own. Before: every such alarm made every rank a candidate, a file on every node.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import audit_workers
from ddp_util import run_ranks
from screener.audit import AuditError
from screener.known_answer.engine import faults

NODES = ["n0", "n0", "n1", "n1"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _after_reduce(target: int, first: int, persistent: bool) -> Callable:
    """A reduce hook: torch's all-reduce, then NaN written into target's reduced bucket from the
    hook's call `first` on (persistent) or on that call only."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    calls = {"n": 0}

    def hook(state, bucket):  # no annotations: DDP checks them against GradBucket
        n = calls["n"]
        calls["n"] += 1

        def poison(fut: Any) -> torch.Tensor:
            reduced = fut.value()[0] if isinstance(fut.value(), list) else fut.value()
            if dist.get_rank() == target and (n == first or (persistent and n > first)):
                reduced.view(-1)[2] = float("nan")
            return reduced
        return allreduce_hook(state, bucket).then(poison)
    hook.stateless = True  # the fault stands in for hardware; the reduction keeps no state
    return hook


def _bad_all_reduce(target: int, first: int, persistent: bool, into_input: bool) -> Callable:
    """torch.distributed.all_reduce with NaN on `target`, on its calls of a gradient-sized
    float tensor numbered `first` (and after, if persistent): written into the input before the
    reduction (every rank receives it) or into the output after it (target alone holds it)."""
    real = dist.all_reduce
    calls = {"n": 0}

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # type: ignore
        big = tensor.is_floating_point() and tensor.numel() > 64
        n = calls["n"]
        calls["n"] += int(big)
        hit = big and dist.get_rank() == target and (n == first or (persistent and n > first))
        if hit and into_input:
            tensor.view(-1)[1] = float("nan")
        work = real(tensor, op=op, group=group, async_op=async_op)
        if hit and not into_input:
            if work is not None:
                work.wait()
            tensor.view(-1)[1] = float("nan")
        return work
    return all_reduce


def _replay_nan_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Finite in the training step (the DDP model), NaN in every replay (the bare module)."""
    loss = audit_workers.compute_loss(model, batch)
    return loss if isinstance(model, DDP) else loss * float("nan")


def _replay_fails_on_2(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if not isinstance(model, DDP) and dist.get_rank() == 2:
        raise RuntimeError("replay broke here")
    return audit_workers.compute_loss(model, batch)


def _huge_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Gradients far past fp16's largest value (65504), finite in fp32."""
    return audit_workers.compute_loss(model, batch) * 1e7


def _stateful(inner: Callable) -> Callable:
    """A hook of the caller's that does not say it keeps no state (as PowerSGD's does keep)."""
    def hook(state, bucket):  # no annotations: DDP checks them against GradBucket
        return inner(state, bucket)
    return hook


def scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def run(name: str, patch: Any = None, **kw: Any) -> None:
        d = os.path.join(root, name)
        real = dist.all_reduce
        if patch is not None:
            dist.all_reduce = patch
        try:
            results[name] = audit_workers.train(rank, alarm_dir=d, steps=5, audit_every=0,
                                                weights_every=0, **kw)
        except AuditError as e:
            results[name] = {"audit_error": str(e)}
        finally:
            dist.all_reduce = real
        dist.barrier()  # every rank has written its files before anyone reads
        results[name]["files"] = audit_workers.read_alarm_dir(d)

    # the caller's reduce hook: NaN into rank 2's bucket before the reduction at step 3, once
    run("once_hook", reduce_hook=faults.corrupt_allreduce(rank=2, calls={3}, element=0))
    # ... and on every call from step 3 on: the redo goes through the hook and is NaN again
    run("stays_hook", reduce_hook=faults.corrupt_allreduce(rank=2, calls=range(3, 99), element=0))
    # into rank 3's reduced bucket after the reduction from step 2 on: only rank 3 holds it
    run("stays_after", reduce_hook=_after_reduce(3, 2, persistent=True))
    # no hook (the fused path): NaN into rank 1's input of the all-reduce at step 3, once
    run("once_fused", patch=_bad_all_reduce(1, 3, persistent=False, into_input=True))
    # no hook: NaN into rank 1's result of every all-reduce from step 2 on
    run("stays_fused", patch=_bad_all_reduce(1, 2, persistent=True, into_input=False))
    # the one-off fault of once_hook, but every replay's loss is NaN: the data or the model
    run("data", reduce_hook=faults.corrupt_allreduce(rank=2, calls={3}, element=0),
        loss_fn=_replay_nan_loss)
    # the one-off fault through a hook that may keep state: not run twice, nobody cleared
    run("stateful", reduce_hook=_stateful(faults.corrupt_allreduce(rank=2, calls={3}, element=0)))
    # torch's fp16 compression of gradients past fp16's range: an overflow, not a fault
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    run("fp16_overflow", reduce_hook=fp16_compress_hook, loss_fn=_huge_loss)
    # the one-off fault, and rank 2's replay raises: every rank raises AuditError, no redo
    run("replay_fails", reduce_hook=faults.corrupt_allreduce(rank=2, calls={3}, element=0),
        loss_fn=_replay_fails_on_2)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-ddp-redo")
    per_rank = run_ranks(scenarios, NODES, timeout=240, root=str(root))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def _alarm(outs: list[dict[str, Any]], step: int) -> dict[str, Any]:
    a = outs[0]["alarm"]
    assert a is not None and all(o["alarm"] == a for o in outs), "the verdict must be collective"
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("nonfinite_reduced",
                                                                         step, False, [])
    for o in outs:  # the bad step was not applied
        assert o["weights_finite"] and o["weights_after"] == o["weights_before_alarm"]
    return a


@pytest.mark.parametrize("name", ["once_hook", "once_fused"])
def test_a_one_off_every_rank_saw_suspects_nobody(runs, name):
    """Before: candidates 0-3, a file on both nodes. The redone all-reduce is finite on every
    rank: it went bad once, on a path every rank's values took; no node is suspected."""
    outs = runs[name]
    a = _alarm(outs, 3)
    ev = a["evidence"]
    assert ev["ranks_seeing_nonfinite"] == [0, 1, 2, 3] and a["candidate_ranks"] == []
    assert ev["verdict"] == "transient" and "none is suspected" in ev["why"]
    redo = ev["redo"]
    assert redo["done"] and redo["redone"] and redo["inputs_reproduced"] is True
    assert redo["senders_finite_and_sum_finite"] and redo["redone_nonfinite_ranks"] == []
    (place,) = redo["places"]
    assert len(place["sent"]) == 4 and all(isinstance(v, float) for v in place["sent"].values())
    assert all(isinstance(v, float) for v in place["redone_all_reduce"].values())
    assert redo["redone_buckets"][0]["parameters"] > 1  # the whole bucket, not the bad element
    assert all(o["files"] == [] for o in outs)  # no alarm file on any node
    assert all(o["counters"]["reduction_transient"] == 1 for o in outs)


def test_a_fault_that_stays_in_every_ranks_redo_keeps_every_rank_a_candidate(runs):
    a = _alarm(runs["stays_hook"], 3)
    ev = a["evidence"]
    assert ev["verdict"] == "persistent" and a["candidate_ranks"] == [0, 1, 2, 3]
    assert ev["redo"]["redone_nonfinite_ranks"] == [0, 1, 2, 3]
    assert "again at rank(s) 0, 1, 2, 3" in ev["why"]
    assert sorted(f["node"] for f in runs["stays_hook"][0]["files"]) == ["n0", "n1"]


@pytest.mark.parametrize("name,rank,node,step", [("stays_after", 3, "n1", 2),
                                                 ("stays_fused", 1, "n0", 2)])
def test_a_fault_that_stays_where_it_shows_makes_that_rank_the_candidate(runs, name, rank, node,
                                                                         step):
    outs = runs[name]
    a = _alarm(outs, step)
    ev = a["evidence"]
    assert ev["ranks_seeing_nonfinite"] == [rank]
    assert ev["verdict"] == "persistent" and a["candidate_ranks"] == [rank]
    redo = ev["redo"]
    assert redo["redone_nonfinite_ranks"] == [rank]
    (place,) = redo["places"]
    assert [r for r, v in place["redone_all_reduce"].items() if v == "nan"] == [str(rank)]
    (rec,) = outs[0]["files"]
    assert (rec["node"], rec["settled"], rec["evidence"]["candidate_ranks"]) == (node, False,
                                                                                [rank])


def test_a_recomputed_gradient_that_is_not_finite_is_the_data(runs):
    a = _alarm(runs["data"], 3)
    ev = a["evidence"]
    assert ev["verdict"] == "data"
    redo = ev["redo"]
    assert redo["done"] and not redo["redone"] and not redo["senders_finite_and_sum_finite"]
    assert "the data or the model" in ev["why"]


def test_a_replay_that_fails_on_one_rank_raises_on_every_rank_without_a_redo(runs):
    for o in runs["replay_fails"]:
        assert "rank(s) 2" in o["audit_error"] and "redoes the reduction" in o["audit_error"]
        assert o["files"] == []


def test_a_hook_that_may_keep_state_is_not_run_twice(runs):
    """PowerSGD's error feedback would carry the bad step's NaN into a redo: a one-off would read
    as a fault that stays. A hook that does not say `stateless = True` is not redone."""
    a = _alarm(runs["stateful"], 3)
    ev = a["evidence"]
    assert ev["verdict"] == "unplaced" and not ev["redo"]["redone"]
    assert "may keep state" in ev["redo"]["why"]
    assert a["candidate_ranks"] == [0, 1, 2, 3]  # named as far as the evidence goes, unsettled


def test_fp16_compression_past_its_range_is_an_overflow_not_an_alarm(runs):
    """The sum is bounded by the dtype the hook sends (fp16), not the gradients' (fp32)."""
    for o in runs["fp16_overflow"]:
        assert o["alarm"] is None and o["files"] == []
        assert o["numeric"] is not None and "float16" in str(o["numeric"]), o["numeric"]
