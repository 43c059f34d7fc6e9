"""Run a function in a real multi-process gloo process group on the CPU, one process per rank.

Each rank gets NODE_NAME from `nodes` (so several simulated nodes share this machine), LOCAL_RANK as
its index on that node, one intra-op thread, and a gloo group rendezvousing on a free loopback port.
The function runs as fn(rank, world_size, **kwargs); what it returns (picklable) comes back in rank
order. A rank that raises fails the run with its traceback; a run past `timeout` is killed.

Ranks are forked from this process, which has already imported torch, torch.distributed and
torch._dynamo (DDP's constructor imports it): a spawned rank spends seconds importing them again.
Forking is only safe from a single-threaded parent without a process group, so a parent that has
either (another test left a group or its threads behind) spawns instead: slower, same result.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import socket
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch._dynamo  # noqa: F401 - imported once here, inherited by forked ranks
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel  # noqa: F401 - same


def start_method() -> str:
    """"fork" when this process can fork safely (one thread, no process group), else "spawn"."""
    if "fork" not in mp.get_all_start_methods() or dist.is_initialized():
        return "spawn"
    gc.collect()  # a dead process group's threads go with its last reference
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return "spawn"
    # pytest-timeout's thread method parks a threading.Timer per test: a Python thread asleep on
    # a condition, holding no native lock, which a forked child never sees. Only other threads
    # (a process group's, torch's pools) make forking unsafe.
    timers = sum(1 for t in threading.enumerate() if isinstance(t, threading.Timer))
    if threads - timers == 1:
        return "fork"
    warnings.warn(f"ddp_util: this process runs {threads} threads, so ranks are spawned (slow); "
                  f"a test before this one left threads behind", stacklevel=3)
    return "spawn"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], nodes: Sequence[str], port: int, outdir: str,
           env: dict[str, str], kwargs: dict[str, Any]) -> None:
    world = len(nodes)
    node = nodes[rank]
    local = [r for r in range(world) if nodes[r] == node].index(rank)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(local), "NODE_NAME": node,
                       "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **env})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result: Any = ("ok", fn(rank, world, **kwargs))
    except BaseException:  # noqa: BLE001 - handed back to the test
        result = ("error", traceback.format_exc())
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable[..., Any], nodes: Sequence[str], *, timeout: float = 90.0,
              env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """fn(rank, world, **kwargs) on len(nodes) ranks; their return values in rank order."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(fn, list(nodes), free_port(), outdir, env or {},
                                               kwargs),
                                 nprocs=len(nodes), join=False, start_method=start_method())
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks still running after {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(len(nodes)):
            path = Path(outdir) / f"rank{rank}.pkl"
            if not path.exists():
                raise RuntimeError(f"rank {rank} left no result")
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


def agreed(outs: Sequence[dict[str, Any]], key: str) -> Any:
    """What every rank's result says under `key`, asserted to be the same, and set, on all."""
    values = [o[key] for o in outs]
    assert values[0] is not None and all(v == values[0] for v in values), values
    return values[0]
