"""examples/train_ddp.py end to end under torchrun: three simulated nodes, a weight bit flipped on
one rank, the alarm printed, one alarm file on that rank's node, and exit code 75 from the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_util import free_port
from screener.types import AlarmRecord

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_example_under_torchrun_shows_alarm_file_and_exit_code(tmp_path):
    alarms = tmp_path / "alarms"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "examples" / "train_ddp.py"), "--nodes", "3", "--steps", "8",
           "--audit-every", "5", "--weights-every", "2", "--ckpt-every", "2",
           "--ckpt-dir", str(tmp_path / "ckpt"), "--alarm-dir", str(alarms),
           "--inject", "weight:rank=2,step=3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("NODE_NAME", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    out = proc.stdout
    assert proc.returncode != 0, out  # torchrun itself exits 1 when a worker fails
    assert "ALARM: SDC alarm weights at step 4: rank 2" in out, out + proc.stderr[-3000:]
    assert "exit code 75" in out
    assert "exitcode  : 75" in proc.stderr  # torchrun's report of the worker's own exit code
    (f,) = alarms.iterdir()
    rec = AlarmRecord.from_dict(json.loads(f.read_text()))
    node = "hyperpod-i-00000000000000003"
    assert (rec.check, rec.step, rec.settled, rec.suspect_ranks, rec.node) == (
        "weights", 4, True, (2,), node)
    assert rec.suspect_nodes[0].instance_id == "i-00000000000000003"
    assert f"roll back to: {tmp_path / 'ckpt' / 'step000002.pt'}" in out
