"""Issue 23.3: the daemon's intervals run on a monotonic clock and its history stamps never run
backward, tested with an injected clock whose wall time steps both ways while its monotonic time
only advances (the real lifecycle, LocalStore, probes over a scripted NVML; DaemonRig)."""

from __future__ import annotations

from screener.agent.daemon.clock import StampClock, as_clock
from screener.agent.daemon.loop import Daemon
from screener.agent.metrics import DaemonMetrics
from screener.lifecycle import machine
from screener.lifecycle.apply import apply_event
from screener.types import ExitCode, NodeState, Outcome
from fakes.clock import FakeClock
from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome

DAY = 86400.0


def stepping_clock() -> FakeClock:
    """Wall and monotonic time that advance together; `step` moves the wall clock alone, as NTP
    stepping it or an RTC reset would (the shared FakeClock, at a wall time far from its
    monotonic one so a test mixing the two up fails)."""
    return FakeClock(1_800_000_000.0, monotonic=5_000.0)


def _ordered(times: list[float]) -> bool:
    return all(a <= b for a, b in zip(times, times[1:]))


def test_a_backward_step_keeps_the_probes_and_screens_on_schedule_and_the_history_ordered(tmp_path):
    clock = stepping_clock()
    runner = ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.PASS))
    rig = DaemonRig(tmp_path, runner, clock=clock, idle_window_s=0.0, screen_interval_s=3600.0)
    try:
        assert rig.tick().state == NodeState.HEALTHY  # the new node's full burn-in passed
        probes, stamped = rig.probe_calls, rig.store.history(NODE)[-1].time
        clock.step(-DAY)
        for _ in range(24):  # 120 s at a tick of 5 s: probes at +60 and +120
            rig.tick(advance=5.0)
        assert rig.probe_calls == probes + 2  # before: none for a day
        rig.drop_alarm("clock-1", settled=False)
        report = rig.tick(advance=5.0)
        assert report.state == NodeState.SUSPECT
        history = rig.store.history(NODE)
        assert _ordered([t.time for t in history]) and history[-1].time > stamped
        # Stamps count on from the last one by monotonic time, not from the stepped wall clock.
        assert history[-1].time - stamped == 125.0 and rig.daemon.stamps.behind_s == DAY
        report = rig.tick(advance=60.0)  # the confirming screen: due on the monotonic clock
        assert len(runner.calls) == 2 and report.state == NodeState.HEALTHY
        # Once the wall clock has caught up with the stamps, it is taken again.
        clock.step(DAY)
        rig.tick(advance=5.0)
        assert rig.daemon.stamps.now() == clock.wall() and rig.daemon.stamps.behind_s == 0.0
    finally:
        rig.close()


def test_a_forward_step_neither_ends_the_idle_window_nor_brings_the_next_screen_early(tmp_path):
    clock = stepping_clock()
    runner = ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.PASS))
    rig = DaemonRig(tmp_path, runner, clock=clock, idle_window_s=300.0, screen_interval_s=3600.0)
    try:
        rig.nvml.gpus[0].processes = [(4242, 2**30)]  # a job: not idle
        rig.tick()
        rig.nvml.gpus[0].processes = []
        rig.tick(advance=60.0)  # quiet from now
        clock.step(2 * DAY)
        rig.tick(advance=60.0)
        assert runner.calls == [] and not rig.daemon.idle.idle(clock.monotonic())
        for _ in range(4):
            rig.tick(advance=60.0)  # 300 s quiet by the monotonic clock
        assert len(runner.calls) == 1 and rig.daemon.state == NodeState.HEALTHY
        clock.step(2 * DAY)
        for _ in range(10):
            rig.tick(advance=60.0)
        assert len(runner.calls) == 1  # the next screen is 3600 s away, not two days past due
        rig.tick(advance=3000.0)
        assert len(runner.calls) == 2
    finally:
        rig.close()


def test_the_lemon_rule_gives_repair_after_a_backward_step_across_a_restart(tmp_path):
    """Two settled alarms quarantine the node (each remediated back to burnin); the wall clock
    steps back ten days and the daemon restarts: the third failure still makes three in the
    window, so the node goes to repair, not quarantined (before: the earlier failures were
    stamped after "now" and stopped counting)."""
    clock = stepping_clock()
    rig = DaemonRig(tmp_path, ScriptedRunner(), clock=clock, screens=False)
    try:
        rig.tick()
        for n in (1, 2):
            rig.drop_alarm(f"lemon-{n}")
            assert rig.tick(advance=5.0).state == NodeState.QUARANTINED
            apply_event(rig.store, NODE, machine.Remediation(passed=True), now=clock.wall() + 1)
            clock.advance(DAY)
        clock.step(-10 * DAY)
        rig.daemon = Daemon(rig.config, store=rig.store, probes=rig.probes, runner=rig.runner,
                            taint=rig.taint, metrics=rig.metrics, clock=clock, stop=rig.stop)
        rig.drop_alarm("lemon-3")
        report = rig.tick(advance=5.0)
        assert report.state == NodeState.REPAIR and report.exit_code == ExitCode.HARDWARE_SUSPECT
        history = rig.store.history(NODE)
        assert history[-1].evidence["lemon"]["count"] == 3
        assert _ordered([t.time for t in history])
    finally:
        rig.close()


def test_liveness_is_measured_on_the_monotonic_clock():
    clock = stepping_clock()
    metrics = DaemonMetrics(NODE, clock=clock)
    metrics.beat()
    clock.step(DAY)  # before: 86,400 s without progress, /healthz 503, the kubelet restarts it
    assert metrics.alive(300.0)
    clock.step(-2 * DAY)
    clock.advance(301.0)  # a wedged loop is still found
    assert not metrics.alive(300.0)
    assert metrics.last_loop.labels(NODE)._value.get() == 1_800_000_000.0  # wall, at the beat


def test_stamp_clock_floor_and_a_plain_callable():
    clock = stepping_clock()
    stamps = StampClock(clock)
    stamps.floor(clock.wall() + 50.0)  # the history's newest stamp is ahead of the wall clock
    assert stamps.now() == clock.wall() + 50.0
    clock.advance(10.0)
    assert stamps.now() == clock.wall() + 50.0  # counted on by monotonic time
    stamps.floor(0.0)  # an older floor changes nothing
    assert stamps.now() == clock.wall() + 50.0
    one = as_clock(lambda: 7.0)
    assert one.wall() == one.monotonic() == 7.0
