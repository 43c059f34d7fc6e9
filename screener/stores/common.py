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


def summary_row(node: str, state: NodeState, last: Optional[Mapping[str, Any]],
                verdict: Any = None) -> dict[str, Any]:
    """One row of `screener node status` for the fleet: node, state, since, reason, actor, and
    `last_screen`, the few fields of the node's last verdict a person scans a fleet for (its
    screen, kind, outcome, time and what a partial burn-in missed), or None."""
    last = last or {}
    return {"node": node, "state": state.value, "since": last.get("time"),
            "reason": str(last.get("reason") or ""), "actor": str(last.get("actor") or ""),
            "last_screen": last_screen(verdict)}


def last_screen(verdict: Any) -> Optional[dict[str, Any]]:
    """The fleet view's part of a stored verdict (what anyone who may edit a Node may have
    written: only plain fields of the expected types are kept, each bounded)."""
    if not isinstance(verdict, Mapping):
        return None
    out: dict[str, Any] = {}
    for key in ("screen", "kind", "outcome"):
        if isinstance(verdict.get(key), str):
            out[key] = verdict[key][:32]
    if isinstance(verdict.get("time"), (int, float)) and not isinstance(verdict["time"], bool):
        out["time"] = float(verdict["time"])
    missing = verdict.get("missing")
    if isinstance(missing, list):
        out["missing"] = [str(m)[:200] for m in missing[:8]]
    return out or None
