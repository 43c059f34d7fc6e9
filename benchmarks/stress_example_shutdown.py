"""Healthy torchrun runs of examples/train_ddp.py in a row: does any of them die at shutdown?

A healthy job that ends with SIGABRT ("terminate called without an active exception") fails its
Job like a crash would. This runs the example N times (default 30) under torchrun on simulated
nodes, with no fault, and counts the runs whose exit code is not 0 and the runs whose output holds
"terminate called" or a worker killed by a signal. Exit 0 only when every run was clean.

    python benchmarks/stress_example_shutdown.py                     # 30 runs, 6 ranks, 3 nodes
    python benchmarks/stress_example_shutdown.py --runs 10 --steps 20 --launcher screener
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIGNAL = re.compile(r"exitcode\s*:\s*-\d+|Signal \d+|terminate called")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(args: argparse.Namespace) -> tuple[int, bool, float, str]:
    torchrun = ["--nproc-per-node", str(args.nproc), "--master-addr", "127.0.0.1",
                "--master-port", str(_free_port())]
    launcher = [sys.executable, "-m", "screener.launch"] if args.launcher == "screener" \
        else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, *torchrun, str(ROOT / "examples" / "train_ddp.py"), "--nodes",
           str(args.nodes), "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("NODE_NAME", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=args.timeout)
    text = proc.stdout + proc.stderr
    return proc.returncode, bool(SIGNAL.search(text)), time.perf_counter() - t0, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--nproc", type=int, default=6)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--launcher", choices=("torchrun", "screener"), default="torchrun")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep", type=Path, default=None, help="write each failing run's output here")
    args = p.parse_args(argv)
    bad_exit = bad_signal = 0
    times = []
    for i in range(1, args.runs + 1):
        code, signalled, seconds, text = one_run(args)
        times.append(seconds)
        bad_exit += code != 0
        bad_signal += signalled
        print(f"run {i:3d}: exit {code}{'  SIGNAL/ABORT' if signalled else ''}  {seconds:.1f} s",
              flush=True)
        if (code != 0 or signalled) and args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / f"run{i}.log").write_text(text)
    clean = args.runs - max(bad_exit, bad_signal)
    print(f"\n{clean} of {args.runs} healthy runs clean ({bad_exit} with a non-zero exit, "
          f"{bad_signal} with a signal or 'terminate called'); median run "
          f"{sorted(times)[len(times) // 2]:.1f} s; {args.nproc} ranks on {args.nodes} simulated "
          f"nodes, {args.steps} steps, launcher {args.launcher}")
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
