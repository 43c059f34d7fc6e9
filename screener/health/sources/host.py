"""The host adapter: everything the screener asks the operating system through psutil.

psutil has this one importer (tests/test_imports.py holds it to that), so the rest of the package
sees small typed functions and plain values, never a psutil object or a psutil exception:

- host checks for the probes: required mounts, memory headroom, disk headroom (`read_host`; what
  is too little is decided by `screener.health.verdict.rules`; the psutil module is passed in, default the
  real one, like every other client);
- facts the agent needs: when the host booted, how much memory is available, our own PIDs;
- the screen workers' processes, named by PID *and* start time (`Proc`), so that a PID the kernel
  has reused for someone else's process is never signalled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Optional

import psutil

from screener.settings.health import ProbeConfig
from screener.health.verdict.snapshot import DiskUsage, HostSnapshot, MountCheck

# Two readings of one process's start time differ by float rounding only; a reused PID's differs by
# at least the kernel's clock tick (10 ms).
_SAME_START_S = 0.01


def read_host(config: ProbeConfig, psutil_module: Optional[Any] = None) -> HostSnapshot:
    """One look at the host. Paths that cannot be read are recorded in ``errors``."""
    ps = psutil if psutil_module is None else psutil_module
    errors: dict[str, str] = {}
    mem = ps.virtual_memory()
    mounts: tuple[MountCheck, ...] = ()
    if config.required_mounts:
        try:
            mounted = {os.path.normpath(p.mountpoint) for p in ps.disk_partitions(all=True)}
        except OSError as e:
            # We could not look: that is our failure, not a missing mount, so no MountChecks.
            errors["mounts"] = str(e)
        else:
            mounts = tuple(MountCheck(path=m, present=os.path.normpath(m) in mounted)
                           for m in config.required_mounts)
    disks = []
    for path in config.disk_paths:
        try:
            usage = ps.disk_usage(path)
        except OSError as e:
            errors[f"disk:{path}"] = str(e)
            continue
        disks.append(DiskUsage(path=path, total=int(usage.total), free=int(usage.free)))
    return HostSnapshot(memory_total=int(mem.total), memory_available=int(mem.available),
                        mounts=mounts, disks=tuple(disks), errors=errors)


def boot_time() -> float:
    """When the host booted (unix seconds): an Xid from before it was recovered by the reboot."""
    return float(psutil.boot_time())


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> Optional[str]:
    """The kernel's id of this boot (a new one at every boot, whatever the wall clock does), or
    None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(128).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def available_memory() -> int:
    """Bytes of RAM a new allocation can get without swapping (the host-memory HBM test's budget)."""
    return int(psutil.virtual_memory().available)


def own_pids() -> set[int]:
    """This process and every process below it (our known-answer children): not a job's."""
    me = psutil.Process(os.getpid())
    pids = {me.pid}
    try:
        pids.update(c.pid for c in me.children(recursive=True))
    except psutil.Error:
        pass
    return pids


@dataclass(frozen=True)
class Proc:
    """One process, named by its PID and its start time (unix seconds) together."""

    pid: int
    create_time: float


def _proc(p: psutil.Process) -> Optional[Proc]:
    try:
        return Proc(p.pid, p.create_time())
    except psutil.Error:
        return None


def find_process(pid: int, create_time: Optional[float] = None) -> Optional[Proc]:
    """The process with this PID, when it runs (and started at `create_time`, when given)."""
    try:
        found = _proc(psutil.Process(pid))
    except psutil.Error:
        return None
    if found is None or (create_time is not None
                         and abs(found.create_time - float(create_time)) >= _SAME_START_S):
        return None
    return found


def descendants(pid: int) -> list[Proc]:
    """Every process below `pid` (children in sessions of their own included); [] when it is gone."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in map(_proc, children) if p is not None]


def tagged_processes(env_var: str, values: Collection[str]) -> list[Proc]:
    """The processes whose environment sets `env_var` to one of `values`, this one excepted.

    Processes whose environment we may not read (another user's) are skipped: ours are readable.
    """
    me = os.getpid()
    found = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            tag = p.environ().get(env_var)
        except (psutil.Error, OSError):
            continue
        if tag in values:
            proc = _proc(p)
            if proc is not None:
                found.append(proc)
    return found


def kill(procs: Iterable[Proc], *, wait_s: float = 0.0) -> None:
    """SIGKILL each process that is still the one named (a reused PID is left alone), then wait
    up to `wait_s` seconds for them to be gone. Those already gone are no error."""
    live = []
    for proc in procs:
        try:
            p = psutil.Process(proc.pid)
            if abs(p.create_time() - proc.create_time) >= _SAME_START_S:
                continue
            p.kill()
            live.append(p)
        except psutil.Error:
            pass
    if live and wait_s > 0:
        psutil.wait_procs(live, timeout=wait_s)
