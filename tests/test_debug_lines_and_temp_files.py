"""-vv adds the debug lines a person chasing a problem needs (which store, which golden, each
child process); the examples leave nothing behind in the temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_util import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_vv_says_which_golden_and_which_child(tmp_path):
    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "screener.cli", *flags, "kat", "run",
                               "--device", "cpu", "--job", "gemm-fp32", "--repeat", "1",
                               "--golden-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    quiet, loud = run("-v"), run("-vv")
    assert quiet.returncode == loud.returncode == 3  # no golden in an empty folder
    assert "DEBUG" not in quiet.stderr
    assert "DEBUG screener.known_answer: child for cpu: pid" in loud.stderr
    assert "DEBUG screener.known_answer: child for cpu ended: ok" in loud.stderr
    assert f"golden for gemm-fp32 on platform" in loud.stderr and str(tmp_path) in loud.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ddp_example_leaves_no_temporary_folders(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": str(tmp)}
    env.pop("NODE_NAME", None)
    env.pop("SCREENER_ALARM_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "screener.launch", "--nproc-per-node", "3",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(ROOT / "examples" / "train_ddp.py"), "--nodes", "3", "--steps", "3",
                           "--audit-every", "2", "--ckpt-every", "2"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "removed" in proc.stdout
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("screener-")]
