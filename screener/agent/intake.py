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
3. a file about another node can never apply here (each node's folder is its own hostPath): it
   is moved to `rejected/` once, known as foreign before the costly field-by-field validation,
   and never read again; with foreign="leave" (a folder simulated nodes share, as in the fire
   drill) it stays for its own daemon and is remembered, unread, while it is unchanged. A file of
   another schema is rejected the same way. A JSON file that is not a screener alarm at all (not
   an object with the alarm's `schema` or `alarm_id` field: another program's file, an
   `alarm_dir` pointed at the wrong folder) is not ours to move: it is left where it is, logged
   once and remembered, unread, while it is unchanged;
4. an alarm is applied (handed to the lifecycle and its transition stored) and only then moved into
   `processed/`. A daemon that dies between the two finds the file again after a restart; the
   `already_applied` check (the alarm's id in the node's stored history), and the lifecycle itself
   (a second settled alarm does not move a quarantined node), make the second pass a no-op, so the
   alarm takes effect exactly once. A file whose name is already in `processed/` is a duplicate
   delivery and is only moved aside.

The cost of a pass is bounded by what is ours: a pass stops after `IntakeLimits.pass_s` of
monotonic time or `pass_bytes` read (always taking one file), files the size of an alarm go
before bulky ones, and between files `keep_going()` lets the daemon beat its liveness and stop
for SIGTERM. `processed/` and `rejected/` keep at most their count of files, none older than
`max_age_s`. The alarm folder must be owned by the daemon's uid (else the pass refuses, with the
reason in IntakeResult.refused, which the daemon turns into one line, a gauge and /readyz); an
aside folder that is not the daemon's own (a writer of the alarm group made it first, or may
write it) is renamed out of the way and made again.

Nothing here reads a clock of its own or talks to a store directly: the clock, `apply` and
`already_applied` are passed in (the daemon gives functions over its store).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.atomicfile import fsync_dir
from screener import boundedjson
from screener.agent.clock import ClockLike, as_clock
from screener.types import ALARM_CHECK_REASONS, MAX_ID_LEN, AlarmRecord, printable_text

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
SMALL_ALARM_BYTES = 96 * 1024  # an alarm with its largest evidence: taken before bulkier files
PRUNE_EVERY_S = 3600.0  # the aside folders are pruned at least this often (files age out)
MAX_CREATED = 1e11  # unix seconds, year 5138: the bound when no clock is known
MIN_CREATED = 946684800.0  # 2000-01-01: no alarm is older (unless the node's own clock is)
MAX_CLOCK_SKEW_S = 600.0  # how far ahead of the daemon's clock an alarm's `created` may be
# The straggler's figures (screener.audit.straggler), bounded by what they mean: a slowdown is
# t_i / median - 1 (0.25 = 25% slower; 1000 = a thousand and one times slower is no straggler
# but a stall), times are seconds of one step, k is a z-score threshold, w a count of steps.
STRAGGLER_BOUNDS: Mapping[str, tuple[float, float, bool]] = {  # name: (lo, hi, integer)
    "slowdown": (0.0, 1000.0, False),
    "score": (0.0, 1e9, False),
    "consecutive": (0, 2**31 - 1, True),
    "window": (1, 2**31 - 1, True),
    "median": (0.0, 86400.0, False),
    "duration": (0.0, 86400.0, False),
    "k": (0.0, 1e6, False),
    "rank": (0, 2**31 - 1, True),
}
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FIELDS = frozenset({"schema", "alarm_id", "check", "step", "settled", "suspect_ranks",
                     "suspect_nodes", "node", "job", "created", "evidence"})


@dataclass
class IntakeResult:
    """What one intake pass did, by alarm id / file name."""

    applied: list[AlarmRecord] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)  # alarm ids seen before: only moved aside
    rejected: list[str] = field(default_factory=list)  # file names moved to rejected/
    foreign: list[str] = field(default_factory=list)  # file names about another node
    not_ours: list[str] = field(default_factory=list)  # JSON files that are no alarm: left there
    failed: list[str] = field(default_factory=list)  # apply raised: left in place for the next pass
    stuck: list[str] = field(default_factory=list)  # could not be moved aside: skipped, remembered
    stalled: str = ""  # why the pass could not look at the folder at all ("" when it could)
    refused: str = ""  # why the pass refused the folder (not the daemon's own; "" when it did not)
    deferred: int = 0  # files left for the next pass: the pass's budget was spent, or a stop came
    read_bytes: int = 0  # bytes of alarm files this pass read

    @property
    def count(self) -> int:
        return len(self.applied) + len(self.duplicates) + len(self.rejected)


