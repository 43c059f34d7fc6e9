"""What the lifecycle needs from a store: the Store and NodeTxn protocols (LocalStore and KubeStore
implement them; see screener.stores).

Stores persist; the lifecycle decides. These protocols are the seam between them, kept on the
lifecycle's side so that deciding code never imports a store.
"""

from __future__ import annotations

from typing import Any, ContextManager, Mapping, Optional, Protocol, Sequence, runtime_checkable

from screener.lifecycle.records import Transition
from screener.types import NodeState

__all__ = ["NodeTxn", "Store"]


@runtime_checkable
class Store(Protocol):
    """Where node states, their history and the last verdicts live (LocalStore, KubeStore).

    Times are unix seconds. Nodes never seen have no state (None), not a default one: the
    lifecycle decides that a new node starts in burnin.
    """

    def get_state(self, node: str) -> Optional[NodeState]:
        """The node's current state, or None if the store has never seen it."""
        ...

    def record(self, transition: Transition) -> None:
        """Write the transition and the node's new state together (all or nothing).

        Recording the same transition twice (same id) is a no-op. Raises StaleTransition when
        from_state is not the stored state (someone changed the node since the caller read it).

        A store that cannot write now (an unreachable API) keeps the transition and writes it
        later, in order; it raises only when it could neither write nor keep it.
        """
        ...

    def history(self, node: str, since: Optional[float] = None) -> list[Transition]:
        """The node's transitions, oldest first; only those at or after `since` if given."""
        ...

    def all_states(self) -> dict[str, NodeState]:
        """Every known node and its current state."""
        ...

    def failures(self, since: float) -> list[Transition]:
        """Transitions with failure=True at or after `since`, on every node, oldest first.

        The lemon rule counts these per node and per GPU serial.
        """
        ...

    def set_verdict(self, node: str, verdict: Mapping[str, Any]) -> None:
        """Remember the node's last known-answer verdict (plain JSON-able data)."""
        ...

    def get_verdict(self, node: str) -> Optional[dict[str, Any]]:
        """The node's last recorded verdict, or None."""
        ...

    def close(self) -> None:
        """Release connections and files."""
        ...

    def one_pass(self) -> ContextManager[None]:
        """One pass of the daemon: within it the store may answer a read from what the pass has
        read or written already, as long as every write stays conditional on what it was decided
        on (a failed write makes the next read fresh)."""
        ...

    def begin(self, node: str) -> ContextManager["NodeTxn"]:
        """Open one atomic read-decide-write of `node` (see NodeTxn); apply_event uses it."""
        ...

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        """Failures at or after `since` that blame one of `serials`, without reading the fleet."""
        ...

    def summaries(self) -> list[dict[str, Any]]:
        """node, state, since, reason, actor of every known node, from one (paginated) read."""
        ...


@runtime_checkable
class NodeTxn(Protocol):
    """One read-decide-write of one node, atomic with the fleet's quarantine budget.

    Opened by a store's `begin(node)` (a context manager). It holds what the lifecycle needs,
    read at the start: the node's state and history, and the fleet's counts for the budget, read
    from one small record (never by listing the fleet). `commit` records the transitions; a
    transition that takes the node out of service automatically also claims a budget slot, and
    fails with BudgetConflict (SQLite: cannot happen, the transaction holds the write lock) when
    the counts changed since they were read, so the caller decides again.
    """

    state: Optional[NodeState]
    history: list[Transition]
    fleet_total: int  # nodes in the fleet, this node included
    out_of_service: int  # *other* nodes quarantined or in repair

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        """Failure transitions at or after `since` on any node that blame one of `serials`."""
        ...

    def commit(self, transitions: Sequence[Transition]) -> None:
        """Record the transitions in order, claiming or releasing budget slots as they require."""
        ...
