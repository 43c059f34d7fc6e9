"""When the periodic checks run, for both auditors: audit steps, weight steps, self-check audits.

Pure functions of the step number and of counts every rank keeps alike, so every rank decides the
same: check 2 on steps where step % audit_every == 0 (when replays are possible), check 3 where
step % weights_every == 0, and the self-check on the first audit and every self_check_every audits
after it. 0 turns the periodic form of a check off.

The first `guard` steps after the auditor starts (from the first step it is called for: a fresh
job and every restart from a checkpoint) are all audit steps while audits are on: the
spike sentinel judges a step only against a baseline of earlier ones, so until it has `warmup`
of them a fault between audits would go unseen and surface later as numbers no hardware
explains (issue 34.6). The guard is the sentinel's warm-up; it costs that many audit steps per
start.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

__all__ = ["Cadence"]


class Cadence:
    """The audit, weight-check and self-check schedule of one auditor."""

    def __init__(self, audit_every: int, weights_every: int, self_check_every: int,
                 can_replay: bool, counters: Counter[str], *, guard: int = 0) -> None:
        self.guard = guard
        # the first step of this start: the first check_gradients' (every rank calls it at the
        # same steps, protocol.py), never a rank's own start_step, so every rank counts alike
        self.first: Optional[int] = None
        self.audit_every = audit_every
        self.weights_every = weights_every
        self.self_check_every = self_check_every
        self.can_replay = can_replay
        self.counters = counters
        self.self_check_due = bool(self_check_every)
        self.audits_since_self_check = 0

    def audits_on(self) -> bool:
        """Whether check 2 runs at all."""
        return bool(self.audit_every) and self.can_replay

    def begin(self, step: int) -> None:
        """check_gradients(step) started: the first one fixes where the guard counts from."""
        if self.first is None:
            self.first = step

    def guarded(self, step: int) -> bool:
        """Whether the step is among the first `guard` of this start (before the first
        check_gradients, the step asked about is the first)."""
        return bool(self.guard) and (self.first is None or 0 <= step - self.first < self.guard)

    def is_audit_step(self, step: int) -> bool:
        """Whether check 2 runs at this step."""
        return self.audits_on() and (step % self.audit_every == 0 or self.guarded(step))

    def is_weights_step(self, step: int) -> bool:
        """Whether check_weights(step) runs the periodic weight check at this step."""
        return bool(self.weights_every) and step % self.weights_every == 0

    def self_checked(self) -> None:
        """A self-check ran (in this audit): the next is self_check_every audits away."""
        self.self_check_due = False
        self.audits_since_self_check = 0
        self.counters["self_checks"] += 1

    def audit_passed(self) -> None:
        """An audit found nothing: count it, and say when the next self-check is due."""
        self.counters["audits"] += 1
        self.audits_since_self_check += 1
        if self.self_check_every and self.audits_since_self_check >= self.self_check_every:
            self.self_check_due = True
