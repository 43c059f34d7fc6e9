"""examples/placement/: the JobSet and Kueue recipes render, every object is valid against the
published schema of its kind, and the recipes keep screener's placement contract.

Schemas: the JobSet and Kueue CRDs' openAPIV3Schema, vendored under tests/data/crd-schemas/ (each
file names its release tag and commit; vendor.py there re-vendors them), checked strictly as
`kubectl apply` does (an unknown field is an error) with the CRDs' own CEL rules evaluated by
cel-python; the core kinds (and the JobSet's embedded Job) against the Kubernetes API schemas of
the oldest and newest version docs/deploy.md names (kubernetes-validate, strict).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
import yaml

from manifests_util import KUBECTL, ROOT
from screener.types import LABEL_STATE, TAINT_SCREENING_KEY, TAINT_STATE_KEY

PLACEMENT = ROOT / "examples" / "placement"
SCHEMAS = ROOT / "tests" / "data" / "crd-schemas"
K8S_VERSIONS = ("1.30.0", "1.37.0")
ALARM_GID = 4190  # the alarm writers' group (manifests/daemonset.yaml's init container)


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _files() -> list[dict[str, Any]]:
    k = _load(PLACEMENT / "kustomization.yaml")[0]
    return [d for r in k["resources"] for d in _load(PLACEMENT / r)]


@pytest.fixture(scope="module")
def objs() -> list[dict[str, Any]]:
    return _files()


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for f in sorted(SCHEMAS.glob("*.json")):
        d = json.loads(f.read_text())
        out[(d["apiVersion"], d["kind"])] = d
    return out


CRDS = _crd_schemas()


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused, as the API server's strict field validation
    (kubectl's default) refuses them: every object schema that lists its properties and does not
    keep unknown fields gets additionalProperties: false."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _rules(schema: dict[str, Any], value: Any, path: str) -> Iterator[tuple[str, dict, Any]]:
    """(path, rule, value) of every x-kubernetes-validations rule that applies to `value`."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for k, v in value.items():
            sub = schema.get("properties", {}).get(k)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                yield from _rules(sub, v, f"{path}.{k}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            yield from _rules(schema["items"], v, f"{path}[{i}]")


def _cel(rule: str, value: Any) -> bool:
    import celpy
    from celpy import json_to_cel

    env = celpy.Environment()
    result = env.program(env.compile(rule)).evaluate({"self": json_to_cel(value)})
    if isinstance(result, Exception):  # celpy returns evaluation errors as values
        raise result
    return bool(result)


# --- rendering and schemas -----------------------------------------------------------------------

@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (the schema tests below still "
                                            "read every file the kustomization lists)")
def test_kubectl_kustomize_renders_the_recipes_unchanged(objs):
    out = subprocess.run([KUBECTL, "kustomize", str(PLACEMENT)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    key = lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])  # noqa: E731
    assert sorted(rendered, key=key) == sorted(objs, key=key)


def test_the_vendored_schemas_name_their_source():
    assert {k for _, k in CRDS} == {"JobSet", "ResourceFlavor", "ClusterQueue", "LocalQueue",
                                    "Topology"}
    for d in CRDS.values():
        src = d["source"]
        assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]) and re.fullmatch(r"v\d+\.\d+\.\d+", src["tag"])
        assert src["path"].startswith("config/components/crd/bases/")
        jsonschema.Draft4Validator.check_schema(d["schema"])


def test_every_custom_object_meets_its_published_schema(objs):
    custom = [o for o in objs if "." in o["apiVersion"].split("/")[0]]
    assert {o["kind"] for o in custom} == {k for _, k in CRDS}
    for o in custom:
        d = CRDS.get((o["apiVersion"], o["kind"]))
        assert d is not None, f"no vendored schema for {o['apiVersion']} {o['kind']}"
        what = f"{o['kind']}/{o['metadata']['name']}"
        errors = sorted(jsonschema.Draft4Validator(_strict(d["schema"])).iter_errors(o), key=str)
        assert not errors, f"{what}: " + "; ".join(
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
        if d["source"]["scope"] == "Cluster":  # a namespace there is an error on apply
            assert "namespace" not in o["metadata"], what


def test_the_custom_objects_pass_their_crds_cel_rules(objs):
    """The rules the API server evaluates on create (transition rules, which compare with
    oldSelf, apply to updates only)."""
    checked = 0
    for o in objs:
        d = CRDS.get((o["apiVersion"], o["kind"]))
        if d is None:
            continue
        for path, rule, value in _rules(d["schema"], o, o["kind"]):
            if "oldSelf" in rule["rule"]:
                continue
            assert _cel(rule["rule"], value), f"{path}: {rule.get('message', rule['rule'])}"
            checked += 1
    assert checked >= 9  # the walk finds them: 9 apply to these objects at the vendored releases


def test_the_cel_check_refuses_what_the_api_server_refuses():
    """A guard against a vacuous CEL check: Kueue's own rules deny a Topology whose node level is
    not the lowest, and a TAS flavor without nodeLabels."""
    topo = CRDS[("kueue.x-k8s.io/v1beta2", "Topology")]
    bad = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology", "metadata": {"name": "t"},
           "spec": {"levels": [{"nodeLabel": "kubernetes.io/hostname"}, {"nodeLabel": "rack"}]}}
    verdicts = [_cel(r["rule"], v) for _, r, v in _rules(topo["schema"], bad, "Topology")
                if "oldSelf" not in r["rule"]]
    assert False in verdicts
    flavor = CRDS[("kueue.x-k8s.io/v1beta2", "ResourceFlavor")]
    bad = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
           "metadata": {"name": "f"}, "spec": {"topologyName": "t", "nodeLabels": {}}}
    assert False in [_cel(r["rule"], v) for _, r, v in _rules(flavor["schema"], bad, "RF")
                     if "oldSelf" not in r["rule"]]


