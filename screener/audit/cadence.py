"""When the periodic checks run, for both auditors: audit steps, weight steps, self-check audits.

Pure functions of the step number and of counts every rank keeps alike, so every rank decides the
same: check 2 on steps where step % audit_every == 0 (when replays are possible), check 3 where
step % weights_every == 0, and the self-check on the first audit and every self_check_every audits
after it. 0 turns the periodic form of a check off.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["Cadence"]


class Cadence:
    """The audit, weight-check and self-check schedule of one auditor."""

    def __init__(self, audit_every: int, weights_every: int, self_check_every: int,
                 can_replay: bool, counters: Counter[str]) -> None:
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

    def is_audit_step(self, step: int) -> bool:
        """Whether check 2 runs at this step."""
        return self.audits_on() and step % self.audit_every == 0

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
