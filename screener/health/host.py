"""Host checks through psutil: required mounts, memory headroom, disk headroom.

Reads only; what is too little is decided by `screener.health.rules`. The psutil module is passed
in (default: the real one) like every other client.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from screener.settings.health import ProbeConfig
from screener.health.snapshot import DiskUsage, HostSnapshot, MountCheck


def read_host(config: ProbeConfig, psutil_module: Optional[Any] = None) -> HostSnapshot:
    """One look at the host. Paths that cannot be read are recorded in ``errors``."""
    if psutil_module is None:
        import psutil as psutil_module
    errors: dict[str, str] = {}
    mem = psutil_module.virtual_memory()
    mounts: tuple[MountCheck, ...] = ()
    if config.required_mounts:
        try:
            mounted = {os.path.normpath(p.mountpoint)
                       for p in psutil_module.disk_partitions(all=True)}
        except OSError as e:
            # We could not look: that is our failure, not a missing mount, so no MountChecks.
            errors["mounts"] = str(e)
        else:
            mounts = tuple(MountCheck(path=m, present=os.path.normpath(m) in mounted)
                           for m in config.required_mounts)
    disks = []
    for path in config.disk_paths:
        try:
            usage = psutil_module.disk_usage(path)
        except OSError as e:
            errors[f"disk:{path}"] = str(e)
            continue
        disks.append(DiskUsage(path=path, total=int(usage.total), free=int(usage.free)))
    return HostSnapshot(memory_total=int(mem.total), memory_available=int(mem.available),
                        mounts=mounts, disks=tuple(disks), errors=errors)
