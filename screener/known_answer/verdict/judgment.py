"""The judgment of a screen (pure): Verdicts from the devices' runs and the golden records.

For each device and job, the results are compared:

(a) with the golden record for the device's platform signature (screener.known_answer.engine.golden);
    without one, with the goldens of sibling platforms (same torch build and dispatch level, or
    GPU model: screener.known_answer.engine.platform.sibling_key): equal bits pass (the verdict names
    the golden), different bits are inconclusive with the record command, never suspect;
(b) with the other devices of the same platform in this run: a device that differs from a
    strict majority is suspect even without a golden;
(c) across repeats on the device itself: every run counts, not only the first two.

A job's reference on a platform is, in this order: its golden, a sibling golden that one of
the runs reproduces, the result a strict majority (two or more) of the devices gave in every
run, or what this node's earlier screens gave (`known`). A device that does not reproduce the
reference is suspect, whatever its repeats did among themselves (wrong in every run the same
way, in some runs, or differently in each): a unit that is wrong again and again is the
commonest silent data corruption, not a nondeterministic job. A device whose repeats disagree
is judged by screener.known_answer.verdict.self_mismatch: suspect wherever something else shows the
job deterministic on its platform (a reference, another device of the platform or this node's
earlier screens that reproduced themselves), whatever its own majority; inconclusive with what
would settle it where nothing does. No comparison here is "a screener bug" (exit 1): a
nondeterministic job and a faulty device look the same without evidence, and exit 1 is kept
for failures of our own code. A device that reproduced itself on another result than the
node's earlier screens kept, with no golden or majority, is inconclusive (the conflict is said;
screener.known_answer.verdict.node_memory never replaces the kept digest).

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
screener.known_answer.verdict.reference's, what a child's ending says is screener.known_answer.verdict.endings',
and how issues become verdicts and the screen's outcome is screener.known_answer.verdict.screen_result's.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from screener.known_answer.verdict.endings import (HANG_FACTOR, ending_issues,
                                                   raise_for_failures_of_ours)
from screener.known_answer.verdict.quorum import FleetView
from screener.known_answer.verdict.reference import (GoldenLookup, JobGroup, Known, NamedJob,
                                                     job_groups, known_digest, lookup_goldens)
from screener.known_answer.verdict.results import Difference, JobResult, first_difference
from screener.known_answer.verdict.runs import DeviceRun
from screener.known_answer.verdict.self_mismatch import self_mismatch_issue
from screener.known_answer.verdict.screen_result import (Issue, ScreenResult, record_command,
                                                         screen_result, verdict_of)
from screener.types import KnownAnswerReason, Outcome, RunStatus

MIN_PEERS = 3  # agreeing devices needed to pass without a golden

# The names other modules take from here: the judgment's entry point and what it returns.
__all__ = ["HANG_FACTOR", "MIN_PEERS", "GoldenLookup", "Known", "NamedJob", "ScreenResult",
           "judge", "known_digest", "record_command"]


def judge(runs: Mapping[str, DeviceRun], specs: Sequence[NamedJob], golden: GoldenLookup, *,
          golden_dir: Optional[str] = None, seconds: float = 0.0,
          known: Optional[Known] = None, fleet: Optional[FleetView] = None) -> ScreenResult:
    """Compare the runs with goldens, peers and themselves; one Verdict per device.

    A device that does not reproduce its reference (golden, sibling golden, a majority of its
    platform, or `known`: what this node's earlier screens produced) is suspect, whatever its
    repeats did among themselves; one whose repeats disagree with nothing to say the job is
    deterministic on its platform is inconclusive. fleet: the other nodes' results
    (screener.known_answer.verdict.quorum); without a golden, a quorum of them is the reference, and a
    platform with none is waiting for one (awaiting_quorum). Raises ScreenerError only when a child
    reported a failure of our own code, and BadInputError when a child was given bad input (a
    missing device).
    """
    raise_for_failures_of_ours(runs)
    # The results a child produced count even when it ended badly later: a device that gave a
    # wrong answer and then crashed is judged on both.
    judged = {d: r for d, r in runs.items() if r.status == RunStatus.OK or r.jobs}
    goldens = lookup_goldens(runs, specs, golden)
    groups = list(job_groups(judged, specs, goldens, golden, known or {}, fleet))
    issues = {d: ending_issues(d, run, runs, specs, goldens, known or {}, fleet)
              for d, run in runs.items()}
    matched: dict[str, dict[str, dict[str, Any]]] = {d: {} for d in runs}
    for group in groups:
        for d in group.members:
            if d not in group.results and runs[d].status == RunStatus.OK \
                    and group.job not in runs[d].raised:  # a raise is its own issue
                issues[d].append(Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.INCOMPLETE, group.job,
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
        out.append(self_mismatch_issue(g, d, golden_dir))
    if g.record is not None:
        issue = _golden_issue(g, ref)
        return out + ([issue] if issue else []), {"golden": g.record.path,
                                                   "platform_hash": g.phash}
    if g.quorum is not None and g.quorum.digest is not None:
        return out + [i for i in (_quorum_issue(g, d),) if i is not None], {
            "quorum": g.quorum.to_dict(), "platform_hash": g.phash}
    if g.kin:
        same = next((r for r in g.kin if r.compare(ref) is None), None)
        if same is not None:
            return out, {"golden": same.path, "platform_hash": same.platform_hash,
                         "sibling": True}
        out.append(Issue(
            Outcome.INCONCLUSIVE, KnownAnswerReason.SIBLING_GOLDEN_DIFFERS, g.job, g.kin[0].compare(ref),
            detail=f"no golden for platform {g.phash}; the results differ from the "
                   f"golden(s) of sibling platforms (same torch build and dispatch "
                   f"level, another library path, thread count or driver): "
                   f"{', '.join(r.path for r in g.kin)}; record one with: "
                   f"{record_command([g.job], g.members, golden_dir)}"))
    conflict = _memory_conflict(g, d, golden_dir)
    peer = _peer_issue(g, ref, golden_dir, sibling_differs=bool(g.kin))
    return out + [i for i in (conflict, peer) if i is not None], None


def _quorum_issue(g: JobGroup, d: str) -> Optional[Issue]:
    """A device whose result is not the quorum's: suspect (quorum_mismatch). Several other nodes
    of the platform, each of which reproduced itself, agree on another result. A device whose
    runs disagree has its self_mismatch issue already; only one wrong in every run is named here."""
    q = g.quorum
    assert q is not None and q.digest is not None
    runs = g.results[d]
    if not runs.consistent or runs.reference.digest == q.digest:
        return None
    ref = g.reference
    diff = (first_difference(ref.steps, runs.reference.steps)
            if ref is not None and ref.steps is not None else None)
    if diff is None:  # no run here reproduced it: the quorum is known by its digest only
        diff = Difference(0, "digest", "digest", q.digest, runs.reference.digest)
    return Issue(Outcome.SUSPECT, KnownAnswerReason.QUORUM_MISMATCH, g.job, diff, detail=(
        f"no golden for platform {g.phash}; {q.describe()}; this device gave "
        f"{runs.reference.digest} in all {runs.runs} run(s)"))


def _memory_conflict(g: JobGroup, d: str, golden_dir: Optional[str]) -> Optional[Issue]:
    """A device that reproduced itself on a result other than the one this node's earlier
    screens kept for the platform, with nothing else to say which is right: one of the two
    is wrong (a persistently bad unit then or now), so it is inconclusive and said, and the
    node's memory is not replaced (screener.known_answer.verdict.node_memory)."""
    runs = g.results[d]
    if g.known is None or g.reference is not None or not runs.consistent \
            or runs.reference.digest == g.known:
        return None
    return Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.EARLIER_SCREENS_DIFFER, g.job, detail=(
        f"this node's earlier screens gave digest {g.known} on platform {g.phash}; this device "
        f"gave {runs.reference.digest} in all {runs.runs} run(s); one of them is wrong and no "
        f"golden or majority says which (the earlier digest is kept, not replaced); record a "
        f"golden on a node you trust: {record_command([g.job], g.members, golden_dir)}"))


