"""How an auditor is configured: how often each check runs, and where its alarms go.

One frozen dataclass for both auditors (DDP and FSDP2/HSDP), validated at construction: a value
that is not a non-negative integer (accumulation_steps: positive) is refused with one line
(AuditUsageError, exit 2), the same way whichever auditor the model gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from screener.audit.alarms import AuditUsageError

__all__ = ["AuditConfig"]


@dataclass(frozen=True)
class AuditConfig:
    """How often the periodic checks run; 0 turns the periodic form of a check off."""

    audit_every: int = 50
    weights_every: int = 100
    check_reduced: bool = True  # check 1's second half: the reduced gradient
    confirm_nonfinite: bool = True  # replay a non-finite rank's micro-batch before naming it
    accumulation_steps: int = 1  # micro-batches per step (no_sync gradient accumulation)
    self_check_every: int = 20  # audits between self-checks (the first audit always); 0: never
    job: str = ""
    alarm_dir: Optional[str] = None  # None: $SCREENER_ALARM_DIR, else the default

    def __post_init__(self) -> None:
        v = self.accumulation_steps
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise AuditUsageError(f"screener.audit: accumulation_steps must be an integer >= 1, "
                                  f"not {v!r}")
        for name in ("audit_every", "weights_every", "self_check_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise AuditUsageError(f"screener.audit: {name} must be an integer >= 0, not "
                                      f"{v!r}")
