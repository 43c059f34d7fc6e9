"""The [dra] settings: per-GPU taints where the cluster allocates GPUs through DRA
(screener.agent.daemon.device_taints, screener.stores.kube.devices)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from screener.errors import ConfigError
from screener.settings import strict

# The admission policy (manifests/admission-policy.yaml, screener-device-taints) admits only taint
# keys under this prefix: a daemon pod must not write a key another controller acts on.
TAINT_KEY_PREFIX = "screener.io/"
DEFAULT_DRIVER = "gpu.nvidia.com"  # the NVIDIA DRA driver's name (its ResourceSlices' spec.driver)
DEFAULT_TAINT_KEY = "screener.io/gpu-suspect"

# A DNS subdomain (a DRA driver's name, as ResourceSlice validation requires it) and the name part
# of a label key (a taint key must be a label name).
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class DraConfig:
    """Whether and how a GPU found bad is taken out of service alone, through DRA.

    enabled: off by default. On, with the kube store on a cluster whose GPUs are published as
        DRA ResourceSlices (Kubernetes 1.37's resource.k8s.io/v1 DeviceTaintRule), a GPU that a
        known-answer screen finds suspect (or that a settled in-job alarm names by serial) gets a
        DeviceTaintRule with effect NoSchedule for exactly that device, removed only by a passing
        known-answer retest of it. The node's own state follows the lifecycle as ever.
    driver: the DRA driver whose devices are tainted (its ResourceSlices' spec.driver).
    taint_key: the device taint's key; under screener.io/ (what the admission policy admits).
    """

    enabled: bool = False
    driver: str = DEFAULT_DRIVER
    taint_key: str = DEFAULT_TAINT_KEY

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("dra enabled must be true or false")
        if not isinstance(self.driver, str) or len(self.driver) > 253 \
                or not _SUBDOMAIN.fullmatch(self.driver):
            raise ConfigError(f"dra driver must be a DRA driver name (a DNS subdomain, e.g. "
                              f"{DEFAULT_DRIVER}), not {self.driver!r}")
        key = self.taint_key
        name = key[len(TAINT_KEY_PREFIX):] if isinstance(key, str) else ""
        if not isinstance(key, str) or not key.startswith(TAINT_KEY_PREFIX) \
                or len(name) > 63 or not _LABEL_NAME.fullmatch(name):
            raise ConfigError(f"dra taint_key must be a label name under {TAINT_KEY_PREFIX} "
                              f"(e.g. {DEFAULT_TAINT_KEY}), not {key!r}")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "DraConfig":
        """Build from a config table; unknown keys are an error."""
        return strict.from_mapping(cls, d, "dra")
