"""The [hyperpod] settings and the names of HyperPod's deep health checks, without boto3.

Kept apart from screener.remediation.hyperpod (the one importer of boto3) so that the daemon's config file can
validate its [hyperpod] table at load, whether or not the feature is on and whether or not boto3 is
installed: a misspelt key there is an error at start, not a feature that silently never runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from screener.settings import strict
from screener.errors import BadInputError, ConfigError

DEEP_HEALTH_CHECKS = ("InstanceStress", "InstanceConnectivity", "MultiNodeTrainingValidation")
DEFAULT_CHECKS = ("InstanceStress", "InstanceConnectivity")


def validate_checks(checks: Sequence[str]) -> tuple[str, ...]:
    """The deep health checks to request, deduplicated in order; BadInputError for an unknown one."""
    checks = tuple(checks)
    if not checks:
        raise BadInputError("no deep health check given; choose from " + ", ".join(DEEP_HEALTH_CHECKS))
    bad = [c for c in checks if c not in DEEP_HEALTH_CHECKS]
    if bad:
        raise BadInputError(f"unknown deep health check {bad[0]!r}; expected one of "
                            + ", ".join(DEEP_HEALTH_CHECKS))
    return tuple(dict.fromkeys(checks))


@dataclass(frozen=True)
class HyperPodConfig:
    """HyperPod settings for the daemon and the CLI.

    deep_check_on_quarantine is off by default: when on, the daemon starts a deep health check on a
    node as it enters quarantine. There is deliberately no setting for automatic replacement.
    """

    cluster: str = ""
    region: Optional[str] = None
    endpoint_url: Optional[str] = None
    deep_check_on_quarantine: bool = False
    checks: tuple[str, ...] = DEFAULT_CHECKS
    max_attempts: int = 8  # botocore standard retry mode: total attempts including the first

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, str):
            raise ConfigError("hyperpod cluster must be a string (the HyperPod cluster's name or ARN)")
        for name in ("region", "endpoint_url"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"hyperpod {name} must be a string")
        if not isinstance(self.deep_check_on_quarantine, bool):
            raise ConfigError("hyperpod deep_check_on_quarantine must be true or false")
        # A config file gives a list; keep a tuple so the frozen config stays hashable.
        if isinstance(self.checks, str) or not isinstance(self.checks, Sequence):
            raise ConfigError("hyperpod checks must be a list of deep health check names")
        try:
            object.__setattr__(self, "checks", validate_checks(self.checks))
        except BadInputError as e:
            raise ConfigError(f"hyperpod checks: {e}") from None
        # botocore's standard mode retries with backoff: 100 attempts is hours already.
        strict.require_number("hyperpod", "max_attempts", self.max_attempts, 1, 100, integer=True)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "HyperPodConfig":
        """Build from a config table; unknown keys are an error, not silently dropped."""
        return strict.from_mapping(cls, d, "hyperpod")
