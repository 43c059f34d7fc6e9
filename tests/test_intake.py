"""Alarm intake: exactly once (also across a restart), malformed files to rejected/, foreign files
left alone. Real files, the real LocalStore, the real lifecycle."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest

from fakes.clock import FakeClock
from fakes.daemon import NODE, alarm
from fakes.kubeapi import KubeAPI
from screener.agent.daemon.intake import AlarmIntake, applied_in_history
from screener.agent.metrics import DaemonMetrics
from screener.audit.alarms import SDCAlarm, node_records, write_alarm_file
from screener.audit.guard import hardware_error_alarm
from screener.audit.straggler import StepResult, Straggler, straggler_alarm
from screener.lifecycle import machine
from screener.lifecycle.apply import apply_event
from screener.stores.kube import KubeStore
from screener.stores.local import LocalStore
from screener.alarmfile import AlarmRecord
from screener.types import NodeState, SuspectNode


def drop(directory, record: AlarmRecord) -> None:
    write_alarm_file(record, directory)


def make_intake(directory, store, clock):
    def apply(record):
        apply_event(store, NODE, record, now=clock())

    def before(record):
        return applied_in_history(store.history(NODE), record.alarm_id)

    # The intake reads `created` against the daemon's clock: the test's own (a time in 1970, as
    # the alarms it drops).
    return AlarmIntake(directory, NODE, apply, before, clock=clock)


@pytest.fixture
def store(tmp_path):
    s = LocalStore(tmp_path / "state.db")
    yield s
    s.close()


def test_applied_once_then_moved_aside(tmp_path, store):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    apply_event(store, NODE, machine.NodeSeen(), now=clock())
    drop(alarms, alarm("a1", settled=False))
    result = make_intake(alarms, store, clock).run()
    assert [r.alarm_id for r in result.applied] == ["a1"]
    assert store.get_state(NODE) == NodeState.SUSPECT
    assert not list(alarms.glob("*.json"))
    assert (alarms / "processed" / "a1.json").exists()
    # A second pass finds nothing to do.
    clock.t += 5
    assert make_intake(alarms, store, clock).run().count == 0
    assert len(store.history(NODE)) == 2  # new -> burnin, burnin -> suspect


def test_exactly_once_across_a_restart_between_store_and_move(tmp_path, store):
    """A daemon killed after storing the transition and before moving the file leaves the file in
    the folder; the next daemon must not apply it again even when the node moved on meanwhile."""
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    apply_event(store, NODE, machine.NodeSeen(), now=clock())
    drop(alarms, alarm("a-crash", settled=False))
    saved = tmp_path / "saved.json"
    shutil.copy(next(alarms.glob("*.json")), saved)
    make_intake(alarms, store, clock).run()
    assert store.get_state(NODE) == NodeState.SUSPECT
    # The state a crash between record() and the move leaves behind: the file is still there.
    (alarms / "processed" / "a-crash.json").unlink()
    shutil.copy(saved, alarms / "a-crash.json")
    # Meanwhile a person sent the node back to burnin; re-applying the alarm would make it suspect.
    clock.t += 60
    apply_event(store, NODE, machine.HumanCommand(NodeState.BURNIN, "checked by hand"), now=clock())
    clock.t += 60
    result = make_intake(alarms, store, clock).run()  # a new intake: the restarted daemon
    assert result.applied == [] and result.duplicates == ["a-crash"]
    assert store.get_state(NODE) == NodeState.BURNIN
    assert sum(1 for t in store.history(NODE) if t.to_state == NodeState.SUSPECT) == 1
    assert (alarms / "processed" / "a-crash.json").exists()


def test_a_failed_apply_leaves_the_file_for_the_next_pass(tmp_path, store):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    drop(alarms, alarm("a2"))
    calls = []

    def broken(record):
        calls.append(record.alarm_id)
        raise ConnectionError("API unreachable")

    result = AlarmIntake(alarms, NODE, broken, clock=FakeClock(2000.0)).run()
    assert result.failed == ["a2.json"] and result.applied == []
    assert (alarms / "a2.json").exists()  # not moved: its transition was not stored
    result = make_intake(alarms, store, clock).run()
    assert [r.alarm_id for r in result.applied] == ["a2"]
    assert store.get_state(NODE) == NodeState.QUARANTINED


def test_a_store_outage_during_the_duplicate_check_does_not_shelve_the_alarm(tmp_path, store):
    # The same intake object across the outage: a file must not be remembered as "stuck" because
    # the store could not be read (that memory lasts until the file changes, so it would be lost).
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    drop(alarms, alarm("a3"))
    down = {"on": True}

    def apply(record):
        apply_event(store, NODE, record, now=clock())

    def before(record):
        if down["on"]:
            raise ConnectionError("API unreachable")
        return applied_in_history(store.history(NODE), record.alarm_id)

    intake = AlarmIntake(alarms, NODE, apply, before, clock=clock)
    result = intake.run()
    assert result.failed == ["a3.json"] and result.stuck == [] and result.applied == []
    assert (alarms / "a3.json").exists()
    down["on"] = False
    result = intake.run()
    assert [r.alarm_id for r in result.applied] == ["a3"]
    assert store.get_state(NODE) == NodeState.QUARANTINED


def test_malformed_files_are_rejected_with_one_log_line_and_the_rest_applied(tmp_path, store,
                                                                              caplog):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    alarms.mkdir()
    (alarms / "garbage.json").write_text("{not json")
    (alarms / "wrong.json").write_text(json.dumps({"schema": 1, "alarm_id": "x"}))
    bad_check = alarm("bad-check").to_dict()
    bad_check["check"] = "vibes"
    (alarms / "bad-check.json").write_text(json.dumps(bad_check))
    (alarms / ".in-progress.tmp").write_text("partial")  # a write under way: not touched
    drop(alarms, alarm("good"))
    with caplog.at_level(logging.WARNING, logger="screener.intake"):
        result = make_intake(alarms, store, clock).run()
    assert sorted(result.rejected) == ["bad-check.json", "garbage.json", "wrong.json"]
    assert [r.alarm_id for r in result.applied] == ["good"]
    assert sorted(p.name for p in (alarms / "rejected").iterdir()) == sorted(result.rejected)
    assert (alarms / ".in-progress.tmp").exists()
    rejected_lines = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected_lines) == 3
    assert any("vibes" in r.getMessage() for r in rejected_lines)
    assert store.get_state(NODE) == NodeState.QUARANTINED


def test_files_about_other_nodes_are_moved_aside_once(tmp_path, store):
    """Issue 23.2: a file about another node can never apply here (each node's folder is its
    own): it goes to rejected/ in the first pass and costs nothing after."""
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    drop(alarms, alarm("other", node="gpu-node-2"))
    intake = make_intake(alarms, store, clock)
    result = intake.run()
    assert result.foreign == ["other.json"] and result.rejected == ["other.json"]
    assert (alarms / "rejected" / "other.json").exists() and not (alarms / "other.json").exists()
    assert store.get_state(NODE) is None
    again = intake.run()
    assert again.foreign == [] and again.read_bytes == 0


def test_in_a_shared_folder_files_about_other_nodes_are_left_and_not_read_again(tmp_path, store):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    drop(alarms, alarm("other", node="gpu-node-2"))
    intake = AlarmIntake(alarms, NODE, lambda r: apply_event(store, NODE, r, now=clock()),
                         foreign="leave", clock=clock)
    first = intake.run()
    assert first.foreign == ["other.json"] and first.count == 0 and first.read_bytes > 0
    assert (alarms / "other.json").exists()
    second = intake.run()
    assert second.foreign == ["other.json"] and second.read_bytes == 0  # remembered, unread
    drop(alarms, alarm("other", node="gpu-node-2", step=8))  # changed: read once more
    assert intake.run().read_bytes > 0
    assert store.get_state(NODE) is None


def test_a_redelivered_file_already_processed_is_a_duplicate(tmp_path, store):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    drop(alarms, alarm("dup"))
    make_intake(alarms, store, clock).run()
    drop(alarms, alarm("dup"))
    result = make_intake(alarms, store, clock).run()
    assert result.duplicates == ["dup"]
    assert sum(1 for t in store.history(NODE) if t.to_state == NodeState.QUARANTINED) == 1


def test_processed_folder_is_bounded(tmp_path, store):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    intake = make_intake(alarms, store, clock)
    intake.processed_keep = 2
    for i in range(4):
        drop(alarms, alarm(f"k{i}", settled=False, step=i))
        intake.run()
    assert len(list((alarms / "processed").iterdir())) == 2


def test_exactly_once_on_the_kube_store_with_bulky_evidence(tmp_path):
    """The Node's history annotation keeps a shrunk evidence; the alarm id must survive it."""
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    big = AlarmRecord(alarm_id="bulky", check="ring_replay", step=9, settled=False,
                      suspect_ranks=(), suspect_nodes=(SuspectNode(NODE, NODE),), node=NODE,
                      created=1000.0, evidence={"differs": [f"layer.{i}.weight" for i in range(600)]})
    assert len(json.dumps(big.to_dict())) > 8192
    with KubeAPI() as api:
        api.add_node(NODE)
        store = KubeStore(api.api_client(), sleep=lambda s: None, instance="t")
        try:
            apply_event(store, NODE, machine.NodeSeen(), now=clock())
            drop(alarms, big)
            saved = json.loads(next(alarms.glob("*.json")).read_text())
            make_intake(alarms, store, clock).run()
            (alarms / "processed" / "bulky.json").unlink()
            (alarms / "bulky.json").write_text(json.dumps(saved))  # the crash left it behind
            clock.t += 60
            apply_event(store, NODE, machine.HumanCommand(NodeState.BURNIN, "by hand"), now=clock())
            result = make_intake(alarms, store, clock).run()
            assert result.duplicates == ["bulky"] and store.get_state(NODE) == NodeState.BURNIN
        finally:
            store.close()


