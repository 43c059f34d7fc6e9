"""`screener burnin`: burn in this node from the shell (screener.agent.burnin.full does the work).

Parses the options, runs the full burn-in (the probes, the known-answer rounds, the HBM test, the
collective, the cross-check, the lifecycle), prints the table (or JSON with --json) on stdout and
progress on stderr, and exits with the contract's code.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import click

from screener.commands._known_answer import (DEVICE_HELP, INJECT_HELP, MAX_ITERATIONS, echo_json,
                                             parse_faults, unfired_exit, unfired_warnings)
from screener.commands._params import Duration, FiniteFloat, positive
from screener.commands.context import AppContext, pass_app
from screener.commands.options import store_options
from screener.atomicfile import write_atomic
from screener.errors import BadInputError
from screener.types import ExitCode
from screener.settings.durations import YEAR_S
from screener.settings.stores import StoreChoice


@click.command("burnin")
@click.option("--device", "-d", "devices", multiple=True, default=("all",), show_default=True,
              help=DEVICE_HELP)
@click.option("--job", "-j", "jobs", multiple=True, help="Job to run (repeatable); default: all.")
@click.option("--duration", type=Duration(longest=YEAR_S), default=None,
              help="Keep repeating the jobs this long (90s, 10m, 1h30m; at most a year); the "
                   "iteration under way finishes. Default: --iterations 10.")
@click.option("--iterations", "-n", type=click.IntRange(min=1, max=MAX_ITERATIONS), default=None,
              help="Repeat every job this many times (default 10 without --duration).")
@click.option("--golden-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of golden records (default: $SCREENER_GOLDEN_DIR or golden/).")
@click.option("--jobs-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of job specs (default: $SCREENER_JOBS_DIR or jobs/).")
@click.option("--timeout", type=positive(max=7 * 86400.0), default=300.0,
              show_default=True, help="Seconds a device may go without finishing a job before "
                                      "it is killed and reported suspect (timeout).")
@click.option("--report", "report", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON report to this file.")
@click.option("--inject", "inject", multiple=True, help=INJECT_HELP)
@click.option("--node", default=None, help="This node's name (default $NODE_NAME, else the hostname).")
@store_options(create=True, env=False, spool=False,
               none_help="move the node's state nowhere (the burn-in only reports).")
@click.option("--hbm-fraction", type=FiniteFloat(0, 0.95, min_open=True), default=0.5,
              show_default=True, help="Share of each GPU's free memory the HBM pattern test covers.")
@click.option("--no-hbm", is_flag=True, help="Skip the HBM pattern test.")
@click.option("--no-collective", is_flag=True, help="Skip the all-reduce check across the GPUs.")
@click.option("--no-probes", is_flag=True, help="Skip the health probes before and after.")
@click.option("--peers", is_flag=True, help="Also run the peer burn-in on this machine: a short "
              "audited DDP training with simulated peer nodes (gloo). In a cluster use the peer "
              "burn-in Job (manifests/peer-burnin-job.yaml).")
@click.option("--peer", "peer_names", multiple=True, metavar="NAME",
              help="A simulated peer node's name for --peers (default: peer-a, peer-b).")
@click.option("--quick", is_flag=True,
              help="A quick screen instead of a burn-in: every stage as usual (10 runs of the "
                   "quick screen's jobs unless --job or --iterations; the full burn-in's llm jobs "
                   "are left out), but no node state is kept (no store, no cluster), so a pass "
                   "exits 0 and says what a full burn-in would add. The README's quick start; "
                   "not with --duration or the store options.")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@pass_app
def burnin_cmd(app: AppContext, devices: tuple[str, ...], jobs: tuple[str, ...],
               duration: Optional[float], iterations: Optional[int], golden_dir: Optional[str],
               jobs_dir: Optional[str], timeout: float, report: Optional[str],
               inject: tuple[str, ...], node: Optional[str], store_choice: StoreChoice,
               hbm_fraction: float, no_hbm: bool, no_collective: bool, no_probes: bool,
               peers: bool, peer_names: tuple[str, ...], quick: bool, no_progress: bool,
               as_json: bool) -> None:
    """Burn in this node: every job on every device, repeated, compared bit for bit with the
    golden records of each device's platform, with the device's peers and with its own runs.

    Without a GPU it screens the CPU against the committed CPU golden. By default every job runs
    10 times (well under two minutes on a CPU); ask for longer burn-ins with --duration.
    Around the known-answer rounds: the health probes before and after, the HBM pattern test on
    every GPU, the all-reduce check across the GPUs (with its bandwidth), and in a cluster a
    cross-check of the known-answer digests with other nodes of the same platform. At the end the
    node is moved through the lifecycle (healthy, suspect, quarantined or repair).
    Prints a progress bar (stderr) and a final table; exit 0 pass, 4 partial (every stage
    passed, but not a full burn-in: the node stays in burnin), 75 a device is suspect,
    3 inconclusive (no golden), 2 bad input, 1 the screener failed.

    --quick is the first thing to run on a new machine: the same stages, no node state moved,
    exit 0 when every check passed; its last lines say what passed and what a full burn-in adds.
    """
    from screener.output import wall
    from screener.output.progress import HEARTBEAT_S, JobEvents, Progress

    seconds = duration
    if quick:
        _refuse_with_quick(duration, store_choice)
    if report and not os.access(Path(report).resolve().parent, os.W_OK):
        raise BadInputError(f"--report {report}: its folder does not exist or is not writable")
    # One progress for the whole burn-in: a line (or the bar) per stage, per job run in the
    # known-answer stage and per pattern in the HBM stage, each with the elapsed time. Its
    # first line comes before torch is imported (seconds on a cold machine).
    prog = Progress(sys.stderr, json_lines=as_json, enabled=not no_progress, prefix="burn-in",
                    heartbeat_s=HEARTBEAT_S, t0=wall.started())
    prog.announce("loading torch and the job specs")
    try:
        from screener.agent.burnin.full import DEFAULT_ITERATIONS, run_burnin
        from screener.known_answer.engine.screen import resolve_devices, resolve_jobs

        # The quick screen's jobs for --quick (the committed goldens cover them on every x86-64
        # path), every job for a burn-in.
        specs = resolve_jobs(list(jobs), jobs_dir, quick_only=quick)
        devs = resolve_devices(list(devices))
    except BaseException:
        prog.close()
        raise
    n = iterations if iterations is not None else (None if seconds else DEFAULT_ITERATIONS)
    from screener.agent.burnin.full import BurninPlan, run_full_burnin

    def known_answer() -> Any:
        return run_burnin(devs, specs, duration=seconds, iterations=iterations,
                          golden_dir=golden_dir, jobs_dir=jobs_dir, timeout=timeout,
                          progress=JobEvents(prog, None, len(specs) * len(devs) * n
                                             if n and not seconds else None),
                          faults=parse_faults(inject, devs))

    stage = prog.begin

    plan = BurninPlan(probes=not no_probes, hbm=not no_hbm, hbm_fraction=hbm_fraction,
                      collective=not no_collective)
    try:
        # The store opens after the known-answer rounds (run_full_burnin): a missing client
        # or a cluster out of reach is one line after the results, not instead of them.
        full = run_full_burnin(app.node_name(node), devs, known_answer, plan=plan,
                               open_store=None if quick else lambda: app.store(store_choice),
                               probe=_prober(app) if plan.probes else None,
                               peers=(peer_names or ("peer-a", "peer-b")) if peers else (),
                               progress=stage, step=prog.step)
    finally:
        prog.close()
    assert full.known_answer is not None  # run_full_burnin always runs the known-answer stage
    full.quick = quick
    full.wall_s = wall.elapsed()  # the summary's time: the wall time since the command started
    rep = replace(full.known_answer, extra=full.extra())
    d = rep.to_dict()
    # A fault that never fired tested nothing: exit 2, and the printed verdict says so too, as
    # kat run's does (the table's last line said "(exit 4)" above an exit 2)
    unfired = unfired_warnings(full.known_answer.screen if full.known_answer else None, inject)
    code = int(ExitCode.USAGE) if unfired else int(full.exit_code)
    if unfired:
        d.update(exit_code=code, unfired=unfired)
    if report:
        try:
            write_atomic(report, json.dumps(d, indent=2, default=str) + "\n", public=True)
        except OSError as e:  # the burn-in itself is done; say so, without a traceback
            raise BadInputError(f"--report {report}: cannot write it: {e.strerror or e}") from e
    if as_json:
        echo_json(d)
    else:
        lines = full.table().splitlines()
        if unfired and lines:
            lines[-1] = (f"not a test (exit {code}): injected fault(s) never fired, so this "
                         f"burn-in proves nothing about the devices they were meant for")
        click.echo("\n".join(lines))
    if full.store_error is not None:
        click.echo(f"screener: the node's state was not recorded: {full.store_error}", err=True)
    sys.exit(unfired_exit(full.known_answer.screen if full.known_answer else None, code, inject))


def _refuse_with_quick(duration: Optional[float], store: StoreChoice) -> None:
    """--quick keeps no node state and runs a number of iterations: an option that asks for a
    store or a duration contradicts it (exit 2, one line, before anything runs)."""
    given = [name for name, value in (("--duration", duration is not None),
                                      ("--store " + store.kind, store.kind in ("local", "kube")),
                                      ("--db", store.db), ("--kubeconfig", store.kubeconfig),
                                      ("--context", store.context)) if value]
    if given:
        raise BadInputError(f"{given[0]}: a --quick screen keeps no node state and runs "
                            f"--iterations (default 10); for a burn-in that moves the node, "
                            f"drop --quick")


def _prober(app: AppContext) -> Callable[[Any], Any]:
    """The burn-in's health probes before and after, with the default settings, reading the GPUs
    through the command's NVML adapter (AppContext.nvml, closed when the command ends). No NVML
    event set: the rules compare the counters before and after instead."""
    from screener.settings.health import ProbeConfig
    from screener.health.probes import run_probes

    nvml = app.nvml(events=False)

    def probe(previous: Any) -> Any:
        return run_probes(ProbeConfig(), nvml=nvml, previous=previous)

    return probe
