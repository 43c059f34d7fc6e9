"""The real probes on a real GPU (NVML from the installed driver). Skipped without CUDA; the CPU
twins are test_health_nvml.py (scripted NVML) and test_health_probes.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from screener.settings.health import ProbeConfig
from screener.health.sources.nvml import NvmlAdapter
from screener.health.probes import run_probes

pytestmark = pytest.mark.gpu


def _torch_uuid(index: int) -> str:
    u = str(torch.cuda.get_device_properties(index).uuid)
    return u if u.startswith("GPU-") else f"GPU-{u}"


def test_real_nvml_snapshot_and_processes():
    x = torch.randn(2048, 2048, device="cuda:0")
    (x @ x).sum().item()  # a CUDA context and a kernel: this process is a compute process
    with NvmlAdapter() as nv:
        assert nv.available, nv.reason
        t0 = time.perf_counter()
        snap = nv.snapshot()
        elapsed = time.perf_counter() - t0
    print(f"NVML snapshot of {snap.device_count} GPU(s) in {elapsed * 1000:.1f} ms; "
          f"events supported: {snap.events_supported}")
    assert snap.driver_version and snap.device_count >= torch.cuda.device_count()
    for g in snap.gpus:
        print(json.dumps(g.to_dict(), default=str))
        assert not g.lost, g.lost_reason
        assert g.uuid and g.uuid.startswith("GPU-") and g.name
        assert g.pci_bus_id and re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}", g.pci_bus_id)
        assert g.temperature_c is not None and g.memory_total and g.memory_total > 0
        assert g.utilization_gpu is not None and g.processes is not None
        assert g.pcie_width_max and g.pcie_gen_max
    mine = next(g for g in snap.gpus if g.uuid == _torch_uuid(0))
    # NVML lists the compute processes of the GPU (host PIDs inside a container, so only count)
    assert len(mine.processes) >= 1 and mine.memory_used > 0


def test_real_probes_report_and_command():
    t0 = time.perf_counter()
    report = run_probes(ProbeConfig(kmsg_path=None, min_free_memory_fraction=0.0,
                                    min_free_disk_fraction=0.0))
    print(f"run_probes in {(time.perf_counter() - t0) * 1000:.1f} ms")
    for f in report.findings:
        print(f.severity.label, f.code, f.gpu, f.message)
    assert report.snapshot.nvml.available
    assert "nvml_unavailable" not in {f.code for f in report.findings}
    assert not report.errors, report.errors
    json.dumps(report.to_dict(), default=str)
    # an adapter kept open polls its event set without blocking
    with NvmlAdapter() as nv:
        t0 = time.perf_counter()
        events, errors = nv.poll_xids()
        assert time.perf_counter() - t0 < 1.0 and not errors
    r = subprocess.run([sys.executable, "-m", "screener.cli", "probe", "--json", "--no-kmsg"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 75), r.stderr
    d = json.loads(r.stdout)
    assert d["driver_version"] and d["nvml"]["device_count"] >= 1
    assert d["exit_code"] == r.returncode
