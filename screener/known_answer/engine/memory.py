"""What the host's memory and our cgroup say: memory a CPU job may use, and OOM kills.

The child reads `available_bytes` before a job allocates (a job that cannot fit is bad input,
not a crash); the parent reads `oom_kills` before and after a child dies of SIGKILL, to say in
the verdict that the kernel's OOM killer, not the device, ended it.
"""

from __future__ import annotations

import os
from typing import Optional


def cgroup_dir() -> Optional[str]:
    """This process's cgroup v2 folder, or None (cgroup v1, or not mounted)."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            for line in f:
                if line.startswith("0::"):
                    d = "/sys/fs/cgroup" + line[3:].strip()
                    return d if os.path.isdir(d) else None
    except OSError:
        pass
    return None


def _mem_available() -> Optional[float]:
    """/proc/meminfo's MemAvailable in bytes, or None."""
    free: Optional[float] = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return free


def available_bytes() -> Optional[float]:
    """Memory a CPU job may use: the smaller of MemAvailable and what the cgroup's limit
    leaves; None when neither can be read."""
    free = _mem_available()
    cg = cgroup_dir()
    if cg is not None:
        try:
            with open(os.path.join(cg, "memory.max"), encoding="ascii") as f:
                limit = f.read().strip()
            with open(os.path.join(cg, "memory.current"), encoding="ascii") as f:
                used = float(f.read().strip())
            if limit != "max":
                left = float(limit) - used
                free = left if free is None else min(free, left)
        except (OSError, ValueError):
            pass
    return free


def oom_kills() -> Optional[int]:
    """The oom_kill count of our cgroup's memory.events (None when it cannot be read)."""
    cg = cgroup_dir()
    if cg is None:
        return None
    try:
        with open(os.path.join(cg, "memory.events"), encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None
