"""What every store shares: the disk-full error and the fleet summary row.

The Store protocol a store implements lives with the lifecycle (screener.lifecycle.ports), and so
do the Transition records a store persists (screener.lifecycle.records): stores only persist.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from screener.errors import ScreenerError
from screener.types import NodeState


class DiskFullError(ScreenerError):
    """The disk holding a store's file is full: the screener's environment failed, never a verdict.

    The message names the file and the filesystem (mount point, bytes free); the write can be
    retried once space is freed.
    """


def summary_row(node: str, state: NodeState, last: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """One row of `screener node status` for the fleet: node, state, since, reason, actor."""
    last = last or {}
    return {"node": node, "state": state.value, "since": last.get("time"),
            "reason": str(last.get("reason") or ""), "actor": str(last.get("actor") or "")}
