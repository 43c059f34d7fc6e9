"""LocalStore: node states, history and last verdicts in one SQLite file (the embedded default).

Used by `screener burnin` and the CLI when no cluster is configured. WAL journal, one transaction
per transition (state and history together, so a process killed mid-write leaves either the whole
transition or none of it), and a schema version in PRAGMA user_version: a file written by a newer
screener is refused with a clear message instead of being misread.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from screener.errors import BadInputError, ScreenerError
from screener.lifecycle.records import BUDGET_STATES, StaleTransition, Transition
from screener.lifecycle.records import json_safe
from screener.stores.base import DiskFullError, summary_row
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


def _mount_point(path: str) -> str:
    """The mount point of the filesystem holding `path` (walks up while the device stays the same)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        dev = p.stat().st_dev
        while p != p.parent and p.parent.stat().st_dev == dev:
            p = p.parent
    except OSError:
        pass
    return str(p)


def disk_full_message(path: str, what: str) -> str:
    """'<file>: the disk is full (filesystem <mount>, N bytes free of M): cannot <what>'."""
    mount = _mount_point(path if path != ":memory:" else ".")
    try:
        st = os.statvfs(mount)
        room = f", {st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
    except OSError:
        room = ""
    return (f"{path}: the disk is full (filesystem {mount}{room}): cannot {what}; free space there "
            "and it is tried again")


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, sqlite3.Error):
        code = getattr(e, "sqlite_errorcode", None)
        return code == sqlite3.SQLITE_FULL or "disk is full" in str(e) or (
            code is not None and code & 0xFF == sqlite3.SQLITE_IOERR and "full" in str(e))
    return False


