"""Which store a command uses: the `--store/--db/--kubeconfig/--spool` choice and what "auto" means.

It decides and opens nothing (screener.commands.context opens what this names); it only looks
whether kubeconfig files exist. Which cluster is kubectl's rule: the one `--kubeconfig` names, else
the files $KUBECONFIG lists (those that exist), else ~/.kube/config when it exists, else the pod's
service account inside a pod ($KUBERNETES_SERVICE_HOST, set by the kubelet in every container).
Whether "auto" means that cluster depends on what the command does with it:
- a command that only reads (`node status`, `lemons`, `plan --history`) keeps kubectl's habits:
  the cluster's Node objects when any of these (or a --context) is there, else the local store;
- a command that writes a node's state (`burnin`, `node set`, the daemon, the HyperPod
  commands) writes to a cluster only when asked: --kubeconfig, --context, $KUBECONFIG naming a
  file that exists, or inside a pod. A ~/.kube/config merely lying in HOME (every Kubernetes user
  has one) is no request: `screener burnin` on a laptop must not label and taint a Node named
  after the laptop in whatever cluster the user last worked on. It then means the local store.

The kube store's own tables live here too: KubeTimeouts (how long a request and a call may take)
and RetryPolicy (its backoff and its bound on 409 re-reads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from screener.errors import ConfigError
from screener.settings import strict

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
# "none": burn-in only, which may move the node's state nowhere.
STORE_KINDS = ("auto", "local", "kube", "none")


@dataclass(frozen=True)
class KubeTimeouts:
    """How long a request, and a call with its retries, may take. Unknown keys are an error.

    connect_s: to open a connection. read_s: for each read of an answer (a black-holed server
    fails here). call_s: one call with all its retries, total time whatever the server sends (a
    server dripping its answer cannot stretch it: screener.stores.kube.deadline). unreachable_s:
    after a call ran out of time, how long later calls fail at once (0: never). stop_s: after
    SIGTERM, every call (those in flight too) ends within this, so the daemon exits well inside
    the pod's terminationGracePeriodSeconds (60)."""

    connect_s: float = 5.0
    read_s: float = 20.0
    call_s: float = 45.0
    unreachable_s: float = 30.0
    stop_s: float = 10.0

    def __post_init__(self) -> None:
        strict.require_number("kube timeouts", "connect_s", self.connect_s, 0.0, 600.0,
                               low_open=True, unit="seconds")
        strict.require_number("kube timeouts", "read_s", self.read_s, 0.0, 3600.0,
                               low_open=True, unit="seconds")
        strict.require_number("kube timeouts", "call_s", self.call_s, 0.0, 3600.0,
                               low_open=True, unit="seconds")
        strict.require_number("kube timeouts", "unreachable_s", self.unreachable_s, 0.0,
                               3600.0, unit="seconds")
        strict.require_number("kube timeouts", "stop_s", self.stop_s, 0.0, 600.0,
                               unit="seconds")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "KubeTimeouts":
        return strict.from_mapping(cls, d, "kube timeouts")


@dataclass(frozen=True)
class RetryPolicy:
    """The kube store's backoff for transient errors and its bound on 409 re-reads. Unknown keys
    are an error."""

    attempts: int = 5  # tries per API call for transient errors (within KubeTimeouts.call_s)
    base_delay: float = 0.2  # seconds before the first retry; doubles each time
    max_delay: float = 5.0
    jitter: float = 0.5  # each delay is scaled by a random factor in [1 - jitter, 1]
    conflict_attempts: int = 10  # read-modify-write rounds before giving up on 409s

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.conflict_attempts < 1:
            raise ConfigError("retry attempts must be >= 1")
        if self.base_delay < 0 or self.max_delay < 0 or not 0 <= self.jitter <= 1:
            raise ConfigError("retry delays must be >= 0 and jitter within [0, 1]")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "RetryPolicy":
        return strict.from_mapping(cls, d, "kube retry")

    def delay(self, attempt: int, rng: Callable[[], float]) -> float:
        """Seconds to wait before retry number `attempt` + 1 (0-based), jittered by rng()."""
        d = min(self.max_delay, self.base_delay * (2.0 ** attempt))
        return d * (1 - self.jitter * rng())


