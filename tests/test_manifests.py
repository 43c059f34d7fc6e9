"""manifests/: every YAML parses, `kubectl kustomize manifests/` renders, and the rendered objects
say what the code expects (alarm path, config keys, ports, taints, GPU access without holding a
GPU, a narrow securityContext, suspended Jobs)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import yaml

from manifests_util import (KUBECTL, MANIFESTS, ROOT, admit_configmap, by_kind, configmap_policy,
                            load_all, rendered, resolve_kustomization)
from screener.settings.daemon import DaemonConfig
from screener.types import (DEFAULT_ALARM_DIR, LABEL_STATE, TAINT_SCREENING_KEY, TAINT_STATE_KEY)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_every_manifest_parses_and_names_itself():
    files = sorted(MANIFESTS.glob("*.yaml"))
    assert len(files) >= 9
    for f in files:
        docs = load_all(f)
        assert docs, f"{f.name} is empty"
        for d in docs:
            if f.name == "kustomization.yaml":
                assert d["kind"] == "Kustomization"
                continue
            assert d.get("apiVersion") and d.get("kind"), f.name
            assert d["metadata"].get("name"), f.name


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (the twin below still checks "
                                            "every resource listed in the kustomization)")
def test_kubectl_kustomize_renders_every_resource():
    objs = rendered()
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted(
        (o["kind"], o["metadata"]["name"]) for o in resolve_kustomization()), "renderers disagree"
    assert ("DaemonSet", "screener") in kinds and ("ClusterRole", "screener") in kinds
    assert all(o["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "screener"
               for o in objs)


@pytest.fixture(scope="module")
def objs():
    return rendered()


def test_the_daemon_config_in_the_configmap_is_valid(objs):
    cm = by_kind(objs, "ConfigMap", "screener-config")
    data = tomllib.loads(cm["data"]["daemon.toml"])
    cfg = DaemonConfig.from_mapping({**data, "node": "n"})  # strict: unknown keys would raise
    ds = by_kind(objs, "DaemonSet", "screener")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == cfg.metrics_port
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    env = {e["name"]: e for e in c["env"]}
    assert env["SCREENER_CONFIG"]["value"] == mounts["config"]
    assert cfg.golden_dir == mounts["golden"]
    state_dir = mounts["state"]
    assert cfg.spool.startswith(state_dir) and cfg.probes.kmsg_state_file.startswith(state_dir)
    assert cfg.probes.kmsg_path == mounts["kmsg"] == "/dev/kmsg"


def test_daemonset_reaches_gpus_without_holding_one(objs):
    ds = by_kind(objs, "DaemonSet", "screener")
    spec = ds["spec"]["template"]["spec"]
    c = spec["containers"][0]
    text = yaml.safe_dump(ds)
    assert "nvidia.com/gpu:" not in yaml.safe_dump(c.get("resources", {}))
    assert spec["runtimeClassName"] == "nvidia"
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["SCREENER_ALARM_DIR"]["value"] == DEFAULT_ALARM_DIR
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["alarms"]["hostPath"]["path"] == DEFAULT_ALARM_DIR
    tol = {t["key"] for t in spec["tolerations"]}
    assert {TAINT_STATE_KEY, TAINT_SCREENING_KEY, "nvidia.com/gpu"} <= tol
    assert spec["affinity"]["nodeAffinity"] and spec["hostPID"] is True
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["port"] == c["readinessProbe"]["httpGet"]["port"] == "metrics"
    assert spec["serviceAccountName"] == "screener"
    assert "image" in c and text


def test_daemonset_security_context_is_narrow(objs):
    spec = by_kind(objs, "DaemonSet", "screener")["spec"]["template"]["spec"]
    sc = spec["containers"][0]["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG", "DAC_READ_SEARCH"]}
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert not spec.get("hostNetwork") and not spec.get("hostIPC")
    # Writable only where we write: the hostPaths for alarms and state, and /tmp.
    ro = {m["name"] for m in spec["containers"][0]["volumeMounts"] if m.get("readOnly")}
    assert {"config", "golden", "kmsg"} <= ro


def test_jobs_ship_suspended_and_map_exit_codes(objs):
    burnin = by_kind(objs, "Job", "screener-burnin")
    peer = by_kind(objs, "Job", "screener-peer-burnin")
    for job in (burnin, peer):
        assert job["spec"]["suspend"] is True
    rule = burnin["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [75]
    assert peer["spec"]["completionMode"] == "Indexed"
    assert peer["spec"]["completions"] == peer["spec"]["parallelism"] == 3
    args = peer["spec"]["template"]["spec"]["containers"][0]["args"]
    module = args[args.index("-m") + 1]
    assert importlib.util.find_spec(module) is not None, f"{module} is not importable"
    svc = by_kind(objs, "Service", "screener-peer-burnin")
    assert svc["spec"]["clusterIP"] == "None"
    assert peer["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    # The example training Job (examples/, not the base) is gated on healthy nodes.
    train = load_all(ROOT / "examples" / "training-job.yaml")[0]
    terms = train["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": LABEL_STATE, "operator": "In", "values": ["healthy"]} in terms[0]["matchExpressions"]
    burn_tol = burnin["spec"]["template"]["spec"]["tolerations"]
    assert {"key": TAINT_STATE_KEY, "operator": "Equal", "value": "burnin",
            "effect": "NoSchedule"} in burn_tol


def test_commands_in_the_manifests_and_the_dockerfile_exist():
    from screener.cli import COMMANDS

    docker = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["screener"]' in docker and 'CMD ["daemon"]' in docker
    objs = resolve_kustomization()
    for o in objs:
        if o["kind"] not in ("DaemonSet", "Job"):
            continue
        c = o["spec"]["template"]["spec"]["containers"][0]
        if c.get("command"):  # torchrun -m screener.known_answer.collective.peer_training, checked above
            continue
        assert c["args"][0] in COMMANDS, f"{o['metadata']['name']}: unknown command {c['args'][0]}"


def test_the_burnin_job_arguments_parse_with_the_burnin_command():
    from screener.commands.burnin import burnin_cmd

    job = next(o for o in resolve_kustomization() if o["metadata"]["name"] == "screener-burnin")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "burnin"
    ctx = burnin_cmd.make_context("burnin", list(args[1:]))
    assert ctx.params["store_kind"] == "kube" and ctx.params["duration"] == 3600.0
    assert ctx.params["report"] == "/reports/burnin.json"


# --- exposure and the trust model (issue 13) -------------------------------------------------------

ALARM_GID = 4190


def test_metrics_bind_the_pod_ip_and_the_alarm_folder_is_root_owned_for_one_group(objs):
    spec = by_kind(objs, "DaemonSet", "screener")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["SCREENER_DAEMON_METRICS_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    init = {c["name"]: c for c in spec["initContainers"]}["alarm-folder"]
    script = " ".join(init["command"])
    assert f"chown 0:{ALARM_GID} {DEFAULT_ALARM_DIR}" in script
    assert f"chmod 3770 {DEFAULT_ALARM_DIR}" in script  # no world access; sticky; setgid
    sc = init["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == {"CHOWN", "FOWNER"}


def _pod_and_container(job):
    spec = job["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def test_jobs_run_with_a_narrow_security_context(objs):
    for name in ("screener-burnin", "screener-peer-burnin"):
        spec, c = _pod_and_container(by_kind(objs, "Job", name))
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False, name
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"], name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts, f"{name}: a read-only root needs a writable /tmp"
    # The peer burn-in never calls the API: non-root, no token, in the alarm writers' group.
    spec, c = _pod_and_container(by_kind(objs, "Job", "screener-peer-burnin"))
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert ALARM_GID in spec["securityContext"]["supplementalGroups"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # Burn-in writes node states through the API: it keeps the token, and says so.
    spec, _ = _pod_and_container(by_kind(objs, "Job", "screener-burnin"))
    assert spec["automountServiceAccountToken"] is True


def test_network_policy_admits_only_scrapes_to_the_metrics_port(objs):
    ds = by_kind(objs, "DaemonSet", "screener")
    port = {p["name"]: p["containerPort"] for p in
            ds["spec"]["template"]["spec"]["containers"][0]["ports"]}["metrics"]
    pol = by_kind(objs, "NetworkPolicy", "screener-daemon-metrics-only")["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pol["podSelector"]["matchLabels"].items())
    assert pol["policyTypes"] == ["Ingress"] and len(pol["ingress"]) == 1
    rule = pol["ingress"][0]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    assert all("podSelector" in f and "namespaceSelector" in f for f in rule["from"])
    burnin = by_kind(objs, "NetworkPolicy", "screener-burnin-no-ingress")["spec"]
    assert burnin["ingress"] == [] and burnin["policyTypes"] == ["Ingress"]


# The admission policy's CEL, evaluated with cel-python against Node objects before and after.

def _admission(objs):
    pol = by_kind(objs, "ValidatingAdmissionPolicy", "screener-node-fields")
    binding = by_kind(objs, "ValidatingAdmissionPolicyBinding", "screener-node-fields")
    assert pol["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"]["policyName"] == "screener-node-fields"
    assert binding["spec"]["validationActions"] == ["Deny"]
    return pol["spec"]


NODE_CLAIM = "authentication.kubernetes.io/node-name"
OWN_NODE = {NODE_CLAIM: ["n1"]}  # what a token bound to a pod on n1 carries


def _admit(spec, old, new, *, user="system:serviceaccount:screener-system:screener",
           extra=OWN_NODE):
    """The messages of the validations that deny the update ([] = admitted; None = not matched);
    `extra` is the token's userInfo.extra (None: a token without any)."""
    import celpy
    from celpy import celtypes, json_to_cel

    env = celpy.Environment()

    def run(expr, act):
        return env.program(env.compile(expr)).evaluate(act)

    info = {"username": user}
    if extra is not None:
        info["extra"] = extra
    act = {"object": json_to_cel(new), "oldObject": json_to_cel(old),
           "request": json_to_cel({"userInfo": info})}
    if not all(run(m["expression"], act) for m in spec["matchConditions"]):
        return None
    variables = {}
    for v in spec["variables"]:
        variables[celtypes.StringType(v["name"])] = run(v["expression"],
                                                        {**act, "variables": celtypes.MapType(variables)})
    act["variables"] = celtypes.MapType(variables)
    # An evaluation error (celpy returns it as a value) is a denial, as failurePolicy: Fail says.
    return [v["message"] for v in spec["validations"]
            if run(v["expression"], act) != celtypes.BoolType(True)]


