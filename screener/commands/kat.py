"""`screener kat` and `screener golden`: known-answer screening from the shell.

Thin wrappers: parse options, call screener.known_answer.engine.screen /
screener.known_answer.engine.golden, print a table (or JSON with --json) on stdout, logs and
progress on stderr, and exit with the contract's code. `screener burnin` is
screener.commands.burnin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import click

from screener.commands._known_answer import (DEVICE_HELP, INJECT_HELP, MAX_REPEAT, echo_json,
                                             parse_faults, unfired_exit, unfired_warnings)
from screener.commands._params import positive
from screener.commands.context import AppContext
from screener.commands.options import store_options
from screener.settings.stores import StoreChoice
from screener.output import wall
from screener.types import ExitCode


def _shown(as_json: bool, what: str) -> Any:
    """The command's progress on stderr (screener.output.progress): a bar on a terminal, else a
    line per finished job run (JSON lines with --json), with times from the command's start.
    Its first line is printed now, before torch is imported (seconds on a cold machine)."""
    from screener.output.progress import HEARTBEAT_S, Progress

    shown = Progress(sys.stderr, json_lines=as_json, heartbeat_s=HEARTBEAT_S, t0=wall.started())
    shown.announce(f"{what}: loading torch and the job specs")
    return shown


@contextlib.contextmanager
def _progress(shown: Any, total: Optional[int], stage: str) -> Iterator[Any]:
    """The known-answer runs' stage of `shown` (_shown), closed with it at the end."""
    from screener.output.progress import JobEvents

    try:
        events = JobEvents(shown, stage, total)
        try:
            yield events
        finally:
            events.close()
    finally:
        shown.close()  # JobEvents ends its stage only; this stops the heartbeat thread too


# --- kat -----------------------------------------------------------------------------------------

@click.group("kat")
def kat_group() -> None:
    """Known-answer screening: deterministic jobs compared bit for bit with golden records,
    with the device's peers and with its own repeats."""


@kat_group.command("run")
@click.option("--job", "-j", "jobs", multiple=True,
              help="Job to run (repeatable); default: the quick screen (jobs with quick = true).")
@click.option("--device", "-d", "devices", multiple=True, default=("all",), show_default=True,
              help=DEVICE_HELP)
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
@click.option("--inject", "inject", multiple=True, help=INJECT_HELP)
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
    shown = _shown(as_json, "kat run")
    try:
        from screener.known_answer.engine.screen import resolve_devices, resolve_jobs, run_screen
        from screener.known_answer.engine.text import format_verdicts

        specs = resolve_jobs(list(jobs), jobs_dir)
        devs = resolve_devices(list(devices))
    except BaseException:
        shown.close()
        raise
    with _progress(shown, len(specs) * len(devs) * repeat, "known-answer") as progress:
        result = run_screen(specs, devs, golden_dir=golden_dir, jobs_dir=jobs_dir, repeat=repeat,
                            timeout=timeout, faults=parse_faults(inject, devs), progress=progress)
    # The summary's "in N s" is the wall time since the command started, not the screen's own
    # seconds (which leave out torch's import and the job specs).
    result = dataclasses.replace(result, seconds=wall.elapsed())
    # A fault that never fired tested nothing: exit 2, and the printed verdict says so too (the
    # screen's own line said "pass (exit 0)" above an exit 2).
    unfired = unfired_warnings(result, inject)
    code = int(ExitCode.USAGE) if unfired else int(result.exit_code)
    if as_json:
        d = result.to_dict()
        if unfired:
            d.update(exit_code=code, unfired=unfired)
        echo_json(d)
    else:
        lines = format_verdicts(result).splitlines()
        if unfired:
            lines[-1] = (f"not a test (exit {code}): injected fault(s) never fired, so the "
                         f"{result.outcome.value} of {len(result.jobs)} job(s) on "
                         f"{len(result.verdicts)} device(s) in {result.seconds:.1f} s proves "
                         "nothing about them")
        click.echo("\n".join(lines))
    sys.exit(unfired_exit(result, code, inject))  # the warnings, after the results


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
    from screener.known_answer.engine.golden import default_golden_dir, golden_path, job_records
    from screener.known_answer.engine.screen import local_platform
    from screener.known_answer.engine.workloads import describe, load_jobs

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
        echo_json({"cpu_platform_hash": phash, "jobs": rows})
    else:
        click.echo(f"{'job':14s} {'kind':8s} {'ver':>3s} {'quick':5s} {'spec hash':16s} "
                   f"{'cpu golden':10s} description")
        for r in rows:
            click.echo(f"{r['name']:14s} {r['kind']:8s} {r['version']:3d} "
                       f"{'yes' if r['quick'] else 'no':5s} {r['spec_hash']:16s} "
                       f"{'yes' if r['cpu_golden'] else 'no':10s} {r['description']}")
        click.echo(f"(cpu platform hash {phash})")
    sys.exit(int(ExitCode.PASS))