def in_pod(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process runs in a Kubernetes pod (the kubelet sets $KUBERNETES_SERVICE_HOST
    in every container): "auto" then means the cluster's store, which then uses the pod's
    service account."""
    env = os.environ if environ is None else environ
    return bool(env.get(IN_CLUSTER_ENV))


def kubeconfig_path(explicit: Optional[str] = None,
                    environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The kubeconfig kubectl would read, or None (then: in-cluster inside a pod, else none).

    `explicit` (--kubeconfig) as given; else the files of $KUBECONFIG that exist, joined with
    os.pathsep (kubectl merges them, and skips the missing ones); else $HOME/.kube/config when it
    exists. `environ` replaces os.environ (HOME included), so a test can be hermetic.
    """
    if explicit:
        return explicit
    env = os.environ if environ is None else environ
    listed = env.get("KUBECONFIG") or ""
    if listed:
        found = [p for p in listed.split(os.pathsep) if p and os.path.exists(p)]
        return os.pathsep.join(found) or None
    home = env.get("HOME") or ""
    default = os.path.join(home, ".kube", "config") if home else ""
    return default if default and os.path.exists(default) else None


def asked_for_cluster(kubeconfig: Optional[str] = None,
                      environ: Optional[Mapping[str, str]] = None,
                      context: Optional[str] = None) -> bool:
    """Whether the command line or the environment asks for a cluster: --kubeconfig, --context,
    $KUBECONFIG naming a file that exists, or a pod's environment. ~/.kube/config alone is not."""
    env = os.environ if environ is None else environ
    return bool(context or kubeconfig or in_pod(env)
                or (env.get("KUBECONFIG") and kubeconfig_path(None, env)))


def resolve_store_kind(kind: str, kubeconfig: Optional[str] = None,
                       environ: Optional[Mapping[str, str]] = None,
                       context: Optional[str] = None, *, writes: bool = False) -> str:
    """"local", "kube" or "none": `kind` with "auto" decided (see the module docstring).

    writes: the command writes node states, so "auto" means a cluster only when one was asked
    for (asked_for_cluster); a read-only command follows kubectl (kubeconfig_path)."""
    if kind not in STORE_KINDS:
        raise ConfigError(f"unknown store kind {kind!r}; expected one of {', '.join(STORE_KINDS)}")
    if kind != "auto":
        return kind
    if writes:
        return "kube" if asked_for_cluster(kubeconfig, environ, context) else "local"
    if context or kubeconfig_path(kubeconfig, environ) or in_pod(environ):
        return "kube"
    return "local"


def unasked_kubeconfig(kind: str, kubeconfig: Optional[str] = None,
                       environ: Optional[Mapping[str, str]] = None,
                       context: Optional[str] = None) -> Optional[str]:
    """The ~/.kube/config a writing command's "auto" did not take (so the command can say in one
    line why it kept node states locally), or None when there is none or the choice was not
    "auto"."""
    if kind != "auto" or asked_for_cluster(kubeconfig, environ, context):
        return None
    return kubeconfig_path(None, environ)


@dataclass(frozen=True)
class StoreChoice:
    """A store as the options name it, before anything is opened.

    kind: auto, local, kube or none. db: the local store's SQLite file (None: the default in the
    user's state directory). kubeconfig: for the kube store (None: as kubectl, $KUBECONFIG, then
    ~/.kube/config, then in-cluster). context: the kubeconfig context (None: its
    current-context). spool: where the kube store keeps transitions it could not write yet.
    event_namespace: where the kube store creates Node Events (None: its default).
    create: whether a `db` that does not exist may be created; a command that only reads says
    no, so a misspelt path is an error instead of an empty fleet that reads as "all clear". It
    also marks a command that writes node states, for which "auto" means a cluster only when one
    was asked for (resolve_store_kind's `writes`).
    """

    kind: str = "auto"
    db: Optional[str] = None
    kubeconfig: Optional[str] = None
    context: Optional[str] = None
    spool: Optional[str] = None
    event_namespace: Optional[str] = None
    create: bool = True
    timeouts: Optional["KubeTimeouts"] = None  # the kube store's request timeouts (None: default)

    def resolved(self, environ: Optional[Mapping[str, str]] = None) -> str:
        """"local", "kube" or "none" (resolve_store_kind); a choice that may create (a command
        that writes node states) takes a cluster only when asked for one."""
        return resolve_store_kind(self.kind, self.kubeconfig, environ, self.context,
                                  writes=self.create)
