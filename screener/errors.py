"""The ScreenerError tree: failures of the screener itself or of its input, each with its exit code.

A bad node is a verdict (screener.types.Verdict, Finding), never an exception. An exception here
means the screener could not do its job, and its exit code says whose fault that is: 2 for bad input
or usage, 1 for our own failure. None of them may ever be reported as a hardware verdict.

Vocabulary: of ours it imports only screener.types (the exit codes).
"""

from __future__ import annotations

from screener.types import ExitCode


class ScreenerError(Exception):
    """The screener itself failed (a bug, an unreachable dependency, an environment problem)."""

    exit_code: ExitCode = ExitCode.SCREENER_ERROR


class BadInputError(ScreenerError):
    """A file, value or option given to us is wrong; the message names it and says what is wrong."""

    exit_code = ExitCode.USAGE


class GoldenError(BadInputError):
    """A golden record is missing a field, truncated, tampered with, or for another job/platform."""


class ConfigError(BadInputError):
    """Configuration (a job spec, a config file, an environment variable) is invalid."""


class TransitionRefused(BadInputError):
    """The lifecycle's transition table does not allow the requested state change."""


class ExternalServiceError(ScreenerError):
    """A service we depend on (Kubernetes API, SageMaker, Prometheus, NVML) failed or refused."""


class NondeterminismError(ScreenerError):
    """A known-answer job gave different bits on every device: a screener bug, not a hardware fault."""
