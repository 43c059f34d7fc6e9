"""The NVML adapter: the only place in screener that talks to NVIDIA's management library.

`NvmlAdapter` takes the NVML module as a constructor argument (by default it imports `pynvml`, from
nvidia-ml-py, lazily), so tests pass a scripted module with the same function names, constants and
`NVMLError` classes. It turns what NVML says into plain `GpuSnapshot`s and `XidEvent`s; it never
decides what is good or bad (that is `screener.health.verdict.rules`).

Error policy, one place:

- every NVML error is wrapped in `NvmlError` (an ExternalServiceError) with the NVML error as cause;
- no driver or no library at init: the adapter is "unavailable" and says why (the probes turn that
  into one info finding); any other init failure raises NvmlError;
- a field that NVML reports as not supported is None and listed in ``unsupported``;
- a GPU that stops answering (GPU_IS_LOST, RESET_REQUIRED) is marked ``lost``: a finding, not an
  exception;
- any other error on one field is recorded in that GPU's ``errors`` and the probe goes on.

Keep one adapter open for the life of the daemon: Xid events arrive through an NVML event set
registered at `open()`, and only events after registration are seen, so a restart never re-raises
old ones. `poll` never blocks (wait timeout 0).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from screener.errors import ExternalServiceError
from screener.health.verdict.snapshot import (EccCounts, GpuProcess, GpuSnapshot, NvmlSnapshot,
                                              RetiredPages, RowRemap, XidEvent, normalize_pci)

log = logging.getLogger(__name__)

# Errors that mean "there is no NVIDIA driver here": report, do not fail.
_NO_DRIVER = ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED")
# Errors that mean "this GPU does not have / NVML cannot give this field".
_ABSENT = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")
# Errors that mean the GPU stopped answering.
_LOST = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")
# A link number past the GPU's last NVLink.
_NO_LINK = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NOT_FOUND",
            "NVML_ERROR_FUNCTION_NOT_FOUND")

# Our names for NVML's clock event (throttle) reason bits: (ours, current name, deprecated name).
_CLOCK_REASONS = (
    ("gpu_idle", "nvmlClocksEventReasonGpuIdle", "nvmlClocksThrottleReasonGpuIdle"),
    ("applications_clocks_setting", "nvmlClocksEventReasonApplicationsClocksSetting",
     "nvmlClocksThrottleReasonApplicationsClocksSetting"),
    ("sw_power_cap", "nvmlClocksEventReasonSwPowerCap", "nvmlClocksThrottleReasonSwPowerCap"),
    ("hw_slowdown", "nvmlClocksEventReasonHwSlowdown", "nvmlClocksThrottleReasonHwSlowdown"),
    ("sync_boost", "nvmlClocksEventReasonSyncBoost", "nvmlClocksThrottleReasonSyncBoost"),
    ("sw_thermal_slowdown", "nvmlClocksEventReasonSwThermalSlowdown",
     "nvmlClocksThrottleReasonSwThermalSlowdown"),
    ("hw_thermal_slowdown", "nvmlClocksEventReasonHwThermalSlowdown",
     "nvmlClocksThrottleReasonHwThermalSlowdown"),
    ("hw_power_brake_slowdown", "nvmlClocksEventReasonHwPowerBrakeSlowdown",
     "nvmlClocksThrottleReasonHwPowerBrakeSlowdown"),
    ("display_clock_setting", "nvmlClocksEventReasonDisplayClockSetting",
     "nvmlClocksThrottleReasonDisplayClockSetting"),
)

MAX_EVENTS_PER_POLL = 4096  # a flood of Xid 13 must not hold the probe forever


class NvmlError(ExternalServiceError):
    """An NVML call failed; ``code`` is NVML's return code, the NVML exception is the cause."""

    def __init__(self, message: str, *, function: str, code: Optional[int],
                 gpu: Optional[int] = None) -> None:
        super().__init__(message)
        self.function = function
        self.code = code
        self.gpu = gpu


