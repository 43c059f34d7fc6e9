"""The node lifecycle: a pure state machine and its policy (lemon rule, quarantine budget).

States: burnin, healthy, suspect, quarantined, repair (screener.types.NodeState). Plain data in
(the node's current state, one input event, its history, the fleet's counts, the time), plain data
out (a Decision: the transitions to record, the new state, and the actions the caller should take).
Nothing here reads a clock, a file or the network; stores and the daemon do that around it.

Inputs and what they do:
  * a new node (current state None) starts in burnin;
  * known-answer verdicts: all pass -> a suspect node that had earned healthy becomes healthy again
    (the quick screen re-verifies); a burnin node, or a suspect node that never earned healthy since
    it last entered burnin, becomes healthy only on a FULL burn-in (KnownAnswerScreen.kind == "full"); a
    partial burn-in or a quick screen never clears it. While a persisting condition
    (KnownAnswerScreen.conditions: a pending row remap, a remap failure, retired pages over the threshold,
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
  * a person's command, checked against the same table; repair is left only this way;
  * a person's replacement of the instance (Replaced, from `screener hyperpod replace`) -> repair,
    by a person, as the table allows a person's move there (a node in repair records it too);
  * a look for a free budget slot (BudgetLook): a node held in suspect by the quarantine budget
    takes the move it was denied, into quarantine or repair, once the budget has room.

Policy: a confirmed failure that makes `lemon_min_failures` within `lemon_window_days` for the node,
or for any GPU serial it blames (counted across nodes), sends the node to repair even when every
diagnostic passes (a failure stamped after now, by a wall clock that stepped back, counts as just
now). Automatic quarantines (and repairs) stop at the quarantine budget, a share of the
fleet (at least one node); past it the node is held in suspect with an alert, and a person decides.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from screener.errors import TransitionRefused
from screener.lifecycle.events import (EVIDENCE_CONFIRMED, EVIDENCE_GPU_SERIAL,  # noqa: F401
                                       EVIDENCE_GPU_SERIALS, EVIDENCE_HELD_BY_BUDGET,
                                       EVIDENCE_SERIAL, KIND_FULL, KIND_PARTIAL, KIND_QUICK,
                                       REPAIR_CODES, RESET_CODES, SCREEN_KINDS, STRAGGLER_CHECK,
                                       Adopted, BudgetLook, Decision, Event, FleetCounts,
                                       Findings, HumanCommand, KnownAnswerScreen, NodeSeen, Remediation,
                                       Replaced, RepairStep)
from screener.lifecycle.records import ACTOR_HUMAN, ACTOR_SCREENER, Transition
from screener.lifecycle.signals import (SignalKind, _classify, _held_by_budget,  # noqa: F401
                                        _rollback, _Signal, camel, earned_healthy,
                                        local_serials)
from screener.lifecycle.table import (_ENTRY_ACTIONS, TRANSITIONS, A, Action, H,  # noqa: F401
                                      Trigger, allows, refusal)
from screener.settings.lifecycle import DEFAULT_POLICY, LifecyclePolicy
from screener.types import BUDGET_STATES, NodeState, Reason, Severity

__all__ = [
    "EVIDENCE_CONFIRMED", "EVIDENCE_GPU_SERIAL", "EVIDENCE_GPU_SERIALS", "EVIDENCE_HELD_BY_BUDGET",
    "EVIDENCE_SERIAL", "KIND_FULL", "KIND_PARTIAL", "KIND_QUICK", "REPAIR_CODES", "RESET_CODES",
    "SCREEN_KINDS", "STRAGGLER_CHECK", "DEFAULT_POLICY", "TRANSITIONS", "Action", "Adopted",
    "BudgetLook", "Decision", "Event", "FleetCounts",
    "Findings", "HumanCommand", "KnownAnswerScreen", "LifecyclePolicy", "NodeSeen", "Remediation",
    "Replaced", "RepairStep",
    "Trigger", "camel", "decide", "earned_healthy", "local_serials", "refusal",
]


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
    if isinstance(event, Replaced):
        return _replaced(node, current, event, now)
    if isinstance(event, BudgetLook):
        # Before a new node would start in burnin: a look changes nothing but a held node.
        return _on_budget_look(node, current, list(history), now,
                               fleet or FleetCounts(total=1, out_of_service=0), policy)
    d = _Deciding(node, current, list(history), now)
    if current is None:
        d.enter_burnin()
        if isinstance(event, NodeSeen):
            return d.stay("", (Action.START_BURNIN,))
    if isinstance(event, NodeSeen):
        return d.stay("known node")
    if isinstance(event, Remediation):
        return _on_remediation(d, event)
    if isinstance(event, RepairStep):
        return _on_repair_step(d, event)
    sig = _classify(event, d.current)
    if sig.kind == SignalKind.NONE:
        return d.stay(sig.reason)
    if sig.kind == SignalKind.PASS:
        return _on_pass(d, sig, event)
    if d.current == NodeState.REPAIR:
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


def _replaced(node: str, current: Optional[NodeState], event: Replaced, now: float) -> Decision:
    """A person's replacement of the instance: repair, where the table allows a person the move.

    Not `refusal`: a node already in repair records its replacement (the table's repair ->
    repair row), where a person's command to repair would be "already"."""
    if not allows(current, NodeState.REPAIR, H):
        raise TransitionRefused(f"node {node}: {current.value if current else '(new)'} -> repair "
                                f"refused: {refusal(current, NodeState.REPAIR, H)}")
    if not event.reason.strip():
        raise TransitionRefused(f"node {node}: a person's replacement needs a reason")
    actions = tuple(a.value for a in _ENTRY_ACTIONS[NodeState.REPAIR])
    t = Transition(node=node, time=now, from_state=current, to_state=NodeState.REPAIR,
                   reason=event.reason, actor=ACTOR_HUMAN, code=Reason.REPLACED,
                   evidence=dict(event.evidence), actions=actions)
    return Decision(state=NodeState.REPAIR, transitions=(t,), actions=actions)


