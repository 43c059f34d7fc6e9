"""Alarm intake: exactly once (also across a restart), malformed files to rejected/, foreign files
left alone. Real files, the real LocalStore, the real lifecycle."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from screener import lifecycle
from screener.intake import AlarmIntake, applied_in_history
from screener.stores import apply_event
from screener.stores.local import LocalStore
from screener.types import AlarmRecord, NodeState, SuspectNode

NODE = "gpu-node-1"


def alarm(alarm_id: str, *, settled: bool = True, node: str = NODE, step: int = 7) -> AlarmRecord:
    return AlarmRecord(alarm_id=alarm_id, check="ring_replay", step=step, settled=settled,
                       suspect_ranks=(3,) if settled else (),
                       suspect_nodes=(SuspectNode(node=node, hostname=node),), node=node,
                       job="train-llm", created=1000.0, evidence={"rows": [1, 2]})


def drop(directory, record: AlarmRecord) -> None:
    from screener.audit.alarms import write_alarm_file

    write_alarm_file(record, directory)


class Clock:
    def __init__(self, t: float = 2000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_intake(directory, store, clock):
    def apply(record):
        apply_event(store, NODE, record, now=clock())

    def before(record):
        return applied_in_history(store.history(NODE), record.alarm_id)

    return AlarmIntake(directory, NODE, apply, before)


@pytest.fixture
def store(tmp_path):
    s = LocalStore(tmp_path / "state.db")
    yield s
    s.close()


def test_applied_once_then_moved_aside(tmp_path, store):
    clock = Clock()
    alarms = tmp_path / "alarms"
    apply_event(store, NODE, lifecycle.NodeSeen(), now=clock())
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
    clock = Clock()
    alarms = tmp_path / "alarms"
    apply_event(store, NODE, lifecycle.NodeSeen(), now=clock())
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
    apply_event(store, NODE, lifecycle.HumanCommand(NodeState.BURNIN, "checked by hand"), now=clock())
    clock.t += 60
    result = make_intake(alarms, store, clock).run()  # a new intake: the restarted daemon
    assert result.applied == [] and result.duplicates == ["a-crash"]
    assert store.get_state(NODE) == NodeState.BURNIN
    assert sum(1 for t in store.history(NODE) if t.to_state == NodeState.SUSPECT) == 1
    assert (alarms / "processed" / "a-crash.json").exists()


def test_a_failed_apply_leaves_the_file_for_the_next_pass(tmp_path, store):
    clock = Clock()
    alarms = tmp_path / "alarms"
    drop(alarms, alarm("a2"))
    calls = []

    def broken(record):
        calls.append(record.alarm_id)
        raise ConnectionError("API unreachable")

    result = AlarmIntake(alarms, NODE, broken).run()
    assert result.failed == ["a2.json"] and result.applied == []
    assert (alarms / "a2.json").exists()  # not moved: its transition was not stored
    result = make_intake(alarms, store, clock).run()
    assert [r.alarm_id for r in result.applied] == ["a2"]
    assert store.get_state(NODE) == NodeState.QUARANTINED


def test_malformed_files_are_rejected_with_one_log_line_and_the_rest_applied(tmp_path, store,
                                                                              caplog):
    clock = Clock()
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


def test_files_about_other_nodes_are_left_for_their_daemon(tmp_path, store):
    clock = Clock()
    alarms = tmp_path / "alarms"
    drop(alarms, alarm("other", node="gpu-node-2"))
    result = make_intake(alarms, store, clock).run()
    assert result.foreign == ["other.json"] and result.count == 0
    assert (alarms / "other.json").exists()
    assert store.get_state(NODE) is None


def test_a_redelivered_file_already_processed_is_a_duplicate(tmp_path, store):
    clock = Clock()
    alarms = tmp_path / "alarms"
    drop(alarms, alarm("dup"))
    make_intake(alarms, store, clock).run()
    drop(alarms, alarm("dup"))
    result = make_intake(alarms, store, clock).run()
    assert result.duplicates == ["dup"]
    assert sum(1 for t in store.history(NODE) if t.to_state == NodeState.QUARANTINED) == 1


def test_processed_folder_is_bounded(tmp_path, store):
    clock = Clock()
    alarms = tmp_path / "alarms"
    intake = make_intake(alarms, store, clock)
    intake.processed_keep = 2
    for i in range(4):
        drop(alarms, alarm(f"k{i}", settled=False, step=i))
        intake.run()
    assert len(list((alarms / "processed").iterdir())) == 2


def test_exactly_once_on_the_kube_store_with_bulky_evidence(tmp_path):
    """The Node's history annotation keeps a shrunk evidence; the alarm id must survive it."""
    from kubeapi import KubeAPI
    from screener.stores.kube import KubeStore

    clock = Clock()
    alarms = tmp_path / "alarms"
    big = AlarmRecord(alarm_id="bulky", check="ring_replay", step=9, settled=False,
                      suspect_ranks=(), suspect_nodes=(SuspectNode(NODE, NODE),), node=NODE,
                      created=1000.0, evidence={"differs": [f"layer.{i}.weight" for i in range(600)]})
    assert len(json.dumps(big.to_dict())) > 8192
    with KubeAPI() as api:
        api.add_node(NODE)
        store = KubeStore(api.api_client(), sleep=lambda s: None, instance="t")
        try:
            apply_event(store, NODE, lifecycle.NodeSeen(), now=clock())
            drop(alarms, big)
            saved = json.loads(next(alarms.glob("*.json")).read_text())
            make_intake(alarms, store, clock).run()
            (alarms / "processed" / "bulky.json").unlink()
            (alarms / "bulky.json").write_text(json.dumps(saved))  # the crash left it behind
            clock.t += 60
            apply_event(store, NODE, lifecycle.HumanCommand(NodeState.BURNIN, "by hand"), now=clock())
            result = make_intake(alarms, store, clock).run()
            assert result.duplicates == ["bulky"] and store.get_state(NODE) == NodeState.BURNIN
        finally:
            store.close()
