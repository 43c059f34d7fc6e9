"""The intra-node collective check: all-reduce across the node's GPUs against a known sum.

Each rank fills a buffer with an integer pattern that depends on its rank, all-reduces it (NCCL on
GPUs, gloo on the CPU) and compares the result element by element with the sum it must be. The
values are small integers held exactly in float32 (every partial sum stays below 2**24), so the
right answer is exact whatever order the reduction adds in, and any difference is corruption on
the way (a link, a GPU's memory, a reduction kernel). It also times the all-reduce and reports the
bandwidth the way nccl-tests does: algbw = bytes / time and busbw = algbw * 2 (n - 1) / n.

`run_group` starts one process per rank with a process group between them; the peer burn-in and
the fire drill use it too (with simulated nodes on the CPU).
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.atomicfile import write_atomic
from screener.errors import BadInputError, ScreenerError
from screener.types import KnownAnswerReason, Outcome, Verdict, node_name

# torch is imported inside the functions that run ranks: the burn-in imports this module at its
# top and the CLI must start without torch; in a rank's process (_entry) it must come after
# OMP_NUM_THREADS and the rendezvous variables are set.

PATTERN_PERIOD = 4096  # values (i mod 4096) * (rank + 1): with 8 ranks the sum is < 2**24
DEFAULT_NUMEL = 32 * 1024 * 1024  # 128 MiB of float32 per GPU
CPU_NUMEL = 1 << 18  # 1 MiB on the CPU: a check of the path, not a bandwidth figure


# --- running a function in a process group -------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], nodes: Sequence[str], devices: Sequence[str],
           backend: str, port: int, outdir: str, kwargs: Mapping[str, Any], timeout: float) -> None:
    world = len(nodes)
    node = nodes[rank]
    local = [r for r in range(world) if nodes[r] == node].index(rank)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(local), "NODE_NAME": node,
                       "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = devices[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    result: Any
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            result = ("ok", fn(rank, world, device, **dict(kwargs)))
        finally:
            # the reference cycles of a DDP model, its comm hook and an Auditor hold the gloo
            # group alive past its destroy, which then aborts the process at exit ("terminate
            # called without an active exception"): collected first (see docs/audit.md, Teardown)
            gc.collect()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - handed back to the parent
        result = ("error", traceback.format_exc())
    # whole or absent: a parent that finds the file reads a complete result
    write_atomic(Path(outdir) / f"rank{rank}.pkl", pickle.dumps(result))


def run_group(fn: Callable[..., Any], devices: Sequence[str], *,
              nodes: Optional[Sequence[str]] = None, backend: Optional[str] = None,
              timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """fn(rank, world, device, **kwargs) in one process per device, with a process group.

    nodes: each rank's NODE_NAME (simulated nodes on one machine; default: this node for all).
    backend: nccl for CUDA devices, gloo otherwise, unless given. Returns the ranks' return values
    in rank order; raises ScreenerError with the traceback if a rank raised, or on the timeout.
    """
    import torch.multiprocessing as mp

    if not devices:
        raise BadInputError("no devices for the process group")
    if nodes is None:
        me = node_name()
        nodes = [me] * len(devices)
    if len(nodes) != len(devices):
        raise BadInputError("one node name per device")
    if backend is None:
        backend = "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"
    with tempfile.TemporaryDirectory(prefix="screener-group-") as outdir:
        ctx = mp.start_processes(_entry, args=(fn, list(nodes), list(devices), backend, free_port(),
                                               outdir, kwargs, timeout),
                                 nprocs=len(devices), join=False, start_method="spawn")
        deadline = time.monotonic() + timeout + 30
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise ScreenerError(f"process group still running after {timeout:g} s")
        except mp.ProcessExitedException as e:
            raise ScreenerError(f"a rank of the process group died: {e}") from e
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        out = []
        for rank in range(len(devices)):
            path = Path(outdir) / f"rank{rank}.pkl"
            if not path.exists():
                raise ScreenerError(f"rank {rank} of the process group left no result")
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                raise ScreenerError(f"rank {rank} failed:\n{value}")
            out.append(value)
        return out


# --- the check ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorruptReceive:
    """Fault injection for drills and tests: after each all-reduce, rank `rank` overwrites element
    `element` of its result with `value` (a bad receive path or memory on that GPU)."""

    rank: int
    element: int = 0
    value: float = -1.0


def known_sum_rank(rank: int, world: int, device: str, *, numel: int, iterations: int = 5,
                   warmup: int = 1, inject: Optional[CorruptReceive] = None,
                   group: Any = None) -> dict[str, Any]:
    """One rank of the check, inside an initialised process group (collective: every rank)."""
    import torch
    import torch.distributed as dist

    dev = torch.device(device)
    index = torch.arange(numel, device=dev, dtype=torch.int64) % PATTERN_PERIOD
    base = (index * (rank + 1)).to(torch.float32)
    expected = (index * (world * (world + 1) // 2)).to(torch.float32)
    del index
    buf = torch.empty_like(base)
    mismatches = 0
    first: Optional[dict[str, Any]] = None
    seconds = 0.0

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for it in range(warmup + iterations):
        buf.copy_(base)
        sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        sync()
        dt = time.perf_counter() - t0
        if inject is not None and inject.rank == rank:
            buf[inject.element % numel] = inject.value
        bad = torch.ne(buf, expected)
        n = int(bad.sum())
        if it >= warmup:
            seconds += dt
        if n:
            mismatches += n
            if first is None:
                i = int(bad.nonzero()[0, 0])
                first = {"iteration": it, "element": i, "expected": float(expected[i]),
                         "observed": float(buf[i])}
    # The slowest rank sets the pace: everyone reports the maximum time.
    t = torch.tensor([seconds], dtype=torch.float64,
                     device=dev if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return {"rank": rank, "device": device, "mismatches": mismatches, "first": first,
            "seconds": float(t.item()), "iterations": iterations, "bytes": numel * 4}


@dataclass(frozen=True)
class CollectiveResult:
    """The check's outcome: per-rank mismatches and the all-reduce bandwidth."""

    backend: str
    devices: tuple[str, ...]
    ranks: tuple[Mapping[str, Any], ...]
    bytes: int
    seconds: float  # timed all-reduces, slowest rank
    iterations: int
    detail: str = ""
    nodes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def mismatched(self) -> tuple[str, ...]:
        return tuple(r["device"] for r in self.ranks if r["mismatches"])

    @property
    def ok(self) -> bool:
        return not self.mismatched

    @property
    def algbw_gbps(self) -> float:
        return self.bytes * self.iterations / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def busbw_gbps(self) -> float:
        n = len(self.ranks)
        return self.algbw_gbps * 2 * (n - 1) / n if n > 1 else 0.0

    def verdicts(self) -> tuple[Verdict, ...]:
        """One per device: suspect where the reduced result was wrong."""
        out = []
        for r in self.ranks:
            if r["mismatches"]:
                out.append(Verdict(device=r["device"], outcome=Outcome.SUSPECT,
                                   reason=KnownAnswerReason.COLLECTIVE_MISMATCH, job="allreduce",
                                   expected=(r["first"] or {}).get("expected"),
                                   observed=(r["first"] or {}).get("observed"),
                                   evidence={"mismatches": r["mismatches"], "first": r["first"],
                                             "backend": self.backend}))
            else:
                out.append(Verdict(device=r["device"], outcome=Outcome.PASS, job="allreduce"))
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "devices": list(self.devices), "ok": self.ok,
                "mismatched": list(self.mismatched), "bytes": self.bytes,
                "iterations": self.iterations, "seconds": round(self.seconds, 6),
                "algbw_gbps": round(self.algbw_gbps, 3), "busbw_gbps": round(self.busbw_gbps, 3),
                "ranks": [dict(r) for r in self.ranks], "detail": self.detail}