def _core(objs) -> list[dict[str, Any]]:
    """The core objects, and each JobSet's Jobs as the Job objects the JobSet creates."""
    out = [o for o in objs if "." not in o["apiVersion"].split("/")[0]]
    for js in (o for o in objs if o["kind"] == "JobSet"):
        for rj in js["spec"]["replicatedJobs"]:
            out.append({"apiVersion": "batch/v1", "kind": "Job",
                        "metadata": {"name": f"{js['metadata']['name']}-{rj['name']}-0"},
                        "spec": copy.deepcopy(rj["template"]["spec"])})
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_core_object_meets_the_kubernetes_schema(objs, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    core = _core(objs)
    assert {"Job", "Service"} <= {o["kind"] for o in core}
    for o in core:
        kubernetes_validate.validate(o, version, strict=True)


# --- screener's contract ------------------------------------------------------------------------

def _pod_templates(objs) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, the Job spec, its pod spec) of every workload in the recipes."""
    for o in objs:
        if o["kind"] == "Job":
            yield f"Job/{o['metadata']['name']}", o["spec"], o["spec"]["template"]["spec"]
        elif o["kind"] == "JobSet":
            for rj in o["spec"]["replicatedJobs"]:
                job = rj["template"]["spec"]
                yield f"JobSet/{o['metadata']['name']}/{rj['name']}", job, job["template"]["spec"]


def test_every_workload_is_gated_on_healthy_nodes_and_can_raise_alarms(objs):
    gate = {"key": LABEL_STATE, "operator": "In", "values": ["healthy"]}
    found = list(_pod_templates(objs))
    assert len(found) == 2
    for where, job, pod in found:
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert all(gate in t["matchExpressions"] for t in terms), where
        assert not {t.get("key") for t in pod.get("tolerations", [])} & {TAINT_STATE_KEY,
                                                                          TAINT_SCREENING_KEY}, where
        assert ALARM_GID in pod["securityContext"]["supplementalGroups"], where
        assert pod["restartPolicy"] == "Never", where  # podFailurePolicy needs it
        hostpaths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        for c in pod["initContainers"] + pod["containers"]:
            env = {e["name"]: e for e in c["env"]}
            assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            alarm_dir = env["SCREENER_ALARM_DIR"]["value"]
            assert hostpaths[mounts[alarm_dir]] == alarm_dir == "/var/run/screener/alarms", where
        assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]


def _pfp_action(job: dict[str, Any], container: str, code: int) -> tuple[str, int] | None:
    """The Job controller's podFailurePolicy decision for `container` exiting `code`: the first
    matching rule's (action, index)."""
    for i, rule in enumerate(job["podFailurePolicy"]["rules"]):
        on = rule.get("onExitCodes")
        if on and on.get("containerName") in (None, container):
            hit = code in on["values"]
            if hit == (on["operator"] == "In"):
                return rule["action"], i
    return None


def _jobset_action(js: dict[str, Any], reason: str, message: str) -> str:
    """JobSet's failurePolicy: the first rule whose reasons and message patterns both match
    (an empty list matches anything); none: RestartJobSet."""
    for rule in js["spec"]["failurePolicy"]["rules"]:
        reasons = rule.get("onJobFailureReasons") or [reason]
        patterns = rule.get("onJobFailureMessagePatterns") or [""]
        if reason in reasons and any(re.search(p, message) for p in patterns):
            return rule["action"]
    return "RestartJobSet"