class _GpuLost(Exception):
    """Internal: the GPU stopped answering while we read it."""

    def __init__(self, error: NvmlError) -> None:
        super().__init__(str(error))
        self.error = error


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlAdapter:
    """Reads GPU health through NVML. Use as a context manager, or call open() and close()."""

    def __init__(self, nvml: Any = None, *, events: bool = True) -> None:
        self._given = nvml
        self._nvml: Any = None
        self._want_events = events
        self._open = False
        self._available = False
        self._reason = ""
        self._event_set: Any = None
        self._event_mask = 0

    # --- lifetime -------------------------------------------------------------------------------

    def _module(self) -> Any:
        if self._nvml is None:
            if self._given is not None:
                self._nvml = self._given
            else:
                try:
                    import pynvml  # the one import of pynvml in screener
                except ImportError as e:
                    raise NvmlError("cannot import pynvml (install nvidia-ml-py)",
                                    function="import", code=None) from e
                self._nvml = pynvml
        return self._nvml

    def _codes(self, names: tuple[str, ...]) -> set[int]:
        nvml = self._module()
        return {getattr(nvml, n) for n in names if hasattr(nvml, n)}

    def _call(self, function: str, *args: Any, gpu: Optional[int] = None) -> Any:
        """Call one NVML function; wrap any NVML error (or a missing function) in NvmlError."""
        nvml = self._module()
        fn: Optional[Callable[..., Any]] = getattr(nvml, function, None)
        if fn is None:
            raise NvmlError(f"{function}: not in this NVML binding", function=function,
                            code=getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", None), gpu=gpu)
        try:
            return fn(*args)
        except nvml.NVMLError as e:
            where = f" (GPU {gpu})" if gpu is not None else ""
            raise NvmlError(f"{function}{where}: {e}", function=function,
                            code=getattr(e, "value", None), gpu=gpu) from e

    @property
    def available(self) -> bool:
        return self._available

    @property
    def reason(self) -> str:
        """Why NVML is unavailable ("" when it is available)."""
        return self._reason

    def open(self) -> bool:
        """Initialise NVML. False (with `reason`) when there is no driver; NvmlError otherwise."""
        if self._open:
            return self._available
        try:
            self._call("nvmlInit")
        except NvmlError as e:
            if e.code in self._codes(_NO_DRIVER):
                self._open, self._available, self._reason = True, False, str(e)
                log.info("no NVIDIA driver: %s", e)
                return False
            raise
        self._open, self._available, self._reason = True, True, ""
        if self._want_events:
            self._register_events()
        return True

    def close(self) -> None:
        """Free the event set and shut NVML down; safe to call twice or after a failed open."""
        if not (self._open and self._available):
            self._open = False
            return
        if self._event_set is not None:
            try:
                self._call("nvmlEventSetFree", self._event_set)
            except NvmlError as e:
                log.warning("%s", e)
            self._event_set = None
        try:
            self._call("nvmlShutdown")
        except NvmlError as e:
            log.warning("%s", e)
        self._open = self._available = False

    def __enter__(self) -> "NvmlAdapter":
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- events ---------------------------------------------------------------------------------

    def _register_events(self) -> None:
        """Register every GPU for critical-Xid events; the others are left to the kernel log."""
        nvml = self._module()
        mask = getattr(nvml, "nvmlEventTypeXidCriticalError", None)
        if mask is None:
            return
        try:
            count = self._call("nvmlDeviceGetCount")
            event_set = self._call("nvmlEventSetCreate")
        except NvmlError as e:
            log.warning("NVML events unavailable: %s", e)
            return
        registered = 0
        for i in range(count):
            try:
                handle = self._call("nvmlDeviceGetHandleByIndex", i, gpu=i)
                supported = self._call("nvmlDeviceGetSupportedEventTypes", handle, gpu=i)
                if not supported & mask:
                    continue
                self._call("nvmlDeviceRegisterEvents", handle, mask, event_set, gpu=i)
                registered += 1
            except NvmlError as e:
                log.warning("no NVML Xid events for GPU %d: %s", i, e)
        if registered:
            self._event_set, self._event_mask = event_set, mask
        else:
            try:
                self._call("nvmlEventSetFree", event_set)
            except NvmlError as e:
                log.warning("%s", e)

    @property
    def events_supported(self) -> bool:
        return self._event_set is not None

    def poll_xids(self) -> tuple[list[XidEvent], list[str]]:
        """Drain pending Xid events without blocking. Returns (events, errors)."""
        if self._event_set is None:
            return [], []
        timeout = self._codes(("NVML_ERROR_TIMEOUT",))
        events: list[XidEvent] = []
        errors: list[str] = []
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                data = self._call("nvmlEventSetWait", self._event_set, 0)
            except NvmlError as e:
                if e.code not in timeout:
                    errors.append(str(e))
                break
            if not int(data.eventType) & self._event_mask:
                continue
            uuid = None
            try:
                uuid = _text(self._call("nvmlDeviceGetUUID", data.device))
            except NvmlError as e:  # the GPU that raised it may be the one that is gone
                log.warning("cannot name the GPU of Xid %s: %s", data.eventData, e)
            events.append(XidEvent(code=int(data.eventData), source="nvml", gpu_uuid=uuid,
                                   text="NVML critical Xid event"))
        return events, errors

    # --- snapshot -------------------------------------------------------------------------------

    def snapshot(self) -> NvmlSnapshot:
        """Read every GPU once, and drain pending Xid events. Opens NVML if needed."""
        if not self._open:
            self.open()
        if not self._available:
            return NvmlSnapshot(available=False, reason=self._reason)
        driver = None
        try:
            driver = _text(self._call("nvmlSystemGetDriverVersion"))
        except NvmlError as e:
            log.warning("%s", e)
        count = self._call("nvmlDeviceGetCount")
        gpus = tuple(self._gpu(i) for i in range(count))
        events, errors = self.poll_xids()
        by_uuid = {g.uuid: g for g in gpus if g.uuid}
        matched = []
        for ev in events:
            g = by_uuid.get(ev.gpu_uuid) if ev.gpu_uuid else None
            if g is not None:
                ev = XidEvent(code=ev.code, source=ev.source, pci_bus_id=g.pci_bus_id,
                              gpu_index=g.index, gpu_uuid=g.uuid, text=ev.text)
            matched.append(ev)
        return NvmlSnapshot(available=True, driver_version=driver, device_count=count, gpus=gpus,
                            xid_events=tuple(matched), events_supported=self.events_supported,
                            errors=tuple(errors))

    def _gpu(self, index: int) -> GpuSnapshot:
        """One GPU; a GPU that stops answering midway comes back ``lost`` with what was read."""
        nvml = self._module()
        absent, lost = self._codes(_ABSENT), self._codes(_LOST)
        fields: dict[str, Any] = {"index": index}
        unsupported: list[str] = []
        errors: dict[str, str] = {}

        def read_first(name: str, *calls: tuple[Any, ...]) -> Any:
            """Read a field by the first of several calls ``(function, *args)`` that this driver
            and binding have (newest API first); None if none has it or one fails."""
            for function, *args in calls:
                try:
                    return self._call(function, *args, gpu=index)
                except NvmlError as e:
                    if e.code in lost:
                        raise _GpuLost(e) from e
                    if e.code not in absent:
                        errors[name] = str(e)
                        return None
            unsupported.append(name)
            return None

        def read(name: str, function: str, *args: Any) -> Any:
            return read_first(name, (function, *args))

        try:
            handle = self._call("nvmlDeviceGetHandleByIndex", index, gpu=index)
        except NvmlError as e:
            if e.code in lost:
                return GpuSnapshot(index=index, lost=True, lost_reason=str(e))
            # e.g. no permission: we cannot see it, which is our problem, not the GPU's.
            return GpuSnapshot(index=index, errors={"handle": str(e)})
        try:
            self._read_gpu(handle, nvml, read, read_first, fields, errors)
        except _GpuLost as e:
            fields["lost"], fields["lost_reason"] = True, str(e.error)
        return GpuSnapshot(unsupported=tuple(unsupported), errors=errors, **fields)

    def _read_gpu(self, h: Any, nvml: Any, read: Callable[..., Any],
                  read_first: Callable[..., Any], f: dict[str, Any],
                  errors: dict[str, str]) -> None:
        """Every field of one GPU into `f`; what cannot be read stays None, with why in `errors`."""
        self._read_identity(h, read, f)
        self._read_memory_health(h, nvml, read, f)
        self._read_load(h, nvml, read, read_first, f, errors)

    def _read_identity(self, h: Any, read: Callable[..., Any], f: dict[str, Any]) -> None:
        """UUID, name, serial, PCI bus id."""
        for key, function in (("uuid", "nvmlDeviceGetUUID"), ("name", "nvmlDeviceGetName"),
                              ("serial", "nvmlDeviceGetSerial")):
            v = read(key, function, h)
            f[key] = _text(v) if v is not None else None
        pci = read("pci", "nvmlDeviceGetPciInfo", h)
        if pci is not None:
            try:
                f["pci_bus_id"] = normalize_pci(_text(pci.busId))
            except ValueError:
                f["pci_bus_id"] = _text(pci.busId)

    def _read_memory_health(self, h: Any, nvml: Any, read: Callable[..., Any],
                            f: dict[str, Any]) -> None:
        """ECC mode and counters, row remapping, retired pages."""
        enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        mode = read("ecc_mode", "nvmlDeviceGetEccMode", h)
        if mode is not None:
            f["ecc_enabled"] = mode[0] == enabled
            f["ecc_pending_enabled"] = mode[1] == enabled
        corrected = nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        uncorrected = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        counts = {}
        for key, etype, ctype in (
                ("volatile_corrected", corrected, nvml.NVML_VOLATILE_ECC),
                ("volatile_uncorrected", uncorrected, nvml.NVML_VOLATILE_ECC),
                ("aggregate_corrected", corrected, nvml.NVML_AGGREGATE_ECC),
                ("aggregate_uncorrected", uncorrected, nvml.NVML_AGGREGATE_ECC)):
            v = read(f"ecc.{key}", "nvmlDeviceGetTotalEccErrors", h, etype, ctype)
            counts[key] = int(v) if v is not None else None
        f["ecc"] = EccCounts(**counts)

        rows = read("row_remap", "nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            corr, unc, pending, failure = rows
            f["row_remap"] = RowRemap(int(corr), int(unc), bool(pending), bool(failure))
        sbe = read("retired_pages", "nvmlDeviceGetRetiredPages", h,
                   nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        if sbe is not None:
            dbe = read("retired_pages", "nvmlDeviceGetRetiredPages", h,
                       nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
            pend = read("retired_pages", "nvmlDeviceGetRetiredPagesPendingStatus", h)
            if dbe is not None and pend is not None:
                f["retired_pages"] = RetiredPages(len(sbe), len(dbe), pend == enabled)

    def _read_load(self, h: Any, nvml: Any, read: Callable[..., Any],
                   read_first: Callable[..., Any], f: dict[str, Any],
                   errors: dict[str, str]) -> None:
        """What the GPU is doing: clocks, temperature, power, links, utilisation, processes."""
        f["clock_event_reasons"] = self._clock_reasons(h, nvml, read_first)
        # nvmlDeviceGetTemperature is deprecated (to go in CUDA 14); older drivers lack the V form.
        f["temperature_c"] = read_first("temperature",
                                  ("nvmlDeviceGetTemperatureV", h, nvml.NVML_TEMPERATURE_GPU),
                                  ("nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU))
        mw = read("power", "nvmlDeviceGetPowerUsage", h)
        f["power_w"] = mw / 1000.0 if mw is not None else None
        for key, function in (("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                              ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                              ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                              ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
            f[key] = read(key, function, h)
        f["nvlinks"] = self._nvlinks(h, nvml, f["index"], errors)
        util = read("utilization", "nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            f["utilization_gpu"], f["utilization_memory"] = int(util.gpu), int(util.memory)
        mem = read("memory", "nvmlDeviceGetMemoryInfo", h)
        if mem is not None:
            f["memory_used"], f["memory_total"] = int(mem.used), int(mem.total)
        procs = read("processes", "nvmlDeviceGetComputeRunningProcesses", h)
        if procs is not None:
            f["processes"] = tuple(
                GpuProcess(pid=int(p.pid), used_memory=(int(p.usedGpuMemory)
                                                        if p.usedGpuMemory is not None else None))
                for p in procs)

    def _clock_reasons(self, h: Any, nvml: Any,
                       read_first: Callable[..., Any]) -> Optional[tuple[str, ...]]:
        # "Throttle" is the deprecated name of the same call, for older drivers and bindings.
        bits = read_first("clock_event_reasons", ("nvmlDeviceGetCurrentClocksEventReasons", h),
                    ("nvmlDeviceGetCurrentClocksThrottleReasons", h))
        if bits is None:
            return None
        names = []
        for ours, current, old in _CLOCK_REASONS:
            bit = getattr(nvml, current, getattr(nvml, old, None))
            if bit and int(bits) & bit:
                names.append(ours)
        return tuple(names)

    def _nvlinks(self, h: Any, nvml: Any, index: int,
                 errors: dict[str, str]) -> tuple[tuple[int, bool], ...]:
        """(link, active) for every link the GPU has; links past its last one answer 'no link'."""
        no_link, lost = self._codes(_NO_LINK), self._codes(_LOST)
        links = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                state = self._call("nvmlDeviceGetNvLinkState", h, link, gpu=index)
            except NvmlError as e:
                if e.code in lost:
                    raise _GpuLost(e) from e
                if e.code in no_link:
                    continue
                errors[f"nvlink{link}"] = str(e)
                continue
            links.append((link, state == getattr(nvml, "NVML_FEATURE_ENABLED", 1)))
        return tuple(links)