NODE_OBJ = {
    "metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "n1", LABEL_STATE: "healthy"},
                 "annotations": {"team": "a"}},
    "spec": {"providerID": "aws:///z/i-1", "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
    "status": {"conditions": [{"type": "Ready", "status": "True"}], "capacity": {"cpu": "8"},
               "allocatable": {"cpu": "8"},
               "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
               "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
               "nodeInfo": {"kubeletVersion": "v1.30.0", "machineID": "m1"},
               "images": [{"names": ["registry.k8s.io/pause:3.9"], "sizeBytes": 321520}],
               "volumesInUse": ["kubernetes.io/csi/ebs^vol-1"],
               "volumesAttached": [{"name": "kubernetes.io/csi/ebs^vol-1", "devicePath": ""}]},
}
OWNER = {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": "0000"}


def _changed(edit):
    import copy

    n = copy.deepcopy(NODE_OBJ)
    edit(n)
    return n


@pytest.mark.parametrize("edit,denied", [
    (lambda n: n["metadata"]["labels"].__setitem__(LABEL_STATE, "suspect"), ""),
    (lambda n: n["spec"]["taints"].append({"key": TAINT_STATE_KEY, "value": "suspect",
                                           "effect": "NoSchedule"}), ""),
    (lambda n: n["metadata"]["annotations"].__setitem__("screener.io/verdict", "{}"), ""),
    (lambda n: n["status"]["conditions"].append({"type": "GPUHardwareSuspect", "status": "True"}), ""),
    (lambda n: n["metadata"]["labels"].__setitem__("node-role.kubernetes.io/gpu", ""), "labels"),
    (lambda n: n["metadata"]["labels"].pop("kubernetes.io/hostname"), "labels"),
    (lambda n: n["metadata"]["annotations"].__setitem__("team", "b"), "annotations"),
    (lambda n: n["spec"].__setitem__("taints", []), "taints"),
    (lambda n: n["spec"].__setitem__("unschedulable", True), "cordon"),
    (lambda n: n["spec"].__setitem__("providerID", "aws:///z/i-2"), "provider ID"),
    (lambda n: n["status"]["conditions"][0].__setitem__("status", "False"), "GPUHardwareSuspect"),
    (lambda n: n["status"]["capacity"].__setitem__("cpu", "16"), "capacity"),
    # issue 23: what a real API server let through before
    (lambda n: n["spec"]["taints"].append({"key": TAINT_STATE_KEY, "value": "suspect",
                                           "effect": "NoExecute"}), "effect NoSchedule"),
    (lambda n: n["metadata"].__setitem__("ownerReferences", [OWNER]), "owner references"),
    (lambda n: n["metadata"].__setitem__("finalizers", ["example.com/hold"]), "finalizers"),
    (lambda n: n["status"]["addresses"][0].__setitem__("address", "10.9.9.9"), "addresses"),
    (lambda n: n["status"]["daemonEndpoints"]["kubeletEndpoint"].__setitem__("Port", 1), "daemon"),
    (lambda n: n["status"].pop("daemonEndpoints"), "daemon endpoints"),
    (lambda n: n["status"]["nodeInfo"].__setitem__("machineID", "m2"), "node info"),
    (lambda n: n["status"].__setitem__("phase", "Terminated"), "phase"),
    (lambda n: n["spec"].__setitem__("podCIDR", "10.1.0.0/24"), "pod CIDRs"),
    (lambda n: n["spec"].__setitem__("configSource", {"configMap": {"name": "x"}}), "config source"),
    # issue 36.5: status fields the policy did not name, admitted on a real server before
    (lambda n: n["status"].__setitem__("volumesInUse", []), "volumes"),
    (lambda n: n["status"]["volumesInUse"].append("kubernetes.io/csi/ebs^vol-2"), "volumes"),
    (lambda n: n["status"].__setitem__("volumesAttached", []), "volumes"),
    (lambda n: n["status"]["volumesAttached"].append(
        {"name": "kubernetes.io/csi/ebs^vol-2", "devicePath": ""}), "volumes"),
    (lambda n: n["status"]["images"].append(
        {"names": ["registry.example/fake:1"], "sizeBytes": 99 * 10**9}), "images"),
    (lambda n: n["status"]["images"][0].__setitem__("sizeBytes", 99 * 10**9), "images"),
    (lambda n: n["status"].pop("images"), "images"),
    (lambda n: n["status"].__setitem__("runtimeHandlers", [{"name": "evil"}]), "any other status"),
    (lambda n: n["status"].__setitem__("features", {"supplementalGroupsPolicy": False}),
     "any other status"),
])
def test_admission_policy_lets_screener_change_only_its_own_fields(objs, edit, denied):
    spec = _admission(objs)
    messages = _admit(spec, NODE_OBJ, _changed(edit))
    if denied:
        assert len(messages) == 1 and denied in messages[0], messages
    else:
        assert messages == []
    # Anyone else is not matched at all: the policy narrows the screener, nobody else.
    assert _admit(spec, NODE_OBJ, _changed(edit), user="kubernetes-admin") is None


def test_admission_policy_keeps_a_pod_bound_token_to_its_own_node(objs):
    spec = _admission(objs)
    new = _changed(lambda n: n["metadata"]["labels"].__setitem__(LABEL_STATE, "suspect"))
    assert _admit(spec, NODE_OBJ, new, extra={NODE_CLAIM: ["n1"]}) == []
    assert "only the node it runs on" in _admit(spec, NODE_OBJ, new, extra={NODE_CLAIM: ["n2"]})[0]
    # Fails closed: a token without the claim (a secret token, a person using the account's
    # kubeconfig) changes no node; before, it kept only the field rules.
    for extra in (None, {}, {"authentication.kubernetes.io/credential-id": ["JTI=x"]}):
        messages = _admit(spec, NODE_OBJ, new, extra=extra)
        assert len(messages) == 1 and "only the node it runs on" in messages[0], (extra, messages)
    bare = {"metadata": {"name": "n1"}, "spec": {}}  # no labels, taints or status yet
    assert _admit(spec, bare, {"metadata": {"name": "n1", "labels": {LABEL_STATE: "burnin"}},
                               "spec": {}}) == []


# The ConfigMap policy (issue 23.1): the service account writes only the store's ConfigMaps.

@pytest.mark.parametrize("operation,name,denied", [
    ("CREATE", "screener-history-gpu-node-1", ""),
    ("UPDATE", "screener-history-gpu-node-1", ""),
    ("CREATE", "screener-budget", ""),
    ("UPDATE", "screener-budget", ""),
    ("CREATE", "screener-budget-slot-3", ""),
    ("DELETE", "screener-budget-slot-3", ""),
    ("CREATE", "screener-fleet-2", ""),
    ("UPDATE", "screener-fleet-2", ""),
    # issue 23.1: the trust settings and the trust anchor are read-only to the daemon
    ("UPDATE", "screener-config", "read-only"),
    ("DELETE", "screener-config", "read-only"),
    ("UPDATE", "screener-golden", "read-only"),
    ("DELETE", "screener-golden", "read-only"),
    ("CREATE", "screener-goldens", "read-only"),
    ("CREATE", "kube-root-ca.crt", "read-only"),
    ("CREATE", "", "read-only"),  # a generated name: the store never asks for one
    ("DELETE", "screener-history-gpu-node-1", "delete only slots"),
    ("DELETE", "screener-budget", "delete only slots"),
    # issue 36.1: the repair ladder's reboot slots are the store's too; a slot number is a number
    ("CREATE", "screener-reboot-slot-0", ""),
    ("DELETE", "screener-reboot-slot-0", ""),
    ("CREATE", "screener-reboot-slot-999999", "at most 5 digits"),
    ("CREATE", "screener-budget-slot-x", "read-only"),
    ("DELETE", "screener-reboot-slot-", "read-only"),
])
def test_configmap_policy_lets_screener_write_only_the_stores_configmaps(objs, operation, name,
                                                                          denied):
    spec = configmap_policy(objs)
    messages = admit_configmap(spec, operation, name)
    if denied:
        assert messages and denied in messages[0], messages
    else:
        assert messages == []
    assert admit_configmap(spec, operation, name, user="kubernetes-admin") is None


def test_the_slots_the_daemon_claims_pass_the_configmap_policy(objs):
    """The names KubeSlots writes for the pools the daemon opens (the repair ladder's "reboot"),
    taken from the code, not retyped: a pool the policy does not know is a 403 on the cluster."""
    import types

    from screener.stores.slots import KubeSlots

    spec = configmap_policy(objs)
    calls = types.SimpleNamespace(namespace="screener-system")
    for pool in ("reboot", "budget"):
        slots = KubeSlots(calls, pool, 3, ttl=60.0, clock=lambda: 0.0)  # type: ignore[arg-type]
        name = slots._body(2, "n1", 0.0)["metadata"]["name"]
        assert admit_configmap(spec, "CREATE", name) == [], name
        assert admit_configmap(spec, "DELETE", name) == [], name


def test_the_training_job_can_write_alarms_and_only_through_the_writers_group():
    job = load_all(ROOT / "examples" / "training-job.yaml")[0]
    spec = job["spec"]["template"]["spec"]
    assert ALARM_GID in spec["securityContext"]["supplementalGroups"]
    assert "fsGroup" not in spec["securityContext"]  # no effect on hostPath; the folder is setgid
    mounts = {m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
    assert DEFAULT_ALARM_DIR in mounts


@pytest.mark.parametrize("name", ["burnin-job.yaml", "peer-burnin-job.yaml"])
def test_a_burnin_jobs_gpu_count_says_it_must_match_the_node(name):
    # Issue 35.4 (10): the Job hard-coded nvidia.com/gpu: 8 without saying so; a node of another
    # shape then never scheduled it, or left GPUs unscreened.
    lines = (MANIFESTS / name).read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("nvidia.com/gpu:"))
    comment = " ".join(line.strip().lstrip("#") for line in lines[max(0, at - 4):at]
                       if line.strip().startswith("#"))
    assert "node's GPU count" in comment and "set it for your node shape" in comment, comment


# metadata.managedFields (issue 36.5): a real server let the account rewrite them. What the API
# server itself does on the daemon's patch stays admitted: it re-stamps the writer's entry (here
# the kubernetes client's default manager) and moves the fields the patch changed out of the
# other entries, which may shrink or go.

T0, T1 = "2024-05-01T10:00:00Z", "2024-05-02T11:00:00Z"
KUBELET = {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "time": T0,
           "fieldsType": "FieldsV1",
           "fieldsV1": {"f:metadata": {"f:labels": {"f:kubernetes.io/hostname": {}}},
                        "f:spec": {"f:providerID": {}, "f:taints": {}}}}
KUBELET_STATUS = {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "time": T0,
                  "subresource": "status", "fieldsType": "FieldsV1",
                  "fieldsV1": {"f:status": {"f:conditions": {'k:{"type":"Ready"}': {
                      ".": {}, "f:status": {}}}, "f:images": {}}}}
KUBECTL_TAINT = {"manager": "kubectl-taint", "operation": "Update", "apiVersion": "v1",
                 "time": T0, "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:taints": {}}}}
