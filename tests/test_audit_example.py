"""examples/train_ddp.py end to end under screener launch -- torchrun: three simulated nodes, one bit
flipped in one activation of one rank at an audit step, the alarm printed, one alarm file on that
rank's node, the checkpoint to roll back to, and exit code 75 from the job itself (not torchrun's 1).
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_flip_is_caught_and_the_job_exits_75(tmp_path):
    alarms = tmp_path / "alarms"
    cmd = [sys.executable, "-m", "screener.launch", "--nproc-per-node", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "examples" / "train_ddp.py"), "--nodes", "3", "--steps", "8",
           "--audit-every", "5", "--weights-every", "2", "--ckpt-every", "2",
           "--ckpt-dir", str(tmp_path / "ckpt"), "--alarm-dir", str(alarms),
           "--inject", "flip:rank=2,step=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("NODE_NAME", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    out = proc.stdout
    assert proc.returncode == 75, out + proc.stderr[-3000:]
    assert "rank 2 step 5: fault in bmm output element 9" in out
    assert "ALARM: SDC alarm ring_replay at step 5: rank 2" in out, out + proc.stderr[-3000:]
    assert "exit code 75" in out
    (f,) = alarms.iterdir()
    rec = AlarmRecord.from_dict(json.loads(f.read_text()))
    node = "hyperpod-i-00000000000000003"
    assert (rec.check, rec.step, rec.settled, rec.suspect_ranks, rec.node) == (
        "ring_replay", 5, True, (2,), node)
    assert rec.suspect_nodes[0].instance_id == "i-00000000000000003"
    # last clean audit: step 4 (the first steps of a start are all audited, cadence.py), so
    # the latest verified checkpoint before the fault
    assert f"roll back to: {tmp_path / 'ckpt' / 'step000004.pt'}" in out
    assert "terminate called" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fsdp_example_catches_a_flip_without_a_batch_fn_and_the_job_exits_75(tmp_path):
    """examples/train_fsdp.py: FSDP2 with bf16 mixed precision, a plain data loader (no batch_fn),
    three simulated nodes of one rank each under screener launch -- torchrun."""
    alarms = tmp_path / "alarms"
    cmd = [sys.executable, "-m", "screener.launch", "--nproc-per-node", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "examples" / "train_fsdp.py"), "--nodes", "3", "--steps", "8",
           "--audit-every", "5", "--weights-every", "2", "--alarm-dir", str(alarms),
           "--inject", "flip:rank=1,step=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("NODE_NAME", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    out = proc.stdout
    assert proc.returncode == 75, out + proc.stderr[-3000:]
    assert "rank 1 step 5: fault in mm output element 5" in out
    assert "ALARM: SDC alarm ring_replay at step 5: rank 1" in out, out + proc.stderr[-3000:]
    (f,) = alarms.iterdir()
    rec = AlarmRecord.from_dict(json.loads(f.read_text()))
    assert (rec.check, rec.step, rec.settled, rec.suspect_ranks, rec.node) == (
        "ring_replay", 5, True, (1,), "hyperpod-i-00000000000000002")
    assert "terminate called" not in proc.stderr
