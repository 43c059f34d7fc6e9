"""The node lifecycle: a pure state machine and its policy (lemon rule, quarantine budget).

States: burnin, healthy, suspect, quarantined, repair (screener.types.NodeState). Plain data in
(the node's current state, one input event, its history, the fleet's counts, the time), plain data
out (a Decision: the transitions to record, the new state, and the actions the caller should take).
Nothing here reads a clock, a file or the network; stores and the daemon do that around it.

Inputs and what they do:
  * a new node (current state None) starts in burnin;
  * known-answer verdicts: all pass -> a suspect node that had earned healthy becomes healthy again
    (the quick screen re-verifies); a burnin node, or a suspect node that never earned healthy since
    it last entered burnin, becomes healthy only on a FULL burn-in (KatScreen.kind == "full"); a
    partial burn-in or a quick screen never clears it. While a persisting condition
    (KatScreen.conditions: a pending row remap, a remap failure, retired pages over the threshold,
    a GPU off the bus, an unrecovered critical Xid) is present, no pass clears anything. A mismatch confirmed by a re-run, or a mismatch on a node already suspect (the
    confirming screen failed) -> quarantined; a single unconfirmed mismatch -> suspect, and a
    confirming screen is requested; inconclusive changes nothing;
  * probe findings: critical -> quarantined, or repair for the codes that mean the GPU must leave
    service (row remap failure, recurring uncorrectable ECC, retired pages over the threshold);
    warning or suspect -> suspect (a pending row remap or pending page retirement: reason "reset
    required"); ok/info -> nothing (clean telemetry never clears a node). The daemon re-applies a
    persisting condition on every probe (level-triggered), which is a no-op while the node is out;
  * a straggler alarm (check "straggler") -> suspect with the detector's figures as evidence;
  * adoption (Adopted): a node found serving on a running fleet with no state -> healthy, marked
    unscreened; its first quick screen follows at its next idle window;
  * in-job alarms: settled -> quarantined; unsettled -> suspect;
  * remediation of a quarantined node (deep health check, GPU reset): passed -> burnin, failed -> repair;
  * a person's command, checked against the same table; repair is left only this way.

Policy: a confirmed failure that makes `lemon_min_failures` within `lemon_window_days` for the node,
or for any GPU serial it blames (counted across nodes), sends the node to repair even when every
diagnostic passes (a failure stamped after now, by a wall clock that stepped back, counts as just
now). Automatic quarantines (and repairs) stop at the quarantine budget, a share of the
fleet (at least one node); past it the node is held in suspect with an alert, and a person decides.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from screener.settings import strict as configs
from screener.errors import TransitionRefused
from screener.lifecycle.records import ACTOR_HUMAN, ACTOR_SCREENER, Transition
from screener.types import (ALARM_CHECK_REASONS, BUDGET_STATES, AlarmRecord, Finding, NodeState,
                            Outcome, Reason, Severity, Verdict)

S = NodeState

# Evidence keys other modules use to talk to the lifecycle.
EVIDENCE_CONFIRMED = "confirmed"  # Verdict.evidence: True when the mismatch repeated on a re-run
EVIDENCE_GPU_SERIAL = "gpu_serial"  # a single serial (Verdict/Finding/AlarmRecord evidence)
EVIDENCE_GPU_SERIALS = "gpu_serials"  # a list of serials
EVIDENCE_HELD_BY_BUDGET = "held_by_budget"  # on a transition into suspect held by the budget
EVIDENCE_SERIAL = "serial"  # where probe findings (GpuSnapshot.identity) carry the GPU's serial

# What a known-answer screen was (KatScreen.kind; also in the verdict annotation).
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
STRAGGLER_CHECK = "straggler"


class Action(str, enum.Enum):
    """What the caller (the daemon, burn-in, the CLI) should do after a decision."""

    REQUEST_CONFIRMING_SCREEN = "request_confirming_screen"  # re-run known-answer jobs soon
    ALERT_BUDGET_EXHAUSTED = "alert_budget_exhausted"  # tell a person: the breaker tripped
    DEEP_HEALTH_CHECK = "deep_health_check"  # diagnostics, row-remap check, GPU reset
    START_BURNIN = "start_burnin"  # run the burn-in sequence
    REQUEST_REPAIR = "request_repair"  # out of service; ticket / replacement for a person


class Trigger(str, enum.Enum):
    """Who may make a move in the transition table."""

    AUTO = "auto"
    HUMAN = "human"


A, H = Trigger.AUTO, Trigger.HUMAN

# The transition table: (from, to) -> who may make the move. Anything not listed is refused.
TRANSITIONS: Mapping[tuple[Optional[NodeState], NodeState], frozenset[Trigger]] = {
    (None, S.BURNIN): frozenset({A, H}),
    (None, S.SUSPECT): frozenset({H}),
    (None, S.QUARANTINED): frozenset({H}),
    (None, S.REPAIR): frozenset({H}),
    (None, S.HEALTHY): frozenset({A}),  # adoption of a node already serving (Adopted)
    (S.BURNIN, S.HEALTHY): frozenset({A}),
    (S.BURNIN, S.SUSPECT): frozenset({A, H}),
    (S.BURNIN, S.QUARANTINED): frozenset({A, H}),
    (S.BURNIN, S.REPAIR): frozenset({A, H}),
    (S.HEALTHY, S.SUSPECT): frozenset({A, H}),
    (S.HEALTHY, S.QUARANTINED): frozenset({A, H}),
    (S.HEALTHY, S.REPAIR): frozenset({A, H}),
    (S.HEALTHY, S.BURNIN): frozenset({H}),
    (S.SUSPECT, S.HEALTHY): frozenset({A}),
    (S.SUSPECT, S.QUARANTINED): frozenset({A, H}),
    (S.SUSPECT, S.REPAIR): frozenset({A, H}),
    (S.SUSPECT, S.BURNIN): frozenset({H}),
    # A suspect node's confirmed failure that the budget holds is recorded (it counts, and marks
    # the node held: no pass clears it, and reconsider_held gives it the next free slot).
    (S.SUSPECT, S.SUSPECT): frozenset({A}),
    (S.QUARANTINED, S.BURNIN): frozenset({A, H}),
    (S.QUARANTINED, S.REPAIR): frozenset({A, H}),
    (S.REPAIR, S.BURNIN): frozenset({H}),
}

_ENTRY_ACTIONS: Mapping[NodeState, tuple[Action, ...]] = {
    S.BURNIN: (Action.START_BURNIN,),
    S.HEALTHY: (),
    S.SUSPECT: (Action.REQUEST_CONFIRMING_SCREEN,),
    S.QUARANTINED: (Action.DEEP_HEALTH_CHECK,),
    S.REPAIR: (Action.REQUEST_REPAIR,),
}


def refusal(from_state: Optional[NodeState], to_state: NodeState, trigger: Trigger) -> Optional[str]:
    """Why the table refuses this move for this trigger, or None when it is allowed."""
    name = from_state.value if from_state else "(new node)"
    if from_state == to_state:
        return f"the node is already {to_state.value}"
    allowed = TRANSITIONS.get((from_state, to_state))
    if allowed and trigger in allowed:
        return None
    if to_state == S.HEALTHY:
        return ("only a passing known-answer screen makes a node healthy; set it to burnin to "
                "screen it")
    if from_state == S.REPAIR:
        return "a node in repair goes back into service only through burnin"
    if allowed:
        return f"{name} -> {to_state.value} is made only by the screener, not by a person"
    return f"{name} -> {to_state.value} is not a move the lifecycle allows"


# --- policy --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LifecyclePolicy:
    """Lemon rule and quarantine budget. Build from config with from_mapping (unknown keys fail)."""

    lemon_window_days: float = 30.0
    lemon_min_failures: int = 3
    quarantine_budget: float = 0.10  # share of the fleet that automatic quarantines may take
    min_budget_nodes: int = 1  # the budget is never below this many nodes

    def __post_init__(self) -> None:
        # Both sides bounded, and a bool is no number: `quarantine_budget = true` was 100%.
        configs.require_number("lifecycle", "lemon_window_days", self.lemon_window_days, 0.0,
                               3650.0, low_open=True, unit="days")
        configs.require_number("lifecycle", "lemon_min_failures", self.lemon_min_failures, 1,
                               1000, integer=True)
        configs.require_number("lifecycle", "quarantine_budget", self.quarantine_budget, 0.0, 1.0,
                               unit="a share of the fleet")
        configs.require_number("lifecycle", "min_budget_nodes", self.min_budget_nodes, 0,
                               1_000_000, integer=True)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "LifecyclePolicy":
        return configs.from_mapping(cls, d, "lifecycle")

    @property
    def window_seconds(self) -> float:
        return self.lemon_window_days * 86400.0

    def budget_limit(self, fleet_size: int) -> int:
        """How many nodes automatic decisions may hold out of service at once."""
        # The epsilon keeps 0.1 * 30 from flooring to 2 through float error.
        return max(self.min_budget_nodes, math.floor(self.quarantine_budget * fleet_size + 1e-9))


DEFAULT_POLICY = LifecyclePolicy()


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


# --- input events ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSeen:
    """The node exists (the daemon started on it); makes an unknown node start in burnin."""


@dataclass(frozen=True)
class KatScreen:
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
    """The outcome of remediating a quarantined node (deep health check, GPU reset)."""

    passed: bool
    detail: str = ""
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HumanCommand:
    """A person's decision: move the node to `to_state` for `reason`."""

    to_state: NodeState
    reason: str
    user: str = ""  # who, if known; the actor is always "human"


