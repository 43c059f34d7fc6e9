"""Pure parts of screener.audit: topology, ring plan, vote, alarm records and files, exit codes,
verified-checkpoint markers. No process group needed."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import screener.audit
from screener.audit import AuditError, AuditUsageError, NumericFailure, SDCAlarm, classify, \
    rollback_target, run_guarded
from screener.audit.alarms import node_records, write_alarm_file
from screener.audit.checkpoints import marker_path, read_marker, write_marker
from screener.audit.ring import (differing_rows, make_record, record_digest, referee_of,
                                 replay_plan, replayer_of)
from screener.audit.topology import RankInfo, Topology, instance_id_of
from screener.audit.vote import vote
from screener.alarmfile import AlarmRecord
from screener.types import ExitCode, SuspectNode

ROOT = Path(__file__).resolve().parents[1]


def topo(nodes: list[str]) -> Topology:
    return Topology(RankInfo(rank=r, local_rank=-1, hostname=f"host-{n}", node=n, device="cpu",
                             gpu_uuid=None, instance_id=instance_id_of(n))
                    for r, n in enumerate(nodes))


THREE = ["a", "a", "b", "b", "c", "c"]


# ---- topology ----------------------------------------------------------------------------------

def test_instance_id_comes_from_hyperpod_node_names_only():
    assert instance_id_of("hyperpod-i-0123456789abcdef0") == "i-0123456789abcdef0"
    assert instance_id_of("hyperpod-i-0abc1234") == "i-0abc1234"
    assert instance_id_of("ip-10-0-0-1.ec2.internal") is None
    assert instance_id_of("hyperpod-i-xyz") is None
    assert instance_id_of("node-i-0123456789abcdef0") is None


def test_topology_groups_ranks_by_node_in_stable_order():
    t = Topology(reversed(list(topo(["n2", "n1", "n2", "n1"]).infos)))  # gathered in any order
    assert t.nodes == ["n2", "n1"]  # by each node's lowest rank
    assert t.ranks_on("n1") == [1, 3] and t.ranks_on("n2") == [0, 2]
    assert t.node_of(3) == "n1"
    assert t.writer_of("n1") == 1
    assert t.suspect_node(2) == SuspectNode(node="n2", hostname="host-n2", instance_id=None)
    with pytest.raises(KeyError):
        t.node_of(9)


def test_suspect_node_carries_the_instance_id():
    t = topo(["hyperpod-i-0123456789abcdef0", "hyperpod-i-0fedcba9876543210"])
    assert t.suspect_node(1).instance_id == "i-0fedcba9876543210"
    assert [n.node for n in t.suspect_nodes([1, 0, 1])] == [
        "hyperpod-i-0123456789abcdef0", "hyperpod-i-0fedcba9876543210"]


def test_local_rank_info_reads_node_name_and_launcher_env(monkeypatch):
    from screener.audit.topology import local_rank_info
    monkeypatch.setenv("NODE_NAME", "hyperpod-i-0123456789abcdef0")
    monkeypatch.setenv("LOCAL_RANK", "3")
    info = local_rank_info(5, "cpu")
    assert (info.rank, info.local_rank, info.node, info.instance_id, info.device, info.gpu_uuid) == (
        5, 3, "hyperpod-i-0123456789abcdef0", "i-0123456789abcdef0", "cpu", None)
    monkeypatch.delenv("NODE_NAME")
    assert local_rank_info(0, "cpu").node == info.hostname


# ---- ring plan ---------------------------------------------------------------------------------

def test_ring_replays_the_same_local_rank_of_the_next_node():
    t = topo(THREE)
    plan = replay_plan(t)
    # owner -> replayer: node b's ranks are replayed by node a's, a's by c's (a ring over nodes)
    assert plan == {0: 4, 1: 5, 2: 0, 3: 1, 4: 2, 5: 3}
    assert sorted(plan.values()) == list(range(6))  # every rank replays exactly one
    for owner, replayer in plan.items():
        assert t.node_of(owner) != t.node_of(replayer)
        ref = referee_of(t, owner, replayer)
        assert ref is not None
        assert t.node_of(ref) not in {t.node_of(owner), t.node_of(replayer)}


def test_two_nodes_have_no_referee_and_one_node_replays_within_it():
    t = topo(["a", "a", "b", "b"])
    assert replayer_of(t, 1) == 3
    assert referee_of(t, 1, 3) is None
    one = topo(["a", "a", "a"])
    assert [replayer_of(one, r) for r in range(3)] == [2, 0, 1]
    assert referee_of(one, 0, 2) is None
    assert replayer_of(topo(["a"]), 0) is None


def test_uneven_nodes_still_give_every_owner_a_replayer_elsewhere():
    t = topo(["a", "a", "a", "b", "c", "c"])
    for owner, replayer in replay_plan(t).items():
        assert replayer is not None and t.node_of(replayer) != t.node_of(owner)


def test_records_and_digests_see_one_changed_gradient_bit():
    g = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.ones(5)]
    a = make_record(torch.tensor(2.5), g)
    g2 = [g[0].clone(), g[1].clone()]
    g2[1].view(torch.int32)[3] ^= 1  # lowest mantissa bit
    b = make_record(torch.tensor(2.5), g2)
    assert differing_rows(a, b) == [2]
    da, db = record_digest(torch.stack([a, a])), record_digest(torch.stack([a, b]))
    assert torch.equal(da[0], db[0]) and not torch.equal(da[1], db[1])
    assert make_record(torch.tensor(2.5), [None])[1].tolist() == [0, 0]
    # the loss is compared bit for bit (as float64 bits)
    assert differing_rows(make_record(torch.tensor(2.5), g), make_record(
        torch.nextafter(torch.tensor(2.5), torch.tensor(3.0)), g)) == [0]


# ---- vote --------------------------------------------------------------------------------------

def test_vote_names_replicas_that_differ_from_a_strict_majority():
    x, y, z = torch.tensor([1, 2]), torch.tensor([1, 3]), torch.tensor([9, 9])
    r = vote([x, x, y, x, x, z])
    assert r.settled and r.majority == (0, 1, 3, 4) and r.outliers == (2, 5)
    assert vote([x, x, x]).agree and vote([x, x, x]).outliers == ()
    tie = vote([x, x, x, y, y, y])
    assert not tie.settled and tie.outliers == () and not tie.agree
    assert not vote([x, y]).settled  # two copies cannot say which is wrong


# ---- alarms ------------------------------------------------------------------------------------

def _records(alarm: SDCAlarm, nodes=THREE):
    t = topo(nodes)
    return node_records(alarm, {r: t.node_of(r) for r in t.ranks},
                        {n: t.suspect_node(t.ranks_on(n)[0]) for n in t.nodes}, job="j")


def test_settled_alarm_goes_only_to_the_suspect_node():
    t = topo(THREE)
    alarm = SDCAlarm("ring_replay", 40, [3], t.suspect_nodes([3]), True, {"x": 1})
    recs = _records(alarm)
    assert list(recs) == ["b"]
    rec = recs["b"]
    assert rec.node == "b" and rec.settled and rec.suspect_ranks == (3,)
    assert rec.suspect_nodes == (SuspectNode("b", "host-b", None),)
    assert AlarmRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec


def test_unsettled_alarm_goes_to_each_candidate_node_naming_nobody():
    alarm = SDCAlarm("ring_replay", 4, (), (), False, {}, candidate_ranks=[1, 3])
    recs = _records(alarm, ["a", "a", "b", "b"])
    assert sorted(recs) == ["a", "b"]
    for node, rec in recs.items():
        assert rec.node == node and not rec.settled and rec.suspect_ranks == ()
        assert [n.node for n in rec.suspect_nodes] == [node]
    assert recs["a"].evidence["candidate_ranks"] == [1]
    assert recs["a"].alarm_id != recs["b"].alarm_id  # one file each, even in one shared directory


def test_alarm_file_is_written_atomically_and_parses(tmp_path):
    alarm = SDCAlarm("weights", 7, [0], topo(THREE).suspect_nodes([0]), True, {"groups": [[0]]})
    rec = _records(alarm)["a"]
    path = write_alarm_file(rec, tmp_path / "alarms")
    assert path.name == f"{rec.alarm_id}.json"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    assert AlarmRecord.from_dict(json.loads(path.read_text())) == rec
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        write_alarm_file(rec, blocker)


def test_alarm_validates_and_survives_pickling():
    with pytest.raises(ValueError):
        SDCAlarm("made_up", 1)
    with pytest.raises(ValueError):
        SDCAlarm("weights", 1, (), (), True)  # settled without a rank
    a = SDCAlarm("weights", 3, [5], (SuspectNode("n", "h", "i-0abc1234"),), True, {"k": [1]},
                 first_suspect_step=2)
    b = pickle.loads(pickle.dumps(a))
    assert b == a and b.first_suspect_step == 2 and "rank 5" in str(b) and "i-0abc1234" in str(b)
    n = pickle.loads(pickle.dumps(NumericFailure(4, [1], {"a": 1})))
    assert (n.step, n.ranks) == (4, (1,))


# ---- exit codes --------------------------------------------------------------------------------

@pytest.mark.parametrize("exc,code", [
    (SDCAlarm("weights", 1, [0], (), True), ExitCode.HARDWARE_SUSPECT),
    (SDCAlarm("nonfinite_reduced", 1), ExitCode.HARDWARE_SUSPECT),
    (NumericFailure(1, [0]), ExitCode.NUMERIC),
    (FloatingPointError("loss is nan"), ExitCode.NUMERIC),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), ExitCode.HARDWARE_SUSPECT),
    (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
     ExitCode.PEER_FAILED),
    (RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8)"),
     ExitCode.PEER_FAILED),
    (dist.DistBackendError("NCCL communicator was aborted"), ExitCode.PEER_FAILED),
    (TimeoutError("barrier"), ExitCode.PEER_FAILED),
    (AuditUsageError("screener.audit: the model is torch.compile(DDP(model)): ..."),
     ExitCode.USAGE),
    (AuditUsageError("refused, whatever it quotes: connection reset, ECC"), ExitCode.USAGE),
    (AuditError("screener.audit: the ring replay at step 0 failed on rank(s) 2"),
     ExitCode.SCREENER_ERROR),
    (ValueError("bad shape"), None),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), None),
    (ZeroDivisionError("x"), None),
])
def test_classify(exc, code):
    assert classify(exc) == code


def test_classify_follows_the_cause_chain():
    try:
        try:
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
        except RuntimeError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert classify(outer) == ExitCode.HARDWARE_SUSPECT


def test_every_exception_class_of_the_audit_has_its_exit_code():
    """The guard's table covers each class screener.audit raises: none escapes as a traceback."""
    classes = {name: obj for name in screener.audit.__all__
               if isinstance(obj := getattr(screener.audit, name), type)
               and issubclass(obj, BaseException)}
    assert set(classes) == {"SDCAlarm", "NumericFailure", "AuditError", "AuditUsageError"}
    for cls in classes.values():
        exc = cls("weights", 1) if cls is SDCAlarm else cls(1, [0]) if cls is NumericFailure \
            else cls("x")
        assert classify(exc) is not None, cls


