"""The NVML adapter against a scripted NVML module with the real function names and error codes."""

from __future__ import annotations

import pynvml
import pytest

from fakes.fake_nvml import FakeNvml, Raise, h100
from screener.health.sources.nvml import NvmlAdapter, NvmlError
from screener.health.verdict.snapshot import EccCounts, GpuProcess, RetiredPages, RowRemap
from screener.types import ExitCode


def test_healthy_gpus_are_read_into_plain_snapshots():
    gpus = [h100(0, utilization=(87, 40), memory=(30 * 2**30, 80 * 2**30),
                 processes=[(4242, 30 * 2**30)]), h100(1)]
    fake = FakeNvml(gpus)
    with NvmlAdapter(fake) as nv:
        snap = nv.snapshot()
    assert snap.available and snap.driver_version == "550.54.15" and snap.device_count == 2
    g0, g1 = snap.gpus
    assert g0.uuid == gpus[0].uuid and g0.serial == "1650923000000"
    assert g0.name == "NVIDIA H100 80GB HBM3"
    assert g0.pci_bus_id == "0000:18:00" and g1.pci_bus_id == "0000:28:00"
    assert g0.ecc_enabled is True and g0.ecc == EccCounts(0, 0, 0, 0)
    assert g0.row_remap == RowRemap(0, 0, False, False)
    assert g0.retired_pages == RetiredPages(0, 0, False)
    assert g0.nvlinks == tuple((i, True) for i in range(18))
    assert g0.pcie_gen == g0.pcie_gen_max == 5 and g0.pcie_width == g0.pcie_width_max == 16
    assert g0.temperature_c == 45 and g0.power_w == 250.0
    assert g0.clock_event_reasons == ()
    assert (g0.utilization_gpu, g0.utilization_memory) == (87, 40)
    assert (g0.memory_used, g0.memory_total) == (30 * 2**30, 80 * 2**30)
    assert g0.processes == (GpuProcess(pid=4242, used_memory=30 * 2**30),)
    assert g0.busy and not g1.busy and g1.processes == ()
    assert not g0.lost and g0.unsupported == () and dict(g0.errors) == {}
    assert fake.initialized == 0  # closed: NVML shut down


def test_counters_change_between_calls():
    gpu = h100(0)
    gpu.queue("nvmlDeviceGetUtilizationRates", (10, 1), (95, 50))
    fake = FakeNvml([gpu])
    with NvmlAdapter(fake, events=False) as nv:
        a = nv.snapshot()
        gpu.set_ecc(volatile_corrected=3, aggregate_corrected=10)
        gpu.remapped_rows = (2, 0, 1, 0)
        b = nv.snapshot()
        c = nv.snapshot()  # script used up: back to the GPU's state
    assert a.gpus[0].utilization_gpu == 10 and b.gpus[0].utilization_gpu == 95
    assert c.gpus[0].utilization_gpu == 0
    assert a.gpus[0].ecc.volatile_corrected == 0 and b.gpus[0].ecc.volatile_corrected == 3
    assert b.gpus[0].ecc.aggregate_corrected == 10
    assert b.gpus[0].row_remap == RowRemap(2, 0, True, False)


def test_clock_event_reasons_are_named():
    gpu = h100(0, clock_reasons=pynvml.nvmlClocksEventReasonSwPowerCap
               | pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    with NvmlAdapter(FakeNvml([gpu])) as nv:
        g = nv.snapshot().gpus[0]
    assert g.clock_event_reasons == ("sw_power_cap", "hw_thermal_slowdown")


def test_not_supported_fields_are_none_and_listed():
    # an older part: no row remapper, no NVLink, page retirement instead
    gpu = h100(0, nvlinks=None, retired_sbe=[0x1000, 0x2000], retired_dbe=[0x3000],
               retired_pending=pynvml.NVML_FEATURE_ENABLED)
    gpu.unsupported |= {"nvmlDeviceGetRemappedRows", "nvmlDeviceGetPowerUsage"}
    with NvmlAdapter(FakeNvml([gpu])) as nv:
        g = nv.snapshot().gpus[0]
    assert g.row_remap is None and g.power_w is None and g.nvlinks == ()
    assert set(g.unsupported) == {"row_remap", "power"}
    assert g.retired_pages == RetiredPages(single_bit=2, double_bit=1, pending=True)
    assert not g.lost and dict(g.errors) == {}


def test_ecc_disabled_counters_not_supported():
    gpu = h100(0, ecc_current=pynvml.NVML_FEATURE_DISABLED,
               ecc_pending=pynvml.NVML_FEATURE_ENABLED)
    with NvmlAdapter(FakeNvml([gpu])) as nv:
        g = nv.snapshot().gpus[0]
    assert g.ecc_enabled is False and g.ecc_pending_enabled is True
    assert g.ecc == EccCounts(None, None, None, None)
    assert "ecc.volatile_uncorrected" in g.unsupported


def test_other_field_errors_are_recorded_with_their_cause_and_the_probe_goes_on():
    gpu = h100(0)
    gpu.errors["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_NO_PERMISSION
    with NvmlAdapter(FakeNvml([gpu])) as nv:
        g = nv.snapshot().gpus[0]
    assert g.power_w is None and g.temperature_c == 45
    assert "nvmlDeviceGetPowerUsage (GPU 0): Insufficient Permissions" in g.errors["power"]


def test_gpu_is_lost_midway_marks_the_gpu_lost_not_an_exception():
    gpu = h100(0)
    gpu.queue("nvmlDeviceGetPowerUsage", Raise(pynvml.NVML_ERROR_GPU_IS_LOST))
    fake = FakeNvml([gpu, h100(1)])
    with NvmlAdapter(fake) as nv:
        snap = nv.snapshot()
    g0, g1 = snap.gpus
    assert g0.lost and "GPU is lost" in g0.lost_reason
    assert "nvmlDeviceGetPowerUsage" in g0.lost_reason
    assert g0.uuid == gpu.uuid and g0.temperature_c == 45  # what was read before it went
    assert g0.power_w is None and g0.utilization_gpu is None
    assert not g1.lost and g1.power_w == 250.0


def test_gpu_that_disappears_between_probes():
    fake = FakeNvml([h100(0), h100(1)])
    with NvmlAdapter(fake) as nv:
        assert nv.snapshot().device_count == 2
        gone = fake.remove(1)
        snap = nv.snapshot()
        assert snap.device_count == 1 and [g.uuid for g in snap.gpus] == [fake.gpus[0].uuid]
        # a GPU still counted but not answering at all
        fake.gpus[0].lost = True
        g = nv.snapshot().gpus[0]
    assert g.lost and g.uuid is None and "GPU is lost" in g.lost_reason
    assert gone.lost


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
                                  pynvml.NVML_ERROR_DRIVER_NOT_LOADED])
