"""Golden writing: turn agreeing runs into golden records, refusing when the runs disagree.

`write_goldens` is the deciding half of `screener golden record` (screener.known_answer.engine.screen.
record_goldens runs the children): nothing is written unless every run on every device of a
platform agrees bit for bit; results equal to another platform's golden are added to that
record instead of copied; a valid golden with other results is replaced only when forced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from screener.errors import GoldenError
from screener.known_answer.engine import golden as _golden
from screener.known_answer.verdict.judgment import ScreenResult, judge
from screener.known_answer.verdict.results import JobResult, where
from screener.known_answer.verdict.runs import DeviceRun
from screener.known_answer.engine.text import format_verdicts
from screener.known_answer.engine.specs import JobSpec
from screener.types import ExitCode, Outcome


@dataclass(frozen=True)
class RecordResult:
    """What `record_goldens` did: files written, platforms added to an existing record with the
    same bits, files left unchanged or refused, and its exit code."""

    written: tuple[str, ...]
    unchanged: tuple[str, ...]
    refused: tuple[str, ...]
    exit_code: ExitCode
    screen: Optional[ScreenResult] = None
    added: tuple[str, ...] = ()  # "<path> (platform <hash>)"

    def lines(self) -> list[str]:
        """The text `screener golden record` prints: one line per file, then any refusal's
        verdicts."""
        out = [f"wrote     {p}" for p in self.written]
        out += [f"added to  {p}" for p in self.added]
        out += [f"unchanged {p}" for p in self.unchanged]
        out += [f"refused   {r}" for r in self.refused]
        if self.refused and self.screen is not None:
            out.append(format_verdicts(self.screen))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`screener golden record --json`)."""
        return {"written": list(self.written), "added": list(self.added),
                "unchanged": list(self.unchanged),
                "refused": list(self.refused), "exit_code": int(self.exit_code),
                "screen": self.screen.to_dict() if self.screen else None}


@dataclass
class _Outcomes:
    """What happened to each (job, platform) record, in the order it happened."""

    written: list[str]
    unchanged: list[str]
    refused: list[str]
    added: list[str]


def write_goldens(runs: Mapping[str, DeviceRun], specs: Sequence[JobSpec], out: str, *,
                  repeat: int, force: bool = False, seconds: float = 0.0) -> RecordResult:
    """The deciding half of record_goldens: judge the runs without goldens, then write."""
    screen = judge(runs, specs, lambda spec, phash: None, golden_dir=out, seconds=seconds)
    bad = [v for v in screen.verdicts if v.outcome == Outcome.SUSPECT]
    if bad:
        return RecordResult((), (), tuple(
            f"{v.device}: {v.reason}" + (f" in {v.job}" if v.job else "") for v in bad),
            ExitCode.HARDWARE_SUSPECT, screen)
    done = _Outcomes([], [], [], [])
    for spec in specs:
        platforms: dict[str, list[str]] = {}
        for d, run in runs.items():
            if spec.name in run.jobs:
                platforms.setdefault(run.platform_hash or "", []).append(d)
        for phash, members in platforms.items():
            results = [(d, runs[d].jobs[spec.name].reference) for d in members]
            record = _golden.record_from_results(spec, runs[members[0]].platform, phash, results,
                                                 repeats=repeat)
            _record_platform(spec, phash, record, results[0][1], out, force, done)
    code = ExitCode.HARDWARE_SUSPECT if done.refused else ExitCode.PASS
    return RecordResult(tuple(done.written), tuple(done.unchanged), tuple(done.refused), code,
                        screen, tuple(done.added))


def _record_platform(spec: JobSpec, phash: str, record: Any, result: JobResult, out: str,
                     force: bool, done: _Outcomes) -> None:
    """Write (or add, or leave, or refuse) the golden of one job on one platform."""
    path = _golden.golden_path(out, spec.name, phash)
    if not path.exists() and _add_to_equal_record(spec, phash, record, result, out, done):
        return
    if path.exists():
        try:
            old = _golden.load(path, spec=spec, platform_hash=phash)
        except GoldenError:
            old = None  # stale or broken: replace it
        if old is not None and old.digest == record.digest:
            done.unchanged.append(str(path))
            return
        if old is not None and not force:
            done.refused.append(f"{path}: the new runs differ from this valid golden at "
                                f"{where(old.compare(result))}; use --force to replace it")
            return
    done.written.append(str(_golden.write(record, out)))


def _add_to_equal_record(spec: JobSpec, phash: str, record: Any, result: JobResult, out: str,
                         done: _Outcomes) -> bool:
    """Results equal to an existing golden of another platform: add this platform to that
    record rather than writing a copy of its bits. False when there is no such record."""
    try:
        same = [r for r in _golden.job_records(out, spec) if r.digest == record.digest
                and r.compare(result) is None]
    except GoldenError:
        return False  # a broken record is replaced by nobody here; write our own
    if not same:
        return False
    old = same[0]
    if phash in old.platform_hashes:
        done.unchanged.append(old.path)
    else:
        _golden.write(_golden.add_platform(old, record.platform, phash, record.recorded), out)
        done.added.append(f"{old.path} (platform {phash})")
    return True
