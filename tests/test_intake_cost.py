"""Issue 23.2: the intake's cost is bounded by what is ours. The campaign's case (hundreds of
~240 KB alarm files naming another node, re-parsed every pass: 76 s of CPU a pass, /healthz
failing, the node's own alarm waiting, SIGTERM taking 152 s) with real files, the real daemon
loop and a real metrics server; the budget, the order, the aside folders' ownership and pruning."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest

from screener.agent.daemon.intake import AlarmIntake, IntakeLimits
from screener.alarmfile import MAX_ALARM_BYTES
from screener.agent.metrics import DaemonMetrics, MetricsServer
from screener.audit.alarms import write_alarm_file
from screener.types import NodeState
from fakes.clock import FakeClock
from fakes.daemon import NODE, DaemonRig, ScriptedRunner, alarm

OTHER = "gpu-node-2"


def bulky_foreign(directory, n: int, *, ranks: int = 34_000) -> int:
    """n valid alarms about another node, each ~240 KB (a long suspect_ranks list), written
    older than anything dropped later; returns one file's size."""
    directory.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"schema": 1, "alarm_id": "ID", "check": "weights", "step": 1,
                       "settled": False, "suspect_ranks": list(range(10_000, 10_000 + ranks)),
                       "suspect_nodes": [], "node": OTHER, "job": "j", "created": 1.7e9,
                       "evidence": {}})
    for i in range(n):
        p = directory / f"foreign-{i:04d}.json"
        p.write_text(body.replace('"ID"', f'"f{i}"', 1))
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    return len(body)


class TickingClock:
    """A monotonic clock that moves `step` seconds at every read (a pass that takes time)."""

    def __init__(self, step: float) -> None:
        self.t, self.step = 1000.0, step

    def wall(self) -> float:
        return 1_700_000_000.0 + self.t

    def monotonic(self) -> float:
        self.t += self.step
        return self.t


def test_a_pass_reads_within_its_byte_budget_and_takes_the_nodes_own_alarm_first(tmp_path):
    alarms = tmp_path / "alarms"
    size = bulky_foreign(alarms, 30)
    write_alarm_file(alarm("own", settled=False), alarms)  # the newest file, and a small one
    applied = []
    intake = AlarmIntake(alarms, NODE, applied.append, clock=FakeClock(2000.0),
                         limits=IntakeLimits(pass_bytes=4 * size, pass_s=3600.0))
    first = intake.run()
    assert [r.alarm_id for r in applied] == ["own"]  # before the bulky files, not after them
    assert len(first.foreign) == 4 and first.deferred == 26  # 4 files of the byte budget
    assert first.read_bytes <= 4 * size + MAX_ALARM_BYTES
    passes = 1
    while intake.pending():
        intake.run()
        passes += 1
    assert passes == 8 and len(list((alarms / "rejected").iterdir())) == 30
    assert intake.run().read_bytes == 0  # moved aside once: nothing is read again


def test_a_pass_stops_at_its_time_budget_but_always_takes_one_file(tmp_path):
    alarms = tmp_path / "alarms"
    bulky_foreign(alarms, 5, ranks=100)
    intake = AlarmIntake(alarms, NODE, lambda r: None, clock=TickingClock(step=1.0),
                         limits=IntakeLimits(pass_s=0.5))
    result = intake.run()
    assert len(result.foreign) == 1 and result.deferred == 4


def test_keep_going_is_asked_between_files_and_a_stop_ends_the_pass(tmp_path):
    alarms = tmp_path / "alarms"
    bulky_foreign(alarms, 6, ranks=100)
    asked = []

    def keep_going() -> bool:
        asked.append(1)
        return len(asked) <= 2

    result = AlarmIntake(alarms, NODE, lambda r: None).run(keep_going=keep_going)
    assert len(asked) == 3 and len(result.foreign) == 2 and result.deferred == 4


class RealClock:
    """The system's clocks, with the rig's advance() as a no-op."""

    wall = staticmethod(time.time)
    monotonic = staticmethod(time.monotonic)
    __call__ = staticmethod(time.time)

    def advance(self, s: float) -> None:
        pass


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_the_daemon_stays_live_and_stops_within_a_file_under_hundreds_of_bulky_files(tmp_path):
    """200 files of ~240 KB about another node, a pass with no budget to speak of: /healthz
    answers 200 through the pass (the loop beats between files) and a SIGTERM ends the pass
    after the file in hand, not after the 200 (about 7 s of parsing here)."""
    rig = DaemonRig(tmp_path, ScriptedRunner(), clock=RealClock(), screens=False,
                    intake_pass_s=3600.0, intake_pass_bytes=2**40)
    server = MetricsServer(rig.metrics, "127.0.0.1", 0, liveness_s=0.5)
    server.start()
    try:
        rig.tick()  # start-up and the first probe
        bulky_foreign(tmp_path / "alarms", 200)
        # Writing 48 MB took the test a while; the loop's last beat is from before that, and
        # what is measured is the pass that follows, not the test's own setup.
        rig.metrics.beat()
        done = threading.Event()
        reports = []
        worker = threading.Thread(target=lambda: (reports.append(rig.daemon.tick()), done.set()))
        worker.start()
        codes = []
        for _ in range(6):
            time.sleep(0.25)
            codes.append(_healthz(server.port))
        assert not done.is_set() and codes == [200] * 6
        t0 = time.monotonic()
        rig.stop.set()  # what SIGTERM does
        assert done.wait(10.0)
        latency = time.monotonic() - t0
        assert latency < 2.0, latency
        assert reports[0].intake.deferred > 50  # most of the files were never reached
    finally:
        rig.stop.set()
        server.stop()
        rig.close()