def _check_fn(rank: int, world: int, device: str, **kw: Any) -> dict[str, Any]:
    return known_sum_rank(rank, world, device, **kw)


def run_collective(devices: Sequence[str], *, numel: Optional[int] = None, iterations: int = 5,
                   inject: Optional[CorruptReceive] = None, timeout: float = 300.0) -> CollectiveResult:
    """All-reduce across `devices` (one process each; "cpu" may repeat) against the known sum.

    With one GPU there is nothing to reduce across: the result has no ranks to blame and a
    bandwidth of 0, and the detail says so.
    """
    devices = list(devices)
    if numel is None:
        numel = DEFAULT_NUMEL if all(d.startswith("cuda") for d in devices) else CPU_NUMEL
    if numel < 1 or iterations < 1:
        raise BadInputError("collective check: numel and iterations must be >= 1")
    backend = "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"
    if len(devices) < 2:
        return CollectiveResult(backend, tuple(devices), (), numel * 4, 0.0, iterations,
                                detail="one device: no all-reduce to check")
    ranks = run_group(_check_fn, devices, backend=backend, timeout=timeout, numel=numel,
                      iterations=iterations, inject=inject)
    return CollectiveResult(backend=backend, devices=tuple(devices), ranks=tuple(ranks),
                            bytes=numel * 4, seconds=max(r["seconds"] for r in ranks),
                            iterations=iterations)
