"""Pipeline parallel: which pipeline replays which, and which stage a disagreement starts at.

A pipeline (one rank per stage, joined by the schedule's sends and receives) computes one step as
one: a replay of one stage alone would need the activations and gradients its neighbours sent,
so a whole pipeline replays another pipeline's batch, stage s replaying stage s, in lockstep
through the same schedule. Pipelines differ only in their data (data parallelism runs across
them, stage by stage), so replays move from pipeline to pipeline.

Who replays whom: pipeline d is replayed by pipeline d + shift (mod the number of pipelines), the
smallest shift that puts every stage of the replayer on another node than the same stage of the
owner; the referee is pipeline d + referee_shift, on a third node at every stage. A layout where
no such shift exists is refused at construction (`plan`).

Tensor parallel inside the stages: the ranks of a stage's TP group are stages of different
pipelines that compute as one (their all-reduces join them), a TP group of pipelines, each at
its TP coordinate. A replay moves a whole group onto another group, coordinate onto coordinate
(a shift is taken only when it maps every group onto a group that way), and a round that
replays one pipeline replays its whole group: a pipeline at another coordinate computes
another shard, and a partner left on its own batch would mix two steps in one all-reduce.

Where it started (`first_difference`): each rank records, per step, a fingerprint of what its
stage sent forward (its outputs, every micro-batch, in order; on the last stage with the losses),
of what it sent back (the gradients of its inputs) and of its own weight gradient. Along the data
flow of a step (forward from stage 0 to the last, then backward from the last to stage 0) a stage
whose inputs agree between two runs and whose outputs do not is where they part: the first stage
whose forward record differs, else the last stage whose backward or gradient record differs.
The referee's run, equal to one of the two, says which of them it was.

Pure: rank numbers and record rows in, rank numbers and stage numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["Pipelines", "PipelinePlan", "plan", "first_difference", "first_nonfinite",
           "settle_pipelines", "R_STATUS", "R_LOSS", "R_FWD", "R_BWD", "R_GRAD", "R_FINITE",
           "R_MAG", "RECORD"]

# One rank's record of a step (an int64 row): status, loss bits (last stage, else 0), the
# forward, backward and gradient fingerprints (2 words each), finiteness flags (forward,
# backward, local gradient; 1 = finite) and the local gradient's largest magnitude (bits).
R_STATUS, R_LOSS, R_FWD, R_BWD, R_GRAD, R_FINITE, R_MAG = 0, 1, 2, 4, 6, 8, 11
RECORD = 12


@dataclass(frozen=True)
class Pipelines:
    """rows[d][s]: the global rank of stage s in pipeline d (pipelines ordered by first rank)."""

    rows: tuple[tuple[int, ...], ...]
    # groups[d]: the pipelines computing with pipeline d as one (its stages' tensor-parallel
    # partners, in TP coordinate order); empty without tensor parallel
    groups: tuple[tuple[int, ...], ...] = ()

    def group(self, d: int) -> tuple[int, ...]:
        return self.groups[d] if self.groups else (d,)

    def close(self, pipelines: Sequence[int]) -> list[int]:
        """The pipelines and their whole tensor-parallel groups."""
        return sorted({q for d in pipelines for q in self.group(d)})

    def aligned(self, shift: int) -> bool:
        """Whether moving every pipeline by `shift` maps each TP group onto a group, coordinate
        onto coordinate."""
        n = self.count
        return all(self.group((d + shift) % n) == tuple((q + shift) % n for q in self.group(d))
                   for d in range(n))

    @property
    def count(self) -> int:
        return len(self.rows)

    @property
    def stages(self) -> int:
        return len(self.rows[0]) if self.rows else 0

    def where(self, rank: int) -> tuple[int, int]:
        """(pipeline, stage) of a rank."""
        for d, row in enumerate(self.rows):
            if rank in row:
                return d, row.index(rank)
        raise KeyError(rank)

    @classmethod
    def from_groups(cls, entries: Sequence[tuple[int, int, int, Sequence[int]]],
                    tp: Optional[dict[int, Sequence[int]]] = None) -> "Pipelines | str":
        """From every rank's (rank, stage index, stage count, its pipeline group's ranks in group
        order) and tensor-parallel group (tp, by rank; absent: none): the pipelines, or why they
        do not form a (stage, data-parallel[, tensor-parallel]) grid."""
        counts = {n for _, _, n, _ in entries}
        if len(counts) != 1:
            return f"the ranks disagree on the number of stages ({sorted(counts)})"
        stages = counts.pop()
        if stages < 2:
            return "a pipeline of one stage is no pipeline parallelism"
        rows: dict[tuple[int, ...], None] = {}
        for rank, stage, _, group in entries:
            group = tuple(int(g) for g in group)
            if len(group) != stages:
                return (f"rank {rank}'s pipeline group has {len(group)} ranks for {stages} "
                        f"stages (one stage per rank is audited: interleaved and looped "
                        f"schedules put several on one)")
            if group[stage] != rank:
                return (f"rank {rank} runs stage {stage} but is at place "
                        f"{group.index(rank) if rank in group else '-'} of its pipeline group")
            rows.setdefault(group, None)
        ranks = [r for row in rows for r in row]
        if len(ranks) != len(set(ranks)) or len(ranks) != len(entries):
            return "the pipeline groups overlap or leave ranks out"
        pipes = cls(tuple(sorted(rows, key=lambda row: row[0])))
        if not tp or all(len(g) == 1 for g in tp.values()):
            return pipes
        groups: list[tuple[int, ...]] = []
        for d, row in enumerate(pipes.rows):
            seen: set[tuple[int, ...]] = set()
            for s, rank in enumerate(row):
                where = [pipes.where(int(r)) for r in tp.get(rank, (rank,))]
                if any(t != s for _, t in where):
                    return (f"rank {rank}'s tensor-parallel group spans stages "
                            f"({sorted({t for _, t in where})}): TP inside one stage is audited")
                seen.add(tuple(q for q, _ in where))
            if len(seen) != 1:
                return (f"pipeline {d}'s stages have tensor-parallel partners in different "
                        f"pipelines from stage to stage ({sorted(seen)}): each pipeline at one "
                        f"TP coordinate throughout is audited")
            groups.append(seen.pop())
        if any(d not in g for d, g in enumerate(groups)):
            return "a pipeline is missing from its own tensor-parallel group"
        return cls(pipes.rows, tuple(groups))


@dataclass(frozen=True)
class PipelinePlan:
    """Replay and referee shifts over the pipelines (referee None with fewer than three
    pipelines on distinct nodes)."""

    pipelines: Pipelines
    shift: int
    referee_shift: Optional[int]

    def replayer(self, d: int) -> int:
        return (d + self.shift) % self.pipelines.count

    def owner_replayed_by(self, d: int) -> int:
        return (d - self.shift) % self.pipelines.count

    def referee(self, d: int) -> Optional[int]:
        return None if self.referee_shift is None else \
            (d + self.referee_shift) % self.pipelines.count

    def owner_refereed_by(self, d: int) -> Optional[int]:
        return None if self.referee_shift is None else \
            (d - self.referee_shift) % self.pipelines.count


def plan(pipes: Pipelines, node_of: Callable[[int], str]) -> "PipelinePlan | str":
    """The smallest node-disjoint replay shift and, with it, the smallest referee shift (see the
    module docstring); or why none exists."""
    n = pipes.count
    if n < 2:
        return ("one pipeline has nobody to replay it: data parallelism across two or more "
                "pipelines is audited")

    def apart(d: int, others: Sequence[int]) -> bool:
        return all(node_of(pipes.rows[d][s]) != node_of(pipes.rows[o][s])
                   for s in range(pipes.stages) for o in others)

    shift = next((k for k in range(1, n) if pipes.aligned(k)
                  and all(apart((d + k) % n, [d]) for d in range(n))), None)
    if shift is None:
        return ("no pipeline can replay another with every stage on another node (each stage's "
                "data-parallel ranks share one node" + (", or no shift maps tensor-parallel "
                "groups onto groups" if pipes.groups else "") + "): spread each stage's ranks "
                "over two or more nodes")
    referee = next((j for j in range(1, n) if j != shift and pipes.aligned(j) and all(
        apart((d + j) % n, [d, (d + shift) % n]) for d in range(n))), None)
    return PipelinePlan(pipes, shift, referee)


def first_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]
                     ) -> Optional[tuple[int, str]]:
    """(stage, "forward" | "backward") where two runs of one pipeline's step part (a, b: one
    record row per stage), or None when they agree."""
    stages = len(a)
    for s in range(stages):
        if tuple(a[s][R_LOSS:R_BWD]) != tuple(b[s][R_LOSS:R_BWD]):
            return s, "forward"
    for s in reversed(range(stages)):
        if tuple(a[s][R_BWD:R_FINITE]) != tuple(b[s][R_BWD:R_FINITE]):
            return s, "backward"
    return None


def first_nonfinite(rows: Sequence[Sequence[int]]) -> Optional[tuple[int, str]]:
    """Where a step's NaN/Inf first appears along the data flow (forward, then backward), by the
    finiteness flags of one pipeline's records; None when all are finite."""
    stages = len(rows)
    for s in range(stages):
        if not rows[s][R_FINITE]:
            return s, "forward"
    for s in reversed(range(stages)):
        if not rows[s][R_FINITE + 1] or not rows[s][R_FINITE + 2]:
            return s, "backward"
    return None


def settle_pipelines(owner: Sequence[Sequence[int]], replay: Sequence[Sequence[int]],
                     referee: Optional[Sequence[Sequence[int]]]) -> tuple[str, Optional[int]]:
    """Who the referee's run agrees with: ("owner", stage) when it agrees with the replay (the
    owner's pipeline parted at that stage), ("replayer", stage) when it agrees with the owner,
    ("unsettled", stage or None) otherwise (no referee, or three different runs)."""
    where = first_difference(owner, replay)
    stage = None if where is None else where[0]
    if referee is None:
        return "unsettled", stage
    def key(rows: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        return [tuple(r[R_LOSS:R_FINITE]) for r in rows]

    if key(referee) == key(replay):
        return "owner", stage
    if key(referee) == key(owner):
        return "replayer", stage
    return "unsettled", stage
