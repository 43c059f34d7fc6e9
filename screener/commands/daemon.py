"""`screener daemon` (the DaemonSet entrypoint) and `screener drill` (an end-to-end fire drill).

Thin wiring: build the configuration, then take the store, NVML and clients from the AppContext
(screener.commands.context), build the probes, the screen runner, the metrics server and the signal
handlers, and hand them to screener.agent.daemon.loop.Daemon (or screener.agent.drill).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import click

from screener.commands.context import AppContext, pass_app
from screener.commands.options import store_options
from screener.settings.stores import StoreChoice

if TYPE_CHECKING:  # the daemon's modules load only when `daemon` runs
    from screener.agent.daemon.ports import RepairPorts

log = logging.getLogger("screener.daemon")


def build_daemon(app: AppContext, config: Any, *, stop: threading.Event,
                 metrics: Any = None, answer: Any = None) -> Any:
    """The real Daemon for a config, wired from the AppContext (store, NVML, SageMaker client);
    what it opens is closed when the command ends."""
    from screener.agent.daemon.loop import Daemon
    from screener.agent.daemon.ports import DaemonPorts, ThisHost
    from screener.health.probes import DeferredKernelLogReader, NodeProbes
    from screener.agent.screening.window import (ScreenOptions, ScreenProcessRunner, LocalTaint,
                                                 reap_stale_screens)
    from screener.stores import default_state_dir

    choice = StoreChoice(kind=config.store, db=config.db, kubeconfig=config.kubeconfig,
                         spool=config.spool, event_namespace=config.event_namespace,
                         timeouts=config.kube_timeouts)
    kind = app.store_kind(choice)
    state_dir = Path(config.db).parent if config.db else default_state_dir()
    kwargs: dict[str, Any] = {}
    store = app.store(choice)
    if kind == "kube":
        node = config.node
        # With the API out of reach, alarms and findings are decided on what the store knows
        # and spooled, from the first pass on (issue 36.4).
        store.decide_offline()
        taint: Any = store
        from screener.stores.kube.bound import KubeNodeObject

        kwargs["node_object"] = KubeNodeObject(store, node)
        if config.dra.enabled:  # per-GPU DeviceTaintRules (screener.agent.daemon.device_taints)
            from screener.stores.kube.devices import KubeDeviceTaints

            kwargs["device_taints"] = KubeDeviceTaints(store.calls, driver=config.dra.driver,
                                                       taint_key=config.dra.taint_key)
    else:
        taint = LocalTaint(state_dir)

    nvml = app.nvml(events=config.probes.nvml_events)
    reader = None
    if config.probes.kmsg_path:
        # The position is saved only once what was read is durable (NodeProbes.commit).
        reader = DeferredKernelLogReader(config.probes.kmsg_path,
                                         state_file=config.probes.kmsg_state_file,
                                         first_read=config.probes.kmsg_first_read,
                                         boot_id_path=config.probes.boot_id_path)
        app.on_close(reader.close)
    probes = NodeProbes(config.probes, nvml=nvml, kmsg=reader)

    work_dir = Path(config.work_dir) if config.work_dir else state_dir / "screens"
    options = ScreenOptions(jobs=config.jobs, devices=config.devices,
                            golden_dir=config.golden_dir, jobs_dir=config.jobs_dir,
                            burnin_seconds=config.burnin_duration_s,
                            burnin_min_iterations=config.burnin_min_iterations)
    runner = ScreenProcessRunner(options, work_dir=work_dir)
    kwargs["reap"] = lambda: reap_stale_screens(work_dir)
    if config.hyperpod.deep_check_on_quarantine:
        from screener.remediation import hyperpod

        hp = config.hyperpod
        client = app.sagemaker(hp.region, endpoint_url=hp.endpoint_url,
                               max_attempts=hp.max_attempts)
        kwargs["on_quarantine"] = lambda node: hyperpod.on_quarantine(client, hp, node)
    if config.ladder.enabled and (config.ladder.reboot != "off" or config.ladder.final == "replace"):
        kwargs["repair"] = _repair_ports(app, config, store)
    return Daemon(config, DaemonPorts(store=store, probes=probes, runner=runner, taint=taint,
                                      host=ThisHost(config.probes.boot_id_path or None),
                                      stop=stop,
                                      metrics=metrics, answer=answer, **kwargs))


def _repair_ports(app: AppContext, config: Any, store: Any) -> RepairPorts:
    """The reboot slots and the reboot/replace calls of a ladder that takes rungs 2 or 3."""
    import time

    from screener.agent.daemon.ports import RepairPorts
    from screener.errors import ConfigError
    from screener.remediation.repairs import CommandRepairs, HyperPodRepairs

    ladder, hp = config.ladder, config.hyperpod
    slots = store.slots("reboot", ladder.max_rebooting, ttl=ladder.reboot_timeout_s,
                        clock=time.time)
    app.on_close(slots.close)
    hyperpod = None
    if ladder.reboot == "hyperpod" or ladder.final == "replace":
        if not hp.cluster:
            what = 'reboot = "hyperpod"' if ladder.reboot == "hyperpod" else 'final = "replace"'
            raise ConfigError(f"[ladder] {what} needs [hyperpod] cluster (the HyperPod cluster's "
                              "name or ARN)")
        client = app.sagemaker(hp.region, endpoint_url=hp.endpoint_url,
                               max_attempts=hp.max_attempts)
        hyperpod = HyperPodRepairs(client, hp.cluster, state_of=store.get_state)
    repairs: Any = hyperpod
    if ladder.reboot == "command":
        repairs = CommandRepairs(ladder.reboot_command, replacer=hyperpod)
    return RepairPorts(slots=slots, calls=repairs)


@click.command("daemon")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=str),
              help="Config file (TOML if it ends in .toml, else JSON); default $SCREENER_CONFIG.")
@click.option("--once", is_flag=True, help="One pass (alarm intake, probes, a screen if one is due "
              "and the GPUs are idle now), then exit with the contract's code.")
@click.option("--node", help="This node's name (default $NODE_NAME, else the hostname).")
@click.option("--alarm-dir", help="Alarm drop folder (default $SCREENER_ALARM_DIR, else "
              "/var/run/screener/alarms).")
@store_options(create=True, env=False, spool=False, overrides=True)
@click.option("--metrics-port", type=click.IntRange(-1, 65535),
              help="Port for /metrics, /healthz and /readyz (0: any free port, -1: none).")
@click.option("--json", "as_json", is_flag=True, help="With --once: print the pass report as JSON.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@pass_app
def daemon_cmd(app: AppContext, config_path: Optional[str], once: bool, node: Optional[str],
               alarm_dir: Optional[str], store_overrides: dict[str, Optional[str]],
               metrics_port: Optional[int], as_json: bool, log_level: str) -> int:
    """Run the per-node screener: the DaemonSet's entrypoint.

    Takes in alarm files from in-job checks (each applied exactly once), runs the health probes
    every probe interval, and when the node's GPUs have been idle for the idle window and a
    screen is due (at once for a node in burnin or suspect), taints the node
    screener.io/screening=true:NoSchedule, runs the known-answer screen with a time cap, yields at
    once if a job lands, and removes the taint again, always. Logs are JSON lines on stderr;
    metrics, /healthz and /readyz are served on one port. SIGTERM stops it cleanly.

    Without a cluster configured it keeps node states in the local SQLite store.
    """
    from screener._optional import MissingExtra
    from screener.errors import ScreenerError
    from screener.settings.daemon import DaemonConfig

    try:  # screener.agent.daemon.loop imports the metrics module too
        from screener.agent.daemon.jsonlog import setup_json_logging
        from screener.agent.metrics import DaemonMetrics, MetricsServer
    except MissingExtra as e:
        # The daemon needs the metrics client and the Kubernetes one: name the extra with both.
        raise ScreenerError(str(e).replace(f"screener[{e.extra}]", "screener[daemon]")
                            .replace("the daemon's metrics endpoint", "screener daemon")) from None

    setup_json_logging(getattr(logging, log_level.upper()))
    config = DaemonConfig.load(config_path, environ=app.environ, overrides={
        "node": node, "alarm_dir": alarm_dir, **store_overrides, "metrics_port": metrics_port})
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %s received: stopping", signal.Signals(signum).name,
                 extra={"event": "signal"})
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from screener.agent.health_answer import AnswerBoard

    metrics = DaemonMetrics(config.node)
    # The node-local health answer (docs/daemonset.md): served from memory on a Unix socket,
    # on the HTTP port at /node and, when configured, in NVRx's protocol.
    board = AnswerBoard(config.node, mode=config.mode,
                        alive=lambda: metrics.alive(config.liveness_s))
    server = None
    servers: list[Any] = []
    if config.metrics_port >= 0 and not once:
        server = MetricsServer(metrics, config.metrics_host, config.metrics_port,
                               liveness_s=config.liveness_s, node_answer=board.render).start()
        log.info("serving /metrics, /healthz, /readyz and /node on %s:%d", server.host,
                 server.port, extra={"event": "metrics", "port": server.port})
    if not once:
        servers = _answer_servers(config, board, metrics)
    try:
        daemon = build_daemon(app, config, stop=stop, metrics=metrics, answer=board)
        _wind_down_on(stop, daemon.store, config.kube_timeouts.stop_s)
        if once:
            report = daemon.tick(once=True)
            if as_json:
                click.echo(json.dumps(report.to_dict(), indent=2, default=str))
            else:
                click.echo(_summary(report))
            return int(report.exit_code)
        daemon.run()
        return 0
    finally:
        # the store, NVML and the kernel-log reader close after this, when the command ends
        if server is not None:
            server.stop()
        for s in servers:
            s.stop()


def _answer_servers(config: Any, board: Any, metrics: Any) -> list[Any]:
    """The health answer's Unix sockets. One that cannot be served is an error line and a
    counted error, not the end of the daemon: screening goes on, and /node still answers."""
    from screener.agent.health_answer import HealthSocket
    from screener.errors import ScreenerError

    out: list[Any] = []
    path = config.health_socket_path()
    if path:
        try:
            out.append(HealthSocket(board, path).start())
            log.info("serving the node health answer on %s", path,
                     extra={"event": "health_socket", "path": path})
        except ScreenerError as e:
            metrics.error("health_socket")
            log.error("%s", e, extra={"event": "error", "where": "health_socket"})
    if config.nvrx_socket and config.nvrx_socket != "off":
        try:
            from screener.agent.nvrx_health import NvhcdServer

            out.append(NvhcdServer(board, config.nvrx_socket).start())
            log.info("serving the NVRx node health check (nvhcd) on %s", config.nvrx_socket,
                     extra={"event": "nvrx_socket", "path": config.nvrx_socket})
        except ScreenerError as e:  # MissingExtra (no grpcio) too: one line that names the extra
            metrics.error("nvrx_socket")
            log.error("%s", e, extra={"event": "error", "where": "nvrx_socket"})
    return out


def _wind_down_on(stop: threading.Event, store: Any, seconds: float) -> None:
    """Once `stop` is set (SIGTERM), cap every API call of the store, the one in flight too, to
    `seconds`: the pod ends within its grace period whatever the API server does. A thread, not
    the signal handler: the handler may interrupt the very code that holds the caps' lock."""
    wind_down = getattr(store, "wind_down", None)
    if wind_down is None:
        return

    def wait() -> None:
        stop.wait()
        log.info("stopping: API calls end within %g s", seconds, extra={"event": "stopping"})
        wind_down(seconds)

    threading.Thread(target=wait, daemon=True, name="screener-wind-down").start()