def _on_budget_look(node: str, current: Optional[NodeState], history: list[Transition],
                    now: float, fleet: FleetCounts, policy: LifecyclePolicy) -> Decision:
    """A node held in suspect by the budget takes a slot another node freed: the move it was
    denied (the state it wanted is in the held transition's evidence), counted as any quarantine.

    Its failure was counted when it was held, so this move is not one; its blamed serials and
    rollback hint are the held transition's."""
    if current != NodeState.SUSPECT or not _held_by_budget(history):
        return Decision(state=current, note="not held by the quarantine budget")
    held = history[-1]
    try:
        wanted = NodeState(held.evidence.get("wanted") or NodeState.QUARANTINED.value)
    except ValueError:  # a hand-edited record: the quarantine a confirmed failure makes
        wanted = NodeState.QUARANTINED
    limit = policy.budget_limit(fleet.total)
    if wanted not in BUDGET_STATES or fleet.out_of_service + 1 > limit:
        return Decision(state=current, note=f"held: the quarantine budget ({limit} of "
                                            f"{fleet.total} nodes) is still used up")
    evidence = {"released_by_budget": {"held_transition": held.id, "limit": limit,
                                       "fleet": fleet.total,
                                       "out_of_service": fleet.out_of_service}}
    reason = (f"a quarantine budget slot is free ({fleet.out_of_service + 1} of {limit}); "
              f"held since {held.time:.0f}: {held.reason}")[:1024]
    return _Deciding(node, current, history, now).move(
        wanted, reason, Reason.BUDGET, evidence, failure=False, serials=held.gpu_serials,
        rollback=held.rollback)


def _adopt(node: str, current: Optional[NodeState], event: Adopted, now: float) -> Decision:
    """A node found serving with no state: healthy, marked unscreened."""
    if current is not None:
        return Decision(state=current, note="known node: adoption applies only to a new one")
    t = Transition(node=node, time=now, from_state=None, to_state=NodeState.HEALTHY,
                   reason=f"adopted as healthy but not yet screened: {event.why}; screened at "
                          "its next idle window", code=Reason.ADOPTED,
                   evidence={"adopted": True, "why": event.why, "screen_kind": "unscreened"})
    return Decision(state=NodeState.HEALTHY, transitions=(t,))


