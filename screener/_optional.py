"""Optional vendor clients: import one, or say in one line which extra installs it.

The core install (torch, click, numpy, psutil, nvidia-ml-py) runs everything that screens a node;
the cluster-side clients are extras (pyproject.toml). Each vendor client has exactly one importer
in screener, and that importer calls `require` first, so a command that needs a missing client
ends with exit 1 and one line such as

    screener: the Kubernetes store needs the kubernetes package: pip install 'screener[kube]'

instead of a traceback. Exit 1, not 2: the command line was fine, this installation cannot run it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from screener.errors import ScreenerError

# import name -> (distribution, extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "kubernetes": ("kubernetes", "kube"),
    "prometheus_client": ("prometheus-client", "metrics"),
    "boto3": ("boto3", "hyperpod"),
    "botocore": ("boto3", "hyperpod"),
    "safetensors": ("safetensors", "safetensors"),
    "grpc": ("grpcio", "nvrx"),
}


class MissingExtra(ScreenerError, ImportError):
    """An optional client is not installed. Also an ImportError, so `except ImportError` holds."""

    def __init__(self, module: str, purpose: str) -> None:
        dist, extra = EXTRAS[module]
        self.module, self.extra = module, extra
        super().__init__(f"{purpose} needs the {dist} package: pip install 'screener[{extra}]'")


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` (a key of EXTRAS) or raise MissingExtra naming `purpose` and the extra."""
    if module not in EXTRAS:
        raise ValueError(f"{module!r} is not an optional dependency of screener")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module:
            raise  # the client is there but one of its own dependencies is broken: show that
        raise MissingExtra(module, purpose) from None
