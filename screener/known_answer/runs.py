"""What a device's screening child produced: its platform, its results per job, how it ended.

The supervisor (screener.known_answer.supervise) fills a DeviceRun from the child's events; the
judgment (screener.known_answer.judgment) reads it. Plain data, so the judgment stays pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from screener.known_answer.results import JobResult
from screener.types import RunStatus


@dataclass
class JobRuns:
    """Every run of one job on one device, kept small: the first result, the first differing one."""

    reference: JobResult
    runs: int = 1
    mismatch: Optional[tuple[int, JobResult]] = None  # (iteration, result) first differing run
    seconds: list[float] = field(default_factory=list)
    fired: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class DeviceRun:
    """What a device's child produced: platform, results per job, and how it ended."""

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

    def add(self, iteration: int, result: JobResult, fired: Sequence[dict[str, Any]] = ()) -> None:
        """Count one result of a job, keeping the first one that differs from the first."""
        runs = self.jobs.get(result.job)
        if runs is None:
            self.jobs[result.job] = JobRuns(result, seconds=[result.seconds], fired=list(fired))
            return
        runs.runs += 1
        runs.seconds.append(result.seconds)
        runs.fired.extend(fired)
        if runs.mismatch is None and result.digest != runs.reference.digest:
            runs.mismatch = (iteration, result)
