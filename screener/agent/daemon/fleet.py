"""The daemon's half of the fleet quorum: what a screen is told of the fleet, and what it tells it.

Where a platform has no golden, a screen is judged against a quorum of other nodes of the platform
(screener.known_answer.verdict.quorum). Around each screen the daemon:

- before: reads the promoted goldens (one small list: one object per platform), and the other
  nodes' candidates when they can matter: for a full burn-in, and for a screen after one that
  found its platform waiting. The candidates cost one paginated list of Node metadata, which at
  10,000 nodes is not a read for every quick screen of every node;
- asks a screen that follows a waiting one to repeat its jobs (two runs at least): only a result
  a device reproduced counts towards a quorum, and a quick screen runs each job once;
- after: publishes the results the node's devices reproduced (its candidates), stores the goldens
  the screen promoted (add-only: a conflict is logged, the stored record stays), and sets the
  per-platform gauge `screener_awaiting_quorum`.

The store is the one the daemon runs on (KubeStore or LocalStore: nodes sharing one database).
A failure to read or write the fleet is logged and counted, never a verdict: the screen then
runs without a fleet view and is judged as before (a golden, or inconclusive).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

from screener.agent.metrics import DaemonMetrics
from screener import boundedjson
from screener.errors import ScreenerError
from screener.known_answer.engine.golden import MAX_GOLDEN_BYTES
from screener.known_answer.verdict.quorum import DEFAULT_NEED, FleetView, awaiting, candidates_of

log = logging.getLogger("screener.daemon")

QUORUM_REPEAT = 2  # runs of each job in a screen that may add to a quorum
REASON_AWAITING = "AwaitingQuorum"  # the node condition's reason while the platform waits
REASON_SETTLED = "QuorumSettled"


@runtime_checkable
class QuorumStore(Protocol):
    """What a store offers the fleet quorum (KubeStore, LocalStore)."""

    def publish_candidates(self, node: str,
                           candidates: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None: ...

    def fleet_candidates(self) -> dict[str, dict[str, dict[str, dict[str, Any]]]]: ...

    def promote_golden(self, phash: str, job: str, text: str) -> Optional[str]: ...

    def promoted_goldens(self) -> dict[str, dict[str, str]]: ...


class FleetQuorum:
    """Around each screen of one node (see the module docstring). need: the quorum's size."""

    def __init__(self, store: Any, node: str, metrics: DaemonMetrics, *,
                 need: int = DEFAULT_NEED) -> None:
        self.store: Optional[QuorumStore] = store if isinstance(store, QuorumStore) else None
        self.node = node
        self.metrics = metrics
        self.need = need
        self.waiting: dict[str, int] = {}  # what the last screen found waiting

    def restore(self, last_verdict: Mapping[str, Any]) -> None:
        """At start-up: whether the node's last screen (its stored verdict) was waiting."""
        if self.store is not None:
            self.waiting = awaiting(last_verdict)

    def view(self, *, full: bool) -> Optional[dict[str, Any]]:
        """The fleet view for the screen worker (FleetView.to_dict()), None without a store
        that keeps one or when it cannot be read."""
        if self.store is None:
            return None
        try:
            promoted = self.store.promoted_goldens()
            candidates = self.store.fleet_candidates() if full or self.waiting else {}
        except (ScreenerError, OSError) as e:
            log.warning("cannot read the fleet's results for the quorum: %s", e)
            self.metrics.errors.labels(self.node, "fleet_quorum").inc()
            return None
        return FleetView(self.node, self.need, candidates, promoted).to_dict()

    def repeat(self) -> Optional[int]:
        """Runs per job the next screen needs so that its results count towards a quorum."""
        return QUORUM_REPEAT if self.waiting else None

    def after(self, screen: Mapping[str, Any],
              promote: Mapping[str, Mapping[str, str]]) -> None:
        """After a screen that ran to its end (its JSON form: verdicts with their evidence)."""
        was = self.waiting
        self.waiting = awaiting(screen)
        self.metrics.set_awaiting(self.waiting)
        self._condition(was)
        if self.waiting:
            log.info("platform(s) waiting for a fleet quorum: %s",
                     ", ".join(f"{p} ({n} job(s))" for p, n in sorted(self.waiting.items())),
                     extra={"event": "awaiting_quorum", "platforms": sorted(self.waiting)})
        if self.store is None:
            return
        try:
            candidates = candidates_of(screen)
            if candidates:
                self.store.publish_candidates(self.node, candidates)
            for phash, jobs in promote.items():
                for job, text in jobs.items():
                    result = _stored(self.store.promote_golden(phash, job, text), text)
                    self.metrics.promotions.labels(self.node, result).inc()
                    if result == "kept":
                        log.warning("golden %s of platform %s: the fleet already promoted "
                                    "another record; it is kept (this node's result agreed "
                                    "with the quorum but not with that record)", job, phash,
                                    extra={"event": "promotion_conflict"})
                    elif result == "stored":
                        log.info("promoted the fleet quorum's result of %s on platform %s to "
                                 "its golden", job, phash, extra={"event": "golden_promoted"})
        except (ScreenerError, OSError, ValueError) as e:
            log.warning("cannot publish this screen's results to the fleet: %s", e)
            self.metrics.errors.labels(self.node, "fleet_quorum").inc()

    def _condition(self, was: Mapping[str, int]) -> None:
        """The node condition's reason while its platform waits (kube: what `kubectl describe
        node` shows), and once it no longer does; the state itself does not move."""
        note = getattr(self.store, "note_condition", None)
        if note is None or (not self.waiting and not was):
            return
        try:
            if self.waiting:
                note(self.node, REASON_AWAITING, "the known-answer screen waits for a fleet "
                     "quorum: no golden for platform(s) " + ", ".join(sorted(self.waiting))
                     + ", and too few other nodes of it agree yet")
            else:
                note(self.node, REASON_SETTLED, "the platform's known-answer reference is "
                     "settled (a golden or a fleet quorum)", only_if=REASON_AWAITING)
        except (ScreenerError, OSError) as e:
            log.warning("cannot set the node condition's reason: %s", e)


def _stored(there: Optional[str], ours: str) -> str:
    """What became of a promotion: "stored", "same" (a record with the same bits is there:
    another node of the quorum promoted first) or "kept" (one with other bits is there)."""
    if there is None:
        return "stored"
    return "same" if _digest(there) == _digest(ours) is not None else "kept"


def _digest(text: str) -> Optional[str]:
    try:
        d = boundedjson.loads(text, max_bytes=MAX_GOLDEN_BYTES, max_depth=8)
    except ValueError:
        return None
    digest = d.get("digest") if isinstance(d, dict) else None
    return digest if isinstance(digest, str) else None
