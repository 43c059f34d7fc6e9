"""The DaemonSet loop: alarm intake, probes, idle detection, screening windows, metrics.

One `Daemon` per node. Everything it touches is passed in: the store (LocalStore or KubeStore),
the probe function, the screen runner, the taint control, the GPU-pod lister, the clock and the
stop event; `screener.commands.daemon` wires the real ones, tests pass fakes at the boundary.

Each pass (`tick`):
  1. takes in alarm files (screener.intake): each applied through the lifecycle exactly once;
  2. replays transitions the kube store spooled while the API was unreachable;
  3. every `probe_interval_s`: runs the probes, feeds *new* findings (warning or worse) to the
     lifecycle (a condition that persists is fed once, not on every probe, so a persistent warning
     cannot flap the node between suspect and healthy), and updates idle tracking;
  4. when a screen is due and the node has been idle for the idle window, opens a screening window
     (screener.screening) and feeds its verdicts to the lifecycle.

A screen is due at once for a node in burnin or suspect (a suspect node's screen is the confirming
one the lifecycle asked for), every `screen_interval_s` for a healthy node, and never for a node
quarantined or in repair (a passing screen cannot clear those; remediation and a person do). After a
screen that ended inconclusive (no golden, time cap, our error) the next try waits
`retry_inconclusive_s`; a screen that yielded to a job waits only for the node to be idle again.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from screener import lifecycle
from screener.config import DaemonConfig
from screener.crosscheck import platform_digests
from screener.errors import BadInputError, ScreenerError
from screener.health.probes import ProbeReport
from screener.idle import Activity, IdleTracker, observe
from screener.intake import AlarmIntake, IntakeResult, applied_in_history
from screener.metrics import DaemonMetrics
from screener.screening import (SHUTDOWN, YIELDED, ScreeningWindow, ScreenOutcome, ScreenRunner,
                                TaintControl)
from screener.stores import apply_event
from screener.stores.base import Store
from screener.types import (ANNOTATION_DIGESTS, AlarmRecord, ExitCode, Finding, NodeState, Outcome,
                            Severity)

log = logging.getLogger("screener.daemon")

S = NodeState
OUT_OF_SERVICE = (S.SUSPECT, S.QUARANTINED, S.REPAIR)

ProbeFn = Callable[[Optional[ProbeReport]], ProbeReport]
PodsFn = Callable[[], list]  # the node's GPU pods (KubeStore.gpu_pods(node))


# --- JSON log lines -------------------------------------------------------------------------------

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, msg, and any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_json_logging(level: int = logging.INFO, stream: Any = None) -> None:
    """Route every logger through one JSON-lines handler on stderr (replacing earlier handlers)."""
    import sys

    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)


# --- one pass ---------------------------------------------------------------------------------------


@dataclass
class PassReport:
    """What one pass of the loop did (the --once output and the test's view)."""

    node: str
    started: float
    state: Optional[NodeState] = None
    intake: IntakeResult = field(default_factory=IntakeResult)
    transitions: list[dict[str, Any]] = field(default_factory=list)
    probed: bool = False
    findings: list[dict[str, Any]] = field(default_factory=list)  # new ones fed to the lifecycle
    activity: Optional[Activity] = None
    idle: bool = False
    screen_due: str = ""  # why a screen is due ("" when none is)
    screen: Optional[ScreenOutcome] = None
    actions: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error_code: Optional[ExitCode] = None

    @property
    def exit_code(self) -> ExitCode:
        """The contract's code for `--once`: our failure first, then what the node's state says."""
        if self.error_code is not None:
            return self.error_code
        if self.state in OUT_OF_SERVICE or (self.screen is not None
                                            and self.screen.outcome == Outcome.SUSPECT):
            return ExitCode.HARDWARE_SUSPECT
        if self.state in (None, S.BURNIN) or (self.screen is not None
                                              and self.screen.outcome == Outcome.INCONCLUSIVE):
            return ExitCode.INCONCLUSIVE
        return ExitCode.PASS

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node, "started": self.started,
            "state": self.state.value if self.state else None,
            "exit_code": int(self.exit_code),
            "alarms": {"applied": [r.alarm_id for r in self.intake.applied],
                       "duplicates": list(self.intake.duplicates),
                       "rejected": list(self.intake.rejected),
                       "foreign": list(self.intake.foreign), "failed": list(self.intake.failed)},
            "transitions": self.transitions, "probed": self.probed, "findings": self.findings,
            "activity": self.activity.to_dict() if self.activity else None, "idle": self.idle,
            "screen_due": self.screen_due,
            "screen": self.screen.to_dict() if self.screen else None,
            "actions": self.actions, "errors": self.errors,
        }


