"""LocalStore: node states, history and last verdicts in one SQLite file (the embedded default).

Used by `screener burnin` and the CLI when no cluster is configured. WAL journal, one transaction
per transition (state and history together, so a process killed mid-write leaves either the whole
transition or none of it).

The store refuses what it did not write (BadInputError, exit 2, one line): a file is ours when
its PRAGMA application_id is APPLICATION_ID, its user_version is SCHEMA_VERSION and it has our
tables; an empty file, another program's SQLite database or one of a newer schema is named and
left alone, never taken for an empty fleet. (Files of the first schema, written before the
application id, are recognised by their tables and get the id on their first writable open.) A
new database is built under a temporary name and linked into place whole, so no half-made file is
ever found at the path. `read_only=True` (the commands that only read) opens the file with
SQLite's mode=ro: it creates nothing and writes nothing. Every row read back is validated: an
unknown state or a record that is not a transition is one line naming the row.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import secrets
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Mapping, Optional, Sequence

from screener import boundedjson
from screener.errors import BadInputError, ScreenerError
from screener.lifecycle.records import BUDGET_STATES, StaleTransition, Transition
from screener.lifecycle.records import json_safe
from screener.stores.common import DiskFullError, summary_row
from screener.types import NodeState

if TYPE_CHECKING:
    from screener.stores.slots import SqliteSlots

SCHEMA_VERSION = 1
APPLICATION_ID = 0x5343524E  # "SCRN" in PRAGMA application_id: this file is a screener store
# Columns of each of our tables, as _SCHEMA creates them: how a file is recognised as ours.
_TABLES = {"nodes": ("node", "state", "since", "last_id"),
           "transitions": ("seq", "id", "node", "time", "from_state", "to_state", "failure",
                           "record"),
           "verdicts": ("node", "verdict")}
MAX_RECORD_BYTES = 4 * 1024 * 1024  # a stored transition or verdict (evidence is bounded far lower)

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
# The fleet quorum's tables (screener.known_answer.verdict.quorum), added to a store of schema 1
# when it is opened for writing: a screener that predates them neither needs nor sees them, so the
# schema version stays. candidates: the results each node's devices reproduced; promoted: the
# goldens promoted from a quorum, add-only (the primary key keeps the first record).
_FLEET_SCHEMA = """
CREATE TABLE IF NOT EXISTS kat_candidates (
    node TEXT NOT NULL,
    platform TEXT NOT NULL,
    job TEXT NOT NULL,
    digest TEXT NOT NULL,
    spec_hash TEXT,
    time REAL NOT NULL,
    PRIMARY KEY (node, platform, job)
);
CREATE TABLE IF NOT EXISTS kat_promoted (
    platform TEXT NOT NULL,
    job TEXT NOT NULL,
    record TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (platform, job)
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


def _create_schema(db: sqlite3.Connection) -> None:
    """Our tables, the application id and the schema version, in one transaction."""
    db.execute("BEGIN IMMEDIATE")
    try:
        for stmt in (_SCHEMA + _FLEET_SCHEMA).split(";"):
            if stmt.strip():
                db.execute(stmt)
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _link_into_place(tmp: Path, target: Path) -> None:
    """Give the finished file `tmp` the name `target` unless something already has it (then the
    other file stands and tmp is left to be removed), and make the new name durable."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        return  # another process created the store meanwhile
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # A filesystem without hard links: a rename, which does not refuse an existing name,
        # so only when there is none (a narrow race, against another first start only).
        if target.exists():
            return
        os.rename(tmp, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A Store in a SQLite file. Safe to share between threads of one process and between processes.

    read_only: for the commands that only read: a missing file is an error rather than a new
    store, and nothing is ever written to the file (SQLite's mode=ro).
    """

    def __init__(self, path: os.PathLike[str] | str, *, timeout: float = 10.0,
                 read_only: bool = False) -> None:
        self.path = str(path)
        self.read_only = read_only
        self._lock = threading.Lock()
        try:
            if self.path != ":memory:":
                self._check_file(timeout)
            self._db = self._connect(timeout)
            try:
                self._setup()
            except BaseException:
                self._db.close()
                raise
        except sqlite3.DatabaseError as e:
            if _is_disk_full(e):
                raise DiskFullError(disk_full_message(self.path, "open the state database")) from e
            raise BadInputError(f"{self.path}: not a usable screener database: {e}") from e

    def _check_file(self, timeout: float) -> None:
        """Refuse a path that holds no store we can open as asked; create a missing one (when
        not read-only)."""
        try:
            size: Optional[int] = os.stat(self.path).st_size
        except FileNotFoundError:
            size = None
        except OSError as e:
            raise BadInputError(f"{self.path}: cannot read the state database: "
                                f"{e.strerror or e}") from e
        if size == 0:
            # SQLite would take it for an empty database and write a schema into it; no store of
            # ours is ever empty (a new one is linked into place whole, see _create).
            raise BadInputError(f"{self.path}: an empty file, not a screener database: remove it "
                                "(a new store is then created there) or give another path")
        if size is None:
            if self.read_only:
                raise BadInputError(f"{self.path}: no state database there (a command that only "
                                    "reads never creates one)")
            self._create(timeout)

    def _create(self, timeout: float) -> None:
        """A new, empty store: built under a temporary name beside the path, then hard-linked into
        place, so a process killed half-way leaves no half-made file where a store is looked
        for. Another process that links first wins, and its store is opened instead."""
        target = Path(self.path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.new"
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except OSError as e:
            if _is_disk_full(e):
                raise DiskFullError(disk_full_message(self.path, "create the state database")) from e
            raise BadInputError(f"{self.path}: cannot create the state database: "
                                f"{e.strerror or e}") from e
        try:
            db = sqlite3.connect(tmp, timeout=timeout, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode = WAL")  # kept in the file's header
                db.execute("PRAGMA synchronous = FULL")
                _create_schema(db)
            finally:
                db.close()  # checkpoints the WAL into the file and removes it
            _link_into_place(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def _connect(self, timeout: float) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per write.
        if self.read_only and self.path != ":memory:":
            uri = Path(os.path.abspath(self.path)).as_uri() + "?mode=ro"
            return sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None,
                                   check_same_thread=False)
        return sqlite3.connect(self.path, timeout=timeout, isolation_level=None,
                               check_same_thread=False)

    def _setup(self) -> None:
        db = self._db
        db.execute("PRAGMA busy_timeout = 10000")
        if self.path == ":memory:":
            _create_schema(db)
            return
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = db.execute("PRAGMA user_version").fetchone()[0]
        problem = self._foreign(app_id, version)
        if problem:
            raise BadInputError(f"{self.path}: {problem}")
        if self.read_only:
            return
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise BadInputError(f"{self.path}: cannot switch the database to WAL (got {mode})")
        # FULL: a committed transition survives power loss too; transitions are rare, so it is cheap.
        db.execute("PRAGMA synchronous = FULL")
        for stmt in _FLEET_SCHEMA.split(";"):
            if stmt.strip():
                db.execute(stmt)
        if app_id == 0:  # a store of the first schema, from before the id: stamp it as ours
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _foreign(self, app_id: int, version: int) -> str:
        """Why the open file is not a store this screener wrote ("" when it is one)."""
        if app_id not in (APPLICATION_ID, 0):
            return (f"not a screener database (SQLite application id {app_id:#010x} is another "
                    "program's); screener neither reads nor changes it")
        if version > SCHEMA_VERSION:
            return (f"database schema version {version} is newer than this screener understands "
                    f"({SCHEMA_VERSION}); upgrade screener or use another --db")
        missing = self._missing_columns()
        if version < SCHEMA_VERSION or missing:
            return (f"not a screener database (schema version {version}"
                    f"{', ' + missing if missing else ''}); screener neither reads nor changes it")
        return ""

    def _missing_columns(self) -> str:
        """Which of our tables or columns the file lacks ("" when it has them all)."""
        for table, want in _TABLES.items():
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if not have:
                return f"no table {table}"
            lacking = [c for c in want if c not in have]
            if lacking:
                return f"table {table} lacks {', '.join(lacking)}"
        return ""

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

    def _state_of(self, node: str, value: Any) -> NodeState:
        """The state a nodes row holds; BadInputError naming the row when it is none of ours."""
        try:
            return NodeState(value)
        except ValueError:
            raise BadInputError(
                f"{self.path}: table nodes, node {str(node)[:128]!r}: state {str(value)[:40]!r} "
                f"is not a node state ({', '.join(s.value for s in NodeState)})") from None

    def _transition_of(self, seq: Any, node: str, text: Any) -> Transition:
        """The Transition a transitions row holds; BadInputError naming the row when its record
        is not JSON, not a transition, or about another node than the row's."""
        try:
            data = boundedjson.loads(text, max_bytes=MAX_RECORD_BYTES)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            t = Transition.from_dict(data)
            if t.node != node:
                raise ValueError(f"it is about node {t.node[:128]!r}")
            return t
        except (TypeError, ValueError) as e:
            raise BadInputError(f"{self.path}: table transitions, row {seq} (node "
                                f"{str(node)[:128]!r}): the record is not a transition "
                                f"({str(e)[:200]})") from None

    def one_pass(self) -> ContextManager[None]:
        """A daemon pass: nothing to keep (a read of the local file costs no request)."""
        return nullcontext()

    def get_state(self, node: str) -> Optional[NodeState]:
        row = self._query("SELECT state FROM nodes WHERE node = ?", (node,))
        return self._state_of(node, row[0][0]) if row else None

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
        stored = self._state_of(t.node, row[0]) if row else None
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
                return _failures_for(self, self._db, serials, since)
            except sqlite3.Error as e:
                raise self._error("read the store", e) from e

    def summaries(self) -> list[dict[str, Any]]:
        """node, state, since, reason, actor of every node, in one query (`node status`)."""
        rows = self._query("SELECT n.node, n.state, t.seq, t.record, v.verdict FROM nodes n "
                           "LEFT JOIN transitions t ON t.id = n.last_id "
                           "LEFT JOIN verdicts v ON v.node = n.node ORDER BY n.node")
        return [summary_row(node, self._state_of(node, state),
                            self._transition_of(seq, node, rec).to_dict() if rec else None,
                            _verdict_or_none(verdict))
                for node, state, seq, rec, verdict in rows]

    def history(self, node: str, since: Optional[float] = None) -> list[Transition]:
        rows = self._query("SELECT seq, record FROM transitions WHERE node = ? AND time >= ? "
                           "ORDER BY seq",
                           (node, float("-inf") if since is None else float(since)))
        return [self._transition_of(seq, node, rec) for seq, rec in rows]

    def all_states(self) -> dict[str, NodeState]:
        return {n: self._state_of(n, s)
                for n, s in self._query("SELECT node, state FROM nodes ORDER BY node")}

    def failures(self, since: float) -> list[Transition]:
        rows = self._query("SELECT seq, node, record FROM transitions WHERE failure = 1 AND "
                           "time >= ? ORDER BY time, seq", (float(since),))
        return [self._transition_of(seq, node, rec) for seq, node, rec in rows]

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
        if not rows:
            return None
        try:
            verdict = boundedjson.loads(rows[0][0], max_bytes=MAX_RECORD_BYTES)
            if not isinstance(verdict, dict):
                raise ValueError("not a JSON object")
        except (TypeError, ValueError) as e:
            raise BadInputError(f"{self.path}: table verdicts, node {node[:128]!r}: the verdict "
                                f"is not a JSON object ({str(e)[:200]})") from None
        return verdict

    # --- the fleet quorum (screener.known_answer.verdict.quorum)
    # -------------------------------------

    def publish_candidates(self, node: str,
                           candidates: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None:
        """The results the node's devices reproduced (platform -> job -> entry), replacing the
        node's earlier entries for the same platform and job."""
        rows = [(node, str(p), str(j), str(e["digest"]), e.get("spec_hash"), time.time())
                for p, jobs in candidates.items() for j, e in jobs.items()]
        if not rows:
            return
        with self._write(f"publish the candidates of {node}"):
            self._db.executemany(
                "INSERT INTO kat_candidates (node, platform, job, digest, spec_hash, time) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(node, platform, job) DO UPDATE SET "
                "digest = excluded.digest, spec_hash = excluded.spec_hash, time = excluded.time",
                rows)

    def fleet_candidates(self) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
        """Every node's candidates: node -> platform -> job -> {"digest", "spec_hash"}."""
        out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
        for node, platform, job, digest, spec_hash in self._fleet_query(
                "SELECT node, platform, job, digest, spec_hash FROM kat_candidates"):
            out.setdefault(node, {}).setdefault(platform, {})[job] = {
                "digest": digest, "spec_hash": spec_hash}
        return out

    def promote_golden(self, phash: str, job: str, text: str) -> Optional[str]:
        """Store a golden promoted from a quorum (add-only): None when stored, else the record
        already there (it stays)."""
        with self._write(f"store the promoted golden {job} of platform {phash}"):
            row = self._db.execute("SELECT record FROM kat_promoted WHERE platform = ? AND "
                                   "job = ?", (phash, job)).fetchone()
            if row is not None:
                return str(row[0])
            self._db.execute("INSERT INTO kat_promoted (platform, job, record, time) VALUES "
                             "(?, ?, ?, ?)", (phash, job, text, time.time()))
        return None

    def promoted_goldens(self) -> dict[str, dict[str, str]]:
        """Platform hash -> job -> record text of the promoted goldens."""
        out: dict[str, dict[str, str]] = {}
        for platform, job, record in self._fleet_query(
                "SELECT platform, job, record FROM kat_promoted"):
            out.setdefault(platform, {})[job] = record
        return out

    def _fleet_query(self, sql: str) -> list[tuple[Any, ...]]:
        """A read of the quorum's tables; none in a read-only store of a screener before them."""
        try:
            with self._lock:
                return self._db.execute(sql).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return []
            raise self._error("read the store", e) from e

    def slots(self, pool: str, capacity: int, *, ttl: float,
              clock: Callable[[], float]) -> "SqliteSlots":
        """A fleet-wide slot pool (stores/slots.py) in this store's file: at most `capacity`
        nodes hold one at once, a claim older than `ttl` may be taken over. Closed by its
        caller."""
        from screener.stores.slots import SqliteSlots

        return SqliteSlots(self.path, pool, capacity, ttl=ttl, clock=clock)

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
        self.state: Optional[NodeState] = store._state_of(node, row[0]) if row else None
        self.history: list[Transition] = [
            store._transition_of(seq, node, rec) for seq, rec in
            db.execute("SELECT seq, record FROM transitions WHERE node = ? ORDER BY seq", (node,))]
        # Two counts over an indexed table of one row per node: no history is decoded.
        total = db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0]
        marks = ",".join("?" * len(BUDGET_STATES))
        out = db.execute(f"SELECT COUNT(*) FROM nodes WHERE node != ? AND state IN ({marks})",
                         (node, *sorted(s.value for s in BUDGET_STATES))).fetchone()[0]
        self.fleet_total = int(total) + (0 if row else 1)
        self.out_of_service = int(out)

    def failures_for(self, serials: Sequence[str], since: float) -> list[Transition]:
        return _failures_for(self._store, self._db, serials, since)

    def commit(self, transitions: Sequence[Transition]) -> None:
        for t in transitions:
            if t.node != self.node:
                raise ValueError(f"a decision about {self.node} cannot record a transition of {t.node}")
            self._store._insert(t)


def _failures_for(store: LocalStore, db: sqlite3.Connection, serials: Sequence[str],
                  since: float) -> list[Transition]:
    serials = sorted({str(s) for s in serials})
    if not serials:
        return []
    marks = ",".join("?" * len(serials))
    # A record that is not a JSON object is selected too (CASE keeps json_each off it, which would
    # fail the whole query), so that _transition_of names its row rather than skipping it.
    rows = db.execute(
        "SELECT seq, node, record FROM transitions t WHERE failure = 1 AND time >= ? AND CASE "
        "WHEN NOT json_valid(t.record) THEN 1 WHEN json_type(t.record) != 'object' THEN 1 ELSE "
        f"EXISTS (SELECT 1 FROM json_each(t.record, '$.gpu_serials') j WHERE j.value IN ({marks}))"
        " END ORDER BY time, seq", (float(since), *serials)).fetchall()
    return [store._transition_of(seq, node, rec) for seq, node, rec in rows]


def _name(state: Optional[NodeState]) -> str:
    return state.value if state else "(new)"


def _verdict_or_none(raw: Optional[str]) -> Any:
    """A stored verdict for the fleet view; one that does not parse is shown as none there
    (`node status NODE` reports it, naming the table)."""
    if raw is None:
        return None
    try:
        return boundedjson.loads(raw, max_bytes=MAX_RECORD_BYTES)
    except (TypeError, ValueError):
        return None
