"""The judgment of a screen (pure): Verdicts from the devices' runs and the golden records.

For each device and job, the results are compared:

(a) with the golden record for the device's platform signature (screener.known_answer.golden);
    without one, with the goldens of sibling platforms (same torch build and dispatch level, or
    GPU model: screener.known_answer.platform.sibling_key): equal bits pass (the verdict names
    the golden), different bits are inconclusive with the record command, never suspect;
(b) with the other devices of the same platform in this run: a device that differs from a
    strict majority is suspect even without a golden;
(c) across repeats on the device itself: every run counts, not only the first two.

A job's reference on a platform is, in this order: its golden, a sibling golden that one of
the runs reproduces, the result a strict majority (two or more) of the devices gave in every
run, or what this node's earlier screens gave (`known`). A device that does not reproduce the
reference is suspect, whatever its repeats did among themselves (wrong in every run the same
way, in some runs, or differently in each): a unit that is wrong again and again is the
commonest silent data corruption, not a nondeterministic job. It is our bug
(NondeterminismError, exit 1, with the evidence) where no reference exists and the job disagrees
with itself on every device (or three or more devices of a platform all differ), and where every
device of a platform (two or more) flips between the reference and another result: silent data
corruption is local to one GPU, not all of a node's at once.

How a child ended counts too, and only evidence about the device makes it suspect: a crash or a
device error is suspect; a job that raised (an IndexError from an index tensor the device
computed wrong) is a crash of the device when something shows the job completes (an earlier
run, a peer, its golden, earlier screens), else our bug (ScreenerError); a child killed from
outside (the OOM killer) is inconclusive; a timeout is suspect only when the same job finished
on a peer device of the same platform in this run, or when the job's golden records how long it
takes and the limit was at least HANG_FACTOR times that (otherwise a slow job and a hung
device look the same).

With no golden and fewer than MIN_PEERS agreeing devices the verdict is inconclusive (exit 3)
and names the command that records a golden. In every verdict `expected` is the reference's
value and `observed` the device's, also when the device went wrong in its first repeat.

Pure: no processes, no files. Goldens come through a lookup function; specs are only named.
This module compares results with their reference and with each other; the reference itself is
screener.known_answer.reference's, what a child's ending says is screener.known_answer.endings',
and how issues become verdicts and the screen's outcome is screener.known_answer.screen_result's.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from screener.errors import NondeterminismError
from screener.known_answer.endings import (HANG_FACTOR, ending_issues,
                                           raise_for_failures_of_ours)
from screener.known_answer.reference import (GoldenLookup, JobGroup, Known, NamedJob,
                                             Reference, job_groups, known_digest, lookup_goldens)
from screener.known_answer.results import JobResult, first_difference, where
from screener.known_answer.runs import DeviceRun, JobRuns
from screener.known_answer.screen_result import (Issue, ScreenResult, record_command,
                                                 screen_result, verdict_of)
from screener.types import KatReason, Outcome, RunStatus

MIN_PEERS = 3  # agreeing devices needed to pass without a golden

# The names other modules take from here: the judgment's entry point and what it returns.
__all__ = ["HANG_FACTOR", "MIN_PEERS", "GoldenLookup", "Known", "NamedJob", "ScreenResult",
           "judge", "known_digest", "record_command"]


def judge(runs: Mapping[str, DeviceRun], specs: Sequence[NamedJob], golden: GoldenLookup, *,
          golden_dir: Optional[str] = None, seconds: float = 0.0,
          known: Optional[Known] = None) -> ScreenResult:
    """Compare the runs with goldens, peers and themselves; one Verdict per device.

    A device that does not reproduce its reference (golden, sibling golden, a majority of its
    platform, or `known`: what this node's earlier screens produced) is suspect, whatever its
    repeats did among themselves. Raises NondeterminismError only where nothing says which
    result is right: a job that disagrees with itself on every device that ran it, or three or
    more devices of one platform that all give different results, with no reference. Raises
    ScreenerError when a child failed in our own code (or a job raised where nothing shows it
    can complete), and BadInputError when a child was given bad input (a missing device).
    """
    raise_for_failures_of_ours(runs)
    # The results a child produced count even when it ended badly later: a device that gave a
    # wrong answer and then crashed is judged on both.
    judged = {d: r for d, r in runs.items() if r.status == RunStatus.OK or r.jobs}
    goldens = lookup_goldens(runs, specs, golden)
    groups = list(job_groups(judged, specs, goldens, golden, known or {}))
    _check_nondeterminism(groups)
    issues = {d: ending_issues(d, run, runs, specs, goldens, known or {})
              for d, run in runs.items()}
    matched: dict[str, dict[str, dict[str, Any]]] = {d: {} for d in runs}
    for group in groups:
        for d in group.members:
            if d not in group.results and runs[d].status == RunStatus.OK:
                issues[d].append(Issue(Outcome.INCONCLUSIVE, KatReason.INCOMPLETE, group.job,
                                       detail="the job produced no result"))
        for d in group.results:
            found, match = _device_issues(group, d, golden_dir)
            issues[d].extend(found)
            if match is not None:
                matched[d][group.job] = match
    verdicts = tuple(verdict_of(d, run, issues[d], golden_dir, matched[d])
                     for d, run in runs.items())
    return screen_result(runs, [s.name for s in specs], verdicts, seconds)


def _device_issues(g: JobGroup, d: str,
                   golden_dir: Optional[str]) -> tuple[list[Issue], Optional[dict[str, Any]]]:
    """A device's issues with one job, and the golden its result matched (or was compared
    with): its own platform's, or a sibling platform's that it reproduces bit for bit."""
    runs = g.results[d]
    ref = runs.reference
    out: list[Issue] = []
    if not runs.consistent:
        out.append(_self_mismatch(runs, g.reference, g.job))
    if g.record is not None:
        issue = _golden_issue(g, ref)
        return out + ([issue] if issue else []), {"golden": g.record.path,
                                                   "platform_hash": g.phash}
    if g.kin:
        same = next((r for r in g.kin if r.compare(ref) is None), None)
        if same is not None:
            return out, {"golden": same.path, "platform_hash": same.platform_hash,
                         "sibling": True}
        out.append(Issue(
            Outcome.INCONCLUSIVE, KatReason.SIBLING_GOLDEN_DIFFERS, g.job, g.kin[0].compare(ref),
            detail=f"no golden for platform {g.phash}; the results differ from the "
                   f"golden(s) of sibling platforms (same torch build and dispatch "
                   f"level, another library path, thread count or driver): "
                   f"{', '.join(r.path for r in g.kin)}; record one with: "
                   f"{record_command([g.job], g.members, golden_dir)}"))
    peer = _peer_issue(g, ref, golden_dir, sibling_differs=bool(g.kin))
    return out + ([peer] if peer else []), None


def _golden_issue(g: JobGroup, ref: JobResult) -> Optional[Issue]:
    """A result that differs from its platform's golden: suspect, unless at least MIN_PEERS
    devices agree with each other on it (then the golden is the odd one out)."""
    diff = g.record.compare(ref)
    if diff is None:
        return None
    agreeing = g.counts[ref.digest]
    if ref.digest == g.majority and agreeing >= MIN_PEERS:
        return Issue(Outcome.INCONCLUSIVE, KatReason.GOLDEN_DISAGREES_WITH_PEERS, g.job, diff,
                     detail=f"{agreeing} devices agree with each other but not with "
                            f"{g.record.path}; re-record it if the platform changed")
    return Issue(Outcome.SUSPECT, KatReason.GOLDEN_MISMATCH, g.job, diff, detail=g.record.path)


def _peer_issue(g: JobGroup, ref: JobResult, golden_dir: Optional[str], *,
                sibling_differs: bool) -> Optional[Issue]:
    """Without a golden of its own: a device that differs from the strict majority of its
    platform, a platform with no majority, or too few agreeing devices to pass."""
    have = len(g.results)
    if have >= 2 and g.majority is not None and ref.digest != g.majority:
        peer = next(p for p in g.results if g.refs[p].digest == g.majority)
        return Issue(Outcome.SUSPECT, KatReason.PEER_MISMATCH, g.job,
                     first_difference(g.refs[peer].steps, ref.steps),
                     detail=f"differs from the {g.counts[g.majority]} of {have} devices "
                            f"that agree (e.g. {peer})")
    if have >= 2 and g.majority is None and not (g.known and ref.digest == g.known):
        return Issue(Outcome.SUSPECT, KatReason.PEER_SPLIT, g.job,
                     detail=f"{have} devices of one platform give {len(g.counts)} different "
                            f"results and no strict majority agrees")
    if g.counts[ref.digest] < MIN_PEERS and not sibling_differs:
        return Issue(Outcome.INCONCLUSIVE, KatReason.NO_GOLDEN, g.job,
                     detail=f"no golden for platform {g.phash} and only {g.counts[ref.digest]} "
                            f"agreeing device(s); record one with: "
                            f"{record_command([g.job], g.members, golden_dir)}")
    return None


def _check_nondeterminism(groups: Sequence[JobGroup]) -> None:
    """Raise NondeterminismError for a job that is our bug, not the hardware's: nothing says
    which result is right (no golden, no sibling golden reproduced, no majority, no earlier
    screen) and it disagrees with itself on every device, or gives three or more devices of a
    platform all different results. With a reference, a device that misses it is suspect."""
    by_job: dict[str, list[JobGroup]] = {}
    for g in groups:
        if g.results:
            by_job.setdefault(g.job, []).append(g)
    for job, gs in by_job.items():
        for g in gs:
            _check_flipping(job, g)
        if any(g.reference is not None for g in gs):
            continue
        ran = [(d, runs) for g in gs for d, runs in g.results.items()]
        if all(not runs.consistent for _, runs in ran):
            d, runs = ran[0]
            it, other = runs.first_mismatch()
            raise NondeterminismError(
                f"job {job} is nondeterministic: it gave different bits across repeats on "
                f"every device ({', '.join(d for d, _ in ran)}) and no golden, majority or "
                f"earlier screen says which is right; e.g. {d} iteration {it} vs 0 at "
                f"{where(first_difference(runs.reference.steps, other.steps))}. This is a "
                f"screener bug, not a hardware verdict.")
        for g in gs:
            if len(g.results) >= 3 and len(g.counts) == len(g.results):
                raise NondeterminismError(
                    f"job {job} gave {len(g.results)} different results on the "
                    f"{len(g.results)} devices of platform {g.phash} "
                    f"({', '.join(g.results)}) and no golden or earlier screen says which is "
                    f"right: a screener bug, not a hardware verdict")


def _check_flipping(job: str, g: JobGroup) -> None:
    """Two or more devices of a platform that all disagree with themselves, each reproducing
    the reference in some runs and not in others: the job flips between results, which is our
    nondeterminism, not every GPU of the node failing at once (silent data corruption is local
    to one GPU). A device that never reproduces the reference is still judged (suspect)."""
    if g.reference is None or len(g.results) < 2:
        return
    ref = g.reference
    flipping = [d for d, runs in g.results.items() if not runs.consistent
                and any(ref.matches(r) for _, r in runs.results())
                and any(not ref.matches(r) for _, r in runs.results())]
    if len(flipping) == len(g.results):
        d = flipping[0]
        it, other = g.results[d].first_mismatch()
        raise NondeterminismError(
            f"job {job} is nondeterministic: on all {len(flipping)} devices of platform "
            f"{g.phash} ({', '.join(flipping)}) some runs reproduce the {ref.source} and "
            f"others do not; e.g. {d} iteration {it} at "
            f"{where(first_difference(g.results[d].reference.steps, other.steps))}. This is a "
            f"screener bug, not a hardware verdict.")


def _self_mismatch(runs: JobRuns, reference: Optional[Reference], job: str) -> Issue:
    """A device whose repeats disagree. Expected is the reference's value (golden, majority,
    earlier screens) and observed the device's first wrong one, whichever repeat went wrong: a
    fault in the first repeat must not make the corrupted value 'expected'."""
    results = runs.results()
    if reference is None or reference.steps is None:
        it, other = runs.first_mismatch()
        why = ("no golden or majority says which is right" if reference is None else
               f"{reference.source} gave digest {reference.digest}, which "
               f"{'iteration 0 reproduces' if reference.matches(runs.reference) else 'no run reproduces'}")
        return Issue(Outcome.SUSPECT, KatReason.SELF_MISMATCH, job,
                     first_difference(runs.reference.steps, other.steps),
                     detail=f"iteration {it} differs from iteration 0 ({why}; expected is "
                            f"iteration 0's value); {len(runs.counts)} different results in "
                            f"{runs.runs} runs")
    wrong = [(it, r) for it, r in results if not reference.matches(r)] or [runs.first_mismatch()]
    right = sum(c for dg, c in runs.counts.items()
                if any(r.digest == dg and reference.matches(r) for _, r in results))
    it, bad = wrong[0]
    # Wrong in every run is a golden (or majority) mismatch, told by its own name.
    reason = (KatReason.SELF_MISMATCH if right else
              KatReason.GOLDEN_MISMATCH if reference.record is not None else
              KatReason.PEER_MISMATCH)
    return Issue(Outcome.SUSPECT, reason, job,
                 first_difference(reference.steps, bad.steps),
                 detail=f"{runs.runs - right} of {runs.runs} runs differ from the "
                        f"{reference.source} (first: iteration {it}; {len(runs.counts)} "
                        f"different results); "
                        + (f"{right} run(s) reproduce it" if right else "no run reproduces it"))