def test_an_audit_error_whose_cause_is_hardware_or_a_peer_keeps_that_code():
    for cause, code in [(RuntimeError("CUDA error: uncorrectable ECC error encountered"), 75),
                        (TimeoutError("gloo timed out"), 77)]:
        try:
            try:
                raise cause
            except Exception as inner:
                raise AuditError("screener.audit: the ring replay at step 3 failed on rank(s) "
                                 "1") from inner
        except AuditError as e:
            assert classify(e) == code


def test_audit_failures_end_as_one_line_and_their_code_not_a_traceback(caplog):
    def ours():
        try:
            {}["missing"]
        except KeyError as e:
            raise AuditError("screener.audit: the ring replay at step 0 failed on rank(s) 1") \
                from e

    def refused():
        raise AuditUsageError("screener.audit: the DDP model runs inside torch.compile")

    caplog.set_level(logging.ERROR, logger="screener.audit")
    assert run_guarded(ours) == 1  # returned, not raised
    line = json.loads(caplog.records[-1].getMessage())
    assert (line["exit_code"], line["error"]) == (1, "AuditError")
    assert line["where"].startswith(__file__) and line["where"].endswith("(KeyError)")
    assert run_guarded(refused) == 2
    line = json.loads(caplog.records[-1].getMessage())
    assert (line["exit_code"], line["error"]) == (2, "AuditUsageError") and "where" not in line
    assert len(caplog.records) == 2 and all("\n" not in r.getMessage() for r in caplog.records)


