"""LocalStore against real SQLite files, a process killed mid-write, and the CLI on top of it."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import cli_util
from screener.cli import main
from screener.errors import BadInputError
from screener.lifecycle.machine import NodeSeen
from screener.lifecycle.apply import apply_event
from screener.lifecycle.records import StaleTransition, Transition
from screener.stores import open_store
from screener.stores.local import APPLICATION_ID, SCHEMA_VERSION, LocalStore
from screener.alarmfile import AlarmRecord
from screener.types import NodeState, SuspectNode

S = NodeState
NOW = 1_800_000_000.0
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def t(node: str, frm, to, when: float, failure: bool = False, serials=()) -> Transition:
    return Transition(node=node, time=when, from_state=frm, to_state=to, reason=f"{frm}->{to}",
                      code="Test", failure=failure, gpu_serials=tuple(serials),
                      evidence={"nan": float("nan"), "tuple": (1, 2)})


def test_record_and_read_back(tmp_path):
    path = tmp_path / "s.db"
    with LocalStore(path) as store:
        assert store.get_state("a") is None and store.history("a") == [] and store.all_states() == {}
        chain = [t("a", None, S.BURNIN, NOW), t("a", S.BURNIN, S.HEALTHY, NOW + 1),
                 t("a", S.HEALTHY, S.QUARANTINED, NOW + 2, True, ["SN1"]),
                 t("b", None, S.BURNIN, NOW + 3)]
        for x in chain:
            store.record(x)
        store.record(chain[1])  # the same transition again (a replay) is a no-op
        store.set_verdict("a", {"outcome": "pass", "device": "cuda:0"})
    with LocalStore(path) as store:  # reopened: everything persisted
        assert store.get_state("a") == S.QUARANTINED
        assert store.all_states() == {"a": S.QUARANTINED, "b": S.BURNIN}
        hist = store.history("a")
        assert [h.to_state for h in hist] == [S.BURNIN, S.HEALTHY, S.QUARANTINED]
        assert hist[0].evidence == {"nan": "nan", "tuple": [1, 2]}
        assert [h.to_state for h in store.history("a", since=NOW + 1)] == [S.HEALTHY, S.QUARANTINED]
        (f,) = store.failures(NOW - 10)
        assert f.node == "a" and f.gpu_serials == ("SN1",)
        assert store.failures(NOW + 5) == []
        assert store.get_verdict("a") == {"outcome": "pass", "device": "cuda:0"}
        assert store.get_verdict("b") is None
        db = sqlite3.connect(path)
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        db.close()


def test_stale_transition_is_refused(tmp_path):
    a, b = LocalStore(tmp_path / "s.db"), LocalStore(tmp_path / "s.db")
    a.record(t("n", None, S.BURNIN, NOW))
    b.record(t("n", S.BURNIN, S.REPAIR, NOW + 1))  # a person, through another connection
    with pytest.raises(StaleTransition, match="the node is repair now"):
        a.record(t("n", S.BURNIN, S.HEALTHY, NOW + 2))
    assert a.get_state("n") == S.REPAIR and len(a.history("n")) == 2
    a.close(), b.close()


def test_apply_event_end_to_end(tmp_path):
    store = LocalStore(tmp_path / "s.db")
    apply_event(store, "n1", NodeSeen(), now=NOW)
    alarm = AlarmRecord(alarm_id="x", check="weights", step=7, settled=True, suspect_ranks=(1,),
                        suspect_nodes=(SuspectNode("n1", "h1"),), node="n1", created=NOW)
    d = apply_event(store, "n1", alarm, now=NOW + 10)
    assert d.state == S.QUARANTINED and store.get_state("n1") == S.QUARANTINED
    assert store.failures(NOW)[0].code == "WeightFingerprintMismatch"
    store.close()


def test_newer_schema_is_a_clear_error(tmp_path):
    path = tmp_path / "future.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit(), db.close()
    with pytest.raises(BadInputError, match=rf"future.db: database schema version {SCHEMA_VERSION + 1}"
                                            " is newer"):
        LocalStore(path)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(BadInputError, match="junk.db"):
        LocalStore(junk)


def test_default_path_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    store = open_store("local")
    store.record(t("n", None, S.BURNIN, NOW))
    store.close()
    assert (tmp_path / "xdg" / "screener" / "screener.db").exists()
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    open_store("local").close()
    assert (tmp_path / "home" / ".local" / "state" / "screener" / "screener.db").exists()


WRITER = textwrap.dedent("""
    import sys, time
    from screener.stores.local import LocalStore
    from screener.lifecycle.records import Transition
    from screener.types import NodeState as S
    CYCLE = [S.BURNIN, S.HEALTHY, S.SUSPECT, S.QUARANTINED]
    store = LocalStore(sys.argv[1])
    i = 0
    print("ready", flush=True)
    while True:
        node = f"n{i % 3}"
        cur = store.get_state(node)
        nxt = S.BURNIN if cur is None else CYCLE[(CYCLE.index(cur) + 1) % len(CYCLE)]
        store.record(Transition(node=node, time=time.time() + i, from_state=cur, to_state=nxt,
                                reason="x" * (i % 500), failure=nxt == S.QUARANTINED,
                                evidence={"i": i, "pad": "y" * 2000}))
        i += 1
