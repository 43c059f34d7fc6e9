"""Automatic inputs reduced to what the lifecycle's policy needs: a signal's kind, code, reason and
evidence, plus the helpers the decisions share (GPU serials, rollback hints, earned healthy).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from screener.lifecycle.events import (EVIDENCE_CONFIRMED, EVIDENCE_GPU_SERIAL,
                                       EVIDENCE_GPU_SERIALS, EVIDENCE_HELD_BY_BUDGET,
                                       EVIDENCE_SERIAL, KIND_FULL, KIND_PARTIAL,
                                       RESET_CODES, STRAGGLER_CHECK, Findings, KnownAnswerScreen)
from screener.lifecycle.records import Transition
from screener.alarmfile import CHECKS as ALARM_CHECK_REASONS, AlarmRecord
from screener.types import Finding, NodeState, Outcome, Reason, Severity, Verdict


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
        if t.to_state == NodeState.HEALTHY:
            return True
        if t.to_state == NodeState.BURNIN:
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
        event = KnownAnswerScreen((event,))
    elif isinstance(event, (list, tuple)) and event and all(isinstance(v, Verdict) for v in event):
        event = KnownAnswerScreen(tuple(event))
    elif isinstance(event, (list, tuple)) and all(isinstance(f, Finding) for f in event):
        event = Findings(tuple(event))
    if isinstance(event, KnownAnswerScreen):
        return _classify_screen(event, current)
    if isinstance(event, Findings):
        return _classify_findings(event)
    if isinstance(event, AlarmRecord) and event.check == STRAGGLER_CHECK:
        return _classify_straggler(event)
    if isinstance(event, AlarmRecord):
        return _classify_alarm(event)
    raise TypeError(f"not a lifecycle input: {type(event).__name__}")


def _classify_screen(event: KnownAnswerScreen, current: Optional[NodeState]) -> _Signal:
    bad = [v for v in event.verdicts if v.outcome == Outcome.SUSPECT]
    verdicts = [v.to_dict() for v in event.verdicts]
    if bad:
        serials = _dedupe([s for v in bad for s in _serials(v.evidence)])
        devices = ", ".join(v.device for v in bad)
        first = bad[0]
        where = f" (job {first.job}, step {first.step}, tensor {first.tensor})" if first.job else ""
        confirmed = event.confirmed or any(v.evidence.get(EVIDENCE_CONFIRMED) for v in bad)
        evidence = {"verdicts": verdicts, EVIDENCE_CONFIRMED: bool(confirmed)}
        if confirmed:
            return _Signal(SignalKind.FAILURE, Reason.KNOWN_ANSWER_MISMATCH,
                           f"known-answer mismatch confirmed by a re-run on {devices}{where}",
                           evidence, serials)
        if current == NodeState.SUSPECT:
            # The node is suspect and this is the confirming screen we asked for: it failed.
            return _Signal(SignalKind.FAILURE, Reason.KNOWN_ANSWER_MISMATCH,
                           f"confirming known-answer screen mismatched on {devices}{where}",
                           evidence, serials)
        return _Signal(SignalKind.AMBIGUOUS, Reason.KNOWN_ANSWER_MISMATCH,
                       f"known-answer mismatch on {devices}{where}, not yet re-run",
                       evidence, serials)
    if event.verdicts and all(v.outcome == Outcome.PASS for v in event.verdicts):
        what = {KIND_FULL: "full burn-in", KIND_PARTIAL: "partial burn-in"}.get(
            event.kind, "known-answer screen")
        return _Signal(SignalKind.PASS, Reason.KNOWN_ANSWER_PASSED,
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
    if current == NodeState.SUSPECT and last is not None and last.to_state == NodeState.SUSPECT:
        # The suspect period began with the transition into suspect: keep its start.
        rb = dict(last.rollback or {"time": last.time, "step": None, "job": None})
        if rb.get("step") is None and sig.step is not None:
            rb["step"], rb["job"] = sig.step, sig.job
        return rb
    t0 = min(now, sig.since) if sig.since is not None else now
    return {"time": t0, "step": sig.step, "job": sig.job}


def _held_by_budget(history: Sequence[Transition]) -> bool:
    last = history[-1] if history else None
    return bool(last and last.to_state == NodeState.SUSPECT
                and last.evidence.get(EVIDENCE_HELD_BY_BUDGET))

