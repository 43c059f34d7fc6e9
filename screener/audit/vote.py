"""Majority vote over replicas: which copies differ from a strict majority of identical copies.

In data parallelism every replica applies the same averaged gradient, so after the optimizer step all
replicas must hold the same weights bit for bit. A replica whose weight fingerprints differ from a
strict majority (more than half of all replicas) is named; without a strict majority nobody is named
and the vote is unsettled (two copies that differ cannot say which one is wrong).

Pure: takes one row per replica (anything comparable with torch.equal) and returns plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["VoteResult", "vote"]


@dataclass(frozen=True)
class VoteResult:
    """groups: indices of identical replicas, largest first (ties: lowest index first)."""

    groups: tuple[tuple[int, ...], ...]
    majority: tuple[int, ...]  # the strict-majority group, () if there is none
    outliers: tuple[int, ...]  # replicas that differ from the strict majority

    @property
    def agree(self) -> bool:
        return len(self.groups) <= 1

    @property
    def settled(self) -> bool:
        return bool(self.majority)


def vote(rows: Sequence[torch.Tensor]) -> VoteResult:
    """Group identical rows and find the strict majority, if any."""
    groups: list[list[int]] = []
    for i, row in enumerate(rows):
        for g in groups:
            if torch.equal(rows[g[0]], row):
                g.append(i)
                break
        else:
            groups.append([i])
    groups.sort(key=lambda g: (-len(g), g[0]))
    n = len(rows)
    majority = tuple(groups[0]) if groups and 2 * len(groups[0]) > n else ()
    outliers = tuple(sorted(i for g in groups[1:] for i in g)) if majority else ()
    return VoteResult(groups=tuple(tuple(g) for g in groups), majority=majority, outliers=outliers)
