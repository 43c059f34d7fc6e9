"""The preflight: a gate run at the moment a job starts on a node (`screener preflight`).

A node screened healthy hours ago can have turned bad since. The preflight runs, in the init
container of a training pod (or by hand), the health probes and then a quick subset of the
known-answer jobs on the pod's devices, judged bit for bit against the golden records as every
screen is. Its answer is the exit-code contract: 0 pass, 75 suspect (and an unsettled alarm file
about its own node in the alarm folder, so the daemon takes the node out of the pool and confirms
with a screen of its own), 3 inconclusive (no golden), 1 the preflight itself failed.

Fast path: when the node passed a screen within a window (the `screener.io/verdict` annotation's
time and outcome, read by the caller from a file, the environment or the store), the known-answer
jobs are skipped and only the probes run.

This module is the logic: the plan (fast or full), the outcome from the probe report and the
screen, the alarm record. Probes, screens and files are passed in by screener.commands.preflight.
"""

from __future__ import annotations

import json
import math
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from screener.alarmfile import PREFLIGHT, AlarmRecord, bounded_alarm_id
from screener.types import ExitCode, Finding, Outcome, Severity, SuspectNode

# The preflight's subset of the quick screen: GEMM chains in float32 and bfloat16 (the matrix
# units at both precisions), the micro-batch replay of a small transformer in float32 and its
# training steps under bf16 autocast, whose forward and backward run every op of the training
# jobs (mm, addmm, bmm, softmax, layer norm, GELU, embedding, log-softmax) at both precisions.
# Not in it: fp16 GEMMs, TF32 and the convolution. Measured against the full quick screen by
# benchmarks/bench_preflight.py coverage.
DEFAULT_JOBS = ("gemm-fp32", "gemm-bf16", "replay-fp32", "train-bf16")
DEFAULT_TIME_CAP_S = 60.0
DEFAULT_FAST_WINDOW_S = 6 * 3600.0
# A verdict stamped further in the future than this is not trusted (clock skew or a forged time).
FUTURE_SLACK_S = 300.0
ALARM_CHECK = PREFLIGHT  # the alarm file's check (screener.alarmfile)
MAX_FINDINGS_IN_ALARM = 16

VERDICT_ENV = "SCREENER_NODE_VERDICT"  # the verdict annotation's JSON text
VERDICT_FILE_ENV = "SCREENER_VERDICT_FILE"  # a file holding it (empty: none)


@dataclass(frozen=True)
class FastPath:
    """Whether the known-answer jobs may be skipped, and why (said in the report)."""

    taken: bool
    reason: str
    screened_at: Optional[float] = None


def fast_path(verdict: Optional[Mapping[str, Any]], now: float, window_s: float) -> FastPath:
    """Decide the fast path from the node's last verdict (the annotation's JSON, parsed).

    Taken only for a screen that passed (outcome "pass", not stopped) and whose time lies within
    window_s before now. The annotation is written by whoever may edit the Node, so anything
    malformed, stopped, from the future or older than the window means the full preflight.
    """
    if window_s <= 0:
        return FastPath(False, "fast path off (window 0)")
    if not verdict:
        return FastPath(False, "no verdict for this node")
    when = verdict.get("time")
    if not isinstance(when, (int, float)) or isinstance(when, bool) or not math.isfinite(when):
        return FastPath(False, "the verdict has no time")
    if verdict.get("outcome") != Outcome.PASS.value or verdict.get("stopped"):
        return FastPath(False, f"the last screen did not pass ({verdict.get('outcome')!s:.40})",
                        float(when))
    age = now - float(when)
    if age < -FUTURE_SLACK_S:
        return FastPath(False, f"the verdict's time is {-age:.0f} s in the future", float(when))
    if age > window_s:
        return FastPath(False, f"the last passing screen is {age:.0f} s old (window "
                        f"{window_s:.0f} s)", float(when))
    return FastPath(True, f"passed a screen {max(age, 0.0):.0f} s ago (window {window_s:.0f} s)",
                    float(when))


