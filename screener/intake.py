"""Alarm intake: take each alarm file in SCREENER_ALARM_DIR exactly once.

In-job checks (screener.audit) drop one JSON file per alarm into the alarm directory of the node
the alarm is about (temp name, then rename). The daemon on that node reads them here:

1. every `*.json` file not starting with a dot (a dot file is a write still in progress) is read
   and parsed as a screener.types.AlarmRecord;
2. a file that cannot be parsed, or that is not an alarm, is moved into `rejected/` with one log
   line, and the intake goes on with the next file;
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

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.types import AlarmRecord

log = logging.getLogger(__name__)

PROCESSED = "processed"
REJECTED = "rejected"
MAX_ALARM_BYTES = 4 * 1024 * 1024  # an alarm is a few KiB; anything this large is not one


@dataclass
class IntakeResult:
    """What one intake pass did, by alarm id / file name."""

    applied: list[AlarmRecord] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)  # alarm ids seen before: only moved aside
    rejected: list[str] = field(default_factory=list)  # file names moved to rejected/
    foreign: list[str] = field(default_factory=list)  # file names about another node, left alone
    failed: list[str] = field(default_factory=list)  # apply raised: left in place for the next pass

    @property
    def count(self) -> int:
        return len(self.applied) + len(self.duplicates) + len(self.rejected)


class AlarmIntake:
    """Reads, applies and moves aside the alarm files of one node.

    apply(record): store the alarm's effect (raise to leave the file for the next pass).
    already_applied(record): True when a previous run stored this alarm's effect.
    processed_keep: how many files processed/ keeps (the oldest go first); 0 keeps none.
    """

    def __init__(self, directory: str | os.PathLike[str], node: str,
                 apply: Callable[[AlarmRecord], None],
                 already_applied: Callable[[AlarmRecord], bool] = lambda r: False, *,
                 processed_keep: int = 1000) -> None:
        self.directory = Path(directory)
        self.node = node
        self.apply = apply
        self.already_applied = already_applied
        self.processed_keep = processed_keep
        self._foreign_logged: set[str] = set()

    @property
    def processed_dir(self) -> Path:
        return self.directory / PROCESSED

    @property
    def rejected_dir(self) -> Path:
        return self.directory / REJECTED

    def pending(self) -> list[Path]:
        """Alarm files waiting in the directory, oldest first (by mtime, then name)."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        files = []
        for e in entries:
            if e.name.startswith(".") or not e.name.endswith(".json"):
                continue
            try:
                if not e.is_file(follow_symlinks=False):
                    continue
                files.append((e.stat(follow_symlinks=False).st_mtime, e.name, Path(e.path)))
            except FileNotFoundError:  # taken by someone else in between
                continue
        return [p for _, _, p in sorted(files)]

    def run(self) -> IntakeResult:
        """One pass over the directory."""
        result = IntakeResult()
        for path in self.pending():
            self._take(path, result)
        if result.applied or result.duplicates:
            self._prune()
        return result

    # --- one file -------------------------------------------------------------------------------

    def _take(self, path: Path, result: IntakeResult) -> None:
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
        if (self.processed_dir / path.name).exists() or self.already_applied(record):
            self._move(path, self.processed_dir)
            result.duplicates.append(record.alarm_id)
            log.info("alarm %s was applied before; moved aside without applying it again",
                     record.alarm_id)
            return
        try:
            self.apply(record)
        except Exception as e:  # noqa: BLE001 - the file stays and is tried again next pass
            result.failed.append(path.name)
            log.error("alarm %s not applied, will retry: %s: %s", record.alarm_id,
                      type(e).__name__, e)
            return
        # Only now, with the transition stored, is the file moved aside.
        self._move(path, self.processed_dir)
        result.applied.append(record)

    def _move(self, path: Path, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / path.name
        try:
            os.replace(path, target)
        except FileNotFoundError:
            pass  # already moved by an earlier attempt
        _fsync_dir(folder)
        _fsync_dir(path.parent)

    def _prune(self) -> None:
        try:
            files = sorted(self.processed_dir.iterdir(), key=lambda p: (p.stat().st_mtime, p.name))
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
        if path.stat().st_size > MAX_ALARM_BYTES:
            return None, f"larger than {MAX_ALARM_BYTES} bytes"
        data = json.loads(path.read_bytes())
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"not JSON: {e}"
    try:
        record = AlarmRecord.from_dict(data)
    except (ValueError, TypeError) as e:
        return None, str(e)
    if not record.alarm_id or not record.node:
        return None, "alarm_id and node must not be empty"
    return record, ""


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
