"""The HBM pattern test on host memory (its CPU twin) and on a GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from screener.errors import BadInputError
from screener.health.sources.hbm import PATTERNS, hbm_test, stuck_bit
from screener.types import Outcome


def test_clean_memory_passes_every_pattern():
    r = hbm_test("cpu", max_bytes=4 << 20, chunk_bytes=1 << 20)
    assert r.ok and r.bytes_tested == 4 << 20 and r.patterns == PATTERNS
    assert r.verdict().outcome == Outcome.PASS and r.bandwidth_gbps > 0


def test_a_stuck_bit_is_found_located_and_confirmed():
    r = hbm_test("cpu", max_bytes=4 << 20, chunk_bytes=1 << 20,
                 inject=stuck_bit(chunk=2, element=1000, bit=7, value=1))
    # Stuck at 1: every pattern whose bit 7 of that element is 0 sees it.
    assert not r.ok and r.confirmed
    first = r.errors[0]
    assert first["pattern"] == "zeros" and first["chunk"] == 2
    assert first["offset_bytes"] == ((2 << 20) + 1000 * 4)
    assert (first["expected"], first["observed"]) == ("0x00000000", "0x00000080")
    assert {e["pattern"] for e in r.errors} >= {"zeros", "checker_5"}
    v = r.verdict()
    assert v.outcome == Outcome.SUSPECT and v.reason == "hbm_mismatch"
    assert v.evidence["confirmed"] is True


def test_a_fault_that_does_not_repeat_is_reported_unconfirmed():
    fired = []

    def once(chunks, pattern):
        if not fired and pattern == "address":
            fired.append(pattern)
            chunks[0][5] = 12345
    r = hbm_test("cpu", max_bytes=1 << 20, chunk_bytes=1 << 20, inject=once)
    assert r.mismatches == 1 and not r.confirmed
    assert r.errors[0]["expected"] == "0x00000005" and r.errors[0]["observed"] == "0x00003039"


def test_nothing_tested_is_inconclusive_not_a_pass():
    r = hbm_test("cpu", max_bytes=0)
    assert r.bytes_tested == 0
    v = r.verdict()
    assert v.outcome == Outcome.INCONCLUSIVE and v.reason == "hbm_untested"


def test_bad_arguments_are_bad_input():
    with pytest.raises(BadInputError, match="fraction"):
        hbm_test("cpu", fraction=0.99)
    with pytest.raises(BadInputError, match="pattern"):
        hbm_test("cpu", patterns=("stripes",))


@pytest.mark.gpu
def test_gpu_memory_passes_and_finds_a_stuck_bit():
    r = hbm_test("cuda:0", fraction=0.2, max_bytes=2 << 30)
    assert r.ok and r.bytes_tested > 0
    r = hbm_test("cuda:0", max_bytes=64 << 20, chunk_bytes=16 << 20,
                 inject=stuck_bit(chunk=1, element=77, bit=3, value=0))
    assert not r.ok and r.confirmed and r.errors[0]["chunk"] == 1
    assert torch.cuda.memory_allocated() < 64 << 20  # released afterwards
