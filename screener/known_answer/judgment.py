"""The judgment of a screen (pure): Verdicts from the devices' runs and the golden records.

For each device and job, the results are compared:

(a) with the golden record for the device's platform signature (screener.known_answer.golden);
    without one, with the goldens of sibling platforms (same torch build and dispatch level, or
    GPU model: screener.known_answer.platform.sibling_key): equal bits pass (the verdict names
    the golden), different bits are inconclusive with the record command, never suspect;
(b) with the other devices of the same platform in this run: a device that differs from a
    strict majority is suspect even without a golden;
(c) across repeats on the device itself: a device that disagrees with itself is suspect.

How a child ended counts too, and only evidence about the device makes it suspect: a crash or a
device error is suspect; a child killed from outside (the OOM killer) is inconclusive; a timeout
is suspect only when the same job finished on a peer device of the same platform in this run,
or when the job's golden records how long it takes and the limit was at least HANG_FACTOR
times that (otherwise a slow job and a hung device look the same).

A job that disagrees with itself on every device is a screener bug (NondeterminismError, exit
1, with the evidence). With no golden and fewer than MIN_PEERS agreeing devices the verdict is
inconclusive (exit 3) and names the command that records a golden. In every verdict `expected`
is the golden's (or the majority's) value and `observed` the device's, also when the device
went wrong in its first repeat.

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
                "seconds": round(self.seconds, 3)}


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


@dataclass
class _JobGroup:
    """One job on the OK devices of one platform: what they are compared with, and each other."""

    job: str
    phash: str
    members: list[str]  # the platform's OK devices
    results: dict[str, JobRuns]  # of the members that produced the job's result
    record: Any  # the platform's golden, or None
    kin: Sequence[Any]  # sibling platforms' goldens (only without a golden of its own)
    refs: dict[str, JobResult] = field(init=False)
    counts: "Counter[str]" = field(init=False)
    majority: Optional[str] = field(init=False)  # the digest a strict majority agrees on

    def __post_init__(self) -> None:
        self.refs = {d: r.reference for d, r in self.results.items()}
        self.counts = Counter(r.digest for r in self.refs.values())
        self.majority = next((dg for dg, c in self.counts.items()
                              if c * 2 > len(self.results)), None)


def judge(runs: Mapping[str, DeviceRun], specs: Sequence[NamedJob], golden: GoldenLookup, *,
          golden_dir: Optional[str] = None, seconds: float = 0.0) -> ScreenResult:
    """Compare the runs with goldens, peers and themselves; one Verdict per device.

    Raises NondeterminismError when a job disagrees with itself on every device that ran it
    (with no golden to show it can be reproduced) or when three or more devices of one platform
    all give different results; raises ScreenerError when a child failed in our own code, and
    BadInputError when a child was given bad input (a missing device).
    """
    _raise_for_failures_of_ours(runs)
    ok = {d: r for d, r in runs.items() if r.status == RunStatus.OK}
    goldens = _goldens(ok, specs, golden)
    _check_nondeterminism(ok, specs, goldens)
    issues = {d: _ending_issues(d, run, runs, specs, golden) for d, run in runs.items()}
    matched: dict[str, dict[str, dict[str, Any]]] = {d: {} for d in runs}
    for group in _groups(ok, specs, goldens, golden):
        for d in group.members:
            if d not in group.results:
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


def _goldens(ok: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
             golden: GoldenLookup) -> dict[tuple[str, str], Any]:
    """The golden (or None) of every job on every platform that ran OK, looked up once."""
    goldens: dict[tuple[str, str], Any] = {}
    for run in ok.values():
        for spec in specs:
            key = (spec.name, run.platform_hash or "")
            if key not in goldens and run.platform_hash:
                goldens[key] = golden(spec, run.platform_hash)
    return goldens


def _groups(ok: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
            goldens: Mapping[tuple[str, str], Any], golden: GoldenLookup) -> Iterator[_JobGroup]:
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
            yield _JobGroup(spec.name, phash, members, results, record, kin)


def _ending_issues(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun],
                   specs: Sequence[NamedJob], golden: GoldenLookup) -> list[Issue]:
    """What the way a device's child ended says (nothing when it finished)."""
    job = run.current[0] if run.current else None
    if run.status == RunStatus.KILLED:
        return [Issue(Outcome.INCONCLUSIVE, KatReason.KILLED, job, detail=(
            f"{run.detail}: killed from outside (memory pressure, an operator), which says "
            f"nothing about the device"))]
    if run.status == RunStatus.TIMEOUT:
        return [_hang(device, run, runs, specs, golden)]
    if run.status != RunStatus.OK:  # crash or device_error (ours and bad input raised before)
        return [Issue(Outcome.SUSPECT, KatReason(run.status), job, detail=run.detail)]
    return []


def _device_issues(g: _JobGroup, d: str,
                   golden_dir: Optional[str]) -> tuple[list[Issue], Optional[dict[str, Any]]]:
    """A device's issues with one job, and the golden its result matched (or was compared
    with): its own platform's, or a sibling platform's that it reproduces bit for bit."""
    runs = g.results[d]
    ref = runs.reference
    out: list[Issue] = []
    if runs.mismatch is not None:
        it, other = runs.mismatch
        out.append(_self_mismatch(it, ref, other, _trusted_steps(g, ref, other), g.job))
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
    if have >= 2 and g.majority is None:
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
        seconds=seconds)


