"""GPU lemons through the real path: scripted NVML -> probes -> daemon -> store -> lemon rule.

No evidence is made by hand: the serial comes from the fake NVML's nvmlDeviceGetSerial, the
finding from the real rules, the transition from the real lifecycle and store.
"""

from __future__ import annotations

from fakes.fake_nvml import FakeNvml, h100
from screener.audit.alarms import write_alarm_file
from screener.lifecycle.apply import apply_event
from screener.lifecycle.machine import HumanCommand
from screener.lifecycle.records import lemon_counts
from screener.stores.local import LocalStore
from screener.alarmfile import AlarmRecord
from screener.types import NodeState, Outcome, SuspectNode
from fakes.daemon import DaemonRig, ScriptedRunner, outcome

MOVED = "1650923077777"  # the GPU that moves from node A to node B


def lose(rig: DaemonRig, index: int = 0) -> None:
    rig.nvml.gpus[index].lost = True


def back(rig: DaemonRig, index: int = 0) -> None:
    rig.nvml.gpus[index].lost = False


def test_a_gpu_that_keeps_failing_is_followed_by_its_serial_across_nodes(tmp_path):
    store = LocalStore(tmp_path / "fleet.db")
    a = DaemonRig(tmp_path / "a", ScriptedRunner(outcome(Outcome.PASS)), store=store,
                  nvml=FakeNvml([h100(0, serial=MOVED), h100(1)]), node="node-a",
                  idle_window_s=0.0)
    b = None
    try:
        assert a.tick().state == NodeState.HEALTHY  # full burn-in passed
        for i in range(2):  # the GPU stops answering NVML twice on node A
            lose(a)
            report = a.tick(advance=60.0)
            assert report.state == NodeState.QUARANTINED
            t = store.history("node-a")[-1]
            assert t.failure and t.gpu_serials == (MOVED,)
            back(a)
            apply_event(store, "node-a", HumanCommand(NodeState.BURNIN, "GPU reseated"),
                        now=a.clock())
            a.daemon.state = NodeState.BURNIN
            a.daemon.window.runner = ScriptedRunner(outcome(Outcome.PASS))
            assert a.tick(advance=60.0).state == NodeState.HEALTHY
        by_node, by_serial = lemon_counts(store.failures(0.0))
        assert by_node == {"node-a": 2} and by_serial == {MOVED: 2}

        # The GPU moves to node B (its first failure there): the third failure of the GPU.
        b = DaemonRig(tmp_path / "b", ScriptedRunner(outcome(Outcome.PASS)), store=store,
                      nvml=FakeNvml([h100(0), h100(1, serial=MOVED)]), node="node-b",
                      idle_window_s=0.0)
        b.clock.t = a.clock() + 60.0
        assert b.tick().state == NodeState.HEALTHY
        lose(b, 1)
        report = b.tick(advance=60.0)
        assert report.state == NodeState.REPAIR
        t = store.history("node-b")[-1]
        assert t.code == "RepeatedFailures" and t.evidence["lemon"]["gpu_serial"] == MOVED
        assert t.evidence["lemon"]["nodes"] == ["node-a", "node-b"]
    finally:
        a.close()
        if b is not None:
            b.adapter.close()


def test_an_alarm_naming_another_nodes_serial_changes_nothing_here(tmp_path):
    rig = DaemonRig(tmp_path, ScriptedRunner(outcome(Outcome.PASS)), idle_window_s=0.0)
    try:
        rig.tick()
        mine = rig.nvml.gpus[1].serial
        for alarm_id, serials, settled in (("far", ["1650923099999"], False),
                                           ("near", ["1650923099999", mine], True)):
            write_alarm_file(AlarmRecord(alarm_id=alarm_id, check="weights", step=3,
                                         settled=settled, suspect_ranks=(1,),
                                         suspect_nodes=(SuspectNode(rig.config.node, "h"),),
                                         node=rig.config.node, created=rig.clock() - 1,
                                         evidence={"gpu_serials": serials}),
                             rig.config.alarm_dir)
            rig.tick(advance=5.0)
        far, near = rig.store.history(rig.config.node)[-2:]
        assert far.to_state == NodeState.SUSPECT and far.gpu_serials == ()
        assert far.evidence["alarm"]["evidence"]["foreign_serials"] == ["1650923099999"]
        assert near.to_state == NodeState.QUARANTINED and near.gpu_serials == (mine,)
        _, by_serial = lemon_counts(rig.store.failures(0.0))
        assert by_serial == {mine: 1}
    finally:
        rig.close()
