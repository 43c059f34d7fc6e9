"""Hostile text (issue 36.6): what the fleet table and a node's history print of stored text that
is not printable (a record stored before the intake refused it, or a store another writer
filled), through the real `screener` process: never a traceback, every such character escaped;
and a hostile alarm file refused by the real intake with one line, the fleet table unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from screener.lifecycle.records import Transition
from screener.stores.local import LocalStore
from screener.types import NodeState

HOSTILE = "tr\ud800ain \u202egnp.exe \x9b31m \x7f \u2028FORGED: healthy \x1b[2J"
ESCAPED = "tr\\ud800ain \\u202egnp.exe \\x9b31m \\x7f \\u2028FORGED: healthy \\x1b[2J"


def _screener(*args: str, db: Path) -> subprocess.CompletedProcess[str]:
    """The real command in a child process, its stdout a pipe in UTF-8 (strict), as a
    terminal or a log collector reads it."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "screener.cli", *args, "--store", "local",
                           "--db", str(db)], capture_output=True, text=True,
                          encoding="utf-8", errors="strict", env=env, timeout=120)


@pytest.fixture
def hostile_db(tmp_path):
    db = tmp_path / "state.db"
    store = LocalStore(db)
    store.record(Transition(node="gpu-1", time=1.7e9, from_state=None, to_state=NodeState.BURNIN,
                            reason="new node"))
    store.record(Transition(node="gpu-1", time=1.7e9 + 60, from_state=NodeState.BURNIN,
                            to_state=NodeState.SUSPECT,
                            reason=f"unsettled in-job alarm ring_replay at step 7 of job {HOSTILE}",
                            rollback={"time": 1.7e9, "step": 7, "job": HOSTILE}))
    store.close()
    return db


@pytest.mark.parametrize("args", [("node", "status"), ("node", "status", "gpu-1"),
                                  ("node", "history", "gpu-1")])
def test_stored_text_that_is_not_printable_is_printed_escaped(hostile_db, args):
    r = _screener(*args, db=hostile_db)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "UnicodeEncodeError" not in r.stderr, r.stderr
    assert ESCAPED in r.stdout, r.stdout
    # Nothing of the hostile text reaches the terminal raw: no control, bidi or separator.
    assert all(c.isprintable() for line in r.stdout.splitlines() for c in line), r.stdout
    if args == ("node", "status"):
        lines = r.stdout.splitlines()
        assert len(lines) == 2 and lines[1].startswith("gpu-1 ") and "suspect" in lines[1]


def test_status_json_of_stored_text_is_ascii_json(hostile_db):
    r = _screener("node", "history", "gpu-1", "--json", db=hostile_db)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.isascii()
    reasons = [t["reason"] for t in json.loads(r.stdout)["transitions"]]
    assert reasons[-1].endswith(HOSTILE)  # the data itself, unchanged, for machines


def test_a_hostile_alarm_is_refused_with_one_line_and_the_table_stays_clean(tmp_path, caplog):
    """The issue's file, through the real intake and the real lifecycle into the local store:
    refused, moved to rejected/, one log line naming the job; the fleet table then shows no
    alarm at all."""
    import logging

    from screener.agent.daemon.intake import AlarmIntake
    from screener.lifecycle.apply import apply_event

    alarms = tmp_path / "alarms"
    alarms.mkdir()
    good = {"schema": 1, "alarm_id": "a-1", "check": "ring_replay", "step": 7, "settled": False,
            "suspect_ranks": [], "suspect_nodes": [{"node": "gpu-1", "hostname": "gpu-1",
                                                    "instance_id": None}],
            "node": "gpu-1", "job": "train", "created": time.time() - 5, "evidence": {}}
    (alarms / "a-1.json").write_text(json.dumps({**good, "job": HOSTILE}))  # \ud800 escaped
    (alarms / "a-2.json").write_text(json.dumps({**good, "alarm_id": "a-2", "check": "straggler",
                                                 "evidence": {"slowdown": 1e308,
                                                              "consecutive": 5}}))
    db = tmp_path / "state.db"
    store = LocalStore(db)
    caplog.set_level(logging.WARNING, logger="screener.intake")
    result = AlarmIntake(alarms, "gpu-1",
                         lambda rec: apply_event(store, "gpu-1", rec, now=time.time())).run()
    store.close()
    assert result.applied == [] and sorted(result.rejected) == ["a-1.json", "a-2.json"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in m and "\u2028" not in m for m in lines), lines
    assert any("alarm job holds U+D800" in m for m in lines), lines
    assert any("straggler slowdown" in m and "0..1000" in m for m in lines), lines
    r = _screener("node", "status", db=db)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "gpu-1" not in r.stdout  # nothing was applied
