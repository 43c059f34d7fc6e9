"""Stores for node states and their history: `local` (SQLite, the default) and `kube` (Node objects).

`open_store(kind, ...)` is the one way the CLI and the daemon get a store, so that `kubernetes` is
imported only when a cluster store is asked for.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from screener.errors import ConfigError
from screener.lifecycle.ports import Store
from screener.stores.local import LocalStore
from screener.stores.paths import default_state_dir

__all__ = ["open_store", "default_state_dir", "STORE_KINDS"]

STORE_KINDS = ("local", "kube")


def open_store(kind: str = "local", *, db: Optional[os.PathLike[str] | str] = None,
               kubeconfig: Optional[str] = None, spool: Optional[os.PathLike[str] | str] = None,
               **kwargs: Any) -> Store:
    """Open a store by kind.

    local: SQLite at `db` (default: default_state_dir()/screener.db); `read_only=True` for a
      command that only reads (nothing is created or written; see LocalStore).
    kube: the cluster's Node objects, via `kubeconfig`, or in-cluster configuration when running in
      a pod, or ~/.kube/config; transitions that cannot be written yet go to the spool at `spool`
      (default: default_state_dir()/spool.db). Extra keyword arguments go to KubeStore.
    """
    if kind == "local":
        read_only = bool(kwargs.pop("read_only", False))
        if kwargs:
            raise ConfigError(f"local store: unknown options {sorted(kwargs)}")
        return LocalStore(db if db is not None else default_state_dir() / "screener.db",
                          read_only=read_only)
    if kind == "kube":
        # Here, not at the top: the kubernetes client takes 1-3 s to import, and the local store,
        # the CLI's default, must not pay for it.
        from screener.stores.kube import KubeStore

        return KubeStore.from_config(kubeconfig=kubeconfig, spool_path=spool, **kwargs)
    raise ConfigError(f"unknown store kind {kind!r}; expected one of {', '.join(STORE_KINDS)}")
