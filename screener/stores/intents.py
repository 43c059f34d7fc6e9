"""The intent journal: what a transition is about to write, durable before its first API write.

KubeStore writes one transition as several API writes: the budget slot or registration, the Node
(label, taint, summary), the history ConfigMap, the condition and the Event. A process that dies
between two of them (kill -9, the OOM killer, a power cut) left half a transition (issue 36.7: of
35 kills mid-quarantine, 2 left the label, taint and slot with the condition False and no Event),
and nothing finished it: the spool holds transitions whose writes failed, not those of a process
that died, and the next pass found the alarm in the node's summary and set it aside as done.

So before its first write a transition is written here, whole and fsync'ed (screener.atomicfile:
a reader sees all of the file or nothing, and a file reported written survives a power cut), and
it is removed after its last write, or once it is in the spool (which finishes it by itself).
A file whose writer is gone is an unfinished transition: the store finishes it
(KubeStore.finish_intents) at the daemon's start and at the start of every pass, before anything
else reads the node. Every write of a transition is safe to do again (the Node patch to the
intended label and taint, the history entry and the Event keyed by the transition's id, the
condition to the intended status, at most one slot per node), so finishing a transition that had
got further than its file shows writes only what is missing.

One folder per state directory, next to the spool (`intents/`), shared by every screener process
that uses it (two daemon pods on one node share the host's folder): `<id>.json` is a decision's
transitions in order (the first one's id names it); `<id>.lock` is held (flock) by the process
writing them for as long as it does. The kernel drops a lock when its process dies, however it
dies, and a lock is the same across PID namespaces, so a finisher takes it without waiting: held
means the writer is still at work and its file is left alone; taken, the file (if still there)
is the finisher's to complete. A file that does not parse (not one this code wrote) is renamed
`<name>.unreadable` with one log line, never a traceback.

Imports the standard library, screener's errors and the lifecycle's records only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterator, Optional, Sequence

from screener import boundedjson
from screener.atomicfile import fsync_dir, write_atomic
from screener.errors import BadInputError
from screener.lifecycle.records import Transition

log = logging.getLogger("screener.stores.kube")

SCHEMA = "screener.intent/v1"
MAX_INTENT_BYTES = 1024 * 1024  # a decision's transitions, evidence within 64 KiB each
_NAME = re.compile(r"^[0-9a-f]{16}\.json$")


class Intent:
    """One decision's transitions in flight: its file, and its writer's lock while held.

    `done()` removes the file (the transitions are written, or handed to the spool); `release()`
    drops the lock and leaves whatever is still on file for a finisher (idempotent).
    """

    def __init__(self, journal: "IntentJournal", key: str, transitions: Sequence[Transition],
                 lock_fd: Optional[int]) -> None:
        self.journal, self.key = journal, key
        self.transitions = tuple(transitions)
        self._fd = lock_fd

    @property
    def path(self) -> Optional[Path]:
        return self.journal.folder / f"{self.key}.json" if self.journal.folder else None

    def done(self) -> None:
        """The transitions are written (or spooled): nothing is left to finish."""
        path = self.path
        if path is None:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fsync_dir(path.parent)

    def release(self) -> None:
        """Drop the writer's lock; a file still there is an unfinished transition."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        folder = self.journal.folder
        if folder is not None and not (folder / f"{self.key}.json").exists():
            try:  # removed while still held, so no finisher can take a lock on a stale file
                os.unlink(folder / f"{self.key}.lock")
            except FileNotFoundError:
                pass
        os.close(fd)

    def __enter__(self) -> "Intent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class IntentJournal:
    """The folder of intents (None: in memory, nothing durable: a store without a spool file)."""

    def __init__(self, folder: Optional[os.PathLike[str] | str]) -> None:
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None:
            try:
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:
                raise BadInputError(f"{self.folder}: cannot create the intent journal: "
                                    f"{e.strerror or e}") from e

    def write(self, transitions: Sequence[Transition]) -> Intent:
        """Put a decision's transitions on file, durably, holding their lock: call before the
        first API write of the first one. Raises OSError when the file cannot be written (the
        transition is not written either: nothing is done that could not be finished)."""
        key = transitions[0].id
        if self.folder is None:
            return Intent(self, key, transitions, None)
        fd = self._lock(key, wait=True)
        assert fd is not None
        try:
            body = {"schema": SCHEMA, "transitions": [t.to_dict() for t in transitions]}
            write_atomic(self.folder / f"{key}.json", json.dumps(body, sort_keys=True))
        except BaseException:
            os.close(fd)
            raise
        return Intent(self, key, transitions, fd)

    def unfinished(self) -> Iterator[Intent]:
        """The intents whose writer is gone, oldest first, each with its lock taken (release or
        done it); intents still being written by a live process are skipped."""
        if self.folder is None:
            return
        try:
            names = [e for e in os.scandir(self.folder) if _NAME.match(e.name)]
        except OSError as e:
            log.error("cannot read the intent journal %s: %s", self.folder, e.strerror or e)
            return
        names.sort(key=lambda e: _mtime(e.path))
        for entry in names:
            key = entry.name[:-len(".json")]
            fd = self._lock(key, wait=False)
            if fd is None:
                continue  # its writer is alive and at work
            intent = Intent(self, key, (), fd)
            try:
                transitions = self._read(Path(entry.path))
            except FileNotFoundError:
                intent.release()  # finished meanwhile by its writer
                continue
            except (OSError, ValueError) as e:
                self._set_aside(Path(entry.path), e)
                intent.release()
                continue
            intent.transitions = tuple(transitions)
            yield intent

    def pending(self, node: str) -> list[Transition]:
        """The transitions on file for `node` (finished or not yet, live writer or not), oldest
        first: what the store decides on while the API is out of reach, besides the spool."""
        if self.folder is None:
            return []
        out: list[Transition] = []
        try:
            paths = [Path(e.path) for e in os.scandir(self.folder) if _NAME.match(e.name)]
        except OSError:
            return []
        for path in paths:
            try:
                out.extend(t for t in self._read(path) if t.node == node)
            except (OSError, ValueError):
                continue
        return sorted(out, key=lambda t: t.time)

    def __len__(self) -> int:
        if self.folder is None:
            return 0
        try:
            return sum(1 for e in os.scandir(self.folder) if _NAME.match(e.name))
        except OSError:
            return 0

    def _lock(self, key: str, *, wait: bool) -> Optional[int]:
        """The lock of `key` (a file descriptor), or None when another process holds it."""
        assert self.folder is not None
        path = self.folder / f"{key}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return None
                raise
            # The holder before us may have removed the lock file as it let go: a lock on an
            # unlinked file guards nothing, so take the one the folder names now.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def _read(self, path: Path) -> list[Transition]:
        with open(path, "rb") as f:
            raw = f.read(MAX_INTENT_BYTES + 1)
        data = boundedjson.loads(raw, max_bytes=MAX_INTENT_BYTES)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA \
                or not isinstance(data.get("transitions"), list) or not data["transitions"]:
            raise ValueError(f"not a {SCHEMA} record")
        out = []
        for item in data["transitions"]:
            if not isinstance(item, dict):
                raise ValueError("a transition that is not an object")
            out.append(Transition.from_dict(item))
        if out[0].id != path.name[:-len(".json")]:
            raise ValueError("named after another transition")
        return out

    def _set_aside(self, path: Path, why: BaseException) -> None:
        try:
            os.replace(path, path.with_name(path.name + ".unreadable"))
        except OSError:
            pass
        log.error("intent %s is unreadable (%s): renamed to %s.unreadable; nothing of it is "
                  "finished", path.name, why, path.name)

    def __repr__(self) -> str:
        return f"IntentJournal({str(self.folder) if self.folder else None!r})"


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


__all__ = ["Intent", "IntentJournal"]