class _Stuck(Exception):
    """A file could not be moved aside; it is skipped until it changes."""


class _Refused(Exception):
    """The alarm folder, or one of its aside folders, is not the daemon's own."""


ApplyFn = Callable[[AlarmRecord], None]  # stores one alarm's effect; raises to keep the file
_Entry = tuple[str, Path, tuple[int, int], int]  # name, path, (inode, mtime_ns), size


@dataclass(frozen=True)
class IntakeLimits:
    """What one pass may spend, and what the aside folders keep.

    pass_s / pass_bytes: a pass stops after this much monotonic time or this many bytes of alarm
        files read (it always takes at least one file), and the rest wait for the next pass.
    processed_keep / rejected_keep: files kept in processed/ and rejected/ (oldest go first);
    max_age_s: files moved there longer ago than this go too (by ctime, which the move set).
    """

    pass_s: float = 2.0
    pass_bytes: int = 16 * 2**20
    processed_keep: int = 1000
    rejected_keep: int = 1000
    max_age_s: float = 14 * 86400.0


class AlarmIntake:
    """Reads, applies and moves aside the alarm files of one node.

    apply(record): store the alarm's effect (raise to leave the file for the next pass). None
        when each `run` is given its own (the daemon's records what it did in that pass's report).
    already_applied(record): True when a previous run stored this alarm's effect.
    limits: the pass's time and byte budget and what the aside folders keep (IntakeLimits);
        processed_keep, the older way to say limits.processed_keep, still works.
    foreign: "reject" moves a file about another node to rejected/ (it can never apply here);
        "leave" leaves it for that node's daemon and remembers it, unread, while it is unchanged.
    uid: the daemon's uid, which must own the alarm folder and its aside folders.
    clock: a clock.Clock (or one callable): the budget runs on its monotonic clock, the age of
        the aside folders' files on its wall clock.

    No exception from one file ends a pass: a file that cannot be read, parsed or validated is
    moved to rejected/; one that cannot even be moved is skipped and remembered (by name, inode
    and mtime) with one log line, and tried again only once it changes.
    """

    def __init__(self, directory: str | os.PathLike[str], node: str,
                 apply: Optional[ApplyFn] = None,
                 already_applied: Callable[[AlarmRecord], bool] = lambda r: False, *,
                 processed_keep: Optional[int] = None, limits: Optional[IntakeLimits] = None,
                 foreign: str = "reject", uid: Optional[int] = None,
                 clock: Optional[ClockLike] = None) -> None:
        if foreign not in ("reject", "leave"):
            raise ValueError(f"foreign must be reject or leave, not {foreign!r}")
        self.directory = Path(directory)
        self.node = node
        self.apply = apply
        self.already_applied = already_applied
        self.limits = limits or IntakeLimits()
        if processed_keep is not None:
            self.limits = replace(self.limits, processed_keep=processed_keep)
        self.foreign = foreign
        self.uid = os.geteuid() if uid is None else uid
        self.clock = as_clock(clock)
        self._foreign_seen: dict[str, tuple[int, int]] = {}  # name -> ident, left unread
        self._not_ours: dict[str, tuple[int, int]] = {}  # name -> ident: no alarm, left unread
        self._stuck: dict[str, tuple[int, int]] = {}  # name -> (inode, mtime_ns) when it stuck
        self._next_prune = 0.0  # monotonic

    @property
    def processed_keep(self) -> int:
        return self.limits.processed_keep

    @processed_keep.setter
    def processed_keep(self, keep: int) -> None:
        self.limits = replace(self.limits, processed_keep=keep)

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

    def _entries(self) -> list[_Entry]:
        """The alarm files waiting, in the order a pass takes them: files the size of an alarm
        first (oldest first by mtime, then name), then the bulky ones, so a flood of large files
        cannot hold back the node's own alarms behind the pass's budget."""
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
                entries.append((st.st_size > SMALL_ALARM_BYTES, st.st_mtime, e.name, Path(e.path),
                                (st.st_ino, st.st_mtime_ns), st.st_size))
        entries.sort(key=lambda x: x[:3])
        return [(name, path, ident, size) for _, _, name, path, ident, size in entries]

    def pending(self) -> list[Path]:
        """Alarm files waiting in the directory, in the order a pass takes them."""
        try:
            return [p for _, p, _, _ in self._entries()]
        except FileNotFoundError:
            return []

    def run(self, apply: Optional[ApplyFn] = None, *,
            keep_going: Callable[[], bool] = lambda: True) -> IntakeResult:
        """One pass over the directory, applying each new alarm with `apply` (default: the one
        given at construction), within the pass's budget; never raises, but for a missing
        `apply` (a bug of the caller).

        keep_going() is called between files: the daemon beats its liveness there and answers
        False once SIGTERM came, so neither waits for the rest of the pass.
        """
        apply = apply or self.apply
        if apply is None:
            raise TypeError("AlarmIntake.run needs an apply function: none was given")
        result = IntakeResult()
        try:
            self._own_folders()
            entries = self._entries()
        except _Refused as e:
            result.refused = str(e)
            return result
        except FileNotFoundError:
            entries = []
        except OSError as e:
            result.stalled = f"cannot list {self.directory}: {e.strerror or e}"
            log.error("alarm intake stalled: %s", result.stalled)
            return result
        self._take_within_budget(entries, result, apply, keep_going)
        present = {name for name, _, _, _ in entries}
        for memo in (self._stuck, self._foreign_seen, self._not_ours):  # gone: forget them
            for name in set(memo) - present:
                del memo[name]
        self._prune_aside(result)
        return result

    def _take_within_budget(self, entries: list[_Entry], result: IntakeResult, apply: ApplyFn,
                            keep_going: Callable[[], bool]) -> None:
        started = self.clock.monotonic()
        for i, (name, path, ident, size) in enumerate(entries):
            if not keep_going() or (i and (
                    result.read_bytes >= self.limits.pass_bytes
                    or self.clock.monotonic() - started >= self.limits.pass_s)):
                result.deferred = len(entries) - i
                log.info("alarm intake: %d file(s) left for the next pass (%d bytes read in "
                         "%.2f s)", result.deferred, result.read_bytes,
                         self.clock.monotonic() - started, extra={"event": "intake_deferred"})
                return
            if self._stuck.get(name) == ident:
                result.stuck.append(name)
                continue
            if self._foreign_seen.get(name) == ident:
                result.foreign.append(name)  # known, unchanged: not read again
                continue
            if self._not_ours.get(name) == ident:
                result.not_ours.append(name)  # no alarm, unchanged: not read again
                continue
            self._stuck.pop(name, None)
            self._foreign_seen.pop(name, None)
            self._not_ours.pop(name, None)
            result.read_bytes += min(size, MAX_ALARM_BYTES + 1)
            self._take_one(name, path, ident, result, apply)

    def _take_one(self, name: str, path: Path, ident: tuple[int, int], result: IntakeResult,
                  apply: ApplyFn) -> None:
        try:
            self._take(path, ident, result, apply)
        except _Stuck as e:
            self._stuck[name] = ident
            result.stuck.append(name)
            log.error("alarm file %s skipped: %s; it is tried again once it changes", name, e)
        except Exception as e:  # noqa: BLE001 - one file must never end the pass
            self._stuck[name] = ident
            result.stuck.append(name)
            log.error("alarm file %s skipped: %s: %s; it is tried again once it changes",
                      name, type(e).__name__, e)

    # --- one file -------------------------------------------------------------------------------

    def _take(self, path: Path, ident: tuple[int, int], result: IntakeResult,
              apply: ApplyFn) -> None:
        record, why, other = _read(path, self.node, now=self.clock.wall())
        if other is NOT_OURS:
            self._not_ours[path.name] = ident
            result.not_ours.append(path.name)
            log.warning("file %s in the alarm folder is not a screener alarm (no schema or "
                        "alarm_id field): left where it is, and not read again while it is "
                        "unchanged", path.name)
            return
        if other:
            self._foreign_file(path, ident, other, result)
            return
        if record is None:
            self._move(path, self.rejected_dir)
            result.rejected.append(path.name)
            log.warning("alarm file %s rejected: %s (moved to %s/)", path.name, why, REJECTED)
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

    def _foreign_file(self, path: Path, ident: tuple[int, int], other: str,
                      result: IntakeResult) -> None:
        """A file about another node: it can never apply here. Moved to rejected/ once (or, in a
        folder simulated nodes share, left and remembered unread while unchanged)."""
        result.foreign.append(path.name)
        if self.foreign == "leave":
            self._foreign_seen[path.name] = ident
            log.info("alarm file %s is about node %s, not %s: left for its own daemon",
                     path.name, other[:60], self.node)
            return
        self._move(path, self.rejected_dir)
        result.rejected.append(path.name)
        log.warning("alarm file %s rejected: it is about node %s, not %s, and can never apply "
                    "here (moved to %s/)", path.name, other[:60], self.node, REJECTED)

    # --- the folders ----------------------------------------------------------------------------

    def _own_folders(self) -> None:
        """Refuse (_Refused) an alarm folder the daemon's uid does not own; an aside folder that
        is not the daemon's own directory (a file squatting on its name, a folder a writer of the
        alarm group made first, a folder others may write) is renamed out of the way and made
        again, so that no writer can block the intake."""
        try:
            st = os.lstat(self.directory)
        except FileNotFoundError:
            return  # nothing dropped yet; the writers' first alarm makes it
        except OSError as e:
            raise _Refused(f"cannot inspect {self.directory}: {e.strerror or e}") from None
        if not stat.S_ISDIR(st.st_mode):
            return  # the listing fails and says so (stalled)
        if st.st_uid != self.uid:
            raise _Refused(f"{self.directory} is owned by uid {st.st_uid}, not the daemon's "
                           f"uid {self.uid}: alarms are not taken from a folder another user "
                           f"controls")
        for folder in (self.processed_dir, self.rejected_dir):
            try:
                self._folder(folder)
            except _Stuck as e:
                raise _Refused(str(e)) from None

    def _folder(self, folder: Path) -> None:
        """Make sure `folder` is a directory of the daemon's own that only it may write; anything
        else on its name is renamed to a dot name (never scanned)."""
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise _Stuck(f"cannot inspect {folder.name}/: {e.strerror or e}") from None
        if st is not None and not _own_dir(st, self.uid):
            what = "not-a-folder" if not stat.S_ISDIR(st.st_mode) else "not-ours"
            squat = folder.with_name(f".{folder.name}.{what}.{st.st_ino}")
            try:
                os.replace(folder, squat)
            except OSError as e:
                raise _Stuck(f"{folder.name} is not the daemon's own folder and cannot be "
                             f"renamed: {e.strerror or e}") from None
            log.warning("%s in the alarm folder was not the daemon's own folder (uid %d, mode "
                        "%o); renamed to %s", folder.name, st.st_uid, stat.S_IMODE(st.st_mode),
                        squat.name, extra={"event": "intake_squat"})
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
        fsync_dir(folder)
        fsync_dir(path.parent)

    def _prune_aside(self, result: IntakeResult) -> None:
        """Keep processed/ and rejected/ within their count and age: after a pass that moved
        files there, and otherwise once every PRUNE_EVERY_S (files also age out)."""
        now = self.clock.monotonic()
        moved = bool(result.applied or result.duplicates or result.rejected)
        if not moved and now < self._next_prune:
            return
        self._next_prune = now + PRUNE_EVERY_S
        for folder, keep in ((self.processed_dir, self.limits.processed_keep),
                             (self.rejected_dir, self.limits.rejected_keep)):
            try:
                _prune(folder, keep, self.clock.wall() - self.limits.max_age_s)
            except OSError as e:
                log.warning("cannot prune %s: %s", folder, e.strerror or e)


