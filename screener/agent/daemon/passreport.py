"""What one pass of the daemon's loop did: `PassReport`, the `--once` output and the tests' view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from screener.agent.daemon.intake import IntakeResult
from screener.agent.screening.window import ScreenOutcome
from screener.health.verdict.idle import Activity
from screener.types import NO_WORK_STATES, ExitCode, NodeState, Outcome


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
        if self.state in (None, NodeState.BURNIN) or (self.screen is not None
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
