"""What the results of a job on one platform are judged against (pure): job groups, references.

The judgment (screener.known_answer.verdict.judgment) compares, job by job and platform by platform, the
results of a screen's devices: a JobGroup holds one job on the devices of one platform, with the
platform's golden, what a quorum of other nodes of the platform gave (screener.known_answer.verdict.quorum),
the goldens of sibling platforms and what this node's earlier screens gave; its Reference is, in
this order, the golden, the quorum's answer, a sibling golden one of the runs reproduces, the
result a strict majority (two or more) of the devices gave in every run, or the earlier screens'.
The quorum comes before this node's own devices: each of its nodes reproduced itself on
independent hardware, while a node's devices share its software and can share its fault.

Pure: goldens come through a lookup function, specs are only named.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence

from screener.known_answer.verdict.quorum import FleetView, Quorum
from screener.known_answer.verdict.results import JobResult
from screener.known_answer.verdict.runs import DeviceRun, JobRuns


class NamedJob(Protocol):
    """What the judgment needs of a job spec (screener.known_answer.engine.specs.JobSpec): its name."""

    @property
    def name(self) -> str: ...


# (spec, platform_hash) -> GoldenRecord | None; it may carry `siblings(spec, platform) -> list`
# (screener.known_answer.engine.screen.golden_lookup), the goldens of sibling platforms.
GoldenLookup = Callable[[Any, str], Any]


# What a node's earlier screens produced: platform hash -> job -> digest (the form a node
# publishes, screener.known_answer.verdict.crosscheck.platform_digests), or with the spec hash it was
# produced under: {"digest": ..., "spec_hash": ...} (a changed spec changes the bits).
Known = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class Reference:
    """What a job's results on one platform are judged against when a device's repeats disagree:
    its golden, a sibling platform's golden that a run reproduces, the result a strict majority
    of two or more devices produced, or what this node's earlier screens produced. `steps` is
    None when only the digest is known (an earlier screen whose result no run reproduced)."""

    source: str  # "golden", "quorum", "sibling golden", "majority", "earlier screens"
    steps: Optional[tuple[Any, ...]]
    digest: Optional[str]
    record: Any = None  # the golden, for its own comparison

    def matches(self, result: JobResult) -> bool:
        """Whether a run reproduced the reference bit for bit."""
        if self.record is not None:
            return bool(self.record.compare(result) is None)
        return result.digest == self.digest


@dataclass
class JobGroup:
    """One job on the OK devices of one platform: what they are compared with, and each other."""

    job: str
    phash: str
    members: list[str]  # the platform's devices that produced results
    results: dict[str, JobRuns]  # of the members that produced the job's result
    record: Any  # the platform's golden, or None
    kin: Sequence[Any]  # sibling platforms' goldens (only without a golden of its own)
    known: Optional[str] = None  # the digest this node's earlier screens gave on the platform
    quorum: Optional[Quorum] = None  # what the other nodes of the platform say (fleet view given)
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
        if self.quorum is not None and self.quorum.digest is not None:
            # Steps only when a run reproduces it: the other nodes publish digests, not steps.
            same = next((r for r in self._all_results() if r.digest == self.quorum.digest), None)
            return Reference("quorum", same.steps if same is not None else None,
                             self.quorum.digest)
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


def lookup_goldens(runs: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
                   golden: GoldenLookup) -> dict[tuple[str, str], Any]:
    """The golden (or None) of every job on every platform that reported one, looked up once."""
    goldens: dict[tuple[str, str], Any] = {}
    for run in runs.values():
        for spec in specs:
            key = (spec.name, run.platform_hash or "")
            if key not in goldens and run.platform_hash:
                goldens[key] = golden(spec, run.platform_hash)
    return goldens


def job_groups(ok: Mapping[str, DeviceRun], specs: Sequence[NamedJob],
               goldens: Mapping[tuple[str, str], Any], golden: GoldenLookup,
               known: Known, fleet: Optional[FleetView] = None) -> Iterator[JobGroup]:
    """Every (job, platform) of the OK runs, job by job, platforms in order of first device;
    with a fleet view, each without a golden carries the quorum of the other nodes."""
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
            quorum = (fleet.quorum_for(phash, spec.name, spec_hash)
                      if fleet is not None and record is None and phash else None)
            if quorum is not None and quorum.digest is not None:
                kin = []  # the platform's own fleet says; a sibling's bits are no evidence
            yield JobGroup(spec.name, phash, members, results, record, kin,
                           known_digest(known, phash, spec.name, spec_hash), quorum)
