"""`screener kat`, `screener golden` and `screener burnin`: known-answer screening from the shell.

Thin wrappers: parse options, call screener.known_answer.screen / screener.known_answer.golden / screener.agent.burnin, print a table
(or JSON with --json) on stdout, logs and progress on stderr, and exit with the contract's code.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import click

from screener.commands._params import Duration, FiniteFloat, positive
from screener.commands.context import AppContext, pass_app
from screener.commands.options import store_options
from screener.errors import BadInputError
from screener.settings.durations import YEAR_S
from screener.settings.stores import StoreChoice
from screener.types import ExitCode

# Upper bounds of the counts (issue 23.6): far past any sensible run, and each keeps a run finite
# (`kat run --repeat 1.2e29` ran for ever). A burn-in's iterations match the daemon's
# burnin_min_iterations bound.
MAX_REPEAT = 1000
MAX_ITERATIONS = 10_000
_DEVICE_HELP = "Device to screen: cpu, cuda:N or all (every GPU, or the CPU without one). Repeatable."
_INJECT_HELP = ("Inject a fault in a device's child, to prove the screen catches it: "
                "'device=cuda:1,op=mm,call=2,element=7,bit=30' (keys: device, op, call, element, bit, "
                "mode=flip|scale|nan|inf|set, factor, value, output, persistent=true (every call from "
                "`call` on), parameter, step, job, iteration). Repeatable. A fault that never fires "
                "(a call past the job's last) is named on stderr and makes the exit code 2: a "
                "screen that tested nothing must not read as a pass.")


def _faults(specs: Sequence[str], devices: Sequence[str]) -> dict[str, list[Any]]:
    from screener.known_answer.fault_spec import parse_fault

    out: dict[str, list[Any]] = {}
    for text in specs:
        device, fault = parse_fault(text)
        for d in ([device] if device else devices):
            out.setdefault(d, []).append(fault)
    return out


@contextlib.contextmanager
def _progress(total: Optional[int], stage: str, as_json: bool = False) -> Iterator[Any]:
    """The known-answer runs' progress on stderr (screener.output.progress): a bar on a terminal, else
    a line per finished job run with the elapsed time (JSON lines with --json)."""
    from screener.output.progress import HEARTBEAT_S, JobEvents, Progress

    shown = Progress(sys.stderr, json_lines=as_json, heartbeat_s=HEARTBEAT_S)
    events = JobEvents(shown, stage, total)
    try:
        yield events
    finally:
        events.close()
        shown.close()  # JobEvents ends its stage only; this stops the heartbeat thread too


def _unfired_exit(result: Any, code: int) -> int:
    """Warn about injected faults that never fired; such a run exits 2 (usage), since it did
    not test what it was asked to."""
    lines = result.warnings() if result is not None else []
    for line in lines:
        click.echo(f"screener: warning: {line}", err=True)
    return int(ExitCode.USAGE) if lines else code


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


# --- kat -----------------------------------------------------------------------------------------

@click.group("kat")
def kat_group() -> None:
    """Known-answer screening: deterministic jobs compared bit for bit with golden records,
    with the device's peers and with its own repeats."""


@kat_group.command("run")
@click.option("--job", "-j", "jobs", multiple=True,
              help="Job to run (repeatable); default: the quick screen (jobs with quick = true).")
@click.option("--device", "-d", "devices", multiple=True, default=("all",), show_default=True,
              help=_DEVICE_HELP)
@click.option("--golden-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of golden records (default: $SCREENER_GOLDEN_DIR or golden/).")
@click.option("--jobs-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of job specs (default: $SCREENER_JOBS_DIR or jobs/).")
@click.option("--repeat", "-r", type=click.IntRange(min=1, max=MAX_REPEAT), default=2,
              show_default=True,
              help="Runs of each job per device; 2 or more also checks a device against itself.")
@click.option("--timeout", type=positive(max=7 * 86400.0), default=300.0,
              show_default=True,
              help="Seconds a device may go without finishing a job (or starting up) before it is "
                   "killed and reported suspect (timeout).")