class _Deciding:
    """One automatic decision in progress: the transitions made so far, and the two ways to end."""

    def __init__(self, node: str, current: Optional[NodeState], history: list[Transition],
                 now: float) -> None:
        self.node, self.current, self.history, self.now = node, current, history, now
        self.transitions: list[Transition] = []

    def enter_burnin(self) -> None:
        """A node never seen starts in burnin, before whatever the input does."""
        t = Transition(node=self.node, time=self.now, from_state=None, to_state=NodeState.BURNIN,
                       reason="new node: screened before it takes work", code=Reason.NEW_NODE,
                       actions=(Action.START_BURNIN.value,))
        self.transitions.append(t)
        self.history.append(t)
        self.current = NodeState.BURNIN

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
        """Record a move (a self-move too: `move` refuses those) that the table lists."""
        if not allows(self.current, to, A):  # a bug here, as in `move`
            raise AssertionError(f"lifecycle policy produced a move the table does not list: "
                                 f"{self.current} -> {to.value}")
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
    if d.current != NodeState.QUARANTINED:
        return d.stay(f"remediation result ignored: the node is {d.current.value}, not quarantined")
    ev = {"remediation": {"passed": event.passed, "detail": event.detail, **dict(event.evidence)}}
    detail = f": {event.detail}" if event.detail else ""
    if event.passed:
        return d.move(NodeState.BURNIN, f"remediation passed{detail}; burn-in must prove the node",
                      Reason.REMEDIATED, ev)
    return d.move(NodeState.REPAIR, f"remediation failed{detail}", Reason.REMEDIATION_FAILED, ev,
                  failure=True)


def _on_repair_step(d: _Deciding, event: RepairStep) -> Decision:
    """A repair step of a quarantined node: recorded, the node stays quarantined."""
    assert d.current is not None
    if d.current != NodeState.QUARANTINED:
        return d.stay(f"repair step ignored: the node is {d.current.value}, not quarantined")
    ev = {"remediation": {"detail": event.detail, **dict(event.evidence)}}
    # Not `move`: a self-move, which `refusal` reads as "already there"; the table lists it.
    return d.record(NodeState.QUARANTINED, event.detail, Reason.REPAIR_STEP, ev, failure=False,
                    serials=(), rollback=None, actions=())


def _on_pass(d: _Deciding, sig: _Signal, event: Any) -> Decision:
    """A passing screen clears a node only when it is allowed to (see the module docstring)."""
    assert d.current is not None
    kind = event.kind if isinstance(event, KnownAnswerScreen) else KIND_QUICK
    conditions = event.conditions if isinstance(event, KnownAnswerScreen) else ()
    if d.current not in (NodeState.BURNIN, NodeState.SUSPECT):
        return d.stay(f"passing screen changes nothing for a {d.current.value} node")
    if d.current == NodeState.SUSPECT and _held_by_budget(d.history):
        return d.stay("a passing screen does not clear a node held suspect by the quarantine "
                      "budget: a person decides", (Action.ALERT_BUDGET_EXHAUSTED,))
    if conditions:
        what = "; ".join(f"{c.code}" + (f" on GPU {c.gpu}" if c.gpu else "") for c in conditions)
        return d.stay(f"a passing screen clears nothing while a condition persists: {what}")
    # A partial burn-in never clears; the quick screen only re-verifies a node that earned it.
    earned = d.current == NodeState.SUSPECT and earned_healthy(d.history)
    if kind == KIND_PARTIAL or (kind != KIND_FULL and not earned):
        return d.stay(f"a {kind} screen passed, but only a full burn-in makes a node healthy "
                      f"that has not earned it since it entered burnin", (Action.START_BURNIN,))
    return d.move(NodeState.HEALTHY, sig.reason, sig.code, sig.evidence)


def _on_ambiguous(d: _Deciding, sig: _Signal) -> Decision:
    """One unconfirmed signal: suspect, and a confirming screen decides."""
    assert d.current is not None
    if d.current in (NodeState.HEALTHY, NodeState.BURNIN):
        return d.move(NodeState.SUSPECT, sig.reason, sig.code, sig.evidence, serials=sig.serials,
                      rollback=_rollback(d.current, d.history, sig, d.now))
    if d.current == NodeState.SUSPECT:
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
    target = NodeState.REPAIR if lemon or must_repair else NodeState.QUARANTINED
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
    if d.current != NodeState.SUSPECT:
        return d.move(NodeState.SUSPECT, held, Reason.BUDGET, evidence, failure=True,
                      serials=sig.serials, rollback=rollback, actions=alert)
    if _held_by_budget(d.history):
        return d.stay(held, alert)
    # Not `move`: a self-move (the table's suspect -> suspect). Unrecorded, the failure would be
    # lost: a later pass would clear the node and a freed slot would never find it.
    return d.record(NodeState.SUSPECT, held, Reason.BUDGET, evidence, failure=True,
                    serials=sig.serials, rollback=rollback, actions=alert)


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