def _golden_issue(g: JobGroup, ref: JobResult) -> Optional[Issue]:
    """A result that differs from its platform's golden: suspect, unless at least MIN_PEERS
    devices agree with each other on it (then the golden is the odd one out)."""
    diff = g.record.compare(ref)
    if diff is None:
        return None
    agreeing = g.counts[ref.digest]
    if ref.digest == g.majority and agreeing >= MIN_PEERS:
        return Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.GOLDEN_DISAGREES_WITH_PEERS, g.job, diff,
                     detail=f"{agreeing} devices agree with each other but not with "
                            f"{g.record.path}; re-record it if the platform changed")
    return Issue(Outcome.SUSPECT, KnownAnswerReason.GOLDEN_MISMATCH, g.job, diff, detail=g.record.path)


def _peer_issue(g: JobGroup, ref: JobResult, golden_dir: Optional[str], *,
                sibling_differs: bool) -> Optional[Issue]:
    """Without a golden of its own: a device that differs from the strict majority of its
    platform, a platform with no majority, or too few agreeing devices to pass."""
    have = len(g.results)
    if have >= 2 and g.majority is not None and ref.digest != g.majority:
        peer = next(p for p in g.results if g.refs[p].digest == g.majority)
        return Issue(Outcome.SUSPECT, KnownAnswerReason.PEER_MISMATCH, g.job,
                     first_difference(g.refs[peer].steps, ref.steps),
                     detail=f"differs from the {g.counts[g.majority]} of {have} devices "
                            f"that agree (e.g. {peer})")
    if have >= 3 and len(g.counts) == have and g.reference is None:
        # Every device different and nothing to say which is right: a nondeterministic job
        # and as many faulty devices look the same.
        return Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.PEER_SPLIT, g.job, detail=(
            f"the {have} devices of platform {g.phash} give {have} different results and no "
            f"golden or earlier screen says which is right; record a golden on a node you "
            f"trust: {record_command([g.job], g.members, golden_dir)}"))
    if have >= 2 and g.majority is None and not (g.known and ref.digest == g.known):
        return Issue(Outcome.SUSPECT, KnownAnswerReason.PEER_SPLIT, g.job,
                     detail=f"{have} devices of one platform give {len(g.counts)} different "
                            f"results and no strict majority agrees")
    if g.quorum is not None and g.counts[ref.digest] < MIN_PEERS:
        return Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.AWAITING_QUORUM, g.job, detail=(
            f"no golden for platform {g.phash}, and no quorum of other nodes yet: "
            f"{g.quorum.describe()}; it settles itself as more nodes of the platform are "
            f"screened, or record a golden: {record_command([g.job], g.members, golden_dir)}"))
    if g.counts[ref.digest] < MIN_PEERS and not sibling_differs:
        return Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.NO_GOLDEN, g.job,
                     detail=f"no golden for platform {g.phash} and only {g.counts[ref.digest]} "
                            f"agreeing device(s); record one with: "
                            f"{record_command([g.job], g.members, golden_dir)}")
    return None
