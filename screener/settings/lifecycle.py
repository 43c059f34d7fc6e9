"""The [lifecycle] settings: the lemon rule and the quarantine budget (screener.lifecycle.machine)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from screener.settings import strict


@dataclass(frozen=True)
class LifecyclePolicy:
    """Lemon rule and quarantine budget. Build from config with from_mapping (unknown keys fail)."""

    lemon_window_days: float = 30.0
    lemon_min_failures: int = 3
    quarantine_budget: float = 0.10  # share of the fleet that automatic quarantines may take
    min_budget_nodes: int = 1  # the budget is never below this many nodes

    def __post_init__(self) -> None:
        # Both sides bounded, and a bool is no number: `quarantine_budget = true` was 100%.
        strict.require_number("lifecycle", "lemon_window_days", self.lemon_window_days, 0.0,
                               3650.0, low_open=True, unit="days")
        strict.require_number("lifecycle", "lemon_min_failures", self.lemon_min_failures, 1,
                               1000, integer=True)
        strict.require_number("lifecycle", "quarantine_budget", self.quarantine_budget, 0.0, 1.0,
                               unit="a share of the fleet")
        strict.require_number("lifecycle", "min_budget_nodes", self.min_budget_nodes, 0,
                               1_000_000, integer=True)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "LifecyclePolicy":
        return strict.from_mapping(cls, d, "lifecycle")

    @property
    def window_seconds(self) -> float:
        return self.lemon_window_days * 86400.0

    def budget_limit(self, fleet_size: int) -> int:
        """How many nodes automatic decisions may hold out of service at once."""
        # The epsilon keeps 0.1 * 30 from flooring to 2 through float error.
        return max(self.min_budget_nodes, math.floor(self.quarantine_budget * fleet_size + 1e-9))


DEFAULT_POLICY = LifecyclePolicy()
