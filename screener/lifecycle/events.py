"""What the lifecycle takes in and gives out: the input events, the fleet's counts, the Decision.

Also the names other modules use to talk to the lifecycle: evidence keys, the kinds of a
known-answer screen, and the finding codes with a fixed meaning. The rules that turn these inputs
into decisions are in screener.lifecycle.machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from screener.lifecycle.records import Transition
from screener.alarmfile import STRAGGLER, AlarmRecord
from screener.types import BUDGET_STATES, Finding, NodeState, Verdict

# Evidence keys other modules use to talk to the lifecycle.
EVIDENCE_CONFIRMED = "confirmed"  # Verdict.evidence: True when the mismatch repeated on a re-run
EVIDENCE_GPU_SERIAL = "gpu_serial"  # a single serial (Verdict/Finding/AlarmRecord evidence)
EVIDENCE_GPU_SERIALS = "gpu_serials"  # a list of serials
EVIDENCE_HELD_BY_BUDGET = "held_by_budget"  # on a transition into suspect held by the budget
EVIDENCE_SERIAL = "serial"  # where probe findings (GpuSnapshot.identity) carry the GPU's serial

# What a known-answer screen was (KnownAnswerScreen.kind; also in the verdict annotation).
KIND_QUICK = "quick"  # the daemon's idle-time screen: re-verifies a node that earned healthy
KIND_FULL = "full"  # a complete burn-in (every stage, the configured duration): earns healthy
KIND_PARTIAL = "partial"  # a burn-in with a stage or the duration missing: clears nothing
SCREEN_KINDS = (KIND_QUICK, KIND_FULL, KIND_PARTIAL)

# Finding codes that mean the GPU must leave service for repair (the seeds: "a remap failure, or
# an uncorrectable error that keeps coming back, means remove the GPU from service").
REPAIR_CODES = frozenset({"row_remap_failure", "ecc_uncorrectable_recurring",
                          "retired_pages_over_threshold"})
# Finding codes that a GPU reset (or reboot) clears: the node stays out until they are gone.
RESET_CODES = frozenset({"row_remap_pending", "retired_pages_pending"})
# Alarm check of a persistent straggler (screener.audit.straggler.write_straggler_alarm).
STRAGGLER_CHECK = STRAGGLER


@dataclass(frozen=True)
class FleetCounts:
    """The fleet's size and how many *other* nodes are out of service (quarantined or repair)."""

    total: int
    out_of_service: int = 0

    @classmethod
    def from_states(cls, states: Mapping[str, NodeState], node: str) -> "FleetCounts":
        """Counts from a store's all_states(); `node` itself is included in the total only."""
        names = set(states) | {node}
        out = sum(1 for n, s in states.items() if n != node and s in BUDGET_STATES)
        return cls(total=len(names), out_of_service=out)


@dataclass(frozen=True)
class NodeSeen:
    """The node exists (the daemon started on it); makes an unknown node start in burnin."""


@dataclass(frozen=True)
class KnownAnswerScreen:
    """The verdicts of one known-answer screen of the node (one per device).

    confirmed: the runner already re-ran a mismatching job and it mismatched again. A verdict can
    also say so itself with evidence {"confirmed": true}.
    kind: KIND_QUICK (the daemon's screen), KIND_FULL (a complete burn-in) or KIND_PARTIAL (a
      burn-in missing a stage or its duration). Only a full one makes a burnin node healthy.
    conditions: persisting conditions present when the screen ended (findings whose cause is still
      there); while any is present a pass clears nothing.
    """

    verdicts: tuple[Verdict, ...]
    confirmed: bool = False
    kind: str = KIND_QUICK
    conditions: tuple[Finding, ...] = ()


@dataclass(frozen=True)
class Findings:
    """Findings from the node's probes (NVML, kernel log, host)."""

    findings: tuple[Finding, ...]


@dataclass(frozen=True)
class Adopted:
    """A node with no state found already serving on a running fleet (the daemon's adoption rule):
    it becomes healthy without a screen, marked unscreened, and is screened at its next idle window."""

    why: str


@dataclass(frozen=True)
class Remediation:
    """The outcome of remediating a quarantined node (deep health check, GPU reset, reboot)."""

    passed: bool
    detail: str = ""
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RepairStep:
    """A step of a quarantined node's repair that leaves it quarantined, recorded so it is durable
    before it is acted on (a reboot requested: the daemon that asks for it does not survive it) or
    so its end is on file (a reboot that never happened). Ignored unless the node is quarantined."""

    detail: str
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Replaced:
    """A person's replacement of the node's instance, accepted by the provider (`screener hyperpod
    replace`): the node goes to repair, by a person, with `reason` and the provider's `evidence`.

    Recorded after the provider accepted it, so it is refused only where the table refuses a
    person's move to repair; a node already in repair records it too (its history names the
    replaced instance).
    """

    reason: str
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BudgetLook:
    """A look whether a quarantine-budget slot is free for a node the budget holds in suspect.

    The held node takes the slot (the move it was denied, into quarantine or repair); anything
    else (a node not held, no slot free) changes nothing.
    """


@dataclass(frozen=True)
class HumanCommand:
    """A person's decision: move the node to `to_state` for `reason`."""

    to_state: NodeState
    reason: str
    user: str = ""  # who, if known; the actor is always "human"


Event = Union[NodeSeen, Adopted, KnownAnswerScreen, Findings, Remediation, RepairStep, Replaced, BudgetLook,
              HumanCommand, AlarmRecord, Verdict, Sequence[Verdict], Sequence[Finding]]


@dataclass(frozen=True)
class Decision:
    """What the lifecycle decided: transitions to record in order, the state after, the actions.

    `note` says in words why nothing changed when `transitions` is empty.
    """

    state: Optional[NodeState]
    transitions: tuple[Transition, ...] = ()
    actions: tuple[str, ...] = ()
    note: str = ""

    @property
    def transition(self) -> Optional[Transition]:
        """The last transition, or None when nothing changed."""
        return self.transitions[-1] if self.transitions else None

    @property
    def changed(self) -> bool:
        return bool(self.transitions)

