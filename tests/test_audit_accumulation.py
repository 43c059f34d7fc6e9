"""Gradient accumulation as training loops really do it (FSDP2 on every micro-step or under
set_requires_gradient_sync(False), HSDP under set_requires_all_reduce(False), DDP with and
without no_sync): audited without an alarm, and a forward fault pinned under each. Real gloo
ranks on simulated nodes (tests/audit_setup_workers.py).
"""

from __future__ import annotations

import pytest

from ddp_util import agreed, run_ranks
import audit_setup_workers

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-accumulation")
    per_rank = run_ranks(audit_setup_workers.accumulation, ["n1", "n1", "n2", "n2", "n3", "n3"],
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
    a = agreed(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 5,
                                                                         True, [3])
    assert [f["node"] for f in outs[0]["files"]] == ["n2"]
