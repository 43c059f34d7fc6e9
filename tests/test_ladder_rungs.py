"""The repair ladder's rungs 2 and 3 (issue 24.3): reboot, then repair or replace.

Real lifecycle, real LocalStore (the ladder records through apply_event), real reboot slots in
the same SQLite file, and fake tools on PATH: `nvidia-smi`, `dcgmi` and a reboot command that
logs, for each call, how many reboot requests the state database already held (a reboot must be
on file before it is asked for: the daemon asking does not survive it). SageMaker calls go through
botocore's Stubber on a real client, which validates each request against the service model.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import threading
from pathlib import Path

import pytest
from botocore.stub import Stubber

from fakes.nvidia_tools import install_tools, tool_calls
from screener.agent.daemon.ports import RepairPorts
from screener.lifecycle.apply import apply_event
from screener.lifecycle.machine import HumanCommand, KnownAnswerScreen, RepairStep
from screener.remediation import hyperpod as hp
from screener.remediation.ladder import RepairLadder, rungs_taken
from screener.remediation.repairs import CommandRepairs, HyperPodRepairs
from screener.settings.ladder import LadderConfig
from screener.stores.local import LocalStore
from screener.stores.slots import SqliteSlots
from screener.types import NodeState, Outcome, Reason, Verdict

NODE = "hyperpod-i-0123456789abcdef0"
IID = "i-0123456789abcdef0"
CLUSTER = "ml-cluster"
BOOT = 1_700_000_000.0


class Rig:
    """A quarantined node, its ladder, a wall clock, a monotonic clock and a boot time."""

    def __init__(self, tmp: Path, *, repairs=None, store=None, timeout_s: float = 120.0,
                 **ladder) -> None:
        self.env, self.tools = install_tools(tmp)
        self.db = tmp / "state.db"
        self.env["FAKE_STATE_DB"] = str(self.db)
        self.store = store or LocalStore(self.db)
        self.now, self.mono, self.boot = BOOT + 86400.0, 1000.0, BOOT
        self.boot_ident: "str | None" = None  # the kernel's boot id; None: not readable
        cfg = {"enabled": True, "min_interval_s": 600.0, "reboot": "command",
               "reboot_command": ["fake-reboot", "--now"], **ladder}
        self.config = LadderConfig.from_mapping(cfg)
        self.slots = SqliteSlots(str(self.db), "reboot", self.config.max_rebooting,
                                 ttl=self.config.reboot_timeout_s, clock=lambda: self.now)
        self.ladder = RepairLadder(self.config, node=NODE, env=self.env,
                                   monotonic=lambda: self.mono, boot_time=lambda: self.boot,
                                   slots=self.slots, boot_id=lambda: self.boot_ident,
                                   repairs=repairs or CommandRepairs(self.config.reboot_command,
                                                                     env=self.env,
                                                                     timeout_s=timeout_s))
        self.apply(HumanCommand(NodeState.QUARANTINED, "bad known answers", user="test"))

    def apply(self, event):
        return apply_event(self.store, NODE, event, now=self.now)

    def state(self):
        return self.store.get_state(NODE)

    def step(self, advance: float = 0.0):
        self.now += advance
        self.mono += advance
        return self.ladder.step(self.store.history(NODE), [0, 1], self.now, self.apply)

    def fail_burnin(self):
        """The burn-in after a rung failed again: the node is quarantined anew."""
        assert self.state() == NodeState.BURNIN
        bad = Verdict(device="cuda:0", outcome=Outcome.SUSPECT, job="gemm", step=3,
                      tensor="out", evidence={"confirmed": True})
        self.apply(KnownAnswerScreen((bad,), confirmed=True, kind="full"))
        assert self.state() == NodeState.QUARANTINED

    def codes(self):
        return [(t.from_state.value if t.from_state else None, t.to_state.value, t.code)
                for t in self.store.history(NODE)]


def test_reset_then_reboot_recorded_before_it_is_asked_for_then_burnin(tmp_path):
    rig = Rig(tmp_path)
    rig.step()  # rung 1: the reset
    assert rig.state() == NodeState.BURNIN
    rig.fail_burnin()
    out = rig.step(advance=600.0)  # rung 2
    assert out.error == "" and rig.state() == NodeState.QUARANTINED
    reboots = [c for c in tool_calls(rig.tools) if c.startswith("reboot")]
    assert reboots == ["reboot --now on_file=1"], reboots  # the request was on file first
    last = rig.store.history(NODE)[-1]
    assert (last.from_state, last.to_state, last.code) == (
        NodeState.QUARANTINED, NodeState.QUARANTINED, Reason.REPAIR_STEP)
    assert last.evidence["remediation"]["ladder"]["boot_time"] == BOOT
    assert set(rig.slots.holders()) == {0}
    # Before the node comes back: waiting, nothing recorded, no second reboot.
    n = len(rig.store.history(NODE))
    out = rig.step(advance=120.0)
    assert "waiting for the reboot" in out.actions[0]["result"]
    assert len(rig.store.history(NODE)) == n
    # The host came back (the daemon restarted on it): a later boot proves the reboot.
    rig.boot = rig.now + 60.0
    out = rig.step(advance=300.0)
    assert rig.state() == NodeState.BURNIN, rig.codes()
    assert rig.store.history(NODE)[-1].code == Reason.REMEDIATED
    assert rig.slots.holders() == {}
    assert len([c for c in tool_calls(rig.tools) if c.startswith("reboot")]) == 1
    # Budget: the reset and the reboot request count; the reboot's end does not.
    assert rungs_taken(rig.store.history(NODE), 0.0) == 2


def test_failed_reboot_command_is_our_failure_not_a_verdict(tmp_path):
    rig = Rig(tmp_path)
    rig.step()
    rig.fail_burnin()
    (rig.tools / "reboot_fails").write_text("")
    out = rig.step(advance=600.0)
    assert "Interactive authentication required" in out.error
    assert rig.state() == NodeState.QUARANTINED  # not repair: a failed call proves nothing
    phases = [t.evidence["remediation"]["ladder"].get("phase") for t in rig.store.history(NODE)
              if t.code == Reason.REPAIR_STEP]
    assert phases == ["requested", "abandoned"]
    assert rig.slots.holders() == {}  # the slot is free for another node
    assert not any(t.failure for t in rig.store.history(NODE)[-2:])
    # No second reboot on the next passes: the rung was taken; a person decides.
    rig.step(advance=600.0)
    assert len([c for c in tool_calls(rig.tools) if c.startswith("reboot")]) == 1


def test_a_reboot_that_never_happens_is_abandoned_after_the_timeout(tmp_path):
    rig = Rig(tmp_path, reboot_timeout_s=900.0)
    rig.step()
    rig.fail_burnin()
    rig.step(advance=600.0)
    assert rig.slots.holders()
    out = rig.step(advance=600.0)
    assert "waiting" in out.actions[0]["result"] and rig.slots.holders()
    out = rig.step(advance=400.0)  # 1,000 s: past the timeout, same boot time
    assert "did not happen" in out.error
    assert rig.state() == NodeState.QUARANTINED and rig.slots.holders() == {}


def test_reboot_slots_cap_how_many_nodes_reboot_at_once(tmp_path):
    rig = Rig(tmp_path, max_rebooting=1)
    other = SqliteSlots(str(rig.db), "reboot", 1, ttl=3600.0, clock=lambda: rig.now)
    assert other.claim("another-node") is not None
    rig.step()
    rig.fail_burnin()
    out = rig.step(advance=600.0)
    assert "all 1 reboot slot(s) are taken" in out.actions[-1]["result"]
    assert not [c for c in tool_calls(rig.tools) if c.startswith("reboot")]
    assert rig.state() == NodeState.QUARANTINED
    other.release("another-node")
    rig.step(advance=600.0)  # the rate limit passed: the slot is free now
    assert [c for c in tool_calls(rig.tools) if c.startswith("reboot")] == [
        "reboot --now on_file=1"]


def test_dry_run_claims_nothing_and_reboots_nothing(tmp_path):
    rig = Rig(tmp_path)
    rig.step()
    rig.fail_burnin()
    object.__setattr__(rig.config, "dry_run", True)  # the same ladder, now told to only say
    out = rig.step(advance=600.0)
    assert out.actions[-1]["result"].startswith("dry run: would claim one of 1 reboot slot")
    assert rig.slots.holders() == {} and rig.state() == NodeState.QUARANTINED
    assert not [c for c in tool_calls(rig.tools) if c.startswith("reboot")]


def test_final_rung_sends_to_repair_after_reset_and_reboot_failed(tmp_path):
    rig = Rig(tmp_path, final="repair", max_rungs=3)
    rig.step()
    rig.fail_burnin()
    rig.step(advance=600.0)
    rig.boot = rig.now + 30.0 + 60.0
    rig.step(advance=300.0)
    rig.fail_burnin()
    rig.step(advance=600.0)
    assert rig.state() == NodeState.REPAIR
    last = rig.store.history(NODE)[-1]
    assert last.code == Reason.REMEDIATION_FAILED and last.failure
    assert last.evidence["remediation"]["ladder"]["rung"] == "final"


def test_without_reboot_or_final_the_node_waits_for_a_person(tmp_path):
    rig = Rig(tmp_path, reboot="off", reboot_command=[])
    rig.step()
    rig.fail_burnin()
    out = rig.step(advance=600.0)
    assert "are a person's" in out.actions[-1]["result"]
    assert rig.state() == NodeState.QUARANTINED


def test_repair_step_is_ignored_unless_quarantined_and_keeps_the_budget_slot(tmp_path):
    rig = Rig(tmp_path)
    d = rig.apply(RepairStep("reboot requested", {"ladder": {"rung": "reboot"}}))
    assert d.changed and d.state == NodeState.QUARANTINED
    assert rig.store.all_states() == {NODE: NodeState.QUARANTINED}
    rig.apply(HumanCommand(NodeState.BURNIN, "try again", user="test"))
    d = rig.apply(RepairStep("late", {}))
    assert not d.changed and "not quarantined" in d.note


# --- slots under a race -----------------------------------------------------------------------

def _claimer(db: str, node: str, q) -> None:
    slots = SqliteSlots(db, "reboot", 3, ttl=3600.0, clock=lambda: 1000.0)
    q.put((node, slots.claim(node) is not None))


def test_sqlite_slots_race_many_processes_exactly_capacity_win(tmp_path):
    db = str(tmp_path / "state.db")
    LocalStore(db).close()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(db, f"node-{i}", q)) for i in range(12)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    assert sum(won for _, won in got) == 3
    holders = SqliteSlots(db, "reboot", 3, ttl=3600.0, clock=lambda: 1000.0).holders()
    assert sorted(holders) == [0, 1, 2] and len({c.node for c in holders.values()}) == 3


def test_sqlite_slot_of_a_node_that_never_came_back_is_taken_over_after_ttl(tmp_path):
    db = str(tmp_path / "state.db")
    now = [0.0]
    a = SqliteSlots(db, "reboot", 1, ttl=100.0, clock=lambda: now[0])
    assert a.claim("lost").index == 0
    assert a.claim("next") is None
    now[0] = 150.0
    c = a.claim("next")
    assert c is not None and c.node == "next"
    assert a.claim("next") == c  # a claim is idempotent


# --- HyperPod -------------------------------------------------------------------------------

LAUNCH = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)


@pytest.fixture
def sagemaker(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    c = hp.make_client("us-west-2")
    with Stubber(c) as stub:
        c.stub = stub
        yield c
        stub.assert_no_pending_responses()


def _describe(c) -> None:
    c.stub.add_response("describe_cluster_node", {"NodeDetails": {
        "InstanceGroupName": "workers", "InstanceId": IID, "InstanceType": "ml.p5.48xlarge",
        "InstanceStatus": {"Status": "Running"}, "LaunchTime": LAUNCH,
        "PrivateDnsHostname": "ip-10-0-0-1.us-west-2.compute.internal"}},
        {"ClusterName": CLUSTER, "NodeId": IID})


def test_hyperpod_reboot_then_replace_through_the_ladder(tmp_path, sagemaker):
    store = LocalStore(tmp_path / "state.db")
    repairs = HyperPodRepairs(sagemaker, CLUSTER, state_of=store.get_state)
    rig = Rig(tmp_path, repairs=repairs, store=store, reboot="hyperpod", reboot_command=[],
              final="replace", max_rungs=3)
    rig.step()
    rig.fail_burnin()
    _describe(sagemaker)
    sagemaker.stub.add_response("batch_reboot_cluster_nodes",
                                {"Successful": [IID], "Failed": []},
                                {"ClusterName": CLUSTER, "NodeIds": [IID]})
    out = rig.step(advance=600.0)
    assert out.error == "" and "HyperPod accepted the reboot" in out.actions[-1]["result"]
    rig.boot = rig.now + 120.0
    rig.step(advance=600.0)
    rig.fail_burnin()
    _describe(sagemaker)
    sagemaker.stub.add_response("batch_replace_cluster_nodes",
                                {"Successful": [IID], "Failed": []},
                                {"ClusterName": CLUSTER, "NodeIds": [IID]})
    out = rig.step(advance=600.0)
    assert out.error == "" and "HyperPod accepted the replacement" in out.actions[-1]["result"]
    assert rig.state() == NodeState.REPAIR
    assert rungs_taken(rig.store.history(NODE), 0.0) == 3


def test_hyperpod_refusing_the_reboot_is_recorded_not_judged(tmp_path, sagemaker):
    store = LocalStore(tmp_path / "state.db")
    repairs = HyperPodRepairs(sagemaker, CLUSTER, state_of=store.get_state)
    rig = Rig(tmp_path, repairs=repairs, store=store, reboot="hyperpod", reboot_command=[])
    rig.step()
    rig.fail_burnin()
    _describe(sagemaker)
    sagemaker.stub.add_response("batch_reboot_cluster_nodes", {"Failed": [
        {"NodeId": IID, "ErrorCode": "InstanceIdInUse", "Message": "a reboot is under way"}]},
        {"ClusterName": CLUSTER, "NodeIds": [IID]})
    out = rig.step(advance=600.0)
    assert "InstanceIdInUse" in out.error and rig.state() == NodeState.QUARANTINED
    assert rig.slots.holders() == {}


def test_ladder_refuses_a_config_it_cannot_carry_out(tmp_path):
    cfg = LadderConfig.from_mapping({"enabled": True, "reboot": "hyperpod"})
    with pytest.raises(ValueError, match="reboot slots"):
        RepairLadder(cfg, node=NODE, monotonic=lambda: 0.0)


def test_threads_of_one_process_share_the_slot_file_safely(tmp_path):
    db = str(tmp_path / "state.db")
    LocalStore(db).close()
    wins: list[bool] = []

    def go(i: int) -> None:
        s = SqliteSlots(db, "reboot", 2, ttl=3600.0, clock=lambda: 5.0)
        wins.append(s.claim(f"n{i}") is not None)
        s.close()

    ts = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sum(wins) == 2


# --- slots on Kubernetes (the official client over HTTP, against tests/fakes/kubeapi.py) -------------

def _kube_slots(server, capacity: int, clock, instance: str):
    from screener.stores.kube import KubeStore
    from screener.stores.slots import KubeSlots

    store = KubeStore(server.api_client(), sleep=lambda s: None, clock=clock, instance=instance)
    return KubeSlots(store.calls, "reboot", capacity, ttl=100.0, clock=clock)


def test_kube_slots_race_exactly_capacity_win_and_release_by_uid():
    from fakes.kubeapi import KubeAPI

    with KubeAPI() as server:
        now = [1000.0]
        wins: list[str] = []

        def go(i: int) -> None:
            slots = _kube_slots(server, 3, lambda: now[0], f"d{i}")
            if slots.claim(f"node-{i}") is not None:
                wins.append(f"node-{i}")

        ts = [threading.Thread(target=go, args=(i,)) for i in range(10)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert len(wins) == 3
        s = _kube_slots(server, 3, lambda: now[0], "check")
        assert sorted(c.node for c in s.holders().values()) == sorted(wins)
        # Verbs within the DaemonSet's role: configmaps list, create, delete.
        verbs = {(c.verb, c.resource) for c in server.calls}
        assert verbs <= {("list", "configmaps"), ("create", "configmaps"),
                         ("delete", "configmaps"), ("get", "configmaps")}, verbs
        s.release(wins[0])
        assert wins[0] not in {c.node for c in s.holders().values()}
        assert s.claim("late") is not None
        # A holder that never came back (past the ttl) gives its slot to the next claimer.
        assert s.claim("later") is None
        now[0] += 150.0
        got = s.claim("later")
        assert got is not None and got.node == "later"
        # Every expired holder was freed (each delete with its uid as precondition).
        assert [c.node for c in s.holders().values()] == ["later"]


# --- the whole loop in the daemon -------------------------------------------------------------

def test_the_daemon_resets_then_reboots_and_its_restart_on_the_new_boot_rescreens(tmp_path):
    from fakes.clock import FakeClock
    from fakes.daemon import NODE as DNODE, DaemonRig, ScriptedRunner, outcome

    env, tools = install_tools(tmp_path)
    db = tmp_path / "state.db"
    env["FAKE_STATE_DB"] = str(db)
    clock = FakeClock()
    boot = [clock() - 3600.0]  # the host booted an hour before the daemon started
    store = LocalStore(db)
    slots = SqliteSlots(str(db), "reboot", 1, ttl=3600.0, clock=clock)
    ports = {"repair": RepairPorts(slots=slots, calls=CommandRepairs(["fake-reboot"], env=env))}
    ladder = {"enabled": True, "min_interval_s": 600.0, "reboot": "command",
              "reboot_command": ["fake-reboot"]}
    bad = outcome(Outcome.SUSPECT)
    runner = ScriptedRunner(outcome(Outcome.PASS), bad, bad, outcome(Outcome.PASS))
    rig = DaemonRig(tmp_path, runner, store=store, clock=clock, idle_window_s=0.0,
                    ladder=ladder, daemon_kw=ports, boot=lambda: boot[0], env=env)
    assert rig.tick().state == NodeState.HEALTHY
    rig.drop_alarm("a-1", settled=True)
    rig.tick(advance=60.0)  # quarantined, reset, its burn-in mismatched: suspect
    rig.tick(advance=600.0)  # the confirming screen mismatched too: quarantined again
    rig.tick(advance=600.0)  # rung 2
    seen = [(t.from_state.value if t.from_state else None, t.to_state.value, t.code)
            for t in store.history(DNODE)]
    assert ("quarantined", "quarantined", Reason.REPAIR_STEP) in seen, seen
    assert [c for c in tool_calls(tools) if c.startswith("reboot")] == ["reboot  on_file=1"]
    assert store.get_state(DNODE) == NodeState.QUARANTINED
    # The host rebooted; the DaemonSet's pod starts again on it: a new Daemon, same store.
    boot[0] = clock() + 5.0
    rig2 = DaemonRig(tmp_path, runner, store=store, clock=clock, idle_window_s=0.0,
                     ladder=ladder, daemon_kw=ports, boot=lambda: boot[0], env=env)
    n = len(store.history(DNODE))
    rig2.tick(advance=120.0)
    rig2.tick(advance=60.0)
    moves = [(t.from_state.value if t.from_state else None, t.to_state.value, t.code)
             for t in store.history(DNODE)[n:]]
    # The later boot proves the reboot; the burn-in that follows re-screens (and passes).
    assert moves[:2] == [("quarantined", "burnin", Reason.REMEDIATED),
                         ("burnin", "healthy", Reason.KNOWN_ANSWER_PASSED)], moves
    assert slots.holders() == {}
    assert len([c for c in tool_calls(tools) if c.startswith("reboot")]) == 1
    # Each rung taken is counted once, by the daemon that took it (the metric is per process).
    assert rig.metrics.ladder_rungs.labels(DNODE, "gpu_reset")._value.get() == 1.0
    assert rig.metrics.ladder_rungs.labels(DNODE, "reboot")._value.get() == 1.0
    assert rig2.metrics.ladder_rungs.labels(DNODE, "reboot")._value.get() == 0.0
    assert b'screener_ladder_rungs_total{node="gpu-node-1",rung="final"} 0.0' in \
        rig.metrics.exposition()
    rig.adapter.close()
    rig2.close()


def test_a_repair_step_on_kubernetes_keeps_the_taint_label_and_budget_slot():
    """The reboot request (quarantined -> quarantined) through KubeStore: appended to the
    history, the node stays labelled and tainted, and it still holds its one budget slot."""
    from fakes.kubeapi import KubeAPI
    from screener.stores.kube import KubeStore
    from screener.types import LABEL_STATE

    with KubeAPI() as server:
        for i in range(10):
            server.add_node(f"gpu-{i}")
        store = KubeStore(server.api_client(), sleep=lambda s: None, clock=lambda: BOOT,
                          instance="t")
        apply_event(store, "gpu-0", HumanCommand(NodeState.QUARANTINED, "bad", user="t"), now=BOOT)
        claims = {c.node for c in store.budget_view().claims.values()}
        assert claims == {"gpu-0"}
        d = apply_event(store, "gpu-0", RepairStep("reboot requested (repair ladder, rung 2)",
                                                   {"ladder": {"rung": "reboot",
                                                               "phase": "requested"}}),
                        now=BOOT + 1)
        assert d.changed and d.state == NodeState.QUARANTINED
        hist = store.history("gpu-0")
        assert [t.code for t in hist][-1] == Reason.REPAIR_STEP
        assert store.get_state("gpu-0") == NodeState.QUARANTINED
        obj = store.get_node("gpu-0")
        assert obj["metadata"]["labels"][LABEL_STATE] == "quarantined"
        assert any(t.get("effect") == "NoSchedule" for t in obj["spec"].get("taints", []))
        assert [c.node for c in store.budget_view().claims.values()] == ["gpu-0"]



# --- what the review found (each once a bug) ---------------------------------------------------

def test_a_reboot_that_did_not_happen_never_leads_to_repair_or_replace(tmp_path):
    rig = Rig(tmp_path, final="repair", max_rungs=3)
    rig.step()
    rig.fail_burnin()
    (rig.tools / "reboot_fails").write_text("")
    rig.step(advance=600.0)  # refused: abandoned
    out = rig.step(advance=600.0)
    assert rig.state() == NodeState.QUARANTINED, rig.codes()
    assert "did not happen; a person decides" in out.actions[-1]["result"]
    assert Reason.REMEDIATION_FAILED not in [t.code for t in rig.store.history(NODE)]


def test_the_ladder_bookkeeping_survives_the_kubernetes_history_shrink(tmp_path):
    """A reset of 8 GPUs with DCGM's table is bulky; the history entry is cut to 2 KiB and the
    rung must still be read back (else the reset repeats every episode, past the budget)."""
    from screener.lifecycle.records import Transition
    from screener.remediation.ladder import ladder_evidence, ladder_record
    from screener.stores.kube.formats import EVIDENCE_BYTES, shrink_evidence

    bulk = {"gpus": list(range(8)), "resets": [{"argv": ["nvidia-smi", "-r", "-i", str(i)],
                                                "output": "GPU %d was successfully reset. " % i * 40}
                                               for i in range(8)],
            "dcgm_diag": {"rows": {f"test {k}": "Pass - All" for k in range(40)}}}
    for rung, book in [("gpu_reset", {}), ("reboot", {"phase": "requested", "boot_time": BOOT,
                                                      "boot_id": "a" * 36, "requested_at": 5.0,
                                                      "method": "hyperpod", "slot": 0})]:
        ev = {"remediation": {"passed": True, "detail": "x" * 100,
                              **ladder_evidence(rung, bulk=bulk, **book)}}
        small = shrink_evidence(ev)
        assert len(__import__("json").dumps(small)) <= EVIDENCE_BYTES
        t = Transition(node=NODE, time=1.0, from_state=NodeState.QUARANTINED,
                       to_state=NodeState.BURNIN, reason="r", evidence=small)
        rec = ladder_record(t)
        assert rec is not None and rec["rung"] == rung, small
        for k, v in book.items():
            assert rec[k] == v


def test_final_replace_past_the_budget_still_sends_to_repair_without_replacing(tmp_path,
                                                                               sagemaker):
    store = LocalStore(tmp_path / "state.db")
    repairs = HyperPodRepairs(sagemaker, CLUSTER, state_of=store.get_state)
    rig = Rig(tmp_path, repairs=repairs, store=store, reboot="off", reboot_command=[],
              final="replace", max_rungs=1)
    rig.step()  # the reset: the one rung the budget allows
    rig.fail_burnin()
    out = rig.step(advance=600.0)  # no SageMaker call is stubbed: none may be made
    assert rig.state() == NodeState.REPAIR
    said = [a["result"] for a in out.actions]
    assert any("budget is spent; a person replaces the node" in r for r in said), said


def test_a_reboot_command_that_hangs_keeps_the_slot_and_the_request(tmp_path):
    """The host going down under the command looks like a timeout: not a refusal."""
    rig = Rig(tmp_path, timeout_s=1.0)
    rig.step()
    rig.fail_burnin()
    (rig.tools / "reboot_hangs").write_text("")
    out = rig.step(advance=600.0)
    assert "no answer" in out.actions[-1]["result"] and out.error
    assert set(rig.slots.holders()) == {0}  # still held: the node may be rebooting
    phases = [t.evidence["remediation"].get("ladder_phase") for t in rig.store.history(NODE)
              if t.code == Reason.REPAIR_STEP]
    assert phases == ["requested"]
    rig.boot = rig.now + 120.0  # it did reboot
    rig.step(advance=300.0)
    assert rig.state() == NodeState.BURNIN and rig.slots.holders() == {}


def test_the_boot_id_not_a_stepped_clock_proves_the_reboot(tmp_path):
    rig = Rig(tmp_path)
    rig.boot_ident = "1b1e0ad5-0000-4000-8000-000000000001"
    rig.step()
    rig.fail_burnin()
    rig.step(advance=600.0)
    rig.boot += 3600.0  # the wall clock stepped forward: psutil's boot time moves with it
    out = rig.step(advance=60.0)
    assert rig.state() == NodeState.QUARANTINED and "waiting" in out.actions[-1]["result"]
    rig.boot_ident = "1b1e0ad5-0000-4000-8000-000000000002"  # a new boot
    rig.step(advance=60.0)
    assert rig.state() == NodeState.BURNIN
