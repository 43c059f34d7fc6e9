"""The node lifecycle: transition table, policy (lemon rule, quarantine budget), rollback hints."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from screener.errors import ConfigError, TransitionRefused
from screener.lifecycle.machine import (DEFAULT_POLICY, TRANSITIONS, Action, FleetCounts, Findings,
                                        HumanCommand, KnownAnswerScreen, LifecyclePolicy, NodeSeen,
                                        Remediation, Trigger, camel, decide, earned_healthy)
from screener.lifecycle.records import Transition
from screener.alarmfile import AlarmRecord
from screener.types import (Finding, NodeState, Outcome, Severity, SuspectNode,
                            Verdict)

S = NodeState
NOW = 1_800_000_000.0
DAY = 86400.0


def verdict(outcome: Outcome, device: str = "cuda:0", **evidence: object) -> Verdict:
    return Verdict(device=device, outcome=outcome, reason="golden_mismatch" if outcome == Outcome.SUSPECT
                   else "", job="gemm_fp32", step=4, tensor="out", evidence=dict(evidence))


def alarm(settled: bool, step: int = 1200, created: float = NOW - 60, **evidence: object) -> AlarmRecord:
    return AlarmRecord(alarm_id="a1", check="ring_replay", step=step, settled=settled,
                       suspect_ranks=(3,), suspect_nodes=(SuspectNode("n1", "n1"),), node="n1",
                       job="llm-7b", created=created, evidence=dict(evidence))


def finding(sev: Severity, code: str = "row_remap_failure", **evidence: object) -> Findings:
    return Findings((Finding(severity=sev, code=code, message="m", gpu="0", evidence=dict(evidence)),))


KAT_PASS = KnownAnswerScreen((verdict(Outcome.PASS), verdict(Outcome.PASS, "cuda:1")))
FULL_PASS = KnownAnswerScreen(KAT_PASS.verdicts, kind="full")
PARTIAL_PASS = KnownAnswerScreen(KAT_PASS.verdicts, kind="partial")
PENDING = Finding(Severity.SUSPECT, "row_remap_pending", "GPU 1: a row remap is pending", gpu="1")
KNOWN_ANSWER_MISMATCH = KnownAnswerScreen((verdict(Outcome.PASS), verdict(Outcome.SUSPECT, "cuda:1")))
KAT_CONFIRMED = KnownAnswerScreen((verdict(Outcome.SUSPECT, confirmed=True),))
KAT_INCONCLUSIVE = KnownAnswerScreen((verdict(Outcome.INCONCLUSIVE),))

RCS, DHC, SB, RR, ABE = (Action.REQUEST_CONFIRMING_SCREEN.value, Action.DEEP_HEALTH_CHECK.value,
                         Action.START_BURNIN.value, Action.REQUEST_REPAIR.value,
                         Action.ALERT_BUDGET_EXHAUSTED.value)

# (state, input) -> (states the node passes through, actions of the decision)
TABLE = [
    ("new node", None, NodeSeen(), [S.BURNIN], (SB,)),
    ("known node seen", S.HEALTHY, NodeSeen(), [], ()),
    ("full burn-in passes", S.BURNIN, FULL_PASS, [S.HEALTHY], ()),
    ("quick screen never clears burnin", S.BURNIN, KAT_PASS, [], (SB,)),
    ("partial burn-in never clears burnin", S.BURNIN, PARTIAL_PASS, [], (SB,)),
    ("full pass with a pending remap", S.BURNIN, KnownAnswerScreen(FULL_PASS.verdicts, kind="full",
                                                           conditions=(PENDING,)), [], ()),
    ("pending remap: reset required", S.HEALTHY, Findings((PENDING,)), [S.SUSPECT], (RCS,)),
    ("remap failure goes to repair", S.HEALTHY, finding(Severity.CRITICAL), [S.REPAIR], (RR,)),
    ("critical xid quarantines", S.HEALTHY, finding(Severity.CRITICAL, "xid"), [S.QUARANTINED], (DHC,)),
    ("burn-in single mismatch", S.BURNIN, KNOWN_ANSWER_MISMATCH, [S.SUSPECT], (RCS,)),
    ("burn-in confirmed mismatch", S.BURNIN, KAT_CONFIRMED, [S.QUARANTINED], (DHC,)),
    ("burn-in inconclusive", S.BURNIN, KAT_INCONCLUSIVE, [], ()),
    ("unsettled alarm", S.HEALTHY, alarm(False), [S.SUSPECT], (RCS,)),
    ("settled alarm", S.HEALTHY, alarm(True), [S.QUARANTINED], (DHC,)),
    ("warning finding", S.HEALTHY, finding(Severity.WARNING, "ecc_correctable"), [S.SUSPECT], (RCS,)),
    ("suspect finding", S.HEALTHY, finding(Severity.SUSPECT, "xid"), [S.SUSPECT], (RCS,)),
    ("info finding", S.HEALTHY, finding(Severity.INFO), [], ()),
    ("single mismatch on healthy", S.HEALTHY, KNOWN_ANSWER_MISMATCH, [S.SUSPECT], (RCS,)),
    ("confirmed mismatch on healthy", S.HEALTHY, KAT_CONFIRMED, [S.QUARANTINED], (DHC,)),
    ("pass on healthy", S.HEALTHY, KAT_PASS, [], ()),
    ("confirming screen passes", S.SUSPECT, FULL_PASS, [S.HEALTHY], ()),
    ("quick pass never clears a suspect that never earned healthy", S.SUSPECT, KAT_PASS, [], (SB,)),
    ("confirming screen fails", S.SUSPECT, KNOWN_ANSWER_MISMATCH, [S.QUARANTINED], (DHC,)),
    ("second unsettled alarm", S.SUSPECT, alarm(False), [], (RCS,)),
    ("settled alarm on suspect", S.SUSPECT, alarm(True), [S.QUARANTINED], (DHC,)),
    ("clean telemetry never clears", S.SUSPECT, finding(Severity.OK), [], ()),
    ("inconclusive never clears", S.SUSPECT, KAT_INCONCLUSIVE, [], ()),
    ("pass does not release quarantine", S.QUARANTINED, KAT_PASS, [], ()),
    ("warning on quarantined", S.QUARANTINED, finding(Severity.WARNING), [], ()),
    ("remediation passes", S.QUARANTINED, Remediation(True, "reset ok"), [S.BURNIN], (SB,)),
    ("remediation fails", S.QUARANTINED, Remediation(False, "row remap failed"), [S.REPAIR], (RR,)),
    ("remediation on healthy ignored", S.HEALTHY, Remediation(True), [], ()),
    ("repair ignores a pass", S.REPAIR, KAT_PASS, [], ()),
    ("repair ignores an alarm", S.REPAIR, alarm(True), [], ()),
    ("new node with settled alarm", None, alarm(True), [S.BURNIN, S.QUARANTINED], (DHC,)),
    ("bare verdict list", S.HEALTHY, [verdict(Outcome.SUSPECT, confirmed=True)], [S.QUARANTINED], (DHC,)),
    ("bare finding list", S.HEALTHY, [Finding(Severity.CRITICAL, "xid", "x")], [S.QUARANTINED], (DHC,)),
]


@pytest.mark.parametrize("name,state,event,path,actions", TABLE, ids=[t[0] for t in TABLE])
def test_transition_table(name, state, event, path, actions):
    fleet = FleetCounts(total=100, out_of_service=0)
    d = decide("n1", state, event, now=NOW, fleet=fleet)
    assert [t.to_state for t in d.transitions] == path
    assert d.actions == actions
    assert d.state == (path[-1] if path else state)
    prev = state
    for t in d.transitions:
        assert t.from_state == prev and t.node == "n1" and t.time == NOW
        assert (prev, t.to_state) in TRANSITIONS and Trigger.AUTO in TRANSITIONS[(prev, t.to_state)]
        assert t.actor == "screener" and t.reason and t.code
        prev = t.to_state
    if not path:
        assert d.note  # says why nothing changed


def test_failure_flags_and_codes():
    d = decide("n1", S.HEALTHY, alarm(True), now=NOW)
    assert d.transition.failure and d.transition.code == "RingReplayMismatch"
    d = decide("n1", S.HEALTHY, alarm(False), now=NOW)
    assert not d.transition.failure
    d = decide("n1", S.HEALTHY, finding(Severity.CRITICAL, "row_remap_failure"), now=NOW)
    assert d.transition.failure and d.transition.code == "RowRemapFailure"
    d = decide("n1", S.SUSPECT, KNOWN_ANSWER_MISMATCH, now=NOW)
    assert d.transition.failure and d.transition.code == "KnownAnswerMismatch"
    assert d.transition.evidence["verdicts"][1]["device"] == "cuda:1"
    d = decide("n1", S.HEALTHY, KnownAnswerScreen((verdict(Outcome.SUSPECT),), confirmed=True), now=NOW)
    assert d.state == S.QUARANTINED and d.transition.evidence["confirmed"] is True
    assert camel("nvlink-crc_errors") == "NvlinkCrcErrors"


# --- human commands -------------------------------------------------------------------------------

ALL_FROM = [None] + list(NodeState)


@pytest.mark.parametrize("current", ALL_FROM, ids=lambda s: s.value if s else "new")
@pytest.mark.parametrize("target", list(NodeState), ids=lambda s: s.value)
def test_human_commands_follow_the_table(current, target):
    cmd = HumanCommand(target, "operator decision", user="alice")
    allowed = TRANSITIONS.get((current, target), frozenset())
    if Trigger.HUMAN in allowed and current != target:
        d = decide("n1", current, cmd, now=NOW)
        (t,) = d.transitions
        assert (t.from_state, t.to_state, t.actor, t.reason) == (current, target, "human",
                                                                 "operator decision")
        assert t.evidence["user"] == "alice" and not t.failure
    else:
        with pytest.raises(TransitionRefused) as e:
            decide("n1", current, cmd, now=NOW)
        assert "refused" in str(e.value)


def test_human_refusals_explain():
    with pytest.raises(TransitionRefused, match="only a passing known-answer screen"):
        decide("n1", S.SUSPECT, HumanCommand(S.HEALTHY, "looks fine"), now=NOW)
    with pytest.raises(TransitionRefused, match="only through burnin"):
        decide("n1", S.REPAIR, HumanCommand(S.QUARANTINED, "x"), now=NOW)
    with pytest.raises(TransitionRefused, match="already"):
        decide("n1", S.HEALTHY, HumanCommand(S.HEALTHY, "x"), now=NOW)
    with pytest.raises(TransitionRefused, match="needs a reason"):
        decide("n1", S.REPAIR, HumanCommand(S.BURNIN, "  "), now=NOW)
    d = decide("n1", S.REPAIR, HumanCommand(S.BURNIN, "GPU replaced"), now=NOW)
    assert d.state == S.BURNIN and d.actions == (SB,)


def test_repair_is_left_only_by_a_person():
    for event in (KAT_PASS, Remediation(True), alarm(False), NodeSeen(), finding(Severity.OK)):
        assert decide("n1", S.REPAIR, event, now=NOW).state == S.REPAIR


# --- quarantine budget ----------------------------------------------------------------------------


@pytest.mark.parametrize("fleet,limit", [(0, 1), (1, 1), (9, 1), (10, 1), (15, 1), (19, 1), (20, 2),
                                         (30, 3), (70, 7), (100, 10), (1000, 100)])
def test_budget_limit(fleet, limit):
    assert DEFAULT_POLICY.budget_limit(fleet) == limit


def test_budget_allows_then_holds():
    ok = decide("n1", S.HEALTHY, alarm(True), now=NOW, fleet=FleetCounts(20, 1))
    assert ok.state == S.QUARANTINED
    held = decide("n1", S.HEALTHY, alarm(True), now=NOW, fleet=FleetCounts(20, 2))
    assert held.state == S.SUSPECT and held.actions == (ABE,)
    t = held.transition
    assert t.failure and t.code == "QuarantineBudgetExhausted"
    assert t.evidence["held_by_budget"] is True and t.evidence["wanted"] == "quarantined"
    assert t.evidence["budget"] == {"limit": 2, "out_of_service": 2, "fleet": 20}
    # Small fleets still get one automatic quarantine, never more.
    assert decide("n1", S.HEALTHY, alarm(True), now=NOW, fleet=FleetCounts(3, 0)).state == S.QUARANTINED
    assert decide("n1", S.HEALTHY, alarm(True), now=NOW, fleet=FleetCounts(3, 1)).state == S.SUSPECT
    # A suspect node past the budget stays suspect and alerts; a burn-in node is held in suspect too.
    d = decide("n1", S.SUSPECT, KNOWN_ANSWER_MISMATCH, now=NOW, fleet=FleetCounts(20, 2))
    assert d.state == S.SUSPECT and d.actions == (ABE,)
    assert [(t.from_state, t.to_state) for t in d.transitions] == [(S.SUSPECT, S.SUSPECT)]
    d = decide("n1", S.BURNIN, KAT_CONFIRMED, now=NOW, fleet=FleetCounts(10, 1))
    assert d.state == S.SUSPECT and d.actions == (ABE,)
    # A person's quarantine is not limited by the budget.
    d = decide("n1", S.SUSPECT, HumanCommand(S.QUARANTINED, "I checked"), now=NOW,
               fleet=FleetCounts(20, 19))
    assert d.state == S.QUARANTINED


def test_budget_hold_is_not_cleared_by_a_pass_but_quarantines_when_room_returns():
    held = decide("n1", S.HEALTHY, alarm(True), now=NOW, fleet=FleetCounts(20, 2))
    hist = list(held.transitions)
    d = decide("n1", S.SUSPECT, KAT_PASS, now=NOW + 60, history=hist, fleet=FleetCounts(20, 2))
    assert d.state == S.SUSPECT and not d.transitions and d.actions == (ABE,)
    d = decide("n1", S.SUSPECT, alarm(True), now=NOW + 120, history=hist, fleet=FleetCounts(20, 1))
    assert d.state == S.QUARANTINED


def test_a_suspect_nodes_failure_held_by_the_budget_is_recorded_and_not_cleared_by_a_pass():
    # Healthy (earned), then an unconfirmed mismatch: suspect. The confirming screen fails while
    # the budget is used up: the node is held, and that is recorded.
    hist = [Transition("n1", NOW - 100, S.BURNIN, S.HEALTHY, "full burn-in passed"),
            decide("n1", S.HEALTHY, KnownAnswerScreen((verdict(Outcome.SUSPECT),)), now=NOW - 50).transition]
    d = decide("n1", S.SUSPECT, KNOWN_ANSWER_MISMATCH, now=NOW, history=hist, fleet=FleetCounts(20, 2))
    (t,) = d.transitions
    assert (t.from_state, t.to_state, t.code, t.failure) == (S.SUSPECT, S.SUSPECT,
                                                              "QuarantineBudgetExhausted", True)
    assert t.evidence["held_by_budget"] is True and t.evidence["wanted"] == "quarantined"
    assert t.rollback["time"] == NOW - 50  # the suspect period began with the first mismatch
    hist.append(t)
    # A later passing screen does not clear it (it would have: the node had earned healthy).
    p = decide("n1", S.SUSPECT, KAT_PASS, now=NOW + 60, history=hist, fleet=FleetCounts(20, 2))
    assert p.state == S.SUSPECT and not p.transitions and p.actions == (ABE,)
    # Held once: another failure while held records nothing more.
    again = decide("n1", S.SUSPECT, KNOWN_ANSWER_MISMATCH, now=NOW + 120, history=hist,
                   fleet=FleetCounts(20, 2))
    assert again.state == S.SUSPECT and not again.transitions and again.actions == (ABE,)


def test_budget_counts_from_states():
    states = {"a": S.HEALTHY, "b": S.QUARANTINED, "c": S.REPAIR, "d": S.SUSPECT}
    assert FleetCounts.from_states(states, "e") == FleetCounts(5, 2)
    assert FleetCounts.from_states(states, "b") == FleetCounts(4, 1)


# --- lemon rule -----------------------------------------------------------------------------------


def failure(node: str, when: float, serials: tuple[str, ...] = (), to=S.QUARANTINED) -> Transition:
    return Transition(node=node, time=when, from_state=S.HEALTHY, to_state=to, reason="settled alarm",
                      code="RingReplayMismatch", failure=True, gpu_serials=serials)


def test_lemon_rule_per_node():
    hist = [failure("n1", NOW - 20 * DAY), failure("n1", NOW - 5 * DAY)]
    d = decide("n1", S.HEALTHY, alarm(True), now=NOW, history=hist, fleet=FleetCounts(100, 0))
    assert d.state == S.REPAIR and d.actions == (RR,)
    t = d.transition
    assert t.code == "RepeatedFailures" and t.failure
    assert t.evidence["lemon"]["count"] == 3 and "3 failures of node n1" in t.reason
    # One of them outside the 30-day window: an ordinary quarantine.
    hist_old = [failure("n1", NOW - 31 * DAY), failure("n1", NOW - 5 * DAY)]
    assert decide("n1", S.HEALTHY, alarm(True), now=NOW, history=hist_old,
                  fleet=FleetCounts(100, 0)).state == S.QUARANTINED
    # Non-failure transitions do not count; the same transition in history and failures counts once.
    soft = [Transition("n1", NOW - DAY, S.HEALTHY, S.SUSPECT, "x")] * 5
    assert decide("n1", S.HEALTHY, alarm(True), now=NOW, history=soft + hist_old[1:],
                  failures=hist_old[1:], fleet=FleetCounts(100, 0)).state == S.QUARANTINED
    # Configurable window and count.
    policy = LifecyclePolicy(lemon_window_days=60, lemon_min_failures=3)
    assert decide("n1", S.HEALTHY, alarm(True), now=NOW, history=hist_old, policy=policy,
                  fleet=FleetCounts(100, 0)).state == S.REPAIR
    policy = LifecyclePolicy(lemon_min_failures=2)
    assert decide("n1", S.HEALTHY, alarm(True), now=NOW, history=hist_old, policy=policy,
                  fleet=FleetCounts(100, 0)).state == S.REPAIR


def test_lemon_rule_sends_to_repair_even_when_diagnostics_pass():
    # Third failure arrives while the node is quarantined after two failures: repair.
    hist = [failure("n1", NOW - 9 * DAY), failure("n1", NOW - 2 * DAY)]
    d = decide("n1", S.QUARANTINED, finding(Severity.CRITICAL), now=NOW, history=hist,
               fleet=FleetCounts(10, 1))  # budget full, but the node is already out of service
    assert d.state == S.REPAIR and d.transition.from_state == S.QUARANTINED
    # Passing diagnostics afterwards do not bring it back.
    assert decide("n1", S.REPAIR, KAT_PASS, now=NOW + 1, history=hist + [d.transition]).state == S.REPAIR


def test_lemon_rule_follows_a_gpu_serial_across_nodes():
    fails = [failure("n7", NOW - 25 * DAY, ("GPU-SN-42",)), failure("n9", NOW - 3 * DAY, ("GPU-SN-42",)),
             failure("n8", NOW - 1 * DAY, ("GPU-SN-99",))]
    d = decide("n1", S.HEALTHY, alarm(True, gpu_serial="GPU-SN-42"), now=NOW, failures=fails,
               fleet=FleetCounts(100, 0))
    assert d.state == S.REPAIR
    lemon = d.transition.evidence["lemon"]
    assert lemon["gpu_serial"] == "GPU-SN-42" and lemon["count"] == 3
    assert lemon["nodes"] == ["n1", "n7", "n9"]
    assert d.transition.gpu_serials == ("GPU-SN-42",)
    # Serials from verdict and finding evidence work the same way.
    d = decide("n1", S.HEALTHY, KnownAnswerScreen((verdict(Outcome.SUSPECT, confirmed=True,
                                                   gpu_serial="GPU-SN-42"),)),
               now=NOW, failures=fails, fleet=FleetCounts(100, 0))
    assert d.state == S.REPAIR
    d = decide("n1", S.HEALTHY, finding(Severity.CRITICAL, gpu_serials=["GPU-SN-42"]), now=NOW,
               failures=fails, fleet=FleetCounts(100, 0))
    assert d.state == S.REPAIR
    # Another GPU: an ordinary quarantine.
    d = decide("n1", S.HEALTHY, alarm(True, gpu_serial="GPU-SN-99"), now=NOW, failures=fails,
               fleet=FleetCounts(100, 0))
    assert d.state == S.QUARANTINED and d.transition.gpu_serials == ("GPU-SN-99",)


# --- rollback hint --------------------------------------------------------------------------------


def test_rollback_points_at_the_first_suspect_time_and_step():
    first = decide("n1", S.HEALTHY, alarm(False, step=1200, created=NOW - 300), now=NOW)
    assert first.transition.rollback == {"time": NOW - 300, "step": 1200, "job": "llm-7b"}
    later = decide("n1", S.SUSPECT, KNOWN_ANSWER_MISMATCH, now=NOW + 3600, history=list(first.transitions))
    assert later.state == S.QUARANTINED
    assert later.transition.rollback == {"time": NOW - 300, "step": 1200, "job": "llm-7b"}
    # Without an alarm, the suspect period starts when the node became suspect.
    s = decide("n1", S.HEALTHY, KNOWN_ANSWER_MISMATCH, now=NOW)
    q = decide("n1", S.SUSPECT, alarm(True, step=50), now=NOW + 10, history=list(s.transitions))
    assert q.transition.rollback == {"time": NOW, "step": 50, "job": "llm-7b"}


# --- policy config and records --------------------------------------------------------------------


def test_policy_config_is_strict():
    p = LifecyclePolicy.from_mapping({"lemon_window_days": 14, "quarantine_budget": 0.2})
    assert p.lemon_window_days == 14 and p.budget_limit(10) == 2
    with pytest.raises(ConfigError, match=r"lifecycle config: unknown key\(s\) lemon_days"):
        LifecyclePolicy.from_mapping({"lemon_days": 14})
    for bad in ({"lemon_min_failures": 0}, {"quarantine_budget": 1.5}, {"lemon_window_days": 0},
                {"lemon_min_failures": 2.5}, {"min_budget_nodes": -1}, {"quarantine_budget": "10%"}):
        with pytest.raises(ConfigError):
            LifecyclePolicy.from_mapping(bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.lemon_min_failures = 5  # type: ignore[misc]


def test_transition_round_trip():
    d = decide("n1", S.HEALTHY, alarm(True, gpu_serial="S1"), now=NOW)
    t = d.transition
    back = Transition.from_dict(t.to_dict())
    assert back == t and back.id == t.id
    with pytest.raises(ValueError, match="malformed"):
        Transition.from_dict({"node": "n1"})


# --- property: automatic decisions never leave the table -------------------------------------------

EVENTS = st.sampled_from([KAT_PASS, FULL_PASS, PARTIAL_PASS, KNOWN_ANSWER_MISMATCH, KAT_CONFIRMED, KAT_INCONCLUSIVE, alarm(True),
                          alarm(False), finding(Severity.CRITICAL), finding(Severity.WARNING),
                          finding(Severity.OK), Remediation(True), Remediation(False), NodeSeen()])


@settings(max_examples=150, deadline=None)
@given(events=st.lists(EVENTS, max_size=25), out=st.integers(0, 3))
def test_automatic_runs_follow_the_table(events, out):
    state, history = None, []
    for i, ev in enumerate(events):
        d = decide("n1", state, ev, now=NOW + i * 3600, history=history, failures=history,
                   fleet=FleetCounts(20, out))
        for t in d.transitions:
            assert t.from_state == state
            assert Trigger.AUTO in TRANSITIONS[(state, t.to_state)]
            if t.to_state == S.HEALTHY:
                # Only a passing screen clears; only a full burn-in clears a node that has not
                # been healthy since it last entered burnin.
                assert ev is FULL_PASS or (ev is KAT_PASS and state == S.SUSPECT
                                           and earned_healthy(history))
            assert state != S.REPAIR  # repair is left only by a person
            history.append(t)
            state = t.to_state
        assert d.state == state


# --- burn-in gate, level-triggered conditions, serials, adoption, stragglers -------------------------


def test_only_a_full_burnin_earns_healthy_and_then_the_quick_screen_reverifies():
    hist: list[Transition] = []
    state = None
    for ev, want in ((NodeSeen(), S.BURNIN), (KAT_PASS, S.BURNIN), (PARTIAL_PASS, S.BURNIN),
                     (FULL_PASS, S.HEALTHY), (KNOWN_ANSWER_MISMATCH, S.SUSPECT), (KAT_PASS, S.HEALTHY)):
        d = decide("n1", state, ev, now=NOW + len(hist), history=hist)
        hist += list(d.transitions)
        state = d.state
        assert state == want, (ev, d.note)
    assert hist[-1].evidence["screen_kind"] == "quick"
    assert [t.evidence.get("screen_kind") for t in hist if t.to_state == S.HEALTHY] == ["full", "quick"]
    # Out through quarantine and back into burnin: the earlier pass no longer counts.
    hist.append(Transition("n1", NOW + 50, S.HEALTHY, S.SUSPECT, "x"))
    hist.append(Transition("n1", NOW + 51, S.SUSPECT, S.BURNIN, "operator", actor="human"))
    hist.append(Transition("n1", NOW + 52, S.BURNIN, S.SUSPECT, "y"))
    assert not earned_healthy(hist)
    assert decide("n1", S.SUSPECT, KAT_PASS, now=NOW + 60, history=hist).state == S.SUSPECT


def test_a_pending_remap_keeps_the_node_out_with_reason_reset_required():
    d = decide("n1", S.HEALTHY, Findings((PENDING,)), now=NOW)
    t = d.transition
    assert t.to_state == S.SUSPECT and t.code == "ResetRequired"
    assert t.reason.startswith("reset required")
    hist = [Transition("n1", NOW - 10, None, S.BURNIN, "new"),
            Transition("n1", NOW - 5, S.BURNIN, S.HEALTHY, "full"), t]
    held = decide("n1", S.SUSPECT, KnownAnswerScreen(KAT_PASS.verdicts, conditions=(PENDING,)),
                  now=NOW + 1, history=hist)
    assert held.state == S.SUSPECT and "row_remap_pending" in held.note
    # The same finding applied again (level-triggered) changes nothing while it is suspect.
    assert not decide("n1", S.SUSPECT, Findings((PENDING,)), now=NOW + 2, history=hist).changed
    # Once gone, the re-screen clears it.
    assert decide("n1", S.SUSPECT, KAT_PASS, now=NOW + 3, history=hist).state == S.HEALTHY


def test_local_serials_keep_only_this_nodes_gpus():
    from screener.lifecycle.machine import local_serials

    ev = local_serials({"serial": "S-mine", "gpu_serials": ["S-other", "S-mine"], "index": 0},
                       ["S-mine", "S-2"])
    assert ev["gpu_serials"] == ["S-mine"] and ev["foreign_serials"] == ["S-other"]
    assert ev["index"] == 0 and "gpu_serial" not in ev
    assert "gpu_serials" not in local_serials({"gpu_serial": "S-other"}, ["S-mine"])


def test_adoption_makes_a_new_node_healthy_but_unscreened_and_only_a_new_one():
    from screener.lifecycle.machine import Adopted

    d = decide("n1", None, Adopted("3 GPU pods running"), now=NOW)
    assert [t.to_state for t in d.transitions] == [S.HEALTHY]
    assert d.transition.code == "AdoptedUnscreened" and d.transition.evidence["screen_kind"] == "unscreened"
    assert not decide("n1", S.BURNIN, Adopted("x"), now=NOW).changed


def test_a_straggler_alarm_makes_the_node_suspect_with_its_figures():
    a = AlarmRecord(alarm_id="st-1", check="straggler", step=40, settled=False, suspect_ranks=(5,),
                    suspect_nodes=(SuspectNode("n1", "n1"),), node="n1", job="llm",
                    created=NOW - 1, evidence={"slowdown": 0.25, "score": 9.1, "consecutive": 5,
                                               "median": 1.0, "duration": 1.25})
    d = decide("n1", S.HEALTHY, a, now=NOW)
    t = d.transition
    assert t.to_state == S.SUSPECT and t.code == "Straggler" and not t.failure
    assert t.evidence["straggler"]["slowdown"] == 0.25 and "25% slower" in t.reason
    assert Action.REQUEST_CONFIRMING_SCREEN.value in d.actions


def test_lemon_rule_counts_failures_stamped_after_now():
    """Issue 23.3: after the wall clock stepped back, earlier failures carry stamps "in the
    future"; they still count (age zero), here and for a GPU serial another node recorded."""
    hist = [failure("n1", NOW + 2 * DAY), failure("n1", NOW + 9 * DAY)]
    d = decide("n1", S.HEALTHY, alarm(True), now=NOW, history=hist, fleet=FleetCounts(100, 0))
    assert d.state == S.REPAIR and d.transition.evidence["lemon"]["count"] == 3
    fails = [failure("n7", NOW + DAY, ("GPU-SN-42",)), failure("n9", NOW - DAY, ("GPU-SN-42",))]
    d = decide("n1", S.HEALTHY, alarm(True, gpu_serial="GPU-SN-42"), now=NOW, failures=fails,
               fleet=FleetCounts(100, 0))
    assert d.state == S.REPAIR and d.transition.evidence["lemon"]["nodes"] == ["n1", "n7", "n9"]
    # The window's far end is unchanged: older than 30 days still does not count.
    old = [failure("n1", NOW - 31 * DAY), failure("n1", NOW + DAY)]
    assert decide("n1", S.HEALTHY, alarm(True), now=NOW, history=old,
                  fleet=FleetCounts(100, 0)).state == S.QUARANTINED


def test_a_spike_rerun_alarm_moves_the_node_as_any_alarm_does():
    """The sentinel's attribution (check spike_rerun): settled quarantines with its own
    reason, unsettled makes the node suspect; an alarm file of it passes AlarmRecord's check."""
    rec = dataclasses.replace(alarm(True), check="spike_rerun")
    assert AlarmRecord.from_dict(rec.to_dict()).check == "spike_rerun"
    d = decide("n1", S.HEALTHY, rec, now=NOW, fleet=FleetCounts(total=100, out_of_service=0))
    assert [t.to_state for t in d.transitions] == [S.QUARANTINED]
    assert d.transitions[0].code == "SpikeRerunMismatch"
    d = decide("n1", S.HEALTHY, dataclasses.replace(alarm(False), check="spike_rerun"), now=NOW,
               fleet=FleetCounts(total=100, out_of_service=0))
    assert [t.to_state for t in d.transitions] == [S.SUSPECT]
