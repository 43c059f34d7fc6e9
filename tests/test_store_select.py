"""Which cluster a command talks to (issue 25.5): `--store auto`, `--kubeconfig` and `--context`
as kubectl picks them: --kubeconfig, else the files $KUBECONFIG lists, else ~/.kube/config, else
the pod's service account; a context by name. End to end through the console entry point against
two Kubernetes API test servers (tests/kubeapi.py) that hold different nodes, so a command that
talks to the wrong one, or to the local store, shows it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from cli_util import screener
from kubeapi import KubeAPI
from screener.settings.stores import kubeconfig_path, resolve_store_kind
from screener.types import LABEL_STATE


@pytest.fixture(scope="module")
def clusters() -> Iterator[tuple[KubeAPI, KubeAPI]]:
    """Two clusters: node a-1 is in burnin on the first, b-1 in repair on the second."""
    with KubeAPI() as a, KubeAPI() as b:
        a.add_node("a-1", labels={LABEL_STATE: "burnin"})
        b.add_node("b-1", labels={LABEL_STATE: "repair"})
        yield a, b


def two_context_kubeconfig(path: Path, a: KubeAPI, b: KubeAPI) -> Path:
    """One file, contexts "ctx-a" (current) and "ctx-b"."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "ctx-a",
        "clusters": [{"name": "a", "cluster": {"server": a.url}},
                     {"name": "b", "cluster": {"server": b.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "ctx-a", "context": {"cluster": "a", "user": "u"}},
                     {"name": "ctx-b", "context": {"cluster": "b", "user": "u"}}]}))
    return path


def nodes_seen(tmp_path: Path, env: dict[str, Any], *args: str) -> list[str]:
    """`screener node status --json ARGS` with `env`; the node names it printed."""
    base = {"KUBECONFIG": None, "KUBERNETES_SERVICE_HOST": None, "HOME": str(tmp_path / "home")}
    r = screener("node", "status", "--json", "--spool", str(tmp_path / "spool.db"), *args,
                 env={**base, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return sorted(n["node"] for n in json.loads(r.stdout)["nodes"])


def test_auto_reads_home_kube_config_outside_a_pod(clusters, tmp_path):
    a, _ = clusters
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    a.write_kubeconfig(home / ".kube" / "config")
    assert nodes_seen(tmp_path, {}) == ["a-1"]  # no --store, no --kubeconfig: as kubectl


def test_auto_follows_KUBECONFIG_over_home_and_context_picks_the_cluster(clusters, tmp_path):
    a, b = clusters
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    a.write_kubeconfig(home / ".kube" / "config")
    other = b.write_kubeconfig(tmp_path / "b.kubeconfig")
    missing = tmp_path / "missing.kubeconfig"
    assert nodes_seen(tmp_path, {"KUBECONFIG": f"{missing}:{other}"}) == ["b-1"]
    both = two_context_kubeconfig(tmp_path / "both", a, b)
    assert nodes_seen(tmp_path, {}, "--kubeconfig", str(both)) == ["a-1"]
    assert nodes_seen(tmp_path, {}, "--kubeconfig", str(both), "--context", "ctx-b") == ["b-1"]
    assert nodes_seen(tmp_path, {"KUBECONFIG": str(both)}, "--context", "ctx-b") == ["b-1"]


def test_without_any_kubeconfig_auto_is_the_local_store(clusters, tmp_path):
    # A read-only command on a local store that does not exist says so: it went local.
    r = screener("node", "status", "--json", env={
        "KUBECONFIG": None, "KUBERNETES_SERVICE_HOST": None, "HOME": str(tmp_path / "home"),
        "XDG_STATE_HOME": str(tmp_path / "state")})
    assert r.returncode == 2 and "screener.db: no state database there" in r.stderr, r.stderr


def test_an_unknown_context_is_one_line_and_exit_2(clusters, tmp_path):
    a, b = clusters
    both = two_context_kubeconfig(tmp_path / "both", a, b)
    r = screener("node", "status", "--kubeconfig", str(both), "--context", "nope",
                 "--spool", str(tmp_path / "spool.db"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "nope" in r.stderr, r.stderr


@pytest.mark.parametrize("files,env_kubeconfig,pod,context,expected", [
    ((), None, False, None, "local"),
    (("home",), None, False, None, "kube"),            # ~/.kube/config outside a pod
    ((), None, True, None, "kube"),                    # in-cluster inside one
    ((), "missing", False, None, "local"),             # $KUBECONFIG's files that exist only
    (("home",), "missing", False, None, "local"),      # ... and it replaces ~/.kube/config
    (("other",), "other", False, None, "kube"),
    ((), None, False, "ctx", "kube"),                  # --context names a cluster
])
def test_the_auto_rule(tmp_path, files, env_kubeconfig, pod, context, expected):
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    made = {"home": home / ".kube" / "config", "other": tmp_path / "other"}
    for f in files:
        made[f].write_text("{}")
    env = {"HOME": str(home)}
    if env_kubeconfig:
        env["KUBECONFIG"] = str(made.get(env_kubeconfig, tmp_path / env_kubeconfig))
    if pod:
        env["KUBERNETES_SERVICE_HOST"] = "10.0.0.1"
    assert resolve_store_kind("auto", None, env, context) == expected
    assert resolve_store_kind("local", None, env, context) == "local"
    want = {"home": str(made["home"]), "other": str(made["other"])}
    path = kubeconfig_path(None, env)
    assert path == (want[files[0]] if files and (env_kubeconfig in (None, files[0])) else None)


def test_help_says_how_the_cluster_is_chosen():
    r = screener("node", "status", "--help")
    text = " ".join(r.stdout.split())
    for words in ("$KUBECONFIG", "~/.kube/config", "inside a pod", "--context",
                  "current-context"):
        assert words in text, words
