"""Which of a training step's ops the known-answer jobs exercise (pure): `screener kat coverage`.

A census (screener.known_answer.engine.census) is, per op, the self time it took and how often it ran:
aten ops on the CPU, kernels on CUDA. This module compares the census of a user's step with the
censuses of the jobs a device runs:

- an op's share is its self time over the total self time of the step's census, so the shares of
  every op of the step add up to 1 (self time, not total time: a composite op such as
  aten::linear would otherwise count the aten::addmm inside it a second time);
- an op is covered when at least one job ran an op of the same name (the same aten op; on CUDA the
  same kernel name), whatever its shapes and however often: a fault in an op no job runs can never
  be seen, and this is what the report must show. The same name is the rule because it is what
  can be checked from a census: in-place and out-of-place variants (aten::sqrt_, aten::sqrt) and
  two kernels of one GEMM are different names, and the report says so rather than guessing;
- covered_share is the sum of the covered ops' shares: the share of the step's time spent in ops
  some job also runs.

Pure: plain data in, plain data out; no torch, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from screener.errors import BadInputError

# What a census counts: aten ops by self CPU time, or CUDA kernels by their device time. A step
# and the jobs are only compared in one unit: an aten op name never equals a kernel name.
KIND_ATEN = "aten"
KIND_KERNEL = "kernel"
KINDS = (KIND_ATEN, KIND_KERNEL)


@dataclass(frozen=True)
class OpStat:
    """One op of a census: its self time in microseconds and how many times it ran."""

    self_us: float
    count: int


@dataclass(frozen=True)
class Census:
    """What some work ran, op by op (name -> OpStat), in one unit (`kind`). `marked`: only what
    ran inside the work's step mark was counted (census.STEP_MARK), not everything it ran."""

    kind: str
    ops: Mapping[str, OpStat]
    marked: bool = False

    @property
    def total_us(self) -> float:
        return sum(s.self_us for s in self.ops.values())

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "marked": self.marked,
                "ops": {name: [s.self_us, s.count] for name, s in sorted(self.ops.items())}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Census":
        """A census from its to_dict() form (a census child's output); BadInputError if broken."""
        kind = d.get("kind") if isinstance(d, Mapping) else None
        ops = d.get("ops") if isinstance(d, Mapping) else None
        marked = d.get("marked", False) if isinstance(d, Mapping) else None
        if kind not in KINDS or not isinstance(ops, Mapping) or not isinstance(marked, bool):
            raise BadInputError(f"not a census: kind {kind!r}, ops of type {type(ops).__name__}")
        out: dict[str, OpStat] = {}
        for name, v in ops.items():
            if not (isinstance(name, str) and isinstance(v, (list, tuple)) and len(v) == 2
                    and isinstance(v[0], (int, float)) and isinstance(v[1], int)
                    and v[0] >= 0 and v[1] >= 0):
                raise BadInputError(f"not a census: op {name!r} is {v!r}, not [self_us, count]")
            out[name] = OpStat(float(v[0]), int(v[1]))
        return cls(str(kind), out, marked)


def least_disturbed(runs: Sequence[Census]) -> Census:
    """One census from several runs of the same work: each op's smallest self time over the runs
    it appears in, and its largest count.

    A profiler's self time is wall time: on a shared machine an op that was preempted, or whose
    worker threads were, takes what the other processes took, and in one run of a small step that
    made aten::sqrt (21 calls) a fifth of the step. The smallest of a few runs is the op's own
    cost; its largest count is every call, should a run skip some. Marked only when every run
    was (a run without the mark counted its set-up too).
    """
    if not runs:
        raise BadInputError("no census to combine")
    kinds = sorted({c.kind for c in runs})
    if len(kinds) != 1:
        raise BadInputError(f"censuses of different kinds ({', '.join(kinds)}) cannot be combined")
    names = sorted({n for c in runs for n in c.ops})
    ops = {n: OpStat(min(c.ops[n].self_us for c in runs if n in c.ops),
                     max(c.ops[n].count for c in runs if n in c.ops)) for n in names}
    return Census(kinds[0], ops, all(c.marked for c in runs))


@dataclass(frozen=True)
class OpShare:
    """One op of the step in the report: its share of the step's time, and the jobs that run it
    (empty: uncovered)."""

    name: str
    share: float
    count: int
    self_us: float
    jobs: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "share": self.share, "count": self.count,
                "self_us": self.self_us, "jobs": list(self.jobs)}


@dataclass(frozen=True)
class Coverage:
    """The comparison of a step's census with the jobs': covered_share and every op of the step,
    covered and uncovered, each sorted by share (largest first)."""

    kind: str
    covered_share: float
    total_us: float
    covered: tuple[OpShare, ...]
    uncovered: tuple[OpShare, ...]
    jobs: tuple[str, ...]
    marked: bool = False  # the step's census counted only its marked step

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "covered_share": self.covered_share,
                "step_self_us": self.total_us, "step_marked": self.marked,
                "jobs": list(self.jobs),
                "uncovered": [o.to_dict() for o in self.uncovered],
                "covered": [o.to_dict() for o in self.covered]}


