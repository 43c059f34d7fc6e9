"""The platform signature of a device: what it is, and which of its properties can change float results.

Golden results are only comparable between devices that should compute the same bits.
`Platform.numeric_hash` is a short stable hash over exactly the fields that change them, and
nothing cosmetic:
- a GPU: its model (name, compute capability) and SM count (kernel selection and split-K depend
  on them), the driver, the torch build, CUDA, cuBLAS and cuDNN;
- a CPU: the torch build, the kernel dispatch level torch reports
  (torch.backends.cpu.get_cpu_capability()), the code paths its BLAS (MKL) and oneDNN take (read
  from their own verbose banners, so a library that ignores an ISA flag does not split goldens)
  and the thread count. Not the CPU model name, not ISA flags torch does not dispatch on: two
  CPUs of different makes on the same paths compute the same bits and share a golden.
Identity fields (UUID, serial, hostname) and the CPU's name and flags are reported, never hashed.

`sibling_key` is the coarser key of platforms whose goldens a device may be compared with when
it has no golden of its own platform (same kind, torch build and dispatch level, or GPU model):
equal bits pass, different bits are inconclusive (screener.known_answer.verdict.judgment).
"""

from __future__ import annotations

import hashlib
import os
import platform as _stdlib_platform  # the standard library's (imports are absolute), not this module
import re
import socket
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from screener.errors import BadInputError
from screener.known_answer.verdict.results import canonical_json

# CPU feature flags shown for information (never hashed: torch dispatches on cpu_capability).
_SHOWN_CPU_FLAGS = re.compile(r"^(fma|f16c|avx|avx2|avx512.*|amx.*|avx_vnni.*|sve.*|asimd.*)$")

# Fields of Platform that enter numeric_hash, per kind of device.
NUMERIC_FIELDS_BY_KIND = {
    "cpu": ("kind", "torch_version", "torch_build", "cpu_capability", "blas", "onednn", "threads"),
    "cuda": ("kind", "name", "compute_capability", "sm_count", "driver_version", "torch_version",
             "torch_build", "cuda_version", "cublas_version", "cudnn_version"),
}
# Every field that enters numeric_hash for some kind (what `screener platform` marks).
NUMERIC_FIELDS = tuple(dict.fromkeys(f for fs in NUMERIC_FIELDS_BY_KIND.values() for f in fs))
# The fields two platforms must share for one's golden to be compared with the other's device.
SIBLING_FIELDS_BY_KIND = {"cpu": ("kind", "torch_version", "cpu_capability"),
                          "cuda": ("kind", "name", "compute_capability", "sm_count",
                                   "torch_version")}


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
    torch_build: Optional[str] = field(default_factory=lambda: _torch_build())
    cuda_version: Optional[str] = None
    cublas_version: Optional[str] = None
    cudnn_version: Optional[str] = None
    cpu_capability: Optional[str] = None
    cpu_flags: tuple[str, ...] = ()
    blas: Optional[str] = None
    onednn: Optional[str] = None
    threads: Optional[int] = None
    hostname: str = field(default_factory=socket.gethostname)

    @property
    def numeric_fields(self) -> dict[str, Any]:
        """The fields that enter numeric_hash for this kind of device, with their values."""
        d = asdict(self)
        names = NUMERIC_FIELDS_BY_KIND.get(self.kind, NUMERIC_FIELDS)
        return {k: (list(d[k]) if isinstance(d[k], tuple) else d[k]) for k in names}

    @property
    def numeric_hash(self) -> str:
        """16 hex digits over the fields that can change numeric results (stable across runs)."""
        blob = canonical_json(self.numeric_fields)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_flags"] = list(self.cpu_flags)
        d["numeric_hash"] = self.numeric_hash
        return d


def sibling_key(platform: Any) -> Optional[tuple[Any, ...]]:
    """The key that platforms whose goldens may stand in for each other share (a Platform or its
    to_dict(), also one stored in an old golden); None when it lacks the fields to say."""
    d = platform.to_dict() if isinstance(platform, Platform) else platform
    if not isinstance(d, dict):
        return None
    names = SIBLING_FIELDS_BY_KIND.get(str(d.get("kind")))
    if names is None or any(d.get(k) is None for k in names):
        return None
    return tuple(str(d[k]) for k in names)


def _torch_build() -> Optional[str]:
    """The torch build's source commit: two wheels of one version string can differ."""
    v = getattr(getattr(torch, "version", None), "git_version", None)
    return str(v)[:12] if v else None


_MKL_BANNER = re.compile(r"MKL_VERBOSE (?:oneMKL|Intel\(R\) MKL) (\S+).*? architecture (.+?), Lnx")
_ONEDNN_ISA = re.compile(r"onednn_verbose,(?:v1,)?info,cpu,isa:(.+)")
_ONEDNN_VERSION = re.compile(r"onednn_verbose,(?:v1,)?info,oneDNN v(\S+)")


def _tidy(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"\((?:R|TM)\)", "", text)).strip()


def _capture_stdout(fn: Any) -> str:
    """What fn writes to file descriptor 1 (the libraries' verbose banners go there, below
    Python), kept off the real stdout: in a screening child stdout is the protocol channel."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            fn()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read(65536).decode(errors="replace")


_math_paths: Optional[tuple[Optional[str], Optional[str]]] = None


def cpu_math_paths() -> tuple[Optional[str], Optional[str]]:
    """(blas, onednn): the code paths torch's MKL and oneDNN take on this CPU, e.g.
    ("mkl 2024.0 Architecture processors", "onednn 3.12.0 Intel AVX2"), as the libraries
    themselves report them in their verbose banners (each one small call, once per process).
    A library torch was built without is None; one that says nothing is "<lib> unknown"."""
    global _math_paths
    if _math_paths is not None:
        return _math_paths
    blas = onednn = None
    if torch.backends.mkl.is_available():
        def mkl() -> None:
            with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                a = torch.ones(4, 4)
                torch.mm(a, a)
        try:
            m = _MKL_BANNER.search(_capture_stdout(mkl))
        except Exception:  # noqa: BLE001 - a best-effort field must not fail the signature
            m = None
        blas = f"mkl {m.group(1)} {_tidy(m.group(2))}" if m else "mkl unknown"
    if torch.backends.mkldnn.is_available():
        def dnnl() -> None:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                x = torch.ones(2, 4).to_mkldnn()
                # torch's stub omits bias's default (None); the call is torch's own test of it
                torch._C._nn.mkldnn_linear(x, torch.ones(3, 4).to_mkldnn())  # type: ignore[call-arg]
        try:
            out = _capture_stdout(dnnl)
        except Exception:  # noqa: BLE001
            out = ""
        isa, ver = _ONEDNN_ISA.search(out), _ONEDNN_VERSION.search(out)
        onednn = (f"onednn {ver.group(1)} {_tidy(isa.group(1))}" if isa and ver
                  else "onednn unknown")
    _math_paths = (blas, onednn)
    return _math_paths


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
            return value.strip()
    return _stdlib_platform.processor() or _stdlib_platform.machine()


def _cpu_flags(cpuinfo: str) -> tuple[str, ...]:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(f for f in value.split() if _SHOWN_CPU_FLAGS.match(f)))
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
        blas, onednn = cpu_math_paths()
        return Platform(device="cpu", kind="cpu", name=_cpu_model(cpuinfo),
                        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                        cpu_capability=torch.backends.cpu.get_cpu_capability(),
                        cpu_flags=_cpu_flags(cpuinfo), blas=blas, onednn=onednn,
                        threads=torch.get_num_threads(),
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
