"""The DaemonSet loop: alarm intake, probes, idle detection, screening windows, metrics.

One `Daemon` per node. Everything it touches is passed in: the store (LocalStore or KubeStore),
the probe function, the screen runner, the taint control, the GPU-pod lister, the clocks (a
monotonic one for every interval, wall-clock stamps that never run backward: clock.py) and the
stop event; `screener.commands.daemon` wires the real ones, tests pass fakes at the boundary.

Start-up (`start`): ends the screen workers a killed predecessor left running and removes their
folders (screening.reap_stale_screens), clears the screening taint, and makes the node known: a
node with no state starts in burnin, unless the adoption rule says it was already serving (GPU pods
running, or a Node object older than `adopt_min_age_s` / `adopt_created_before`): then it is
adopted as healthy-but-unscreened and gets a quick screen at its next idle window.

Each pass (`tick`):
  1. takes in alarm files (screener.agent.intake): each applied through the lifecycle exactly once, with
     the GPU serials it names kept only when this node's NVML reports them;
  2. replays transitions the kube store spooled while the API was unreachable;
  3. every `probe_interval_s`: runs the probes and feeds the findings to the lifecycle. An event
     finding (a rising counter, a warning Xid) is fed once; a persisting condition (a pending or
     failed row remap, retired pages over the threshold, a GPU off the bus, a critical Xid not yet
     recovered by a reboot, a remediation or a person) is fed on every probe (level-triggered) and
     blocks every pass while present. A finding is marked seen, and the kernel-log position saved,
     only after its transition is recorded (or spooled); a failed write is retried on every tick;
  4. when a screen is due and the node has been idle for the idle window, opens a screening window
     (screener.agent.screening) and feeds its verdicts to the lifecycle.

What a screen is: a node in burnin, or suspect without having been healthy since it entered
burnin, gets the FULL burn-in (the worker runs the known-answer jobs for `burnin_duration_s`, the
HBM test and the collective; the daemon adds the probes before and after and the cross-check with
same-platform peers, and screener.agent.burnin.missing_for_full decides whether it was full or partial);
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

import datetime as _dt
import json
import logging
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.agent.burnin import (BurninRequirement, crosscheck_digests_stage, missing_for_full,
                                   probe_report_stage)
from screener.agent.clock import ClockLike, StampClock, as_clock
from screener.agent.intake import AlarmIntake, IntakeLimits, IntakeResult, applied_in_history
from screener.agent.metrics import DaemonMetrics
from screener.agent.screening import (KIND_FULL, KIND_QUICK, ScreeningWindow, ScreenOutcome,
                                      ScreenRunner, TaintControl)
from screener.errors import BadInputError, ScreenerError
from screener.health import host
from screener.health.idle import Activity, IdleTracker, observe
from screener.health.probes import ProbeReport
from screener.health.rules import is_condition
from screener.known_answer.crosscheck import platform_digests
from screener.lifecycle import machine as lifecycle
from screener.lifecycle.apply import apply_event, release_held
from screener.lifecycle.ports import Store
from screener.lifecycle.records import ACTOR_HUMAN, Transition
from screener.remediation.ladder import RepairLadder
from screener.settings.daemon import MODE_OBSERVE, DaemonConfig
from screener.types import (ANNOTATION_DIGESTS, NO_WORK_STATES, AlarmRecord, AlarmResult, ExitCode,
                            Finding, NodeState, Outcome, Reason, ScreenStop, Severity)

log = logging.getLogger("screener.daemon")

S = NodeState

ProbeFn = Callable[[Optional[ProbeReport]], ProbeReport]
PodsFn = Callable[[], list]  # the node's GPU pods (KubeStore.gpu_pods(node))
VERDICT_UNSCREENED = "unscreened"  # the verdict annotation's kind for an adopted node
BUDGET_LOOK_S = 30.0  # a node held by the budget looks for a free slot at most this often


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
    conditions: list[dict[str, Any]] = field(default_factory=list)  # persisting, re-applied
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
        if self.state in NO_WORK_STATES or (self.screen is not None
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
                       "foreign": list(self.intake.foreign), "failed": list(self.intake.failed),
                       "deferred": self.intake.deferred},
            "transitions": self.transitions, "probed": self.probed, "findings": self.findings,
            "conditions": self.conditions,
            "activity": self.activity.to_dict() if self.activity else None, "idle": self.idle,
            "screen_due": self.screen_due,
            "screen": self.screen.to_dict() if self.screen else None,
            "actions": self.actions, "errors": self.errors,
        }


def _finding_key(f: Finding) -> tuple[str, str, int]:
    return (f.code, str(f.gpu or ""), int(f.severity))


def _xid_key(f: Finding) -> tuple[str, str, int]:
    return ("xid", str(f.gpu or ""), int(f.evidence.get("xid") or 0))


def _is_recovery(t: Any) -> bool:
    """A transition after which earlier Xids no longer hold the node: a person's decision, or a
    remediation (deep health check, GPU reset) that passed."""
    return t.actor == ACTOR_HUMAN or t.code == Reason.REMEDIATED


class Daemon:
    """The per-node loop (see the module docstring).

    store: where states live. probe(previous) -> ProbeReport. runner: the screen runner.
    taint: adds/removes the screening taint (KubeStore, or screening.LocalTaint).
    gpu_pods: lists the node's GPU pods (KubeStore.gpu_pods bound to the node), or None outside a
        cluster. own_pids: our PIDs (host.own_pids). publish(node, annotations): sets annotations
        on the Node (KubeStore.set_annotations) or None. on_quarantine(node): the optional deep
        health check. replay(): writes spooled transitions (KubeStore.replay) or None.
    reap(): ends screen workers a killed predecessor left (screening.reap_stale_screens bound to
        the runner's work_dir) or None. node_created(): the Node object's creation time (unix
        seconds) or None when unknown, for the adoption rule. commit_kmsg(): saves the kernel-log
        position (DeferredKernelLogReader.commit) once what it read is durable, or None.
        boot_time(): when the host booted (an Xid before it was recovered by the reboot).
        uid: the uid that must own the alarm folder (default: the daemon's own).
        tool_env: the environment (PATH) the repair ladder runs nvidia-smi and dcgmi in
        (default: the daemon's own).
    clock: a clock.Clock (wall and monotonic) or one callable standing for both (a test clock
        that never steps); default the system's. Every interval runs on its monotonic clock and
        every history stamp comes from a StampClock over it, so a stepped wall clock neither
        stops the probes nor reorders the history (clock.py).
    """

    def __init__(self, config: DaemonConfig, *, store: Store, probe: ProbeFn, runner: ScreenRunner,
                 taint: TaintControl, gpu_pods: Optional[PodsFn] = None,
                 own_pids: Callable[[], set[int]] = lambda: set(),
                 publish: Optional[Callable[[str, Mapping[str, Optional[str]]], None]] = None,
                 on_quarantine: Optional[Callable[[str], Any]] = None,
                 replay: Optional[Callable[[], int]] = None,
                 metrics: Optional[DaemonMetrics] = None, clock: Optional[ClockLike] = None,
                 stop: Optional[threading.Event] = None,
                 untaint_delay_s: float = 1.0,
                 reap: Optional[Callable[[], Any]] = None,
                 node_created: Optional[Callable[[], Optional[float]]] = None,
                 commit_kmsg: Optional[Callable[[], None]] = None,
                 boot_time: Callable[[], float] = host.boot_time,
                 uid: Optional[int] = None,
                 tool_env: Optional[Mapping[str, str]] = None) -> None:
        self.config = config
        self.node = config.node
        self.store = store
        self.probe = probe
        self.gpu_pods = gpu_pods
        self.own_pids = own_pids
        self.publish = publish
        self.on_quarantine = on_quarantine
        self.replay = replay
        # Observe mode (issue 24.2): the lifecycle runs and is recorded as ever, but nothing acts
        # on the node's scheduling: the store writes no taint (only the kube store taints) and
        # no remediation starts.
        self.observe = config.mode == MODE_OBSERVE
        if self.observe and hasattr(store, "observe_only"):
            store.observe_only()
        # Intervals on the monotonic clock, history stamps from the stamp clock (clock.py).
        self.clock = as_clock(clock)
        self.stamps = StampClock(self.clock)
        self.stop = stop or threading.Event()
        self.metrics = metrics or DaemonMetrics(self.node, clock=self.clock)
        # Both take this pass's report with each call (tick binds it), not at construction.
        self.intake = AlarmIntake(config.alarm_dir, self.node,
                                  already_applied=self._alarm_applied_before,
                                  limits=IntakeLimits(pass_s=config.intake_pass_s,
                                                      pass_bytes=config.intake_pass_bytes,
                                                      processed_keep=config.processed_keep,
                                                      rejected_keep=config.rejected_keep,
                                                      max_age_s=config.aside_max_age_s),
                                  foreign=config.foreign_alarms, uid=uid, clock=self.clock)
        self.window = ScreeningWindow(self.node, taint, runner,
                                      time_cap_s=config.screen_time_cap_s, poll_s=config.job_poll_s,
                                      clock=self.clock.monotonic, stop=self.stop,
                                      heartbeat=self.metrics.beat,
                                      untaint_delay_s=untaint_delay_s)
        self.idle = IdleTracker(config.idle_window_s)
        self.state: Optional[NodeState] = None
        self.last_report: Optional[ProbeReport] = None
        self._seen_findings: set[tuple[str, str, int]] = set()
        self.next_probe = 0.0  # monotonic
        self.next_budget_look = 0.0  # monotonic
        self.last_screen_end: Optional[float] = None  # monotonic
        self.last_screen_stopped = ""
        self.last_screen_outcome: Optional[Outcome] = None
        self.started = False
        self.reap = reap
        self.node_created = node_created
        self.commit_kmsg = commit_kmsg
        self.boot_time = boot_time
        self.requirement = BurninRequirement(min_seconds=config.burnin_duration_s,
                                             min_iterations=config.burnin_min_iterations,
                                             jobs=tuple(config.jobs))
        self._known_serials: set[str] = set()  # every serial this node's NVML has reported
        self._known_gpus: dict[str, Any] = {}  # uuid -> GpuSnapshot seen since start
        self._pending: list[Finding] = []  # event findings whose transition is not yet durable
        self._unwritten = False  # the last feed of findings failed to write: retry every tick
        self._xids: dict[tuple[str, str, int], tuple[float, Finding]] = {}  # unrecovered critical
        self.conditions: tuple[Finding, ...] = ()
        self.reaped: Any = None
        self._incidents: list[float] = []  # failure times within mtbi_days (the MTBI metric)
        # The repair ladder for an idle quarantined node (issue 24.3), when configured.
        self.ladder = (RepairLadder(config.ladder, env=tool_env, monotonic=self.clock.monotonic)
                       if config.ladder.enabled else None)

    # --- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        """End what a killed predecessor left running, clear a stale screening taint, make sure
        the node is known (a new node starts in burnin, or is adopted), read when it was last
        screened, and become ready."""
        if self.reap is not None:
            self.reaped = self.reap()
        self.window.clear_stale()
        self._floor_stamps()
        event: Any = lifecycle.NodeSeen()
        why = self._adoption() if self.store.get_state(self.node) is None else ""
        if why:
            event = lifecycle.Adopted(why)
        decision = apply_event(self.store, self.node, event, now=self.stamps.now(),
                               policy=self.config.lifecycle)
        if why and decision.state == S.HEALTHY:
            self.store.set_verdict(self.node, {"kind": VERDICT_UNSCREENED,
                                               "outcome": VERDICT_UNSCREENED, "adopted": why})
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
            # Its age by the stamp clock (never negative: a verdict stamped "in the future" by a
            # clock that stepped back is taken as just now), carried onto the monotonic clock.
            age = max(0.0, self.stamps.now() - float(last["time"]))
            self.last_screen_end = self.clock.monotonic() - age
            try:
                self.last_screen_outcome = Outcome(last.get("outcome"))
            except ValueError:
                self.last_screen_outcome = None
            self.last_screen_stopped = str(last.get("stopped") or "")
            if self.last_screen_outcome == Outcome.PASS:
                self.metrics.last_success.labels(self.node).set(float(last["time"]))
        self._seed_xids()
        self.started = True
        self.metrics.ready = True
        self.metrics.beat()
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
        newest = max((t.time for t in history), default=None)
        if newest is not None:
            self.stamps.floor(newest)
        # The same read seeds the incident times the MTBI metric counts (issue 24.4); later
        # incidents are added as they are recorded, so no event reads the history for it.
        self._incidents = sorted(t.time for t in history if t.failure)
        self._update_mtbi()

    def _update_mtbi(self) -> None:
        """Set the incident and MTBI metrics from the incidents within `mtbi_days` (in memory:
        at most the node's own history, whatever the fleet's size)."""
        since = self.stamps.now() - self.config.mtbi_days * 86400.0
        self._incidents = [t for t in self._incidents if t >= since]
        self.metrics.set_incidents(self._incidents)

    def _adoption(self) -> str:
        """Why this node, unknown to the store, is adopted as serving ("" when it is not)."""
        if self.config.adopt == "off":
            return ""
        if self.gpu_pods is not None:
            try:
                pods = [p for p in self.gpu_pods()
                        if not (self.config.own_pod and p.get("name") == self.config.own_pod)]
            except Exception as e:  # noqa: BLE001 - cannot tell: the safe default is burnin
                log.warning("cannot list the GPU pods on %s for adoption: %s", self.node, e)
                pods = []
            if pods:
                names = ", ".join(f"{p.get('namespace', '')}/{p.get('name', '')}" for p in pods[:3])
                return f"already running {len(pods)} GPU pod(s) ({names})"
        created = None
        if self.node_created is not None:
            try:
                created = self.node_created()
            except Exception as e:  # noqa: BLE001
                log.warning("cannot read when node %s was created: %s", self.node, e)
        if created is None:
            return ""
        if self.config.adopt_created_before > 0 and created < self.config.adopt_created_before:
            return f"created before {self.config.adopt_created_before:.0f} (adopt_created_before)"
        age = self.stamps.now() - created
        if age >= self.config.adopt_min_age_s:
            return (f"existed {age:.0f} s before the screener first saw it "
                    f"(adopt_min_age_s {self.config.adopt_min_age_s:g})")
        return ""

    def _seed_xids(self) -> None:
        """Critical Xids recorded since this boot and not recovered stay conditions across a
        restart of the daemon (the transition that recorded them is the durable record)."""
        try:
            boot = self.boot_time()
        except Exception:  # noqa: BLE001 - without it, only this run's Xids count
            return
        for t in self.store.history(self.node, since=boot):
            if _is_recovery(t):
                self._xids.clear()
                continue
            for d in t.evidence.get("findings") or ():
                try:
                    f = Finding.from_dict(d)
                except (KeyError, TypeError, ValueError):
                    continue
                if f.code == "xid" and f.severity >= Severity.CRITICAL:
                    self._xids[_xid_key(f)] = (t.time, f)

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
                now = self.clock.monotonic()
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
        now = self.clock.monotonic()
        report = PassReport(node=self.node, started=self.stamps.now())
        self.metrics.beat()
        if self.last_report is None:
            # The first pass probes before the intake: an alarm's GPU serials count only when
            # this node's NVML reports them, so the serials must be known first.
            self._step(report, "probe", lambda: self._probe_and_observe(report))
            self.next_probe = now + self.config.probe_interval_s
            probed_first = True
        else:
            probed_first = False
        self._step(report, "intake", lambda: self._intake(report))
        if self.replay is not None:
            self._step(report, "replay", self.replay)
        self._step(report, "budget", lambda: self._reconsider_budget(report))
        if self.window.taint_dirty:
            self._step(report, "untaint", self.window.clear_stale)
        if not probed_first and (once or now >= self.next_probe):
            self._step(report, "probe", lambda: self._probe_and_observe(report))
            self.next_probe = now + self.config.probe_interval_s
        elif self._pending or self._unwritten:
            # Findings whose transition could not be written: retried on every tick.
            self._step(report, "findings", lambda: self._apply_findings(report))
        if self.ladder is not None and self.state == S.QUARANTINED and report.idle:
            self._step(report, "ladder", lambda: self._climb(report))
        report.screen_due = self._screen_due(now)
        if report.screen_due and (report.idle or (once and report.activity is not None
                                                  and not report.activity.busy)):
            if not self.stop.is_set():
                self._step(report, "screen", lambda: self._screen(report))
        report.state = self.state
        self.metrics.set_state(self.state)
        self._update_mtbi()  # the window slides: an old incident leaves it without an event
        self.metrics.beat()
        return report

    def _reconsider_budget(self, report: PassReport) -> None:
        """A node held by the budget takes a slot another node freed: a quarantine like any other
        (its metrics, its log line, its deep health check)."""
        if self.state not in (None, S.SUSPECT):
            return
        mono = self.clock.monotonic()
        if mono < self.next_budget_look:
            return
        # Looked at most every BUDGET_LOOK_S on the monotonic clock (release_held's own limit
        # compares wall stamps, which a stepped clock would defeat).
        self.next_budget_look = mono + BUDGET_LOOK_S
        self.state, released = release_held(self.store, self.node, self.state,
                                            now=self.stamps.now(), policy=self.config.lifecycle,
                                            min_interval_s=0.0)
        if released is not None:
            self._note_transitions((released,), "a quarantine budget slot freed", report)

    def _climb(self, report: PassReport) -> None:
        """One look at the repair ladder (screener.remediation.ladder); a rung taken is a
        Remediation through the lifecycle, so the burn-in that follows re-screens the node."""
        assert self.ladder is not None
        if self.observe:  # says what enforce would have started
            report.actions.append({"action": "repair_ladder", "result": "not started: observe mode"})
            return
        gpus = sorted(g.index for g in (self.last_report.gpus if self.last_report else ()))
        step = self.ladder.step(self.store.history(self.node), gpus, self.stamps.now())
        report.actions.extend(step.actions)
        if step.error:
            self.metrics.error("ladder")
        if step.event is not None:
            self._apply(step.event, "repair ladder", report)

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

    def _apply(self, event: Any, why: str, report: PassReport) -> lifecycle.Decision:
        """Feed one event to the lifecycle; what it did goes into `report` and the metrics."""
        decision = apply_event(self.store, self.node, event, now=self.stamps.now(),
                               policy=self.config.lifecycle)
        self.state = decision.state
        self._note_transitions(decision.transitions, why, report)
        self.metrics.set_state(self.state)
        return decision

    def _note_transitions(self, transitions: Sequence[Transition], why: str,
                          report: PassReport) -> None:
        """What every recorded move is followed by: a metric, the pass report, a log line, and
        for a quarantine the deep health check when it is configured."""
        if any(t.failure for t in transitions):
            self._incidents.extend(t.time for t in transitions if t.failure)
            self._update_mtbi()
        for t in transitions:
            self.metrics.transitions.labels(self.node, t.to_state.value).inc()
            entry = {"from": t.from_state.value if t.from_state else None, "to": t.to_state.value,
                     "reason": t.reason, "code": t.code, "time": t.time, "cause": why}
            report.transitions.append(entry)
            log.warning("node %s: %s -> %s: %s", self.node, entry["from"] or "(new)",
                        t.to_state.value, t.reason,
                        extra={"event": "transition", "to": t.to_state.value, "code": t.code,
                               "cause": why})
            if t.to_state == S.QUARANTINED and self.on_quarantine is not None:
                if self.observe:  # says what enforce would have started
                    report.actions.append({"action": lifecycle.Action.DEEP_HEALTH_CHECK.value,
                                           "result": "not started: observe mode"})
                else:
                    self._deep_check(report)

    def _deep_check(self, report: PassReport) -> None:
        assert self.on_quarantine is not None
        try:
            started = self.on_quarantine(self.node)
        except Exception as e:  # noqa: BLE001 - the quarantine stands; a person follows up
            self.metrics.error("deep_health_check")
            log.error("deep health check on %s could not be started: %s", self.node, e)
            return
        if started is not None:
            report.actions.append({"action": lifecycle.Action.DEEP_HEALTH_CHECK.value,
                                          "result": getattr(started, "to_dict", lambda: str(started))()})

    def _apply_alarm(self, record: AlarmRecord, report: PassReport) -> None:
        latency = self.stamps.now() - record.created if record.created else None
        # An alarm acts only on the GPU serials this node's NVML reports.
        record = replace(record, evidence=lifecycle.local_serials(record.evidence,
                                                                  sorted(self._known_serials)))
        self._apply(record, f"alarm {record.alarm_id}", report)
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
        report = self.probe(self.last_report)
        self.metrics.probes.labels(self.node).inc()
        for e in report.errors:
            self.metrics.error("probe")
            log.warning("probe: %s", e)
        self.last_report = report
        for g in report.gpus:
            if g.serial:
                self._known_serials.add(str(g.serial))
            if g.uuid:
                self._known_gpus[g.uuid] = g
        findings = [self._localize(f) for f in report.findings] + self._gone(report)
        current = {_finding_key(f) for f in findings}
        new = [f for f in findings if _finding_key(f) not in self._seen_findings]
        for f in new:
            self.metrics.finding(f.severity)
        now = self.stamps.now()  # compared with the history's stamps (_drop_recovered_xids)
        for f in findings:
            if f.code == "xid" and f.severity >= Severity.CRITICAL:
                self._xids.setdefault(_xid_key(f), (now, f))
        self._drop_recovered_xids()
        # Event findings are fed once; conditions on every probe (level-triggered).
        pending = {_finding_key(p) for p in self._pending}
        self._pending.extend(f for f in new if f.severity >= Severity.WARNING
                             and not is_condition(f) and _finding_key(f) not in pending)
        self.conditions = self._current_conditions(findings)
        into.findings.extend(f.to_dict() for f in new if f.severity >= Severity.WARNING)
        into.conditions = [f.to_dict() for f in self.conditions]
        for f in new:
            if f.severity >= Severity.WARNING:
                log.warning("finding %s (%s)%s: %s", f.code, f.severity.label,
                            f" on GPU {f.gpu}" if f.gpu else "", f.message,
                            extra={"event": "finding", "severity": f.severity.label,
                                   "code": f.code})
        # Marked seen only once durable: what _apply_findings cannot write is unmarked again.
        self._seen_findings = current
        self._apply_findings(into)
        return report

    def _apply_findings(self, report: PassReport) -> None:
        """Feed pending event findings and the persisting conditions to the lifecycle; only when
        that is recorded (or spooled) are they done and the kernel-log position saved."""
        todo = tuple(self._pending) + tuple(f for f in self.conditions if self._could_move(f))
        if todo:
            try:
                self._apply(lifecycle.Findings(todo), "probe findings", report)
            except BaseException:
                # Not durable: not seen either, so nothing is lost; every tick retries.
                self._seen_findings -= {_finding_key(f) for f in self._pending}
                self._unwritten = True
                raise
        self._pending = []
        self._unwritten = False
        if self.commit_kmsg is not None:
            self.commit_kmsg()

    def _could_move(self, f: Finding) -> bool:
        """Whether re-applying a persisting condition can still change the node's state; the
        others are skipped, so a node held out costs no store reads per probe."""
        if f.severity < Severity.WARNING or self.state == S.REPAIR:
            return False
        if self.state == S.QUARANTINED:
            return f.code in lifecycle.REPAIR_CODES and f.severity >= Severity.CRITICAL
        if self.state == S.SUSPECT:
            return f.severity >= Severity.CRITICAL
        return True

    def _localize(self, f: Finding) -> Finding:
        """The finding with its GPU serial under the key the lemon rule reads, when it is one
        this node's NVML reports (never another node's)."""
        keys = (lifecycle.EVIDENCE_SERIAL, lifecycle.EVIDENCE_GPU_SERIAL,
                lifecycle.EVIDENCE_GPU_SERIALS)
        if not any(k in f.evidence for k in keys):
            return f
        return replace(f, evidence=lifecycle.local_serials(f.evidence, sorted(self._known_serials)))

    def _gone(self, report: ProbeReport) -> list[Finding]:
        """A GPU seen since the daemon started and missing now stays a condition (the rules see
        it only against the previous probe) until it is back."""
        if not report.snapshot.nvml.available:
            return []
        now = {g.uuid for g in report.gpus if g.uuid}
        named = {f.evidence.get("uuid") for f in report.findings if f.code == "gpu_missing"}
        out = []
        for uuid, g in self._known_gpus.items():
            if uuid in now or uuid in named:
                continue
            ev = lifecycle.local_serials(dict(g.identity()), sorted(self._known_serials))
            out.append(Finding(severity=Severity.CRITICAL, code="gpu_missing",
                               message=f"GPU {g.index} ({uuid}) is still missing: fallen off the bus",
                               gpu=g.label, evidence=ev,
                               action="drain the node and reboot it; repair if the GPU stays missing"))
        return out

    def _drop_recovered_xids(self) -> None:
        if not self._xids:
            return
        try:
            history = self.store.history(self.node)
        except ScreenerError:
            return  # cannot tell: keep them (the safe side)
        last = max((t.time for t in history if _is_recovery(t)), default=None)
        if last is not None:
            self._xids = {k: v for k, v in self._xids.items() if v[0] > last}

    def _current_conditions(self, findings: list[Finding]) -> tuple[Finding, ...]:
        out = [f for f in findings if is_condition(f) and f.code != "xid"]
        out += [f for _, f in self._xids.values()]
        return tuple(out)

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
            probe = self._probe(report)
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
        if self.conditions:
            return ""  # a pass would clear nothing while a condition persists
        last = self.last_screen_end
        if last is not None and self.last_screen_outcome == Outcome.INCONCLUSIVE \
                and self.last_screen_stopped not in (ScreenStop.YIELDED, ScreenStop.SHUTDOWN) \
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

    def _screen_kind(self) -> str:
        """Full burn-in for a node that has not earned healthy since it entered burnin, else the
        quick screen."""
        if self.state == S.BURNIN:
            return KIND_FULL
        if self.state == S.SUSPECT and not lifecycle.earned_healthy(self.store.history(self.node)):
            return KIND_FULL
        return KIND_QUICK

    def _screen(self, report: PassReport) -> None:
        kind = self._screen_kind()
        cap = self.config.screen_time_cap_s + (self.config.burnin_duration_s if kind == KIND_FULL
                                               else 0.0)
        before = self.last_report
        self.metrics.screening.labels(self.node).set(1)
        log.info("opening a screening window on %s (%s): %s", self.node,
                 "full burn-in" if kind == KIND_FULL else "quick screen", report.screen_due,
                 extra={"event": "screen_start", "kind": kind})
        try:
            outcome = self.window.run(kind, cap, job_check=lambda: self._job_landed(report))
        finally:
            self.metrics.screening.labels(self.node).set(0)
        report.screen = outcome
        end = self.stamps.now()
        self.idle.reset()
        self.metrics.screen_done(outcome.outcome, [v.outcome for v in outcome.verdicts],
                                 outcome.seconds, outcome.stopped,
                                 passed_at=end if outcome.outcome == Outcome.PASS else None)
        self.last_screen_end = self.clock.monotonic()
        self.last_screen_outcome = outcome.outcome
        self.last_screen_stopped = outcome.stopped
        log.info("screen on %s: %s%s in %.1f s", self.node, outcome.outcome.value,
                 f" (stopped: {outcome.stopped}: {outcome.detail})" if outcome.stopped else "",
                 outcome.seconds,
                 extra={"event": "screen_done", "outcome": outcome.outcome.value,
                        "stopped": outcome.stopped, "seconds": round(outcome.seconds, 3)})
        verdicts = tuple(outcome.verdicts)
        screen_kind: str = KIND_QUICK
        missing: list[str] = []
        stages: list[dict[str, Any]] = []
        if kind == KIND_FULL and not outcome.stopped:
            verdicts, missing, stages = self._assess_burnin(outcome, before, report)
            screen_kind = lifecycle.KIND_PARTIAL if missing else lifecycle.KIND_FULL
            if missing:
                log.warning("burn-in on %s was partial: %s", self.node, "; ".join(missing),
                            extra={"event": "burnin_partial"})
        if not outcome.stopped:
            self._apply(lifecycle.KatScreen(verdicts, kind=screen_kind,
                                            conditions=self.conditions), "known-answer screen",
                        report)
        self.store.set_verdict(self.node, {
            "time": end, "outcome": outcome.outcome.value, "stopped": outcome.stopped,
            "kind": screen_kind if not outcome.stopped else kind, "missing": missing,
            "stages": [{"name": st.get("name"), "outcome": st.get("outcome")} for st in stages],
            "detail": outcome.detail, "exit_code": int(outcome.exit_code),
            "verdicts": [v.to_dict() for v in verdicts]})
        if outcome.outcome == Outcome.PASS and self.publish is not None \
                and self.config.publish_digests:
            digests = platform_digests(outcome.verdicts, outcome.digests)
            if digests:
                self.publish(self.node, {ANNOTATION_DIGESTS: json.dumps(digests, sort_keys=True)})
        if outcome.stopped and outcome.exit_code == ExitCode.USAGE:
            raise BadInputError(f"screen failed: {outcome.detail}")
        if outcome.stopped and outcome.exit_code == ExitCode.SCREENER_ERROR:
            raise ScreenerError(f"screen failed: {outcome.detail}")

    def _assess_burnin(self, outcome: ScreenOutcome, before: Optional[ProbeReport],
                       report: PassReport
                       ) -> tuple[tuple[Any, ...], list[str], list[dict[str, Any]]]:
        """The daemon's half of a full burn-in: the probes before (this pass's) and after, the
        cross-check with same-platform peers, and what the run lacked to be full."""
        stages: list[dict[str, Any]] = []
        if before is not None:
            stages.append(probe_report_stage("probes-before", before).to_dict())
        stages += [dict(st) for st in outcome.stages]
        verdicts = list(outcome.verdicts)
        peers_available = False
        if hasattr(self.store, "annotations_by_node"):
            try:
                cc = crosscheck_digests_stage(self.node, outcome.verdicts, outcome.digests,
                                              self.store)
                peers_available = int(cc.data.get("nodes_compared") or 0) > 0
                stages.append(cc.to_dict())
                verdicts += list(cc.verdicts)
            except ScreenerError as e:
                log.warning("cross-check with peers failed: %s", e)
        after = self._probe(report)  # its findings go to the lifecycle as usual
        stages.append(probe_report_stage("probes-after", after).to_dict())
        devices = len(after.gpus) or 1
        missing = missing_for_full(stages, self.requirement, devices=devices,
                                   peers_available=peers_available)
        return tuple(verdicts), missing, stages
