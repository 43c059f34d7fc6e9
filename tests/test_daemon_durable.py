"""Nothing is lost: a critical Xid 79 that arrives while the state disk is full.

The state disk is full for real: a 2 MiB tmpfs mounted over the test's folder (as root) and filled
up to ENOSPC, so SQLite answers SQLITE_FULL exactly as on a node. Where mounting is not allowed,
the same SQLITE_FULL comes from the database's own size limit (PRAGMA max_page_count) on the
store's connection. The kernel log is a real file read by the real reader; NVML is the scripted
fake at the boundary.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest

from fakes.fake_nvml import FakeNvml, h100
from screener.settings.daemon import DaemonConfig
from screener.agent.daemon.loop import Daemon
from screener.settings.health import ProbeConfig
from screener.health.sources.nvml import NvmlAdapter
from screener.health.probes import DeferredKernelLogReader, NodeProbes
from screener.agent.screening.window import LocalTaint
from screener.stores.local import LocalStore
from screener.types import NodeState
from fakes.clock import FakeClock
from fakes.daemon import FakeHost, ScriptedRunner

NODE = "gpu-node-1"
XID_79 = ("[ 4242.000001] NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, "
          "GPU has fallen off the bus.\n")


class FullDisk:
    """A small filesystem that can be filled to ENOSPC and freed again."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.mounted = False
        if os.geteuid() == 0:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)],
                               capture_output=True)
            self.mounted = r.returncode == 0
        self.filler = root / "filler"
        self.store: Any = None

    def fill(self) -> None:
        if not self.mounted:
            # No mount allowed here: the database's own size limit gives the same SQLITE_FULL.
            pages = self.store._db.execute("PRAGMA page_count").fetchone()[0]
            self.store._db.execute(f"PRAGMA max_page_count = {pages}")
            return
        chunk = b"\0" * 65536
        with open(self.filler, "ab") as f:
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        # Whatever a 64 KiB chunk left: fill it byte-wise.
        with open(self.filler, "ab", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 512)
            except OSError as e:
                assert e.errno == errno.ENOSPC

    def free(self) -> None:
        if not self.mounted:
            self.store._db.execute("PRAGMA max_page_count = 1073741823")
            return
        self.filler.unlink()

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.root)], capture_output=True)


@pytest.fixture
def disk(tmp_path):
    d = FullDisk(tmp_path / "state")
    yield d
    d.close()


def make_daemon(tmp_path: Path, disk: FullDisk, clock: FakeClock, nvml: FakeNvml,
                kern_log: Path) -> tuple[Daemon, Callable[[], None]]:
    store = LocalStore(disk.root / "state.db")
    disk.store = store
    adapter = NvmlAdapter(nvml, events=False)
    adapter.open()
    # The position lives on another disk that has room: only the daemon's ordering keeps it
    # from running ahead of the transition.
    reader = DeferredKernelLogReader(str(kern_log), state_file=str(tmp_path / "kmsg.json"))
    cfg = ProbeConfig(kmsg_path=None, disk_paths=(str(tmp_path),), min_free_disk_fraction=0.0,
                      min_free_memory_fraction=0.0)

    config = DaemonConfig.from_mapping(dict(node=NODE, alarm_dir=str(tmp_path / "alarms"),
                                            store="local", probe_interval_s=60.0, screens=False,
                                            metrics_port=-1, untaint_retry_s=0.01))
    # The real probes port: run_probes over the NVML adapter and the deferred reader, whose
    # position commit() saves.
    probes = NodeProbes(cfg, nvml=adapter, kmsg=reader, clock=clock)
    daemon = Daemon(config, store=store, probes=probes, runner=ScriptedRunner(),
                    taint=LocalTaint(tmp_path / "taint"), clock=clock,
                    host=FakeHost(boot=lambda: 0.0))

    def close() -> None:
        reader.close()
        adapter.close()
        store.close()

    return daemon, close


def offset(disk: FullDisk) -> int:
    return json.loads((disk.root.parent / "kmsg.json").read_text())["offset"]


def test_an_xid_79_on_a_full_state_disk_is_applied_once_space_returns(tmp_path, disk):
    kern_log = tmp_path / "kern.log"
    kern_log.write_text("[    1.000000] Linux version 6.8\n")
    clock = FakeClock()
    nvml = FakeNvml([h100(0), h100(1)])
    daemon, close = make_daemon(tmp_path, disk, clock, nvml, kern_log)
    try:
        first = daemon.tick()
        assert first.state == NodeState.BURNIN and first.errors == []
        saved = offset(disk)
        assert saved == kern_log.stat().st_size  # nothing to wait for: committed

        disk.fill()
        with open(kern_log, "a") as f:
            f.write(XID_79)
        clock.advance(60.0)
        failed = daemon.tick()
        assert any("full" in e for e in failed.errors), failed.errors
        assert daemon.store.get_state(NODE) == NodeState.BURNIN
        assert offset(disk) == saved  # the kernel-log position did not move
        clock.advance(5.0)
        again = daemon.tick()  # retried on the next tick, still full
        assert again.errors and not again.probed
        assert offset(disk) == saved
    finally:
        close()

    # The daemon dies here (nothing of its memory survives); space is freed; a new one starts.
    disk.free()
    clock.advance(5.0)
    daemon, close = make_daemon(tmp_path, disk, clock, nvml, kern_log)
    try:
        report = daemon.tick()
        assert report.errors == [] and report.state == NodeState.QUARANTINED
        t = daemon.store.history(NODE)[-1]
        assert t.code == "Xid" and t.evidence["findings"][0]["evidence"]["xid"] == 79
        assert offset(disk) == kern_log.stat().st_size  # saved only now, after the transition
        # The unrecovered Xid 79 stays a condition on later probes; nothing is applied twice.
        clock.advance(60.0)
        later = daemon.tick()
        assert [c["code"] for c in later.conditions] == ["xid"] and later.transitions == []
    finally:
        close()


def test_a_failed_write_is_retried_on_a_later_tick_without_a_restart(tmp_path, disk):
    kern_log = tmp_path / "kern.log"
    kern_log.write_text("")
    clock = FakeClock()
    nvml = FakeNvml([h100(0)])
    daemon, close = make_daemon(tmp_path, disk, clock, nvml, kern_log)
    try:
        daemon.tick()
        disk.fill()
        with open(kern_log, "a") as f:
            f.write(XID_79)
        clock.advance(60.0)
        assert daemon.tick().errors
        disk.free()
        clock.advance(5.0)  # no probe due: the pending finding is retried anyway
        report = daemon.tick()
        assert not report.probed and report.errors == []
        assert report.state == NodeState.QUARANTINED
        assert offset(disk) == kern_log.stat().st_size
    finally:
        close()
