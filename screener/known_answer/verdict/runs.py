"""What a device's screening child produced: its platform, its results per job, how it ended.

The supervisor (screener.known_answer.engine.supervise) fills a DeviceRun from the child's events; the
judgment (screener.known_answer.verdict.judgment) reads it. Plain data, so the judgment stays pure.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from screener.known_answer.verdict.results import JobResult
from screener.types import RunStatus

# Distinct results of one job kept per device. A persistently bad unit gives a different wrong
# answer in every run; the judgment needs a golden-equal run if there is one, and the first
# wrong ones, not all of them (each is a few KB, a burn-in repeats a job for hours).
MAX_DISTINCT = 8


@dataclass
class JobRuns:
    """Every run of one job on one device, kept small: the first result, and the first run of
    each different result (up to MAX_DISTINCT; past that only counted).

    A device is judged on all of them: a later run that reproduces the golden, or a run that is
    wrong differently from the first, both matter (a unit that is wrong in every run is the
    commonest silent data corruption, and must not look like a nondeterministic job)."""

    reference: JobResult  # iteration 0's result
    runs: int = 1
    mismatch: Optional[tuple[int, JobResult]] = None  # (iteration, result) first differing run
    seconds: list[float] = field(default_factory=list)
    fired: list[dict[str, Any]] = field(default_factory=list)
    distinct: dict[str, tuple[int, JobResult]] = field(default_factory=dict)  # digest -> first
    counts: "Counter[str]" = field(default_factory=Counter)  # digest -> runs that gave it
    dropped: int = 0  # runs whose (new) result was past MAX_DISTINCT

    def __post_init__(self) -> None:
        if not self.distinct:
            self.distinct[self.reference.digest] = (0, self.reference)
            self.counts[self.reference.digest] += 1

    def add(self, iteration: int, result: JobResult) -> None:
        """Count one more run of the job."""
        self.runs += 1
        digest = result.digest
        self.counts[digest] += 1
        if digest not in self.distinct:
            if len(self.distinct) < MAX_DISTINCT:
                self.distinct[digest] = (iteration, result)
            else:
                self.dropped += 1
        if self.mismatch is None and digest != self.reference.digest:
            self.mismatch = (iteration, result)

    def first_mismatch(self) -> tuple[int, JobResult]:
        """(iteration, result) of the first run that differed from iteration 0; only for runs
        that are not consistent."""
        if self.mismatch is None:
            raise ValueError("every run gave iteration 0's bits: there is no mismatch")
        return self.mismatch

    @property
    def consistent(self) -> bool:
        """Whether every run gave the same bits."""
        return len(self.counts) == 1

    def results(self) -> list[tuple[int, JobResult]]:
        """The first run of each different result, in the order they first appeared."""
        return sorted(self.distinct.values(), key=lambda p: p[0])

    def iterations_of(self, digest: str) -> int:
        """How many runs gave this digest."""
        return self.counts.get(digest, 0)


@dataclass
class Raised:
    """The runs of one job that raised on a device while its child went on (a corrupted index
    tensor's IndexError): how many, and the first one's iteration and message."""

    iteration: int  # the first run that raised
    detail: str  # "job J iteration I: IndexError: ..."
    traceback: str = ""
    count: int = 1


@dataclass
class DeviceRun:
    """What a device's child produced: platform, results per job, and how it ended.

    faults: the DeviceFault.to_dict()s its child was asked to apply (drills, `--inject`);
    faults_fired: the index (into faults) of each one that fired at least once."""

    device: str
    status: RunStatus = RunStatus.OK
    detail: str = ""
    platform: Mapping[str, Any] = field(default_factory=dict)
    platform_hash: Optional[str] = None
    jobs: dict[str, JobRuns] = field(default_factory=dict)
    iterations: int = 0
    current: Optional[tuple[str, int]] = None  # (job, iteration) running when it ended
    seconds: float = 0.0
    stderr_tail: str = ""
    timeout_s: Optional[float] = None  # the limit it ran past, when status is TIMEOUT
    faults: list[dict[str, Any]] = field(default_factory=list)
    faults_fired: set[int] = field(default_factory=set)
    raised: dict[str, Raised] = field(default_factory=dict)  # job -> its runs that raised

    def add_raised(self, job: str, iteration: int, detail: str, traceback: str = "") -> None:
        """Count one run of a job that raised (the child re-runs it before any verdict)."""
        if job in self.raised:
            self.raised[job].count += 1
        else:
            self.raised[job] = Raised(iteration, detail, traceback)

    def add(self, iteration: int, result: JobResult, fired: Sequence[dict[str, Any]] = ()) -> None:
        """Count one result of a job (and the faults that fired in its run)."""
        for rec in fired:
            if isinstance(rec.get("fault"), int):
                self.faults_fired.add(rec["fault"])
        runs = self.jobs.get(result.job)
        if runs is None:
            self.jobs[result.job] = JobRuns(result, seconds=[result.seconds], fired=list(fired))
            return
        runs.add(iteration, result)
        runs.seconds.append(result.seconds)
        runs.fired.extend(fired)

    def unfired_faults(self) -> list[dict[str, Any]]:
        """The requested faults that never fired (a drill that tested nothing)."""
        return [f for i, f in enumerate(self.faults) if i not in self.faults_fired]
