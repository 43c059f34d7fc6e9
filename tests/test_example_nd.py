"""examples/train_nd.py end to end under screener launch -- torchrun: a small Llama-style model,
FSDP2 x tensor parallel on a (dp, tp) mesh, a TP group per simulated node (its healthy steps
are the audit tests' SP+LP runs, tests/test_audit_tensor_parallel.py). One bit flipped in rank 3's
embedding output at an audit step ends in exit 75, the alarm naming rank 3's TP group on its node, one alarm file there; under --pp 2 (pipeline parallel x FSDP2, a
pipeline per node) it names rank 3 at its stage. under --pp 2 --tp 2 it names the TP pair at its stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_util import free_port
from screener.alarmfile import AlarmRecord

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_nd.py"


def _launch(tmp_path: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "screener.launch", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(EXAMPLE), "--alarm-dir",
           str(tmp_path / "alarms"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("NODE_NAME", None)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_flip_in_the_nd_example_exits_75_naming_the_tp_group_and_its_node(tmp_path):
    proc = _launch(tmp_path, 6, "--nodes", "3", "--tp", "2", "--steps", "3",
                   "--inject", "flip:rank=3,step=2")
    out = proc.stdout
    assert proc.returncode == 75, out + proc.stderr[-3000:]
    assert "rank 3: fault in the embedding output element 5" in out
    node = "hyperpod-i-00000000000000002"
    assert (f"ALARM: SDC alarm ring_replay at step 2: rank 2, rank 3 on {node} "
            f"(i-00000000000000002) (settled)") in out, out + proc.stderr[-3000:]
    assert "exit code 75" in out
    (f,) = (tmp_path / "alarms").iterdir()
    rec = AlarmRecord.from_dict(json.loads(f.read_text()))
    assert (rec.check, rec.step, rec.settled, rec.suspect_ranks, rec.node) == (
        "ring_replay", 2, True, (2, 3), node)
    assert "terminate called" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_flip_under_pipeline_parallel_exits_75_naming_the_rank_at_its_stage(tmp_path):
    """--pp 2 --tp 1: a pipeline per node (dp-major ranks), 1F1B; rank 3 is stage 1 of
    pipeline 1, on the second node."""
    proc = _launch(tmp_path, 6, "--nodes", "3", "--tp", "1", "--pp", "2", "--steps", "3",
                   "--audit-every", "2", "--inject", "flip:rank=3,step=2")
    out = proc.stdout
    assert proc.returncode == 75, out + proc.stderr[-3000:]
    assert "mesh (dp, pp) = (3, 2); pipelines [[0, 1], [2, 3], [4, 5]]" in out
    node = "hyperpod-i-00000000000000002"
    assert (f"ALARM: SDC alarm ring_replay at step 2: rank 3 on {node} "
            f"(i-00000000000000002) (settled)") in out, out + proc.stderr[-3000:]
    (f,) = (tmp_path / "alarms").iterdir()
    rec = AlarmRecord.from_dict(json.loads(f.read_text()))
    assert (rec.check, rec.suspect_ranks, rec.node) == ("ring_replay", (3,), node)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_flip_under_pipeline_and_tensor_parallel_exits_75_naming_the_tp_pair_at_its_stage(
        tmp_path):
    """--pp 2 --tp 2: twelve ranks, a dp row (both stages, each a TP pair) per node; rank 7 is
    stage 1 of dp row 1, TP rank 1, on the second node: its partner, rank 6, computes with it."""
    proc = _launch(tmp_path, 12, "--nodes", "3", "--tp", "2", "--pp", "2", "--steps", "3",
                   "--audit-every", "2", "--inject", "flip:rank=7,step=2")
    out = proc.stdout
    assert proc.returncode == 75, out + proc.stderr[-3000:]
    assert "mesh (dp, pp, tp) = (3, 2, 2)" in out, out
    node = "hyperpod-i-00000000000000002"
    assert (f"ALARM: SDC alarm ring_replay at step 2: rank 6, rank 7 on {node} "
            f"(i-00000000000000002) (settled)") in out, out + proc.stderr[-3000:]
    (f,) = (tmp_path / "alarms").iterdir()
    rec = AlarmRecord.from_dict(json.loads(f.read_text()))
    assert (rec.check, rec.suspect_ranks, rec.node) == ("ring_replay", (6, 7), node)


@pytest.mark.slow
def test_stages_that_do_not_split_the_blocks_evenly_are_refused_in_one_line():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--pp", "3"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("--pp: the 2 blocks split evenly over the stages")
