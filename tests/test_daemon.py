"""The daemon loop with a fake clock: real lifecycle, real LocalStore, real probes over a scripted
NVML, a scripted screen runner standing in for the known-answer child processes.

The rig and the scripted stand-ins live in tests/fakes/daemon.py, shared with every test that
runs the daemon loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import pytest

from fakes.daemon import NODE, DaemonRig, FakeNodeObject, ScriptedRunner, outcome
from screener.agent.screening.window import ScreenOutcome, ScreenRequest
from screener.audit.alarms import write_alarm_file
from screener.errors import ConfigError
from screener.settings.daemon import DaemonConfig
from screener.settings.hyperpod import HyperPodConfig
from screener.alarmfile import AlarmRecord
from screener.types import ExitCode, NodeState, Outcome, SuspectNode


@pytest.fixture
def rig_factory(tmp_path):
    rigs = []

    def make(runner: Any, **kw: Any) -> DaemonRig:
        rig = DaemonRig(tmp_path, runner, **kw)
        rigs.append(rig)
        return rig

    yield make
    for r in rigs:
        r.close()


# --- tests ----------------------------------------------------------------------------------------


def test_a_new_node_starts_in_burnin_and_is_screened_once_idle_for_the_window(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.PASS))
    rig = rig_factory(runner)
    first = rig.tick()
    assert first.state == NodeState.BURNIN
    assert first.transitions == [] and rig.store.history(NODE)[0].to_state == NodeState.BURNIN
    assert first.screen_due and not first.idle and runner.calls == []
    # Idle, but not yet for the whole window of 300 s.
    for _ in range(11):
        rig.tick(advance=25.0)
    assert runner.calls == []
    report = rig.tick(advance=25.0)  # 300 s quiet now
    assert report.idle and len(runner.calls) == 1
    assert report.state == NodeState.HEALTHY and report.exit_code == ExitCode.PASS
    assert [t["to"] for t in report.transitions] == ["healthy"]
    assert not rig.taint.present(NODE)
    assert rig.store.get_verdict(NODE)["outcome"] == "pass"


def test_probes_run_every_interval_and_a_healthy_node_is_rescreened_after_its_interval(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.PASS))
    rig = rig_factory(runner, idle_window_s=0.0, screen_interval_s=3600.0)
    rig.tick()
    # The new node's full burn-in: the probes before it and after it.
    assert len(runner.calls) == 1 and rig.probe_calls == 2 and runner.calls[0].kind == "full"
    for _ in range(24):  # 120 s at a tick of 5 s: probes at +60 and +120 only
        rig.tick(advance=5.0)
    assert rig.probe_calls == 4
    assert len(runner.calls) == 1
    rig.tick(advance=3600.0)
    assert len(runner.calls) == 2 and runner.calls[1].kind == "quick"
    assert rig.daemon.state == NodeState.HEALTHY
    assert rig.store.get_verdict(NODE)["kind"] == "quick"


def test_a_busy_gpu_holds_the_screen_off_until_quiet_for_the_window(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.PASS))
    rig = rig_factory(runner, idle_window_s=120.0)
    rig.nvml.gpus[0].processes = [(4242, 10 * 2**30)]  # a training process
    rig.tick()
    rig.tick(advance=600.0)
    assert runner.calls == [] and "4242" in rig.daemon.idle.last.reason
    rig.nvml.gpus[0].processes = []
    rig.nvml.gpus[1].utilization = (80, 40)  # no process visible, but kernels running
    rig.tick(advance=600.0)
    assert runner.calls == []
    rig.nvml.gpus[1].utilization = (0, 0)
    rig.tick(advance=60.0)  # quiet since now
    rig.tick(advance=60.0)
    assert runner.calls == []
    rig.tick(advance=60.0)  # 120 s quiet
    assert len(runner.calls) == 1


def test_a_mismatch_makes_a_healthy_node_suspect_and_the_confirming_screen_quarantines(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.SUSPECT), outcome(Outcome.SUSPECT))
    rig = rig_factory(runner, idle_window_s=0.0, screen_interval_s=3600.0)
    assert rig.tick().state == NodeState.HEALTHY
    report = rig.tick(advance=3600.0)
    assert report.state == NodeState.SUSPECT and report.exit_code == ExitCode.HARDWARE_SUSPECT
    # Suspect: the confirming screen is due at once (next probe, still idle).
    report = rig.tick(advance=60.0)
    assert len(runner.calls) == 3
    assert report.state == NodeState.QUARANTINED
    # Quarantined: never screened again by the daemon.
    rig.tick(advance=100_000.0)
    assert len(runner.calls) == 3


def test_an_inconclusive_screen_is_retried_only_after_the_retry_delay(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.INCONCLUSIVE), outcome(Outcome.PASS))
    rig = rig_factory(runner, idle_window_s=0.0, retry_inconclusive_s=600.0)
    report = rig.tick()
    assert report.screen.outcome == Outcome.INCONCLUSIVE
    assert report.state == NodeState.BURNIN and report.exit_code == ExitCode.INCONCLUSIVE
    for _ in range(9):
        rig.tick(advance=60.0)
    assert len(runner.calls) == 1
    assert rig.tick(advance=60.0).state == NodeState.HEALTHY
    assert len(runner.calls) == 2


def test_a_pending_remap_keeps_the_node_out_until_it_clears_then_it_is_rescreened(rig_factory):
    """Level-triggered: the pending remap holds the node suspect ("reset required") on every
    probe, no screen clears it meanwhile; once the reset applied the remap, the quick screen
    re-verifies the node (it had earned healthy)."""
    runner = ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.PASS))
    rig = rig_factory(runner, idle_window_s=0.0)
    assert rig.tick().state == NodeState.HEALTHY
    rig.nvml.gpus[1].remapped_rows = (0, 0, 1, 0)  # a row remap pending: suspect-level
    report = rig.tick(advance=60.0)
    assert [f["code"] for f in report.findings] == ["row_remap_pending"]
    assert report.state == NodeState.SUSPECT and report.transitions[0]["code"] == "ResetRequired"
    assert report.transitions[0]["reason"].startswith("reset required")
    for _ in range(5):  # still pending: re-applied, never screened, never cleared
        report = rig.tick(advance=60.0)
        assert [c["code"] for c in report.conditions] == ["row_remap_pending"]
        assert report.state == NodeState.SUSPECT and not report.screen_due
    assert len(runner.calls) == 1
    rig.nvml.gpus[1].remapped_rows = (1, 0, 0, 0)  # after the reset: remapped, nothing pending
    report = rig.tick(advance=60.0)
    assert report.conditions == [] and len(runner.calls) == 2 and runner.calls[1].kind == "quick"
    assert report.state == NodeState.HEALTHY


def test_a_remap_failure_sends_the_node_to_repair(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.PASS))
    rig = rig_factory(runner, idle_window_s=0.0)
    assert rig.tick().state == NodeState.HEALTHY
    rig.nvml.gpus[0].remapped_rows = (0, 8, 0, 1)
    report = rig.tick(advance=60.0)
    assert report.state == NodeState.REPAIR
    t = rig.store.history(NODE)[-1]
    assert t.code == "RowRemapFailure" and t.failure


def test_an_event_finding_is_fed_once(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.PASS))
    rig = rig_factory(runner, idle_window_s=0.0)
    assert rig.tick().state == NodeState.HEALTHY
    rig.nvml.gpus[0].set_ecc(volatile_corrected=5)  # corrected errors rose: an event
    report = rig.tick(advance=60.0)
    assert [f["code"] for f in report.findings] == ["ecc_corrected_rising"]
    assert [t["to"] for t in report.transitions] == ["suspect", "healthy"]  # confirming screen
    report = rig.tick(advance=60.0)
    assert report.findings == [] and report.transitions == [] and report.state == NodeState.HEALTHY


def test_alarms_are_taken_in_on_every_tick_and_a_settled_one_quarantines(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.PASS))
    rig = rig_factory(runner, idle_window_s=0.0)
    rig.tick()
    rig.drop_alarm("al-1")
    rig.drop_alarm("al-other", node="gpu-node-9")
    report = rig.tick(advance=5.0)  # no probe due: intake still runs
    assert not report.probed
    assert [r.alarm_id for r in report.intake.applied] == ["al-1"]
    assert report.state == NodeState.QUARANTINED
    assert report.exit_code == ExitCode.HARDWARE_SUSPECT
    assert report.intake.foreign == ["al-other.json"]
    entry = rig.store.history(NODE)[-1]
    assert entry.code == "WeightFingerprintMismatch" and entry.evidence["alarm"]["alarm_id"] == "al-1"


def test_a_node_released_from_the_budget_hold_gets_its_deep_check_metric_and_log(rig_factory):
    """A node held in suspect by the quarantine budget that takes a freed slot is quarantined like
    any other: counted in the transitions metric, in the pass report, and its deep health check
    starts (before, the release was recorded and nothing else happened: no check ever ran)."""
    from screener.lifecycle.apply import apply_event
    from screener.lifecycle.machine import HumanCommand

    checks: list[str] = []
    rig = rig_factory(ScriptedRunner(outcome(Outcome.PASS)), idle_window_s=0.0,
                      daemon_kw={"on_quarantine": lambda node: checks.append(node)})
    rig.tick()
    other = AlarmRecord(alarm_id="al-o", check="weights", step=3, settled=True,
                        suspect_ranks=(0,), suspect_nodes=(SuspectNode("gpu-o", "gpu-o"),),
                        node="gpu-o", job="llm", created=rig.clock())
    assert apply_event(rig.store, "gpu-o", other, now=rig.clock()).state == NodeState.QUARANTINED
    rig.drop_alarm("al-1")
    held = rig.tick(advance=5.0)
    assert held.state == NodeState.SUSPECT and checks == []  # the budget (one node) is used up
    apply_event(rig.store, "gpu-o", HumanCommand(NodeState.BURNIN, "repaired"), now=rig.clock())
    released = rig.tick(advance=60.0)
    assert released.state == NodeState.QUARANTINED
    assert [t["to"] for t in released.transitions] == ["quarantined"]
    assert released.transitions[0]["code"] == "QuarantineBudgetExhausted"
    assert checks == [NODE]
    assert rig.metrics.transitions.labels(NODE, "quarantined")._value.get() == 1


def test_a_runner_exception_is_our_error_not_a_verdict_and_the_loop_goes_on(rig_factory):
    def explode(request: ScreenRequest) -> Optional[ScreenOutcome]:
        raise RuntimeError("CUDA driver went away in our code")

    runner = ScriptedRunner(outcome(Outcome.PASS), during=None)
    broken = ScriptedRunner(during=explode)
    rig = rig_factory(broken, idle_window_s=0.0, retry_inconclusive_s=60.0)
    report = rig.tick()
    assert report.exit_code == ExitCode.SCREENER_ERROR
    assert report.state == NodeState.BURNIN  # not blamed on the node
    assert "RuntimeError" in report.screen.detail and not rig.taint.present(NODE)
    rig.daemon.window.runner = runner
    assert rig.tick(advance=60.0).state == NodeState.HEALTHY


def test_run_loop_stops_on_the_stop_event(rig_factory):
    runner = ScriptedRunner(outcome(Outcome.PASS))
    healthy = threading.Event()

    def replay() -> int:
        # The spool replay runs once in every pass: a pass after the screen sees the node healthy.
        if rig.daemon.state == NodeState.HEALTHY:
            healthy.set()
        return 0

    rig = rig_factory(runner, idle_window_s=0.0, tick_s=0.01, node_object=FakeNodeObject(replay=replay))
    t = threading.Thread(target=rig.daemon.run)
    t.start()
    assert healthy.wait(10), "the loop never screened the node healthy"
    rig.stop.set()
    t.join(5)
    assert not t.is_alive()
    assert rig.daemon.state == NodeState.HEALTHY and rig.metrics.ready is False


def test_config_rejects_unknown_keys_and_reads_env(tmp_path):
    with pytest.raises(ConfigError, match="screen_intervall"):
        DaemonConfig.from_mapping({"screen_intervall": 5})
    with pytest.raises(ConfigError, match="probes.*kmsg_pth|kmsg_pth"):
        DaemonConfig.from_mapping({"probes": {"kmsg_pth": None}})
    f = tmp_path / "d.toml"
    f.write_text('screen_interval_s = 7200\njobs = ["gemm-fp32"]\n[probes]\nkmsg_path = "/x"\n'
                 '[lifecycle]\nquarantine_budget = 0.2\n')
    cfg = DaemonConfig.load(f, environ={"NODE_NAME": "n7", "SCREENER_ALARM_DIR": "/a",
                                        "SCREENER_DAEMON_IDLE_WINDOW_S": "30",
                                        "SCREENER_DAEMON_DEVICES": "cuda:0,cuda:1"})
    assert (cfg.node, cfg.alarm_dir, cfg.idle_window_s, cfg.screen_interval_s) == ("n7", "/a", 30.0, 7200)
    assert cfg.devices == ("cuda:0", "cuda:1") and cfg.jobs == ("gemm-fp32",)
    assert cfg.probes.kmsg_path == "/x" and cfg.lifecycle.quarantine_budget == 0.2
    with pytest.raises(ConfigError, match="SCREENER_DAEMON_BOGUS"):
        DaemonConfig.load(None, environ={"SCREENER_DAEMON_BOGUS": "1"})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="bad.json"):
        DaemonConfig.load(bad, environ={})
    typo = tmp_path / "typo.toml"
    typo.write_text("tick_s = 1\n[lifecycle]\nquarantine_budgt = 0.1\n")
    with pytest.raises(ConfigError, match=r"^\S*typo\.toml: lifecycle config: unknown key\(s\) "
                                          r"quarantine_budgt; known: "):
        DaemonConfig.load(typo, environ={})
    with pytest.raises(ConfigError, match="daemon config must be a table"):
        DaemonConfig.from_mapping(["tick_s"])  # type: ignore[arg-type]
    assert DaemonConfig.load(None, environ={}).resolved_store({}) == "local"
    assert DaemonConfig.load(None, environ={}).resolved_store({"KUBERNETES_SERVICE_HOST": "x"}) == "kube"
    assert json.loads(json.dumps(cfg.to_dict()))["probes"]["kmsg_path"] == "/x"


def test_the_hyperpod_table_is_validated_at_load_even_with_the_feature_off(tmp_path):
    # Issue 15: a misspelt key used to load silently and leave the deep check unwired.
    f = tmp_path / "d.toml"
    f.write_text('[hyperpod]\ndeep_check_on_quarantin = true\nregoin = "us-west-2"\n')
    with pytest.raises(ConfigError, match=r"d\.toml: hyperpod config: unknown key\(s\) "
                                          r"deep_check_on_quarantin, regoin"):
        DaemonConfig.load(f, environ={})
    for table, why in (({"checks": ["InstanceStres"]}, "unknown deep health check"),
                       ({"checks": "InstanceStress"}, "must be a list"),
                       ({"max_attempts": 0}, ">= 1"),
                       ({"deep_check_on_quarantine": "yes"}, "true or false"),
                       ({"cluster": 5}, "must be a string")):
        with pytest.raises(ConfigError, match=why):
            DaemonConfig.from_mapping({"hyperpod": table})
    cfg = DaemonConfig.from_mapping({"hyperpod": {"cluster": "c1", "region": "us-west-2",
                                                  "checks": ["InstanceStress", "InstanceStress"]}})
    assert cfg.hyperpod == HyperPodConfig(cluster="c1", region="us-west-2",
                                          checks=("InstanceStress",))
    assert DaemonConfig.from_mapping({}).hyperpod.deep_check_on_quarantine is False
    assert json.loads(json.dumps(cfg.to_dict()))["hyperpod"]["checks"] == ["InstanceStress"]


@pytest.mark.slow
def test_once_from_the_command_line_uses_the_local_store_and_exits_with_the_contract(tmp_path):
    """`screener daemon --once` as a user runs it: no cluster configured -> the local store under
    $XDG_STATE_HOME; a settled alarm -> quarantined -> exit 75; JSON log lines on stderr."""
    root = Path(__file__).resolve().parents[1]
    config = tmp_path / "d.toml"
    config.write_text('screens = false\nmetrics_port = -1\n[probes]\nkmsg_path = "/nonexistent"\n'
                      f'disk_paths = ["{tmp_path}"]\nmin_free_disk_fraction = 0.0\n'
                      'min_free_memory_fraction = 0.0\n')
    env = {**os.environ, "NODE_NAME": NODE, "SCREENER_ALARM_DIR": str(tmp_path / "alarms"),
           "XDG_STATE_HOME": str(tmp_path / "state"), "SCREENER_CONFIG": str(config)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    cmd = [sys.executable, "-m", "screener.cli", "daemon", "--once", "--json"]
    first = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == int(ExitCode.INCONCLUSIVE), first.stderr  # a new node: burnin
    assert json.loads(first.stdout)["state"] == "burnin"
    assert (tmp_path / "state" / "screener" / "screener.db").exists()
    write_alarm_file(AlarmRecord(alarm_id="cli-1", check="nonfinite_local", step=3, settled=True,
                                 suspect_ranks=(0,), suspect_nodes=(SuspectNode(NODE, NODE),),
                                 node=NODE), tmp_path / "alarms")
    (tmp_path / "alarms" / "broken.json").write_text("{")
    second = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == int(ExitCode.HARDWARE_SUSPECT), second.stderr
    report = json.loads(second.stdout)
    assert report["state"] == "quarantined" and report["alarms"]["applied"] == ["cli-1"]
    assert report["alarms"]["rejected"] == ["broken.json"]
    logs = [json.loads(line) for line in second.stderr.splitlines() if line.strip()]
    assert {"time", "level", "logger", "msg"} <= set(logs[0])
    assert any(x.get("event") == "alarm" and x.get("alarm_id") == "cli-1" for x in logs)
    assert sum("rejected" in x["msg"] for x in logs) == 1
    # Bad configuration is bad input: one line, exit 2, no traceback.
    config.write_text("screen_interval = 5\n")
    bad = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "screen_interval" in bad.stderr and "Traceback" not in bad.stderr
