"""The DaemonSet loop: alarm intake, probes, idle detection, screening windows, metrics.

One `Daemon` per node. Everything it touches is passed in as one `DaemonPorts`
(screener.agent.daemon.ports): the store (LocalStore or KubeStore), the probe function, the screen
runner, the taint control, the GPU-pod lister, the clocks (a monotonic one for every interval,
wall-clock stamps that never run backward: clock.py) and the stop event; `screener.commands.daemon`
wires the real ones, tests pass fakes at the boundary. Its parts, each a module of its own: the
findings bookkeeping (findings), the way into the lifecycle (feed), the screening step (screens),
the adoption rule (adoption), the pass report (passreport), the per-GPU taints where the cluster
uses DRA (device_taints: a GPU a screen finds suspect, or a settled alarm names by serial, gets a
DeviceTaintRule of its own; a passing retest of it removes it; the node's state is the lifecycle's
as ever).

Start-up (`start`): ends the screen workers a killed predecessor left running and removes their
folders (screening.reap_stale_screens), clears the screening taint, and makes the node known: a
node with no state starts in burnin, unless the adoption rule says it was already serving (GPU pods
running, or a Node object older than `adopt_min_age_s` / `adopt_created_before`): then it is
adopted as healthy-but-unscreened and gets a quick screen at its next idle window. A start-up
that fails (the API server out of reach) does not hold the passes back (issue 36.4): every pass
tries it again first, and until it succeeds a pass still probes and takes in alarms (the kube
store then decides on what it knows and spools: KubeStore.decide_offline), only the budget, the
ladder and screens wait for it.

Each pass (`tick`):
  0. finishes a transition a killed predecessor left half-written (the kube store's intent
     journal, screener.stores.intents), before anything reads the node;
  1. takes in alarm files (screener.agent.daemon.intake): each applied through the lifecycle exactly
     once, with the GPU serials it names kept only when this node's NVML reports them (the first
     pass after start-up probes before the intake, so that those serials are known);
  2. replays transitions the kube store spooled while the API was unreachable;
  3. lets a node the quarantine budget held (suspect, or not yet recorded) take a slot another
     node freed: looked at most every BUDGET_LOOK_S, and then a quarantine like any other
     (screener.agent.daemon.feed);
  4. removes a screening taint an earlier window could not remove;
  5. every `probe_interval_s`: runs the probes and feeds the findings to the lifecycle
     (screener.agent.daemon.findings keeps the bookkeeping). An event finding (a rising counter, a
     warning Xid) is fed once; a persisting condition (a pending or failed row remap, retired pages
     over the threshold, a GPU off the bus, a critical Xid not yet recovered by a reboot, a
     remediation or a person) is fed on every probe (level-triggered) and blocks every pass while
     present. A finding is marked seen, and the kernel-log position saved, only after its transition
     is recorded (or spooled); a failed write is retried on every tick;
  6. for a quarantined node that is idle: one look at the repair ladder, when configured
     (screener.remediation.ladder; in observe mode only what it would have started);
  7. when a screen is due and the node has been idle for the idle window, opens a screening window
     (screener.agent.daemon.screens, screener.agent.screening.window) and feeds its verdicts to the
     lifecycle.

What a screen is: a node in burnin, or suspect without having been healthy since it entered
burnin, gets the FULL burn-in (the worker runs the known-answer jobs for `burnin_duration_s`, the
HBM test and the collective; the daemon adds the probes before and after and the cross-check with
same-platform peers, and screener.agent.burnin.full.missing_for_full decides whether it was full or partial);
a node that earned healthy gets the quick known-answer screen. The verdict annotation says which
kind passed (quick, full, partial, or unscreened for an adopted node).

A screen is due at once for a node in burnin or suspect (a suspect node's screen is the confirming
one the lifecycle asked for), every `screen_interval_s` for a healthy node, never while a
condition persists (it would clear nothing), and never for a node quarantined or in repair (a
passing screen cannot clear those; remediation and a person do). After a screen that ended
inconclusive (no golden, time cap, our error) the next try waits `retry_inconclusive_s`; a screen
that yielded to a job waits only for the node to be idle again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any, Callable, Optional

from screener.agent.daemon.adoption import adoption_reason
from screener.agent.daemon.clock import StampClock, as_clock
from screener.agent.daemon.device_taints import DeviceTaints
from screener.agent.daemon.feed import BUDGET_LOOK_S, LifecycleFeed
from screener.agent.daemon.findings import FindingsTracker
from screener.agent.health_answer import AnswerBoard
from screener.agent.daemon.intake import AlarmIntake, IntakeLimits, applied_in_history
from screener.agent.metrics import DaemonMetrics
from screener.agent.daemon.passreport import PassReport
from screener.agent.daemon.ports import DaemonPorts
from screener.agent.screening.window import ScreeningWindow
from screener.agent.daemon.screens import DaemonScreens
from screener.errors import ScreenerError
from screener.health.verdict.idle import Activity, IdleTracker, observe
from screener.health.probes import ProbeReport
from screener.lifecycle import machine
from screener.remediation.ladder import RepairLadder
from screener.settings.daemon import MODE_OBSERVE, DaemonConfig
from screener.alarmfile import AlarmRecord
from screener.types import AlarmResult, ExitCode, NodeState, Severity

log = logging.getLogger("screener.daemon")

VERDICT_UNSCREENED = "unscreened"  # the verdict annotation's kind for an adopted node
__all__ = ["BUDGET_LOOK_S", "VERDICT_UNSCREENED", "Daemon"]


class Daemon:
    """The per-node loop (see the module docstring).

    Built from its config and its ports: `Daemon(config, DaemonPorts(store=..., probes=...,
    runner=..., taint=...))`, or with the same fields as keywords, `Daemon(config, store=...,
    probes=..., runner=..., taint=...)` (see DaemonPorts for each). Every interval runs on the
    ports' monotonic clock and every history stamp comes from a StampClock over it, so a stepped
    wall clock neither stops the probes nor reorders the history (clock.py).
    """

    def __init__(self, config: DaemonConfig, ports: Optional[DaemonPorts] = None,
                 **fields: Any) -> None:
        if ports is None:
            ports = DaemonPorts(**fields)
        elif fields:
            raise TypeError(f"Daemon takes its ports or their fields, not both: {sorted(fields)}")
        self.config = config
        self.node = config.node
        self.ports = ports
        # Observe mode (issue 24.2): the lifecycle runs and is recorded as ever, but nothing acts
        # on the node's scheduling: the store writes no taint (only the kube store taints) and
        # no remediation starts.
        self.observe = config.mode == MODE_OBSERVE
        if self.observe and hasattr(ports.store, "observe_only"):
            ports.store.observe_only()
        # Intervals on the monotonic clock, history stamps from the stamp clock (clock.py).
        self.clock = as_clock(ports.clock)
        self.stamps = StampClock(self.clock)
        self.stop = ports.stop or threading.Event()
        self.metrics = ports.metrics or DaemonMetrics(self.node, clock=self.clock)
        self.intake = AlarmIntake(config.alarm_dir, self.node,
                                  already_applied=self._alarm_applied_before,
                                  limits=IntakeLimits(pass_s=config.intake_pass_s,
                                                      pass_bytes=config.intake_pass_bytes,
                                                      processed_keep=config.processed_keep,
                                                      rejected_keep=config.rejected_keep,
                                                      max_age_s=config.aside_max_age_s),
                                  foreign=config.foreign_alarms, uid=ports.host.uid(),
                                  clock=self.clock)
        self.window = ScreeningWindow(self.node, ports.taint, ports.runner,
                                      time_cap_s=config.screen_time_cap_s, poll_s=config.job_poll_s,
                                      clock=self.clock.monotonic, stop=self.stop,
                                      heartbeat=self.metrics.beat,
                                      untaint_delay_s=config.untaint_retry_s)
        self.idle = IdleTracker(config.idle_window_s)
        self.findings = FindingsTracker()
        self.feed = LifecycleFeed(config, ports, stamps=self.stamps, monotonic=self.clock.monotonic,
                                  metrics=self.metrics, observe=self.observe)
        # Per-GPU taints where the cluster uses DRA ([dra], off by default): device_taints.py.
        self.devices = DeviceTaints(config.dra, self.node, ports.device_taints,
                                    observe=self.observe)
        self.screens = DaemonScreens(config, ports, self.feed, self.findings, window=self.window,
                                     idle=self.idle, metrics=self.metrics, stamps=self.stamps,
                                     monotonic=self.clock.monotonic, probe=self._probe,
                                     job_landed=self._job_landed, devices=self.devices)
        # The node-local health answer (screener.agent.health_answer): what this loop holds,
        # published after start-up and every pass, never read from the store per request.
        self.answer = ports.answer or AnswerBoard(
            self.node, mode=config.mode, clock=self.clock,
            alive=lambda: self.metrics.alive(config.liveness_s))
        self._newest: Optional[dict[str, Any]] = None  # the newest transition read at start
        self._undecided_alarms: list[str] = []  # alarm files the last intake could not apply
        self.last_report: Optional[ProbeReport] = None
        self.next_probe = 0.0  # monotonic
        self.started = False
        self.reaped: Any = None
        # The repair ladder for an idle quarantined node (issue 24.3), when configured.
        repair = ports.repair
        self.ladder = (RepairLadder(config.ladder, node=self.node, env=ports.host.tool_env(),
                                    monotonic=self.clock.monotonic, boot_time=ports.host.boot_time,
                                    slots=repair.slots if repair else None,
                                    repairs=repair.calls if repair else None,
                                    boot_id=ports.host.boot_id)
                       if config.ladder.enabled else None)

    @property
    def store(self) -> Any:
        """The store the ports hold (a test replaces `daemon.ports.store`, not this)."""
        return self.ports.store

    @property
    def state(self) -> Optional[NodeState]:
        """The node's state as the lifecycle last decided it (None before start-up)."""
        return self.feed.state

    @state.setter
    def state(self, state: Optional[NodeState]) -> None:
        # What a test (or a person at a debugger) sets is what the daemon acts on next.
        self.feed.state = state

    # --- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        """End what a killed predecessor left running, clear a stale screening taint, make sure
        the node is known (a new node starts in burnin, or is adopted), read when it was last
        screened, and become ready."""
        if self.ports.reap is not None:
            self.reaped = self.ports.reap()
        self.window.clear_stale()
        self._floor_stamps()
        event: Any = machine.NodeSeen()
        why = ""
        if self.store.get_state(self.node) is None:
            why = adoption_reason(self.config, self.ports.node_object, self.stamps.now)
        if why:
            event = machine.Adopted(why)
        decision = self.feed.begin(event)
        if why and decision.state == NodeState.HEALTHY:
            self.store.set_verdict(self.node, {"kind": VERDICT_UNSCREENED,
                                               "outcome": VERDICT_UNSCREENED, "adopted": why})
        self.screens.restore()
        self._seed_xids()
        self.started = True
        self.metrics.ready = True
        self.metrics.beat()
        moved = ({"time": decision.transitions[-1].time, "reason": decision.transitions[-1].reason,
                  "code": decision.transitions[-1].code} if decision.transitions else self._newest)
        self._publish(moved)
        log.info("screener daemon started on %s in state %s", self.node,
                 self.state.value if self.state else None,
                 extra={"event": "started", "state": self.state.value if self.state else None})

    def _floor_stamps(self) -> None:
        """Stamp nothing before the newest transition the node's history holds: a daemon
        restarted after the wall clock stepped back still records in order (clock.StampClock)."""
        try:
            history = self.store.history(self.node)
        except ScreenerError as e:  # start-up goes on; this run's own stamps stay ordered
            log.warning("cannot read the history of %s for its newest stamp: %s", self.node, e)
            return
        newest = max(history, key=lambda t: t.time, default=None)
        if newest is not None:
            self.stamps.floor(newest.time)
            # The health answer's "since" and "reason" until this run records a transition.
            self._newest = {"time": newest.time, "reason": newest.reason, "code": newest.code}
        # The same read seeds the incident times the MTBI metric counts (issue 24.4).
        self.feed.seed_incidents(history)

    def _seed_xids(self) -> None:
        """Critical Xids recorded since this boot and not recovered stay conditions across a
        restart of the daemon."""
        try:
            boot = self.ports.host.boot_time()
        except Exception:  # noqa: BLE001 - without it, only this run's Xids count
            return
        self.findings.seed_xids(self.store.history(self.node, since=boot))

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Loop until `stop` is set (SIGTERM). Our own errors are logged and counted, never fatal."""
        # A start-up that fails (the API server out of reach) is retried by every pass, and the
        # passes go on meanwhile: alarms are spooled and the probes run (issue 36.4).
        try:
            while not self.stop.is_set():
                self.tick()
                now = self.clock.monotonic()
                wait = max(0.0, min(self.config.tick_s, self.next_probe - now))
                self.stop.wait(wait if wait > 0 else min(self.config.tick_s, 0.05))
        finally:
            self.metrics.ready = False
            if self.window.taint_dirty:
                self.window.clear_stale()
            log.info("screener daemon on %s stopped", self.node, extra={"event": "stopped"})

    def tick(self, *, once: bool = False) -> PassReport:
        """One pass (the module docstring's steps): intake, spool replay, the budget, a stale
        taint, probes when due, the repair ladder, a screen when due and idle."""
        now = self.clock.monotonic()
        report = PassReport(node=self.node, started=self.stamps.now())
        self.metrics.beat()
        # Every step up to the screen in one pass of the store: each object read once (a screen
        # runs for minutes: what it writes afterwards reads the node afresh).
        with self.store.one_pass():
            cluster = self.ports.node_object
            if cluster is not None:
                # Before anything reads the node: a transition a killed predecessor left
                # half-written is finished (or dropped, undone), so the intake does not take its
                # alarm for done.
                self._step(report, "intents", cluster.finish)
            if not self.started and not self.stop.is_set():
                # Retried on every pass; not started, the pass still probes and takes in alarms.
                self._step(report, "start", self.start)
            if self.last_report is None:
                # The first pass probes before the intake: an alarm's GPU serials count only
                # when this node's NVML reports them, so the serials must be known first.
                self._step(report, "probe", lambda: self._probe_and_observe(report))
                self.next_probe = now + self.config.probe_interval_s
                probed_first = True
            else:
                probed_first = False
            self._step(report, "intake", lambda: self._intake(report))
            if cluster is not None:
                self._step(report, "replay", cluster.replay)
            if self.devices.pending:  # device taints a pass could not write (API out of reach)
                self._step(report, "devices", lambda: self.devices.retry(report))
            if self.started:
                self._step(report, "budget", lambda: self.feed.reconsider_budget(report))
            if self.window.taint_dirty and not self.stop.is_set():  # stopping: run() removes it
                self._step(report, "untaint", self.window.clear_stale)
            if not probed_first and (once or now >= self.next_probe):
                self._step(report, "probe", lambda: self._probe_and_observe(report))
                self.next_probe = now + self.config.probe_interval_s
            elif self.findings.needs_retry:
                # Findings whose transition could not be written: retried on every tick.
                self._step(report, "findings", lambda: self._apply_findings(report))
            if (self.ladder is not None and self.started and self.state == NodeState.QUARANTINED
                    and report.idle):
                self._step(report, "ladder", lambda: self._climb(report))
        report.screen_due = self.screens.due(now) if self.started else ""
        if report.screen_due and (report.idle or (once and report.activity is not None
                                                  and not report.activity.busy)):
            if not self.stop.is_set():
                self._step(report, "screen",
                           lambda: self.screens.run(report, before=self.last_report))
        report.state = self.state
        self.metrics.set_state(self.state)
        self.feed.update_mtbi()  # the window slides: an old incident leaves it without an event
        self._publish(report.transitions[-1] if report.transitions else None)
        self.metrics.beat()
        return report

    def _publish(self, moved: Optional[dict[str, Any]]) -> None:
        """The node-local health answer from what the loop holds now (no store read)."""
        self.answer.update(state=self.state, started=self.started, moved=moved,
                           verdict=self.screens.last_verdict, waiting=self._waiting())

    def _waiting(self) -> str:
        """The hardware evidence this loop holds but could not decide (node_answer's `waiting`):
        alarm files whose apply failed on the last intake, and findings that would take the node
        out of service whose transition could not be written. "" when there is none."""
        alarms = self._undecided_alarms
        findings = self.findings.undecided(self.state)
        if not alarms and not findings:
            return ""
        parts = []
        if alarms:
            parts.append(f"{len(alarms)} alarm file{'s' if len(alarms) > 1 else ''} "
                         f"({', '.join(alarms[:3])}{', ...' if len(alarms) > 3 else ''})")
        if findings:
            names = [f.code + (f" on GPU {f.gpu}" if f.gpu else "") for f in findings[:3]]
            parts.append(f"{len(findings)} finding{'s' if len(findings) > 1 else ''} "
                         f"({', '.join(names)}{', ...' if len(findings) > 3 else ''})")
        why = ("the node's state is not known yet" if self.state is None
               else "its transition could not be written")
        return f"{' and '.join(parts)}, held until decided ({why})"

    def _climb(self, report: PassReport) -> None:
        """One look at the repair ladder (screener.remediation.ladder); a rung taken goes through
        the lifecycle (a Remediation to burnin, so the burn-in that follows re-screens the node, or
        a RepairStep recorded before a reboot is asked for)."""
        assert self.ladder is not None
        if self.observe:  # says what enforce would have started
            report.actions.append({"action": "repair_ladder", "result": "not started: observe mode"})
            return
        gpus = sorted(g.index for g in (self.last_report.gpus if self.last_report else ()))
        step = self.ladder.step(self.store.history(self.node), gpus, self.stamps.now(),
                                lambda event: self.feed.apply(event, "repair ladder", report))
        report.actions.extend(step.actions)
        for rung in step.taken:
            self.metrics.rung_taken(rung)
        if step.error:
            self.metrics.error("ladder")

    def _step(self, report: PassReport, where: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except ScreenerError as e:
            self._failed(report, where, e, e.exit_code)
        except Exception as e:  # noqa: BLE001 - a bug must not kill the DaemonSet; it is counted
            log.exception("%s failed", where)
            self._failed(report, where, e, ExitCode.SCREENER_ERROR)
        # After every step, not only at the pass's end: an alarm that makes the node suspect
        # must show in the health answer before the confirming screen of the same pass runs.
        self._publish(report.transitions[-1] if report.transitions else None)

    def _failed(self, report: PassReport, where: str, e: BaseException, code: ExitCode) -> None:
        report.errors.append(f"{where}: {type(e).__name__}: {e}")
        if report.error_code is None or code == ExitCode.USAGE:
            report.error_code = ExitCode(code)
        self.metrics.error(where)
        log.error("%s failed: %s", where, e, extra={"event": "error", "where": where})

    # --- alarms ---------------------------------------------------------------------------------

    def _apply_alarm(self, record: AlarmRecord, report: PassReport) -> None:
        latency = self.stamps.now() - record.created if record.created else None
        # An alarm acts only on the GPU serials this node's NVML reports.
        record = replace(record, evidence=self.findings.local_evidence(record.evidence))
        self.feed.apply(record, f"alarm {record.alarm_id}", report)
        # A settled alarm naming a local GPU by serial takes that GPU out alone (DRA).
        self.devices.after_alarm(record, self.last_report.gpus if self.last_report else (), report)
        self.metrics.alarm(AlarmResult.APPLIED)
        self.metrics.alarm_applied(record.check, record.settled)
        log.warning("alarm %s applied: %s at step %d (%s)", record.alarm_id, record.check,
                    record.step, "settled" if record.settled else "unsettled",
                    extra={"event": "alarm", "alarm_id": record.alarm_id, "check": record.check,
                           "settled": record.settled, "job": record.job,
                           "latency_s": round(latency, 3) if latency is not None else None})

    def _between_files(self) -> bool:
        """Between two alarm files: the loop is alive (/healthz), and a SIGTERM ends the pass."""
        self.metrics.beat()
        return not self.stop.is_set()

    def _alarm_applied_before(self, record: AlarmRecord) -> bool:
        return applied_in_history(self.store.history(self.node), record.alarm_id)

    def _intake(self, report: PassReport) -> None:
        result = self.intake.run(apply=lambda record: self._apply_alarm(record, report),
                                 keep_going=self._between_files)
        report.intake = result
        self._undecided_alarms = list(result.failed)
        self.metrics.alarm(AlarmResult.DUPLICATE, len(result.duplicates))
        self.metrics.alarm(AlarmResult.REJECTED, len(result.rejected))
        self.metrics.intake_pass(len(result.stuck), result.stalled, result.refused,
                                 result.deferred)  # /readyz and gauges
        if result.refused:
            raise ScreenerError(f"alarm intake refused: {result.refused}")
        if result.stalled:
            raise ScreenerError(f"alarm intake stalled: {result.stalled}")
        if result.failed:
            raise ScreenerError(f"{len(result.failed)} alarm(s) could not be applied: "
                                f"{', '.join(result.failed)}")

    # --- probes and idleness --------------------------------------------------------------------

    def _probe(self, into: PassReport) -> ProbeReport:
        """Probe, and feed what is new to the lifecycle; `into` gets the findings and conditions."""
        report = self.ports.probes.run(self.last_report)
        self.metrics.probes.labels(self.node).inc()
        for e in report.errors:
            self.metrics.error("probe")
            log.warning("probe: %s", e)
        self.last_report = report
        new = self.findings.observe(report, self.stamps.now(),
                                    history=lambda: self.store.history(self.node))
        for f in new:
            self.metrics.finding(f.severity)
        into.findings.extend(f.to_dict() for f in new if f.severity >= Severity.WARNING)
        into.conditions = [f.to_dict() for f in self.findings.conditions]
        for f in new:
            if f.severity >= Severity.WARNING:
                log.warning("finding %s (%s)%s: %s", f.code, f.severity.label,
                            f" on GPU {f.gpu}" if f.gpu else "", f.message,
                            extra={"event": "finding", "severity": f.severity.label,
                                   "code": f.code})
        self._apply_findings(into)
        return report

    def _apply_findings(self, report: PassReport) -> None:
        """Feed pending event findings and the persisting conditions to the lifecycle; only when
        that is recorded (or spooled) are they done and the kernel-log position saved."""
        todo = self.findings.todo(self.state)
        if todo:
            try:
                self.feed.apply(machine.Findings(todo), "probe findings", report)
            except BaseException:
                # Not durable: not seen either, so nothing is lost; every tick retries.
                self.findings.not_written()
                raise
        self.findings.written()
        self.ports.probes.commit()

    def _activity(self, report: Optional[ProbeReport]) -> Activity:
        pods, pods_error = None, ""
        if self.ports.node_object is not None:
            try:
                pods = self.ports.node_object.gpu_pods()
            except Exception as e:  # noqa: BLE001 - cannot tell: not idle
                pods_error = str(e)
                log.warning("cannot list the GPU pods on %s: %s", self.node, e)
        return observe(report.gpus if report is not None else (), pods, own=self.ports.host.own_pids(),
                       own_pod=self.config.own_pod,
                       utilization_pct=self.config.idle_utilization_pct, pods_error=pods_error)

    def _probe_and_observe(self, report: PassReport) -> None:
        probe = self._probe(report)
        report.probed = True
        activity = self._activity(probe)
        report.activity = activity
        report.idle = self.idle.update(activity, self.clock.monotonic())
        self.metrics.idle.labels(self.node).set(1 if report.idle else 0)
        if activity.busy:
            log.debug("node %s busy: %s", self.node, activity.reason)

    def _job_landed(self, report: PassReport) -> Optional[str]:
        """During a screen: probe again (the probe's findings are handled as usual, into the
        screening pass's `report`) and look for a foreign process or a GPU pod. Utilisation is
        ours now, so it does not count."""
        try:
            probe: Optional[ProbeReport] = self._probe(report)
        except ScreenerError as e:
            log.warning("probe during the screen failed: %s", e)
            probe = None
        activity = self._activity(probe)
        if activity.job_present:
            return activity.reason
        return None
