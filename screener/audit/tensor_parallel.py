"""Tensor parallel under FSDP2: which ranks must replay together, and with whom.

A tensor-parallel (TP) group splits every layer between its ranks: their forward and backward are
one computation, joined by the group's collectives, on one micro-batch. A replay of one rank's
step alone is meaningless (its TP partners are not there); a TP group replays another TP group's
micro-batch in lockstep, each rank the partner at its own TP coordinate, and its reduce-scatter
inputs (the gradient of its own TP shard) are compared with the owner's at the same coordinate.
The data-parallel dimension is where micro-batches differ, so replays move along it only.

On a (dp, tp) device mesh, TP group d is row d of the mesh (the ranks at dp index d) and a rank's
TP coordinate is its column. The ring's replay plan pairs ranks node by node, a rank with the rank
at its own place on another node (ring.py): that maps TP groups onto TP groups, coordinate by
coordinate, when every node holds whole TP groups in mesh order (tp inside a node, the usual
layout). `TPGroups.check` says whether it does; the auditor refuses a layout where it does not.
Every lockstep round that replays some owners (the referee, the confirmation of a NaN, the
sentinel's rerun) takes their TP partners along (`close`): a partner replayed only so the group
computes together is not judged.

Pure: rank numbers in, rank numbers out.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Sequence

__all__ = ["TPGroups"]


class TPGroups:
    """The TP groups of a (dp, tp) mesh: rows of global ranks, index = TP coordinate."""

    def __init__(self, rows: Sequence[Sequence[int]]) -> None:
        self.rows = [tuple(int(r) for r in row) for row in rows]
        self._where = {r: (d, t) for d, row in enumerate(self.rows) for t, r in enumerate(row)}

    def group_of(self, rank: int) -> tuple[int, ...]:
        return self.rows[self._where[rank][0]]

    def coord(self, rank: int) -> int:
        return self._where[rank][1]

    def partner(self, rank: int, like: int) -> int:
        """The rank of `rank`'s TP group at `like`'s TP coordinate."""
        return self.group_of(rank)[self.coord(like)]

    def maps_groups(self, assign: Mapping[int, Optional[int]]) -> bool:
        """Whether an owner -> replayer map sends every TP group onto one TP group, coordinate
        by coordinate (None: not replayed; then for the whole group)."""
        for row in self.rows:
            targets = [assign.get(r) for r in row]
            if all(t is None for t in targets):
                continue
            if any(t is None for t in targets):
                return False
            first = targets[0]
            assert first is not None
            if self.group_of(first) == row:
                return False  # a group replaying itself is no second opinion
            if any(t != self.partner(first, r) for t, r in zip(targets, row)):
                return False
        return True

    def check(self, plan: Mapping[int, Optional[int]],
              referee_of: Callable[[int, Optional[int]], Optional[int]]) -> Optional[str]:
        """Why the ring's plan (and its referees) cannot replay TP groups in lockstep, or None."""
        if not self.maps_groups(plan):
            return ("the ring replay pairs ranks node by node, which here does not map each "
                    "tensor-parallel group onto another one coordinate by coordinate: lay the "
                    "mesh out so that every node holds whole TP groups in mesh order (tp inside "
                    "a node, dp across nodes)")
        referees = {o: referee_of(o, r) for o, r in plan.items()}
        if not self.maps_groups(referees):
            return ("the referees of the ring replay do not map each tensor-parallel group "
                    "onto another one: lay the mesh out so that every node holds whole TP "
                    "groups in mesh order")
        return None

    def close(self, owners: Iterable[int]) -> list[int]:
        """The owners with their TP partners, in rank order."""
        return sorted({m for o in owners for m in self.group_of(o)})

    def spread(self, owner: int, helper: int) -> dict[int, int]:
        """A helper chosen for `owner`, taken to its whole TP group: each of owner's partners
        is helped by the helper's partner at the same coordinate."""
        return {m: self.partner(helper, m) for m in self.group_of(owner)}