def _summary(report: Any) -> str:
    d = report.to_dict()
    lines = [f"node       {d['node']}", f"state      {d['state']}"]
    a = d["alarms"]
    lines.append(f"alarms     applied {len(a['applied'])}, duplicates {len(a['duplicates'])}, "
                 f"rejected {len(a['rejected'])}")
    for t in d["transitions"]:
        lines.append(f"transition {t['from'] or '(new)'} -> {t['to']}: {t['reason']}")
    if d["activity"]:
        lines.append(f"activity   {d['activity']['reason']}")
    if d["screen"]:
        s = d["screen"]
        stopped = f" (stopped: {s['stopped']})" if s["stopped"] else ""
        lines.append(f"screen     {s['outcome']}{stopped} in {s['seconds']:.1f} s")
    elif d["screen_due"]:
        lines.append(f"screen     due ({d['screen_due']}) but the node is not idle")
    for e in d["errors"]:
        lines.append(f"error      {e}")
    lines.append(f"exit       {d['exit_code']}")
    return "\n".join(lines)


@click.command("drill")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=str),
              help="Keep the drill's alarm folder and local store here (default: a temporary "
                   "folder, removed afterwards).")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, exists=True, path_type=str),
              help="Record the states on a real cluster's Node objects instead of the local store "
                   "(give three real node names with --node; the faulty one really ends up "
                   "quarantined).")
