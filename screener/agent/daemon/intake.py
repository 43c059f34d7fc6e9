"""Alarm intake: take each alarm file in SCREENER_ALARM_DIR exactly once.

In-job checks (screener.audit) drop one JSON file per alarm into the alarm directory of the node
the alarm is about (temp name, then rename). The daemon on that node reads them here:

1. every `*.json` entry not starting with a dot (a dot file is a write still in progress) is
   opened with O_NOFOLLOW | O_NONBLOCK (a symlink or a FIFO swapped in after the scan is refused,
   never followed or waited on), checked with fstat to be a regular file under MAX_ALARM_BYTES,
   parsed within bounds (screener.boundedjson: depth, integer length, no NaN or infinity) and
   validated field by field (`validate`, from the alarm file's contract screener.alarmfile,
   which the writer in screener.audit shares);
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
import logging
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.atomicfile import fsync_dir
from screener import boundedjson
from screener.agent.daemon.clock import ClockLike, as_clock
# The alarm file's rules (its fields, check names and bounds, `validate`, `is_ours`) are the
# contract's, shared with the writer in screener.audit.
from screener.alarmfile import (MAX_ALARM_BYTES, MAX_DEPTH, SCHEMA, AlarmRecord, is_ours,
                                validate)

# The name the daemon's JSON log lines have always carried (log queries filter on it), not the
# module's path since the move into subpackages.
log = logging.getLogger("screener.intake")

PROCESSED = "processed"
REJECTED = "rejected"
SMALL_ALARM_BYTES = 96 * 1024  # an alarm with its largest evidence: taken before bulkier files
PRUNE_EVERY_S = 3600.0  # the aside folders are pruned at least this often (files age out)


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
            and data.get("schema") == SCHEMA:
        return None, "", other
    try:
        return validate(data, now=now), "", ""
    except ValueError as e:
        return None, str(e), ""


def applied_in_history(history: Sequence[Any], alarm_id: str) -> bool:
    """Whether a stored transition's evidence carries this alarm (the lifecycle puts the whole
    AlarmRecord under evidence["alarm"])."""
    for t in history:
        ev = getattr(t, "evidence", None) or {}
        alarm = ev.get("alarm") if isinstance(ev, Mapping) else None
        if isinstance(alarm, Mapping) and alarm.get("alarm_id") == alarm_id:
            return True
    return False
