"""The fire drill end to end: `screener drill` on the CPU (three simulated nodes, real DDP over
gloo, the real Auditor, alarm files, daemon passes over the real LocalStore), and the same alarm
files taken in by daemon passes against the Kubernetes API test server."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from cli_util import screener
from fakes.kubeapi import KubeAPI
from screener.cli import main
from screener.agent.drill import DrillOptions, daemon_passes
from screener.stores.kube import KubeStore
from screener.stores.local import LocalStore
from screener.types import CONDITION_TYPE, LABEL_STATE, TAINT_STATE_KEY


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    work = tmp_path_factory.mktemp("drill")
    result = CliRunner().invoke(main, ["drill", "--workdir", str(work), "--json"],
                                catch_exceptions=False, standalone_mode=False)
    return result, work


@pytest.mark.slow
def test_the_drill_catches_the_fault_and_quarantines_the_faulty_node(drill):
    result, work = drill
    assert result.return_value == 0
    report = json.loads(result.stdout)  # stderr (logs, progress) apart
    assert report["ok"] and report["caught"]
    assert report["states"] == {"drill-node-a": "burnin", "drill-node-b": "quarantined",
                                "drill-node-c": "burnin"}
    assert report["alarm"]["check"] == "ring_replay" and report["alarm"]["settled"]
    whats = [h["what"] for h in report["hops"]]
    order = ["training starts", "fault injected on drill-node-b", "alarm file written",
             "daemon on drill-node-b"]
    idx = [next(i for i, w in enumerate(whats) if w.startswith(o)) for o in order]
    assert idx == sorted(idx), whats
    lat = report["latency"]
    assert 0 <= lat["fault_to_alarm"] <= lat["fault_to_label"]
    assert 0 <= lat["alarm_file_to_label"] <= lat["fault_to_label"]
    # The store says the same, with the alarm as evidence.
    store = LocalStore(work / "state.db")
    try:
        last = store.history("drill-node-b")[-1]
        assert last.to_state.value == "quarantined" and last.code == "RingReplayMismatch"
        assert last.evidence["alarm"]["node"] == "drill-node-b"
    finally:
        store.close()
    # The file was moved aside after the transition was stored.
    assert not list((work / "alarms").glob("*.json"))
    assert len(list((work / "alarms" / "processed").glob("*.json"))) == 1


@pytest.mark.slow
def test_the_same_alarm_files_quarantine_the_node_on_a_cluster(drill, tmp_path):
    _, work = drill
    alarms = tmp_path / "alarms"
    alarms.mkdir()
    for f in (work / "alarms" / "processed").glob("*.json"):
        shutil.copy(f, alarms / f.name)
    options = DrillOptions()
    with KubeAPI() as api:
        for n in options.nodes:
            api.add_node(n)
        store = KubeStore(api.api_client(), sleep=lambda s: None, instance="drill")
        try:
            passes = daemon_passes(options.nodes, alarms, store, taint=store, state_dir=tmp_path)
        finally:
            store.close()
        assert not any(p.errors for p in passes.values())
        node = api.node("drill-node-b")
        assert node["metadata"]["labels"][LABEL_STATE] == "quarantined"
        assert {"key": TAINT_STATE_KEY, "value": "quarantined", "effect": "NoSchedule"} in \
            node["spec"]["taints"]
        cond = next(c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE)
        assert cond["status"] == "True" and cond["reason"] == "RingReplayMismatch"
        assert api.node("drill-node-a")["metadata"]["labels"][LABEL_STATE] == "burnin"
        assert any(e["involvedObject"]["name"] == "drill-node-b" and e["type"] == "Warning"
                   for e in api.events)


def test_bad_drill_options_are_usage_errors():
    r = screener("drill", "--node", "a", "--node", "b", "--node", "c", "--faulty", "z")
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == ["screener: the faulty node 'z' is not one of a, b, c"]


@pytest.mark.slow
def test_a_drill_whose_fault_never_fires_exits_2_not_a_pass_or_a_failure(tmp_path):
    """A fault past the last matmul of the step never fires: the drill tested nothing, which
    is a usage error (2), not a broken pipeline (1) and never a pass."""
    from screener.agent.drill import run_drill
    from screener.agent.screening.window import LocalTaint

    options = DrillOptions(steps=2, fault_step=1, call=10 ** 6)
    with LocalStore(str(tmp_path / "state.db")) as store:
        report = run_drill(options, tmp_path, store=store, taint=LocalTaint(tmp_path))
    assert report.fault_fired is False and "the fault never fired" in report.problems
    assert int(report.exit_code) == 2 and report.to_dict()["fault_fired"] is False
    assert set(report.states.values()) <= {None, "healthy", "burnin"}  # nobody was quarantined