@kat_group.command("coverage")
@click.argument("script")
@click.option("--device", "-d", default="auto", show_default=True,
              help="Device to measure on: cpu, cuda:N, or auto (cuda:0 when there is a GPU, else "
                   "the CPU). The jobs run there; the script finds it in $SCREENER_DEVICE.")
@click.option("--job", "-j", "jobs", multiple=True,
              help="Job to count (repeatable); default: every job, as a full burn-in runs them "
                   "(--quick: the quick screen's).")
@click.option("--quick", is_flag=True,
              help="Count the quick screen's jobs (the ones `kat run` and the daemon's daily "
                   "screen run) instead of every job.")
@click.option("--jobs-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of job specs (default: $SCREENER_JOBS_DIR or jobs/).")
@click.option("--timeout", type=positive(max=7 * 86400.0), default=600.0, show_default=True,
              help="Seconds the script's runs, and the jobs' run, may each take before they are "
                   "killed.")
@click.option("--runs", type=click.IntRange(min=1, max=100), default=3, show_default=True,
              help="Counted runs of the script; each op's time is its least disturbed run's.")
@click.option("--warmup", type=click.IntRange(min=0, max=100), default=1, show_default=True,
              help="Runs of the script before the counted ones, not counted (one-time costs).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def kat_coverage(script: str, device: str, jobs: tuple[str, ...], quick: bool,
                 jobs_dir: Optional[str], timeout: float, runs: int, warmup: int,
                 as_json: bool) -> None:
    """Which of a training step's ops the known-answer jobs run, by share of the step's time.

    SCRIPT is a Python file that runs one training step of your model when run as a program:
    a child process runs it with runpy.run_path(SCRIPT, run_name="__main__"), as `python
    SCRIPT` would, so its top-level code and its `if __name__ == "__main__":` block run, and
    everything they run is counted, set-up included, unless the script marks its step: run
    inside `with torch.profiler.record_function("screener:step"):`, only the ops that start
    inside the mark count (on CUDA the kernels launched inside it). It runs --warmup times
    uncounted, then --runs times under the census, in that one process, so it must run again
    there. $SCREENER_DEVICE names the device to put the step on. examples/llama_step.py is one.

    The census is torch.profiler's: on the CPU every aten op with its self time, on CUDA every
    kernel with its device time; each op's time is its smallest over the counted runs (the
    least disturbed by other processes). Then the jobs (every job, as a full burn-in runs them;
    --quick: the quick screen's) run under the same census, once each, through the screen's own
    runner. An op is covered when a job runs an op of the same name
    (the same kernel on CUDA). The report lists the ops no job runs (a fault there cannot be
    seen), the covered ones with the jobs that run them, and covered_share: the covered ops'
    share of the step's self time.

    Exit: 0 measured; 2 bad input (no such script, a script that raises or exits non-zero, one
    that runs no op: one line naming the file, the line and the exception); 1 the census failed.
    """
    from screener.known_answer.engine.census import check_script, jobs_census, script_census
    from screener.known_answer.verdict.coverage import compare, report_lines
    from screener.known_answer.engine.screen import resolve_devices, resolve_jobs

    check_script(script)  # before anything is said about running it
    if jobs and quick:
        raise click.UsageError("--quick and --job: give one (--quick is the quick screen's jobs)")
    specs = resolve_jobs(list(jobs), jobs_dir, quick_only=quick)
    # One device: every GPU of a node runs the same kernels, so auto takes the first (cuda:0).
    devs = resolve_devices(["all"] if device == "auto" else [device])
    if device != "auto" and len(devs) != 1:
        raise click.UsageError(f"--device {device}: give one device (cpu or cuda:N)")
    dev = devs[0]
    click.echo(f"screener: kat coverage: running {script} on {dev} under the census", err=True)
    step = script_census(script, dev, timeout=timeout, warmup=warmup, runs=runs)
    click.echo(f"screener: kat coverage: running {len(specs)} job(s) on {dev} under the census",
               err=True)
    cov = compare(step, jobs_census(specs, dev, timeout=timeout))
    if as_json:
        echo_json({"script": script, "device": dev, **cov.to_dict(),
                   "exit_code": int(ExitCode.PASS)})
    else:
        click.echo("\n".join(report_lines(cov, script=script, device=dev)))
    sys.exit(int(ExitCode.PASS))


# --- golden --------------------------------------------------------------------------------------

