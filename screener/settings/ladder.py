"""The [ladder] settings: the repair ladder for quarantined nodes (screener.remediation.ladder)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from screener.errors import ConfigError
from screener.settings import strict


REBOOT_METHODS = ("off", "hyperpod", "command")
FINAL_RUNGS = ("none", "repair", "replace")


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
    reboot: rung 2, taken when a reset did not heal the node: "off" (the node waits for a
        person), "hyperpod" (SageMaker BatchRebootClusterNodes for the node's instance; needs
        [hyperpod] cluster) or "command" (reboot_command, run on the node).
    reboot_command: the argv of the "command" reboot, e.g. ["systemctl", "reboot"] in a pod
        with the host's PID namespace; it must return once the reboot is under way.
    max_rebooting: at most this many nodes of the fleet rebooting at once (slots claimed in the
        store before a reboot is asked for, freed when the node is back).
    reboot_timeout_s: a node not back (booted after its request) within this is taken as not
        rebooted: its slot is freed (another node may then take it) and a person decides.
    final: when a reset and the reboot did not heal the node: "none" (it stays quarantined for
        a person), "repair" (out of service, the request_repair action: a ticket), or "replace"
        (repair, and HyperPod BatchReplaceClusterNodes for its instance; needs [hyperpod]).
    """

    enabled: bool = False
    dry_run: bool = False
    nvidia_smi: str = "nvidia-smi"
    dcgmi: str = "dcgmi"
    dcgm_level: int = 2
    max_rungs: int = 2
    window_days: float = 30.0
    min_interval_s: float = 600.0
    reboot: str = "off"
    reboot_command: tuple[str, ...] = ()
    max_rebooting: int = 1
    reboot_timeout_s: float = 3600.0
    final: str = "none"

    def __post_init__(self) -> None:
        for name in ("enabled", "dry_run"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ladder {name} must be true or false")
        for name in ("nvidia_smi", "dcgmi"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v or "\x00" in v:
                raise ConfigError(f"ladder {name} must be a command name or path")
        strict.require_number("ladder", "dcgm_level", self.dcgm_level, 0, 4, integer=True)
        strict.require_number("ladder", "max_rungs", self.max_rungs, 0, 100, integer=True)
        strict.require_number("ladder", "window_days", self.window_days, 0.0, 3650.0,
                               low_open=True, unit="days")
        strict.require_number("ladder", "min_interval_s", self.min_interval_s, 0.0, 30 * 86400.0,
                               unit="seconds")
        if self.reboot not in REBOOT_METHODS:
            raise ConfigError(f"ladder reboot must be one of {', '.join(REBOOT_METHODS)}, "
                              f"not {self.reboot!r}")
        if self.final not in FINAL_RUNGS:
            raise ConfigError(f"ladder final must be one of {', '.join(FINAL_RUNGS)}, "
                              f"not {self.final!r}")
        argv = self.reboot_command
        if isinstance(argv, str) or not isinstance(argv, (list, tuple)) or not all(
                isinstance(a, str) and a and "\x00" not in a for a in argv):
            raise ConfigError("ladder reboot_command must be a list of arguments, e.g. "
                              '["systemctl", "reboot"]')
        object.__setattr__(self, "reboot_command", tuple(argv))
        if self.reboot == "command" and not argv:
            raise ConfigError('ladder reboot = "command" needs reboot_command')
        strict.require_number("ladder", "max_rebooting", self.max_rebooting, 1, 100_000,
                               integer=True)
        strict.require_number("ladder", "reboot_timeout_s", self.reboot_timeout_s, 60.0,
                               7 * 86400.0, unit="seconds")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "LadderConfig":
        """Build from a config table; unknown keys are an error."""
        return strict.from_mapping(cls, d, "ladder")
