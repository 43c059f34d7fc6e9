"""The compiled CPU fingerprint kernel (fingerprint.c), loaded with ctypes on first use.

The C library is built into the package by `pip install` (setuptools `ext-modules` in
pyproject.toml, marked optional: an install without a C compiler still succeeds, and fingerprints
then run on the pure-torch reference path). It has a plain C ABI and no Python or torch headers, so
one build serves every torch version. ctypes releases the GIL for the duration of the call.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from array import array
from typing import Optional

# The extension's module name; the file is _fingerprint.<python tag>.so next to this module.
LIBRARY = "screener.kernels._fingerprint"
_ABI_VERSION = 2

# The kernel sets a build has, by the number sfp_sums takes ("native" = the one this CPU runs).
KERNEL_SETS = {"native": 0, "generic": 1, "avx2": 2, "avx512": 3}

# Large tensors are cut into pieces of this many bytes for the threads; runs of small tensors are
# grouped to about this size. ~1 MiB: a few hundred microseconds of work at most, so threads share
# the work evenly, and far more than the per-piece cost of a claim and two atomic adds.
PIECE_BYTES = 1 << 20
# Each thread gets at least this many bytes of a call: starting one costs tens of microseconds.
PARALLEL_MIN_BYTES = 4 << 20


class CpuKernel:
    """A loaded C kernel: fingerprints of contiguous CPU tensors given by address."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._fn = lib.sfp_fingerprints
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_int64, ctypes.c_int64]
        self._sums = lib.sfp_sums
        self._sums.restype = ctypes.c_int
        self._sums.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                               ctypes.c_void_p]
        isa = lib.sfp_isa
        isa.restype = ctypes.c_char_p
        self.isa: str = isa().decode()  # "avx512", "avx2" or "generic": the kernels this CPU runs

    def sums(self, address: int, numel: int, element_size: int, kernels: str = "native") -> tuple[int, int]:
        """One contiguous tensor's (S, W) on one thread, with the kernel set named (a key of
        KERNEL_SETS): for tests that check, on any machine, every set the CPU can run."""
        out = (ctypes.c_int64 * 2)()
        rc = self._sums(address, numel, element_size, KERNEL_SETS[kernels], out)
        if rc == -3:
            raise ValueError(f"fingerprint kernel: this CPU or build cannot run the {kernels} kernels")
        if rc != 0:
            raise RuntimeError(f"fingerprint kernel: failed with code {rc}")
        return out[0], out[1]

    def runnable(self) -> list[str]:
        """The kernel sets this CPU can run, the generic ones first."""
        return ["generic"] + [k for k in ("avx2", "avx512") if self._can_run(k)]

    def _can_run(self, kernels: str) -> bool:
        one = (ctypes.c_int64 * 1)(0)
        out = (ctypes.c_int64 * 2)()
        rc: int = self._sums(ctypes.addressof(one), 1, 8, KERNEL_SETS[kernels], out)
        return rc == 0

    def run(self, desc: "array[int]", out_address: int, threads: int,
            piece_bytes: int = PIECE_BYTES, parallel_min_bytes: int = PARALLEL_MIN_BYTES) -> None:
        """Fingerprint the tensors in `desc` into the zeroed int64 (n, 2) buffer at out_address.

        desc is an array('q') of (address, elements, element size) per tensor; the caller keeps the
        tensors alive and contiguous for the duration of the call.
        """
        n = len(desc) // 3
        address, _ = desc.buffer_info()
        rc = self._fn(address, n, out_address, max(1, threads), piece_bytes, parallel_min_bytes)
        if rc == -1:
            raise MemoryError("fingerprint kernel: out of memory for its work list")
        if rc != 0:
            raise RuntimeError(f"fingerprint kernel: failed with code {rc}")


_lock = threading.Lock()
_loaded: Optional[tuple[Optional[CpuKernel], str]] = None


def load() -> tuple[Optional[CpuKernel], str]:
    """The kernel, or None and why not (not built, unloadable, wrong ABI). Loaded once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> tuple[Optional[CpuKernel], str]:
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or not spec.origin:
        return None, "the C kernel was not built (reinstall with a C compiler: pip install -e .)"
    try:
        lib = ctypes.CDLL(spec.origin)
        version = lib.sfp_abi_version()
    except (OSError, AttributeError) as exc:
        return None, f"the C kernel at {spec.origin} could not be loaded: {exc}"
    if version != _ABI_VERSION:
        return None, f"the C kernel at {spec.origin} has ABI {version}, expected {_ABI_VERSION}"
    return CpuKernel(lib, spec.origin), "loaded"
