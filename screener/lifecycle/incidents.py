"""Time between incidents per node (MTBI, as NVSentinel names it): a lemon is visible before the
lemon rule trips.

An incident is a failure transition (the ones the lemon rule counts: Transition.failure). A
node's MTBI over a window is the mean gap between its consecutive incidents in it, (last - first)
/ (n - 1) for n >= 2 incidents; with fewer there is no gap to measure (None). Pure: plain
transitions in, numbers out.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional


def mtbi_seconds(times: Iterable[float]) -> Optional[float]:
    """The mean gap between consecutive incident times, or None with fewer than two."""
    ordered = sorted(float(t) for t in times)
    if len(ordered) < 2:
        return None
    return (ordered[-1] - ordered[0]) / (len(ordered) - 1)


def mtbi_by_node(failures: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """node -> {"incidents": n, "mtbi_s": seconds or None, "last": time} from failure
    transitions (Store.failures(since): one read for the whole fleet)."""
    times: dict[str, list[float]] = {}
    for t in failures:
        times.setdefault(t.node, []).append(float(t.time))
    return {node: {"incidents": len(ts), "mtbi_s": mtbi_seconds(ts), "last": max(ts)}
            for node, ts in times.items()}


def format_mtbi(seconds: Optional[float]) -> str:
    """'-' when unknown, else days or hours, for a table column."""
    if seconds is None:
        return "-"
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    return f"{seconds / 3600:.1f} h"