def _own_dir(st: os.stat_result, uid: int) -> bool:
    """Whether `st` is a directory `uid` owns that no group or other user may write."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022


def _prune(folder: Path, keep: int, older_than: float) -> None:
    """Remove from `folder` what is past the newest `keep` files or older than `older_than`, by
    when each was moved there: the rename set its ctime, which no writer can set (its mtime is
    the writer's to choose)."""
    files = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                try:
                    files.append((e.stat(follow_symlinks=False).st_ctime, e.name, Path(e.path)))
                except OSError:
                    continue
    except FileNotFoundError:
        return
    files.sort()
    cut = max(0, len(files) - keep)
    for i, (moved, _, p) in enumerate(files):
        if i < cut or moved < older_than:
            try:
                p.unlink()
            except OSError:
                pass


NOT_OURS = "\0not ours"  # _read's `other` for a JSON file that is no screener alarm at all


def is_ours(data: Any) -> bool:
    """Whether parsed JSON claims to be a screener alarm: an object with the alarm's `schema` or
    `alarm_id` field (a broken alarm of ours still has one; another program's file neither)."""
    return isinstance(data, Mapping) and ("schema" in data or "alarm_id" in data)


def _read(path: Path, node: str = "", *,
          now: Optional[float] = None) -> tuple[Optional[AlarmRecord], str, str]:
    """(the record in a file or None, why not, the other node it names or "", or NOT_OURS for
    a JSON file that is no alarm). A file that names another node under this schema is known as
    foreign before the field-by-field validation (the costly part of a bulky file): it can never
    apply here, whatever else is in it. now: the daemon's wall clock, for `created`."""
    try:
        raw = boundedjson.read_regular(path, MAX_ALARM_BYTES, follow_symlinks=False)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, "a symbolic link (alarm files must be regular files)", ""
        return None, f"unreadable: {e.strerror or e}", ""
    except ValueError as e:
        return None, str(e), ""
    try:
        data = boundedjson.loads(raw, max_bytes=MAX_ALARM_BYTES, max_depth=MAX_DEPTH)
    except ValueError as e:
        return None, str(e), ""
    if not is_ours(data):
        return None, "", NOT_OURS
    other = data.get("node") if isinstance(data, Mapping) else None
    if node and isinstance(other, str) and other and other != node \
            and data.get("schema") == AlarmRecord.SCHEMA:
        return None, "", other
    try:
        return validate(data, now=now), "", ""
    except ValueError as e:
        return None, str(e), ""


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


def validate(d: Any, *, now: Optional[float] = None) -> AlarmRecord:
    """An AlarmRecord from a parsed alarm file, every field checked; ValueError naming the first
    field that is wrong. Beyond AlarmRecord.from_dict: ids are bounded in length and charset,
    the job is printable text (types.printable_text), numbers are finite and bounded by what
    they mean (`created` no older than 2000 and at most MAX_CLOCK_SKEW_S ahead of `now`, the
    daemon's wall clock, time.time() when not given; a straggler's figures, STRAGGLER_BOUNDS),
    evidence is small and its strings encodable, and every suspect node named is the alarm's own
    node (an alarm may only ever speak about the node it was dropped on)."""
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
        printable_text(job, "alarm job", MAX_NAME_LEN)
    created = _created(d.get("created", 0.0), time.time() if now is None else now)
    evidence = d.get("evidence")
    if evidence is None:
        evidence = {}
    if not isinstance(evidence, Mapping):
        raise ValueError("alarm evidence is not an object")
    size = len(json.dumps(evidence))
    if size > MAX_EVIDENCE_BYTES:
        raise ValueError(f"alarm evidence is {size} bytes of JSON (at most {MAX_EVIDENCE_BYTES})")
    _encodable(evidence)
    if d["check"] == "straggler":
        _straggler_figures(evidence)
    return AlarmRecord.from_dict({**d, "created": float(created), "evidence": dict(evidence)})


def _created(created: Any, now: float) -> float:
    """`created` (0 or absent: not known) as a unix time between 2000 (0 while the daemon's own
    clock is before then: a node whose clock was reset cannot judge) and now plus a small skew
    (the writer ran on this node, on this clock)."""
    if created is None:
        return 0.0
    if not isinstance(created, (int, float)) or isinstance(created, bool) \
            or not math.isfinite(created):
        raise ValueError(f"alarm created {str(created)[:40]} is not a unix time")
    if created == 0:
        return 0.0
    lo = MIN_CREATED if now >= MIN_CREATED else 0.0
    hi = min(MAX_CREATED, now + MAX_CLOCK_SKEW_S)
    if not lo <= created <= hi:
        raise ValueError(f"alarm created {created:.0f} is not a unix time in {lo:.0f}..{hi:.0f} "
                         f"(not before 2000, at most {MAX_CLOCK_SKEW_S:.0f} s ahead of this "
                         f"node's clock)")
    return float(created)


def _encodable(evidence: Mapping[str, Any]) -> None:
    """Every key and string in the evidence can be written as UTF-8 (no lone surrogate, which
    breaks every store, log line and terminal that meets it later); keys are printable text.
    String values may hold newlines (an error message): whoever prints them escapes them."""
    stack: list[Any] = [evidence]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            for k, x in v.items():
                printable_text(k, "alarm evidence key", 256)
                stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"alarm evidence holds a lone surrogate (U+{ord(v[e.start]):04X})"
                                 f", which no UTF-8 text can carry") from None


def _straggler_figures(evidence: Mapping[str, Any]) -> None:
    """A straggler's figures, when present, are numbers in the range of what they mean."""
    for key, (lo, hi, integer) in STRAGGLER_BOUNDS.items():
        if key not in evidence:
            continue
        v = evidence[key]
        kind = (int,) if integer else (int, float)
        if not isinstance(v, kind) or isinstance(v, bool) or not math.isfinite(v) \
                or not lo <= v <= hi:
            raise ValueError(f"alarm straggler {key} {str(v)[:40]} is not "
                             f"{'an integer' if integer else 'a number'} in {lo:g}..{hi:g}")


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


def applied_in_history(history: Sequence[Any], alarm_id: str) -> bool:
    """Whether a stored transition's evidence carries this alarm (the lifecycle puts the whole
    AlarmRecord under evidence["alarm"])."""
    for t in history:
        ev = getattr(t, "evidence", None) or {}
        alarm = ev.get("alarm") if isinstance(ev, Mapping) else None
        if isinstance(alarm, Mapping) and alarm.get("alarm_id") == alarm_id:
            return True
    return False