def test_no_driver_is_unavailable_not_an_error(code):
    fake = FakeNvml([h100(0)], init_error=code)
    nv = NvmlAdapter(fake)
    assert nv.open() is False and not nv.available
    snap = nv.snapshot()
    assert not snap.available and not snap.failed and snap.gpus == ()
    assert "nvmlInit" in snap.reason
    nv.close()
    nv.close()  # harmless twice


def test_other_init_errors_raise_wrapped_with_their_cause():
    fake = FakeNvml([h100(0)], init_error=pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(NvmlError) as info:
        NvmlAdapter(fake).open()
    e = info.value
    assert isinstance(e.__cause__, pynvml.NVMLError_NoPermission)
    assert e.__cause__.value == pynvml.NVML_ERROR_NO_PERMISSION == e.code
    assert e.function == "nvmlInit" and e.exit_code == ExitCode.SCREENER_ERROR


def test_missing_binding_function_is_not_supported():
    class OldBinding(FakeNvml):
        nvmlDeviceGetRemappedRows = None  # an older pynvml without the call

    with NvmlAdapter(OldBinding([h100(0)])) as nv:
        g = nv.snapshot().gpus[0]
    assert g.row_remap is None and "row_remap" in g.unsupported


def test_deprecated_calls_are_the_fallback_for_older_drivers():
    class OldDriver(FakeNvml):
        nvmlDeviceGetCurrentClocksEventReasons = None  # only the "Throttle" name exists

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
            self._dev("nvmlDeviceGetCurrentClocksThrottleReasons", h)
            return pynvml.nvmlClocksThrottleReasonHwSlowdown

    fake = OldDriver([h100(0)])
    with NvmlAdapter(fake) as nv:
        g = nv.snapshot().gpus[0]
    assert g.clock_event_reasons == ("hw_slowdown",) and g.temperature_c == 45
    assert g.unsupported == ()  # the fake has no nvmlDeviceGetTemperatureV either: fell back
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in fake.calls


def test_xid_events_are_polled_without_blocking_and_named():
    gpus = [h100(0), h100(1), h100(2, supported_events=0)]  # GPU 2 cannot give events
    fake = FakeNvml(gpus)
    with NvmlAdapter(fake) as nv:
        assert nv.events_supported
        assert nv.snapshot().xid_events == ()
        fake.xid(1, 79)
        fake.xid(1, 79)
        fake.xid(0, 13)
        fake.xid(2, 48)  # not registered: left to the kernel log
        snap = nv.snapshot()
        assert [(e.code, e.gpu_index, e.source) for e in snap.xid_events] == [
            (79, 1, "nvml"), (79, 1, "nvml"), (13, 0, "nvml")]
        assert snap.xid_events[0].gpu_uuid == gpus[1].uuid
        assert snap.xid_events[0].pci_bus_id == "0000:28:00"
        assert nv.snapshot().xid_events == ()  # each event once
    assert "nvmlEventSetFree" in fake.calls and fake.initialized == 0


def test_events_off_registers_nothing():
    fake = FakeNvml([h100(0)])
    with NvmlAdapter(fake, events=False) as nv:
        fake.xid(0, 79)
        assert nv.snapshot().xid_events == () and not nv.events_supported
    assert "nvmlEventSetCreate" not in fake.calls
