"""The known-answer rounds of a burn-in: every job on every device, again and again.

`run_burnin` runs the known-answer jobs for a duration or a number of iterations, each device in
one child process for the whole burn-in (screener.known_answer.engine.screen.execute); every repeat
is compared with the first (self-consistency), the first with the golden record of the device's
platform and with the device's peers. Its BurninReport has a per-device, per-job table.
This is stage 2 of the full burn-in (screener.agent.burnin.full orders the stages around it).
`TextProgress` is the older known-answer-only progress bar, kept for library callers.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, TextIO

from screener.errors import BadInputError
from screener.known_answer.engine.golden import default_golden_dir
from screener.known_answer.verdict.quorum import FleetView
from screener.known_answer.engine.screen import (DEFAULT_TIMEOUT, DeviceFault, Known, Progress,
                                          ScreenResult, execute, judge_runs, prevalidate_goldens,
                                          resolve_devices, resolve_jobs)
from screener.types import ExitCode, Outcome

DEFAULT_ITERATIONS = 10


@dataclass(frozen=True)
class BurninRow:
    """One job on one device: how often it ran, how long it took, and what came of it."""

    device: str
    job: str
    runs: int
    mean_seconds: float
    digest: str
    result: str  # "pass", or the reason of the first issue (golden_mismatch, self_mismatch, ...)
    where: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "job": self.job, "runs": self.runs,
                "mean_seconds": self.mean_seconds, "digest": self.digest, "result": self.result,
                "where": self.where}


@dataclass(frozen=True)
class BurninReport:
    """The outcome of a burn-in: the screen result and one row per (device, job)."""

    screen: ScreenResult
    rows: tuple[BurninRow, ...]
    started: float
    finished: float
    duration: Optional[float] = None
    iterations: Optional[int] = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def outcome(self) -> Outcome:
        return self.screen.outcome

    @property
    def exit_code(self) -> ExitCode:
        return self.screen.exit_code

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "burnin", "outcome": self.outcome.value, "exit_code": int(self.exit_code),
                "started": self.started, "finished": self.finished,
                "seconds": round(self.finished - self.started, 3),
                "requested": {"duration": self.duration, "iterations": self.iterations},
                "rows": [r.to_dict() for r in self.rows], "screen": self.screen.to_dict(),
                **dict(self.extra)}

    def table(self) -> str:
        """The final table: one line per (device, job), then one verdict line per device."""
        lines = [f"{'device':8s} {'job':14s} {'runs':>5s} {'mean s':>8s} {'digest':16s} result"]
        for r in self.rows:
            lines.append(f"{r.device:8s} {r.job:14s} {r.runs:5d} {r.mean_seconds:8.3f} "
                         f"{r.digest:16s} {r.result}{'  ' + r.where if r.where else ''}")
        lines.append("")
        for v in self.screen.verdicts:
            text = f"{v.device}: {v.outcome.value}"
            if v.reason:
                text += f" ({v.reason}"
                if v.job:
                    text += f", {v.job}"
                    if v.step is not None:
                        text += f" step {v.step} {v.tensor}: expected {v.expected}, " \
                                f"observed {v.observed}"
                text += ")"
            lines.append(text)
            if v.evidence.get("detail") and v.outcome != Outcome.PASS:
                lines.append(f"  {v.evidence['detail']}")
            if v.evidence.get("command"):
                lines.append(f"  record a golden: {v.evidence['command']}")
        # This table is one stage of the burn-in: its time and outcome are the stage's; the
        # overall result and exit code are the full report's last line.
        lines.append(f"known-answer stage: {self.outcome.value} in "
                     f"{self.finished - self.started:.1f} s")
        return "\n".join(lines)


def _rows(screen: ScreenResult) -> tuple[BurninRow, ...]:
    rows = []
    for v in screen.verdicts:
        jobs = v.evidence.get("jobs", {})
        issues = v.evidence.get("issues", [])
        for job in screen.jobs:
            info = jobs.get(job)
            first = next((i for i in issues if i.get("job") == job), None)
            if info is None:
                result = first["reason"] if first else v.reason or "not run"
                rows.append(BurninRow(v.device, job, 0, 0.0, "-", result))
                continue
            where = ""
            if first and first.get("step") is not None:
                where = f"step {first['step']} {first.get('tensor')}"
            runs = int(info["runs"])
            rows.append(BurninRow(v.device, job, runs, round(info["seconds"] / max(runs, 1), 4),
                                  info["digest"], first["reason"] if first else "pass", where))
    return tuple(rows)


def run_burnin(devices: Optional[Sequence[str]] = None, jobs: Optional[Sequence[Any]] = None, *,
               duration: Optional[float] = None, iterations: Optional[int] = None,
               golden_dir: Optional[str] = None, jobs_dir: Optional[str] = None,
               timeout: float = DEFAULT_TIMEOUT, progress: Optional[Progress] = None,
               faults: Optional[Mapping[str, Sequence[DeviceFault]]] = None,
               known: Optional[Known] = None,
               fleet: Optional[FleetView] = None) -> BurninReport:
    """Burn in devices (default: every local GPU, or the CPU) with jobs (default: all).

    Runs for `duration` seconds (finishing the iteration under way) or `iterations` times
    (default DEFAULT_ITERATIONS when neither is given; both: whichever ends first, at least one
    iteration). known: what this node's earlier screens produced, as for run_screen (the
    daemon's full burn-in passes its known-digests); fleet: the other nodes' results and the
    promoted goldens, as for run_screen. Raises GoldenError / ScreenerError as
    run_screen does.
    """
    if duration is not None and duration <= 0:
        raise BadInputError(f"duration {duration} must be positive")
    if iterations is not None and iterations < 1:
        raise BadInputError(f"iterations {iterations} must be >= 1")
    if duration is None and iterations is None:
        iterations = DEFAULT_ITERATIONS
    specs = resolve_jobs(jobs, jobs_dir, quick_only=False)
    devs = resolve_devices(devices)
    if golden_dir is None:
        golden_dir = str(default_golden_dir())
    prevalidate_goldens(golden_dir, specs)
    started = time.time()
    t0 = time.monotonic()
    runs = execute(specs, devs, iterations=iterations, duration=duration, timeout=timeout,
                   faults=faults, progress=progress)
    screen = judge_runs(runs, specs, golden_dir, seconds=time.monotonic() - t0, known=known,
                        fleet=fleet)
    return BurninReport(screen=screen, rows=_rows(screen), started=started, finished=time.time(),
                        duration=duration, iterations=iterations)


class TextProgress:
    """A one-line progress bar on a stream (stderr) fed with the child events of execute().

    With a known number of job runs it shows a bar of finished runs; with a duration, elapsed
    time against it. On a stream that is not a terminal it prints a line per finished iteration.
    """

    def __init__(self, total_runs: Optional[int] = None, duration: Optional[float] = None,
                 stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total, self.duration, self.stream, self.width = total_runs, duration, stream, width
        self.done = 0
        self.t0 = time.monotonic()
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.last = ""
        self.problems: list[str] = []

    def __call__(self, event: Mapping[str, Any]) -> None:
        kind = event.get("event")
        if kind == "result":
            self.done += 1
        elif kind in ("timeout", "error"):
            self.problems.append(f"{event.get('device')}: {kind}")
        elif kind != "start":
            return
        self.last = f"{event.get('device')} {event.get('job') or ''} #{event.get('iteration', '')}"
        self._draw(final=False, iteration_end=kind == "result")

    def _draw(self, final: bool, iteration_end: bool = False) -> None:
        elapsed = time.monotonic() - self.t0
        if self.total:
            frac = min(self.done / self.total, 1.0)
            text = f"{self.done}/{self.total} job runs"
        elif self.duration:
            frac = min(elapsed / self.duration, 1.0)
            text = f"{elapsed:.0f}/{self.duration:.0f} s, {self.done} job runs"
        else:
            frac, text = 0.0, f"{self.done} job runs"
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        line = f"[{bar}] {text} {elapsed:6.1f} s  {self.last}"
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
            if final:
                self.stream.write("\n")
            self.stream.flush()
        elif final or (iteration_end and self.total and self.done % max(1, self.total // 10) == 0):
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        self._draw(final=True)