def _finding_key(f: Finding) -> tuple[str, str, int]:
    return (f.code, str(f.gpu or ""), int(f.severity))


class Daemon:
    """The per-node loop (see the module docstring).

    store: where states live. probe(previous) -> ProbeReport. runner: the screen runner.
    taint: adds/removes the screening taint (KubeStore, or screening.LocalTaint).
    gpu_pods: lists the node's GPU pods (KubeStore.gpu_pods bound to the node), or None outside a
        cluster. own_pids: our PIDs (idle.own_pids). publish(node, annotations): sets annotations
        on the Node (KubeStore.set_annotations) or None. on_quarantine(node): the optional deep
        health check. replay(): writes spooled transitions (KubeStore.replay) or None.
    """

    def __init__(self, config: DaemonConfig, *, store: Store, probe: ProbeFn, runner: ScreenRunner,
                 taint: TaintControl, gpu_pods: Optional[PodsFn] = None,
                 own_pids: Callable[[], set[int]] = lambda: set(),
                 publish: Optional[Callable[[str, Mapping[str, Optional[str]]], None]] = None,
                 on_quarantine: Optional[Callable[[str], Any]] = None,
                 replay: Optional[Callable[[], int]] = None,
                 metrics: Optional[DaemonMetrics] = None, clock: Callable[[], float] = time.time,
                 stop: Optional[threading.Event] = None,
                 untaint_delay_s: float = 1.0) -> None:
        self.config = config
        self.node = config.node
        self.store = store
        self.probe = probe
        self.gpu_pods = gpu_pods
        self.own_pids = own_pids
        self.publish = publish
        self.on_quarantine = on_quarantine
        self.replay = replay
        self.clock = clock
        self.stop = stop or threading.Event()
        self.metrics = metrics or DaemonMetrics(self.node, clock=clock)
        self.intake = AlarmIntake(config.alarm_dir, self.node, self._apply_alarm,
                                  self._alarm_applied_before, processed_keep=config.processed_keep)
        self.window = ScreeningWindow(self.node, taint, runner, self._job_landed,
                                      time_cap_s=config.screen_time_cap_s, poll_s=config.job_poll_s,
                                      clock=clock, stop=self.stop, heartbeat=self.metrics.beat,
                                      untaint_delay_s=untaint_delay_s)
        self.idle = IdleTracker(config.idle_window_s)
        self.state: Optional[NodeState] = None
        self.last_report: Optional[ProbeReport] = None
        self._seen_findings: set[tuple[str, str, int]] = set()
        self.next_probe = 0.0
        self.last_screen_end: Optional[float] = None
        self.last_screen_stopped = ""
        self.last_screen_outcome: Optional[Outcome] = None
        self.started = False
        self._current: Optional[PassReport] = None

    # --- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        """Clear a stale screening taint, make sure the node is known (a new node starts in
        burnin), read when it was last screened, and become ready."""
        self.window.clear_stale()
        decision = apply_event(self.store, self.node, lifecycle.NodeSeen(), now=self.clock(),
                               policy=self.config.lifecycle)
        for t in decision.transitions:
            self.metrics.transitions.labels(self.node, t.to_state.value).inc()
            log.info("node %s: %s -> %s: %s", self.node, t.from_state.value if t.from_state
                     else "(new)", t.to_state.value, t.reason,
                     extra={"event": "transition", "to": t.to_state.value})
        self.state = decision.state
        self.metrics.set_state(self.state)
        try:
            last = self.store.get_verdict(self.node) or {}
        except ScreenerError as e:
            log.warning("cannot read the last verdict of %s: %s", self.node, e)
            last = {}
        if isinstance(last.get("time"), (int, float)):
            self.last_screen_end = float(last["time"])
            try:
                self.last_screen_outcome = Outcome(last.get("outcome"))
            except ValueError:
                self.last_screen_outcome = None
            self.last_screen_stopped = str(last.get("stopped") or "")
            if self.last_screen_outcome == Outcome.PASS:
                self.metrics.last_success.labels(self.node).set(self.last_screen_end)
        self.started = True
        self.metrics.ready = True
        self.metrics.beat()
        log.info("screener daemon started on %s in state %s", self.node,
                 self.state.value if self.state else None,
                 extra={"event": "started", "state": self.state.value if self.state else None})

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Loop until `stop` is set (SIGTERM). Our own errors are logged and counted, never fatal."""
        while not self.started and not self.stop.is_set():
            try:
                self.start()
            except ScreenerError as e:  # e.g. the API server not reachable yet: not ready, retry
                self.metrics.error("start")
                log.error("start-up failed, retrying in %g s: %s", self.config.tick_s, e,
                          extra={"event": "error", "where": "start"})
                self.stop.wait(self.config.tick_s)
        try:
            while not self.stop.is_set():
                self.tick()
                now = self.clock()
                wait = max(0.0, min(self.config.tick_s, self.next_probe - now))
                self.stop.wait(wait if wait > 0 else min(self.config.tick_s, 0.05))
        finally:
            self.metrics.ready = False
            if self.window.taint_dirty:
                self.window.clear_stale()
            log.info("screener daemon on %s stopped", self.node, extra={"event": "stopped"})

    def tick(self, *, once: bool = False) -> PassReport:
        """One pass: intake, spool replay, probes when due, a screen when due and idle."""
        if not self.started:
            self.start()
        now = self.clock()
        report = PassReport(node=self.node, started=now)
        self._current = report
        try:
            self.metrics.beat()
            self._step(report, "intake", self._intake)
            if self.replay is not None:
                self._step(report, "replay", self.replay)
            if self.window.taint_dirty:
                self._step(report, "untaint", self.window.clear_stale)
            if once or now >= self.next_probe:
                self._step(report, "probe", lambda: self._probe_and_observe(report, once=once))
                self.next_probe = now + self.config.probe_interval_s
            report.screen_due = self._screen_due(now)
            if report.screen_due and (report.idle or (once and report.activity is not None
                                                      and not report.activity.busy)):
                if not self.stop.is_set():
                    self._step(report, "screen", lambda: self._screen(report))
            report.state = self.state
            self.metrics.set_state(self.state)
            self.metrics.beat()
            return report
        finally:
            self._current = None

    def _step(self, report: PassReport, where: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except ScreenerError as e:
            self._failed(report, where, e, e.exit_code)
        except Exception as e:  # noqa: BLE001 - a bug must not kill the DaemonSet; it is counted
            log.exception("%s failed", where)
            self._failed(report, where, e, ExitCode.SCREENER_ERROR)

    def _failed(self, report: PassReport, where: str, e: BaseException, code: ExitCode) -> None:
        report.errors.append(f"{where}: {type(e).__name__}: {e}")
        if report.error_code is None or code == ExitCode.USAGE:
            report.error_code = ExitCode(code)
        self.metrics.error(where)
        log.error("%s failed: %s", where, e, extra={"event": "error", "where": where})

    # --- lifecycle glue -------------------------------------------------------------------------

    def _apply(self, event: Any, why: str) -> lifecycle.Decision:
        decision = apply_event(self.store, self.node, event, now=self.clock(),
                               policy=self.config.lifecycle)
        self.state = decision.state
        for t in decision.transitions:
            self.metrics.transitions.labels(self.node, t.to_state.value).inc()
            entry = {"from": t.from_state.value if t.from_state else None, "to": t.to_state.value,
                     "reason": t.reason, "code": t.code, "time": t.time, "cause": why}
            if self._current is not None:
                self._current.transitions.append(entry)
            log.warning("node %s: %s -> %s: %s", self.node, entry["from"] or "(new)",
                        t.to_state.value, t.reason,
                        extra={"event": "transition", "to": t.to_state.value, "code": t.code,
                               "cause": why})
            if t.to_state == S.QUARANTINED and self.on_quarantine is not None:
                self._deep_check()
        self.metrics.set_state(self.state)
        return decision

    def _deep_check(self) -> None:
        assert self.on_quarantine is not None
        try:
            started = self.on_quarantine(self.node)
        except Exception as e:  # noqa: BLE001 - the quarantine stands; a person follows up
            self.metrics.error("deep_health_check")
            log.error("deep health check on %s could not be started: %s", self.node, e)
            return
        if started is not None and self._current is not None:
            self._current.actions.append({"action": lifecycle.Action.DEEP_HEALTH_CHECK.value,
                                          "result": getattr(started, "to_dict", lambda: str(started))()})

    def _apply_alarm(self, record: AlarmRecord) -> None:
        latency = self.clock() - record.created if record.created else None
        self._apply(record, f"alarm {record.alarm_id}")
        self.metrics.alarm("applied")
        log.warning("alarm %s applied: %s at step %d (%s)", record.alarm_id, record.check,
                    record.step, "settled" if record.settled else "unsettled",
                    extra={"event": "alarm", "alarm_id": record.alarm_id, "check": record.check,
                           "settled": record.settled, "job": record.job,
                           "latency_s": round(latency, 3) if latency is not None else None})

    def _alarm_applied_before(self, record: AlarmRecord) -> bool:
        return applied_in_history(self.store.history(self.node), record.alarm_id)

    def _intake(self) -> None:
        assert self._current is not None
        result = self.intake.run()
        self._current.intake = result
        self.metrics.alarm("duplicate", len(result.duplicates))
        self.metrics.alarm("rejected", len(result.rejected))
        self.metrics.intake_pass(len(result.stuck), result.stalled)  # /readyz and a gauge
        if result.stalled:
            raise ScreenerError(f"alarm intake stalled: {result.stalled}")
        if result.failed:
            raise ScreenerError(f"{len(result.failed)} alarm(s) could not be applied: "
                                f"{', '.join(result.failed)}")

    # --- probes and idleness --------------------------------------------------------------------

    def _probe(self) -> ProbeReport:
        report = self.probe(self.last_report)
        self.metrics.probes.labels(self.node).inc()
        for e in report.errors:
            self.metrics.error("probe")
            log.warning("probe: %s", e)
        self.last_report = report
        current = {_finding_key(f) for f in report.findings}
        new = [f for f in report.findings if _finding_key(f) not in self._seen_findings]
        self._seen_findings = current
        for f in new:
            self.metrics.finding(f.severity)
        relevant = tuple(f for f in new if f.severity >= Severity.WARNING)
        if relevant:
            if self._current is not None:
                self._current.findings.extend(f.to_dict() for f in relevant)
            for f in relevant:
                log.warning("finding %s (%s)%s: %s", f.code, f.severity.label,
                            f" on GPU {f.gpu}" if f.gpu else "", f.message,
                            extra={"event": "finding", "severity": f.severity.label,
                                   "code": f.code})
            self._apply(lifecycle.Findings(relevant), "probe findings")
        return report

    def _activity(self, report: Optional[ProbeReport]) -> Activity:
        pods, pods_error = None, ""
        if self.gpu_pods is not None:
            try:
                pods = self.gpu_pods()
            except Exception as e:  # noqa: BLE001 - cannot tell: not idle
                pods_error = str(e)
                log.warning("cannot list the GPU pods on %s: %s", self.node, e)
        return observe(report.gpus if report is not None else (), pods, own=self.own_pids(),
                       own_pod=self.config.own_pod,
                       utilization_pct=self.config.idle_utilization_pct, pods_error=pods_error)

    def _probe_and_observe(self, report: PassReport, *, once: bool = False) -> None:
        probe = self._probe()
        report.probed = True
        activity = self._activity(probe)
        report.activity = activity
        now = self.clock()
        report.idle = self.idle.update(activity, now)
        self.metrics.idle.labels(self.node).set(1 if report.idle else 0)
        if activity.busy:
            log.debug("node %s busy: %s", self.node, activity.reason)

    def _job_landed(self) -> Optional[str]:
        """During a screen: probe again (the probe's findings are handled as usual) and look for a
        foreign process or a GPU pod. Utilisation is ours now, so it does not count."""
        try:
            probe = self._probe()
        except ScreenerError as e:
            log.warning("probe during the screen failed: %s", e)
            probe = None
        activity = self._activity(probe)
        if activity.job_present:
            return activity.reason
        return None

    # --- screens --------------------------------------------------------------------------------

    def _screen_due(self, now: float) -> str:
        state = self.state
        if not self.config.screens or state in (S.QUARANTINED, S.REPAIR) or state is None:
            return ""
        last = self.last_screen_end
        if last is not None and self.last_screen_outcome == Outcome.INCONCLUSIVE \
                and self.last_screen_stopped not in (YIELDED, SHUTDOWN) \
                and now - last < self.config.retry_inconclusive_s:
            return ""  # wait before retrying an inconclusive screen
        if state == S.BURNIN:
            return "the node is in burnin"
        if state == S.SUSPECT:
            return "the node is suspect: confirming screen"
        if last is None:
            return "never screened"
        if now - last >= self.config.screen_interval_s:
            return f"last screen {now - last:.0f} s ago"
        return ""

    def _screen(self, report: PassReport) -> None:
        self.metrics.screening.labels(self.node).set(1)
        log.info("opening a screening window on %s: %s", self.node, report.screen_due,
                 extra={"event": "screen_start"})
        try:
            outcome = self.window.run()
        finally:
            self.metrics.screening.labels(self.node).set(0)
        report.screen = outcome
        end = self.clock()
        self.idle.reset()
        self.metrics.screen_done(outcome.outcome, [v.outcome for v in outcome.verdicts],
                                 outcome.seconds, outcome.stopped,
                                 passed_at=end if outcome.outcome == Outcome.PASS else None)
        self.last_screen_end = end
        self.last_screen_outcome = outcome.outcome
        self.last_screen_stopped = outcome.stopped
        log.info("screen on %s: %s%s in %.1f s", self.node, outcome.outcome.value,
                 f" (stopped: {outcome.stopped}: {outcome.detail})" if outcome.stopped else "",
                 outcome.seconds,
                 extra={"event": "screen_done", "outcome": outcome.outcome.value,
                        "stopped": outcome.stopped, "seconds": round(outcome.seconds, 3)})
        if not outcome.stopped:
            self._apply(lifecycle.KatScreen(tuple(outcome.verdicts)), "known-answer screen")
        self.store.set_verdict(self.node, {
            "time": end, "outcome": outcome.outcome.value, "stopped": outcome.stopped,
            "detail": outcome.detail, "exit_code": int(outcome.exit_code),
            "verdicts": [v.to_dict() for v in outcome.verdicts]})
        if outcome.outcome == Outcome.PASS and self.publish is not None \
                and self.config.publish_digests:
            digests = platform_digests(outcome.verdicts, outcome.digests)
            if digests:
                self.publish(self.node, {ANNOTATION_DIGESTS: json.dumps(digests, sort_keys=True)})
        if outcome.stopped and outcome.exit_code == ExitCode.USAGE:
            raise BadInputError(f"screen failed: {outcome.detail}")
        if outcome.stopped and outcome.exit_code == ExitCode.SCREENER_ERROR:
            raise ScreenerError(f"screen failed: {outcome.detail}")