@click.option("--inject", "inject", multiple=True, help=_INJECT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def kat_run(jobs: tuple[str, ...], devices: tuple[str, ...], golden_dir: Optional[str],
            jobs_dir: Optional[str], repeat: int, timeout: float, inject: tuple[str, ...],
            as_json: bool) -> None:
    """Run known-answer jobs on each device (one child process per device) and judge them.

    A device is suspect when its results differ from the golden record of its platform, from a
    strict majority of the devices of its platform, or from its own repeats; the verdict names
    the job, step and tensor where results first differ, with expected and observed values.
    Without a golden and with fewer than three agreeing devices the result is inconclusive
    (exit 3) and the command that records a golden is printed.

    Exit: 0 pass, 75 a device is suspect, 3 inconclusive, 2 bad input (e.g. a broken golden
    file, or an --inject fault that never fired), 1 the screener failed (e.g. a job that is
    nondeterministic on every device with no golden or majority to say which result is right).
    """
    from screener.known_answer.screen import resolve_devices, resolve_jobs, run_screen
    from screener.known_answer.text import format_verdicts

    specs = resolve_jobs(list(jobs), jobs_dir)
    devs = resolve_devices(list(devices))
    with _progress(len(specs) * len(devs) * repeat, "known-answer", as_json) as progress:
        result = run_screen(specs, devs, golden_dir=golden_dir, jobs_dir=jobs_dir, repeat=repeat,
                            timeout=timeout, faults=_faults(inject, devs), progress=progress)
    if as_json:
        _echo_json(result.to_dict())
    else:
        click.echo(format_verdicts(result))
    sys.exit(_unfired_exit(result, int(result.exit_code)))


@kat_group.command("list")
@click.option("--jobs-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of job specs (default: $SCREENER_JOBS_DIR or jobs/).")
@click.option("--golden-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of golden records, to show which jobs have one for this machine's CPU.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
def kat_list(jobs_dir: Optional[str], golden_dir: Optional[str], as_json: bool) -> None:
    """List the job specs: name, kind, version, quick-screen membership, spec hash, and whether
    a golden record exists for this machine's CPU platform."""
    from screener.errors import GoldenError
    from screener.known_answer.golden import default_golden_dir, golden_path, job_records
    from screener.known_answer.screen import local_platform
    from screener.known_answer.workloads import describe, load_jobs

    specs = load_jobs(jobs_dir)
    phash = local_platform("cpu").numeric_hash
    gdir = golden_dir or str(default_golden_dir())
    rows = describe(specs)
    names = {s.name: s for s in specs}
    for row in rows:
        # its own file, or a record its bits were added to (golden schema 2, "also")
        try:
            row["cpu_golden"] = golden_path(gdir, row["name"], phash).exists() or any(
                phash in r.platform_hashes for r in job_records(gdir, names[row["name"]]))
        except GoldenError:  # a broken record is `golden verify`'s to report, not the list's
            row["cpu_golden"] = False
    if as_json:
        _echo_json({"cpu_platform_hash": phash, "jobs": rows})
    else:
        click.echo(f"{'job':14s} {'kind':8s} {'ver':>3s} {'quick':5s} {'spec hash':16s} "
                   f"{'cpu golden':10s} description")
        for r in rows:
            click.echo(f"{r['name']:14s} {r['kind']:8s} {r['version']:3d} "
                       f"{'yes' if r['quick'] else 'no':5s} {r['spec_hash']:16s} "
                       f"{'yes' if r['cpu_golden'] else 'no':10s} {r['description']}")
        click.echo(f"(cpu platform hash {phash})")
    sys.exit(int(ExitCode.PASS))


# --- golden --------------------------------------------------------------------------------------

@click.group("golden")
def golden_group() -> None:
    """Golden records: the known answers of each job per platform (golden/<job>.<hash>.json)."""


@golden_group.command("record")
@click.option("--job", "-j", "jobs", multiple=True,
              help="Job to record (repeatable); default: every job but selftests.")
@click.option("--device", "-d", "devices", multiple=True, default=("all",), show_default=True,
              help=_DEVICE_HELP)
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Folder to write to (default: $SCREENER_GOLDEN_DIR or golden/).")
@click.option("--jobs-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of job specs (default: $SCREENER_JOBS_DIR or jobs/).")
@click.option("--repeat", "-r", type=click.IntRange(min=1, max=MAX_REPEAT), default=3,
              show_default=True,
              help="Runs of each job per device; all of them must agree bit for bit.")
@click.option("--timeout", type=positive(max=7 * 86400.0), default=300.0,
              show_default=True, help="Seconds a device may go without progress.")
@click.option("--force", is_flag=True,
              help="Replace an existing valid golden whose results differ from the new runs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
def golden_record(jobs: tuple[str, ...], devices: tuple[str, ...], out: Optional[str],
                  jobs_dir: Optional[str], repeat: int, timeout: float, force: bool,
                  as_json: bool) -> None:
    """Run jobs on devices and write their golden records, one file per (job, platform).

    When the results equal an existing golden of the job (another platform that computes the
    same bits), this platform is added to that record instead of writing a copy.
    Refuses to write unless every run on every device agrees bit for bit; it prints the
    disagreement instead (exit 75). An existing golden that is stale (the job changed) or broken
    is replaced; one that is valid but differs is kept unless --force (a platform change the
    signature does not capture, or a bad device).
    """
    from screener.known_answer.screen import record_goldens, resolve_devices, resolve_jobs

    specs = resolve_jobs(list(jobs), jobs_dir, quick_only=False)
    devs = resolve_devices(list(devices))
    with _progress(len(specs) * len(devs) * repeat, "golden runs", as_json) as progress:
        rec = record_goldens(specs, devs, out_dir=out, repeat=repeat, timeout=timeout, force=force,
                             progress=progress)
    if as_json:
        _echo_json(rec.to_dict())
    else:
        for line in rec.lines():
            click.echo(line)
    sys.exit(int(rec.exit_code))


def _one_golden_dir(positional: Optional[str], option: Optional[str]) -> Optional[str]:
    """The folder a golden command works on: --golden-dir, as every other command takes it, or
    the positional GOLDEN_DIR older scripts pass; both only when they agree."""
    if positional and option and Path(positional).resolve() != Path(option).resolve():
        raise click.UsageError(f"two golden folders: {positional} and --golden-dir {option}")
    return option or positional


@golden_group.command("verify")
@click.argument("golden_dir", required=False, type=click.Path(file_okay=False))
@click.option("--golden-dir", "golden_dir_opt", type=click.Path(file_okay=False), default=None,
              help="Folder of golden records (default: the installed golden/); the positional "
                   "GOLDEN_DIR works too.")
@click.option("--jobs-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of job specs to check staleness against (default: jobs/).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
def golden_verify(golden_dir: Optional[str], golden_dir_opt: Optional[str],
                  jobs_dir: Optional[str], as_json: bool) -> None:
    """Validate every golden record in GOLDEN_DIR (default: golden/): schema, checksum, content
    (numbered steps, float bit patterns, 64-bit fingerprints), file name, and that its job
    exists, still has the spec hash it was recorded for and implies its number of steps.

    Exit 0 when all are valid, 2 (one line per problem on stderr) otherwise.
    """
    from screener.known_answer.golden import default_golden_dir, load_dir, spec_problem
    from screener.known_answer.workloads import load_jobs

    golden_dir = _one_golden_dir(golden_dir, golden_dir_opt)
    d = Path(golden_dir) if golden_dir else default_golden_dir()
    if not d.is_dir():
        click.echo(f"screener: golden folder {d} does not exist", err=True)
        sys.exit(int(ExitCode.USAGE))
    records, errors = load_dir(d)
    problems = [str(e) for e in errors]
    specs = {s.name: s for s in load_jobs(jobs_dir)}
    ok = []
    for r in records:
        spec = specs.get(r.job)
        if spec is None:
            problems.append(f"golden record {r.path}: no job named {r.job!r} in the jobs folder")
        elif spec.spec_hash != r.spec_hash:
            problems.append(f"golden record {r.path}: stale, recorded for spec hash {r.spec_hash} "
                            f"but job {r.job} now hashes to {spec.spec_hash}; re-record with "
                            f"`screener golden record --job {r.job}`")
        elif spec_problem(r, spec):
            problems.append(f"golden record {r.path}: {spec_problem(r, spec)}")
        else:
            ok.append(r)
    if as_json:
        _echo_json({"folder": str(d), "valid": [r.path for r in ok], "problems": problems})
    else:
        for r in ok:
            click.echo(f"ok      {r.path}")
    for p in problems:
        click.echo(f"screener: {p}", err=True)
    sys.exit(int(ExitCode.USAGE if problems else ExitCode.PASS))


@golden_group.command("list")
@click.argument("golden_dir", required=False, type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
def golden_list(golden_dir: Optional[str], as_json: bool) -> None:
    """List the golden records in GOLDEN_DIR (default: golden/); '*' marks records for a
    platform of this machine. Broken files are listed as problems (exit 2)."""
    from screener.known_answer.golden import default_golden_dir, load_dir
    from screener.known_answer.screen import local_platform, resolve_devices

    d = Path(golden_dir) if golden_dir else default_golden_dir()
    records, errors = load_dir(d) if d.is_dir() else ([], [])
    local = {local_platform(dev).numeric_hash for dev in resolve_devices(["all"])}
    local.add(local_platform("cpu").numeric_hash)
    rows: list[dict[str, Any]] = [{"job": r.job, "platform_hash": r.platform_hash,
             "platform": r.platform.get("name"), "devices": r.recorded.get("devices"),
             "repeats": r.recorded.get("repeats"), "time": r.recorded.get("time"),
             "digest": r.digest, "local": bool(local & set(r.platform_hashes)),
             "platform_hashes": list(r.platform_hashes), "path": r.path}
            for r in records]
    if as_json:
        _echo_json({"folder": str(d), "records": rows, "problems": [str(e) for e in errors]})
    else:
        click.echo(f"  {'job':14s} {'platform hash':16s} {'recorded':20s} {'devices':18s} platform")
        for r in rows:
            click.echo(f"{'*' if r['local'] else ' '} {r['job']:14s} {r['platform_hash']:16s} "
                       f"{r['time']:20s} {','.join(r['devices'] or []):18s} {r['platform']}")
        for e in errors:
            click.echo(f"screener: {e}", err=True)
    sys.exit(int(ExitCode.USAGE if errors else ExitCode.PASS))


# --- burnin --------------------------------------------------------------------------------------

@click.command("burnin")
@click.option("--device", "-d", "devices", multiple=True, default=("all",), show_default=True,
              help=_DEVICE_HELP)
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
@click.option("--inject", "inject", multiple=True, help=_INJECT_HELP)
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
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@pass_app
def burnin_cmd(app: AppContext, devices: tuple[str, ...], jobs: tuple[str, ...],
               duration: Optional[float], iterations: Optional[int], golden_dir: Optional[str],
               jobs_dir: Optional[str], timeout: float, report: Optional[str],
               inject: tuple[str, ...], node: Optional[str], store_choice: StoreChoice,
               hbm_fraction: float, no_hbm: bool, no_collective: bool, no_probes: bool,
               peers: bool, peer_names: tuple[str, ...], no_progress: bool,
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
    """
    from screener.agent.burnin import DEFAULT_ITERATIONS, run_burnin
    from screener.known_answer.screen import resolve_devices, resolve_jobs

    seconds = duration
    if report and not os.access(Path(report).resolve().parent, os.W_OK):
        raise BadInputError(f"--report {report}: its folder does not exist or is not writable")
    specs = resolve_jobs(list(jobs), jobs_dir, quick_only=False)
    devs = resolve_devices(list(devices))
    n = iterations if iterations is not None else (None if seconds else DEFAULT_ITERATIONS)
    from dataclasses import replace

    from screener.agent.burnin import BurninPlan, run_full_burnin
    from screener.output.progress import HEARTBEAT_S, JobEvents, Progress

    # One progress for the whole burn-in: a line (or the bar) per stage, per job run in the
    # known-answer stage and per pattern in the HBM stage, each with the elapsed time.
    prog = Progress(sys.stderr, json_lines=as_json, enabled=not no_progress, prefix="burn-in",
                    heartbeat_s=HEARTBEAT_S)

    def known_answer() -> Any:
        return run_burnin(devs, specs, duration=seconds, iterations=iterations,
                          golden_dir=golden_dir, jobs_dir=jobs_dir, timeout=timeout,
                          progress=JobEvents(prog, None, len(specs) * len(devs) * n
                                             if n and not seconds else None),
                          faults=_faults(inject, devs))

    stage = prog.begin

    plan = BurninPlan(probes=not no_probes, hbm=not no_hbm, hbm_fraction=hbm_fraction,
                      collective=not no_collective)
    try:
        full = run_full_burnin(app.node_name(node), devs, known_answer, plan=plan,
                               store=app.store(store_choice),
                               probe=_probe if plan.probes else None,
                               peers=(peer_names or ("peer-a", "peer-b")) if peers else (),
                               progress=stage, step=prog.step)
    finally:
        prog.close()
    assert full.kat is not None  # run_full_burnin always runs the known-answer stage
    rep = replace(full.kat, extra=full.extra())
    d = rep.to_dict()
    if report:
        try:
            Path(report).write_text(json.dumps(d, indent=2, default=str) + "\n")
        except OSError as e:  # the burn-in itself is done; say so, without a traceback
            raise BadInputError(f"--report {report}: cannot write it: {e.strerror or e}") from e
    if as_json:
        _echo_json(d)
    else:
        click.echo(full.table())
    sys.exit(_unfired_exit(full.kat.screen if full.kat else None, int(full.exit_code)))


def _probe(previous: Any) -> Any:
    """The burn-in's health probes before and after, with the default settings (each run opens
    and closes NVML itself: there is no time between them for NVML events to arrive)."""
    from screener.settings.health import ProbeConfig
    from screener.health.probes import run_probes

    return run_probes(ProbeConfig(), previous=previous)
