"""Fleet-wide slots for a disruptive repair: at most N nodes hold one at once (the reboot rung).

The repair ladder (screener.remediation.ladder) claims a slot before it asks for a node's reboot
and frees it when the node is back, so however many nodes fail at once, no more than N reboot
together. A slot is one record per index, claimed by an atomic create (a taken index is refused),
so claimers on many nodes race without a queue on one object, and a claim cannot exceed N.

A claim holds its time: one older than the pool's `ttl` belongs to a node that never came back
(or a daemon that died between its claim and its release) and may be taken over by the next
claimer, so a lost node does not hold a slot forever.

Two homes, as for the node states (each store hands out its own: `store.slots(...)`): the state
database (SQLite, a table of its own, one transaction per claim) and ConfigMaps
`screener-<pool>-slot-<k>` in the screener namespace on Kubernetes, the places of the fleet
semaphore the quarantine budget's slots use too (stores/kube/semaphore.py: claim by create,
release by uid-preconditioned delete, one place per node); the ttl takeover is this pool's rule.
"""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from screener.stores.kube import formats as kf
from screener.stores.kube.calls import ApiCaller
from screener.stores.kube.semaphore import Semaphore

LABEL_POOL = "screener.io/slot-pool"
_POOL_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")


@dataclass(frozen=True)
class SlotClaim:
    """A node's slot: its index and when it was claimed (unix seconds)."""

    index: int
    node: str
    since: float


def _check(pool: str, capacity: int, ttl: float) -> None:
    if not _POOL_NAME.fullmatch(pool):
        raise ValueError(f"slot pool name {pool!r}: lowercase letters, digits and dashes")
    if capacity < 1 or ttl <= 0:
        raise ValueError(f"slot pool {pool}: capacity must be >= 1 and ttl > 0")


class SqliteSlots:
    """Slots in the state database (the local store's file), one row per claimed index.

    Each claim is one BEGIN IMMEDIATE transaction: the write lock is taken before the free slots
    are read, so daemons sharing the file cannot both take the last one.
    """

    def __init__(self, path: str, pool: str, capacity: int, *, ttl: float,
                 clock: Callable[[], float], timeout: float = 10.0) -> None:
        _check(pool, capacity, ttl)
        self.pool, self.capacity, self.ttl, self.clock = pool, capacity, ttl, clock
        self._db = sqlite3.connect(path, timeout=timeout, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS slots (pool TEXT NOT NULL, idx INTEGER "
                         "NOT NULL, node TEXT NOT NULL, since REAL NOT NULL, "
                         "PRIMARY KEY (pool, idx))")

    def claim(self, node: str) -> Optional[SlotClaim]:
        """The node's slot (the one it holds, or a free one, or one past its ttl); None when all
        are taken."""
        now = self.clock()
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            rows = db.execute("SELECT idx, node, since FROM slots WHERE pool = ?",
                              (self.pool,)).fetchall()
            for idx, holder, since in rows:
                if holder == node:
                    db.execute("COMMIT")
                    return SlotClaim(int(idx), node, float(since))
            taken = {int(idx) for idx, _, since in rows if now - float(since) < self.ttl}
            free = [k for k in range(self.capacity) if k not in taken]
            if not free:
                db.execute("COMMIT")
                return None
            k = free[0]
            db.execute("INSERT OR REPLACE INTO slots (pool, idx, node, since) VALUES (?,?,?,?)",
                       (self.pool, k, node, now))
            db.execute("COMMIT")
            return SlotClaim(k, node, now)
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def release(self, node: str) -> None:
        """Free the node's slot (nothing when it holds none)."""
        self._db.execute("DELETE FROM slots WHERE pool = ? AND node = ?", (self.pool, node))

    def holders(self) -> dict[int, SlotClaim]:
        """The claims on file, by index (expired ones included)."""
        rows = self._db.execute("SELECT idx, node, since FROM slots WHERE pool = ?",
                                (self.pool,)).fetchall()
        return {int(i): SlotClaim(int(i), str(n), float(s)) for i, n, s in rows}

    def close(self) -> None:
        self._db.close()


class KubeSlots:
    """Slots as places of the fleet semaphore (stores/kube/semaphore.py): a create claims (409
    when taken), a delete with the uid as precondition releases, so a slot someone took over is
    never freed by its old holder. The pool's own rule is the takeover after its ttl."""

    def __init__(self, calls: ApiCaller, pool: str, capacity: int, *, ttl: float,
                 clock: Callable[[], float], rng: Callable[[], float] = random.random) -> None:
        _check(pool, capacity, ttl)
        self.calls, self.pool, self.capacity, self.ttl = calls, pool, capacity, ttl
        self.clock, self.rng = clock, rng
        self.places: Semaphore[SlotClaim] = Semaphore(
            calls, what=f"{pool} slots", selector=f"{LABEL_POOL}={pool}", name=self._name,
            parse=self._parse)

    def _name(self, index: int) -> str:
        return f"screener-{self.pool}-slot-{index}"

    def _parse(self, cm: Mapping[str, Any]) -> Optional[SlotClaim]:
        meta, data = cm.get("metadata") or {}, cm.get("data") or {}
        prefix = f"screener-{self.pool}-slot-"
        name = str(meta.get("name") or "")
        if not name.startswith(prefix) or not re.fullmatch(r"[0-9]{1,6}", name[len(prefix):]):
            return None
        node = data.get("node")
        try:
            since = float(data.get("since") or "")
        except ValueError:
            return None
        if not isinstance(node, str) or not node or since != since:
            return None
        return SlotClaim(int(name[len(prefix):]), node, since)

    def _body(self, index: int, node: str, since: float) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": self._name(index), "namespace": self.calls.namespace,
                             "labels": {**kf.MANAGED_BY, LABEL_POOL: self.pool}},
                "data": {"node": node, "since": repr(float(since))}}

    def claim(self, node: str) -> Optional[SlotClaim]:
        """The node's slot (the one it holds, or a free one, or one past its ttl); None when all
        are taken."""
        for _ in range(self.capacity + 3):
            held = self.places.places()
            for place in held.values():
                if place.claim.node == node:
                    return place.claim  # ours: held already, or a create whose answer was lost
            now = self.clock()
            for index, place in list(held.items()):
                if now - place.claim.since >= self.ttl and index < self.capacity:
                    # A holder that never came back: take its place (only if it is still that
                    # object). Free now whoever's delete it was: a racer whose delete lost to
                    # another's tries its create too (before, it gave up, and of 3 expired slots
                    # 10 racers once claimed 2 with one left free, issue 36.7); a create that a
                    # new claim beat is refused, and the pool is read again.
                    self.places.free(index, place.uid)
                    del held[index]
            free = [k for k in range(self.capacity) if k not in held]
            if not free:
                return None
            # A random free index, so many claimers mostly try different ones. A refused
            # create (taken meanwhile, or our own create whose answer was lost) reads again.
            index = free[int(self.rng() * len(free)) % len(free)]
            if self.places.take(self._body(index, node, now)) is not None:
                # one slot per node: two claimers for one node, each missing the other's
                # create, took two; the lowest is kept
                kept, _ = self.places.keep_lowest(node)
                return kept or SlotClaim(index, node, now)
        return None

    def release(self, node: str) -> None:
        """Free the node's slot (nothing when it holds none)."""
        self.places.keep_lowest(node, keep=False)

    def holders(self) -> dict[int, SlotClaim]:
        """The claims on file, by index (expired ones included)."""
        return {i: p.claim for i, p in self.places.places().items()}

    def close(self) -> None:
        """Nothing to close: the calls belong to the store."""
