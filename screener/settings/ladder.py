"""The [ladder] settings: the repair ladder for quarantined nodes (screener.remediation.ladder)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from screener.errors import ConfigError
from screener.settings import strict as configs


@dataclass(frozen=True)
class LadderConfig:
    """How the daemon tries to heal an idle quarantined node, cheapest rung first.

    enabled: off by default (a quarantine then waits for remediation or a person, as before).
    dry_run: say what each rung would do (pass report, log) and do nothing.
    nvidia_smi, dcgmi: the tools, looked up on PATH (dcgmi is optional).
    dcgm_level: `dcgmi diag -r LEVEL` on the first idle pass after entry to quarantine, its result
        recorded as corroboration (0: never).
    max_rungs, window_days: the budget, at most this many rungs taken on one node in the window
        (counted from the node's own history); past it the node waits for a person.
    min_interval_s: the rate limit, a node tries a rung at most this often (a failed attempt
        included), so a reset that keeps failing is not retried on every tick.
    """

    enabled: bool = False
    dry_run: bool = False
    nvidia_smi: str = "nvidia-smi"
    dcgmi: str = "dcgmi"
    dcgm_level: int = 2
    max_rungs: int = 2
    window_days: float = 30.0
    min_interval_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("enabled", "dry_run"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ladder {name} must be true or false")
        for name in ("nvidia_smi", "dcgmi"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v or "\x00" in v:
                raise ConfigError(f"ladder {name} must be a command name or path")
        configs.require_number("ladder", "dcgm_level", self.dcgm_level, 0, 4, integer=True)
        configs.require_number("ladder", "max_rungs", self.max_rungs, 0, 100, integer=True)
        configs.require_number("ladder", "window_days", self.window_days, 0.0, 3650.0,
                               low_open=True, unit="days")
        configs.require_number("ladder", "min_interval_s", self.min_interval_s, 0.0, 30 * 86400.0,
                               unit="seconds")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "LadderConfig":
        """Build from a config table; unknown keys are an error."""
        return configs.from_mapping(cls, d, "ladder")
