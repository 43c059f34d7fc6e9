"""Every health rule, on plain snapshots (previous and current)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from screener.health.verdict.rules import (NO_DRIVER_MESSAGE, RETIRED_PAGES_REPAIR, evaluate, host_rules,
                                           is_condition, worst_severity, xid_rules)
from screener.health.verdict.snapshot import (DiskUsage, EccCounts, GpuProcess, GpuSnapshot, HostSnapshot,
                                              MountCheck, NvmlSnapshot, ProbeSnapshot, RetiredPages,
                                              RowRemap, XidEvent)
from screener.settings.health import ProbeConfig
from screener.types import Severity

CFG = ProbeConfig(kmsg_path=None)


def gpu(index=0, **kw):
    base = dict(index=index, uuid=f"GPU-{index}", serial=f"S{index}", name="H100",
                pci_bus_id=f"0000:{0x18 + 16 * index:02x}:00", ecc_enabled=True,
                ecc=EccCounts(0, 0, 0, 0), row_remap=RowRemap(0, 0, False, False),
                clock_event_reasons=(), pcie_gen=5, pcie_gen_max=5, pcie_width=16,
                pcie_width_max=16, nvlinks=tuple((i, True) for i in range(18)),
                utilization_gpu=0, processes=())
    base.update(kw)
    return GpuSnapshot(**base)


def probe(*gpus, xids=(), host=None, count=None, **kw):
    nv = NvmlSnapshot(available=True, driver_version="550", device_count=len(gpus)
                      if count is None else count, gpus=tuple(gpus))
    return ProbeSnapshot(taken_at=0.0, nvml=nv, xids=tuple(xids), host=host, **kw)


def codes(findings):
    return [(f.code, f.severity) for f in findings]


def only(findings, code):
    found = [f for f in findings if f.code == code]
    assert len(found) == 1, codes(findings)
    return found[0]


def test_healthy_node_has_no_findings():
    assert evaluate(probe(gpu(0), gpu(1)), None, CFG) == []
    assert evaluate(probe(gpu(0), gpu(1)), probe(gpu(0), gpu(1)), CFG) == []


# --- NVML-level -------------------------------------------------------------------------------


def test_no_driver_is_one_info_finding():
    snap = ProbeSnapshot(taken_at=0, nvml=NvmlSnapshot(available=False, reason="no lib"))
    f = evaluate(snap, None, CFG)
    assert codes(f) == [("nvml_unavailable", Severity.INFO)]
    assert f[0].message == NO_DRIVER_MESSAGE == "no NVIDIA driver: GPU probes skipped"


def test_no_driver_where_gpus_are_expected_is_critical():
    snap = ProbeSnapshot(taken_at=0, nvml=NvmlSnapshot(available=False, reason="no lib"))
    f = evaluate(snap, None, replace(CFG, expected_gpus=8))
    assert codes(f) == [("gpu_missing", Severity.CRITICAL), ("nvml_unavailable", Severity.INFO)]


def test_nvml_failure_gives_no_hardware_verdict():
    snap = ProbeSnapshot(taken_at=0, nvml=NvmlSnapshot(available=False, failed=True, reason="x"))
    assert evaluate(snap, None, replace(CFG, expected_gpus=8)) == []


def test_fewer_gpus_than_expected_is_critical():
    f = only(evaluate(probe(gpu(0)), None, replace(CFG, expected_gpus=2)), "gpu_missing")
    assert f.severity is Severity.CRITICAL and "fallen off the bus" in f.message
    assert f.evidence["expected"] == 2 and f.evidence["found"] == 1
    assert evaluate(probe(gpu(0), gpu(1)), None, replace(CFG, expected_gpus=2)) == []


def test_gpu_gone_since_the_last_probe_is_critical_without_an_expected_count():
    f = only(evaluate(probe(gpu(0)), probe(gpu(0), gpu(1)), CFG), "gpu_missing")
    assert f.severity is Severity.CRITICAL and f.gpu == "GPU-1"
    assert f.evidence["serial"] == "S1"


def test_missing_gpu_is_named_once_when_both_rules_see_it():
    cfg = replace(CFG, expected_gpus=3)
    before = probe(gpu(0), gpu(1), gpu(2))
    f = evaluate(probe(gpu(0), gpu(2)), before, cfg)
    assert codes(f) == [("gpu_missing", Severity.CRITICAL)] and f[0].gpu == "GPU-1"
    # two gone, one of them never seen by this daemon: the count finding covers the rest
    f = evaluate(probe(gpu(0)), probe(gpu(0), gpu(1)), cfg)
    assert sorted((x.gpu or "") for x in f) == ["", "GPU-1"]


def test_gpu_that_stopped_answering_is_critical_once():
    lost = GpuSnapshot(index=1, lost=True, lost_reason="nvmlDeviceGetUUID (GPU 1): GPU is lost")
    f = evaluate(probe(gpu(0), lost), probe(gpu(0), gpu(1)), CFG)
    assert codes(f) == [("gpu_lost", Severity.CRITICAL)]  # not also "missing"
    assert "GPU is lost" in f[0].evidence["error"]


# --- memory -----------------------------------------------------------------------------------


def test_pending_row_remap_drains_and_resets():
    f = only(evaluate(probe(gpu(0, row_remap=RowRemap(3, 1, True, False))), None, CFG),
             "row_remap_pending")
    assert f.severity is Severity.SUSPECT and "reset" in f.action and f.gpu == "GPU-0"
    assert f.evidence["uncorrectable_rows"] == 1 and f.evidence["uuid"] == "GPU-0"


def test_row_remap_failure_removes_the_gpu_from_service():
    f = only(evaluate(probe(gpu(0, row_remap=RowRemap(0, 8, False, True))), None, CFG),
             "row_remap_failure")
    assert f.severity is Severity.CRITICAL and "repair" in f.action


def test_pending_page_retirement_on_older_parts():
    g = gpu(0, row_remap=None, retired_pages=RetiredPages(2, 1, True))
    f = only(evaluate(probe(g), None, CFG), "retired_pages_pending")
    assert f.severity is Severity.SUSPECT


def test_retired_pages_over_the_threshold_mean_repair_and_are_a_condition():
    under = gpu(0, row_remap=None, retired_pages=RetiredPages(RETIRED_PAGES_REPAIR - 2, 1, False))
    assert evaluate(probe(under), None, CFG) == []
    over = gpu(0, row_remap=None, retired_pages=RetiredPages(RETIRED_PAGES_REPAIR - 2, 2, False))
    f = only(evaluate(probe(over), None, CFG), "retired_pages_over_threshold")
    assert f.severity is Severity.CRITICAL and "repair" in f.action and is_condition(f)
    assert f.evidence["serial"] == "S0"


def test_first_uncorrectable_errors_are_suspect():
    f = only(evaluate(probe(gpu(0, ecc=EccCounts(0, 2, 0, 2))), None, CFG), "ecc_uncorrectable")
    assert f.severity is Severity.SUSPECT and f.evidence["volatile_uncorrected"] == 2


def test_uncorrectable_errors_back_after_a_reset_mean_repair():
    # lifetime total larger than the count since the last reset: they were there before it too
    f = only(evaluate(probe(gpu(0, ecc=EccCounts(0, 1, 0, 3))), None, CFG),
             "ecc_uncorrectable_recurring")
    assert f.severity is Severity.CRITICAL and "repair" in f.action
    # seen across probes: the volatile count went down (a reset) and is non-zero again
    before = probe(gpu(0, ecc=EccCounts(0, 4, None, None)))
    after = probe(gpu(0, ecc=EccCounts(0, 1, None, None)))
    assert only(evaluate(after, before, CFG), "ecc_uncorrectable_recurring").severity \
        is Severity.CRITICAL


def test_uncorrectable_history_only_is_info():
    f = only(evaluate(probe(gpu(0, ecc=EccCounts(0, 0, 0, 5))), None, CFG),
             "ecc_uncorrectable_history")
    assert f.severity is Severity.INFO


def test_rising_corrected_count_between_probes_is_a_warning():
    before = probe(gpu(0, ecc=EccCounts(10, 0, 100, 0)))
    after = probe(gpu(0, ecc=EccCounts(15, 0, 105, 0)))
    f = only(evaluate(after, before, CFG), "ecc_corrected_rising")
    assert f.severity is Severity.WARNING
    assert f.evidence["counters"]["volatile_corrected"] == {"before": 10, "now": 15, "delta": 5}
    assert evaluate(after, after, CFG) == []  # steady: nothing
    assert evaluate(after, None, CFG) == []  # no previous probe: a count alone is not a trend


def test_ecc_disabled_is_info():
    f = only(evaluate(probe(gpu(0, ecc_enabled=False, ecc=EccCounts())), None, CFG),
             "ecc_disabled")
    assert f.severity is Severity.INFO


# --- clocks -----------------------------------------------------------------------------------


def test_thermal_throttling_while_busy_is_a_warning():
    busy = gpu(0, clock_event_reasons=("hw_thermal_slowdown",), utilization_gpu=97,
               temperature_c=91)
    f = only(evaluate(probe(busy), None, CFG), "clocks_throttled")
    assert f.severity is Severity.WARNING and "straggler" in f.message
    assert f.evidence["temperature_c"] == 91
    with_procs = gpu(0, clock_event_reasons=("hw_slowdown",), utilization_gpu=0,
                     processes=(GpuProcess(1),))
    assert only(evaluate(probe(with_procs), None, CFG), "clocks_throttled")


def test_throttling_while_idle_is_ignored():
    idle = gpu(0, clock_event_reasons=("sw_thermal_slowdown", "gpu_idle"), utilization_gpu=3)
    assert evaluate(probe(idle), None, CFG) == []


def test_power_cap_is_info_unless_configured_as_warning():
    g = gpu(0, clock_event_reasons=("sw_power_cap",), utilization_gpu=100)
    assert only(evaluate(probe(g), None, CFG), "clocks_power_capped").severity is Severity.INFO
    cfg = replace(CFG, power_cap_is_warning=True)
    assert only(evaluate(probe(g), None, cfg), "clocks_power_capped").severity is \
        Severity.WARNING


# --- links ------------------------------------------------------------------------------------


def test_pcie_width_below_maximum_is_suspect():
    f = only(evaluate(probe(gpu(0, pcie_width=8)), None, CFG), "pcie_degraded")
    assert f.severity is Severity.SUSPECT and "x8 of x16" in f.message


def test_pcie_generation_below_maximum_counts_only_while_busy():
    assert evaluate(probe(gpu(0, pcie_gen=1)), None, CFG) == []  # idle GPUs downclock the link
    f = only(evaluate(probe(gpu(0, pcie_gen=3, utilization_gpu=80)), None, CFG), "pcie_degraded")
    assert "gen 3 of 5" in f.message


def test_nvlink_down_while_others_are_up_is_suspect():
    links = tuple((i, i != 7) for i in range(18))
    f = only(evaluate(probe(gpu(0, nvlinks=links)), None, CFG), "nvlink_down")
    assert f.severity is Severity.SUSPECT and f.evidence["down"] == [7]
    assert f.evidence["active"] == 17


def test_gpu_without_nvlink_is_not_flagged_but_a_whole_gpu_going_down_is():
    all_down = tuple((i, False) for i in range(4))
    assert evaluate(probe(gpu(0, nvlinks=all_down)), None, CFG) == []
    assert evaluate(probe(gpu(0, nvlinks=())), None, CFG) == []
    was_up = probe(gpu(0, nvlinks=tuple((i, True) for i in range(4))))
    f = only(evaluate(probe(gpu(0, nvlinks=all_down)), was_up, CFG), "nvlink_down")
    assert f.evidence["went_down"] == [0, 1, 2, 3]


def test_fewer_active_nvlinks_than_expected():
    cfg = replace(CFG, expected_nvlinks=18)
    f = only(evaluate(probe(gpu(0, nvlinks=tuple((i, True) for i in range(12)))), None, cfg),
             "nvlink_down")
    assert "12 active, expected 18" in f.message
    assert evaluate(probe(gpu(0)), None, cfg) == []


# --- Xids -------------------------------------------------------------------------------------


def xid(code, index=0, **kw):
    return XidEvent(code=code, source=kw.pop("source", "kmsg"), gpu_index=index,
                    gpu_uuid=f"GPU-{index}", pci_bus_id=f"0000:{0x18 + 16 * index:02x}:00", **kw)


def test_xid_findings_follow_the_catalog():
    f = xid_rules([xid(79), xid(13, index=1, pid=7, process="train.py"), xid(63)])
    by = {x.evidence["xid"]: x for x in f}
    assert by[79].severity is Severity.CRITICAL and by[79].evidence["resolution"] == "RESTART_BM"
    assert by[79].evidence["classification"] == "hardware" and by[79].gpu == "GPU-0"
    assert by[13].severity is Severity.INFO and by[13].evidence["classification"] == "software"
    assert by[13].evidence["pids"] == [7] and by[13].evidence["processes"] == ["train.py"]
    assert by[63].severity is Severity.WARNING
    assert all(x.code == "xid" for x in f)


def test_repeated_xids_from_both_sources_are_one_finding_with_a_count():
    f = xid_rules([xid(13), xid(13), xid(13, source="nvml"), xid(13, index=1)])
    assert len(f) == 2
    first = next(x for x in f if x.gpu == "GPU-0")
    assert first.evidence["count"] == 3 and first.evidence["sources"] == ["kmsg", "nvml"]
    assert "x3" in first.message


def test_unknown_xid_is_reported_never_dropped():
    f = xid_rules([XidEvent(code=4242, source="kmsg", pci_bus_id="0000:99:00")])
    assert len(f) == 1 and f[0].severity is Severity.WARNING
    assert f[0].evidence["classification"] == "unknown" and f[0].gpu == "0000:99:00"


def test_xids_in_evaluate_are_sorted_worst_first():
    f = evaluate(probe(gpu(0), xids=[xid(13), xid(79)]), None, CFG)
    assert [x.evidence["xid"] for x in f] == [79, 13]
    assert worst_severity(f) is Severity.CRITICAL
    assert worst_severity([]) is Severity.OK


# --- host and kernel log ----------------------------------------------------------------------


def host(**kw):
    base = dict(memory_total=100, memory_available=50,
                mounts=(MountCheck("/fsx", True),), disks=(DiskUsage("/", 1000, 500),))
    base.update(kw)
    return HostSnapshot(**base)


def test_host_healthy():
    assert host_rules(host(), CFG) == []


def test_missing_mount_is_suspect():
    f = host_rules(host(mounts=(MountCheck("/fsx", False), MountCheck("/data", True))), CFG)
    assert codes(f) == [("mount_missing", Severity.SUSPECT)] and f[0].evidence["path"] == "/fsx"


@pytest.mark.parametrize("kw,code", [
    (dict(memory_available=4), "memory_low"),
    (dict(disks=(DiskUsage("/", 1000, 10),)), "disk_low"),
])
def test_low_headroom_is_a_warning(kw, code):
    f = host_rules(host(**kw), CFG)
    assert codes(f) == [(code, Severity.WARNING)]


def test_unreadable_kernel_log_is_info():
    snap = probe(gpu(0), kmsg_status="unavailable", kmsg_reason="permission denied")
    f = evaluate(snap, None, CFG)
    assert codes(f) == [("kmsg_unavailable", Severity.INFO)]
    assert evaluate(probe(gpu(0), kmsg_status="disabled"), None, CFG) == []
