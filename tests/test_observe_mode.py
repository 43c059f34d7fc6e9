"""Observe-only mode (issue 24.2), on the Kubernetes store against the API test server.

`mode = "observe"` does everything enforce does (probes, screens, alarms, the state label, the
verdict annotation, the condition, Events, metrics, history) but writes no taint, never marks a
node unschedulable and starts no remediation. The same script under enforce shows the taints
and the deep health check, so each assertion can fail.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fakes.kubeapi import KubeAPI
from screener.agent.screening.window import ScreenRequest
from screener.settings.daemon import DaemonConfig
from screener.errors import ConfigError
from screener.stores.kube import KubeStore
from screener.stores.kube.bound import KubeNodeObject
from screener.types import (ANNOTATION_VERDICT, CONDITION_TYPE, LABEL_STATE, TAINT_SCREENING_KEY,
                            TAINT_STATE_KEY, NodeState, Outcome)
from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome


def _ours(api: KubeAPI) -> list[dict[str, Any]]:
    return [t for t in api.node(NODE)["spec"].get("taints") or []
            if t["key"] in (TAINT_STATE_KEY, TAINT_SCREENING_KEY)]


def _run_script(tmp_path, api: KubeAPI, mode: str) -> dict[str, Any]:
    """A new node, a passing screen (taints looked at while it runs), a settled alarm."""
    seen: dict[str, Any] = {"during_screen": None, "checks": []}

    def during(request: ScreenRequest) -> None:
        seen["during_screen"] = _ours(api)

    store = KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0, instance=NODE)
    rig = DaemonRig(tmp_path, ScriptedRunner(outcome(Outcome.PASS), during=during), store=store,
                    taint=store, node_object=KubeNodeObject(store, NODE), idle_window_s=0.0,
                    mode=mode, daemon_kw={"on_quarantine": lambda n: seen["checks"].append(n)})
    try:
        rig.daemon.start()
        seen["new"] = (api.node(NODE)["metadata"]["labels"][LABEL_STATE], _ours(api))
        rig.tick()  # burn-in... the scripted full screen passes: healthy
        seen["screened"] = api.node(NODE)["metadata"]["labels"][LABEL_STATE]
        rig.drop_alarm("al-observe")
        report = rig.tick(advance=5.0)
        seen["report"] = report.to_dict()
        seen["metrics"] = rig.metrics.transitions.labels(NODE, "quarantined")._value.get()
        seen["history"] = [t.to_state for t in store.history(NODE)]
    finally:
        rig.close()
    node = api.node(NODE)
    seen["node"] = node
    seen["taints"] = _ours(api)
    return seen


@pytest.mark.parametrize("mode", ["observe", "enforce"])
def test_observe_does_everything_but_taint_cordon_and_remediate(tmp_path, mode):
    with KubeAPI() as api:
        api.add_node(NODE)
        seen = _run_script(tmp_path, api, mode)
        events = [e for e in api.events if e.get("involvedObject", {}).get("name") == NODE]
    node = seen["node"]
    # the same everywhere: label, verdict, condition, events, history, metrics, the report
    assert seen["new"][0] == "burnin" and seen["screened"] == "healthy"
    assert node["metadata"]["labels"][LABEL_STATE] == "quarantined"
    assert json.loads(node["metadata"]["annotations"][ANNOTATION_VERDICT])["outcome"] == "pass"
    cond = {c["type"]: c for c in node["status"].get("conditions") or []}[CONDITION_TYPE]
    assert cond["status"] == "True" and cond["reason"] == "WeightFingerprintMismatch"
    assert {e["reason"] for e in events} >= {"NewNode", "WeightFingerprintMismatch"}
    assert seen["history"][-1] == NodeState.QUARANTINED and seen["metrics"] == 1
    assert seen["report"]["state"] == "quarantined"
    assert not node["spec"].get("unschedulable")  # screener never cordons, in either mode
    if mode == "observe":
        assert seen["new"][1] == [] and seen["during_screen"] == [] and seen["taints"] == []
        assert seen["checks"] == []
        assert {"action": "deep_health_check", "result": "not started: observe mode"} in \
            seen["report"]["actions"]
    else:
        assert seen["new"][1] == [{"key": TAINT_STATE_KEY, "value": "burnin",
                                   "effect": "NoSchedule"}]
        assert seen["during_screen"] and seen["during_screen"][-1]["key"] == TAINT_SCREENING_KEY
        assert seen["taints"] == [{"key": TAINT_STATE_KEY, "value": "quarantined",
                                   "effect": "NoSchedule"}]
        assert seen["checks"] == [NODE]


def test_observe_after_enforce_drops_the_stale_state_taint_at_the_next_transition(tmp_path):
    with KubeAPI() as api:
        api.add_node(NODE, labels={LABEL_STATE: "suspect"},
                     taints=[{"key": TAINT_STATE_KEY, "value": "suspect", "effect": "NoSchedule"},
                             {"key": "nvidia.com/gpu", "value": "x", "effect": "NoSchedule"}])
        store = KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0, instance=NODE)
        store.observe_only()
        from screener.lifecycle.apply import apply_event
        from screener.lifecycle.machine import HumanCommand

        apply_event(store, NODE, HumanCommand(NodeState.REPAIR, "send to repair", user="ops"),
                    now=1.8e9)
        taints = api.node(NODE)["spec"]["taints"]
        store.close()
    assert api.node(NODE)["metadata"]["labels"][LABEL_STATE] == "repair"
    assert taints == [{"key": "nvidia.com/gpu", "value": "x", "effect": "NoSchedule"}]


def test_mode_comes_from_the_config_or_the_environment_and_is_checked():
    assert DaemonConfig.load(environ={"NODE_NAME": "n"}).mode == "enforce"
    assert DaemonConfig.load(environ={"NODE_NAME": "n",
                                      "SCREENER_DAEMON_MODE": "observe"}).mode == "observe"
    assert DaemonConfig.from_mapping({"node": "n", "mode": "observe"}).mode == "observe"
    with pytest.raises(ConfigError, match="mode"):
        DaemonConfig.from_mapping({"node": "n", "mode": "dry-run"})
