"""run_probes end to end (scripted NVML, real log files, real psutil), the config, and the
`screener probe` command through the real console entry point."""

from __future__ import annotations

import json
import pathlib
import psutil
import shutil
import subprocess
import sys

import pynvml
import pytest

from fakes.fake_nvml import FakeNvml, h100
from screener.errors import ConfigError
from screener.health.sources.kmsg import KernelLogReader
from screener.health.sources.nvml import NvmlAdapter
from screener.health.probes import DeferredKernelLogReader, run_probes
from screener.settings.health import ProbeConfig
from screener.types import ExitCode, Severity

DATA = pathlib.Path(__file__).parent / "data"
QUIET = dict(min_free_memory_fraction=0.0, min_free_disk_fraction=0.0)  # this host's headroom


def codes(report):
    return sorted((f.code, f.severity.label) for f in report.findings)


def test_kernel_log_xids_are_matched_to_nvml_gpus_by_pci(tmp_path):
    fake = FakeNvml([h100(0), h100(1), h100(2)])  # PCI 0000:18, 0000:28, 0000:38
    config = ProbeConfig(kmsg_path=str(DATA / "kmsg_sample.log"), **QUIET)
    report = run_probes(config, nvml=fake)
    xids = {(f.evidence["xid"], f.evidence["index"]) for f in report.findings if f.code == "xid"}
    assert {(79, 0), (48, 1), (63, 1), (13, 2), (31, 2), (154, 0)} <= xids
    assert (94, None) in xids  # PCI 0000:48 is no GPU this node has: kept, with its address
    f79 = next(f for f in report.findings if f.evidence.get("xid") == 79)
    assert f79.gpu == fake.gpus[0].uuid and f79.severity is Severity.CRITICAL
    assert report.exit_code == ExitCode.HARDWARE_SUSPECT == 75
    d = json.loads(json.dumps(report.to_dict()))
    j79 = next(f for f in d["findings"] if f.get("xid", {}).get("code") == 79)
    assert j79["xid"] == {"code": 79, "name": "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
                          "resolution": "RESTART_BM", "classification": "hardware"}
    assert j79["severity"] == "critical" and j79["gpu"] == fake.gpus[0].uuid
    j13 = next(f for f in d["findings"] if f.get("xid", {}).get("code") == 13)
    assert j13["xid"]["classification"] == "software" and j13["severity"] == "info"


def test_daemon_style_successive_probes(tmp_path):
    """One adapter and one reader kept open; each signal is reported when it appears, once."""
    gpus = [h100(0, utilization=(90, 50), processes=[(31337, 2**30)]), h100(1)]
    fake = FakeNvml(gpus)
    log = tmp_path / "kern.log"
    log.write_text("")
    state = tmp_path / "kmsg.json"
    config = ProbeConfig(kmsg_path=str(log), kmsg_state_file=str(state), expected_gpus=2, **QUIET)
    with NvmlAdapter(fake) as nv, KernelLogReader(str(log), state_file=str(state)) as km:
        r1 = run_probes(config, nvml=nv, kmsg=km)
        assert r1.findings == () and r1.exit_code == ExitCode.PASS
        # what the daemon uses for idle detection
        assert r1.gpus[0].busy and r1.gpus[0].utilization_gpu == 90
        assert [p.pid for p in r1.gpus[0].processes] == [31337]
        assert not r1.gpus[1].busy

        gpus[1].set_ecc(volatile_corrected=7, aggregate_corrected=7)
        fake.xid(0, 94)
        with open(log, "a") as f:
            f.write("[9.0] NVRM: Xid (PCI:0000:18:00): 94, pid=31337, name=python3, Contained\n")
        r2 = run_probes(config, nvml=nv, kmsg=km, previous=r1)
        assert codes(r2) == [("ecc_corrected_rising", "warning"), ("xid", "suspect")]
        x = next(f for f in r2.findings if f.code == "xid")
        assert x.evidence["sources"] == ["kmsg", "nvml"] and x.evidence["count"] == 2

        r3 = run_probes(config, nvml=nv, kmsg=km, previous=r2)
        assert r3.findings == ()  # nothing new: no rise, no Xid raised twice

        gpus[0].remapped_rows = (0, 1, 1, 0)
        fake.remove(1)
        r4 = run_probes(config, nvml=nv, kmsg=km, previous=r3)
        assert codes(r4) == [("gpu_missing", "critical"), ("row_remap_pending", "suspect")]
        assert r4.worst is Severity.CRITICAL
        assert next(f for f in r4.findings if f.code == "gpu_missing").gpu == gpus[1].uuid

    # a restarted daemon with the saved kernel-log position does not re-raise the old Xid
    fresh = FakeNvml([h100(0)])
    r5 = run_probes(ProbeConfig(kmsg_path=str(log), kmsg_state_file=str(state), **QUIET),
                    nvml=fresh)
    assert r5.findings == ()


