"""A screen's result (pure): each device's verdict from the issues found against it, and the whole
screen's outcome and exit code (the worst verdict decides).

The judgment (screener.known_answer.verdict.judgment) finds the issues; this module turns them into the
ScreenResult that `screener kat run --json`, the burn-in report and the daemon's records carry:
which issue names a device's verdict, the evidence kept with it, and which requested faults fired.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from screener.known_answer.verdict.results import Difference
from screener.known_answer.verdict.runs import DeviceRun
from screener.types import ExitCode, KnownAnswerReason, Outcome, RunStatus, Verdict


@dataclass(frozen=True)
class ScreenResult:
    """What one known-answer screen found (judgment.judge's return value): one Verdict per
    device, the overall outcome and exit code, the result digest of every job on every device,
    platforms, timings and the faults that fired. The daemon keeps a screening window's account
    of it in screener.agent.screening.window.ScreenOutcome."""

    verdicts: tuple[Verdict, ...]
    outcome: Outcome
    exit_code: ExitCode
    digests: Mapping[str, Mapping[str, str]]
    platforms: Mapping[str, Mapping[str, Any]]
    timings: Mapping[str, Mapping[str, float]]
    jobs: tuple[str, ...]
    iterations: Mapping[str, int]
    seconds: float = 0.0
    # device -> {"requested", "fired", "unfired"}: the faults a drill or `--inject` asked for
    faults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # platform hash -> job -> golden record text: what this screen promotes from a fleet quorum
    # (screener.known_answer.engine.promotion), for the daemon to store
    promote: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def unfired_faults(self) -> dict[str, list[dict[str, Any]]]:
        """device -> the requested faults that never fired, on devices whose child finished
        (a fault that never fired tested nothing, and its screen's pass means nothing)."""
        return {d: list(f["unfired"]) for d, f in self.faults.items() if f.get("unfired")}

    def warnings(self) -> list[str]:
        """One line per device whose requested faults did not all fire."""
        return [f"{d}: {len(u)} injected fault(s) never fired (the job never reached them): "
                + "; ".join(",".join(f"{k}={v}" for k, v in f.items()
                                     if v is not None and k in ("op", "call", "parameter", "step",
                                                                "job", "iteration"))
                            for f in u)
                for d, u in self.unfired_faults.items()]

    def verdict(self, device: str) -> Verdict:
        """The verdict of one device."""
        return next(v for v in self.verdicts if v.device == device)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`screener kat run --json`, the burn-in report, the daemon's records)."""
        return {"outcome": self.outcome.value, "exit_code": int(self.exit_code),
                "verdicts": [v.to_dict() for v in self.verdicts],
                "digests": {d: dict(j) for d, j in self.digests.items()},
                "platforms": {d: dict(p) for d, p in self.platforms.items()},
                "timings": {d: dict(t) for d, t in self.timings.items()},
                "jobs": list(self.jobs), "iterations": dict(self.iterations),
                "seconds": round(self.seconds, 3),
                **({"faults": {d: dict(f) for d, f in self.faults.items()},
                    "faults_fired": {d: list(f["fired"]) for d, f in self.faults.items()},
                    "warnings": self.warnings()} if self.faults else {}),
                **({"promote": {p: dict(j) for p, j in self.promote.items()}}
                   if self.promote else {})}


def record_command(jobs: Iterable[str], devices: Iterable[str], golden_dir: Optional[str]) -> str:
    """The command that records goldens for these jobs and devices."""
    parts = ["screener golden record"]
    parts += [f"--job {j}" for j in jobs]
    parts += [f"--device {d}" for d in devices]
    if golden_dir:
        parts.append(f"--out {golden_dir}")
    return " ".join(parts)


@dataclass
class Issue:
    """One thing found against a device: its outcome, reason, job and where results differ."""

    outcome: Outcome
    reason: KnownAnswerReason
    job: Optional[str] = None
    diff: Optional[Difference] = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The form kept in the verdict's evidence["issues"]."""
        d: dict[str, Any] = {"outcome": self.outcome.value, "reason": self.reason, "job": self.job}
        if self.diff is not None:
            d.update(self.diff.to_dict())
        if self.detail:
            d["detail"] = self.detail
        return d


# Which issue names a device's verdict when it has several: the most specific evidence first.
_REASON_RANK = {KnownAnswerReason.TIMEOUT: 0, KnownAnswerReason.CRASH: 0, KnownAnswerReason.KILLED: 0,
                KnownAnswerReason.DEVICE_ERROR: 0, KnownAnswerReason.SELF_MISMATCH: 1,
                KnownAnswerReason.GOLDEN_MISMATCH: 2, KnownAnswerReason.QUORUM_MISMATCH: 2,
                KnownAnswerReason.PEER_MISMATCH: 3,
                KnownAnswerReason.PEER_SPLIT: 4, KnownAnswerReason.GOLDEN_DISAGREES_WITH_PEERS: 5,
                KnownAnswerReason.EARLIER_SCREENS_DIFFER: 5,
                KnownAnswerReason.SIBLING_GOLDEN_DIFFERS: 6, KnownAnswerReason.NO_GOLDEN: 6,
                KnownAnswerReason.AWAITING_QUORUM: 5,
                KnownAnswerReason.INCOMPLETE: 6}
# Inconclusive reasons that a golden of the platform would settle: their verdict names the
# command that records it (a self-mismatch, a raise or a split with nothing to say which
# result is right, a conflict with the node's earlier screens, no golden at all).
_NEEDS_GOLDEN = (KnownAnswerReason.NO_GOLDEN, KnownAnswerReason.AWAITING_QUORUM,
                 KnownAnswerReason.SIBLING_GOLDEN_DIFFERS, KnownAnswerReason.SELF_MISMATCH,
                 KnownAnswerReason.CRASH, KnownAnswerReason.PEER_SPLIT,
                 KnownAnswerReason.EARLIER_SCREENS_DIFFER)


def screen_result(runs: Mapping[str, DeviceRun], jobs: Sequence[str],
                  verdicts: tuple[Verdict, ...], seconds: float) -> ScreenResult:
    """The screen's result: the worst verdict decides the outcome and exit code."""
    outcomes = {v.outcome for v in verdicts}
    if Outcome.SUSPECT in outcomes:
        outcome, code = Outcome.SUSPECT, ExitCode.HARDWARE_SUSPECT
    elif Outcome.INCONCLUSIVE in outcomes:
        outcome, code = Outcome.INCONCLUSIVE, ExitCode.INCONCLUSIVE
    else:
        outcome, code = Outcome.PASS, ExitCode.PASS
    return ScreenResult(
        verdicts=verdicts, outcome=outcome, exit_code=code,
        digests={d: {j: r.reference.digest for j, r in run.jobs.items()} for d, run in runs.items()},
        platforms={d: run.platform for d, run in runs.items()},
        timings={d: {j: round(sum(r.seconds) / max(len(r.seconds), 1), 4)
                     for j, r in run.jobs.items()} for d, run in runs.items()},
        jobs=tuple(jobs), iterations={d: r.iterations for d, r in runs.items()},
        seconds=seconds, faults=_faults(runs))


def _faults(runs: Mapping[str, DeviceRun]) -> dict[str, dict[str, Any]]:
    """Per device that was asked to inject faults: which fired. A fault that did not fire is
    only 'unfired' when the child finished: one that crashed first never had the chance."""
    out: dict[str, dict[str, Any]] = {}
    for d, run in runs.items():
        if not run.faults:
            continue
        fired = sorted(run.faults_fired)
        unfired = run.unfired_faults() if run.status == RunStatus.OK else []
        out[d] = {"requested": len(run.faults), "fired": fired, "unfired": unfired}
    return out


def _evidence(run: DeviceRun, issues: Sequence[Issue],
              matched: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A verdict's evidence: how the child ended, each job's digest and golden, every issue."""
    evidence: dict[str, Any] = {
        "status": run.status,
        "platform": run.platform.get("name") if run.platform else None,
        "iterations": run.iterations,
        # per job: its digest and, when compared with one, the golden (and whether a sibling's);
        # "seconds" are all its runs together, "seconds_per_run" their mean (what to compare)
        "jobs": {j: {"digest": r.reference.digest, "runs": r.runs,
                     "spec_hash": r.reference.spec_hash, "results": len(r.counts),
                     "seconds": round(sum(r.seconds), 4),
                     "seconds_per_run": round(sum(r.seconds) / max(r.runs, 1), 4),
                     **matched.get(j, {})}
                 for j, r in run.jobs.items()},
    }
    if issues:
        evidence["issues"] = [i.to_dict() for i in issues]
    fired = {j: r.fired for j, r in run.jobs.items() if r.fired}
    if fired:
        evidence["faults_fired"] = fired
    if run.status != RunStatus.OK and run.stderr_tail:
        evidence["stderr_tail"] = run.stderr_tail[-1500:]
    return evidence


def verdict_of(device: str, run: DeviceRun, issues: Sequence[Issue], golden_dir: Optional[str],
               matched: Mapping[str, Mapping[str, Any]]) -> Verdict:
    """A device's verdict: named by its most specific suspect issue, else its most specific
    inconclusive one, else a pass."""
    evidence = _evidence(run, issues, matched)
    suspects = [i for i in issues if i.outcome == Outcome.SUSPECT]
    inconclusive = [i for i in issues if i.outcome == Outcome.INCONCLUSIVE]
    candidates = suspects or inconclusive
    chosen = min(candidates, key=lambda i: _REASON_RANK.get(i.reason, 9)) if candidates else None
    if chosen is None:
        return Verdict(device=device, outcome=Outcome.PASS, reason="",
                       platform_hash=run.platform_hash, evidence=evidence)
    if chosen.outcome == Outcome.INCONCLUSIVE and chosen.reason in (*_NEEDS_GOLDEN,
                                                                     KnownAnswerReason.INCOMPLETE):
        names = list(dict.fromkeys(i.job for i in inconclusive
                                   if i.reason in _NEEDS_GOLDEN and i.job))
        if names:
            evidence["command"] = record_command(names, [device], golden_dir)
    diff = chosen.diff
    if chosen.detail:
        evidence["detail"] = chosen.detail
    return Verdict(device=device, outcome=chosen.outcome, reason=chosen.reason, job=chosen.job,
                   step=diff.step if diff else None, tensor=diff.tensor if diff else None,
                   expected=diff.expected if diff else None,
                   observed=diff.observed if diff else None,
                   platform_hash=run.platform_hash, evidence=evidence)
