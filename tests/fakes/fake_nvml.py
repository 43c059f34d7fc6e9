"""A scripted stand-in for the `pynvml` module: same function names, constants and NVMLError codes.

The constants and the NVMLError class hierarchy are taken from the real pynvml (nvidia-ml-py), so
the fake cannot drift from the codes the adapter sees on a real machine; the structures returned
(PCI info, utilisation, memory) are the real ctypes structures where they hold no pointers. Only the
driver behind them is scripted:

- each `FakeGpu` holds its state as plain attributes; a test changes them between probes (counters
  rising, a remap becoming pending);
- `FakeGpu.script[function]` is a queue of values or NVML error codes returned by the next calls to
  that function before the state is used (counters that change between calls);
- `FakeGpu.unsupported` / `FakeGpu.errors` make a function raise NOT_SUPPORTED / any NVML code;
- `FakeNvml.remove(index)` makes a GPU disappear: it is no longer counted and every handle to it
  answers GPU_IS_LOST; `FakeGpu.lost = True` keeps it counted but lost;
- `FakeNvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED)` is a node without a driver;
- `FakeNvml.xid(index, code)` queues a critical-Xid event for the event set.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import pynvml as _real

NVMLError = _real.NVMLError


def _err(code: int) -> Exception:
    return NVMLError(code)  # NVMLError.__new__ maps the code to its subclass, as pynvml does


@dataclass
class FakeGpu:
    uuid: str
    bus_id: str  # NVML's form, "00000000:3B:00.0"
    name: str = "NVIDIA H100 80GB HBM3"
    serial: str = "1650923000001"
    ecc_current: int = _real.NVML_FEATURE_ENABLED
    ecc_pending: int = _real.NVML_FEATURE_ENABLED
    # (error type, counter type) -> count
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corr, unc, pending, failure
    retired_sbe: list[int] = field(default_factory=list)
    retired_dbe: list[int] = field(default_factory=list)
    retired_pending: int = _real.NVML_FEATURE_DISABLED
    clock_reasons: int = 0
    temperature: int = 45
    power_mw: int = 250_000
    pcie: tuple[int, int, int, int] = (5, 5, 16, 16)  # gen, max gen, width, max width
    nvlinks: Optional[list[int]] = field(default_factory=lambda: [1] * 18)  # None: no NVLink
    utilization: tuple[int, int] = (0, 0)
    memory: tuple[int, int] = (0, 80 * 2**30)  # used, total
    processes: list[tuple[int, Optional[int]]] = field(default_factory=list)
    supported_events: int = (_real.nvmlEventTypeXidCriticalError
                              | _real.nvmlEventTypeDoubleBitEccError
                              | _real.nvmlEventTypeSingleBitEccError)
    unsupported: set[str] = field(default_factory=set)
    errors: dict[str, int] = field(default_factory=dict)
    script: dict[str, deque] = field(default_factory=dict)
    lost: bool = False

    def set_ecc(self, *, volatile_corrected: int = 0, volatile_uncorrected: int = 0,
                aggregate_corrected: int = 0, aggregate_uncorrected: int = 0) -> None:
        c, u = _real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        v, a = _real.NVML_VOLATILE_ECC, _real.NVML_AGGREGATE_ECC
        self.ecc = {(c, v): volatile_corrected, (u, v): volatile_uncorrected,
                    (c, a): aggregate_corrected, (u, a): aggregate_uncorrected}

    def queue(self, function: str, *values: Any) -> None:
        """The next calls of `function` return these values in turn; a `Raise(code)` raises."""
        self.script.setdefault(function, deque()).extend(values)


class Raise:
    """A scripted value that raises an NVML error code instead of returning."""

    def __init__(self, code: int) -> None:
        self.code = code


class _Handle:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu


class FakeNvml:
    """The module-like object handed to NvmlAdapter(nvml=...)."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu], *, driver: str = "550.54.15",
                 init_error: Optional[int] = None) -> None:
        for name in dir(_real):
            if name.startswith(("NVML_", "nvmlClocks", "nvmlEventType")) or (
                    name.startswith("NVMLError_")):
                setattr(self, name, getattr(_real, name))
        self.gpus = list(gpus)
        self.driver = driver
        self.init_error = init_error
        self.initialized = 0
        self.calls: list[str] = []
        self._events: deque = deque()
        self._sets: dict[int, set[int]] = {}  # event set id -> registered gpu ids
        self._next_set = 1

    # --- test controls --------------------------------------------------------------------------

    def remove(self, index: int) -> FakeGpu:
        """The GPU falls off the bus: uncounted, and its handles answer GPU_IS_LOST."""
        gpu = self.gpus.pop(index)
        gpu.lost = True
        return gpu

    def xid(self, index: int, code: int) -> None:
        gpu = self.gpus[index]
        self._events.append(SimpleNamespace(device=_Handle(gpu),
                                            eventType=_real.nvmlEventTypeXidCriticalError,
                                            eventData=code, gpuInstanceId=0, computeInstanceId=0))

    # --- plumbing -------------------------------------------------------------------------------

    def _check_init(self, name: str) -> None:
        self.calls.append(name)
        if not self.initialized:
            raise _err(_real.NVML_ERROR_UNINITIALIZED)

    def _dev(self, name: str, handle: _Handle) -> Any:
        """Common checks for a per-device call; returns a scripted value or None."""
        self._check_init(name)
        gpu = handle.gpu
        if gpu.lost:
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        if name in gpu.errors:
            raise _err(gpu.errors[name])
        if name in gpu.unsupported:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        q = gpu.script.get(name)
        if q:
            v = q.popleft()
            if isinstance(v, Raise):
                raise _err(v.code)
            return SimpleNamespace(value=v)
        return None

    # --- library --------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise _err(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._check_init("nvmlShutdown")
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._check_init("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check_init("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost:
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        return _Handle(gpu)

    # --- identity -------------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        s = self._dev("nvmlDeviceGetUUID", h)
        return s.value if s else h.gpu.uuid

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        s = self._dev("nvmlDeviceGetName", h)
        return s.value if s else h.gpu.name

    def nvmlDeviceGetSerial(self, h: _Handle) -> str:
        s = self._dev("nvmlDeviceGetSerial", h)
        return s.value if s else h.gpu.serial

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> Any:
        s = self._dev("nvmlDeviceGetPciInfo", h)
        bus = s.value if s else h.gpu.bus_id
        info = _real.nvmlPciInfo_t()
        info.busId = bus.encode()
        return info

    # --- memory health --------------------------------------------------------------------------

    def nvmlDeviceGetEccMode(self, h: _Handle) -> list[int]:
        s = self._dev("nvmlDeviceGetEccMode", h)
        return list(s.value) if s else [h.gpu.ecc_current, h.gpu.ecc_pending]

    def nvmlDeviceGetTotalEccErrors(self, h: _Handle, error_type: int, counter_type: int) -> int:
        s = self._dev("nvmlDeviceGetTotalEccErrors", h)
        if s:
            return s.value
        if h.gpu.ecc_current != _real.NVML_FEATURE_ENABLED:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        return h.gpu.ecc.get((error_type, counter_type), 0)

    def nvmlDeviceGetRemappedRows(self, h: _Handle) -> tuple[int, int, int, int]:
        s = self._dev("nvmlDeviceGetRemappedRows", h)
        return tuple(s.value) if s else h.gpu.remapped_rows

    def nvmlDeviceGetRetiredPages(self, h: _Handle, cause: int) -> list[int]:
        s = self._dev("nvmlDeviceGetRetiredPages", h)
        if s:
            return list(s.value)
        if cause == _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            return list(h.gpu.retired_dbe)
        return list(h.gpu.retired_sbe)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: _Handle) -> int:
        s = self._dev("nvmlDeviceGetRetiredPagesPendingStatus", h)
        return s.value if s else h.gpu.retired_pending

    # --- clocks, thermals, links ----------------------------------------------------------------

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: _Handle) -> int:
        s = self._dev("nvmlDeviceGetCurrentClocksEventReasons", h)
        return s.value if s else h.gpu.clock_reasons

    def nvmlDeviceGetTemperature(self, h: _Handle, sensor: int) -> int:
        s = self._dev("nvmlDeviceGetTemperature", h)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return s.value if s else h.gpu.temperature

    def nvmlDeviceGetPowerUsage(self, h: _Handle) -> int:
        s = self._dev("nvmlDeviceGetPowerUsage", h)
        return s.value if s else h.gpu.power_mw

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: _Handle) -> int:
        s = self._dev("nvmlDeviceGetCurrPcieLinkGeneration", h)
        return s.value if s else h.gpu.pcie[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: _Handle) -> int:
        s = self._dev("nvmlDeviceGetMaxPcieLinkGeneration", h)
        return s.value if s else h.gpu.pcie[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: _Handle) -> int:
        s = self._dev("nvmlDeviceGetCurrPcieLinkWidth", h)
        return s.value if s else h.gpu.pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: _Handle) -> int:
        s = self._dev("nvmlDeviceGetMaxPcieLinkWidth", h)
        return s.value if s else h.gpu.pcie[3]

    def nvmlDeviceGetNvLinkState(self, h: _Handle, link: int) -> int:
        s = self._dev("nvmlDeviceGetNvLinkState", h)
        if s:
            return s.value
        links = h.gpu.nvlinks
        if links is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < _real.NVML_NVLINK_MAX_LINKS:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if link >= len(links):  # what a real GPU answers past its last link
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]

    # --- activity -------------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, h: _Handle) -> Any:
        s = self._dev("nvmlDeviceGetUtilizationRates", h)
        gpu, mem = s.value if s else h.gpu.utilization
        return _real.c_nvmlUtilization_t(gpu=gpu, memory=mem)

    def nvmlDeviceGetMemoryInfo(self, h: _Handle, version: Any = None) -> Any:
        s = self._dev("nvmlDeviceGetMemoryInfo", h)
        used, total = s.value if s else h.gpu.memory
        return _real.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list[Any]:
        s = self._dev("nvmlDeviceGetComputeRunningProcesses", h)
        procs = s.value if s else h.gpu.processes
        return [_real.nvmlFriendlyObject({"pid": pid, "usedGpuMemory": mem, "gpuInstanceId": 0,
                                          "computeInstanceId": 0}) for pid, mem in procs]

    # --- events ---------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> int:
        self._check_init("nvmlEventSetCreate")
        sid = self._next_set
        self._next_set += 1
        self._sets[sid] = set()
        return sid

    def nvmlDeviceGetSupportedEventTypes(self, h: _Handle) -> int:
        s = self._dev("nvmlDeviceGetSupportedEventTypes", h)
        return s.value if s else h.gpu.supported_events

    def nvmlDeviceRegisterEvents(self, h: _Handle, event_types: int, event_set: int) -> None:
        self._dev("nvmlDeviceRegisterEvents", h)
        if event_set not in self._sets:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if event_types & ~h.gpu.supported_events:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        self._sets[event_set].add(id(h.gpu))

    def nvmlEventSetWait(self, event_set: int, timeout_ms: int) -> Any:
        self._check_init("nvmlEventSetWait")
        if event_set not in self._sets:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        registered = self._sets[event_set]
        while self._events:
            ev = self._events.popleft()
            if id(ev.device.gpu) in registered:
                return ev
        raise _err(_real.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: int) -> None:
        self._check_init("nvmlEventSetFree")
        if self._sets.pop(event_set, None) is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)


def h100(index: int, **kw: Any) -> FakeGpu:
    """A healthy H100-like GPU at PCI bus 0x18 + 0x10 * index."""
    bus = 0x18 + 0x10 * index
    kw.setdefault("serial", f"16509230000{index:02d}")
    gpu = FakeGpu(uuid=f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd",
                  bus_id=f"00000000:{bus:02X}:00.0", **kw)
    if not gpu.ecc:
        gpu.set_ecc()
    return gpu
