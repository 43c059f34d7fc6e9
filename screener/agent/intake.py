"""Alarm intake: take each alarm file in SCREENER_ALARM_DIR exactly once.

In-job checks (screener.audit) drop one JSON file per alarm into the alarm directory of the node
the alarm is about (temp name, then rename). The daemon on that node reads them here:

1. every `*.json` entry not starting with a dot (a dot file is a write still in progress) is
   opened with O_NOFOLLOW | O_NONBLOCK (a symlink or a FIFO swapped in after the scan is refused,
   never followed or waited on), checked with fstat to be a regular file under MAX_ALARM_BYTES,
   parsed within bounds (screener.boundedjson: depth, integer length, no NaN or infinity) and
   validated field by field (`validate`);
2. a file that cannot be read, parsed or validated is moved into `rejected/` with one log line,
   and the intake goes on with the next file. No exception from one file ends a pass: a file
   that cannot even be moved aside is skipped and remembered (logged once, tried again when it
   changes), and a regular file squatting on the name `processed` or `rejected` is renamed out of
   the way. What the pass could not do is in IntakeResult.stuck / .stalled, which the daemon
   turns into /readyz and a gauge;
3. a file about another node is left where it is (its own daemon takes it; several simulated nodes
   may share one directory in a drill or a test);
4. an alarm is applied (handed to the lifecycle and its transition stored) and only then moved into
   `processed/`. A daemon that dies between the two finds the file again after a restart; the
   `already_applied` check (the alarm's id in the node's stored history), and the lifecycle itself
   (a second settled alarm does not move a quarantined node), make the second pass a no-op, so the
   alarm takes effect exactly once. A file whose name is already in `processed/` is a duplicate
   delivery and is only moved aside.

Nothing here reads a clock of its own or talks to a store directly: `apply` and `already_applied`
are passed in (the daemon gives functions over its store).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from screener import boundedjson
from screener.types import ALARM_CHECK_REASONS, MAX_ID_LEN, AlarmRecord

# The name the daemon's JSON log lines have always carried (log queries filter on it), not the
# module's path since the move into subpackages.
log = logging.getLogger("screener.intake")

PROCESSED = "processed"
REJECTED = "rejected"
MAX_ALARM_BYTES = 256 * 1024  # an alarm is a few KiB; anything this large is not one
MAX_EVIDENCE_BYTES = 64 * 1024  # evidence is stored with the transition: keep it small
MAX_DEPTH = 16
MAX_NAME_LEN = 253  # a DNS subdomain, the longest Kubernetes node name
MAX_RANKS = 65536
MAX_SUSPECT_NODES = 64
MAX_CREATED = 1e11  # unix seconds, year 5138: a bound, not a clock check
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FIELDS = frozenset({"schema", "alarm_id", "check", "step", "settled", "suspect_ranks",
                     "suspect_nodes", "node", "job", "created", "evidence"})


@dataclass
class IntakeResult:
    """What one intake pass did, by alarm id / file name."""

    applied: list[AlarmRecord] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)  # alarm ids seen before: only moved aside
    rejected: list[str] = field(default_factory=list)  # file names moved to rejected/
    foreign: list[str] = field(default_factory=list)  # file names about another node, left alone
    failed: list[str] = field(default_factory=list)  # apply raised: left in place for the next pass
    stuck: list[str] = field(default_factory=list)  # could not be moved aside: skipped, remembered
    stalled: str = ""  # why the pass could not look at the folder at all ("" when it could)

    @property
    def count(self) -> int:
        return len(self.applied) + len(self.duplicates) + len(self.rejected)


class _Stuck(Exception):
    """A file could not be moved aside; it is skipped until it changes."""


ApplyFn = Callable[[AlarmRecord], None]  # stores one alarm's effect; raises to keep the file


class AlarmIntake:
    """Reads, applies and moves aside the alarm files of one node.

    apply(record): store the alarm's effect (raise to leave the file for the next pass). None
        when each `run` is given its own (the daemon's records what it did in that pass's report).
    already_applied(record): True when a previous run stored this alarm's effect.
    processed_keep: how many files processed/ keeps (the oldest go first); 0 keeps none.

    No exception from one file ends a pass: a file that cannot be read, parsed or validated is
    moved to rejected/; one that cannot even be moved is skipped and remembered (by name, inode
    and mtime) with one log line, and tried again only once it changes.
    """

    def __init__(self, directory: str | os.PathLike[str], node: str,
                 apply: Optional[ApplyFn] = None,
                 already_applied: Callable[[AlarmRecord], bool] = lambda r: False, *,
                 processed_keep: int = 1000) -> None:
        self.directory = Path(directory)
        self.node = node
        self.apply = apply
        self.already_applied = already_applied
        self.processed_keep = processed_keep
        self._foreign_logged: set[str] = set()
        self._stuck: dict[str, tuple[int, int]] = {}  # name -> (inode, mtime_ns) when it stuck

    @property
    def processed_dir(self) -> Path:
        return self.directory / PROCESSED

    @property
    def rejected_dir(self) -> Path:
        return self.directory / REJECTED

    @property
    def stuck(self) -> list[str]:
        """Names of files skipped because they could not be moved aside."""
        return sorted(self._stuck)

    def _entries(self) -> list[tuple[float, str, Path, tuple[int, int]]]:
        entries = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.startswith(".") or not e.name.endswith(".json"):
                    continue
                try:
                    if e.is_dir(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                except OSError:  # taken by someone else in between
                    continue
                # Symlinks, FIFOs and devices are listed too: _read refuses them and they are
                # moved aside, so they cannot sit in the folder forever.
                entries.append((st.st_mtime, e.name, Path(e.path), (st.st_ino, st.st_mtime_ns)))
        return sorted(entries, key=lambda x: (x[0], x[1]))

    def pending(self) -> list[Path]:
        """Alarm files waiting in the directory, oldest first (by mtime, then name)."""
        try:
            return [p for _, _, p, _ in self._entries()]
        except FileNotFoundError:
            return []

    def run(self, apply: Optional[ApplyFn] = None) -> IntakeResult:
        """One pass over the directory, applying each new alarm with `apply` (default: the one
        given at construction); never raises, but for a missing `apply` (a bug of the caller)."""
        apply = apply or self.apply
        if apply is None:
            raise TypeError("AlarmIntake.run needs an apply function: none was given")
        result = IntakeResult()
        try:
            entries = self._entries()
        except FileNotFoundError:
            entries = []
        except OSError as e:
            result.stalled = f"cannot list {self.directory}: {e.strerror or e}"
            log.error("alarm intake stalled: %s", result.stalled)
            return result
        present = set()
        for _, name, path, ident in entries:
            present.add(name)
            if self._stuck.get(name) == ident:
                result.stuck.append(name)
                continue
            self._stuck.pop(name, None)
            try:
                self._take(path, result, apply)
            except _Stuck as e:
                self._stuck[name] = ident
                result.stuck.append(name)
                log.error("alarm file %s skipped: %s; it is tried again once it changes", name, e)
            except Exception as e:  # noqa: BLE001 - one file must never end the pass
                self._stuck[name] = ident
                result.stuck.append(name)
                log.error("alarm file %s skipped: %s: %s; it is tried again once it changes",
                          name, type(e).__name__, e)
        for name in set(self._stuck) - present:  # gone (moved by hand): forget it
            del self._stuck[name]
        if result.applied or result.duplicates:
            try:
                self._prune()
            except OSError as e:
                log.warning("cannot prune %s: %s", self.processed_dir, e)
        return result

    # --- one file -------------------------------------------------------------------------------

    def _take(self, path: Path, result: IntakeResult, apply: ApplyFn) -> None:
        record, why = _read(path)
        if record is None:
            self._move(path, self.rejected_dir)
            result.rejected.append(path.name)
            log.warning("alarm file %s rejected: %s (moved to %s/)", path.name, why, REJECTED)
            return
        if record.node != self.node:
            result.foreign.append(path.name)
            if path.name not in self._foreign_logged:
                self._foreign_logged.add(path.name)
                log.info("alarm file %s is about node %s, not %s: left for its own daemon",
                         path.name, record.node, self.node)
            return
        try:
            # The store may be unreachable (API server down): that is not the file's fault, so
            # the file stays and is tried again next pass rather than being remembered as stuck.
            applied_before = (os.path.lexists(self.processed_dir / path.name)
                              or self.already_applied(record))
        except Exception as e:  # noqa: BLE001 - retried next pass
            result.failed.append(path.name)
            log.error("alarm %s not checked against the store, will retry: %s: %s",
                      record.alarm_id, type(e).__name__, e)
            return
        if applied_before:
            self._move(path, self.processed_dir)
            result.duplicates.append(record.alarm_id)
            log.info("alarm %s was applied before; moved aside without applying it again",
                     record.alarm_id)
            return
        try:
            apply(record)
        except Exception as e:  # noqa: BLE001 - the file stays and is tried again next pass
            result.failed.append(path.name)
            log.error("alarm %s not applied, will retry: %s: %s", record.alarm_id,
                      type(e).__name__, e)
            return
        # Only now, with the transition stored, is the file moved aside.
        self._move(path, self.processed_dir)
        result.applied.append(record)

    def _folder(self, folder: Path) -> None:
        """Make sure `folder` is a real directory; a file squatting on its name is renamed to a
        dot name (never scanned) so that it cannot block every later pass."""
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise _Stuck(f"cannot inspect {folder.name}/: {e.strerror or e}") from None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            squat = folder.with_name(f".{folder.name}.not-a-folder.{st.st_ino}")
            try:
                os.replace(folder, squat)
            except OSError as e:
                raise _Stuck(f"{folder.name} is not a folder and cannot be renamed: "
                             f"{e.strerror or e}") from None
            log.warning("%s in the alarm folder was not a folder; renamed to %s", folder.name,
                        squat.name)
            st = None
        if st is None:
            try:
                os.mkdir(folder, 0o700)  # writers (the alarm group) may not read what was taken
            except FileExistsError:
                pass
            except OSError as e:
                raise _Stuck(f"cannot create {folder.name}/: {e.strerror or e}") from None

    def _move(self, path: Path, folder: Path) -> None:
        self._folder(folder)
        target = folder / path.name
        try:
            os.replace(path, target)
        except FileNotFoundError:
            pass  # already moved by an earlier attempt
        except OSError as e:
            raise _Stuck(f"cannot move it to {folder.name}/: {e.strerror or e}") from None
        _fsync_dir(folder)
        _fsync_dir(path.parent)

    def _prune(self) -> None:
        try:
            files = sorted(self.processed_dir.iterdir(),
                           key=lambda p: (p.lstat().st_mtime, p.name))
        except FileNotFoundError:
            return
        for p in files[:max(0, len(files) - self.processed_keep)]:
            try:
                p.unlink()
            except OSError:
                pass


def _read(path: Path) -> tuple[Optional[AlarmRecord], str]:
    """The record in a file, or None and why not."""
    try:
        raw = boundedjson.read_regular(path, MAX_ALARM_BYTES, follow_symlinks=False)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, "a symbolic link (alarm files must be regular files)"
        return None, f"unreadable: {e.strerror or e}"
    except ValueError as e:
        return None, str(e)
    try:
        data = boundedjson.loads(raw, max_bytes=MAX_ALARM_BYTES, max_depth=MAX_DEPTH)
    except ValueError as e:
        return None, str(e)
    try:
        return validate(data), ""
    except ValueError as e:
        return None, str(e)


def _name(v: Any, what: str, limit: int, *, pattern: bool = True) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"alarm {what} must be a non-empty string")
    if len(v) > limit:
        raise ValueError(f"alarm {what} is {len(v)} characters long (at most {limit})")
    if pattern and not _ID_RE.match(v):
        raise ValueError(f"alarm {what} {v[:40]!r} may hold only letters, digits, '_', '.', '-'")
    return v


def _int(v: Any, what: str, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise ValueError(f"alarm {what} {str(v)[:40]} is not an integer in 0..{hi}")
    return v


def validate(d: Any) -> AlarmRecord:
    """An AlarmRecord from a parsed alarm file, every field checked; ValueError naming the first
    field that is wrong. Beyond AlarmRecord.from_dict: ids are bounded in length and charset,
    numbers are finite and in range, evidence is small, and every suspect node named is the
    alarm's own node (an alarm may only ever speak about the node it was dropped on)."""
    if not isinstance(d, Mapping):
        raise ValueError("alarm is not a JSON object")
    unknown = sorted(str(k)[:40] for k in set(d) - _FIELDS)
    if unknown:
        raise ValueError(f"alarm has unknown field(s) {', '.join(unknown)}")
    if d.get("schema") != AlarmRecord.SCHEMA or isinstance(d.get("schema"), bool):
        raise ValueError(f"alarm schema {str(d.get('schema'))[:40]} is not {AlarmRecord.SCHEMA}")
    for key in ("alarm_id", "check", "step", "settled", "suspect_ranks", "suspect_nodes", "node"):
        if key not in d:
            raise ValueError(f"alarm lacks the field {key!r}")
    _name(d["alarm_id"], "alarm_id", MAX_ID_LEN)
    node = _name(d["node"], "node", MAX_NAME_LEN)
    if not isinstance(d["check"], str) or d["check"] not in ALARM_CHECK_REASONS:
        raise ValueError(f"alarm check {str(d['check'])[:40]!r} is not one of "
                         f"{sorted(ALARM_CHECK_REASONS)}")
    _int(d["step"], "step", 2**63 - 1)
    if not isinstance(d["settled"], bool):
        raise ValueError("alarm settled is not true or false")
    _suspects(d["suspect_ranks"], d["suspect_nodes"], node)
    job = d.get("job")
    if job not in (None, ""):
        _name(job, "job", MAX_NAME_LEN, pattern=False)
        if any(ord(c) < 32 for c in job):
            raise ValueError("alarm job holds control characters")
    created = d.get("created", 0.0)
    if created is None:
        created = 0.0
    if not isinstance(created, (int, float)) or isinstance(created, bool) \
            or not math.isfinite(created) or not 0 <= created <= MAX_CREATED:
        raise ValueError(f"alarm created {str(created)[:40]} is not a unix time in "
                         f"0..{MAX_CREATED:.0f}")
    evidence = d.get("evidence")
    if evidence is None:
        evidence = {}
    if not isinstance(evidence, Mapping):
        raise ValueError("alarm evidence is not an object")
    size = len(json.dumps(evidence))
    if size > MAX_EVIDENCE_BYTES:
        raise ValueError(f"alarm evidence is {size} bytes of JSON (at most {MAX_EVIDENCE_BYTES})")
    return AlarmRecord.from_dict({**d, "created": float(created), "evidence": dict(evidence)})


