"""Kernel-log Xid parser: reads NVRM Xid lines from /dev/kmsg or a log file, each line once.

It serves where NVML events are unavailable (an older driver, a GPU that cannot register events, a
GPU already gone). The driver logs, in its current form::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

and in older forms without ``pid=``/``name=``, with ``pid='<unknown>'``, or without the ``PCI:``
prefix. Only kernel messages count: a record that user space wrote into /dev/kmsg (facility not 0),
a syslog line whose tag is not ``kernel:``, an NVSwitch ``SXid`` or any other ``NVRM:`` line is not
an Xid.

The reader keeps its position so that a line is counted once, across restarts too, in a small JSON
state file (written to a temporary name, then renamed):

- /dev/kmsg (a character device): the sequence number of the last record, with the boot id, since
  sequence numbers start again at every boot;
- a plain file: the byte offset with the file's inode and device; a different inode or a file
  shorter than the offset means it was rotated or truncated, and reading starts again at 0.

With no state yet, ``first_read="all"`` reports what is already there and ``"end"`` only what
arrives after the reader starts (the daemon's start).

Hostile paths are refused, never read forever: a character device must be /dev/kmsg itself
(major 1, minor 11: /dev/zero would otherwise feed an endless stream of records), anything else
must be a regular file (opened with O_NONBLOCK so a FIFO cannot block the open). One read takes
at most MAX_RECORDS records or MAX_FILE_BYTES bytes; the rest is read next time.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from screener.atomicfile import write_atomic
from screener import boundedjson
from screener.errors import BadInputError, ScreenerError
from screener.health.verdict.snapshot import XidEvent, normalize_pci
from screener.settings.health import DEFAULT_BOOT_ID, DEFAULT_KMSG

log = logging.getLogger(__name__)

_READ_SIZE = 16384  # /dev/kmsg returns one record per read and EINVAL for a short buffer
KMSG_DEVICE = (1, 11)  # major, minor of /dev/kmsg on Linux
MAX_RECORDS = 100_000  # per read_new(): the ring buffer holds far fewer
MAX_FILE_BYTES = 64 * 1024 * 1024  # per read_new() of a plain log file
MAX_LINE_BYTES = 16384  # a longer line is not an Xid line (and /dev/kmsg records are shorter)

_XID_RE = re.compile(
    r"^NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\):"
    r" (?P<code>\d{1,5})(?:,\s*(?P<rest>.*))?$")
_PID_RE = re.compile(r"^pid=(?P<pid>'?<?[^,]*?>?'?)(?:,\s*|$)")
_NAME_RE = re.compile(r"^name=(?P<name>[^,]*)(?:,\s*|$)")
# /dev/kmsg record: "prio,seq,usec,flags[,...];message"
# (bounded digit runs: a hostile "record" of 5,000 digits must not reach int())
_KMSG_RE = re.compile(r"^(?P<prio>\d{1,4}),(?P<seq>\d{1,20}),(?P<usec>\d{1,20}),[^;]*;(?P<msg>.*)$")
# syslog / journal: "<date> <host> kernel: [ 12.345678] message"
_SYSLOG_RE = re.compile(r"^\S.*?\s(?P<tag>[\w./-]+(?:\[\d+\])?):\s(?P<msg>.*)$")
# dmesg: "[   12.345678] message" or "[Mon Oct  1 12:00:00 2024] message"
_DMESG_RE = re.compile(r"^\[[^\]]*\]\s?(?P<msg>.*)$")


class KmsgUnavailable(ScreenerError):
    """The kernel log cannot be read here (missing, or no permission): no Xids from it."""


def parse_xid_message(message: str, source: str = "kmsg", raw: str = "") -> Optional[XidEvent]:
    """Parse the message part of one kernel-log entry; None unless it is an NVRM Xid line."""
    m = _XID_RE.match(message.rstrip("\r\n"))
    if m is None:
        return None
    rest = m.group("rest") or ""
    pid: Optional[int] = None
    name: Optional[str] = None
    pm = _PID_RE.match(rest)
    if pm:
        token = pm.group("pid").strip("'")
        pid = int(token) if token.isascii() and token.isdigit() and len(token) <= 10 else None
        rest = rest[pm.end():]
    nm = _NAME_RE.match(rest)
    if nm:
        name = nm.group("name").strip() or None
        if name == "<unknown>":
            name = None
        rest = rest[nm.end():]
    # Bounded: a hostile line must not put megabytes into a finding's evidence.
    return XidEvent(code=int(m.group("code")), source=source,
                    pci_bus_id=normalize_pci(m.group("pci")), pid=pid,
                    process=name[:64] if name else None, text=rest.strip()[:512],
                    raw=(raw or message)[:1024])


def parse_line(line: str) -> Optional[XidEvent]:
    """Parse one line of a kernel log in any of the usual layouts; None unless a kernel Xid line.

    Layouts: a /dev/kmsg record (kernel facility only), syslog/journal with the ``kernel:`` tag,
    dmesg with a ``[timestamp]`` prefix, or the bare message.
    """
    line = line.rstrip("\r\n")
    raw = line
    m = _KMSG_RE.match(line)
    if m:
        if int(m.group("prio")) >> 3 != 0:  # written by user space, not by the kernel
            return None
        return parse_xid_message(m.group("msg"), raw=raw)
    if line.startswith("NVRM: "):
        return parse_xid_message(line, raw=raw)
    m = _DMESG_RE.match(line)
    if m:
        return parse_xid_message(m.group("msg"), raw=raw)
    m = _SYSLOG_RE.match(line)
    if m and m.group("tag") == "kernel":
        msg = m.group("msg")
        d = _DMESG_RE.match(msg)  # "kernel: [ 12.3] NVRM: ..."
        return parse_xid_message(d.group("msg") if d else msg, raw=raw)
    return None


@dataclass
class _State:
    kind: str = ""  # "kmsg" or "file"
    boot_id: str = ""
    seq: Optional[int] = None
    inode: Optional[int] = None
    device: Optional[int] = None
    offset: int = 0

    @classmethod
    def load(cls, path: Optional[str]) -> Optional["_State"]:
        if not path or not os.path.exists(path):
            return None
        try:
            d = boundedjson.loads(boundedjson.read_regular(path, 64 * 1024), max_bytes=64 * 1024,
                                  max_depth=4)
            ints = {k: d.get(k) for k in ("seq", "inode", "device", "offset")}
            for k, v in ints.items():
                if v is not None and (type(v) is not int or not 0 <= v < 2**64):
                    raise ValueError(f"{k} {str(v)[:40]} is not a position")
            return cls(kind=str(d.get("kind", ""))[:16], boot_id=str(d.get("boot_id", ""))[:64],
                       seq=ints["seq"], inode=ints["inode"], device=ints["device"],
                       offset=ints["offset"] or 0)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            # A corrupt state file must not stop Xid reading; start over and say so.
            log.warning("ignoring unreadable kernel-log state %s: %s", path, e)
            return None

    def save(self, path: Optional[str]) -> None:
        if not path:
            return
        d = {"kind": self.kind, "boot_id": self.boot_id, "seq": self.seq, "inode": self.inode,
             "device": self.device, "offset": self.offset}
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            write_atomic(path, json.dumps(d))
        except OSError as e:
            raise ScreenerError(f"cannot write kernel-log state {path}: {e}") from e


@dataclass(frozen=True)
class KmsgRead:
    """What one read_new() found."""

    events: tuple[XidEvent, ...]
    lines: int  # entries read (not counting ones skipped as already seen)
    restarted: bool = False  # rotation, truncation or a new boot made it start again
    errors: tuple[str, ...] = ()  # our own failures that did not stop the read (saving state)


class KernelLogReader:
    """Reads new NVRM Xid lines from /dev/kmsg or a log file; remembers where it stopped.

    ``opener`` (tests) returns a file descriptor to read kmsg records from instead of opening
    ``path``; each read on it must return one record, and EAGAIN when there are no more, as
    /dev/kmsg does.
    """

    def __init__(self, path: str = DEFAULT_KMSG, *, state_file: Optional[str] = None,
                 first_read: str = "all", boot_id_path: str = DEFAULT_BOOT_ID,
                 opener: Optional[Callable[[], int]] = None, user_input: bool = False) -> None:
        if first_read not in ("all", "end"):
            raise ValueError(f"first_read must be 'all' or 'end', not {first_read!r}")
        self.path = path
        self.state_file = state_file
        self.first_read = first_read
        self.boot_id_path = boot_id_path
        self._opener = opener
        self._user_input = user_input  # a path the user named: missing is bad input, exit 2
        self._state: Optional[_State] = _State.load(state_file)
        self._fd: Optional[int] = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "KernelLogReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unavailable(self, e: OSError) -> ScreenerError:
        msg = f"{self.path}: {e.strerror or e}"
        if self._user_input:
            return BadInputError(f"kernel log {msg}")
        return KmsgUnavailable(f"kernel log unavailable: {msg}")

    def _is_kmsg(self) -> bool:
        if self._opener is not None:
            return True
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise self._unavailable(e) from e
        if stat.S_ISCHR(st.st_mode):
            if (os.major(st.st_rdev), os.minor(st.st_rdev)) != KMSG_DEVICE:
                raise self._refused("a character device that is not /dev/kmsg")
            return True
        if not stat.S_ISREG(st.st_mode):
            raise self._refused("neither /dev/kmsg nor a regular file")
        return False

    def _refused(self, why: str) -> ScreenerError:
        if self._user_input:
            return BadInputError(f"kernel log {self.path}: {why}")
        return KmsgUnavailable(f"kernel log unavailable: {self.path}: {why}")

    def read_new(self) -> KmsgRead:
        """Xid events logged since the last read (or per ``first_read`` on the very first)."""
        result = self._read_kmsg() if self._is_kmsg() else self._read_file()
        if self._state is not None:
            try:
                self._state.save(self.state_file)
            except ScreenerError as e:
                # The Xids were read and must still be reported; only the position is at risk
                # (a restart may report them again), which is our failure to surface.
                result = dataclasses.replace(result, errors=result.errors + (str(e),))
        return result

    # --- /dev/kmsg ------------------------------------------------------------------------------

    def _boot_id(self) -> str:
        try:
            with open(self.boot_id_path, encoding="ascii") as f:
                return f.read().strip()
        except OSError:
            return ""

    def _records(self) -> Iterator[str]:
        if self._fd is None:
            try:
                self._fd = (self._opener() if self._opener is not None
                            else os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))
            except OSError as e:
                raise self._unavailable(e) from e
        for _ in range(MAX_RECORDS):
            try:
                chunk = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EPIPE:  # the ring buffer overwrote records we had not read
                    log.warning("kernel log: records were overwritten before they were read")
                    continue
                if e.errno == errno.EAGAIN:
                    return
                raise self._unavailable(e) from e
            if not chunk:
                return
            yield chunk.decode("utf-8", errors="replace")

    def _read_kmsg(self) -> KmsgRead:
        boot = self._boot_id()
        st = self._state
        restarted = False
        after: Optional[int] = None
        skip_history = False
        if st is None or st.kind != "kmsg":
            skip_history = self.first_read == "end"
        elif st.boot_id != boot:
            restarted = True  # a new boot: sequence numbers started again, every record is new
        else:
            after = st.seq
        events, lines, last = [], 0, after
        for record in self._records():
            head = record.split("\n", 1)[0]  # continuation lines (" KEY=value") follow
            m = _KMSG_RE.match(head)
            if m is None:
                continue
            seq = int(m.group("seq"))
            if after is not None and seq <= after:
                continue
            last = seq if last is None else max(last, seq)
            lines += 1
            ev = None if skip_history else parse_line(head)
            if ev is not None:
                events.append(ev)
        self._state = _State(kind="kmsg", boot_id=boot, seq=last)
        return KmsgRead(events=tuple(events), lines=lines, restarted=restarted)

    # --- plain files ----------------------------------------------------------------------------

    def _read_file(self) -> KmsgRead:
        try:
            f = os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK), "rb")
        except OSError as e:
            raise self._unavailable(e) from e
        with f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):  # swapped for a FIFO or a device since the stat
                raise self._refused("not a regular file")
            st = self._state
            restarted = False
            if st is None or st.kind != "file":
                offset = info.st_size if self.first_read == "end" else 0
            elif (st.inode, st.device) != (info.st_ino, info.st_dev) or info.st_size < st.offset:
                offset, restarted = 0, True  # rotated or truncated: the content is new
            else:
                offset = st.offset
            f.seek(offset)
            data = f.read(MAX_FILE_BYTES)
        # Only complete lines: a line still being written is read next time, whole.
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) >= MAX_FILE_BYTES:
            end = len(data)  # one "line" longer than a whole read is not a log line: skip it
        events, lines = [], 0
        for raw in data[:end].splitlines():
            lines += 1
            if len(raw) > MAX_LINE_BYTES:  # no driver line is this long; not worth a regex
                continue
            ev = parse_line(raw.decode("utf-8", errors="replace"))
            if ev is not None:
                events.append(ev)
        self._state = _State(kind="file", inode=info.st_ino, device=info.st_dev,
                             offset=offset + end)
        return KmsgRead(events=tuple(events), lines=lines, restarted=restarted)