def test_no_driver_reports_one_info_finding_and_passes():
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    report = run_probes(ProbeConfig(kmsg_path=None, **QUIET), nvml=fake)
    assert [(f.severity, f.message) for f in report.findings] == [
        (Severity.INFO, "no NVIDIA driver: GPU probes skipped")]
    assert report.exit_code == ExitCode.PASS and report.errors == ()


def test_nvml_failure_is_our_error_not_a_hardware_finding():
    fake = FakeNvml([h100(0)], init_error=pynvml.NVML_ERROR_NO_PERMISSION)
    report = run_probes(ProbeConfig(kmsg_path=None, expected_gpus=8, **QUIET), nvml=fake)
    assert report.findings == ()
    assert report.errors and "Insufficient Permissions" in report.errors[0]
    assert report.exit_code == ExitCode.SCREENER_ERROR


def test_unreadable_kernel_log_is_info_and_the_run_goes_on(tmp_path):
    config = ProbeConfig(kmsg_path=str(tmp_path / "missing.log"), **QUIET)
    report = run_probes(config, nvml=FakeNvml([h100(0)]))
    assert codes(report) == [("kmsg_unavailable", "info")]
    assert report.exit_code == ExitCode.PASS


def test_host_checks_with_real_psutil(tmp_path):
    config = ProbeConfig(kmsg_path=None, required_mounts=("/", str(tmp_path / "not-a-mount")),
                         min_free_memory_fraction=1.0, disk_paths=("/",),
                         min_free_disk_fraction=0.0)
    report = run_probes(config, nvml=FakeNvml([h100(0)]))
    assert codes(report) == [("memory_low", "warning"), ("mount_missing", "suspect")]
    missing = next(f for f in report.findings if f.code == "mount_missing")
    assert missing.evidence["path"] == str(tmp_path / "not-a-mount")
    assert report.snapshot.host.mounts[0].present  # "/" is always mounted
    bad_disk = run_probes(ProbeConfig(kmsg_path=None, disk_paths=(str(tmp_path / "gone"),),
                                      **QUIET), nvml=FakeNvml([h100(0)]))
    assert bad_disk.errors and bad_disk.exit_code == ExitCode.SCREENER_ERROR


def test_unreadable_mount_table_is_our_error_not_a_missing_mount():
    class NoMountTable:
        """psutil, except that the mount table cannot be read (the boundary, not our code)."""

        virtual_memory, disk_usage = staticmethod(psutil.virtual_memory), \
            staticmethod(psutil.disk_usage)

        @staticmethod
        def disk_partitions(all: bool = False):
            raise PermissionError(13, "Permission denied", "/proc/self/mounts")

    config = ProbeConfig(kmsg_path=None, required_mounts=("/fsx",), **QUIET)
    report = run_probes(config, nvml=FakeNvml([h100(0)]), psutil_module=NoMountTable)
    assert report.findings == ()  # we could not look, so nothing is reported missing
    assert report.snapshot.host.mounts == ()
    assert any("mounts" in e and "Permission denied" in e for e in report.errors)
    assert report.exit_code == ExitCode.SCREENER_ERROR


# --- config -----------------------------------------------------------------------------------