""")


def check_consistent(path: Path) -> int:
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    store = LocalStore(path)
    total = 0
    for node, state in store.all_states().items():
        hist = store.history(node)
        total += len(hist)
        prev = None
        for h in hist:  # an unbroken chain: every transition starts where the last one ended
            assert h.from_state == prev
            prev = h.to_state
        assert prev == state  # the state and the history were written together
    store.close()
    return total


@pytest.mark.slow
def test_process_killed_mid_write_leaves_a_consistent_db(tmp_path):
    path = tmp_path / "kill.db"
    counts = []
    for round_ in range(5):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                                 env=ENV, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.15 + 0.07 * round_)  # land the kill at varying points of the write loop
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert child.returncode == -signal.SIGKILL
        counts.append(check_consistent(path))
    print("transitions after each kill:", counts)
    assert counts == sorted(counts) and counts[-1] > counts[0] > 0  # work survived and went on


# --- CLI on the local store -----------------------------------------------------------------------


def cli(*args: str, db: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "screener.cli", *args, "--db", str(db)],
                          capture_output=True, text=True, env=ENV, timeout=60)


def test_cli_set_status_history_lemons(tmp_path):
    db = tmp_path / "cli.db"
    runner = CliRunner()
    r = runner.invoke(main, ["node", "set", "gpu-1", "burnin", "--reason", "racked", "--db", str(db),
                             "--store", "local"])
    assert r.exit_code == 0, r.output
    assert "(new) -> burnin" in r.output
    # A person cannot make a node healthy: exit 2, one line on stderr, no traceback.
    p = cli("node", "set", "gpu-1", "healthy", "--reason", "trust me", db=db)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "only a passing known-answer screen" in p.stderr
    assert "Traceback" not in p.stderr
    r = runner.invoke(main, ["node", "set", "gpu-1", "repair", "--reason", "fan noise", "--db", str(db),
                             "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["actor"] == "human"

    # Three failures recorded by the screener in the last days make gpu-2 (and its GPU) a lemon.
    store = LocalStore(db)
    now = time.time()
    store.record(t("gpu-2", None, S.BURNIN, now - 9000))
    prev = S.BURNIN
    for k in range(3):
        store.record(t("gpu-2", prev, S.QUARANTINED, now - 8000 + k * 2000, True, ["SN-7"]))
        store.record(t("gpu-2", S.QUARANTINED, S.BURNIN, now - 7000 + k * 2000))
        prev = S.BURNIN
    store.close()

    r = runner.invoke(main, ["node", "status", "--json", "--db", str(db)])
    assert r.exit_code == 0
    out = json.loads(r.output)
    assert {n["node"]: n["state"] for n in out["nodes"]} == {"gpu-1": "repair", "gpu-2": "burnin"}
    assert out["counts"]["repair"] == 1
    r = runner.invoke(main, ["node", "status", "gpu-1", "--db", str(db)])
    assert r.exit_code == 0 and "gpu-1: repair" in r.output and "fan noise" in r.output
    r = runner.invoke(main, ["node", "history", "gpu-1", "--json", "--db", str(db)])
    hist = json.loads(r.output)["transitions"]
    assert [(h["from"], h["to"], h["actor"]) for h in hist] == [(None, "burnin", "human"),
                                                                ("burnin", "repair", "human")]
    r = runner.invoke(main, ["lemons", "--json", "--db", str(db)])
    lem = json.loads(r.output)
    assert [n["node"] for n in lem["nodes"]] == ["gpu-2"] and lem["nodes"][0]["failures"] == 3
    assert lem["gpus"] == [{"serial": "SN-7", "failures": 3, "nodes": ["gpu-2"]}]
    r = runner.invoke(main, ["lemons", "--json", "--min-failures", "4", "--db", str(db)])
    assert json.loads(r.output)["nodes"] == []
    r = runner.invoke(main, ["lemons", "--days", "0.05", "--db", str(db)])  # 72 minutes: 2 failures
    assert r.exit_code == 0 and "gpu-2" not in r.output


# --- the quarantine budget and the per-GPU lemon lookup ----------------------------------------

def confirmed(serial: str = "") -> "Verdict":
    from screener.types import Outcome, Verdict

    evidence = {"confirmed": True, **({"gpu_serial": serial} if serial else {})}
    return Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm-fp32",
                   evidence=evidence)


def healthy_fleet(store, names, when=NOW - 1000):
    for n in names:
        store.record(t(n, None, S.BURNIN, when))
        store.record(t(n, S.BURNIN, S.HEALTHY, when + 1))


def test_a_node_held_by_the_budget_takes_the_slot_when_it_frees(tmp_path):
    from screener.lifecycle.machine import Remediation
    from screener.lifecycle.apply import SlotLooks, reconsider_held

    store = LocalStore(tmp_path / "budget.db")
    healthy_fleet(store, [f"n{k}" for k in range(10)])  # budget: 1 node
    looks = SlotLooks(min_interval_s=30.0)  # the caller's, not the lifecycle's: no module state
    assert apply_event(store, "n0", confirmed(), now=NOW).state == S.QUARANTINED
    held = apply_event(store, "n1", confirmed(), now=NOW + 1)
    assert held.state == S.SUSPECT and held.transition.evidence["held_by_budget"] is True
    # No slot: reconsidering changes nothing (and costs nothing for a node not suspect).
    assert reconsider_held(store, "n1", S.SUSPECT, now=NOW + 2, looks=looks) == S.SUSPECT
    assert reconsider_held(store, "n2", S.HEALTHY, now=NOW + 2, looks=looks) == S.HEALTHY
    apply_event(store, "n0", Remediation(passed=True), now=NOW + 3)  # n0 leaves quarantine
    # Looked at most every 30 s per node: too soon, then the slot is taken.
    assert reconsider_held(store, "n1", S.SUSPECT, now=NOW + 4, looks=looks) == S.SUSPECT
    assert reconsider_held(store, "n1", S.SUSPECT, now=NOW + 40, looks=looks) == S.QUARANTINED
    last = store.history("n1")[-1]
    assert (last.from_state, last.to_state, last.code) == (S.SUSPECT, S.QUARANTINED,
                                                           "QuarantineBudgetExhausted")
    assert last.evidence["released_by_budget"]["held_transition"] == held.transition.id
    assert not last.failure  # the failure counted once, when the node was held
    # The slot is taken again: the next failure is held.
    assert apply_event(store, "n2", confirmed(), now=NOW + 50).state == S.SUSPECT
    store.close()


def test_a_suspect_node_whose_confirming_screen_fails_past_the_budget_is_held_then_released(
        tmp_path):
    from screener.lifecycle.machine import KnownAnswerScreen, Remediation
    from screener.lifecycle.apply import reconsider_held
    from screener.types import Outcome, Verdict

    store = LocalStore(tmp_path / "held.db")
    healthy_fleet(store, [f"n{k}" for k in range(10)])  # budget: 1 node
    assert apply_event(store, "n0", confirmed(), now=NOW).state == S.QUARANTINED
    mismatch = Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm-fp32")
    assert apply_event(store, "n1", mismatch, now=NOW + 1).state == S.SUSPECT  # not yet re-run
    # The confirming screen fails too, with the budget used up: held, and recorded as held.
    assert apply_event(store, "n1", mismatch, now=NOW + 2).state == S.SUSPECT
    last = store.history("n1")[-1]
    assert last.evidence.get("held_by_budget") is True and last.failure
    # A lucky pass does not clear a node with a confirmed failure.
    passed = Verdict(device="cuda:0", outcome=Outcome.PASS, reason="", job="gemm-fp32")
    assert apply_event(store, "n1", KnownAnswerScreen((passed,)), now=NOW + 3).state == S.SUSPECT
    # The slot frees: the held node takes it.
    apply_event(store, "n0", Remediation(passed=True), now=NOW + 4)
    assert reconsider_held(store, "n1", S.SUSPECT, now=NOW + 5) == S.QUARANTINED
    assert store.get_state("n1") == S.QUARANTINED
    store.close()


def test_the_gpu_lemon_rule_finds_a_serial_without_reading_the_fleet(tmp_path):
    store = LocalStore(tmp_path / "lemon.db")
    healthy_fleet(store, [f"n{k}" for k in range(40)])  # budget: 4 nodes
    # GPU SN-9 fails on n0, then (moved) on n1, then on n2: the third failure is a lemon.
    for k, name in enumerate(["n0", "n1"]):
        assert apply_event(store, name, confirmed("SN-9"), now=NOW + k).state == S.QUARANTINED
    assert apply_event(store, "n3", confirmed("SN-other"), now=NOW + 3).state == S.QUARANTINED
    assert [f.node for f in store.failures_for(["SN-9"], NOW - 10)] == ["n0", "n1"]
    assert store.failures_for(["SN-9"], NOW + 0.5)[0].node == "n1"
    assert store.failures_for(["nope"], 0) == []
    d = apply_event(store, "n2", confirmed("SN-9"), now=NOW + 5)
    assert d.state == S.REPAIR and d.transition.evidence["lemon"]["gpu_serial"] == "SN-9"
    rows = {r["node"]: r for r in store.summaries()}
    assert rows["n2"]["state"] == "repair" and rows["n2"]["reason"].startswith("lemon rule")
    assert len(rows) == 40
    store.close()


FULL_DISK = textwrap.dedent("""
    import json, os, subprocess, sys
    from screener.stores.local import LocalStore
    from screener.lifecycle.records import Transition
    from screener.stores.common import DiskFullError
    from screener.types import NodeState as S
    d = sys.argv[1]
    db = os.path.join(d, "state.db")
    store = LocalStore(db)
    store.record(Transition(node="n", time=1.0, from_state=None, to_state=S.BURNIN, reason="new"))
    fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\\0" * 65536)
    except OSError:
        os.close(fd)
    out = {}
    big = Transition(node="n", time=2.0, from_state=S.BURNIN, to_state=S.QUARANTINED,
                     reason="x" * 20000, evidence={"pad": "y" * 100000})
    try:
        store.record(big)
        out["record"] = "written"
    except DiskFullError as e:
        out["record"] = str(e)
    cli = subprocess.run([sys.executable, "-m", "screener.cli", "node", "set", "m", "burnin",
                          "--reason", "z" * 50000, "--db", os.path.join(d, "new.db")],
                         capture_output=True, text=True)
    out["cli"] = [cli.returncode, cli.stderr]
    os.remove(os.path.join(d, "filler"))
    store.record(big)  # space freed: the same write goes through
    out["after"] = store.get_state("n").value
    print(json.dumps(out))
