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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol, Sequence

from screener.errors import BadInputError, NondeterminismError, ScreenerError
from screener.known_answer.results import Difference, JobResult, first_difference, where
from screener.known_answer.runs import DeviceRun, JobRuns
from screener.types import ExitCode, KatReason, Outcome, RunStatus, Verdict

MIN_PEERS = 3  # agreeing devices needed to pass without a golden
HANG_FACTOR = 10.0  # a timeout this many times the golden's recorded job time is a hang


class NamedJob(Protocol):
    """What the judgment needs of a job spec (screener.known_answer.workloads.JobSpec): its name."""

    @property
    def name(self) -> str: ...


# (spec, platform_hash) -> GoldenRecord | None; it may carry `siblings(spec, platform) -> list`
# (screener.known_answer.kat.golden_lookup), the goldens of sibling platforms.
GoldenLookup = Callable[[Any, str], Any]


@dataclass(frozen=True)
class ScreenResult:
    """The outcome of a screen: one Verdict per device, the overall outcome and exit code, the
    result digest of every job on every device, platforms, and timings."""

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
                    "warnings": self.warnings()} if self.faults else {})}


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
    reason: KatReason
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
_REASON_RANK = {KatReason.TIMEOUT: 0, KatReason.CRASH: 0, KatReason.KILLED: 0,
                KatReason.DEVICE_ERROR: 0, KatReason.SELF_MISMATCH: 1,
                KatReason.GOLDEN_MISMATCH: 2, KatReason.PEER_MISMATCH: 3,
                KatReason.PEER_SPLIT: 4, KatReason.GOLDEN_DISAGREES_WITH_PEERS: 5,
                KatReason.SIBLING_GOLDEN_DIFFERS: 6, KatReason.NO_GOLDEN: 6,
                KatReason.INCOMPLETE: 6}
# Reasons whose verdict names the command that records the missing golden.
_NEEDS_GOLDEN = (KatReason.NO_GOLDEN, KatReason.SIBLING_GOLDEN_DIFFERS)


@dataclass(frozen=True)
class Reference:
    """What a job's results on one platform are judged against when a device's repeats disagree:
    its golden, a sibling platform's golden that a run reproduces, the result a strict majority
    of two or more devices produced, or what this node's earlier screens produced. `steps` is
    None when only the digest is known (an earlier screen whose result no run reproduced)."""

    source: str  # "golden", "sibling golden", "majority", "earlier screens"
    steps: Optional[tuple[Any, ...]]
    digest: Optional[str]
    record: Any = None  # the golden, for its own comparison

    def matches(self, result: JobResult) -> bool:
        """Whether a run reproduced the reference bit for bit."""
        if self.record is not None:
            return bool(self.record.compare(result) is None)
        return result.digest == self.digest


@dataclass
class _JobGroup:
    """One job on the OK devices of one platform: what they are compared with, and each other."""

    job: str
    phash: str
    members: list[str]  # the platform's devices that produced results
    results: dict[str, JobRuns]  # of the members that produced the job's result
    record: Any  # the platform's golden, or None
    kin: Sequence[Any]  # sibling platforms' goldens (only without a golden of its own)
    known: Optional[str] = None  # the digest this node's earlier screens gave on the platform
    refs: dict[str, JobResult] = field(init=False)
    counts: "Counter[str]" = field(init=False)
    majority: Optional[str] = field(init=False)  # the digest a strict majority agrees on
    reference: Optional[Reference] = field(init=False)

    def __post_init__(self) -> None:
        self.refs = {d: r.reference for d, r in self.results.items()}
        self.counts = Counter(r.digest for r in self.refs.values())
        self.majority = next((dg for dg, c in self.counts.items()
                              if c * 2 > len(self.results)), None)
        self.reference = self._reference()

    def _all_results(self) -> Iterator[JobResult]:
        for runs in self.results.values():
            for _, r in runs.results():
                yield r

    def _reference(self) -> Optional[Reference]:
        if self.record is not None:
            return Reference("golden", tuple(self.record.steps), None, self.record)
        for r in self.kin:
            if any(r.compare(res) is None for res in self._all_results()):
                return Reference("sibling golden", tuple(r.steps), None, r)
        consensus = self._consensus()
        if consensus is not None:
            return Reference("majority", consensus.steps, consensus.digest)
        if self.known is not None:
            # Only a result some run reproduces today says which of today's results is right.
            same = next((r for r in self._all_results() if r.digest == self.known), None)
            if same is not None:
                return Reference("earlier screens", same.steps, self.known)
        return None

    def _consensus(self) -> Optional[JobResult]:
        """The result a strict majority (two or more) of the devices gave in every run.

        Devices that each disagree with themselves are no majority, even when their first runs
        agree: state carried from one run to the next (our bug) looks exactly like that."""
        steady = Counter(runs.reference.digest for runs in self.results.values()
                         if runs.consistent)
        n = len(self.results)
        winner = next((dg for dg, c in steady.items() if c >= 2 and c * 2 > n), None)
        return None if winner is None else next(
            r.reference for r in self.results.values() if r.reference.digest == winner)


