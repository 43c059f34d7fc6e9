"""Configuration of the health probes: one frozen dataclass, built from a mapping that must not
carry unknown keys (a typo in a config file is an error, not a silently ignored setting)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from screener.settings import strict
from screener.errors import ConfigError

# Where the kernel log and the boot id are on a Linux node (the kernel-log reader's defaults too).
DEFAULT_KMSG = "/dev/kmsg"
DEFAULT_BOOT_ID = "/proc/sys/kernel/random/boot_id"
# The most GPUs (or NVLinks per GPU) a count may expect: past any real node, so a typo such as
# 80000 is refused rather than read as every GPU fallen off the bus.
MAX_PER_NODE = 1024


@dataclass(frozen=True)
class ProbeConfig:
    """What the probes check and the thresholds the rules use.

    expected_gpus: GPUs this node should have; fewer in NVML is critical ("fallen off the bus").
        None: do not check the count (a GPU seen in the previous probe and gone now still is).
    required_mounts: mount points that must be mounted (e.g. the shared filesystem).
    min_free_memory_fraction: host memory available / total below this is a warning.
    disk_paths: paths whose filesystems are checked for free space.
    min_free_disk_fraction: free / total below this is a warning.
    kmsg_path: where Xid lines are read (/dev/kmsg, or a log file); None: do not read.
    kmsg_state_file: where the kernel-log reader keeps its position; None: in memory only.
    kmsg_first_read: with no saved position, "all" reports what is already in the log, "end"
        only lines that arrive after the reader starts.
    boot_id_path: the kernel's boot id (kmsg sequence numbers restart at each boot).
    busy_utilization: a GPU at or above this utilisation (percent), or with compute processes, is
        busy: throttling and a low PCIe generation matter only then (idle GPUs downclock the link
        on purpose).
    power_cap_is_warning: the software power cap is how a GPU at its power limit normally runs,
        so by default it is only info; set True to make it a warning like thermal slowdown.
    expected_nvlinks: active NVLinks each GPU should have; fewer is suspect. None: only links
        that are down while others of the same GPU are up (or that went down) count.
    nvml_events: register an NVML event set for critical Xid events.
    """

    expected_gpus: Optional[int] = None
    required_mounts: tuple[str, ...] = ()
    min_free_memory_fraction: float = 0.05
    disk_paths: tuple[str, ...] = ("/",)
    min_free_disk_fraction: float = 0.05
    kmsg_path: Optional[str] = DEFAULT_KMSG
    kmsg_state_file: Optional[str] = None
    kmsg_first_read: str = "all"
    boot_id_path: str = DEFAULT_BOOT_ID
    busy_utilization: int = 10
    power_cap_is_warning: bool = False
    expected_nvlinks: Optional[int] = None
    nvml_events: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"probe config {name}={getattr(self, name)!r}: {why}")

        for name in ("expected_gpus", "expected_nvlinks"):
            v = getattr(self, name)
            if v is not None:  # null: not checked. A node has far fewer than MAX_PER_NODE.
                strict.require_number("probe", name, v, 0, MAX_PER_NODE, integer=True)
        for name in ("min_free_memory_fraction", "min_free_disk_fraction"):
            strict.require_number("probe", name, getattr(self, name), 0.0, 1.0)
        strict.require_number("probe", "busy_utilization", self.busy_utilization, 0, 100,
                               integer=True, unit="percent")
        if self.kmsg_first_read not in ("all", "end"):
            raise bad("kmsg_first_read", "must be 'all' or 'end'")
        for name in ("required_mounts", "disk_paths"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p for p in v):
                raise bad(name, "must be a list of paths")
            object.__setattr__(self, name, tuple(v))
        for name in ("power_cap_is_warning", "nvml_events"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if not isinstance(self.boot_id_path, str) or not self.boot_id_path:
            raise bad("boot_id_path", "must be a path")
        for name in ("kmsg_path", "kmsg_state_file"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(name, "must be a path or null")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "ProbeConfig":
        """Build from a parsed config file section; unknown keys raise ConfigError."""
        return strict.from_mapping(cls, data, "probes")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["required_mounts"], d["disk_paths"] = list(self.required_mounts), list(self.disk_paths)
        return d
