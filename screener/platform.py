"""The platform signature of a device: what it is, and which of its properties can change float results.

Golden results are only comparable between devices that should compute the same bits: the same GPU
model and SM count (kernel selection and split-K depend on them), the same driver and library versions,
or for a CPU the same instruction-set paths and thread count. `Platform.numeric_hash` is a short stable
hash over exactly those fields; identity fields (UUID, serial, hostname) are reported but never hashed,
so two healthy GPUs of one model share a golden record.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from screener.errors import BadInputError

# CPU feature flags that change which kernels (and so which rounding) torch and its BLAS pick.
_NUMERIC_CPU_FLAGS = re.compile(r"^(fma|f16c|avx|avx2|avx512.*|amx.*|avx_vnni.*|sve.*|asimd.*)$")

# Fields of Platform that enter numeric_hash.
NUMERIC_FIELDS = ("kind", "name", "compute_capability", "sm_count", "driver_version", "torch_version",
                  "cuda_version", "cublas_version", "cudnn_version", "cpu_capability", "cpu_flags",
                  "threads")


@dataclass(frozen=True)
class Platform:
    """Everything we know about a device that matters for comparing its results with others'."""

    device: str
    kind: str  # "cpu" or "cuda"
    name: str
    compute_capability: Optional[str] = None
    sm_count: Optional[int] = None
    memory_bytes: Optional[int] = None
    uuid: Optional[str] = None
    serial: Optional[str] = None
    driver_version: Optional[str] = None
    torch_version: str = torch.__version__
    cuda_version: Optional[str] = None
    cublas_version: Optional[str] = None
    cudnn_version: Optional[str] = None
    cpu_capability: Optional[str] = None
    cpu_flags: tuple[str, ...] = ()
    threads: Optional[int] = None
    hostname: str = field(default_factory=socket.gethostname)

    @property
    def numeric_fields(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: (list(d[k]) if isinstance(d[k], tuple) else d[k]) for k in NUMERIC_FIELDS}

    @property
    def numeric_hash(self) -> str:
        """16 hex digits over the fields that can change numeric results (stable across runs)."""
        blob = json.dumps(self.numeric_fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_flags"] = list(self.cpu_flags)
        d["numeric_hash"] = self.numeric_hash
        return d


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
            return value.strip()
    import platform as _stdlib_platform

    return _stdlib_platform.processor() or _stdlib_platform.machine()


def _cpu_flags(cpuinfo: str) -> tuple[str, ...]:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(f for f in value.split() if _NUMERIC_CPU_FLAGS.match(f)))
    return ()


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _driver_version() -> Optional[str]:
    """The NVIDIA kernel driver version from procfs (no NVML needed), or None without a driver."""
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", _read("/proc/driver/nvidia/version"))
    return m.group(1) if m else None


def _cublas_version() -> Optional[str]:
    # torch exposes no public cuBLAS version; the private getter exists on CUDA builds.
    getter = getattr(torch._C, "_cuda_getCompiledVersion", None)
    if getter is None or not torch.cuda.is_available():
        return None
    try:
        return str(getter())
    except Exception:  # noqa: BLE001 - a best-effort field must not fail the signature
        return None


def signature(device: str = "cpu", *, serial: Optional[str] = None) -> Platform:
    """The platform signature of `device` ("cpu" or "cuda:N").

    `serial` can be supplied by a caller that reads it from NVML (the health adapter); torch does
    not expose it. Raises BadInputError for a device that is not present or not understood.
    """
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise BadInputError(f"device {device!r} is not a device name (cpu, cuda:N): {e}") from None
    if dev.type == "cpu":
        cpuinfo = _read("/proc/cpuinfo")
        return Platform(device="cpu", kind="cpu", name=_cpu_model(cpuinfo),
                        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                        cpu_capability=torch.backends.cpu.get_cpu_capability(),
                        cpu_flags=_cpu_flags(cpuinfo), threads=torch.get_num_threads(),
                        driver_version=None)
    if dev.type != "cuda":
        raise BadInputError(f"device {device!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise BadInputError(f"device {device!r}: CUDA is not available on this machine")
    index = dev.index if dev.index is not None else 0
    if index >= torch.cuda.device_count():
        raise BadInputError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return Platform(device=f"cuda:{index}", kind="cuda", name=props.name,
                    compute_capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, memory_bytes=props.total_memory,
                    uuid=f"GPU-{uuid}" if uuid is not None else None, serial=serial,
                    driver_version=_driver_version(), cuda_version=torch.version.cuda,
                    cublas_version=_cublas_version(),
                    cudnn_version=str(cudnn) if cudnn is not None else None)


def local_devices(include_cpu_when_gpus: bool = False) -> list[str]:
    """The devices to screen on this machine: every CUDA device, or the CPU when there is none."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [f"cuda:{i}" for i in range(n)]
    if not devices or include_cpu_when_gpus:
        devices.insert(0, "cpu")
    return devices
