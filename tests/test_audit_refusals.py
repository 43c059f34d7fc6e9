"""What the audit refuses or raises alike on every rank instead of guessing or aborting: pipeline
stages that do not hold the same model, gathers of different sizes, ranks at different steps.
Real gloo ranks on simulated nodes (tests/audit_setup_workers.py).
"""

from __future__ import annotations

import pytest

from ddp_util import agreed, run_ranks
import audit_setup_workers

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_pipeline_stages_each_sharded_on_their_row_are_refused_not_aborted():
    outs = run_ranks(audit_setup_workers.pipeline_stages, ["a", "a", "b", "b"], timeout=240)
    line = agreed(outs, "refused")
    assert all(o["exit"] == 2 and o["lines"] == 1 for o in outs)
    assert "do not hold the same model" in line and "pipeline" in line
    assert "rank(s) 0, 1" in line and "rank(s) 2, 3" in line


@pytest.mark.slow
def test_a_gather_of_different_sizes_is_an_audit_error_on_every_rank_not_an_abort():
    outs = run_ranks(audit_setup_workers.uneven_gather, ["a", "b", "c"], timeout=120)
    err = agreed(outs, "error")
    assert all(o["exit"] == 1 for o in outs)
    assert "different sizes" in err and "{0: (3, 'int64'), 1: (4, 'int64'), 2: (5, 'int64')}" \
        in err


@pytest.mark.slow
def test_ranks_at_different_steps_raise_alike_instead_of_gathering_different_widths():
    """Rank 0 calls check_gradients at an audit step, the others at a plain one: the step's
    head has one width on every step and its tag carries the step, so every rank raises."""
    outs = run_ranks(audit_setup_workers.steps_apart, ["a", "b", "c"], timeout=120)
    err = agreed(outs, "error")
    assert all(o["exit"] == 1 for o in outs)
    assert "different steps ([1, 10])" in err
