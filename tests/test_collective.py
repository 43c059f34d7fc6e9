"""The intra-node all-reduce check: real processes, gloo on the CPU (NCCL on GPUs where present)."""

from __future__ import annotations

import pytest
import torch

from screener.known_answer.collective.allreduce import CorruptReceive, run_collective
from screener.types import Outcome


@pytest.mark.slow
def test_allreduce_matches_the_known_sum_and_a_corrupted_receive_is_found_on_its_rank():
    # One run of three ranks (process start-up dominates on the CPU): rank 1's result is
    # overwritten after every all-reduce, ranks 0 and 2 must see exactly the known sum.
    r = run_collective(["cpu", "cpu", "cpu"], numel=1 << 14, iterations=3, timeout=120,
                       inject=CorruptReceive(rank=1, element=100, value=-1.0))
    assert r.backend == "gloo" and len(r.ranks) == 3
    assert [x["mismatches"] for x in r.ranks] == [0, 4, 0]  # warm-up + 3 timed iterations
    first = r.ranks[1]["first"]
    # Element 100 of the sum over ranks 1, 2 and 3: 100 * (1 + 2 + 3).
    assert first["element"] == 100 and first["expected"] == 600.0 and first["observed"] == -1.0
    assert not r.ok and r.mismatched == ("cpu",)
    v = r.verdicts()
    assert [x.outcome for x in v] == [Outcome.PASS, Outcome.SUSPECT, Outcome.PASS]
    assert v[1].reason == "collective_mismatch"
    assert r.bytes == 4 << 14 and r.seconds > 0 and r.busbw_gbps > 0
    assert abs(r.busbw_gbps - r.algbw_gbps * 4 / 3) < 1e-9


def test_one_device_has_nothing_to_reduce():
    r = run_collective(["cpu"], numel=16)
    assert r.ok and r.ranks == () and "one device" in r.detail


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_allreduce_across_the_gpus():
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    r = run_collective(devices, iterations=5)
    assert r.ok and r.backend == "nccl" and r.busbw_gbps > 1.0
