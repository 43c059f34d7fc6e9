"""How a device's child ended, and the runs in which a job raised, as evidence about the device
(pure).

A crash or a device error is suspect. A job that raised (an IndexError from an index tensor the
device computed wrong) was run again by the child before any verdict (screener.known_answer.engine.child
RERUNS_AFTER_RAISE); it is a crash of the device (suspect) when something shows the job completes
(another run on the device, a peer, its golden, earlier screens), and inconclusive when nothing
does (a device that corrupts an index in every run and a bug of ours look the same there; a
golden settles it). Exit 1 is only for what a child reports as ours. A child killed from outside
(the OOM killer) is inconclusive. A timeout is suspect only when the same job finished on a peer
device of the same platform in this run, or when the job's golden records how long it takes and
the limit was at least HANG_FACTOR times that (otherwise a slow job and a hung device look the
same). Bad input (exit 2) and a failure of ours (exit 1) are raised, never verdicts.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from screener.errors import BadInputError, ScreenerError
from screener.known_answer.verdict.quorum import FleetView
from screener.known_answer.verdict.reference import Known, NamedJob, known_digest
from screener.known_answer.verdict.runs import DeviceRun
from screener.known_answer.verdict.screen_result import Issue
from screener.types import KnownAnswerReason, Outcome, RunStatus

HANG_FACTOR = 10.0  # a timeout this many times the golden's recorded job time is a hang


def raise_for_failures_of_ours(runs: Mapping[str, DeviceRun]) -> None:
    """Bad input (exit 2) and a bug of ours (exit 1) are errors, never verdicts."""
    for run in runs.values():
        if run.status == RunStatus.BAD_INPUT:
            msg = run.detail.split(": ", 2)[-1]
            named = msg.startswith((f"device {run.device}", f"device {run.device!r}"))
            raise BadInputError(msg if named else f"device {run.device}: {msg}")
        if run.status == RunStatus.SCREENER_ERROR:
            raise ScreenerError(f"device {run.device}: the screener failed: {run.detail}\n"
                                f"{run.stderr_tail}".rstrip())


def ending_issues(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun],
                  specs: Sequence[NamedJob], goldens: Mapping[tuple[str, str], Any],
                  known: Known, fleet: Optional[FleetView] = None) -> list[Issue]:
    """What the way a device's child ended says (nothing when it finished)."""
    job = run.current[0] if run.current else None
    if run.status == RunStatus.KILLED:
        return [Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.KILLED, job, detail=(
            f"{run.detail}: killed from outside (memory pressure, an operator), which says "
            f"nothing about the device"))]
    if run.status == RunStatus.TIMEOUT:
        return [_hang(device, run, runs, specs, goldens)]
    raised = [_raised(device, run, runs, goldens, known, fleet, j, r.detail, r.count)
              for j, r in run.raised.items()]
    if run.status == RunStatus.JOB_ERROR:  # a child that ended on a job's raise
        raised.append(_raised(device, run, runs, goldens, known, fleet, job, run.detail, 1))
    if run.status not in (RunStatus.OK, RunStatus.JOB_ERROR):
        # crash or device_error (ours and bad input raised before)
        raised.append(Issue(Outcome.SUSPECT, KnownAnswerReason(run.status), job, detail=run.detail))
    return raised


def _raised(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun],
            goldens: Mapping[tuple[str, str], Any], known: Known, fleet: Optional[FleetView],
            job: Optional[str], detail: str, count: int) -> Issue:
    """A job that raised in `count` runs on this device is a crash of the device (suspect)
    when something shows the job completes: another run on this device, a peer of the platform
    in this run, its golden, other nodes of the platform (the fleet's candidates) or this node's
    earlier screens; with none of these it is
    inconclusive, never our bug: exceptions of ours are reported as ours by the child."""
    done = run.jobs[job].runs if job in run.jobs else 0
    times = f"it raised in {count} of {count + done} run(s)"
    why = _completes(device, run, runs, goldens, known, fleet, job)
    if why is None:
        return Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.CRASH, job, detail=(
            f"{detail}; {times}, and nothing shows the job completes on this platform (no "
            f"golden, no peer device, no earlier screen), so a device that corrupts the job's "
            f"values in every run cannot be told from a bug of ours; record a golden for the "
            f"platform on a node you trust, or screen another device of it"))
    return Issue(Outcome.SUSPECT, KnownAnswerReason.CRASH, job, detail=f"{detail}; {times}; {why}")


def _completes(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun],
               goldens: Mapping[tuple[str, str], Any], known: Known,
               fleet: Optional[FleetView], job: Optional[str]) -> Optional[str]:
    """What shows a job completes where it raised on `device`, or None."""
    if job is None:
        return None
    if job in run.jobs:
        return f"it completed the job in {run.jobs[job].runs} other run(s) of this screen"
    peers = [d for d, r in runs.items() if d != device and job in r.jobs
             and (run.platform_hash is None or r.platform_hash == run.platform_hash)]
    if peers:
        return f"{len(peers)} peer device(s) of the platform completed it (e.g. {peers[0]})"
    record = goldens.get((job, run.platform_hash or ""))
    if record is not None:
        return f"its golden {getattr(record, 'path', '')} records completed runs on this platform"
    if run.platform_hash and fleet is not None:
        q = fleet.quorum_for(run.platform_hash, job, None)
        if q.reporting:
            return f"{q.reporting} other node(s) of the platform completed it"
    if run.platform_hash and known_digest(known, run.platform_hash, job, None):
        return "this node's earlier screens completed it on this platform"
    return None


def _hang(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
          goldens: Mapping[tuple[str, str], Any]) -> Issue:
    """A timeout is a hang (suspect) only with evidence that the job finishes in time: a peer of
    the same platform finished it in this run, or its golden says how long it takes."""
    job = run.current[0] if run.current else None
    peers = [d for d, r in runs.items() if d != device and r.platform_hash
             and (run.platform_hash is None or r.platform_hash == run.platform_hash)
             and (job is None or job in r.jobs)]
    if peers:
        return Issue(Outcome.SUSPECT, KnownAnswerReason.TIMEOUT, job, detail=(
            f"{run.detail}; {len(peers)} peer device(s) of the platform finished it "
            f"(e.g. {peers[0]})"))
    record = goldens.get((job, run.platform_hash)) if job and run.platform_hash else None
    took = _recorded_seconds(record)
    limit = run.timeout_s
    if took is not None and limit is not None and limit >= HANG_FACTOR * took:
        return Issue(Outcome.SUSPECT, KnownAnswerReason.TIMEOUT, job, detail=(
            f"{run.detail}; its golden records {took:g} s for the job"))
    return Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.TIMEOUT, job, detail=(
        f"{run.detail}; no peer finished the job and its golden records no time for it, so a "
        f"slow job cannot be told from a hung device"))


def _recorded_seconds(record: Any) -> Optional[float]:
    """How long the golden's recording took the job, when it says so plausibly."""
    recorded = getattr(record, "recorded", None) or {}
    v = recorded.get("seconds") if isinstance(recorded, Mapping) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e7:
        return float(v)
    return None
