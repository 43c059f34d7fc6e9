"""FSDP2 x tensor parallel with every transformer block compiled on its own (issue 34.1), on
real gloo ranks of three simulated nodes: (dp = 3, tp = 2), a TP group per node. The blocks run
inductor's code in the training step and in every replay; a fault lands inside a compiled
graph (tests/tp_compile_workers.py). One process group, the model compiled once, every case
in turn: compile is the cost.
"""

from __future__ import annotations

import pytest

from ddp_util import agreed, run_ranks
import tp_compile_workers as workers

pytestmark = pytest.mark.timeout(300)

NODES = ["n1", "n1", "n2", "n2", "n3", "n3"]
CASES = (
    ("healthy", None, 3),
    # a mantissa bit of the Colwise output shard of rank 3 (node n2), block 0, at step 1: it
    # reaches rank 2 through the RowwiseParallel all-reduce, so the TP group computes it as one
    ("forward", workers.Armed(3, 1, site=1), 2),
    # the same bit of the gradient leaving block 0 on rank 3, into its rows of the
    # RowwiseParallel embedding: only rank 3's gradient shard changes
    ("gradient", workers.Armed(3, 1, site=0, backward=True, element=None), 2),
)


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-tp-compile")
    per_rank = run_ranks(workers.scenarios, NODES, timeout=280, root=str(root), how="wrap",
                         cases=CASES)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@pytest.mark.slow
def test_per_block_compile_under_fsdp_x_tp_is_audited_without_an_alarm(compiled_runs):
    # the blocks really ran compiled: one graph per block, no graph break, and no replay
    # recompiled one (a recompiled graph could round differently from the step's)
    for d in compiled_runs["dynamo"]:
        assert d == {"unique_graphs": 2, "graph_breaks": 0}, d
    for o in compiled_runs["healthy"]:
        assert (o["refused"], o["alarm"], o["numeric"], o["steps_done"]) == (None, None, None,
                                                                             3), o
        assert o["counters"]["audits"] == 3 and o["counters"]["weight_checks"] == 3
        assert o["counters"]["self_checks"] == 1 and not o["files"]


@pytest.mark.slow
@pytest.mark.parametrize("case, ranks", [("forward", [2, 3]), ("gradient", [3])])
def test_a_flip_inside_a_compiled_block_is_settled_on_its_tp_group_or_rank(compiled_runs, case,
                                                                          ranks):
    outs = compiled_runs[case]
    fired = [len(o["fired"]) for o in outs]
    assert fired == [0, 0, 0, 1, 0, 0], fired  # the fault landed once, on rank 3
    assert all(o["numeric"] is None for o in outs), [o["numeric"] for o in outs]
    a = agreed(outs, "alarm")
    assert (a["check"], a["step"], a["settled"], a["suspect_ranks"]) == ("ring_replay", 1, True,
                                                                         ranks)
    assert [n["node"] for n in a["suspect_nodes"]] == ["n2"]
    assert [f["node"] for f in outs[0]["files"]] == ["n2"]
    assert all(o["counters"]["audits"] == 1 for o in outs)  # step 0 clean, step 1 caught
