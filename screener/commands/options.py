"""The store options every command that reads or moves node states takes, written once.

`store_options(...)` adds --store, --db, --kubeconfig, --context (and --spool) and hands the command one
`store_choice: StoreChoice` (screener.settings.stores); the command opens it through the
AppContext (screener.commands.context) only if it needs it. `with_store(...)` also opens it and
hands the command the opened `store`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import click

from screener.commands.context import AppContext
from screener.settings.stores import StoreChoice

F = Callable[..., Any]

STORE_HELP = ("Where node states live: 'local' (SQLite) or 'kube' (Node labels, taints, "
              "conditions, annotations). auto, as kubectl picks a cluster: kube when --kubeconfig "
              "or --context is given, $KUBECONFIG names a file that exists, ~/.kube/config exists, "
              "or inside a pod (its service account); else local.")
# A command that writes node states takes a cluster only when asked (screener.settings.stores).
WRITE_STORE_HELP = ("Where node states live: 'local' (SQLite) or 'kube' (Node labels, taints, "
                    "conditions, annotations). auto: kube only when a cluster is asked for "
                    "(--kubeconfig, --context, $KUBECONFIG naming a file that exists) or inside "
                    "a pod (its service account); else local. A ~/.kube/config alone is not a "
                    "request: this command writes the node's state.")
DB_HELP = ("SQLite file of the local store [default: $XDG_STATE_HOME/screener/screener.db or "
           "~/.local/state/screener/screener.db].")
KUBECONFIG_HELP = ("kubeconfig file for the kube store (default, as kubectl: $KUBECONFIG's files, "
                   "else ~/.kube/config, else the in-cluster configuration inside a pod).")
CONTEXT_HELP = "kubeconfig context for the kube store (default: the kubeconfig's current-context)."
SPOOL_HELP = ("SQLite file where the kube store keeps transitions it could not write yet "
              "[default: beside the local database].")


def store_options(*, create: bool = False, none_help: Optional[str] = None, env: bool = True,
                  spool: bool = True, overrides: bool = False) -> Callable[[F], F]:
    """Add the store options to a command, which then gets `store_choice: StoreChoice`.

    create: whether a --db that does not exist may be created (only commands that write).
    none_help: offer --store none (burn-in: move the state nowhere), with this help.
    env: read $SCREENER_STORE and $SCREENER_DB (the daemon takes its own from its config).
    spool: offer --spool.
    overrides: the daemon's form: no default, and the command gets `store_overrides`, a dict of
        the options given (None where not given) for its config to apply over the file's values.
    """
    default = None if overrides else "auto"
    kinds = ["auto", "local", "kube"] + (["none"] if none_help else [])

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, store_kind: Optional[str], db: Optional[str],
                    kubeconfig: Optional[str], spool: Optional[str] = None,
                    context: Optional[str] = None, **kwargs: Any) -> Any:
            if overrides:
                return fn(*args, store_overrides={"store": store_kind, "db": db,
                                                  "kubeconfig": kubeconfig}, **kwargs)
            choice = StoreChoice(kind=store_kind or "auto", db=db, kubeconfig=kubeconfig,
                                 context=context or None, spool=spool, create=create)
            return fn(*args, store_choice=choice, **kwargs)

        # Applied innermost first: --help lists them as --store, --db, --kubeconfig, --context,
        # --spool.
        decorated: F = wrapper
        if spool:
            decorated = click.option("--spool", type=click.Path(dir_okay=False), default=None,
                                     help=SPOOL_HELP)(decorated)
        if not overrides:  # the daemon runs in a pod, on its service account: no contexts
            decorated = click.option("--context", default=None, help=CONTEXT_HELP)(decorated)
        decorated = click.option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
                                 help=KUBECONFIG_HELP)(decorated)
        decorated = click.option("--db", type=click.Path(dir_okay=False), default=None,
                                 envvar="SCREENER_DB" if env else None, help=DB_HELP)(decorated)
        decorated = click.option(
            "--store", "store_kind", type=click.Choice(kinds), default=default,
            show_default=default is not None, envvar="SCREENER_STORE" if env else None,
            help=(WRITE_STORE_HELP if create else STORE_HELP)
            + (f" none: {none_help}" if none_help else ""))(decorated)
        return decorated

    return decorate


def with_store(fn: Optional[F] = None, *, create: bool = False) -> Any:
    """store_options, and the store opened through the AppContext: the command gets `store`."""
    if fn is None:
        return functools.partial(with_store, create=create)

    @store_options(create=create)
    @functools.wraps(fn)
    def wrapper(*args: Any, store_choice: StoreChoice, **kwargs: Any) -> Any:
        app = click.get_current_context().ensure_object(AppContext)
        return fn(*args, store=app.store(store_choice), **kwargs)

    return wrapper