@click.group("golden")
def golden_group() -> None:
    """Golden records: the known answers of each job per platform (golden/<job>.<hash>.json)."""


@golden_group.command("record")
@click.option("--job", "-j", "jobs", multiple=True,
              help="Job to record (repeatable); default: every job but selftests.")
@click.option("--device", "-d", "devices", multiple=True, default=("all",), show_default=True,
              help=DEVICE_HELP)
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
    shown = _shown(as_json, "golden record")
    try:
        from screener.known_answer.engine.screen import (record_goldens, resolve_devices,
                                                         resolve_jobs)

        specs = resolve_jobs(list(jobs), jobs_dir, quick_only=False)
        devs = resolve_devices(list(devices))
    except BaseException:
        shown.close()
        raise
    with _progress(shown, len(specs) * len(devs) * repeat, "golden runs") as progress:
        rec = record_goldens(specs, devs, out_dir=out, repeat=repeat, timeout=timeout, force=force,
                             progress=progress)
    if as_json:
        echo_json(rec.to_dict())
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
    from screener.known_answer.engine.golden import default_golden_dir, load_dir, spec_problem
    from screener.known_answer.engine.workloads import load_jobs

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
        echo_json({"folder": str(d), "valid": [r.path for r in ok], "problems": problems})
    else:
        for r in ok:
            click.echo(f"ok      {r.path}")
    for p in problems:
        click.echo(f"screener: {p}", err=True)
    sys.exit(int(ExitCode.USAGE if problems else ExitCode.PASS))


@golden_group.command("list")
@click.argument("golden_dir", required=False, type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.option("--fleet", is_flag=True,
              help="Also list the goldens the fleet promoted from a quorum of nodes (where a "
                   "platform had no golden), with their provenance, read from the store "
                   "(--store, --db, --kubeconfig, --context).")
@store_options(spool=False)
def golden_list(golden_dir: Optional[str], as_json: bool, fleet: bool,
                store_choice: StoreChoice) -> None:
    """List the golden records in GOLDEN_DIR (default: golden/); '*' marks records for a
    platform of this machine. With --fleet, also the goldens the fleet promoted from a quorum
    (source 'quorum': which nodes agreed, who promoted it, when, with which screener). Broken
    files are listed as problems (exit 2); a broken promoted record is listed as a problem too."""
    from screener.known_answer.engine.golden import GoldenError, default_golden_dir, load_dir, parse
    from screener.known_answer.engine.promotion import describe, store_path
    from screener.known_answer.engine.screen import local_platform, resolve_devices

    d = Path(golden_dir) if golden_dir else default_golden_dir()
    records, errors = load_dir(d) if d.is_dir() else ([], [])
    promoted: list[Any] = []
    if fleet:
        app = click.get_current_context().ensure_object(AppContext)
        store = app.store(store_choice)
        lister = getattr(store, "promoted_goldens", None)
        for phash, jobs in sorted((lister() if lister is not None else {}).items()):
            for job, text in sorted(jobs.items()):
                try:
                    promoted.append(parse(store_path(job, phash), text))
                except GoldenError as bad:
                    errors.append(bad)
    local = {local_platform(dev).numeric_hash for dev in resolve_devices(["all"])}
    local.add(local_platform("cpu").numeric_hash)
    rows: list[dict[str, Any]] = [{"job": r.job, "platform_hash": r.platform_hash,
             "platform": r.platform.get("name"), "devices": r.recorded.get("devices"),
             "repeats": r.recorded.get("repeats"), "time": r.recorded.get("time"),
             "digest": r.digest, "local": bool(local & set(r.platform_hashes)),
             "platform_hashes": list(r.platform_hashes), "path": r.path,
             "source": "folder" if r in records else "quorum",
             **({"provenance": describe(r)} if r not in records else {})}
            for r in (*records, *promoted)]
    if as_json:
        echo_json({"folder": str(d), "records": rows, "problems": [str(e) for e in errors]})
    else:
        click.echo(f"  {'job':14s} {'platform hash':16s} {'recorded':20s} {'devices':18s} platform")
        for r in rows:
            click.echo(f"{'*' if r['local'] else ' '} {r['job']:14s} {r['platform_hash']:16s} "
                       f"{r['time']:20s} {','.join(r['devices'] or []):18s} {r['platform']}")
            if r["source"] == "quorum":
                p = r["provenance"]
                click.echo(f"    promoted from a quorum of {p['agreeing']} node(s) "
                           f"({', '.join(p['nodes'])}) by {p['promoted_by']} at "
                           f"{p['promoted_at']}, screener {p['screener_version']}")
        for e in errors:
            click.echo(f"screener: {e}", err=True)
    sys.exit(int(ExitCode.USAGE if errors else ExitCode.PASS))