OURS = {"manager": "OpenAPI-Generator", "operation": "Update", "apiVersion": "v1", "time": T0,
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:labels": {f"f:{LABEL_STATE}": {}}}}}


def _managed(*entries):
    import copy

    return _changed(lambda n: n["metadata"].__setitem__("managedFields", copy.deepcopy(list(entries))))


def _with(entry, **changes):
    return {**entry, **changes}


MANAGED_OLD = _managed(KUBELET, KUBELET_STATUS, KUBECTL_TAINT, OURS)
OURS_TAINTS = _with(OURS, time=T1, fieldsV1={"f:metadata": {"f:labels": {f"f:{LABEL_STATE}": {}}},
                                             "f:spec": {"f:taints": {}}})
KUBELET_NO_TAINTS = _with(KUBELET, fieldsV1={"f:metadata": KUBELET["fieldsV1"]["f:metadata"],
                                             "f:spec": {"f:providerID": {}}})


@pytest.mark.parametrize("entries,denied", [
    # The label patch: our entry re-stamped, nobody else's touched.
    ((KUBELET, KUBELET_STATUS, KUBECTL_TAINT, _with(OURS, time=T1)), ""),
    # The taint patch (taints are an atomic list): ours takes f:taints from the kubelet's entry,
    # and kubectl-taint's, left with nothing, goes.
    ((KUBELET_NO_TAINTS, KUBELET_STATUS, OURS_TAINTS), ""),
    # The first write by a new manager name (an upgrade with another client version).
    ((KUBELET, KUBELET_STATUS, KUBECTL_TAINT, OURS, _with(OURS, manager="screener", time=T1)), ""),
    # A second write by the same manager within the same second (the label patch, then the
    # taint patch of one pass, as a real kube-apiserver 1.28.7 stamped them): its entry grows in
    # place, with the same time.
    ((KUBELET_NO_TAINTS, KUBELET_STATUS, _with(OURS_TAINTS, time=T0)), ""),
    # Kubernetes folds the oldest of more than ten writers into "ancient-changes".
    ((KUBELET, KUBELET_STATUS, _with(KUBECTL_TAINT, manager="ancient-changes"),
      _with(OURS, time=T1)), ""),
    # Forbidden: stripped (managedFields: [{}]), re-timed, renamed, forged, grown.
    ((), "managedFields"),
    ((KUBELET, _with(KUBELET_STATUS, time=T1), KUBECTL_TAINT, _with(OURS, time=T1)), "managedFields"),
    ((KUBELET, KUBELET_STATUS, _with(KUBECTL_TAINT, manager="kubeadm"), _with(OURS, time=T1)),
     "managedFields"),
    ((KUBELET, KUBELET_STATUS, KUBECTL_TAINT, _with(OURS, time=T1),
      _with(KUBECTL_TAINT, manager="cluster-autoscaler", time=T1)), "managedFields"),
    ((_with(KUBELET, fieldsV1={**KUBELET["fieldsV1"], "f:status": {"f:images": {}}}),
      KUBELET_STATUS, KUBECTL_TAINT, _with(OURS, time=T1)), "managedFields"),
    ((_with(KUBELET, fieldsV1={"f:metadata": {"f:labels": {"f:kubernetes.io/hostname": {},
                                                            "f:team": {}}},
                               "f:spec": KUBELET["fieldsV1"]["f:spec"]}),
      KUBELET_STATUS, KUBECTL_TAINT, _with(OURS, time=T1)), "managedFields"),
    ((KUBELET, _with(KUBELET_STATUS, fieldsV1={"f:status": {"f:conditions": {
        'k:{"type":"Ready"}': {".": {}, "f:status": {}},
        'k:{"type":"MemoryPressure"}': {}}, "f:images": {}}}),
      KUBECTL_TAINT, _with(OURS, time=T1)), "managedFields"),
])
def test_admission_policy_keeps_managed_fields_to_what_the_server_records(objs, entries, denied):
    spec = _admission(objs)
    new = _managed(*entries)
    new["metadata"]["labels"][LABEL_STATE] = "suspect"
    messages = _admit(spec, MANAGED_OLD, new)
    if denied:
        assert len(messages) == 1 and denied in messages[0], messages
    else:
        assert messages == [], messages
    # A node no one has written with managed fields yet gets its first entries.
    assert _admit(spec, NODE_OBJ, _managed(_with(OURS, time=T1))) == []


# Events (issue 36.5): the Role grants events create in `default`, about anything; the policy
# admits only the store's Events about the pod's own node.

def _events_policy(objs):
    pol = by_kind(objs, "ValidatingAdmissionPolicy", "screener-events")
    binding = by_kind(objs, "ValidatingAdmissionPolicyBinding", "screener-events")
    assert pol["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"] == {"policyName": "screener-events", "validationActions": ["Deny"]}
    assert pol["spec"]["failurePolicy"] == "Fail"
    return pol["spec"]


def _admit_event(spec, event, *, user="system:serviceaccount:screener-system:screener",
                 extra=OWN_NODE, operation="CREATE"):
    """The messages of the validations that deny creating `event` ([] = admitted; None = not
    matched), as the API server evaluates them (cel-python)."""
    import celpy
    from celpy import celtypes, json_to_cel

    rules = spec["matchConstraints"]["resourceRules"]
    assert any(operation in r["operations"] and "events" in r["resources"] for r in rules)
    env = celpy.Environment()

    def run(expr, act):
        return env.program(env.compile(expr)).evaluate(act)

    info = {"username": user}
    if extra is not None:
        info["extra"] = extra
    act = {"object": json_to_cel(event), "oldObject": json_to_cel(None),
           "request": json_to_cel({"userInfo": info, "operation": operation,
                                   "namespace": "default", "name": event["metadata"]["name"]})}
    if not all(run(m["expression"], act) for m in spec["matchConditions"]):
        return None
    variables = {}
    for v in spec["variables"]:
        variables[celtypes.StringType(v["name"])] = run(v["expression"],
                                                        {**act, "variables": celtypes.MapType(variables)})
    act["variables"] = celtypes.MapType(variables)
    return [v["message"] for v in spec["validations"]
            if run(v["expression"], act) != celtypes.BoolType(True)]


def _store_event(node="n1", **changes):
    """The Event the store really posts (NodeEvents.body, not retyped) about `node`."""
    from screener.lifecycle.records import Transition
    from screener.stores.kube.events import NodeEvents
    from screener.types import NodeState

    t = Transition(node=node, from_state=NodeState.HEALTHY, to_state=NodeState.SUSPECT,
                   reason="ring replay mismatch", actor="screener-daemon", time=1.7e9)
    events = NodeEvents(None, namespace="default", component="screener",  # type: ignore[arg-type]
                        instance=node, clock=lambda: 1.7e9)
    body = events.body(t, {"metadata": {"uid": "u-1"}})
    for k, v in changes.items():
        body[k] = v
    return body


def test_events_policy_admits_the_stores_event_about_its_own_node(objs):
    spec = _events_policy(objs)
    assert _admit_event(spec, _store_event()) == []
    # events.k8s.io/v1 names the object `regarding`
    ev = _store_event()
    ev["regarding"] = ev.pop("involvedObject")
    assert _admit_event(spec, ev) == []
    assert _admit_event(spec, _store_event("n2"), user="kubernetes-admin") is None


@pytest.mark.parametrize("make", [
    lambda: _store_event("n2"),                                       # another node's
    lambda: _store_event(involvedObject={"apiVersion": "v1", "kind": "Node", "name": "n2"},
                         metadata={"name": "n1.screener.x", "namespace": "default"}),
    lambda: _store_event(involvedObject={"apiVersion": "v1", "kind": "Pod", "name": "n1",
                                         "namespace": "default"}),  # not a Node
    lambda: _store_event(involvedObject={"apiVersion": "v1", "kind": "Node", "name": "n1",
                                         "namespace": "kube-system"}),
    lambda: _store_event(involvedObject={"kind": "Node"}),            # about no one
    lambda: _store_event(metadata={"name": "n1.kubelet.abc", "namespace": "default"}),
    lambda: {k: v for k, v in _store_event().items() if k != "involvedObject"},
])
def test_events_policy_denies_events_about_anything_else(objs, make):
    spec = _events_policy(objs)
    messages = _admit_event(spec, make())
    assert len(messages) == 1 and "only about the node it runs on" in messages[0], messages


def test_events_policy_fails_closed_without_the_node_claim(objs):
    spec = _events_policy(objs)
    for extra in (None, {}, {NODE_CLAIM: ["n2"]}):
        messages = _admit_event(spec, _store_event(), extra=extra)
        assert len(messages) == 1 and "node claim" in messages[0], (extra, messages)
