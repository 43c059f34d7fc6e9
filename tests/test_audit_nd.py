"""The N-D parallel matrix's CI slice (benchmarks/bench_audit_nd.py is the campaign).

A Llama-style model (RMSNorm, rotary, causal SDPA, SwiGLU; tests/nd_workers.py) under the N-D
setups the other audit tests do not run: HSDP x TP on four nodes; and TP without sequence parallel (the norms left off the TP mesh), refused in one
line. Then one fault of each kind, each on another rank and setup: every one
caught, settled and pinned to its rank's node, the alarm file there only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_audit_nd  # noqa: E402
import nd_workers  # noqa: E402

# (FSDP2 x TP with SP and LP, and pipeline parallel with checkpointing, train healthy in
# tests/test_audit_tensor_parallel.py and tests/test_audit_pipeline.py)
# (per-block compile trains healthy in tests/test_audit_tp_compile.py, under inductor)
SETUPS = ["tp_no_sp", "hsdp_tp"]
FAULTS = (
    ("tp_sp_lp", nd_workers.Fault("forward", 3, call=2, persistent=True)),
    ("tp_sp_lp", nd_workers.Fault("weight", 0)),
    ("hsdp_tp", nd_workers.Fault("gradient", 5, call=25, bit=20)),
    ("pp_gpipe", nd_workers.Fault("gradient", 4, call=24, bit=20)),
)


@pytest.fixture(scope="module")
def result():
    return bench_audit_nd.run(SETUPS, [], 2, extra=FAULTS)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_nd_setup_trains_audited_without_an_alarm(result):
    assert sorted(result["healthy"]) == sorted(s for s in SETUPS if s not in nd_workers.REFUSED)
    for setup, h in result["healthy"].items():
        assert (h["steps"], h["audits"], h["alarms"], h["numeric"], h["errors"], h["files"]) \
            == (2, 2, 0, 0, [], 0), (setup, h)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp_without_sequence_parallel_is_refused_in_one_line(result):
    r = result["refused"]["tp_no_sp"]
    assert r["refused"] and "different device meshes" in r["line"], r


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_fault_of_each_kind_is_caught_settled_and_pinned(result):
    got = [(f["setup"], f["fault"]["kind"], f["check"], f["caught"], f["settled"], f["pinned"])
           for f in result["faults"]]
    # an exponent flip in a forward overflows downstream: the NaN/Inf check names the rank first
    assert got == [("tp_sp_lp", "forward", "nonfinite_local", True, True, True),
                   ("tp_sp_lp", "weight", "weights", True, True, True),
                   ("hsdp_tp", "gradient", "ring_replay", True, True, True),
                   ("pp_gpipe", "gradient", "ring_replay", True, True, True)], got
    assert not bench_audit_nd.failed(result)