def test_config_from_mapping_rejects_unknown_keys_and_bad_values():
    c = ProbeConfig.from_mapping({"expected_gpus": 8, "required_mounts": ["/fsx"],
                                  "kmsg_first_read": "end"})
    assert c.expected_gpus == 8 and c.required_mounts == ("/fsx",)
    with pytest.raises(ConfigError, match="unknown key.*expected_gpu\\b"):
        ProbeConfig.from_mapping({"expected_gpu": 8})
    for bad in ({"expected_gpus": -1}, {"expected_gpus": True}, {"min_free_disk_fraction": 2},
                {"required_mounts": "/fsx"}, {"kmsg_first_read": "later"},
                {"busy_utilization": 101}, {"nvml_events": "yes"}):
        with pytest.raises(ConfigError, match="probe config"):
            ProbeConfig.from_mapping(bad)
    with pytest.raises(ConfigError):
        ProbeConfig.from_mapping(["expected_gpus"])
    assert ProbeConfig.from_mapping(c.to_dict()) == c


# --- the command ------------------------------------------------------------------------------


def screener(*args):
    return subprocess.run([sys.executable, "-m", "screener.cli", *args], capture_output=True,
                          text=True, timeout=120)


def _driver_present() -> bool:
    nv = NvmlAdapter(events=False)
    try:
        return nv.open()
    except Exception:
        return True
    finally:
        nv.close()


HAS_DRIVER = _driver_present()


@pytest.mark.skipif(HAS_DRIVER, reason="an NVIDIA driver is present (see the gpu test)")
def test_cli_without_a_driver_prints_the_info_finding_and_exits_0():
    r = screener("probe", "--no-kmsg")
    assert r.returncode == 0, r.stderr
    assert "no NVIDIA driver: GPU probes skipped" in r.stdout and "worst: info" in r.stdout
    r = screener("probe", "--no-kmsg", "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["exit_code"] == 0
    assert [f["code"] for f in d["findings"]] == ["nvml_unavailable"]


def test_cli_reads_xids_from_a_file_and_exits_75(tmp_path):
    log = tmp_path / "kern.log"
    shutil.copy(DATA / "kmsg_sample.log", log)
    state = tmp_path / "state.json"
    r = screener("probe", "--json", "--kmsg", str(log), "--kmsg-state", str(state))
    assert r.returncode == 75, r.stderr
    d = json.loads(r.stdout)
    x = {f["xid"]["code"]: f for f in d["findings"] if f["code"] == "xid"}
    assert set(x) == {79, 48, 63, 13, 31, 94, 95, 74, 119, 999, 154}
    assert x[79]["xid"]["classification"] == "hardware" and x[79]["gpu"] == "0000:18:00"
    assert x[13]["xid"]["classification"] == "software"
    assert x[999]["xid"]["classification"] == "unknown"
    # the same file again with the saved position: nothing new, nothing suspect
    r = screener("probe", "--kmsg", str(log), "--kmsg-state", str(state))
    assert "xid" not in r.stdout
    if not HAS_DRIVER:
        assert r.returncode == 0, r.stdout


def test_cli_table_and_required_mount(tmp_path):
    r = screener("probe", "--no-kmsg", "--require-mount", str(tmp_path / "fsx"))
    assert r.returncode == 75
    assert "SEVERITY" in r.stdout and "mount_missing" in r.stdout
    assert "-> mount_missing" in r.stdout and "restore the mount" in r.stdout


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    r = screener("probe", "--kmsg", str(tmp_path / "missing.log"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "missing.log" in r.stderr
    assert "Traceback" not in r.stderr
    r = screener("probe", "--expected-gpus", "-1")
    assert r.returncode == 2


def test_cli_help():
    r = screener("probe", "--help")
    assert r.returncode == 0 and "--kmsg" in r.stdout and "75" in r.stdout


def test_the_deferred_reader_saves_its_position_only_on_commit(tmp_path):
    log_file = tmp_path / "kern.log"
    log_file.write_text("[ 1.0] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus.\n")
    state = tmp_path / "kmsg.json"
    first = DeferredKernelLogReader(str(log_file), state_file=str(state))
    assert [e.code for e in first.read_new().events] == [79]
    assert first.read_new().events == ()  # in memory the position moved on
    assert not state.exists()  # but nothing was saved: a restart reads the Xid again
    again = DeferredKernelLogReader(str(log_file), state_file=str(state))
    assert [e.code for e in again.read_new().events] == [79]
    again.commit()
    assert DeferredKernelLogReader(str(log_file), state_file=str(state)).read_new().events == ()
