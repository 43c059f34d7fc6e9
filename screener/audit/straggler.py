"""Straggler detection: the slow GPU that holds a whole synchronous job back.

A synchronous step takes as long as its slowest rank, so one GPU throttled by 20% slows every GPU
by 20%. Rank i is a straggler when its step time t_i stands out from the others robustly,

    score_i = (t_i - median(t)) / (1.4826 * MAD(t)) > k      for w consecutive steps,

where MAD is the median absolute deviation (1.4826 scales it to a standard deviation under
normality). Medians keep the straggler from inflating its own baseline, and the window w ignores
one-off stalls such as a checkpoint write.

Defaults: k = 3.0 and w = 5 steps. When the ranks are nearly identical, MAD is 0 (or tiny) and
any jitter would give a huge score; the scale therefore has a floor of ``min_relative_scale`` (2%)
of the median, so with the defaults a rank must be persistently more than 3 * 2% = 6% slower than the
median to be flagged, and identical times never divide by zero. A robust median needs at least
three ranks (with two, each is as far from the median as the other); with fewer, nothing is flagged.

`StragglerDetector` is pure: feed it one step's durations at a time. `StragglerMonitor` is the
in-job helper: every rank calls `observe(step_seconds)` each step; one small all_gather shares the times,
every rank runs the same detector on the same numbers (so all agree), and stragglers are reported
with their nodes from the audit library's topology.

A straggler reaches the node's label through an alarm file: when a rank has stood out for the
whole window (newly flagged), the rank itself (it runs on the slow node, whose alarm folder is the
hostPath its DaemonSet reads) writes one unsettled alarm with check "straggler" and the figures
(slowdown, score, consecutive steps, median, its step time, k and w) as evidence
(`write_straggler_alarm`; `StragglerMonitor(alarm_dir=...)` does it). The daemon makes the node
suspect with those figures and runs the confirming screen; a slow GPU is not a wrong one, so a
straggler alone never quarantines.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from screener.alarmfile import STRAGGLER, AlarmRecord, bounded_alarm_id, write_alarm_file
from screener.types import Finding, Severity, SuspectNode

STRAGGLER_CHECK = STRAGGLER  # the alarm check (the contract's, screener.alarmfile)

DEFAULT_K = 3.0
DEFAULT_WINDOW = 5
DEFAULT_MIN_RELATIVE_SCALE = 0.02
MAD_TO_SIGMA = 1.4826
MIN_RANKS = 3


@dataclass(frozen=True)
class Straggler:
    """A rank flagged as a straggler (score above k for at least w consecutive steps)."""

    rank: int
    score: float  # this step's robust z-score
    slowdown: float  # t_i / median - 1 this step (0.2 = 20% slower)
    consecutive: int  # steps in a row above k
    duration: float
    node: Optional[SuspectNode] = None  # filled in by the in-job helper


@dataclass(frozen=True)
class StepResult:
    """The detector's view of one step."""

    step: int
    median: float
    mad: float
    scale: float  # max(1.4826 * MAD, min_relative_scale * median)
    scores: tuple[float, ...]
    stragglers: tuple[Straggler, ...]  # flagged at this step
    newly_flagged: tuple[int, ...] = ()  # ranks that reached w consecutive steps at this step

    @property
    def flagged(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.stragglers)


class StragglerDetector:
    """Median/MAD straggler detector with a persistence window; pure and deterministic."""

    def __init__(self, k: float = DEFAULT_K, window: int = DEFAULT_WINDOW,
                 min_relative_scale: float = DEFAULT_MIN_RELATIVE_SCALE) -> None:
        if not k > 0 or not math.isfinite(k):
            raise ValueError(f"k must be a positive number, not {k!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, not {window!r}")
        if not 0 < min_relative_scale < 1:
            raise ValueError(f"min_relative_scale must be in (0, 1), not {min_relative_scale!r}")
        self.k = float(k)
        self.window = window
        self.min_relative_scale = float(min_relative_scale)
        self._streak: list[int] = []
        self._step = 0

    def reset(self) -> None:
        self._streak = []
        self._step = 0

    def update(self, durations: Sequence[float]) -> StepResult:
        """Feed one step: ``durations[i]`` is rank i's step time (seconds, or any unit)."""
        times = [float(t) for t in durations]
        for i, t in enumerate(times):
            if not math.isfinite(t) or t < 0:
                raise ValueError(f"duration of rank {i} is {t!r}; need a finite number >= 0")
        if len(times) != len(self._streak):
            self._streak = [0] * len(times)  # the group changed: streaks start again
        self._step += 1
        if len(times) < MIN_RANKS:
            return StepResult(step=self._step, median=statistics.median(times) if times else 0.0,
                              mad=0.0, scale=0.0, scores=tuple(0.0 for _ in times),
                              stragglers=())
        med = statistics.median(times)
        mad = statistics.median(abs(t - med) for t in times)
        scale = max(MAD_TO_SIGMA * mad, self.min_relative_scale * med)
        if scale <= 0:  # every rank took 0: nothing stands out
            scores = [0.0] * len(times)
        else:
            scores = [(t - med) / scale for t in times]
        flagged, new = [], []
        for i, s in enumerate(scores):
            self._streak[i] = self._streak[i] + 1 if s > self.k else 0
            if self._streak[i] >= self.window:
                if self._streak[i] == self.window:
                    new.append(i)
                flagged.append(Straggler(rank=i, score=s, consecutive=self._streak[i],
                                         slowdown=times[i] / med - 1 if med > 0 else 0.0,
                                         duration=times[i]))
        return StepResult(step=self._step, median=med, mad=mad, scale=scale, scores=tuple(scores),
                          stragglers=tuple(flagged), newly_flagged=tuple(new))


