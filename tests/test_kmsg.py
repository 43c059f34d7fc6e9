"""Kernel-log Xid parser and reader: every form of the line, look-alikes, and reading each line once
(plain files with rotation and truncation, /dev/kmsg records with sequence numbers and boot ids)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import time

import pytest

from screener.errors import BadInputError
from screener.health.sources.kmsg import KernelLogReader, KmsgUnavailable, parse_line

DATA = pathlib.Path(__file__).parent / "data"
SAMPLE = DATA / "kmsg_sample.log"

# (code, pci, pid, process) of every real Xid line in the sample, in order.
EXPECTED = [
    (79, "0000:18:00", 1234, "python3"),
    (48, "0000:28:00", None, None),  # pid='<unknown>', name=<unknown>
    (63, "0000:28:00", 1896, None),  # pid without name
    (13, "0000:38:00", None, None),  # oldest form: no "PCI:", no pid
    (31, "0000:38:00", 5678, "train.py"),
    (94, "0000:48:00", 2001, "python3"),  # syslog with kernel: tag and dmesg stamp
    (95, "0000:48:00", 2001, "python3"),  # ISO syslog with kernel: tag
    (74, "0000:58:00", 3003, "python3"),  # /dev/kmsg record, PCI function suffix
    (119, "0000:68:00", 4004, "nvidia-smi"),  # bare message
    (999, "0000:78:00", 7, "x"),  # unknown code: still parsed
    (154, "0000:18:00", None, None),  # no pid at all
]


def _parse_file(path):
    events = []
    for line in path.read_text().splitlines():
        ev = parse_line(line)
        if ev is not None:
            events.append(ev)
    return events


def test_sample_log_every_form_of_the_xid_line():
    events = _parse_file(SAMPLE)
    assert [(e.code, e.pci_bus_id, e.pid, e.process) for e in events] == EXPECTED
    assert events[0].text == "GPU has fallen off the bus."
    assert events[4].text.startswith("Ch 00000008, intr 00000000. MMU Fault")
    assert events[3].text == "0003 00000000 0000c397 00001b0c 1000f010 00000000"
    assert all(e.source == "kmsg" and e.raw for e in events)


def test_lookalike_lines_are_not_xids():
    lookalikes = [
        # user space wrote it, not the kernel
        "Mar 10 12:00:09 gpu-node-7 python3[2222]: NVRM: Xid (PCI:0000:18:00): 79, pid=2222, "
        "name=python3, GPU has fallen off the bus.",
        "12,5002,1031000000,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=logger, injected",
        # NVSwitch SXid, other NVRM lines, quoted text, bad code
        "[ 1032.000012] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32",
        "[ 1033.000013] NVRM: Xid message suppressed: too many Xids in a short time",
        "[ 1034.000014] audit: type=1105 msg='cmd=grep \"NVRM: Xid (PCI:0000:18:00): 79, x\"'",
        "[ 1035.000015] NVRM: XidCatalog: 79 entries loaded",
        "[ 1036.000016] NVRM: Xid (PCI:0000:18:00): seventy-nine, GPU has fallen off the bus.",
        "[ 1037.000017] NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x23:0x65:1426)",
        "Mar 10 12:00:10 gpu-node-7 kernel: [ 1038.0] some driver said NVRM: Xid "
        "(PCI:0000:18:00): 79, pid=1, name=x, quoted",
        "NVRM: Xid (PCI:zzzz:18:00): 79, pid=1, name=x, bad address",
        "",
    ]
    for line in lookalikes:
        assert parse_line(line) is None, line
    # and the sample file holds exactly the expected ones despite its look-alikes
    raw = SAMPLE.read_text()
    assert "python3[2222]" in raw and "SXid" in raw and "12,5002" in raw
    assert len(_parse_file(SAMPLE)) == len(EXPECTED)


# --- plain files ------------------------------------------------------------------------------


def test_file_reader_counts_each_line_once_across_restarts(tmp_path):
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE, log)
    state = tmp_path / "state" / "kmsg.json"
    r = KernelLogReader(str(log), state_file=str(state))
    first = r.read_new()
    assert [e.code for e in first.events] == [c for c, *_ in EXPECTED]
    assert r.read_new().events == ()
    with open(log, "a") as f:
        f.write("[ 2000.0] NVRM: Xid (PCI:0000:18:00): 62, pid=9, name=x, PMU halt\n")
        f.write("[ 2001.0] NVRM: Xid (PCI:0000:18:00): 64, pid=9, name=x, ")  # still being written
    assert [e.code for e in r.read_new().events] == [62]
    with open(log, "a") as f:
        f.write("Row remapping failed\n")
    ev = r.read_new().events
    assert [(e.code, e.text) for e in ev] == [(64, "Row remapping failed")]
    # a restarted reader (new process) continues from the saved position: nothing old again
    r2 = KernelLogReader(str(log), state_file=str(state))
    assert r2.read_new().events == ()
    saved = json.loads(state.read_text())
    assert saved["kind"] == "file" and saved["offset"] == log.stat().st_size


def test_file_reader_starts_over_after_rotation_and_truncation(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("[1.0] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=a, gone\n")
    state = tmp_path / "kmsg.json"
    r = KernelLogReader(str(log), state_file=str(state))
    assert [e.code for e in r.read_new().events] == [79]
    # rotation: the old file moves away, a new file (new inode) takes its name
    os.rename(log, tmp_path / "kern.log.1")
    log.write_text("[2.0] NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=a, dbe\n")
    res = r.read_new()
    assert res.restarted and [e.code for e in res.events] == [48]
    # truncation in place: same inode, shorter than the saved offset
    with open(log, "w") as f:
        f.write("[3.0] NVRM: Xid (PCI:0000:18:00): 94, x\n")
    res = KernelLogReader(str(log), state_file=str(state)).read_new()
    assert res.restarted and [e.code for e in res.events] == [94]


def test_file_reader_first_read_end_reports_only_new_lines(tmp_path):
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE, log)
    r = KernelLogReader(str(log), first_read="end")
    assert r.read_new().events == ()
    with open(log, "a") as f:
        f.write("NVRM: Xid (PCI:0000:18:00): 95, pid=1, name=a, uncontained\n")
    assert [e.code for e in r.read_new().events] == [95]


def test_corrupt_state_file_is_ignored_with_a_warning(tmp_path, caplog):
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE, log)
    state = tmp_path / "kmsg.json"
    state.write_text("{not json")
    res = KernelLogReader(str(log), state_file=str(state)).read_new()
    assert len(res.events) == len(EXPECTED)
    assert "ignoring unreadable kernel-log state" in caplog.text
    assert json.loads(state.read_text())["kind"] == "file"  # rewritten, valid


def test_unwritable_state_keeps_the_events_and_reports_our_error(tmp_path):
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE, log)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the state file's parent is a file: it cannot be written, even as root
    res = KernelLogReader(str(log), state_file=str(blocker / "kmsg.json")).read_new()
    assert len(res.events) == len(EXPECTED)  # read Xids are never dropped
    assert len(res.errors) == 1 and "cannot write kernel-log state" in res.errors[0]


def test_missing_log(tmp_path):
    with pytest.raises(KmsgUnavailable, match="kernel log unavailable"):
        KernelLogReader(str(tmp_path / "nope.log")).read_new()
    with pytest.raises(BadInputError, match="nope.log"):
        KernelLogReader(str(tmp_path / "nope.log"), user_input=True).read_new()
    with pytest.raises(ValueError):
        KernelLogReader(str(tmp_path / "x"), first_read="sometimes")


# --- /dev/kmsg records ------------------------------------------------------------------------


class KmsgDevice:
    """One record per read and EAGAIN when empty, like /dev/kmsg: a SOCK_SEQPACKET pair."""

    def __init__(self, records):
        self.reader, self.writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.reader.setblocking(False)
        for r in records:
            self.add(r)

    def add(self, record):
        self.writer.send(record.encode())

    def fd(self):
        return os.dup(self.reader.fileno())

    def close(self):
        self.reader.close()
        self.writer.close()


def _record(seq, msg, prio=3):
    return f"{prio},{seq},{seq * 1000},-;{msg}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:18:00.0\n"


XID79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=python3, GPU has fallen off the bus."
XID48 = "NVRM: Xid (PCI:0000:28:00): 48, pid=2, name=python3, DBE"


def test_kmsg_records_once_by_sequence_number_and_boot(tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    state = tmp_path / "kmsg.json"
    dev = KmsgDevice([_record(1, "usb 1-1: new device"), _record(2, XID79),
                      _record(3, XID79.replace("python3", "logger"), prio=12)])  # user space
    r = KernelLogReader("/dev/kmsg", state_file=str(state), boot_id_path=str(boot),
                        opener=dev.fd)
    res = r.read_new()
    assert [(e.code, e.pci_bus_id, e.process) for e in res.events] == [(79, "0000:18:00",
                                                                        "python3")]
    assert res.lines == 3
    assert r.read_new().events == ()
    dev.add(_record(4, XID48))
    assert [e.code for e in r.read_new().events] == [48]
    r.close()
    assert json.loads(state.read_text()) == {"kind": "kmsg", "boot_id": "boot-a", "seq": 4,
                                             "inode": None, "device": None, "offset": 0}
    dev.close()

    # a restart re-reads the whole ring buffer: records up to seq 4 are not raised again
    dev = KmsgDevice([_record(2, XID79), _record(4, XID48), _record(5, XID79)])
    r = KernelLogReader("/dev/kmsg", state_file=str(state), boot_id_path=str(boot),
                        opener=dev.fd)
    res = r.read_new()
    assert [e.code for e in res.events] == [79] and res.lines == 1
    r.close()
    dev.close()

    # after a reboot sequence numbers start again: everything in this boot's buffer is new
    boot.write_text("boot-b\n")
    dev = KmsgDevice([_record(1, XID48)])
    r = KernelLogReader("/dev/kmsg", state_file=str(state), boot_id_path=str(boot),
                        opener=dev.fd)
    res = r.read_new()
    assert res.restarted and [e.code for e in res.events] == [48]
    r.close()
    dev.close()


def test_kmsg_first_read_end_skips_history(tmp_path):
    dev = KmsgDevice([_record(10, XID79), _record(11, XID48)])
    r = KernelLogReader("/dev/kmsg", first_read="end", boot_id_path=str(tmp_path / "none"),
                        opener=dev.fd)
    assert r.read_new().events == ()
    dev.add(_record(12, XID48))
    assert [e.code for e in r.read_new().events] == [48]
    r.close()
    dev.close()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable here")
def test_real_dev_kmsg_is_read_without_blocking_and_once(tmp_path):
    state = tmp_path / "kmsg.json"
    with KernelLogReader("/dev/kmsg", state_file=str(state)) as r:
        try:
            first = r.read_new()
        except KmsgUnavailable as e:  # readable mode bits but dmesg_restrict / no CAP_SYSLOG
            pytest.skip(str(e))
        saved = json.loads(state.read_text())
        assert saved["kind"] == "kmsg" and isinstance(saved["seq"], int)
        assert first.lines >= 1
    # a new reader with the saved state sees at most the records logged since
    with KernelLogReader("/dev/kmsg", state_file=str(state)) as r:
        again = r.read_new()
    assert again.lines < first.lines  # only what the kernel logged in between, if anything
    assert json.loads(state.read_text())["seq"] >= saved["seq"]


def test_a_device_other_than_kmsg_or_a_fifo_is_refused_not_read_forever(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(BadInputError, match="/dev/zero: a character device that is not /dev/kmsg"):
        KernelLogReader("/dev/zero", user_input=True).read_new()
    with pytest.raises(KmsgUnavailable, match="not /dev/kmsg"):
        KernelLogReader("/dev/null").read_new()
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)  # opening it for reading would block without a writer
    with pytest.raises(BadInputError, match="neither /dev/kmsg nor a regular file"):
        KernelLogReader(str(fifo), user_input=True).read_new()
    assert time.monotonic() - t0 < 5