def _by_share(ops: Sequence[OpShare]) -> tuple[OpShare, ...]:
    # Largest share first; the name breaks ties so that the report is the same run to run.
    return tuple(sorted(ops, key=lambda o: (-o.share, o.name)))


def compare(step: Census, jobs: Mapping[str, Census]) -> Coverage:
    """The coverage of `step` by the censuses of `jobs` (job name -> census).

    Raises BadInputError when the censuses are of different kinds (aten ops against kernels: no
    name could ever match, and 0% would read as a finding) or when the step's census measured no
    time at all (a script that ran no op: its step never ran, and no share can be computed).
    """
    other = sorted({c.kind for c in jobs.values()} - {step.kind})
    if other:
        raise BadInputError(f"the step's census counts {step.kind} ops, the jobs' {other[0]} ops: "
                            "they cannot be compared")
    total = step.total_us
    if not step.ops or total <= 0:
        raise BadInputError("the step's census is empty: it ran no op that took any time")
    covered: list[OpShare] = []
    uncovered: list[OpShare] = []
    for name, stat in step.ops.items():
        by = tuple(sorted(j for j, c in jobs.items() if name in c.ops))
        op = OpShare(name, stat.self_us / total, stat.count, stat.self_us, by)
        (covered if by else uncovered).append(op)
    # Summed from the ops' own self times, not from the rounded shares: exactly 1.0 when every
    # op is covered, 0.0 when none is.
    share = sum(o.self_us for o in covered) / total
    return Coverage(step.kind, min(1.0, share), total, _by_share(covered), _by_share(uncovered),
                    tuple(sorted(jobs)), step.marked)


# Ops under these shares are summed into one line of the text report (the JSON lists every op):
# every uncovered op a fault could hide in that is worth a job, the covered ones that matter.
MIN_SHOWN_UNCOVERED = 0.001
MIN_SHOWN_COVERED = 0.005
NAME_WIDTH = 60  # a CUDA kernel's name runs to hundreds of characters; the JSON has it whole


def _name(name: str) -> str:
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."


def _jobs_text(jobs: Sequence[str], every: int) -> str:
    if len(jobs) == every and every > 1:
        return f"all {every} jobs"
    return ", ".join(jobs) if len(jobs) <= 3 else f"{', '.join(jobs[:3])} +{len(jobs) - 3}"


def _table(ops: Sequence[OpShare], every: int, with_jobs: bool) -> list[str]:
    least = MIN_SHOWN_COVERED if with_jobs else MIN_SHOWN_UNCOVERED
    shown = [o for o in ops if o.share >= least]
    rest = ops[len(shown):]
    head = f"  {'share':>7s} {'calls':>6s}  {'op':{NAME_WIDTH}s}"
    out = [(head + ("  jobs" if with_jobs else "")).rstrip()]
    for o in shown:
        row = f"  {o.share:7.2%} {o.count:6d}  {_name(o.name):{NAME_WIDTH}s}"
        out.append((row + f"  {_jobs_text(o.jobs, every)}" if with_jobs else row).rstrip())
    if rest:
        out.append(f"  {sum(o.share for o in rest):7.2%} {sum(o.count for o in rest):6d}  "
                   f"({len(rest)} more op(s), each under {least:.1%})")
    return out


def report_lines(cov: Coverage, *, script: str, device: str) -> list[str]:
    """The text report: the uncovered ops (what a fault could hide in), the covered ones with the
    jobs that run them, and the summary line last."""
    what = "aten ops by self CPU time" if cov.kind == KIND_ATEN else "CUDA kernels by device time"
    every = len(cov.jobs)
    scope = ("its marked step" if cov.marked
             else "everything it ran (no record_function('screener:step') mark)")
    out = [f"{script} on {device}, {scope}: {len(cov.covered) + len(cov.uncovered)} {cov.kind} "
           f"op(s), {cov.total_us / 1000:.1f} ms ({what})", f"jobs: {', '.join(cov.jobs)}", ""]
    out.append(f"not run by any job ({1.0 - cov.covered_share:.1%} of the step's time):")
    out += _table(cov.uncovered, every, with_jobs=False) if cov.uncovered else ["  (none)"]
    out += ["", f"run by the jobs ({cov.covered_share:.1%} of the step's time):"]
    out += _table(cov.covered, every, with_jobs=True) if cov.covered else ["  (none)"]
    out += ["", f"covered_share {cov.covered_share:.3f}: the jobs run {len(cov.covered)} of the "
                f"step's {len(cov.covered) + len(cov.uncovered)} op(s), "
                f"{cov.covered_share:.1%} of its time"]
    return out