def straggler_findings(result: StepResult) -> list[Finding]:
    """Stragglers as warning Findings (a straggler signal makes a node suspect, not broken)."""
    out = []
    for s in result.stragglers:
        ev: dict[str, Any] = {"rank": s.rank, "score": s.score, "slowdown": s.slowdown,
                              "consecutive": s.consecutive, "step": result.step,
                              "median": result.median, "duration": s.duration}
        if s.node is not None:
            ev.update(node=s.node.node, hostname=s.node.hostname, instance_id=s.node.instance_id)
        where = f" on node {s.node.node}" if s.node is not None else ""
        out.append(Finding(severity=Severity.WARNING, code="straggler",
                           message=f"rank {s.rank}{where} is {s.slowdown:.0%} slower than the "
                                   f"median for {s.consecutive} steps", evidence=ev,
                           action="check the GPU's clocks, temperature and power; re-screen"))
    return out


def straggler_alarm(s: Straggler, result: StepResult, *, k: float, window: int, job: str = "",
                    created: float = 0.0) -> AlarmRecord:
    """The unsettled alarm for a straggler that persisted for the window (s.node must be set)."""
    import uuid

    if s.node is None:
        raise ValueError("a straggler alarm needs the straggler's node")
    return AlarmRecord(
        alarm_id=bounded_alarm_id("straggler", s.node.node, unique=uuid.uuid4().hex[:12]),
        check=STRAGGLER_CHECK,
        step=int(result.step), settled=False, suspect_ranks=(int(s.rank),), suspect_nodes=(s.node,),
        node=s.node.node, job=job, created=float(created),
        evidence={"rank": s.rank, "slowdown": s.slowdown, "score": s.score,
                  "consecutive": s.consecutive, "median": result.median, "duration": s.duration,
                  "mad": result.mad, "k": k, "window": window})


def write_straggler_alarm(s: Straggler, result: StepResult, alarm_dir: str, *, k: float,
                          window: int, job: str = "", created: float = 0.0) -> Path:
    """Write the straggler's alarm file into `alarm_dir` (its node's); returns the path."""
    return write_alarm_file(straggler_alarm(s, result, k=k, window=window, job=job,
                                            created=created), alarm_dir)


@dataclass
class StragglerMonitor:
    """In-job helper: each rank calls ``observe(step_seconds)`` once per step, in step.

    One all_gather of a single float64 per rank per step. The first call also gathers the
    rank-to-node map (`screener.audit.topology.gather_topology`, one all_gather_object), so every
    rank must call ``observe`` the same number of times. Returns the stragglers of this step with
    their nodes; ranks are global ranks.
    """

    group: Any = None  # torch.distributed ProcessGroup; None = WORLD
    detector: StragglerDetector = field(default_factory=StragglerDetector)
    device: Any = None  # where the all_gather tensor lives; default: cuda for NCCL, else cpu
    topology: Any = None  # a screener.audit.topology.Topology; gathered on first use if None
    last: Optional[StepResult] = None
    alarm_dir: Optional[str] = None  # where this rank drops a straggler alarm for its own node
    job: str = ""
    alarms: list[Any] = field(default_factory=list)  # paths of the alarm files this rank wrote

    def _device(self) -> Any:
        import torch
        import torch.distributed as dist

        if self.device is not None:
            return torch.device(self.device)
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def observe(self, step_seconds: float) -> tuple[Straggler, ...]:
        import torch
        import torch.distributed as dist

        if self.topology is None:
            from screener.audit.topology import gather_topology

            self.topology = gather_topology(self.group)
        device = self._device()
        mine = torch.tensor([float(step_seconds)], dtype=torch.float64, device=device)
        world = dist.get_world_size(self.group)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=self.group)
        times = torch.cat(parts).cpu().tolist()
        result = self.detector.update(times)
        ranks = self.topology.ranks  # group rank k -> global rank
        out = tuple(Straggler(rank=ranks[s.rank], score=s.score, slowdown=s.slowdown,
                              consecutive=s.consecutive, duration=s.duration,
                              node=self.topology.suspect_node(ranks[s.rank]))
                    for s in result.stragglers)
        self.last = StepResult(step=result.step, median=result.median, mad=result.mad,
                               scale=result.scale, scores=result.scores, stragglers=out,
                               newly_flagged=tuple(ranks[i] for i in result.newly_flagged))
        if self.alarm_dir is not None:
            import time

            me = dist.get_rank()
            for st in out:
                # Once per streak, by the slow rank itself: its alarm folder is its node's.
                if st.rank == me and st.rank in self.last.newly_flagged:
                    self.alarms.append(write_straggler_alarm(
                        st, self.last, self.alarm_dir, k=self.detector.k,
                        window=self.detector.window, job=self.job, created=time.time()))
        return out


def summarize(result: StepResult) -> Mapping[str, Any]:
    """A small dict for logs and metrics."""
    return {"step": result.step, "median": result.median, "mad": result.mad,
            "scale": result.scale, "flagged": list(result.flagged),
            "newly_flagged": list(result.newly_flagged)}
