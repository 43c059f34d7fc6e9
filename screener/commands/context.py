"""The CLI's composition root: settings in, objects out, once, for every command.

`AppContext` is the click context object (`ctx.obj`) of the `screener` group. It turns what the
options, the environment and the config name (a StoreChoice, a region, a URL) into the objects the
commands and the agent work with: the node's name, the store, the NVML adapter, the SageMaker and
Prometheus clients, the clocks. Each is built on first use, so a command that needs no store
imports no store, and `screener --help` and `screener plan` stay fast. What it opens is closed
when the command that asked for it ends.

Tests hand in fakes the same way commands get the real things:
`CliRunner().invoke(main, args, obj=AppContext(store=fake, sagemaker=stubbed, clock=lambda: T))`.
A store, client or adapter given here is used as is and never closed by the CLI.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping, Optional

import click

from screener.settings.stores import StoreChoice
from screener.types import node_name

log = logging.getLogger(__name__)


class AppContext:
    """Everything a command needs from outside itself; see the module docstring.

    environ: the environment the rules read (default os.environ). clock: wall-clock seconds
    (transition times, windows). monotonic and sleep: for waiting and polling. store, sagemaker,
    prometheus, nvml: ready objects that replace what would be opened (tests); when a store is
    given every store option names it.
    """

    def __init__(self, *, environ: Optional[Mapping[str, str]] = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 store: Any = None, sagemaker: Any = None, prometheus: Any = None,
                 nvml: Any = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self.clock, self.monotonic, self.sleep = clock, monotonic, sleep
        self._store, self._sagemaker, self._prometheus, self._nvml = store, sagemaker, prometheus, nvml
        self._closers: list[Callable[[], None]] = []

    # --- names ----------------------------------------------------------------------------------

    def node_name(self, given: Optional[str] = None) -> str:
        """This node's name: `given` (--node) when not blank, else screener.types.node_name."""
        return (given or "").strip() or node_name(self.environ)

    def store_kind(self, choice: StoreChoice) -> str:
        """"local", "kube" or "none": what the choice means here (screener.settings.stores)."""
        return choice.resolved(self.environ)

    # --- things to open -------------------------------------------------------------------------

    def store(self, choice: StoreChoice) -> Any:
        """The store `choice` names (None for kind "none"), open until the command ends.

        A choice that may not create (StoreChoice.create: a command that only reads) opens a
        local store read-only: a --db that does not exist is refused (exit 2) and nothing is
        ever written to the file.
        """
        kind = self.store_kind(choice)
        if self._store is not None:
            return self._store
        if kind == "none":
            return None
        if kind == "local" and choice.create:
            self._say_why_local(choice)
        if kind == "local" and choice.db is not None and not choice.create \
                and not os.path.exists(choice.db):
            raise click.BadParameter(f"{choice.db}: no state database there (a command that only "
                                     "reads never creates one; omit --db for the default)",
                                     param_hint="'--db'")
        # Here, not at the top: screener.stores costs ~120 ms to import (sqlite3, the lifecycle),
        # which `screener --help` and `screener plan` must not pay; the kube store's kubernetes
        # client costs seconds more and is imported by open_store only for kind "kube".
        from screener.stores import open_store

        if kind == "local":
            opened = open_store("local", db=choice.db, read_only=not choice.create)
        else:
            extra: dict[str, Any] = {"event_namespace": choice.event_namespace} \
                if choice.event_namespace else {}
            if choice.context:
                extra["context"] = choice.context
            if choice.timeouts is not None:
                extra["timeouts"] = choice.timeouts
            opened = open_store("kube", kubeconfig=choice.kubeconfig, spool=choice.spool, **extra)
        log.debug("store: %s (%s)", kind, choice.db or choice.kubeconfig or "default location")
        self._on_close(opened.close)
        return opened

    def _say_why_local(self, choice: StoreChoice) -> None:
        # A kubectl user expects ~/.kube/config to be read; one line says it was not, and how
        # to ask for the cluster, so a state written locally is never a surprise.
        from screener.settings.stores import unasked_kubeconfig

        path = unasked_kubeconfig(choice.kind, choice.kubeconfig, self.environ, choice.context)
        if path:
            click.echo(f"screener: note: node states go to the local store; {path} is not read "
                       "by a command that writes them unless asked (--store kube, --kubeconfig, "
                       "--context or $KUBECONFIG)", err=True)

    def sagemaker(self, region: Optional[str] = None, *, profile: Optional[str] = None,
                  endpoint_url: Optional[str] = None, max_attempts: Optional[int] = None) -> Any:
        """A SageMaker client (boto3, standard retries) for HyperPod remediation."""
        if self._sagemaker is not None:
            return self._sagemaker
        # boto3 takes ~0.5 s to import: only the hyperpod commands and a daemon with the deep
        # check on pay for it.
        from screener.remediation.hyperpod import make_client

        extra = {"max_attempts": max_attempts} if max_attempts is not None else {}
        return make_client(region, endpoint_url=endpoint_url, profile=profile, **extra)

    def prometheus(self, url: str, *, headers: Optional[Mapping[str, str]] = None) -> Any:
        """A Prometheus HTTP API client for `url` (a bad URL is exit 2)."""
        if self._prometheus is not None:
            return self._prometheus
        from screener.remediation.correlate import PrometheusClient  # only `correlate` needs it

        return PrometheusClient(url, headers=headers)

    def nvml(self, *, events: bool = True) -> Any:
        """An opened NVML adapter, closed when the command ends. A machine without NVML gets the
        adapter all the same: the probes report NVML trouble as findings on every run."""
        if self._nvml is not None:
            return self._nvml
        from screener.health.sources.nvml import NvmlAdapter  # pynvml: only commands that read GPUs load it

        adapter = NvmlAdapter(events=events)
        try:
            adapter.open()
        except Exception as e:  # noqa: BLE001 - reported by the probes, run after run
            log.warning("NVML could not be opened: %s", e)
        self._on_close(lambda: _quietly(adapter.close))
        return adapter

    def on_close(self, close: Callable[[], None]) -> None:
        """Close something the command built from what this gave it, when the command ends."""
        self._on_close(close)

    # --- closing --------------------------------------------------------------------------------

    def _on_close(self, close: Callable[[], None]) -> None:
        # On the innermost click context, so what a command opened closes when the command
        # ends, in reverse order, before anything that command entered earlier (a temporary
        # folder the store lives in) is removed.
        # A close that fails is a warning: it must not turn a finished command's verdict into an
        # error, nor keep the other closes from running.
        ctx = click.get_current_context(silent=True)
        if ctx is not None:
            ctx.call_on_close(lambda: _quietly(close))
        else:
            self._closers.append(close)

    def close(self) -> None:
        """Close what was opened outside a click command (library use), newest first."""
        while self._closers:
            _quietly(self._closers.pop())


def _quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception as e:  # noqa: BLE001 - one failing close must not keep the others open
        log.warning("closing: %s", e)


# `@pass_app` gives a command the AppContext of the `screener` group (or a default one when the
# command is invoked on its own, as some tests do).
pass_app = click.make_pass_decorator(AppContext, ensure=True)
