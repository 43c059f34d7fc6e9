"""The daemon's screening step: whether a screen is due, which kind, and what follows it.

When a screen is due (screener.agent.daemon.loop's docstring says when) and the node has been idle
for the window, the daemon hands the pass to `DaemonScreens.run`: it opens a screening window
(screener.agent.screening.window) for a quick screen or a full burn-in, and for a full one adds the
daemon's half (the probes before and after, the cross-check with same-platform peers, and whether
the run was full or partial: screener.agent.burnin.full.missing_for_full). It then feeds the
verdicts to the lifecycle, stores the verdict annotation (which kind passed), and publishes the
digests same-platform peers cross-check against; where the cluster uses DRA, a suspect GPU gets its
own device taint and a passing one loses it (screener.agent.daemon.device_taints). A screen stopped
early (a job landed, the time cap, a shutdown) is inconclusive and moves nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Optional

from screener.agent.burnin.full import (BurninRequirement, crosscheck_digests_stage,
                                        missing_for_full, probe_report_stage)
from screener.agent.daemon.clock import StampClock
from screener.agent.daemon.device_taints import DeviceTaints
from screener.agent.daemon.feed import LifecycleFeed
from screener.agent.daemon.fleet import FleetQuorum
from screener.agent.daemon.findings import FindingsTracker
from screener.agent.metrics import DaemonMetrics
from screener.agent.daemon.passreport import PassReport
from screener.agent.daemon.ports import DaemonPorts
from screener.agent.screening.window import KIND_FULL, KIND_QUICK, ScreeningWindow, ScreenOutcome
from screener.errors import BadInputError, ScreenerError
from screener.health.verdict.idle import IdleTracker
from screener.health.probes import ProbeReport
from screener.known_answer.verdict.crosscheck import platform_digests
from screener.lifecycle import machine
from screener.settings.daemon import DaemonConfig
from screener.types import ANNOTATION_DIGESTS, ExitCode, NodeState, Outcome, ScreenStop

log = logging.getLogger("screener.daemon")


class DaemonScreens:
    """When the last screen ended and how, when the next is due, and running it.

    probe(report): the daemon's probe, its findings handled as on every pass (the probes after a
    full burn-in). job_landed(report): whether a job landed on the node during the screen (the
    window stops the screen when it says so).
    """

    def __init__(self, config: DaemonConfig, ports: DaemonPorts, feed: LifecycleFeed,
                 findings: FindingsTracker, *, window: ScreeningWindow, idle: IdleTracker,
                 metrics: DaemonMetrics, stamps: StampClock, monotonic: Callable[[], float],
                 probe: Callable[[PassReport], ProbeReport],
                 job_landed: Callable[[PassReport], Optional[str]],
                 devices: Optional[DeviceTaints] = None) -> None:
        self.config = config
        self.node = config.node
        self.ports = ports
        self.feed = feed
        self.findings = findings
        self.window = window
        self.idle = idle
        self.metrics = metrics
        self.stamps = stamps
        self.monotonic = monotonic
        self.probe = probe
        self.job_landed = job_landed
        self.devices = devices  # per-GPU taints where the cluster uses DRA (device_taints.py)
        self.requirement = BurninRequirement(min_seconds=config.burnin_duration_s,
                                             min_iterations=config.burnin_min_iterations,
                                             jobs=tuple(config.jobs))
        self.fleet = FleetQuorum(ports.store if config.quorum_nodes else None, config.node,
                                 metrics, need=config.quorum_nodes or 1)
        self.last_end: Optional[float] = None  # monotonic
        self.last_stopped = ""
        self.last_outcome: Optional[Outcome] = None
        # The last verdict written or read at start-up, as the health answer shows it.
        self.last_verdict: Optional[dict[str, Any]] = None

    def restore(self) -> None:
        """At start-up: when the node was last screened, and how, from its stored verdict."""
        try:
            last = self.ports.store.get_verdict(self.node) or {}
        except ScreenerError as e:
            log.warning("cannot read the last verdict of %s: %s", self.node, e)
            last = {}
        self.last_verdict = last if isinstance(last, dict) and last else None
        if not isinstance(last.get("time"), (int, float)):
            return
        # Its age by the stamp clock (never negative: a verdict stamped "in the future" by a
        # clock that stepped back is taken as just now), carried onto the monotonic clock.
        age = max(0.0, self.stamps.now() - float(last["time"]))
        self.last_end = self.monotonic() - age
        try:
            self.last_outcome = Outcome(last.get("outcome"))
        except ValueError:
            self.last_outcome = None
        self.last_stopped = str(last.get("stopped") or "")
        self.fleet.restore(last)
        if self.last_outcome == Outcome.PASS:
            self.metrics.last_success.labels(self.node).set(float(last["time"]))

    def due(self, now: float) -> str:
        """Why a screen is due at monotonic time `now` ("" when none is)."""
        state = self.feed.state
        if (not self.config.screens or state is None
                or state in (NodeState.QUARANTINED, NodeState.REPAIR)):
            return ""
        if self.findings.conditions:
            return ""  # a pass would clear nothing while a condition persists
        last = self.last_end
        if last is not None and self.last_outcome == Outcome.INCONCLUSIVE \
                and self.last_stopped not in (ScreenStop.YIELDED, ScreenStop.SHUTDOWN) \
                and now - last < self.config.retry_inconclusive_s:
            return ""  # wait before retrying an inconclusive screen
        if state == NodeState.BURNIN:
            return "the node is in burnin"
        if state == NodeState.SUSPECT:
            return "the node is suspect: confirming screen"
        if last is None:
            return "never screened"
        if self.fleet.waiting:
            # A platform waiting for its quorum settles as its nodes repeat their jobs: at the
            # retry delay, not a screen interval (a day) per round.
            return "the platform waits for a fleet quorum: screening again"
        if now - last >= self.config.screen_interval_s:
            return f"last screen {now - last:.0f} s ago"
        return ""

    def kind(self) -> str:
        """Full burn-in for a node that has not earned healthy since it entered burnin, else the
        quick screen."""
        state = self.feed.state
        if state == NodeState.BURNIN:
            return KIND_FULL
        if (state == NodeState.SUSPECT
                and not machine.earned_healthy(self.ports.store.history(self.node))):
            return KIND_FULL
        return KIND_QUICK

    def run(self, report: PassReport, before: Optional[ProbeReport]) -> None:
        """Screen the node now (`before`: this pass's probe report) and feed what it found."""
        kind = self.kind()
        outcome = self._open_window(kind, report)
        end = self.stamps.now()
        self.idle.reset()
        self.metrics.screen_done(outcome.outcome, [v.outcome for v in outcome.verdicts],
                                 outcome.seconds, outcome.stopped,
                                 passed_at=end if outcome.outcome == Outcome.PASS else None)
        self.last_end = self.monotonic()
        self.last_outcome = outcome.outcome
        self.last_stopped = outcome.stopped
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
            screen_kind = machine.KIND_PARTIAL if missing else machine.KIND_FULL
            if missing:
                log.warning("burn-in on %s was partial: %s", self.node, "; ".join(missing),
                            extra={"event": "burnin_partial"})
        if not outcome.stopped:
            self.feed.apply(machine.KnownAnswerScreen(verdicts, kind=screen_kind,
                                              conditions=self.findings.conditions),
                            "known-answer screen", report)
            if self.devices is not None:
                # After the node's own transition, which it never changes: a suspect device is
                # tainted alone, a passing one cleared (the only way its taint goes).
                self.devices.after_screen(outcome.verdicts, before.gpus if before else (), report)
        self.last_verdict = {
            "time": end, "outcome": outcome.outcome.value, "stopped": outcome.stopped,
            "kind": screen_kind if not outcome.stopped else kind, "missing": missing,
            "stages": [{"name": st.get("name"), "outcome": st.get("outcome")} for st in stages],
            "detail": outcome.detail, "exit_code": int(outcome.exit_code),
            "verdicts": [v.to_dict() for v in verdicts]}
        self.ports.store.set_verdict(self.node, self.last_verdict)
        self._publish_digests(outcome)
        if not outcome.stopped:
            self.fleet.after({"verdicts": [v.to_dict() for v in outcome.verdicts]},
                             outcome.promote)
        if outcome.stopped and outcome.exit_code == ExitCode.USAGE:
            raise BadInputError(f"screen failed: {outcome.detail}")
        if outcome.stopped and outcome.exit_code == ExitCode.SCREENER_ERROR:
            raise ScreenerError(f"screen failed: {outcome.detail}")

    def _open_window(self, kind: str, report: PassReport) -> ScreenOutcome:
        """The screening window itself, with its metric and log lines; `report` gets it."""
        cap = self.config.screen_time_cap_s + (self.config.burnin_duration_s if kind == KIND_FULL
                                               else 0.0)
        self.metrics.screening.labels(self.node).set(1)
        log.info("opening a screening window on %s (%s): %s", self.node,
                 "full burn-in" if kind == KIND_FULL else "quick screen", report.screen_due,
                 extra={"event": "screen_start", "kind": kind})
        fleet = self.fleet.view(full=kind == KIND_FULL)
        try:
            outcome = self.window.run(kind, cap, job_check=lambda: self.job_landed(report),
                                      fleet=fleet,
                                      repeat=self.fleet.repeat() if fleet is not None else None)
        finally:
            self.metrics.screening.labels(self.node).set(0)
        report.screen = outcome
        return outcome

    def _publish_digests(self, outcome: ScreenOutcome) -> None:
        """A passing screen's digests on the Node, for same-platform peers' cross-checks."""
        cluster = self.ports.node_object
        if outcome.outcome == Outcome.PASS and cluster is not None and self.config.publish_digests:
            digests = platform_digests(outcome.verdicts, outcome.digests)
            if digests:
                cluster.publish({ANNOTATION_DIGESTS: json.dumps(digests, sort_keys=True)})

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
        store = self.ports.store
        if hasattr(store, "annotations_by_node"):
            try:
                cc = crosscheck_digests_stage(self.node, outcome.verdicts, outcome.digests, store)
                peers_available = int(cc.data.get("nodes_compared") or 0) > 0
                stages.append(cc.to_dict())
                verdicts += list(cc.verdicts)
            except ScreenerError as e:
                log.warning("cross-check with peers failed: %s", e)
        after = self.probe(report)  # its findings go to the lifecycle as usual
        stages.append(probe_report_stage("probes-after", after).to_dict())
        devices = len(after.gpus) or 1
        missing = missing_for_full(stages, self.requirement, devices=devices,
                                   peers_available=peers_available)
        return tuple(verdicts), missing, stages