""")


def test_a_full_disk_is_named_not_a_rollback_error(tmp_path):
    """A real full filesystem: a 512 KiB tmpfs in a private mount namespace (root: unshare -m,
    otherwise a user namespace: unshare -rm), filled to the last byte."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    ns = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK)
    cmd = f"mount -t tmpfs -o size=512k tmpfs {mnt} && exec {sys.executable} {script} {mnt}"
    p = subprocess.run([*ns, "sh", "-c", cmd], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["record"].startswith(f"{mnt}/state.db: the disk is full (filesystem {mnt}, ")
    assert "rollback" not in out["record"]
    code, stderr = out["cli"]
    assert code == 1 and stderr.count("\n") == 1 and "Traceback" not in stderr
    assert f"{mnt}/new.db: the disk is full (filesystem {mnt}" in stderr
    assert out["after"] == "quarantined"


# --- the store refuses what it did not write (issue 23.4) --------------------------------------

def _sqlite(path: Path, *statements: str) -> Path:
    db = sqlite3.connect(path)
    for stmt in statements:
        db.execute(stmt)
    db.commit(), db.close()
    return path


def _our_store(path: Path) -> Path:
    with LocalStore(path) as store:
        store.record(t("n1", None, S.BURNIN, NOW))
        store.record(t("n1", S.BURNIN, S.QUARANTINED, NOW + 1, True, ["SN-1"]))
        store.set_verdict("n1", {"outcome": "suspect"})
    return path


FOREIGN = {
    "empty": (lambda p: (p.write_bytes(b""), p)[1], "an empty file, not a screener database"),
    "not sqlite": (lambda p: (p.write_bytes(b"plain text " * 500), p)[1], "not a usable"),
    "another program's sqlite": (
        lambda p: _sqlite(p, "CREATE TABLE songs (title TEXT)"), "schema version 0, no table nodes"),
    "another application id": (
        lambda p: _sqlite(p, "PRAGMA application_id = 1234", "CREATE TABLE t (x)"),
        "application id 0x000004d2 is another program's"),
    "newer schema": (lambda p: _sqlite(_our_store(p), f"PRAGMA user_version = {SCHEMA_VERSION + 1}"),
                     f"schema version {SCHEMA_VERSION + 1} is newer"),
    "older user_version": (lambda p: _sqlite(_our_store(p), "PRAGMA user_version = 0"),
                           "not a screener database (schema version 0"),
    "a table dropped": (lambda p: _sqlite(_our_store(p), "DROP TABLE verdicts"), "no table verdicts"),
    "same tables, other columns": (
        lambda p: _sqlite(p, "PRAGMA user_version = 1", "CREATE TABLE nodes (node, state)",
                          "CREATE TABLE transitions (x)", "CREATE TABLE verdicts (node, verdict)"),
        "table nodes lacks since, last_id"),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_a_file_it_did_not_write_is_one_line_and_left_alone(tmp_path, kind):
    make, needle = FOREIGN[kind]
    path = make(tmp_path / "x.db")
    before = path.read_bytes()
    for read_only in (True, False):
        with pytest.raises(BadInputError) as e:
            LocalStore(path, read_only=read_only)
        text = str(e.value)
        assert text.startswith(f"{path}: ") and needle in text and "\n" not in text, text
        assert e.value.exit_code == 2
        assert path.read_bytes() == before, (kind, read_only)  # nothing written, ever
    r = cli_util.screener("node", "status", "--store", "local", "--db", str(path))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_read_only_commands_never_write(tmp_path):
    path = _our_store(tmp_path / "s.db")
    before = path.read_bytes()
    for args in (["node", "status"], ["node", "status", "n1"], ["node", "history", "n1"],
                 ["lemons"], ["report", "fleet", "-o", str(tmp_path / "r.html")]):
        r = cli_util.screener(*args, "--store", "local", "--db", str(path))
        assert r.returncode == 0, (args, r.stderr)
    assert path.read_bytes() == before
    with LocalStore(path, read_only=True) as store:  # and a write through it is refused
        with pytest.raises(Exception, match="readonly"):
            store.record(t("n2", None, S.BURNIN, NOW))
    assert path.read_bytes() == before


def test_a_store_of_the_first_schema_is_still_ours(tmp_path):
    # Written before the application id: our tables, user_version 1, application id 0.
    path = _sqlite(_our_store(tmp_path / "old.db"), "PRAGMA application_id = 0")
    with LocalStore(path, read_only=True) as store:
        assert store.get_state("n1") == S.QUARANTINED
    assert sqlite3.connect(path).execute("PRAGMA application_id").fetchone()[0] == 0
    with LocalStore(path) as store:  # a writer stamps it
        assert [h.to_state for h in store.history("n1")] == [S.BURNIN, S.QUARANTINED]
    assert sqlite3.connect(path).execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID


def test_a_new_store_appears_whole(tmp_path):
    path = tmp_path / "deep" / "new.db"
    LocalStore(path).close()
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".")) == []
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    with pytest.raises(BadInputError, match="no state database there"):
        LocalStore(tmp_path / "missing.db", read_only=True)
    assert not (tmp_path / "missing.db").exists()