# --- hostile input: one file never ends a pass ---------------------------------------------------

def _raw(directory, name: str, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(data)


def _valid(aid: str, **over) -> dict:
    d = alarm(aid).to_dict()
    d.update(over)
    return d


@pytest.mark.parametrize("name,content,why", [
    ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    ("digits.json", json.dumps(_valid("x", step=1)).replace('"step": 1', '"step": ' + "9" * 5000)
     .encode(), "digits"),
    ("nan.json", json.dumps(_valid("x")).replace('"created": 1000.0', '"created": NaN').encode(),
     "NaN"),
    ("inf.json", json.dumps(_valid("x")).replace('"created": 1000.0', '"created": 1e999').encode(),
     "overflows"),
    ("neg.json", json.dumps(_valid("x", created=-5.0)).encode(), "created"),
    ("intid.json", json.dumps(_valid("x", alarm_id=12345)).encode(), "alarm_id"),
    ("longid.json", json.dumps(_valid("a" * 300)).encode(), "characters long"),
    ("slashid.json", json.dumps(_valid("../../etc")).encode(), "may hold only"),
    ("bigstep.json", json.dumps(_valid("x", step=2**64)).encode(), "step"),
    ("bigev.json", json.dumps(_valid("x", evidence={"blob": "y" * 200_000})).encode(), "evidence"),
    ("huge.json", b" " * (5 * 1024 * 1024), "larger than"),
    ("utf.json", b'{"schema": 1, "alarm_id": "\xff\xfe"}', "UTF-8"),
    ("listcheck.json", json.dumps(_valid("x", check=["ring_replay"])).encode(), "check"),
    ("other.json", json.dumps(_valid("x", suspect_nodes=[{"node": "victim", "hostname": "v",
                                                          "instance_id": None}])).encode(),
     "acts only on its own node"),
])
def test_hostile_files_are_rejected_and_the_pass_goes_on(tmp_path, store, caplog, name, content,
                                                         why):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    apply_event(store, NODE, machine.NodeSeen(), now=clock())
    _raw(alarms, name, content)
    drop(alarms, alarm("good", settled=False))
    with caplog.at_level(logging.WARNING, logger="screener.intake"):
        result = make_intake(alarms, store, clock).run()
    assert result.rejected == [name], result
    assert [r.alarm_id for r in result.applied] == ["good"]
    assert (alarms / "rejected" / name).exists()
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1 and why in lines[0], lines


def test_a_symlink_or_fifo_swapped_in_is_refused_without_blocking(tmp_path, store):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    alarms.mkdir()
    os.mkfifo(alarms / "fifo.json")  # a reader that blocked in open() would hang here forever
    target = tmp_path / "pipe"
    os.mkfifo(target)
    os.symlink(target, alarms / "link.json")
    drop(alarms, alarm("good", settled=False))
    t0 = time.monotonic()
    result = make_intake(alarms, store, clock).run()
    assert time.monotonic() - t0 < 5
    assert sorted(result.rejected) == ["fifo.json", "link.json"]
    assert [r.alarm_id for r in result.applied] == ["good"]
    assert (alarms / "rejected" / "link.json").is_symlink()  # the link moved, not its target
    assert target.exists()


def test_regular_files_squatting_on_the_aside_folders_do_not_block_intake(tmp_path, store):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    alarms.mkdir()
    (alarms / "processed").write_text("squatter")
    (alarms / "rejected").write_text("squatter")
    _raw(alarms, "junk.json", b"not json")
    drop(alarms, alarm("good", settled=False))
    for _ in range(2):  # and again on the next pass
        result = make_intake(alarms, store, clock).run()
        assert not result.stuck and not result.stalled
    assert (alarms / "processed" / "good.json").exists()
    assert (alarms / "rejected" / "junk.json").exists()
    assert len(list(alarms.glob(".*.not-a-folder.*"))) == 2


def test_a_file_that_cannot_be_moved_is_skipped_remembered_and_shows_in_readiness(tmp_path,
                                                                                 store, caplog):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    alarms.mkdir()
    (alarms / "rejected").mkdir()
    (alarms / "rejected" / "bad.json").mkdir()  # os.replace onto a folder fails
    _raw(alarms, "bad.json", b"not json")
    drop(alarms, alarm("good", settled=False))
    intake = make_intake(alarms, store, clock)
    metrics = DaemonMetrics(NODE)
    metrics.ready = True
    with caplog.at_level(logging.ERROR, logger="screener.intake"):
        first = intake.run()
        second = intake.run()
    assert first.stuck == ["bad.json"] and second.stuck == ["bad.json"]
    assert [r.alarm_id for r in first.applied] == ["good"]
    assert len([r for r in caplog.records if "bad.json" in r.getMessage()]) == 1  # remembered
    metrics.intake_pass(len(second.stuck), second.stalled)
    ready, body = metrics.readiness()
    assert not ready and "neither taken nor moved" in body["intake"]
    assert metrics.alarm_files_stuck.labels(NODE)._value.get() == 1
    (alarms / "rejected" / "bad.json").rmdir()  # an operator clears the way
    (alarms / "bad.json").write_bytes(b"still not json")  # and the file changes: tried again
    third = intake.run()
    assert third.rejected == ["bad.json"] and not third.stuck
    metrics.intake_pass(len(third.stuck), third.stalled)
    assert metrics.readiness()[0]


def test_an_unlistable_folder_stalls_the_intake_without_raising(tmp_path, store):
    clock = FakeClock(2000.0)
    alarms = tmp_path / "alarms"
    alarms.write_text("a file where the folder should be")
    result = make_intake(alarms, store, clock).run()
    assert result.stalled.startswith("cannot list") and result.count == 0


def test_alarms_our_writers_make_for_long_job_and_node_names_are_taken(tmp_path, store,
                                                                       monkeypatch):
    """The in-job writers (auditor, exit-75 guard, straggler) keep their alarm ids within what
    the intake accepts, however long the job's and the node's names are."""
    node = "ip-172-31-100-200.ap-southeast-2.compute.internal." + "gpu-pool-a" * 6
    job = "llm-pretrain-70b-stage2-" + "run" * 13
    me = SuspectNode(node=node, hostname=node)
    sdc = SDCAlarm("ring_replay", 7, (3,), (me,), True, {}, candidate_ranks=(3,),
                   key=f"{job}-ring_replay-s7")
    monkeypatch.setenv("NODE_NAME", node)
    records = [node_records(sdc, {3: node}, {node: me}, job=job)[node],
               hardware_error_alarm(RuntimeError("uncorrectable ECC error"), job=job, step=7),
               straggler_alarm(Straggler(rank=3, score=9.0, slowdown=0.5, consecutive=20,
                                         duration=1.5, node=me),
                               StepResult(step=7, median=1.0, mad=0.1, scale=0.15, scores=(),
                                          stragglers=()), k=6.0, window=20, job=job)]
    alarms = tmp_path / "alarms"
    for r in records:
        write_alarm_file(r, alarms)
    clock = FakeClock(2000.0)
    intake = AlarmIntake(alarms, node, lambda r: apply_event(store, node, r, now=clock()),
                         lambda r: applied_in_history(store.history(node), r.alarm_id))
    result = intake.run()
    assert result.rejected == [] and len(result.applied) == 3, result
    assert sorted(r.alarm_id for r in result.applied) == sorted(r.alarm_id for r in records)
