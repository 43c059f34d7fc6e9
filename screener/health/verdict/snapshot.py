"""Plain snapshots of what the probes observed: GPUs (from NVML), Xid events, the host.

These are the inputs of the pure rules in `screener.health.verdict.rules`. They hold plain values only (no
NVML handles, no ctypes), so a test or the daemon can build, store and compare them, and the rules
can look at two successive snapshots to see a counter rising. ``None`` in a field means the value
could not be read (not supported on this GPU, or an error recorded in ``errors``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

_PCI_RE = re.compile(r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
                     r"(?P<dev>[0-9a-fA-F]{1,2})(?:\.(?P<fn>[0-7]))?$")


def normalize_pci(bus_id: str) -> str:
    """A PCI address in one canonical form, ``dddd:bb:dd`` (lower case, function dropped).

    NVML says ``00000000:3B:00.0``, the kernel log says ``0000:3b:00``; both become ``0000:3b:00``
    so an Xid line can be matched to its GPU. Raises ValueError for anything else.
    """
    text = bus_id.strip()
    if text.upper().startswith("PCI:"):
        text = text[4:]
    m = _PCI_RE.match(text)
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain = int(m.group("domain") or "0", 16)
    return f"{domain:04x}:{int(m.group('bus'), 16):02x}:{int(m.group('dev'), 16):02x}"


@dataclass(frozen=True)
class EccCounts:
    """ECC error counts. Volatile counts reset with the GPU (reset or driver reload); aggregate
    counts are the lifetime totals kept in the GPU's InfoROM."""

    volatile_corrected: Optional[int] = None
    volatile_uncorrected: Optional[int] = None
    aggregate_corrected: Optional[int] = None
    aggregate_uncorrected: Optional[int] = None


@dataclass(frozen=True)
class RowRemap:
    """The row remapper (Ampere and newer): rows replaced by spares, pending and failure flags."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class RetiredPages:
    """Dynamic page retirement (pre-Ampere parts)."""

    single_bit: int  # pages retired for multiple single-bit errors
    double_bit: int  # pages retired for a double-bit error
    pending: bool  # retirements that take effect at the next driver reload


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory: Optional[int] = None  # bytes; None where NVML cannot tell


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU as NVML saw it in one probe."""

    index: int
    uuid: Optional[str] = None
    name: Optional[str] = None
    serial: Optional[str] = None
    pci_bus_id: Optional[str] = None  # canonical, see normalize_pci
    lost: bool = False  # the GPU stopped answering NVML (GPU_IS_LOST or similar)
    lost_reason: str = ""
    ecc_enabled: Optional[bool] = None
    ecc_pending_enabled: Optional[bool] = None
    ecc: EccCounts = field(default_factory=EccCounts)
    row_remap: Optional[RowRemap] = None
    retired_pages: Optional[RetiredPages] = None
    clock_event_reasons: Optional[tuple[str, ...]] = None  # e.g. ("sw_power_cap",)
    temperature_c: Optional[int] = None
    power_w: Optional[float] = None
    pcie_gen: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width: Optional[int] = None
    pcie_width_max: Optional[int] = None
    nvlinks: tuple[tuple[int, bool], ...] = ()  # (link number, active) for every link that exists
    utilization_gpu: Optional[int] = None  # percent of the last sample period a kernel ran
    utilization_memory: Optional[int] = None
    memory_used: Optional[int] = None  # bytes
    memory_total: Optional[int] = None
    processes: Optional[tuple[GpuProcess, ...]] = None  # compute processes running on the GPU
    unsupported: tuple[str, ...] = ()  # fields NVML reports as not supported on this GPU
    errors: Mapping[str, str] = field(default_factory=dict)  # field -> wrapped NVML error text

    @property
    def label(self) -> str:
        """How findings name this GPU: its UUID, else its PCI address, else its index."""
        return self.uuid or self.pci_bus_id or str(self.index)

    def identity(self) -> dict[str, Any]:
        """The fields that identify the GPU, for a finding's evidence."""
        return {"index": self.index, "uuid": self.uuid, "serial": self.serial,
                "pci_bus_id": self.pci_bus_id, "name": self.name}

    @property
    def busy(self) -> bool:
        """Whether work is running: compute processes present (or, without that, utilisation)."""
        if self.processes:
            return True
        return bool(self.utilization_gpu)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["errors"] = dict(self.errors)
        return d


@dataclass(frozen=True)
class XidEvent:
    """One Xid report, from NVML's event set or from a kernel-log line."""

    code: int
    source: str  # "nvml" or "kmsg"
    pci_bus_id: Optional[str] = None  # canonical; kernel-log lines carry it
    gpu_index: Optional[int] = None
    gpu_uuid: Optional[str] = None
    pid: Optional[int] = None
    process: Optional[str] = None
    text: str = ""
    raw: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NvmlSnapshot:
    """Everything NVML said in one probe."""

    available: bool
    reason: str = ""  # why not available (no driver, library missing, or the failure)
    failed: bool = False  # NVML itself failed (our problem, see the report's errors), not absent
    driver_version: Optional[str] = None
    device_count: int = 0
    gpus: tuple[GpuSnapshot, ...] = ()
    xid_events: tuple[XidEvent, ...] = ()
    events_supported: bool = False
    errors: tuple[str, ...] = ()  # NVML failures that are not about one GPU field

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason, "failed": self.failed,
                "driver_version": self.driver_version, "device_count": self.device_count,
                "gpus": [g.to_dict() for g in self.gpus],
                "xid_events": [e.to_dict() for e in self.xid_events],
                "events_supported": self.events_supported, "errors": list(self.errors)}


@dataclass(frozen=True)
class MountCheck:
    path: str
    present: bool


@dataclass(frozen=True)
class DiskUsage:
    path: str
    total: int
    free: int


@dataclass(frozen=True)
class HostSnapshot:
    """Host-level observations (psutil)."""

    memory_total: int
    memory_available: int
    mounts: tuple[MountCheck, ...] = ()
    disks: tuple[DiskUsage, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["errors"] = dict(self.errors)
        return d


@dataclass(frozen=True)
class ProbeSnapshot:
    """One full probe: NVML, the Xid events seen since the last probe, the host."""

    taken_at: float  # unix time
    nvml: NvmlSnapshot
    xids: tuple[XidEvent, ...] = ()  # from every source, matched to GPUs where possible
    host: Optional[HostSnapshot] = None
    kmsg_status: str = "read"  # "read", "disabled" (not configured) or "unavailable"
    kmsg_reason: str = ""

    def gpu_by_label(self) -> dict[str, GpuSnapshot]:
        return {g.label: g for g in self.nvml.gpus}
