"""A durable FIFO of transitions that could not be written to the cluster yet.

KubeStore appends here when the API server stays unreachable after its retries, and replays the
entries oldest first once it answers again, so a transition is never lost and never reordered. One
SQLite file (WAL, one transaction per append or removal); ":memory:" for tests.

It also remembers each node's last known state (`known`, `remember`): what the daemon decides on
while the API server is out of reach, from its first pass on (issue 36.4), when nothing is
spooled for the node yet.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Optional

from screener.errors import BadInputError, ScreenerError
from screener.lifecycle.records import Transition

SPOOL_SCHEMA_VERSION = 1


class Spool:
    """Transitions waiting to be written, in the order they were decided."""

    def __init__(self, path: os.PathLike[str] | str = ":memory:") -> None:
        self.path = str(path)
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None,
                                       check_same_thread=False)
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SPOOL_SCHEMA_VERSION:
                raise BadInputError(f"{self.path}: spool schema version {version} is newer than this "
                                    f"screener understands ({SPOOL_SCHEMA_VERSION})")
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS spool (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                             " id TEXT NOT NULL, node TEXT NOT NULL, record TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS known (node TEXT PRIMARY KEY,"
                             " state TEXT NOT NULL)")
            self._db.execute(f"PRAGMA user_version = {SPOOL_SCHEMA_VERSION}")
        except (OSError, sqlite3.Error) as e:
            raise BadInputError(f"{self.path}: cannot open the transition spool: {e}") from e
        self._lock = threading.Lock()
        self._known: dict[str, str] = {}

    def remember(self, node: str, state: Optional[str]) -> None:
        """The node's state as last read or written (written only when it changed)."""
        if state is None or self._known.get(node) == state:
            return
        with self._lock:
            try:
                self._db.execute("INSERT OR REPLACE INTO known (node, state) VALUES (?, ?)",
                                 (node, state))
            except sqlite3.Error:
                return  # a hint for the offline decision only; the next read tries again
            self._known[node] = state

    def known(self, node: str) -> Optional[str]:
        """The node's last remembered state (None: never seen by this spool)."""
        if node in self._known:
            return self._known[node]
        with self._lock:
            row = self._db.execute("SELECT state FROM known WHERE node = ?", (node,)).fetchone()
        if row is not None:
            self._known[node] = str(row[0])
        return self._known.get(node)

    def append(self, t: Transition) -> None:
        payload = json.dumps(t.to_dict(), sort_keys=True)
        with self._lock:
            try:
                self._db.execute("INSERT INTO spool (id, node, record) VALUES (?, ?, ?)",
                                 (t.id, t.node, payload))
            except sqlite3.Error as e:
                raise ScreenerError(f"{self.path}: cannot spool the transition of {t.node}: {e}") from e

    def entries(self, node: Optional[str] = None) -> list[tuple[int, Transition]]:
        """(seq, transition) pairs, oldest first; only `node`'s if given."""
        sql = "SELECT seq, record FROM spool" + (" WHERE node = ?" if node else "") + " ORDER BY seq"
        with self._lock:
            rows = self._db.execute(sql, (node,) if node else ()).fetchall()
        return [(seq, Transition.from_dict(json.loads(rec))) for seq, rec in rows]

    def remove(self, seq: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM spool WHERE seq = ?", (seq,))

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM spool").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __repr__(self) -> str:
        return f"Spool({self.path!r})"
