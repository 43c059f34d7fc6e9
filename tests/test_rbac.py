"""The roles grant exactly what the code calls: every (verb, resource, subresource) the daemon and
burn-in code paths send to the recording Kubernetes API test server is granted by
manifests/clusterrole.yaml (cluster-scoped objects), manifests/role.yaml (in screener's namespace,
for a call in that namespace) or manifests/rbac-events.yaml (Events, in the event namespace only),
and the roles grant nothing those paths never use; no call goes to any other namespace. A resource
of a group other than the core one is named `<resource>.<group>` (resourceslices.resource.k8s.io:
the DRA device taints, issue 38.4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from fakes.kubeapi import KubeAPI
from screener.stores.kube import KubeStore
from screener.stores.kube.bound import KubeNodeObject
from screener.types import ANNOTATION_DIGESTS, TAINT_SCREENING_KEY, Outcome
from screener.settings.daemon import DaemonConfig
from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome
from manifests_util import VERBS, admit_configmap, configmap_policy, rendered
from dra_policy import admit_rule, device_taint_policy

ROOT = Path(__file__).resolve().parents[1]


NAMESPACE = "screener-system"
EVENTS_NAMESPACE = "default"  # event_namespace in manifests/configmap.yaml and the default


def _rules(file: str, kind: str) -> tuple[dict, set[tuple[str, str, str]]]:
    role = next(d for d in yaml.safe_load_all((ROOT / "manifests" / file).read_text())
                if d and d["kind"] == kind)
    out = set()
    for rule in role["rules"]:
        # The core group, and DRA's (resourceslices, devicetaintrules) for the device taints.
        assert rule["apiGroups"] in ([""], ["resource.k8s.io"]), rule["apiGroups"]
        group = rule["apiGroups"][0]
        for res in rule["resources"]:
            resource, _, sub = res.partition("/")
            for verb in rule["verbs"]:
                assert verb != "*" and resource != "*", "no wildcards"
                out.add((verb, _qualified(resource, group), sub))
    return role, out


def _qualified(resource: str, group: str) -> str:
    """A resource as these checks name it: plain in the core group, else <resource>.<group>."""
    return f"{resource}.{group}" if group else resource


def granted() -> set[tuple[str, str, str]]:
    """What the ClusterRole grants everywhere."""
    return _rules("clusterrole.yaml", "ClusterRole")[1]


def granted_in_namespace(file: str = "role.yaml",
                         namespace: str = NAMESPACE) -> set[tuple[str, str, str]]:
    """What the Role in `file` grants in `namespace` (bound to the same service account)."""
    role, out = _rules(file, "Role")
    assert role["metadata"]["namespace"] == namespace
    binding = next(d for d in yaml.safe_load_all((ROOT / "manifests" / file).read_text())
                   if d and d["kind"] == "RoleBinding")
    assert binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "screener",
                                    "namespace": NAMESPACE}]
    kustomization = yaml.safe_load((ROOT / "manifests" / "kustomization.yaml").read_text())
    assert file in kustomization["resources"]
    return out


def _configmap_toml() -> dict:
    import tomllib

    cm = next(d for d in yaml.safe_load_all((ROOT / "manifests" / "configmap.yaml").read_text())
              if d and d["kind"] == "ConfigMap" and "daemon.toml" in d.get("data", {}))
    return tomllib.loads(cm["data"]["daemon.toml"])


def exercise_daemon(api: KubeAPI, tmp_path: Path) -> None:
    """Start-up with a stale taint, alarms, probes with pods listed, a screen with the taint and
    published digests, a transition spooled while the API is down and replayed."""
    api.mutate(NODE, lambda n: n["spec"]["taints"].append(
        {"key": TAINT_SCREENING_KEY, "value": "true", "effect": "NoSchedule"}))
    store = KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0, instance="rbac")
    runner = ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.SUSPECT))
    rig = DaemonRig(tmp_path, runner, store=store, taint=store,
                    node_object=KubeNodeObject(store, NODE), idle_window_s=0.0,
                    screen_interval_s=3600.0)
    try:
        rig.tick()  # start-up, probe, pods, screen -> healthy, digests published
        assert json.loads(api.node(NODE)["metadata"]["annotations"][ANNOTATION_DIGESTS])
        api.down()
        rig.tick(advance=5.0)  # cannot even read the node: nothing is written or spooled
        assert store.pending() == 0
        api.up()
        # (Dropped after the outage: what intake does with an alarm it could not apply while the
        # API was down is the intake's own tests' business; this test records API calls.)
        rig.drop_alarm("rbac-1", settled=False)
        api.fail_next(10, status=503, verb="patch")  # reads work; writes and the replay fail
        rig.tick(advance=5.0)  # the transition is spooled; the alarm counts as taken in
        assert store.pending() == 1 and not list((tmp_path / "alarms").glob("*.json"))
        rig.tick(advance=5.0)  # replayed
        assert store.pending() == 0
        rig.tick(advance=3600.0)  # a screen of the suspect node
    finally:
        rig.close()


def exercise_burnin_crosscheck(api: KubeAPI) -> None:
    from screener.known_answer.verdict.crosscheck import peer_digests

    store = KubeStore(api.api_client(), sleep=lambda s: None, instance="rbac")
    try:
        peer_digests(store, NODE)
    finally:
        store.close()


def exercise_budget_and_lemons(api: KubeAPI) -> None:
    """A confirmed failure naming a GPU serial (the per-GPU lemon rule looks the serial up), a
    node held by the budget and released when a slot frees, and the hourly recount."""
    from screener.lifecycle import machine
    from screener.lifecycle.apply import apply_event, reconsider_held
    from screener.types import NodeState, Verdict

    store = KubeStore(api.api_client(), sleep=lambda s: None, instance="rbac", recount_s=0.0)
    bad = Verdict(device="cuda:0", outcome=Outcome.SUSPECT, reason="mismatch", job="gemm",
                  evidence={"gpu_serial": "SN-RBAC", "confirmed": True})
    try:
        now = 1_900_000_000.0
        apply_event(store, "gpu-node-2", machine.NodeSeen(), now=now)
        held = apply_event(store, "gpu-node-2", bad, now=now + 1)
        assert held.state == NodeState.SUSPECT  # the daemon's node took the only slot
        assert store.get_state(NODE) == NodeState.QUARANTINED
        apply_event(store, NODE, machine.Remediation(passed=True), now=now + 2)
        assert reconsider_held(store, "gpu-node-2", NodeState.SUSPECT, now=now + 3) == \
            NodeState.QUARANTINED
    finally:
        store.close()


DRA_NODE = "gpu-node-3"  # a node of its own: the DRA exercise starts it from burn-in


def exercise_dra(api: KubeAPI, tmp_path: Path) -> None:
    """[dra] enabled: a full burn-in that passes, a screen naming cuda:1 bad (its rule created),
    a passing retest (the node's rules listed, the rule deleted), and a replay of a rule already
    there (409, read back)."""
    from fakes.fake_nvml import h100
    from screener.stores.kube.devices import KubeDeviceTaints
    from screener.types import Verdict

    api.add_node(DRA_NODE)
    api.add_resource_slice(DRA_NODE, [
        {"name": f"gpu-{i}", "attributes": {"uuid": {"string": h100(i).uuid}}} for i in (0, 1)])
    store = KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0, instance="rbac")
    taints = KubeDeviceTaints(store.calls, driver="gpu.nvidia.com",
                              taint_key="screener.io/gpu-suspect")
    bad = outcome(Outcome.SUSPECT, verdicts=(
        Verdict(device="cuda:0", outcome=Outcome.PASS, job="gemm-fp32", platform_hash="p1"),
        Verdict(device="cuda:1", outcome=Outcome.SUSPECT, reason="golden_mismatch",
                job="gemm-fp32", platform_hash="p1")))
    runner = ScriptedRunner(outcome(Outcome.PASS), bad, outcome(Outcome.PASS))
    (tmp_path / "dra").mkdir()
    rig = DaemonRig(tmp_path / "dra", runner, store=store, taint=store, node=DRA_NODE,
                    idle_window_s=0.0, screen_interval_s=3600.0,
                    dra={"enabled": True}, daemon_kw={"device_taints": taints})
    try:
        rig.tick()  # the full burn-in
        rig.tick(advance=3600.0)  # cuda:1 suspect: its rule
        assert len(api.device_taint_rules) == 1
        rig.tick(advance=60.0)  # the confirming screen passes: the rule goes
        assert api.device_taint_rules == {}
        device = taints.devices(DRA_NODE)[1]
        body = taints.body(DRA_NODE, device, reason="KnownAnswerMismatch", gpu_uuid=device.uuid)
        assert taints.create(body, device) and not taints.create(body, device)  # the replay
    finally:
        rig.close()


def exercise_cli(api: KubeAPI, tmp_path: Path) -> None:
    """The real `screener daemon --once` wiring (screens off: their calls are covered above)."""
    config = tmp_path / "d.json"
    config.write_text(json.dumps({"store": "kube", "screens": False, "metrics_port": -1,
                                  "spool": str(tmp_path / "spool.db"),
                                  "probes": {"kmsg_path": None, "disk_paths": [str(tmp_path)],
                                             "min_free_disk_fraction": 0,
                                             "min_free_memory_fraction": 0}}))
    env = {**os.environ, "NODE_NAME": NODE, "SCREENER_ALARM_DIR": str(tmp_path / "cli-alarms"),
           "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-m", "screener.cli", "daemon", "--once", "--json",
                        "--config", str(config), "--kubeconfig",
                        str(api.write_kubeconfig(tmp_path / "kubeconfig"))],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 3, 75), r.stderr
    assert json.loads(r.stdout)["node"] == NODE


def test_the_cluster_role_grants_exactly_what_the_code_calls(tmp_path):
    with KubeAPI() as api:
        api.add_node(NODE, labels={"nvidia.com/gpu.present": "true"})
        api.add_node("gpu-node-2", annotations={ANNOTATION_DIGESTS: json.dumps({"p1": {"j": "d"}})})
        api.add_pod("cpu-thing", NODE, gpus=0)
        exercise_daemon(api, tmp_path)
        exercise_burnin_crosscheck(api)
        exercise_budget_and_lemons(api)
        exercise_dra(api, tmp_path)
        exercise_cli(api, tmp_path)
        # A create names its object in the body, not the path the server records: the names
        # created are those in the namespace at the end and those deleted since.
        writes = {(c.verb, c.name) for c in api.calls
                  if c.resource == "configmaps" and c.verb in VERBS and c.name}
        writes |= {("create", name) for ns, name in api.configmaps if ns == NAMESPACE}
        writes |= {("create", n) for v, n in set(writes) if v == "delete"}
        by_ns: dict[str, set[tuple[str, str, str]]] = {}
        for c in api.calls:
            by_ns.setdefault(c.namespace, set()).add((c.verb, _qualified(c.resource, c.group),
                                                      c.subresource))
        dra_writes = list(api.dra_writes)
    # Pods are listed across namespaces (those on this node); everything else that is
    # namespaced goes to one namespace of its own.
    assert set(by_ns) == {"", NAMESPACE, EVENTS_NAMESPACE}, sorted(by_ns)
    for ns, calls, grant in (("(cluster)", by_ns[""], granted()),
                             (NAMESPACE, by_ns[NAMESPACE], granted_in_namespace()),
                             (EVENTS_NAMESPACE, by_ns[EVENTS_NAMESPACE],
                              granted_in_namespace("rbac-events.yaml", EVENTS_NAMESPACE))):
        assert calls - grant == set(), f"called in {ns} but not granted: {sorted(calls - grant)}"
        assert grant - calls == set(), f"granted in {ns} but never called: {sorted(grant - calls)}"
    assert by_ns[EVENTS_NAMESPACE] == {("create", "events", "")}
    assert {r for _, r, _ in by_ns[NAMESPACE]} == {"configmaps"}
    assert DaemonConfig().event_namespace == EVENTS_NAMESPACE
    assert _configmap_toml()["event_namespace"] == EVENTS_NAMESPACE
    # Every ConfigMap write the code made is one the admission policy admits (its cel-python
    # twin), and the policy's read-only ConfigMaps were never written.
    spec = configmap_policy(rendered())
    assert {v for v, _ in writes} >= {"create", "update", "delete"}, writes
    for verb, name in sorted(writes):
        assert admit_configmap(spec, VERBS[verb], name) == [], (verb, name)
    assert not {n for _, n in writes} & {"screener-config", "screener-golden"}
    # Every DeviceTaintRule write the code made is one the device-taint policy admits, as the
    # daemon of the node whose pool it selects.
    dra_spec = device_taint_policy(rendered())
    assert {op for op, _, _ in dra_writes} == {"CREATE", "DELETE"}, dra_writes
    for op, obj, old in dra_writes:
        assert admit_rule(dra_spec, op, obj, old, node=DRA_NODE) == [], (op, obj, old)
