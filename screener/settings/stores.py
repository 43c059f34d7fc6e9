"""Which store a command uses: the `--store/--db/--kubeconfig/--spool` choice and what "auto" means.

Pure: it decides, it opens nothing (screener.commands.context opens what this names). One rule for
every command and the daemon: "auto" is the cluster's Node objects when a kubeconfig is given or
the process runs in a pod ($KUBERNETES_SERVICE_HOST, set by the kubelet in every container),
else the local SQLite store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from screener.errors import ConfigError

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
# "none": burn-in only, which may move the node's state nowhere.
STORE_KINDS = ("auto", "local", "kube", "none")


def in_pod(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process runs in a Kubernetes pod (the kubelet sets $KUBERNETES_SERVICE_HOST
    in every container): "auto" then means the cluster's store, which then uses the pod's
    service account."""
    env = os.environ if environ is None else environ
    return bool(env.get(IN_CLUSTER_ENV))


def resolve_store_kind(kind: str, kubeconfig: Optional[str] = None,
                       environ: Optional[Mapping[str, str]] = None) -> str:
    """"local", "kube" or "none": `kind` with "auto" decided (see the module docstring)."""
    if kind not in STORE_KINDS:
        raise ConfigError(f"unknown store kind {kind!r}; expected one of {', '.join(STORE_KINDS)}")
    if kind != "auto":
        return kind
    return "kube" if kubeconfig or in_pod(environ) else "local"


@dataclass(frozen=True)
class StoreChoice:
    """A store as the options name it, before anything is opened.

    kind: auto, local, kube or none. db: the local store's SQLite file (None: the default in the
    user's state directory). kubeconfig: for the kube store (None: in-cluster, then
    ~/.kube/config). spool: where the kube store keeps transitions it could not write yet.
    event_namespace: where the kube store creates Node Events (None: its default).
    create: whether a `db` that does not exist may be created; a command that only reads says
    no, so a misspelt path is an error instead of an empty fleet that reads as "all clear".
    """

    kind: str = "auto"
    db: Optional[str] = None
    kubeconfig: Optional[str] = None
    spool: Optional[str] = None
    event_namespace: Optional[str] = None
    create: bool = True

    def resolved(self, environ: Optional[Mapping[str, str]] = None) -> str:
        """"local", "kube" or "none" (resolve_store_kind)."""
        return resolve_store_kind(self.kind, self.kubeconfig, environ)
