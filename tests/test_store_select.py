"""Which cluster a command talks to (issue 25.5): `--store auto`, `--kubeconfig` and `--context`
as kubectl picks them: --kubeconfig, else the files $KUBECONFIG lists, else ~/.kube/config, else
the pod's service account; a context by name. End to end through the console entry point against
two Kubernetes API test servers (tests/fakes/kubeapi.py) that hold different nodes, so a command that
talks to the wrong one, or to the local store, shows it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from cli_util import screener
from fakes.kubeapi import KubeAPI
from screener.settings.daemon import DaemonConfig
from screener.settings.stores import (IN_CLUSTER_ENV, KubeTimeouts, StoreChoice, kubeconfig_path,
                                      resolve_store_kind)
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


# --- issue 35.2: a command that writes node states talks to a cluster only when asked ----------

@pytest.mark.parametrize("files,env_kubeconfig,pod,given,context,expected,reads", [
    # ~/.kube/config lying in HOME: no request to write there (a reader follows kubectl)
    (("home",), None, False, None, None, "local", "kube"),
    ((), None, False, None, None, "local", "local"),
    (("home",), None, True, None, None, "kube", "kube"),       # inside a pod: its account
    (("home", "other"), "other", False, None, None, "kube", "kube"),  # $KUBECONFIG names one
    (("home",), "missing", False, None, None, "local", "local"),  # ... a file that exists
    (("home",), None, False, "given", None, "kube", "kube"),   # --kubeconfig
    (("home",), None, False, None, "ctx", "kube", "kube"),     # --context
])
def test_a_writer_takes_a_cluster_only_when_asked(tmp_path, files, env_kubeconfig, pod, given,
                                                  context, expected, reads):
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
    assert resolve_store_kind("auto", given, env, context, writes=True) == expected
    assert StoreChoice("auto", kubeconfig=given, context=context,
                       create=True).resolved(env) == expected
    if context is None:
        assert DaemonConfig(store="auto", kubeconfig=given).resolved_store(env) == expected
    # the same files for a command that only reads: kubectl's habits, HOME's file included
    assert resolve_store_kind("auto", given, env, context) == reads


def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def laptop_home(tmp_path: Path, port: int) -> Path:
    """A HOME whose ~/.kube/config points at 127.0.0.1:port, as every Kubernetes user's has."""
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return home


def burnin_process(tmp_path: Path, golden_dir: str, *args: str,
                   env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """A real `screener burnin` (one job twice, no HBM test) as a laptop user runs it."""
    base = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", IN_CLUSTER_ENV)}
    base.update({"HOME": str(tmp_path / "home"), "XDG_STATE_HOME": str(tmp_path / "state"),
                 "NODE_NAME": "laptop-1"})
    return subprocess.run([sys.executable, "-m", "screener.cli", "burnin", "-j", "gemm-fp32",
                           "-n", "2", "--no-hbm", "--no-probes", "--golden-dir", golden_dir,
                           *args], capture_output=True, text=True, timeout=240,
                          env={**base, **(env or {})})


def test_burnin_with_a_home_kube_config_keeps_the_state_locally_and_attempts_nothing(
        tmp_path, cpu_goldens):
    # A listener that counts connections, where the kubeconfig points: nothing may reach it.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        laptop_home(tmp_path, listener.getsockname()[1])
        r = burnin_process(tmp_path, cpu_goldens("gemm-fp32"))
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert r.returncode == 4, r.stdout + r.stderr  # partial: stays in burnin, locally
    assert "overall: partial: node stays in burnin" in r.stdout, r.stdout
    assert "node laptop-1: (new) -> burnin" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr and "Kubernetes" not in r.stderr, r.stderr
    assert "not read by a command that writes them unless asked" in r.stderr, r.stderr
    assert (tmp_path / "state" / "screener" / "screener.db").exists()


@pytest.mark.slow
def test_burnin_against_a_closed_port_prints_the_results_then_one_line(tmp_path, cpu_goldens):
    home = laptop_home(tmp_path, closed_port())
    t0 = time.monotonic()
    r = burnin_process(tmp_path, cpu_goldens("gemm-fp32"), "--store", "kube")
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr  # the screener failed: nothing recorded
    assert "known-answer   pass" in r.stdout, r.stdout  # the screen's results are all there
    assert r.stdout.rstrip().splitlines()[-1].startswith(
        "overall: pass, but the node's state was not recorded (the store failed) (exit 1)")
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("screener: the node's state was not recorded: list nodes: ") \
        and "127.0.0.1" in last, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert took < KubeTimeouts().call_s + 120, took  # one call's retries, not one per write
    assert home.exists()


@pytest.mark.slow
def test_burnin_without_the_kubernetes_package_prints_the_results_then_one_line(
        tmp_path, cpu_goldens):
    # The package is absent as pip leaves it absent: an import of it fails by its own name.
    shadow = tmp_path / "no-kube"
    (shadow / "kubernetes").mkdir(parents=True)
    (shadow / "kubernetes" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'kubernetes'\", name='kubernetes')\n")
    kubeconfig = laptop_home(tmp_path, closed_port()) / ".kube" / "config"
    r = burnin_process(tmp_path, cpu_goldens("gemm-fp32"), "--kubeconfig", str(kubeconfig),
                       env={"PYTHONPATH": str(shadow)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "known-answer   pass" in r.stdout and "overall: pass, but" in r.stdout, r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert "needs the kubernetes package: pip install 'screener[kube]'" in last, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
