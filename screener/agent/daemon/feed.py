"""The daemon's way into the lifecycle: feed an event, keep the node's state, note what moved.

Every event the daemon has (the node seen or adopted at start-up: `begin`; an alarm, probe
findings, a screen's verdicts, a rung of the repair ladder, a slot the quarantine budget freed:
`apply`) goes through this feed: the lifecycle decides (screener.lifecycle.apply), the store
records, and each recorded move is followed by the same things wherever it came from: a metric,
an entry in the pass report, a log line, the incident times the MTBI metric counts, and for a
quarantine the deep health check when one is configured (in observe mode only a line saying what
enforce would have started; at start-up only the metric and a line).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

from screener.agent.daemon.clock import StampClock
from screener.agent.metrics import DaemonMetrics
from screener.agent.daemon.passreport import PassReport
from screener.agent.daemon.ports import DaemonPorts
from screener.lifecycle import machine
from screener.lifecycle.apply import apply_event, release_held
from screener.lifecycle.records import Transition
from screener.settings.daemon import DaemonConfig
from screener.types import NodeState

log = logging.getLogger("screener.daemon")

BUDGET_LOOK_S = 30.0  # a node held by the budget looks for a free slot at most this often


class LifecycleFeed:
    """The node's state as the lifecycle last decided it, and the one way to change it.

    ports: the daemon's (the store and the deep check are read from it at each use). observe:
    observe mode (issue 24.2): moves are recorded as ever, but no deep check starts.
    """

    def __init__(self, config: DaemonConfig, ports: DaemonPorts, *, stamps: StampClock,
                 monotonic: Callable[[], float], metrics: DaemonMetrics, observe: bool) -> None:
        self.config = config
        self.node = config.node
        self.ports = ports
        self.stamps = stamps
        self.monotonic = monotonic
        self.metrics = metrics
        self.observe = observe
        self.state: Optional[NodeState] = None
        self.next_budget_look = 0.0  # monotonic
        self.incidents: list[float] = []  # failure times within mtbi_days (the MTBI metric)

    def apply(self, event: Any, why: str, report: PassReport) -> machine.Decision:
        """Feed one event to the lifecycle; what it did goes into `report` and the metrics."""
        decision = apply_event(self.ports.store, self.node, event, now=self.stamps.now(),
                               policy=self.config.lifecycle)
        self.state = decision.state
        self.note(decision.transitions, why, report)
        self.metrics.set_state(self.state)
        return decision

    def begin(self, event: Any) -> machine.Decision:
        """The start-up event (the node seen, or adopted), through the same gateway as every
        other; its moves get their metric and a line at info level (a daemon starting is not an
        incident: no pass report, no deep check, no incident time)."""
        decision = apply_event(self.ports.store, self.node, event, now=self.stamps.now(),
                               policy=self.config.lifecycle)
        for t in decision.transitions:
            self.metrics.transitions.labels(self.node, t.to_state.value).inc()
            log.info("node %s: %s -> %s: %s", self.node, t.from_state.value if t.from_state
                     else "(new)", t.to_state.value, t.reason,
                     extra={"event": "transition", "to": t.to_state.value})
        self.state = decision.state
        self.metrics.set_state(self.state)
        return decision

    def reconsider_budget(self, report: PassReport) -> None:
        """A node held by the budget takes a slot another node freed: a quarantine like any other
        (its metrics, its log line, its deep health check)."""
        if self.state not in (None, NodeState.SUSPECT):
            return
        mono = self.monotonic()
        if mono < self.next_budget_look:
            return
        # Looked at most every BUDGET_LOOK_S on the monotonic clock (release_held's SlotLooks
        # compares wall stamps, which a stepped clock would defeat: the feed holds none).
        self.next_budget_look = mono + BUDGET_LOOK_S
        self.state, released = release_held(self.ports.store, self.node, self.state,
                                            now=self.stamps.now(), policy=self.config.lifecycle)
        if released is not None:
            self.note((released,), "a quarantine budget slot freed", report)

    def note(self, transitions: Sequence[Transition], why: str, report: PassReport) -> None:
        """What every recorded move is followed by: a metric, the pass report, a log line, and
        for a quarantine the deep health check when it is configured."""
        if any(t.failure for t in transitions):
            self.incidents.extend(t.time for t in transitions if t.failure)
            self.update_mtbi()
        for t in transitions:
            self.metrics.transitions.labels(self.node, t.to_state.value).inc()
            entry = {"from": t.from_state.value if t.from_state else None, "to": t.to_state.value,
                     "reason": t.reason, "code": t.code, "time": t.time, "cause": why}
            report.transitions.append(entry)
            log.warning("node %s: %s -> %s: %s", self.node, entry["from"] or "(new)",
                        t.to_state.value, t.reason,
                        extra={"event": "transition", "to": t.to_state.value, "code": t.code,
                               "cause": why})
            # On entry only: a repair step (quarantined -> quarantined) is not a new quarantine.
            if (t.to_state == NodeState.QUARANTINED and t.from_state != NodeState.QUARANTINED
                    and self.ports.on_quarantine is not None):
                if self.observe:  # says what enforce would have started
                    report.actions.append({"action": machine.Action.DEEP_HEALTH_CHECK.value,
                                           "result": "not started: observe mode"})
                else:
                    self._deep_check(report)

    def _deep_check(self, report: PassReport) -> None:
        on_quarantine = self.ports.on_quarantine
        assert on_quarantine is not None
        try:
            started = on_quarantine(self.node)
        except Exception as e:  # noqa: BLE001 - the quarantine stands; a person follows up
            self.metrics.error("deep_health_check")
            log.error("deep health check on %s could not be started: %s", self.node, e)
            return
        if started is not None:
            report.actions.append({"action": machine.Action.DEEP_HEALTH_CHECK.value,
                                   "result": getattr(started, "to_dict", lambda: str(started))()})

    # --- the MTBI metric (issue 24.4) -----------------------------------------------------------

    def seed_incidents(self, history: Sequence[Transition]) -> None:
        """The incident times from the history read at start-up; later incidents are added as
        they are recorded (`note`), so no event reads the history for them."""
        self.incidents = sorted(t.time for t in history if t.failure)
        self.update_mtbi()

    def update_mtbi(self) -> None:
        """Set the incident and MTBI metrics from the incidents within `mtbi_days` (in memory:
        at most the node's own history, whatever the fleet's size)."""
        since = self.stamps.now() - self.config.mtbi_days * 86400.0
        self.incidents = [t for t in self.incidents if t >= since]
        self.metrics.set_incidents(self.incidents)