Event = Union[NodeSeen, Adopted, KatScreen, Findings, Remediation, HumanCommand, AlarmRecord, Verdict,
              Sequence[Verdict], Sequence[Finding]]


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


# --- helpers --------------------------------------------------------------------------------------


def camel(code: str) -> str:
    """row_remap_failure -> RowRemapFailure (Kubernetes condition reasons are CamelCase)."""
    parts = [p for p in re.split(r"[^0-9A-Za-z]+", code) if p]
    return "".join(p[:1].upper() + p[1:] for p in parts) or "Unknown"


def _serials(evidence: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    one = evidence.get(EVIDENCE_GPU_SERIAL)
    if one:
        out.append(str(one))
    many = evidence.get(EVIDENCE_GPU_SERIALS)
    if isinstance(many, (list, tuple)):
        out.extend(str(s) for s in many if s)
    return out


def _dedupe(items: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def local_serials(evidence: Mapping[str, Any], known: Sequence[str]) -> dict[str, Any]:
    """Evidence with its GPU serials reduced to those this node's NVML reports (`known`).

    The serial a probe finding names (under "serial", from GpuSnapshot.identity) or an alarm names
    (under "gpu_serial"/"gpu_serials") becomes "gpu_serials", the key the lemon rule reads, only
    when it is one of `known`; a serial of another node's GPU is dropped (and noted under
    "foreign_serials") so it can never count against a GPU here.
    """
    out = dict(evidence)
    named: list[str] = []
    for key in (EVIDENCE_SERIAL, EVIDENCE_GPU_SERIAL):
        v = out.pop(key, None) if key == EVIDENCE_GPU_SERIAL else out.get(key)
        if isinstance(v, (str, int)) and str(v):
            named.append(str(v))
    many = out.pop(EVIDENCE_GPU_SERIALS, None)
    if isinstance(many, (list, tuple)):
        named.extend(str(x) for x in many if isinstance(x, (str, int)) and str(x))
    mine = set(str(k) for k in known if k)
    ok = _dedupe([x for x in named if x in mine])
    foreign = _dedupe([x for x in named if x not in mine])
    if ok:
        out[EVIDENCE_GPU_SERIALS] = list(ok)
    if foreign:
        out["foreign_serials"] = list(foreign)
    return out


def earned_healthy(history: Sequence[Transition]) -> bool:
    """Whether the node has been healthy since it last entered burnin (by a full burn-in, a pass
    that cleared it, or adoption): only then may the quick screen clear it again."""
    for t in reversed(history):
        if t.to_state == S.HEALTHY:
            return True
        if t.to_state == S.BURNIN:
            return False
    return False


class SignalKind(enum.Enum):
    """What an automatic input says about the node, for the policy."""

    FAILURE = "failure"  # confirmed: quarantine (or repair)
    AMBIGUOUS = "ambiguous"  # one unconfirmed signal: suspect, confirm by a screen
    PASS = "pass"  # a passing known-answer screen
    NONE = "none"  # nothing to act on


@dataclass(frozen=True)
class _Signal:
    """An automatic input reduced to what the policy needs."""

    kind: SignalKind
    code: str
    reason: str
    evidence: Mapping[str, Any]
    serials: tuple[str, ...] = ()
    step: Optional[int] = None
    job: Optional[str] = None
    since: Optional[float] = None  # when the signal was first seen, if earlier than now


def _classify(event: Any, current: Optional[NodeState]) -> _Signal:
    if isinstance(event, Verdict):
        event = KatScreen((event,))
    elif isinstance(event, (list, tuple)) and event and all(isinstance(v, Verdict) for v in event):
        event = KatScreen(tuple(event))
    elif isinstance(event, (list, tuple)) and all(isinstance(f, Finding) for f in event):
        event = Findings(tuple(event))
    if isinstance(event, KatScreen):
        return _classify_screen(event, current)
    if isinstance(event, Findings):
        return _classify_findings(event)
    if isinstance(event, AlarmRecord) and event.check == STRAGGLER_CHECK:
        return _classify_straggler(event)
    if isinstance(event, AlarmRecord):
        return _classify_alarm(event)
    raise TypeError(f"not a lifecycle input: {type(event).__name__}")


def _classify_screen(event: KatScreen, current: Optional[NodeState]) -> _Signal:
    bad = [v for v in event.verdicts if v.outcome == Outcome.SUSPECT]
    verdicts = [v.to_dict() for v in event.verdicts]
    if bad:
        serials = _dedupe([s for v in bad for s in _serials(v.evidence)])
        devices = ", ".join(v.device for v in bad)
        first = bad[0]
        where = f" (job {first.job}, step {first.step}, tensor {first.tensor})" if first.job else ""
        confirmed = event.confirmed or any(v.evidence.get(EVIDENCE_CONFIRMED) for v in bad)
        evidence = {"verdicts": verdicts, "confirmed": bool(confirmed)}
        if confirmed:
            return _Signal(SignalKind.FAILURE, Reason.KAT_MISMATCH,
                           f"known-answer mismatch confirmed by a re-run on {devices}{where}",
                           evidence, serials)
        if current == S.SUSPECT:
            # The node is suspect and this is the confirming screen we asked for: it failed.
            return _Signal(SignalKind.FAILURE, Reason.KAT_MISMATCH,
                           f"confirming known-answer screen mismatched on {devices}{where}",
                           evidence, serials)
        return _Signal(SignalKind.AMBIGUOUS, Reason.KAT_MISMATCH,
                       f"known-answer mismatch on {devices}{where}, not yet re-run",
                       evidence, serials)
    if event.verdicts and all(v.outcome == Outcome.PASS for v in event.verdicts):
        what = {KIND_FULL: "full burn-in", KIND_PARTIAL: "partial burn-in"}.get(
            event.kind, "known-answer screen")
        return _Signal(SignalKind.PASS, Reason.KAT_PASSED,
                       f"{what} passed on {len(event.verdicts)} device(s)",
                       {"verdicts": verdicts, "screen_kind": event.kind})
    return _Signal(SignalKind.NONE, "", "known-answer screen inconclusive; an inconclusive "
                   "screen never clears or blames a node", {"verdicts": verdicts})


def _classify_findings(event: Findings) -> _Signal:
    if not event.findings:
        return _Signal(SignalKind.NONE, "", "no findings", {})
    worst = max(event.findings, key=lambda f: f.severity)
    relevant = [f for f in event.findings if f.severity >= Severity.WARNING]
    serials = _dedupe([s for f in relevant for s in _serials(f.evidence)])
    evidence = {"findings": [f.to_dict() for f in relevant]}
    on_gpu = f" on GPU {worst.gpu}" if worst.gpu else ""
    text = f"{worst.severity.label} finding {worst.code}{on_gpu}: {worst.message}"
    if worst.severity >= Severity.CRITICAL:
        return _Signal(SignalKind.FAILURE, camel(worst.code), text, evidence, serials)
    if worst.severity >= Severity.WARNING:
        reset = [f for f in relevant if f.code in RESET_CODES]
        if reset:
            # A pending remap takes effect only at a GPU reset: the node stays out until then.
            return _Signal(SignalKind.AMBIGUOUS, Reason.RESET_REQUIRED,
                           f"reset required: {reset[0].message}", evidence, serials)
        return _Signal(SignalKind.AMBIGUOUS, camel(worst.code), text, evidence, serials)
    return _Signal(SignalKind.NONE, "", "clean telemetry never clears or blames a node", {})


def _classify_straggler(event: AlarmRecord) -> _Signal:
    """A straggler is slow, not wrong: never a failure, always the confirming screen."""
    figures = {k: event.evidence.get(k) for k in ("slowdown", "score", "consecutive",
                                                  "median", "duration", "window", "k")
               if k in event.evidence}
    evidence = {"alarm": event.to_dict(), "straggler": figures}
    slow = figures.get("slowdown")
    text = (f"straggler at step {event.step}" + (f" of job {event.job}" if event.job else "")
            + (f": {float(slow):.0%} slower than the median" if isinstance(slow, (int, float))
               else "") + (f" for {figures['consecutive']} steps" if "consecutive" in figures
                           else ""))
    return _Signal(SignalKind.AMBIGUOUS, Reason.STRAGGLER, text, evidence,
                   _dedupe(_serials(event.evidence)), step=event.step, job=event.job or None,
                   since=event.created if event.created > 0 else None)


def _classify_alarm(event: AlarmRecord) -> _Signal:
    """An in-job alarm: settled ones are failures, unsettled ones ambiguous."""
    code = ALARM_CHECK_REASONS.get(event.check, camel(event.check))
    where = f"in-job alarm {event.check} at step {event.step}" + (f" of job {event.job}"
                                                                  if event.job else "")
    kind = SignalKind.FAILURE if event.settled else SignalKind.AMBIGUOUS
    return _Signal(kind, code, f"{'settled' if event.settled else 'unsettled'} {where}",
                   {"alarm": event.to_dict()}, _dedupe(_serials(event.evidence)), step=event.step,
                   job=event.job or None, since=event.created if event.created > 0 else None)


def _rollback(current: Optional[NodeState], history: Sequence[Transition], sig: _Signal,
              now: float) -> dict[str, Any]:
    """Where the suspect period began: the first suspect time (and training step, if known)."""
    last = history[-1] if history else None
    if current == S.SUSPECT and last is not None and last.to_state == S.SUSPECT:
        # The suspect period began with the transition into suspect: keep its start.
        rb = dict(last.rollback or {"time": last.time, "step": None, "job": None})
        if rb.get("step") is None and sig.step is not None:
            rb["step"], rb["job"] = sig.step, sig.job
        return rb
    t0 = min(now, sig.since) if sig.since is not None else now
    return {"time": t0, "step": sig.step, "job": sig.job}


def _held_by_budget(history: Sequence[Transition]) -> bool:
    last = history[-1] if history else None
    return bool(last and last.to_state == S.SUSPECT and last.evidence.get(EVIDENCE_HELD_BY_BUDGET))


# --- the decision ---------------------------------------------------------------------------------


def decide(node: str, current: Optional[NodeState], event: Any, *, now: float,
           history: Sequence[Transition] = (), failures: Sequence[Transition] = (),
           fleet: Optional[FleetCounts] = None,
           policy: LifecyclePolicy = DEFAULT_POLICY) -> Decision:
    """Decide what one input does to a node.

    current: the node's state (None: never seen; it starts in burnin).
    history: the node's transitions, oldest first (for the lemon rule and the rollback hint).
    failures: recent failure transitions of the whole fleet (for the lemon rule per GPU serial;
      may include this node's too).
    fleet: the fleet's counts for the quarantine budget (default: a fleet of this node alone).
    Raises TransitionRefused for a person's command the table does not allow; automatic inputs
    that change nothing return a Decision without transitions.
    """
    if isinstance(event, HumanCommand):
        return _human(node, current, event, now)
    if isinstance(event, Adopted):
        return _adopt(node, current, event, now)
    d = _Deciding(node, current, list(history), now)
    if current is None:
        d.enter_burnin()
        if isinstance(event, NodeSeen):
            return d.stay("", (Action.START_BURNIN,))
    if isinstance(event, NodeSeen):
        return d.stay("known node")
    if isinstance(event, Remediation):
        return _on_remediation(d, event)
    sig = _classify(event, d.current)
    if sig.kind == SignalKind.NONE:
        return d.stay(sig.reason)
    if sig.kind == SignalKind.PASS:
        return _on_pass(d, sig, event)
    if d.current == S.REPAIR:
        return d.stay("a node in repair is left only by a person")
    if sig.kind == SignalKind.AMBIGUOUS:
        return _on_ambiguous(d, sig)
    return _on_failure(d, sig, event, failures, fleet or FleetCounts(total=1, out_of_service=0),
                       policy)


def _human(node: str, current: Optional[NodeState], event: HumanCommand, now: float) -> Decision:
    """A person's command: any move the table allows a person, with a reason."""
    why = refusal(current, event.to_state, H)
    if why:
        raise TransitionRefused(f"node {node}: {current.value if current else '(new)'} -> "
                                f"{event.to_state.value} refused: {why}")
    if not event.reason.strip():
        raise TransitionRefused(f"node {node}: a person's decision needs a reason")
    actions = tuple(a.value for a in _ENTRY_ACTIONS[event.to_state])
    evidence: dict[str, Any] = {"user": event.user} if event.user else {}
    t = Transition(node=node, time=now, from_state=current, to_state=event.to_state,
                   reason=event.reason.strip(), actor=ACTOR_HUMAN, code=Reason.MANUAL,
                   evidence=evidence, actions=actions)
    return Decision(state=event.to_state, transitions=(t,), actions=actions)


def _adopt(node: str, current: Optional[NodeState], event: Adopted, now: float) -> Decision:
    """A node found serving with no state: healthy, marked unscreened."""
    if current is not None:
        return Decision(state=current, note="known node: adoption applies only to a new one")
    t = Transition(node=node, time=now, from_state=None, to_state=S.HEALTHY,
                   reason=f"adopted as healthy but not yet screened: {event.why}; screened at "
                          "its next idle window", code=Reason.ADOPTED,
                   evidence={"adopted": True, "why": event.why, "screen_kind": "unscreened"})
    return Decision(state=S.HEALTHY, transitions=(t,))


class _Deciding:
    """One automatic decision in progress: the transitions made so far, and the two ways to end."""

    def __init__(self, node: str, current: Optional[NodeState], history: list[Transition],
                 now: float) -> None:
        self.node, self.current, self.history, self.now = node, current, history, now
        self.transitions: list[Transition] = []

    def enter_burnin(self) -> None:
        """A node never seen starts in burnin, before whatever the input does."""
        t = Transition(node=self.node, time=self.now, from_state=None, to_state=S.BURNIN,
                       reason="new node: screened before it takes work", code=Reason.NEW_NODE,
                       actions=(Action.START_BURNIN.value,))
        self.transitions.append(t)
        self.history.append(t)
        self.current = S.BURNIN

    def move(self, to: NodeState, reason: str, code: str, evidence: Mapping[str, Any], *,
             failure: bool = False, serials: tuple[str, ...] = (),
             rollback: Optional[Mapping[str, Any]] = None,
             actions: Optional[tuple[Action, ...]] = None) -> Decision:
        """Record a move the table allows the screener, and end the decision with it."""
        why = refusal(self.current, to, A)
        if why:  # a bug in this module, not a bad node: the policy must follow the table
            raise AssertionError(f"lifecycle policy produced a refused move: {why}")
        return self.record(to, reason, code, evidence, failure=failure, serials=serials,
                           rollback=rollback,
                           actions=actions if actions is not None else _ENTRY_ACTIONS[to])

    def record(self, to: NodeState, reason: str, code: str, evidence: Mapping[str, Any], *,
               failure: bool, serials: tuple[str, ...], rollback: Optional[Mapping[str, Any]],
               actions: tuple[Action, ...]) -> Decision:
        acts = tuple(a.value for a in actions)
        self.transitions.append(Transition(
            node=self.node, time=self.now, from_state=self.current, to_state=to, reason=reason,
            actor=ACTOR_SCREENER, code=code, evidence=dict(evidence), failure=failure,
            gpu_serials=serials, rollback=rollback, actions=acts))
        return Decision(state=to, transitions=tuple(self.transitions), actions=acts)

    def stay(self, note: str, actions: tuple[Action, ...] = ()) -> Decision:
        """End the decision without a move (transitions made so far are kept)."""
        assert self.current is not None
        return Decision(state=self.current, transitions=tuple(self.transitions),
                        actions=tuple(a.value for a in actions), note=note)


def _on_remediation(d: _Deciding, event: Remediation) -> Decision:
    assert d.current is not None
    if d.current != S.QUARANTINED:
        return d.stay(f"remediation result ignored: the node is {d.current.value}, not quarantined")
    ev = {"remediation": {"passed": event.passed, "detail": event.detail, **dict(event.evidence)}}
    detail = f": {event.detail}" if event.detail else ""
    if event.passed:
        return d.move(S.BURNIN, f"remediation passed{detail}; burn-in must prove the node",
                      Reason.REMEDIATED, ev)
    return d.move(S.REPAIR, f"remediation failed{detail}", Reason.REMEDIATION_FAILED, ev,
                  failure=True)


def _on_pass(d: _Deciding, sig: _Signal, event: Any) -> Decision:
    """A passing screen clears a node only when it is allowed to (see the module docstring)."""
    assert d.current is not None
    kind = event.kind if isinstance(event, KatScreen) else KIND_QUICK
    conditions = event.conditions if isinstance(event, KatScreen) else ()
    if d.current not in (S.BURNIN, S.SUSPECT):
        return d.stay(f"passing screen changes nothing for a {d.current.value} node")
    if d.current == S.SUSPECT and _held_by_budget(d.history):
        return d.stay("a passing screen does not clear a node held suspect by the quarantine "
                      "budget: a person decides", (Action.ALERT_BUDGET_EXHAUSTED,))
    if conditions:
        what = "; ".join(f"{c.code}" + (f" on GPU {c.gpu}" if c.gpu else "") for c in conditions)
        return d.stay(f"a passing screen clears nothing while a condition persists: {what}")
    # A partial burn-in never clears; the quick screen only re-verifies a node that earned it.
    if kind == KIND_PARTIAL or (kind != KIND_FULL
                                and not (d.current == S.SUSPECT and earned_healthy(d.history))):
        return d.stay(f"a {kind} screen passed, but only a full burn-in makes a node healthy "
                      f"that has not earned it since it entered burnin", (Action.START_BURNIN,))
    return d.move(S.HEALTHY, sig.reason, sig.code, sig.evidence)


def _on_ambiguous(d: _Deciding, sig: _Signal) -> Decision:
    """One unconfirmed signal: suspect, and a confirming screen decides."""
    assert d.current is not None
    if d.current in (S.HEALTHY, S.BURNIN):
        return d.move(S.SUSPECT, sig.reason, sig.code, sig.evidence, serials=sig.serials,
                      rollback=_rollback(d.current, d.history, sig, d.now))
    if d.current == S.SUSPECT:
        return d.stay("already suspect; the confirming screen decides",
                      (Action.REQUEST_CONFIRMING_SCREEN,))
    return d.stay(f"ambiguous signal on a {d.current.value} node changes nothing")


def _on_failure(d: _Deciding, sig: _Signal, event: Any, failures: Sequence[Transition],
                fleet: FleetCounts, policy: LifecyclePolicy) -> Decision:
    """A confirmed failure: quarantine, or repair under the lemon rule, within the budget."""
    assert d.current is not None
    lemon = _lemon(d.node, sig.serials, d.history, failures, d.now, policy)
    must_repair = isinstance(event, Findings) and any(
        f.code in REPAIR_CODES and f.severity >= Severity.CRITICAL for f in event.findings)
    target = S.REPAIR if lemon or must_repair else S.QUARANTINED
    if d.current == target:
        return d.stay(f"already {d.current.value}")
    reason, code, evidence = sig.reason, sig.code, dict(sig.evidence)
    if lemon:
        evidence["lemon"] = lemon
        reason = f"{lemon['why']}; latest: {sig.reason}"
        code = Reason.REPEATED_FAILURES
    rollback = _rollback(d.current, d.history, sig, d.now)
    limit = policy.budget_limit(fleet.total)
    if d.current in BUDGET_STATES or fleet.out_of_service + 1 <= limit:
        if d.current not in BUDGET_STATES:
            # The counts it was granted on: a store claims its slot below this limit.
            evidence["budget"] = {"limit": limit, "out_of_service": fleet.out_of_service,
                                  "fleet": fleet.total}
        return d.move(target, reason, code, evidence, failure=True, serials=sig.serials,
                      rollback=rollback)
    # Past the budget: held in suspect, and a person decides.
    evidence[EVIDENCE_HELD_BY_BUDGET] = True
    evidence["wanted"] = target.value
    evidence["budget"] = {"limit": limit, "out_of_service": fleet.out_of_service,
                          "fleet": fleet.total}
    held = (f"{reason}; held in suspect: the quarantine budget ({limit} of {fleet.total} "
            f"nodes) is used up, a person decides")
    alert = (Action.ALERT_BUDGET_EXHAUSTED,)
    if d.current != S.SUSPECT:
        return d.move(S.SUSPECT, held, Reason.BUDGET, evidence, failure=True, serials=sig.serials,
                      rollback=rollback, actions=alert)
    if _held_by_budget(d.history):
        return d.stay(held, alert)
    # Not `move`: the table's only self-move. Unrecorded, the failure would be lost: a later pass
    # would clear the node and a freed slot would never find it.
    return d.record(S.SUSPECT, held, Reason.BUDGET, evidence, failure=True, serials=sig.serials,
                    rollback=rollback, actions=alert)


def _lemon(node: str, serials: Sequence[str], history: Sequence[Transition],
           failures: Sequence[Transition], now: float,
           policy: LifecyclePolicy) -> Optional[dict[str, Any]]:
    """The lemon rule, counting this failure: the reason to send to repair, or None."""
    since = now - policy.window_seconds
    seen: dict[str, Transition] = {}
    for t in list(history) + list(failures):
        # A failure stamped after `now` counts (its age is taken as zero): a wall clock that
        # stepped back, here or on the node that recorded it, must not hide it from the rule.
        if t.failure and t.time >= since:
            seen[t.id] = t
    node_count = 1 + sum(1 for t in seen.values() if t.node == node)
    days = f"{policy.lemon_window_days:g} days"
    if node_count >= policy.lemon_min_failures:
        return {"node": node, "count": node_count, "window_days": policy.lemon_window_days,
                "why": f"lemon rule: {node_count} failures of node {node} within {days}"}
    for s in serials:
        hits = [t for t in seen.values() if s in t.gpu_serials]
        count = 1 + len(hits)
        if count >= policy.lemon_min_failures:
            nodes = sorted({t.node for t in hits} | {node})
            return {"gpu_serial": s, "count": count, "nodes": nodes,
                    "window_days": policy.lemon_window_days,
                    "why": f"lemon rule: {count} failures of GPU {s} within {days} "
                           f"(on {', '.join(nodes)})"}
    return None