def _hang(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
          golden: GoldenLookup) -> Issue:
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
    spec = next((s for s in specs if s.name == job), None)
    record = None
    if spec is not None and run.platform_hash:
        try:
            record = golden(spec, run.platform_hash)
        except Exception:  # noqa: BLE001 - a broken golden was already reported by the lookup
            record = None
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


def _check_nondeterminism(ok: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
                          goldens: Mapping[tuple[str, str], Any]) -> None:
    """Raise NondeterminismError for a job that is our bug, not the hardware's: it disagrees
    with itself on every device, or gives three or more devices of a platform all different
    results with no golden to say which is right."""
    for spec in specs:
        ran = [d for d, r in ok.items() if spec.name in r.jobs]
        if not ran:
            continue
        self_bad = [d for d in ran if ok[d].jobs[spec.name].mismatch is not None]
        # One device that disagrees with itself while a golden proves the job reproducible is a
        # suspect device; every device disagreeing with itself is our bug.
        proven = any(_golden_reproduced(goldens.get((spec.name, ok[d].platform_hash or "")),
                                        ok[d].jobs[spec.name]) for d in ran)
        if self_bad and len(self_bad) == len(ran) and not (len(ran) == 1 and proven):
            d = self_bad[0]
            it, other = ok[d].jobs[spec.name].mismatch  # type: ignore[misc]
            diff = first_difference(ok[d].jobs[spec.name].reference.steps, other.steps)
            raise NondeterminismError(
                f"job {spec.name} is nondeterministic: it gave different bits across repeats on "
                f"every device ({', '.join(self_bad)}); e.g. {d} iteration {it} vs 0 at "
                f"{where(diff)}. This is a screener bug, not a hardware verdict.")
        _check_platform_split(spec.name, ok, ran, goldens)


def _check_platform_split(job: str, ok: Mapping[str, DeviceRun], ran: Sequence[str],
                          goldens: Mapping[tuple[str, str], Any]) -> None:
    """Three or more devices of one platform, all different, and no golden: our bug."""
    by_platform: dict[str, list[str]] = {}
    for d in ran:
        by_platform.setdefault(ok[d].platform_hash or "", []).append(d)
    for phash, members in by_platform.items():
        digests = {ok[d].jobs[job].reference.digest for d in members}
        if len(members) >= 3 and len(digests) == len(members) and \
                goldens.get((job, phash)) is None:
            raise NondeterminismError(
                f"job {job} gave {len(members)} different results on the "
                f"{len(members)} devices of platform {phash} ({', '.join(members)}): a "
                f"screener bug, not a hardware verdict")


def _trusted_steps(g: _JobGroup, ref: JobResult, other: JobResult) -> Any:
    """The steps a device's disagreeing repeats are judged against: its golden, else a sibling
    golden that one repeat reproduces, else the result a strict majority of two or more devices
    agree on; None when nothing outside the device says which repeat is right."""
    if g.record is not None:
        return g.record.steps
    for r in g.kin:
        if r.compare(ref) is None or r.compare(other) is None:
            return r.steps
    if g.majority is not None and len(g.refs) >= 2 and g.counts[g.majority] >= 2:
        return next(r.steps for r in g.refs.values() if r.digest == g.majority)
    return None


def _self_mismatch(it: int, ref: JobResult, other: JobResult, trusted: Any, job: str) -> Issue:
    """A device that disagrees with itself. Expected is the trusted value (golden or majority)
    and observed the device's wrong one, whichever repeat went wrong: a fault in the first
    repeat must not make the corrupted value 'expected'."""
    if trusted is None:
        return Issue(Outcome.SUSPECT, KatReason.SELF_MISMATCH, job,
                     first_difference(ref.steps, other.steps),
                     detail=f"iteration {it} differs from iteration 0 (no golden or majority "
                            f"says which is right; expected is iteration 0's value)")
    ref_diff = first_difference(trusted, ref.steps)
    bad, good, bad_it, good_it = ((ref, other, 0, it) if ref_diff is not None
                                  else (other, ref, it, 0))
    # digests differ, so at least one repeat differs from the trusted result
    diff = ref_diff or first_difference(trusted, bad.steps)
    agrees = first_difference(trusted, good.steps) is None
    return Issue(Outcome.SUSPECT, KatReason.SELF_MISMATCH, job, diff,
                 detail=f"iteration {bad_it} differs from the trusted result, which iteration "
                        f"{good_it} {'reproduces' if agrees else 'does not reproduce either'}")


def _golden_reproduced(record: Any, runs: JobRuns) -> bool:
    """Whether any run of the job reproduced its golden bit for bit."""
    if record is None:
        return False
    candidates = [runs.reference] + ([runs.mismatch[1]] if runs.mismatch else [])
    return any(record.compare(r) is None for r in candidates)


def _evidence(run: DeviceRun, issues: Sequence[Issue],
              matched: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A verdict's evidence: how the child ended, each job's digest and golden, every issue."""
    evidence: dict[str, Any] = {
        "status": run.status,
        "platform": run.platform.get("name") if run.platform else None,
        "iterations": run.iterations,
        # per job: its digest and, when compared with one, the golden (and whether a sibling's)
        "jobs": {j: {"digest": r.reference.digest, "runs": r.runs,
                     "seconds": round(sum(r.seconds), 4), **matched.get(j, {})}
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
    chosen = min(suspects or inconclusive or [None],
                 key=lambda i: _REASON_RANK.get(i.reason, 9) if i else 0)
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