def _suspects(ranks: Any, nodes: Any, node: str) -> None:
    """The suspect ranks and nodes are bounded lists, and every suspect node is `node` itself."""
    if not isinstance(ranks, list) or len(ranks) > MAX_RANKS:
        raise ValueError(f"alarm suspect_ranks must be a list of at most {MAX_RANKS} ranks")
    for r in ranks:
        _int(r, "suspect rank", 2**31 - 1)
    if not isinstance(nodes, list) or len(nodes) > MAX_SUSPECT_NODES:
        raise ValueError(f"alarm suspect_nodes must be a list of at most {MAX_SUSPECT_NODES}")
    for n in nodes:
        if not isinstance(n, Mapping) or set(n) - {"node", "hostname", "instance_id"}:
            raise ValueError("alarm suspect_nodes entries must be {node, hostname, instance_id}")
        named = _name(n.get("node"), "suspect node", MAX_NAME_LEN)
        _name(n.get("hostname"), "suspect hostname", MAX_NAME_LEN)
        if n.get("instance_id") is not None:
            _name(n["instance_id"], "suspect instance_id", MAX_ID_LEN)
        if named != node:
            raise ValueError(f"alarm names node {named[:60]} as suspect but was dropped for "
                             f"node {node}: an alarm acts only on its own node")


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (not every filesystem lets a directory be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def applied_in_history(history: Sequence[Any], alarm_id: str) -> bool:
    """Whether a stored transition's evidence carries this alarm (the lifecycle puts the whole
    AlarmRecord under evidence["alarm"])."""
    for t in history:
        ev = getattr(t, "evidence", None) or {}
        alarm = ev.get("alarm") if isinstance(ev, Mapping) else None
        if isinstance(alarm, Mapping) and alarm.get("alarm_id") == alarm_id:
            return True
    return False