def parse_verdict_text(text: str) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(verdict, problem) from the annotation's text: (None, None) when empty (the downward API
    writes an empty file for a missing annotation), (None, why) when it is not a JSON object."""
    if not text.strip():
        return None, None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None, "the node verdict is not JSON"
    if not isinstance(data, dict):
        return None, "the node verdict is not a JSON object"
    return data, None


@dataclass
class PreflightResult:
    """What one preflight found; `exit_code` is the contract's answer."""

    node: str
    fast: FastPath
    probe: Optional[Mapping[str, Any]] = None  # ProbeReport.to_dict()
    probe_findings: tuple[Finding, ...] = ()
    probe_errors: tuple[str, ...] = ()
    screen: Optional[Mapping[str, Any]] = None  # ScreenResult.to_dict()
    screen_outcome: Optional[Outcome] = None
    screen_exit: Optional[ExitCode] = None
    jobs: tuple[str, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)
    alarm_file: Optional[str] = None
    warnings: list[str] = field(default_factory=list)

    @property
    def probe_suspect(self) -> bool:
        return any(f.severity >= Severity.SUSPECT for f in self.probe_findings)

    @property
    def exit_code(self) -> ExitCode:
        """75 when the probes or the screen say suspect; else 1 when either failed itself;
        else 3 when the screen had nothing to compare with; else 0."""
        if self.probe_suspect or self.screen_exit == ExitCode.HARDWARE_SUSPECT:
            return ExitCode.HARDWARE_SUSPECT
        if self.probe_errors or self.screen_exit == ExitCode.SCREENER_ERROR:
            return ExitCode.SCREENER_ERROR
        if self.screen_exit == ExitCode.INCONCLUSIVE:
            return ExitCode.INCONCLUSIVE
        if self.screen_exit not in (None, ExitCode.PASS):
            return ExitCode(self.screen_exit)
        return ExitCode.PASS

    @property
    def outcome(self) -> str:
        return {ExitCode.PASS: "pass", ExitCode.HARDWARE_SUSPECT: "suspect",
                ExitCode.INCONCLUSIVE: "inconclusive"}.get(self.exit_code, "error")

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "outcome": self.outcome, "exit_code": int(self.exit_code),
                "fast_path": {"taken": self.fast.taken, "reason": self.fast.reason,
                              "screened_at": self.fast.screened_at},
                "jobs": list(self.jobs), "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "alarm_file": self.alarm_file, "warnings": list(self.warnings),
                "probes": self.probe, "screen": self.screen}


def _suspect_verdicts(screen: Optional[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The screen's suspect verdicts, cut to what locates the fault (the alarm stays small)."""
    keep = ("device", "reason", "job", "step", "tensor", "expected", "observed", "platform_hash")
    return [{k: v.get(k) for k in keep} for v in (screen or {}).get("verdicts", [])
            if isinstance(v, Mapping) and v.get("outcome") == Outcome.SUSPECT.value][:8]


def alarm_evidence(result: PreflightResult) -> dict[str, Any]:
    """The evidence an alarm file carries: the suspect findings and verdicts, bounded."""
    findings = [{"code": f.code, "severity": f.severity.label, "gpu": f.gpu,
                 "message": f.message[:300]}
                for f in result.probe_findings if f.severity >= Severity.SUSPECT]
    return {"source": "preflight", "fast_path": result.fast.taken,
            "findings": findings[:MAX_FINDINGS_IN_ALARM],
            "verdicts": _suspect_verdicts(result.screen), "jobs": list(result.jobs)}


def alarm_record(result: PreflightResult, *, created: float, job: str = "",
                 instance_id: Optional[str] = None, hostname: Optional[str] = None) -> AlarmRecord:
    """The unsettled AlarmRecord about this node that a suspect preflight leaves for the daemon.

    Unsettled: one preflight is a single signal, so the daemon makes the node suspect (no new
    work) and confirms with a screen of its own, as for any unsettled in-job alarm.
    """
    alarm_id = bounded_alarm_id(ALARM_CHECK, result.node, unique=uuid.uuid4().hex[:8])
    me = SuspectNode(node=result.node, hostname=hostname or socket.gethostname(),
                     instance_id=instance_id)
    return AlarmRecord(alarm_id=alarm_id, check=ALARM_CHECK, step=0, settled=False,
                       suspect_ranks=(), suspect_nodes=(me,), node=result.node, job=job,
                       created=created, evidence=alarm_evidence(result))


def screen_jobs(requested: Sequence[str]) -> tuple[str, ...]:
    """The jobs a full preflight runs: those asked for, else DEFAULT_JOBS."""
    return tuple(requested) or DEFAULT_JOBS
