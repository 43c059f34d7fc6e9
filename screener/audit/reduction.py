"""A reduction that went bad: whom the evidence names. One rule, both auditors (issue 21.5).

Every local gradient was finite and a reduced one is NaN/Inf below any overflow: the reduction
itself made it (a link, a NIC, one rank's reduction arithmetic). What each auditor gathers about
it (nonfinite.py: every rank recomputes what it sent; DDP then runs the bad bucket's all-reduce
once more for real, through the job's own reduction; FSDP2/HSDP the reduce-scatter, and HSDP's
all-reduce) comes here as a `ReductionEvidence`, and `reduction_verdict` says what it supports:

- a sender's recomputed value, or their sum, not finite: the data or the model ("data"); the
  candidates stay what they were without a redo;
- no redone collective (no replay, no reduction to redo it through, or a replay that did not
  recompute the step's inputs): "unplaced". A result every holder should share but only some
  hold NaN/Inf was made where it is seen: those ranks are the candidates; held by every holder,
  every sender is;
- the collective redone on the same inputs gives NaN/Inf again: "persistent"; the candidates are
  the ranks where it shows first in the redo (the reduce-scatter's receivers before the
  all-reduce's), where it is made or received, never a settled name;
- the redone collective is finite: "transient", the reduction went bad once. Held by only some of
  the holders: those ranks (made where seen). Held by every holder (a reduce-scatter's shard has
  one holder per replica; every rank's values took that path): nobody can be named, and nobody is
  suspected; the alarm says so instead of putting every node under suspicion.

No alarm is settled here: a reduction's result does not say on which link or GPU it went bad.
Pure: ranks and booleans in, a verdict out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["ReductionEvidence", "ReductionVerdict", "reduction_verdict"]


@dataclass(frozen=True)
class ReductionEvidence:
    """What a check knows about a bad reduction.

    seeing: the ranks that held NaN/Inf in the result; holders: the ranks that should hold the
    same result (every rank for an all-reduce; for FSDP/HSDP the holders of the bad shard, one
    per replica); senders: every rank whose values went into it. sent_finite / sum_finite: each
    sender's recomputed value at the bad places is finite, and so is their sum (None: not
    recomputed). redone: per stage of the collective done again, in order ("reduce-scatter",
    then "all-reduce"), the holders whose redone result is NaN/Inf; None when it was not redone.
    collective: what reduced ("all-reduce", "reduce-scatter").
    """

    seeing: Sequence[int]
    holders: Sequence[int]
    senders: Sequence[int]
    collective: str
    sent_finite: Optional[bool] = None
    sum_finite: Optional[bool] = None
    redone: Optional[Sequence[tuple[str, Sequence[int]]]] = None


@dataclass(frozen=True)
class ReductionVerdict:
    """verdict: "data" | "unplaced" | "persistent" | "transient"; candidates: the ranks under
    suspicion (empty: nobody can be named, and nobody is suspected); why: one sentence."""

    verdict: str
    candidates: tuple[int, ...]
    why: str


def _ranks(rs: Sequence[int]) -> str:
    return ", ".join(map(str, sorted(rs)))


def reduction_verdict(e: ReductionEvidence) -> ReductionVerdict:
    """The rule of the module docstring."""
    seeing, holders = sorted(set(e.seeing)), sorted(set(e.holders))
    some = bool(seeing) and set(seeing) < set(holders)  # a shared result only some hold
    unplaced = tuple(seeing) if some else tuple(sorted(set(e.senders)))
    if e.sent_finite is False or e.sum_finite is False:
        return ReductionVerdict("data", unplaced, "a recomputed gradient is not finite there: "
                                                  "the data or the model")
    if e.redone is None:
        return ReductionVerdict("unplaced", unplaced, (
            f"every rank's gradient, recomputed, is finite where the reduction gave NaN/Inf, and "
            f"their sum there is finite: the reduction itself went bad (a link, a NIC, a rank's "
            f"reduction arithmetic); the {e.collective} does not say which, so no rank is named"))
    for stage, bad in e.redone:
        if bad:
            where = tuple(sorted(set(bad)))
            return ReductionVerdict("persistent", where, (
                f"the {stage}, done again on the same finite inputs (whose sum is finite), gives "
                f"NaN/Inf again at rank(s) {_ranks(where)}: a fault that stays, made or received "
                f"there (that rank's reduction arithmetic or a link into it); which, the "
                f"{stage} does not say, so no rank is named"))
    if some:
        return ReductionVerdict("transient", tuple(seeing), (
            f"the {e.collective}, done again on the same inputs, is finite: it went bad once; "
            f"only rank(s) {_ranks(seeing)} of the {len(holders)} holding that result held "
            f"NaN/Inf, so it was made where it was seen (after the values met); no rank is "
            f"named"))
    return ReductionVerdict("transient", (), (
        f"the {e.collective}, done again on the same inputs, is finite: it went bad once, on a "
        f"path every rank's values took; nothing names a rank or a node: no rank is named, and "
        f"none is suspected"))
