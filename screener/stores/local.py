"""LocalStore: node states, history and last verdicts in one SQLite file (the embedded default).

Used by `screener burnin` and the CLI when no cluster is configured. WAL journal, one transaction
per transition (state and history together, so a process killed mid-write leaves either the whole
transition or none of it), and a schema version in PRAGMA user_version: a file written by a newer
screener is refused with a clear message instead of being misread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Mapping, Optional

from screener.errors import BadInputError, ScreenerError
from screener.stores.base import StaleTransition, Transition, _json_safe
from screener.types import NodeState

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    since REAL NOT NULL,          -- time of the transition into this state
    last_id TEXT NOT NULL         -- id of that transition
);
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    node TEXT NOT NULL,
    time REAL NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    failure INTEGER NOT NULL,
    record TEXT NOT NULL          -- the whole Transition as JSON
);
CREATE INDEX IF NOT EXISTS transitions_by_node ON transitions (node, seq);
CREATE INDEX IF NOT EXISTS transitions_failures ON transitions (failure, time);
CREATE TABLE IF NOT EXISTS verdicts (
    node TEXT PRIMARY KEY,
    verdict TEXT NOT NULL
);
"""


class LocalStore:
    """A Store in a SQLite file. Safe to share between threads of one process and between processes."""

    def __init__(self, path: os.PathLike[str] | str, *, timeout: float = 10.0) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise BadInputError(f"{self.path}: cannot create the store's directory: "
                                    f"{e.strerror or e}") from e
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per write.
            self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None,
                                       check_same_thread=False)
            self._lock = threading.Lock()
            self._setup()
        except sqlite3.DatabaseError as e:
            raise BadInputError(f"{self.path}: not a usable screener database: {e}") from e

    def _setup(self) -> None:
        db = self._db
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            db.close()
            raise BadInputError(f"{self.path}: database schema version {version} is newer than this "
                                f"screener understands ({SCHEMA_VERSION}); upgrade screener or use "
                                f"another --db")
        db.execute("PRAGMA busy_timeout = 10000")
        if self.path != ":memory:":
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise BadInputError(f"{self.path}: cannot switch the database to WAL (got {mode})")
        # FULL: a committed transition survives power loss too; transitions are rare, so it is cheap.
        db.execute("PRAGMA synchronous = FULL")
        db.execute("PRAGMA foreign_keys = ON")
        if version < SCHEMA_VERSION:
            db.execute("BEGIN IMMEDIATE")
            try:
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        db.execute(stmt)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    # --- Store protocol ----------------------------------------------------------------------

    def get_state(self, node: str) -> Optional[NodeState]:
        row = self._query("SELECT state FROM nodes WHERE node = ?", (node,))
        return NodeState(row[0][0]) if row else None

    def record(self, transition: Transition) -> None:
        t = transition
        payload = json.dumps(t.to_dict(), sort_keys=True, allow_nan=False)
        with self._lock:
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE")  # take the write lock before reading the state
                try:
                    if db.execute("SELECT 1 FROM transitions WHERE id = ?", (t.id,)).fetchone():
                        db.execute("ROLLBACK")
                        return  # already recorded: a replay
                    row = db.execute("SELECT state FROM nodes WHERE node = ?", (t.node,)).fetchone()
                    stored = NodeState(row[0]) if row else None
                    if stored != t.from_state:
                        raise StaleTransition(
                            f"node {t.node}: transition {_name(t.from_state)} -> {t.to_state.value} "
                            f"not recorded: the node is {_name(stored)} now")
                    db.execute("INSERT INTO transitions (id, node, time, from_state, to_state, failure,"
                               " record) VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (t.id, t.node, float(t.time),
                                t.from_state.value if t.from_state else None, t.to_state.value,
                                int(bool(t.failure)), payload))
                    db.execute("INSERT INTO nodes (node, state, since, last_id) VALUES (?, ?, ?, ?) "
                               "ON CONFLICT(node) DO UPDATE SET state = excluded.state, "
                               "since = excluded.since, last_id = excluded.last_id",
                               (t.node, t.to_state.value, float(t.time), t.id))
                    db.execute("COMMIT")
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise ScreenerError(f"{self.path}: cannot record the transition of {t.node}: {e}") from e

    def history(self, node: str, since: Optional[float] = None) -> list[Transition]:
        rows = self._query("SELECT record FROM transitions WHERE node = ? AND time >= ? ORDER BY seq",
                           (node, float("-inf") if since is None else float(since)))
        return [Transition.from_dict(json.loads(r[0])) for r in rows]

    def all_states(self) -> dict[str, NodeState]:
        return {n: NodeState(s) for n, s in self._query("SELECT node, state FROM nodes ORDER BY node")}

    def failures(self, since: float) -> list[Transition]:
        rows = self._query("SELECT record FROM transitions WHERE failure = 1 AND time >= ? "
                           "ORDER BY time, seq", (float(since),))
        return [Transition.from_dict(json.loads(r[0])) for r in rows]

    def set_verdict(self, node: str, verdict: Mapping[str, Any]) -> None:
        payload = json.dumps(_json_safe(dict(verdict)), sort_keys=True)
        with self._lock:
            try:
                self._db.execute("INSERT INTO verdicts (node, verdict) VALUES (?, ?) ON CONFLICT(node) "
                                 "DO UPDATE SET verdict = excluded.verdict", (node, payload))
            except sqlite3.Error as e:
                raise ScreenerError(f"{self.path}: cannot record the verdict of {node}: {e}") from e

    def get_verdict(self, node: str) -> Optional[dict[str, Any]]:
        rows = self._query("SELECT verdict FROM verdicts WHERE node = ?", (node,))
        return json.loads(rows[0][0]) if rows else None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "LocalStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalStore({self.path!r})"

    # --- internals ---------------------------------------------------------------------------

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise ScreenerError(f"{self.path}: cannot read the store: {e}") from e


def _name(state: Optional[NodeState]) -> str:
    return state.value if state else "(new)"