@click.option("--node", "nodes", multiple=True, metavar="NAME",
              help="A node taking part (three; default drill-node-a, -b, -c).")
@click.option("--faulty", metavar="NAME", help="The node whose GPU computes wrong (default: the second).")
@click.option("--steps", type=click.IntRange(2, 100), default=4, show_default=True,
              help="Training steps.")
@click.option("--fault-step", type=click.IntRange(0, 99), default=2, show_default=True,
              help="The step at which one bit of one matmul output flips.")
@click.option("--json", "as_json", is_flag=True, help="Print the drill report as JSON.")
@click.pass_context
def drill_cmd(ctx: click.Context, workdir: Optional[str], kubeconfig: Optional[str],
              nodes: tuple[str, ...], faulty: Optional[str], steps: int, fault_step: int,
              as_json: bool) -> int:
    """Fire drill: follow an injected fault from a training job to the node's quarantine.

    Runs a small DDP training on the CPU as one process per simulated node (gloo) with the in-job
    audit checking every step, flips the lowest mantissa bit of one matmul output on the faulty
    node, and lets the audit raise its alarm and write the alarm file. Then one daemon pass per
    node takes the files in and records the transitions (local SQLite store, or the cluster with
    --kubeconfig). Prints the path the alarm took with the time of each hop and the latency from
    fault to label. Exit 0 when the fault was caught and the faulty node, and only it, ended
    quarantined; 2 when the fault never fired (the drill tested nothing); 1 when anything else
    failed (the pipeline is broken).
    """
    from screener.agent.drill import DEFAULT_NODES, DrillOptions, run_drill, with_nodes
    from screener.agent.screening.window import LocalTaint

    if kubeconfig and not nodes:
        raise click.UsageError("with --kubeconfig, name the three real nodes with --node")
    options = with_nodes(DrillOptions(steps=steps, fault_step=fault_step), nodes or DEFAULT_NODES,
                         faulty)
    # The audit's alarm log lines are expected here: quiet them for the drill, and only for it.
    audit_log = logging.getLogger("screener.audit")
    saved_level = audit_log.level
    audit_log.setLevel(logging.ERROR)
    from screener.output.progress import HEARTBEAT_S, Progress

    # a line per stage, timed, and a heartbeat while the training runs
    prog = Progress(sys.stderr, json_lines=as_json, prefix="drill", heartbeat_s=HEARTBEAT_S)
    try:
        if workdir:
            work = Path(workdir)
            work.mkdir(parents=True, exist_ok=True)
        else:  # removed when the command ends, after the store in it is closed
            work = Path(ctx.with_resource(tempfile.TemporaryDirectory(prefix="screener-drill-")))
        app = ctx.ensure_object(AppContext)
        if kubeconfig:
            store = app.store(StoreChoice("kube", kubeconfig=kubeconfig,
                                          spool=str(work / "spool.db")))
            taint = None  # the kube store taints the Nodes itself
        else:
            store = app.store(StoreChoice("local", db=str(work / "state.db")))
            taint = LocalTaint(work)
        report = run_drill(options, work, store=store, taint=taint, progress=prog.begin)
    finally:
        prog.close()
        audit_log.setLevel(saved_level)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        click.echo("\n".join(report.lines()))
    return int(report.exit_code)