def test_a_folder_another_uid_owns_is_refused_with_one_line_and_a_metric(tmp_path):
    rig = DaemonRig(tmp_path, ScriptedRunner(), screens=False, uid=os.geteuid() + 1)
    try:
        rig.drop_alarm("not-taken")
        report = rig.tick()
        assert [e for e in report.errors if "intake" in e] == [
            f"intake: ScreenerError: alarm intake refused: {tmp_path / 'alarms'} is owned by uid "
            f"{os.geteuid()}, not the daemon's uid {os.geteuid() + 1}: alarms are not taken from a "
            f"folder another user controls"]
        assert rig.metrics.intake_refused.labels(NODE)._value.get() == 1
        rig.metrics.ready = True
        ready, body = rig.metrics.readiness()
        assert not ready and "owned by uid" in body["intake"]
        assert (tmp_path / "alarms" / "not-taken.json").exists()  # untouched
        assert rig.daemon.state == NodeState.BURNIN
    finally:
        rig.close()


def _squat(folder, how: str) -> None:
    folder.mkdir()
    (folder / "planted.json").write_text("{}")
    if how == "writable":
        folder.chmod(0o777)  # a folder the alarm group (or anyone) may write
    else:
        os.chown(folder, 4242, 4190)  # a writer of the alarm group made it first


@pytest.mark.parametrize("how", ["writable"] + (["another-uid"] if os.geteuid() == 0 else []))
def test_an_aside_folder_a_writer_made_is_renamed_and_made_again(tmp_path, how):
    alarms = tmp_path / "alarms"
    alarms.mkdir()
    _squat(alarms / "processed", how)
    _squat(alarms / "rejected", how)
    write_alarm_file(alarm("own", settled=False), alarms)
    (alarms / "junk.json").write_text("not json")
    applied = []
    metrics = DaemonMetrics(NODE)
    metrics.ready = True
    result = AlarmIntake(alarms, NODE, applied.append, clock=FakeClock(2000.0)).run()
    metrics.intake_pass(len(result.stuck), result.stalled, result.refused, result.deferred)
    assert [r.alarm_id for r in applied] == ["own"] and result.rejected == ["junk.json"]
    assert not result.stuck and not result.refused and metrics.readiness()[0]
    for name in ("processed", "rejected"):
        st = os.lstat(alarms / name)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    assert sorted(p.name.split(".")[2] for p in alarms.glob(".*.not-ours.*")) == \
        ["not-ours", "not-ours"]


def test_rejected_and_processed_are_pruned_by_count_and_by_age_since_moved(tmp_path):
    alarms = tmp_path / "alarms"
    for folder in ("processed", "rejected"):
        (alarms / folder).mkdir(parents=True, mode=0o700)
        for i in range(6):
            (alarms / folder / f"{folder}-{i}.json").write_text("{}")
            time.sleep(0.002)  # distinct ctimes, in this order
    bulky_foreign(alarms, 1, ranks=10)  # its mtime says 1970: a writer chose it; it stays
    clock = FakeClock(time.time(), monotonic=100.0)
    intake = AlarmIntake(alarms, NODE, lambda r: None, clock=clock,
                         limits=IntakeLimits(processed_keep=3, rejected_keep=2,
                                             max_age_s=14 * 86400.0))
    intake.run()  # moved a file to rejected/: prunes
    assert sorted(p.name for p in (alarms / "processed").iterdir()) == \
        ["processed-3.json", "processed-4.json", "processed-5.json"]
    assert sorted(p.name for p in (alarms / "rejected").iterdir()) == \
        ["foreign-0000.json", "rejected-5.json"]
    clock.step(13 * 86400.0)  # the wall clock alone: the hourly prune runs on the monotonic one
    intake.run()  # nothing moved and the hourly prune not due: nothing goes
    assert len(list((alarms / "processed").iterdir())) == 3
    clock.step(2 * 86400.0)
    clock.advance(3600.0)  # the hourly prune is due
    intake.run()
    assert not list((alarms / "processed").iterdir()) and not list((alarms / "rejected").iterdir())


def test_an_alarm_of_a_future_schema_is_moved_aside_once(tmp_path):
    alarms = tmp_path / "alarms"
    alarms.mkdir()
    (alarms / "v2.json").write_text(json.dumps({"schema": 2, "node": NODE, "alarm_id": "x"}))
    intake = AlarmIntake(alarms, NODE, lambda r: None)
    assert intake.run().rejected == ["v2.json"]
    assert intake.run().read_bytes == 0 and (alarms / "rejected" / "v2.json").exists()
