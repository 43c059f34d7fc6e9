"""Idle detection: foreign compute processes, GPU pods and utilisation, held for the idle window.
GPU snapshots come from the real NVML adapter over the scripted NVML; pods from the real KubeStore
over the Kubernetes API test server."""

from __future__ import annotations

import os
import subprocess
import sys

from pynvml import NVML_ERROR_NO_PERMISSION

from fakes.fake_nvml import FakeNvml, h100
from fakes.kubeapi import KubeAPI
from screener.health.sources.host import own_pids
from screener.health.verdict.idle import IdleTracker, observe
from screener.health.sources.nvml import NvmlAdapter
from screener.stores.kube import KubeStore


def snapshot(nvml: FakeNvml):
    with NvmlAdapter(nvml, events=False) as a:
        return a.snapshot().gpus


def test_observe_reads_processes_pods_and_utilisation():
    nvml = FakeNvml([h100(0), h100(1)])
    assert not observe(snapshot(nvml), None).busy
    nvml.gpus[0].processes = [(os.getpid(), 1 << 30), (31337, None)]
    a = observe(snapshot(nvml), None, own={os.getpid()})
    assert a.job_present and a.foreign_processes == (("GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", 31337),)
    nvml.gpus[0].processes = []
    nvml.gpus[1].utilization = (7, 1)
    a = observe(snapshot(nvml), None, utilization_pct=5)
    assert a.busy and not a.job_present and "7%" in a.reason
    assert not observe(snapshot(nvml), None, utilization_pct=10).busy


def test_gpu_pods_from_the_api_count_except_our_own_and_finished_ones():
    with KubeAPI() as api:
        api.add_node("n1")
        api.add_pod("screener-abc", "n1", namespace="screener-system", gpus=1)
        api.add_pod("done", "n1", gpus=8, phase="Succeeded")
        api.add_pod("cpu-only", "n1", gpus=0)
        api.add_pod("elsewhere", "n2", gpus=8)
        store = KubeStore(api.api_client(), sleep=lambda s: None, instance="t")
        try:
            a = observe((), store.gpu_pods("n1"), own_pod="screener-abc")
            assert not a.busy
            api.add_pod("trainer-1", "n1", namespace="ml", gpus=4)
            a = observe((), store.gpu_pods("n1"), own_pod="screener-abc")
            assert a.gpu_pods == ("ml/trainer-1",) and a.job_present
        finally:
            store.close()


def test_a_pod_list_that_fails_means_not_idle():
    a = observe((), None, pods_error="connection refused")
    assert a.busy and not a.job_present and "connection refused" in a.reason


def test_a_process_list_nvml_cannot_read_means_not_idle():
    nvml = FakeNvml([h100(0)])
    nvml.gpus[0].errors["nvmlDeviceGetComputeRunningProcesses"] = NVML_ERROR_NO_PERMISSION
    a = observe(snapshot(nvml), None)
    assert a.busy and not a.job_present and "compute processes on GPU" in a.reason
    # a GPU that does not support the call at all is judged by utilisation alone
    nvml.gpus[0].errors.clear()
    nvml.gpus[0].unsupported.add("nvmlDeviceGetComputeRunningProcesses")
    assert not observe(snapshot(nvml), None).busy


def test_the_tracker_needs_quiet_for_the_whole_window():
    quiet = observe((), [])
    busy = observe((), [{"name": "x", "namespace": "ml"}])
    t = IdleTracker(300.0)
    assert not t.update(quiet, 0.0)
    assert not t.update(quiet, 299.0)
    assert t.update(quiet, 300.0)
    assert not t.update(busy, 310.0)  # a job resets the window
    assert not t.update(quiet, 320.0)
    assert t.update(quiet, 620.0)
    t.reset()
    assert not t.idle(10_000.0)


def test_own_pids_include_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pids = own_pids()
        assert os.getpid() in pids and child.pid in pids
    finally:
        child.kill()
        child.wait()