# What a node's earlier screens produced: platform hash -> job -> digest (the form a node
# publishes, screener.known_answer.crosscheck.platform_digests), or with the spec hash it was
# produced under: {"digest": ..., "spec_hash": ...} (a changed spec changes the bits).
Known = Mapping[str, Mapping[str, Any]]


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
    _raise_for_failures_of_ours(runs)
    # The results a child produced count even when it ended badly later: a device that gave a
    # wrong answer and then crashed is judged on both.
    judged = {d: r for d, r in runs.items() if r.status == RunStatus.OK or r.jobs}
    goldens = _goldens(runs, specs, golden)
    groups = list(_groups(judged, specs, goldens, golden, known or {}))
    _check_nondeterminism(groups)
    issues = {d: _ending_issues(d, run, runs, specs, goldens, known or {})
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
    verdicts = tuple(_verdict(d, run, issues[d], golden_dir, matched[d])
                     for d, run in runs.items())
    return _result(runs, specs, verdicts, seconds)


def known_digest(known: Known, phash: str, job: str, spec_hash: Optional[str]) -> Optional[str]:
    """The digest earlier screens gave for a job on a platform, if its spec has not changed."""
    table = known.get(phash) if isinstance(known, Mapping) else None
    entry = table.get(job) if isinstance(table, Mapping) else None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Mapping) and isinstance(entry.get("digest"), str):
        recorded = entry.get("spec_hash")
        if recorded is None or spec_hash is None or recorded == spec_hash:
            return str(entry["digest"])
    return None


def _raise_for_failures_of_ours(runs: Mapping[str, DeviceRun]) -> None:
    """Bad input (exit 2) and a bug of ours (exit 1) are errors, never verdicts."""
    for run in runs.values():
        if run.status == RunStatus.BAD_INPUT:
            msg = run.detail.split(": ", 2)[-1]
            named = msg.startswith((f"device {run.device}", f"device {run.device!r}"))
            raise BadInputError(msg if named else f"device {run.device}: {msg}")
        if run.status == RunStatus.SCREENER_ERROR:
            raise ScreenerError(f"device {run.device}: the screener failed: {run.detail}\n"
                                f"{run.stderr_tail}".rstrip())


def _goldens(runs: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
             golden: GoldenLookup) -> dict[tuple[str, str], Any]:
    """The golden (or None) of every job on every platform that reported one, looked up once."""
    goldens: dict[tuple[str, str], Any] = {}
    for run in runs.values():
        for spec in specs:
            key = (spec.name, run.platform_hash or "")
            if key not in goldens and run.platform_hash:
                goldens[key] = golden(spec, run.platform_hash)
    return goldens


def _groups(ok: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
            goldens: Mapping[tuple[str, str], Any], golden: GoldenLookup,
            known: Known) -> Iterator[_JobGroup]:
    """Every (job, platform) of the OK runs, job by job, platforms in order of first device."""
    platforms: dict[str, list[str]] = {}
    for device, run in ok.items():
        platforms.setdefault(run.platform_hash or "", []).append(device)
    siblings = getattr(golden, "siblings", None)
    for spec in specs:
        for phash, members in platforms.items():
            record = goldens.get((spec.name, phash))
            kin = (siblings(spec, ok[members[0]].platform)
                   if record is None and siblings is not None and phash else [])
            results = {d: ok[d].jobs[spec.name] for d in members if spec.name in ok[d].jobs}
            spec_hash = next((r.reference.spec_hash for r in results.values()), None)
            yield _JobGroup(spec.name, phash, members, results, record, kin,
                            known_digest(known, phash, spec.name, spec_hash))


def _ending_issues(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun],
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


def _device_issues(g: _JobGroup, d: str,
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


def _golden_issue(g: _JobGroup, ref: JobResult) -> Optional[Issue]:
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


def _peer_issue(g: _JobGroup, ref: JobResult, golden_dir: Optional[str], *,
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


def _result(runs: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
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
        jobs=tuple(s.name for s in specs), iterations={d: r.iterations for d, r in runs.items()},
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


def _check_nondeterminism(groups: Sequence[_JobGroup]) -> None:
    """Raise NondeterminismError for a job that is our bug, not the hardware's: nothing says
    which result is right (no golden, no sibling golden reproduced, no majority, no earlier
    screen) and it disagrees with itself on every device, or gives three or more devices of a
    platform all different results. With a reference, a device that misses it is suspect."""
    by_job: dict[str, list[_JobGroup]] = {}
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


def _check_flipping(job: str, g: _JobGroup) -> None:
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


def _verdict(device: str, run: DeviceRun, issues: Sequence[Issue], golden_dir: Optional[str],
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
    if chosen.reason in (*_NEEDS_GOLDEN, KatReason.INCOMPLETE):
        names = [i.job for i in inconclusive if i.reason in _NEEDS_GOLDEN and i.job]
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