EDITS = {
    "unknown state": ("UPDATE nodes SET state = 'exploded'",
                      "table nodes, node 'n1': state 'exploded' is not a node state"),
    "record not JSON": ("UPDATE transitions SET record = '{not json' WHERE seq = 2",
                        "table transitions, row 2 (node 'n1'): the record is not a transition"),
    "record an array": ("UPDATE transitions SET record = '[1, 2]' WHERE seq = 2",
                        "row 2 (node 'n1'): the record is not a transition (not a JSON object)"),
    "record unknown to-state": (
        "UPDATE transitions SET record = json_set(record, '$.to', 'gone') WHERE seq = 2",
        "row 2 (node 'n1'): the record is not a transition (malformed"),
    "record of another node": (
        "UPDATE transitions SET record = json_set(record, '$.node', 'n9') WHERE seq = 2",
        "row 2 (node 'n1'): the record is not a transition (it is about node 'n9')"),
}


@pytest.mark.parametrize("kind", sorted(EDITS))
def test_an_edited_row_is_one_line_naming_it(tmp_path, kind):
    edit, needle = EDITS[kind]
    path = _sqlite(_our_store(tmp_path / "s.db"), edit)
    with LocalStore(path) as store:
        if kind == "unknown state":
            reads = [store.summaries, store.all_states, lambda: store.get_state("n1")]
        else:  # every read of the records, the per-GPU lemon lookup's SQL included
            reads = [store.summaries, lambda: store.history("n1"), lambda: store.failures(0),
                     lambda: store.failures_for(["SN-1"], 0)]
        for read in reads:
            with pytest.raises(BadInputError) as e:
                read()
            assert str(e.value) == f"{path}: " + str(e.value).split(": ", 1)[1]
            assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    r = cli_util.screener("node", "status", "--store", "local", "--db", str(path))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_an_edited_verdict_is_one_line(tmp_path):
    path = _sqlite(_our_store(tmp_path / "s.db"), "UPDATE verdicts SET verdict = 'NaN'")
    with LocalStore(path) as store, pytest.raises(BadInputError,
                                                  match="table verdicts, node 'n1': the verdict"):
        store.get_verdict("n1")
