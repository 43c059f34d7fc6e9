"""What every auditor is, whichever parallelism it audits.

`Auditor(model)` is the one entry point: it returns an `Auditor` for a DDP model, a
`ShardedAuditor` for one sharded with fully_shard (FSDP2, HSDP, with or without tensor parallel)
and a `PipelineAuditor` for a pipeline schedule. The three share this base: the cadence (which
steps audit, which vote), the context manager that closes, and the weight check, so code that
holds "an auditor" can type it as `AuditorBase` and rely on these. `check_gradients` is not here:
its arguments follow what a training step of that kind has (one loss, or a pipeline's losses).
"""

from __future__ import annotations

import abc
from typing import Any, TypeVar

from screener.audit.cadence import Cadence

__all__ = ["AuditorBase"]

_Self = TypeVar("_Self", bound="AuditorBase")


class AuditorBase(abc.ABC):
    """The part of an auditor that is the same for DDP, sharded and pipeline models."""

    cadence: Cadence

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def is_audit_step(self, step: int) -> bool:
        """Whether check 2 (the ring replay) runs at this step."""
        return self.cadence.is_audit_step(step)

    def is_weights_step(self, step: int) -> bool:
        """Whether check_weights(step) does its periodic work at this step (the vote across
        replicas; for a pipeline stage, the record of its shards)."""
        return self.cadence.is_weights_step(step)

    @abc.abstractmethod
    def check_weights(self, step: int, *, force: bool = False) -> None:
        """The weight check after the optimizer step (see each auditor for what it compares)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Remove the hooks this auditor installed; idempotent."""