@pytest.mark.parametrize("code,job_action,jobset_action", [
    (75, "FailJob", "RestartJobSetAndIgnoreMaxRestarts"),  # a bad GPU: the gang restarts elsewhere
    (76, "FailJob", "FailJobSet"),                         # numeric: a restart would repeat it
    (77, "Ignore", None),                                  # a peer failed: its code decides
    (1, None, "RestartJobSet"),                            # anything else: counted restarts
])
def test_the_jobset_and_its_jobs_agree_on_each_exit_code(objs, code, job_action, jobset_action):
    js = next(o for o in objs if o["kind"] == "JobSet")
    for rj in js["spec"]["replicatedJobs"]:
        job = rj["template"]["spec"]
        got = _pfp_action(job, "trainer", code)
        assert (got[0] if got else None) == job_action, code
        if job_action == "FailJob":
            # the Job controller's message for a FailJob rule (pkg/controller/job)
            message = (f"Container trainer for pod training/llm-train-trainer-0-1-x failed with "
                       f"exit code {code} matching FailJob rule at index {got[1]}")
            assert _jobset_action(js, "PodFailurePolicy", message) == jobset_action
        elif job_action is None:  # counted: backoffLimit 0 fails the Job at once
            assert job["backoffLimit"] == 0
            assert _jobset_action(js, "BackoffLimitExceeded", "Job has reached the specified "
                                  "backoff limit") == jobset_action
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 1
    # the preflight's 75 (a suspect node found at the pod's start) makes that one pod again
    assert _pfp_action(js["spec"]["replicatedJobs"][0]["template"]["spec"], "preflight", 75)[0] == "Ignore"


def test_the_gangs_rendezvous_names_resolve(objs):
    """torchrun's rendezvous endpoint is pod 0's DNS name as JobSet (headless Service named
    after the JobSet) and an Indexed Job with a subdomain (the Service in kueue.yaml) make it."""
    js = next(o for o in objs if o["kind"] == "JobSet")
    name, rj = js["metadata"]["name"], js["spec"]["replicatedJobs"][0]
    cmd = rj["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--rdzv-endpoint={name}-{rj['name']}-0-0.{name}:29500" in cmd
    assert f"--nnodes={rj['template']['spec']['parallelism']}" in cmd
    job = next(o for o in objs if o["kind"] == "Job")
    pod = job["spec"]["template"]
    svc = next(o for o in objs if o["kind"] == "Service")
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert (f"--rdzv-endpoint={job['metadata']['name']}-0.{svc['metadata']['name']}:29500"
            in pod["spec"]["containers"][0]["command"])
    assert f"--nnodes={job['spec']['parallelism']}" in pod["spec"]["containers"][0]["command"]


def test_kueue_admits_only_onto_healthy_nodes(objs):
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    flavors = [o for o in objs if o["kind"] == "ResourceFlavor"]
    assert len(flavors) == 2
    for f in flavors:
        assert f["spec"]["nodeLabels"][LABEL_STATE] == "healthy"
        assert not f["spec"].get("tolerations")  # a flavor's tolerations are added to the pods
        if "topologyName" in f["spec"]:
            levels = by[("Topology", f["spec"]["topologyName"])]["spec"]["levels"]
            assert levels[-1]["nodeLabel"] == "kubernetes.io/hostname"  # pods pinned: hot swap
    for cq in (o for o in objs if o["kind"] == "ClusterQueue"):
        for rg in cq["spec"]["resourceGroups"]:
            assert "nvidia.com/gpu" in rg["coveredResources"]
            for fl in rg["flavors"]:
                assert ("ResourceFlavor", fl["name"]) in by
                assert {r["name"] for r in fl["resources"]} == set(rg["coveredResources"])
    lq = next(o for o in objs if o["kind"] == "LocalQueue")
    assert ("ClusterQueue", lq["spec"]["clusterQueue"]) in by
    job = next(o for o in objs if o["kind"] == "Job")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == lq["metadata"]["name"]
    assert job["metadata"]["namespace"] == lq["metadata"]["namespace"] and job["spec"]["suspend"]


def test_the_schema_check_refuses_a_misspelt_field(objs):
    """A guard against a vacuous schema check: a misspelt field deep in the JobSet's pod template,
    and a misspelt ResourceFlavor field, are errors."""
    js = copy.deepcopy(next(o for o in objs if o["kind"] == "JobSet"))
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["restartPolicyy"] = pod.pop("restartPolicy")
    schema = _strict(CRDS[("jobset.x-k8s.io/v1alpha2", "JobSet")]["schema"])
    assert any("restartPolicyy" in e.message for e in jsonschema.Draft4Validator(schema).iter_errors(js))
    rf = copy.deepcopy(next(o for o in objs if o["kind"] == "ResourceFlavor"))
    rf["spec"]["nodeLabel"] = rf["spec"].pop("nodeLabels")
    schema = _strict(CRDS[("kueue.x-k8s.io/v1beta2", "ResourceFlavor")]["schema"])
    assert not jsonschema.Draft4Validator(schema).is_valid(rf)
