"""How a device's child ended, as evidence about the device (pure).

A crash or a device error is suspect. A job that raised (an IndexError from an index tensor the
device computed wrong) is a crash of the device when something shows the job completes (an
earlier run, a peer, its golden, earlier screens), else our bug (ScreenerError). A child killed
from outside (the OOM killer) is inconclusive. A timeout is suspect only when the same job
finished on a peer device of the same platform in this run, or when the job's golden records how
long it takes and the limit was at least HANG_FACTOR times that (otherwise a slow job and a hung
device look the same). Bad input (exit 2) and a failure of ours (exit 1) are raised, never
verdicts.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from screener.errors import BadInputError, ScreenerError
from screener.known_answer.reference import Known, NamedJob, known_digest
from screener.known_answer.runs import DeviceRun
from screener.known_answer.screen_result import Issue
from screener.types import KatReason, Outcome, RunStatus

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
                  known: Known) -> list[Issue]:
    """What the way a device's child ended says (nothing when it finished)."""
    job = run.current[0] if run.current else None
    if run.status == RunStatus.KILLED:
        return [Issue(Outcome.INCONCLUSIVE, KatReason.KILLED, job, detail=(
            f"{run.detail}: killed from outside (memory pressure, an operator), which says "
            f"nothing about the device"))]
    if run.status == RunStatus.TIMEOUT:
        return [_hang(device, run, runs, specs, goldens)]
    if run.status == RunStatus.JOB_ERROR:
        return [_job_crash(device, run, runs, goldens, known)]
    if run.status != RunStatus.OK:  # crash or device_error (ours and bad input raised before)
        return [Issue(Outcome.SUSPECT, KatReason(run.status), job, detail=run.detail)]
    return []


def _job_crash(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun],
               goldens: Mapping[tuple[str, str], Any], known: Known) -> Issue:
    """A job that raised on this device is a crash of the device (suspect) when something shows
    the job completes: an earlier run on this device, a peer of the platform in this run, its
    golden, or this node's earlier screens; with none of these it is our bug (ScreenerError)."""
    job = run.current[0] if run.current else None
    why = _completes(device, run, runs, goldens, known, job)
    if why is None:
        raise ScreenerError(
            f"device {device}: {run.detail}; nothing shows the job completes on this platform "
            f"(no golden, no peer device, no earlier run), so this is taken as a screener "
            f"failure, not a hardware verdict\n{run.stderr_tail}".rstrip())
    return Issue(Outcome.SUSPECT, KatReason.CRASH, job, detail=f"{run.detail}; {why}")


def _completes(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun],
               goldens: Mapping[tuple[str, str], Any], known: Known,
               job: Optional[str]) -> Optional[str]:
    """What shows a job completes where it raised on `device`, or None."""
    if job is None:
        return None
    if job in run.jobs:
        return f"it completed the job {run.jobs[job].runs} time(s) earlier in this screen"
    peers = [d for d, r in runs.items() if d != device and job in r.jobs
             and (run.platform_hash is None or r.platform_hash == run.platform_hash)]
    if peers:
        return f"{len(peers)} peer device(s) of the platform completed it (e.g. {peers[0]})"
    record = goldens.get((job, run.platform_hash or ""))
    if record is not None:
        return f"its golden {getattr(record, 'path', '')} records completed runs on this platform"
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
        return Issue(Outcome.SUSPECT, KatReason.TIMEOUT, job, detail=(
            f"{run.detail}; {len(peers)} peer device(s) of the platform finished it "
            f"(e.g. {peers[0]})"))
    record = goldens.get((job, run.platform_hash)) if job and run.platform_hash else None
    took = _recorded_seconds(record)
    limit = run.timeout_s
    if took is not None and limit is not None and limit >= HANG_FACTOR * took:
        return Issue(Outcome.SUSPECT, KatReason.TIMEOUT, job, detail=(
            f"{run.detail}; its golden records {took:g} s for the job"))
    return Issue(Outcome.INCONCLUSIVE, KatReason.TIMEOUT, job, detail=(
        f"{run.detail}; no peer finished the job and its golden records no time for it, so a "
        f"slow job cannot be told from a hung device"))


def _recorded_seconds(record: Any) -> Optional[float]:
    """How long the golden's recording took the job, when it says so plausibly."""
    recorded = getattr(record, "recorded", None) or {}
    v = recorded.get("seconds") if isinstance(recorded, Mapping) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e7:
        return float(v)
    return None