def test_run_guarded_maps_logs_rank_and_host_first_and_reraises_the_rest(caplog):
    def alarm():
        raise SDCAlarm("weights", 9, [2], (SuspectNode("n", "h", None),), True)

    caplog.set_level(logging.ERROR, logger="screener.audit")
    assert run_guarded(alarm) == 75
    line = json.loads(caplog.records[-1].getMessage())
    assert list(line)[:2] == ["rank", "hostname"] and line["exit_code"] == 75
    assert line["check"] == "weights" and line["suspect_ranks"] == [2]
    assert run_guarded(lambda: (_ for _ in ()).throw(FloatingPointError("nan"))) == 76
    assert run_guarded(lambda: None) == 0
    assert run_guarded(lambda x: x, 3) == 3
    with pytest.raises(KeyError):
        run_guarded(lambda: {}["missing"])
    assert json.loads(caplog.records[-1].getMessage())["exit_code"] is None


# ---- verified checkpoints ----------------------------------------------------------------------

def test_rollback_target_takes_the_newest_verified_checkpoint_before_the_suspect_step(tmp_path):
    paths = {}
    for step in (10, 20, 30, 40):
        p = tmp_path / f"ckpt-{step}.pt"
        p.write_bytes(b"x")
        paths[step] = p
        if step != 30:  # 30 was saved without verified_save
            write_marker(p, step=step, weights_digest="d")
    listing = list(paths.values())
    assert rollback_target(listing, 35) == paths[20]
    assert rollback_target(listing, 40) == paths[20]  # strictly before
    assert rollback_target(listing, 41) == paths[40]
    assert rollback_target(listing, 10) is None
    assert rollback_target(str(tmp_path), 41) == paths[40]  # a directory of checkpoints
    paths[40].unlink()  # a verified checkpoint that is gone does not count
    assert rollback_target(listing, 41) == paths[20]
    assert read_marker(paths[20])["step"] == 20
    later = marker_path(paths[20]).stat().st_mtime_ns + 2_000_000_000
    os.utime(paths[20], ns=(later, later))  # the same path saved again, without verified_save
    assert read_marker(paths[20]) is None and rollback_target(listing, 41) == paths[10]
    marker_path(paths[10]).write_text(json.dumps({"schema": 1, "checkpoint": "other", "step": 10}))
    assert read_marker(paths[10]) is None  # a marker copied next to another file is not trusted