class LocalStore:
    """A Store in a SQLite file. Safe to share between threads of one process and between processes."""

    def __init__(self, path: os.PathLike[str] | str, *, timeout: float = 10.0) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                if _is_disk_full(e):
                    raise DiskFullError(disk_full_message(self.path, "create the store's "
                                                          "directory")) from e
                raise BadInputError(f"{self.path}: cannot create the store's directory: "
                                    f"{e.strerror or e}") from e
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per write.
            self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None,
                                       check_same_thread=False)
            self._lock = threading.Lock()
            self._setup()
        except sqlite3.DatabaseError as e:
            if _is_disk_full(e):
                raise DiskFullError(disk_full_message(self.path, "open the state database")) from e
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
                self._rollback()
                raise

    def _rollback(self) -> None:
        """Roll back if a transaction is open. SQLite may already have rolled back by itself (a
        full disk, an I/O error); a failing ROLLBACK must not hide the error that caused it."""
        try:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def _error(self, what: str, e: sqlite3.Error) -> ScreenerError:
        if _is_disk_full(e):
            return DiskFullError(disk_full_message(self.path, what))
        return ScreenerError(f"{self.path}: cannot {what}: {e}")

    # --- Store protocol ----------------------------------------------------------------------

    def get_state(self, node: str) -> Optional[NodeState]:
        row = self._query("SELECT state FROM nodes WHERE node = ?", (node,))
        return NodeState(row[0][0]) if row else None

    @contextmanager
    def _write(self, what: str) -> Iterator[None]:
        """One BEGIN IMMEDIATE transaction: the write lock is taken before anything is read,
        committed at the end, rolled back on any error; an SQLite error names `what` failed."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield
                    self._db.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
            except sqlite3.Error as e:
                raise self._error(what, e) from e

    def record(self, transition: Transition) -> None:
        with self._write(f"record the transition of {transition.node}"):
            self._insert(transition)

    def _insert(self, t: Transition) -> None:
        """Write one transition inside an open write transaction (a replay of it is a no-op)."""
        db = self._db
        if db.execute("SELECT 1 FROM transitions WHERE id = ?", (t.id,)).fetchone():
            return  # already recorded: a replay
        row = db.execute("SELECT state FROM nodes WHERE node = ?", (t.node,)).fetchone()
        stored = NodeState(row[0]) if row else None
        if stored != t.from_state:
            raise StaleTransition(
                f"node {t.node}: transition {_name(t.from_state)} -> {t.to_state.value} "
                f"not recorded: the node is {_name(stored)} now")
        payload = json.dumps(t.to_dict(), sort_keys=True, allow_nan=False)
        db.execute("INSERT INTO transitions (id, node, time, from_state, to_state, failure,"
                   " record) VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (t.id, t.node, float(t.time), t.from_state.value if t.from_state else None,
                    t.to_state.value, int(bool(t.failure)), payload))
        db.execute("INSERT INTO nodes (node, state, since, last_id) VALUES (?, ?, ?, ?) "
                   "ON CONFLICT(node) DO UPDATE SET state = excluded.state, "
                   "since = excluded.since, last_id = excluded.last_id",
                   (t.node, t.to_state.value, float(t.time), t.id))

    @contextmanager
    def begin(self, node: str) -> Iterator["LocalTxn"]:
        """Read-decide-write of `node` in one BEGIN IMMEDIATE transaction (see NodeTxn).

        The write lock is taken before anything is read, so no other process can change a state
        between the budget count this decision reads and the transition it writes: however many
        daemons race for the last budget slot, one gets it.
        """
        with self._write(f"record a decision about {node}"):
            yield LocalTxn(self, node)

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        """Failures at or after `since` that blame one of `serials` (the per-GPU lemon rule)."""
        with self._lock:
            try:
                return _failures_for(self._db, serials, since)
            except sqlite3.Error as e:
                raise self._error("read the store", e) from e

    def summaries(self) -> list[dict[str, Any]]:
        """node, state, since, reason, actor of every node, in one query (`node status`)."""
        rows = self._query("SELECT n.node, n.state, t.record FROM nodes n LEFT JOIN transitions t "
                           "ON t.id = n.last_id ORDER BY n.node")
        return [summary_row(node, NodeState(state), json.loads(rec) if rec else None)
                for node, state, rec in rows]

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
        payload = json.dumps(json_safe(dict(verdict)), sort_keys=True)
        with self._lock:
            try:
                self._db.execute("INSERT INTO verdicts (node, verdict) VALUES (?, ?) ON CONFLICT(node) "
                                 "DO UPDATE SET verdict = excluded.verdict", (node, payload))
            except sqlite3.Error as e:
                raise self._error(f"record the verdict of {node}", e) from e

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
                raise self._error("read the store", e) from e


class LocalTxn:
    """The NodeTxn of LocalStore: everything read and written inside one write transaction."""

    def __init__(self, store: LocalStore, node: str) -> None:
        db = store._db
        self._store, self._db, self.node = store, db, node
        row = db.execute("SELECT state FROM nodes WHERE node = ?", (node,)).fetchone()
        self.state: Optional[NodeState] = NodeState(row[0]) if row else None
        self.history: list[Transition] = [
            Transition.from_dict(json.loads(r[0])) for r in
            db.execute("SELECT record FROM transitions WHERE node = ? ORDER BY seq", (node,))]
        # Two counts over an indexed table of one row per node: no history is decoded.
        total = db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0]
        marks = ",".join("?" * len(BUDGET_STATES))
        out = db.execute(f"SELECT COUNT(*) FROM nodes WHERE node != ? AND state IN ({marks})",
                         (node, *sorted(s.value for s in BUDGET_STATES))).fetchone()[0]
        self.fleet_total = int(total) + (0 if row else 1)
        self.out_of_service = int(out)

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        return _failures_for(self._db, serials, since)

    def commit(self, transitions: Sequence[Transition]) -> None:
        for t in transitions:
            if t.node != self.node:
                raise ValueError(f"a decision about {self.node} cannot record a transition of {t.node}")
            self._store._insert(t)


def _failures_for(db: sqlite3.Connection, serials: Sequence[str], since: float) -> list[Transition]:
    serials = sorted({str(s) for s in serials})
    if not serials:
        return []
    marks = ",".join("?" * len(serials))
    rows = db.execute("SELECT record FROM transitions t WHERE failure = 1 AND time >= ? AND EXISTS "
                      f"(SELECT 1 FROM json_each(t.record, '$.gpu_serials') j WHERE j.value IN ({marks}))"
                      " ORDER BY time, seq", (float(since), *serials)).fetchall()
    return [Transition.from_dict(json.loads(r[0])) for r in rows]


def _name(state: Optional[NodeState]) -> str:
    return state.value if state else "(new)"
