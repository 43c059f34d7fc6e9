"""Adoption on a running fleet, against the Kubernetes API test server: installing the DaemonSet
taints nothing that serves. A node already running GPU pods, or whose Node object is older than
`adopt_min_age_s`, is adopted healthy-but-unscreened (the verdict annotation says so) and gets a
quick screen at its next idle window; a node that joins later starts in burnin."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from fakes.kubeapi import KubeAPI
from screener.stores.kube import KubeStore
from screener.stores.kube.bound import KubeNodeObject
from screener.types import ANNOTATION_VERDICT, LABEL_STATE, TAINT_STATE_KEY, NodeState, Outcome
from fakes.daemon import DaemonRig, ScriptedRunner, outcome

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc).timestamp()


@pytest.fixture
def api():
    with KubeAPI() as server:
        server.add_node("serving")  # created 2026-01-01 by the test server, too
        server.add_pod("train-0", "serving", gpus=8)
        server.add_node("old")
        server.add_node("joiner")
        server.nodes["joiner"]["metadata"]["creationTimestamp"] = "2026-11-30T11:59:00Z"
        server.add_node("joiner-with-pods")
        server.nodes["joiner-with-pods"]["metadata"]["creationTimestamp"] = "2026-11-30T11:59:30Z"
        server.add_pod("infer-0", "joiner-with-pods")
        yield server


def rig_for(tmp_path, api, node: str, runner, **config) -> DaemonRig:
    store = KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0, instance=node)
    folder = tmp_path / node
    folder.mkdir()
    rig = DaemonRig(folder, runner, store=store, taint=store,
                    node_object=KubeNodeObject(store, node), node=node,
                    **config)
    rig.clock.t = NOW
    return rig


def state_taints(api: KubeAPI, node: str) -> list:
    return [t for t in api.node(node)["spec"].get("taints") or [] if t["key"] == TAINT_STATE_KEY]


def test_install_on_a_running_fleet_taints_nothing_that_serves(tmp_path, api):
    rigs = {n: rig_for(tmp_path, api, n, ScriptedRunner(outcome(Outcome.PASS)), idle_window_s=0.0)
            for n in ("serving", "old", "joiner", "joiner-with-pods")}
    try:
        for name, rig in rigs.items():
            rig.daemon.start()
        for name in ("serving", "old", "joiner-with-pods"):
            node = api.node(name)
            assert node["metadata"]["labels"][LABEL_STATE] == "healthy", name
            assert state_taints(api, name) == []
            verdict = json.loads(node["metadata"]["annotations"][ANNOTATION_VERDICT])
            assert verdict["kind"] == "unscreened" and verdict["adopted"]
        assert "GPU pod" in rigs["serving"].store.history("serving")[0].reason
        assert "existed" in rigs["old"].store.history("old")[0].reason
        # A node that joined a minute ago, with nothing on it: burnin, tainted.
        assert api.node("joiner")["metadata"]["labels"][LABEL_STATE] == "burnin"
        assert state_taints(api, "joiner")

        # The adopted idle node gets its first screen, a quick one, at its next idle window;
        # the serving one waits for its pods to go.
        old = rigs["old"].tick()
        assert old.screen_due == "never screened" and rigs["old"].runner.calls[0].kind == "quick"
        assert old.state == NodeState.HEALTHY
        assert json.loads(api.node("old")["metadata"]["annotations"][ANNOTATION_VERDICT])["kind"] == "quick"
        serving = rigs["serving"].tick()
        assert serving.screen_due and not serving.idle and rigs["serving"].runner.calls == []
    finally:
        for rig in rigs.values():
            rig.close()


def test_adoption_can_be_switched_off_or_pinned_to_the_rollout_time(tmp_path, api):
    off = rig_for(tmp_path, api, "old", ScriptedRunner(), adopt="off")
    pinned = rig_for(tmp_path, api, "joiner", ScriptedRunner(),
                     adopt_created_before=NOW, adopt_min_age_s=86400.0)
    try:
        off.daemon.start()
        pinned.daemon.start()
        assert api.node("old")["metadata"]["labels"][LABEL_STATE] == "burnin"
        assert api.node("joiner")["metadata"]["labels"][LABEL_STATE] == "healthy"
    finally:
        off.close()
        pinned.close()