# ---- import contract ---------------------------------------------------------------------------

@pytest.mark.slow
def test_audit_imports_nothing_of_ours_but_the_vocabulary_and_fingerprint():
    code = ("import sys, json; import screener.audit; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('screener'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # screener.kernels is fingerprint's implementation (its compiled/vectorised paths).
    ours = {m for m in json.loads(out.stdout) if not m.startswith(("screener.audit",
                                                                   "screener.kernels"))}
    # screener.atomicfile: the one way a file is written (alarm files, checkpoint markers);
    # screener.alarmfile: the alarm file's contract, which the daemon's intake reads by
    assert ours <= {"screener", "screener.types", "screener.fingerprint", "screener.atomicfile",
                    "screener.alarmfile"}, ours


def test_the_three_auditors_share_one_base():
    """Auditor(model) returns an Auditor, a ShardedAuditor or a PipelineAuditor: the three share
    AuditorBase (the cadence and the context manager written once), which is not an auditor on
    its own."""
    from screener.audit import AuditorBase
    from screener.audit.auditor import Auditor
    from screener.audit.pipeline import PipelineAuditor
    from screener.audit.sharded import ShardedAuditor

    for cls in (Auditor, ShardedAuditor, PipelineAuditor):
        assert issubclass(cls, AuditorBase), cls
        for name in ("is_audit_step", "is_weights_step", "__enter__", "__exit__"):
            assert getattr(cls, name) is getattr(AuditorBase, name), (cls, name)
    with pytest.raises(TypeError, match="abstract"):
        AuditorBase()  # type: ignore[abstract]
