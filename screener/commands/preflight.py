"""`screener preflight`: the gate a training pod's init container runs before the job starts.

Thin: parse options, read the node's last verdict (for the fast path), run the probes and the
preflight's known-answer subset, write an alarm file when the node is suspect, print, exit with
the contract's code. The decisions are screener.agent.preflight's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import click

from screener.agent.preflight import (ALARM_CHECK, DEFAULT_FAST_WINDOW_S, DEFAULT_TIME_CAP_S,
                                      VERDICT_ENV, VERDICT_FILE_ENV, FastPath, PreflightResult,
                                      alarm_record, fast_path, parse_verdict_text, screen_jobs)
from screener.commands._params import Duration
from screener.commands.context import AppContext
from screener.settings.health import MAX_PER_NODE
from screener.types import ALARM_DIR_ENV, DEFAULT_ALARM_DIR, ExitCode

_DAY = 86400.0


def _warn(result: PreflightResult, text: str) -> None:
    result.warnings.append(text)
    click.echo(f"screener preflight: warning: {text}", err=True)


def _read_verdict(app: AppContext, node: str, verdict_file: Optional[str], store_kind: str,
                  db: Optional[str], kubeconfig: Optional[str],
                  problems: list[str]) -> Optional[dict[str, Any]]:
    """The node's verdict annotation: $SCREENER_NODE_VERDICT, else the file, else the store.

    A source that cannot be read is a warning and the full preflight, never a failure: the fast
    path only saves time, so the gate must not depend on the API server being reachable.
    """
    text = app.environ.get(VERDICT_ENV, "")
    if text.strip():
        verdict, problem = parse_verdict_text(text)
        if problem:
            problems.append(f"${VERDICT_ENV}: {problem}")
        return verdict
    if verdict_file:
        try:
            verdict, problem = parse_verdict_text(Path(verdict_file).read_text(errors="replace"))
        except OSError as e:
            problems.append(f"{verdict_file}: {e.strerror or e}")
            return None
        if problem:
            problems.append(f"{verdict_file}: {problem}")
        return verdict
    if store_kind == "none":
        return None
    from screener.errors import ScreenerError
    from screener.settings.stores import StoreChoice

    try:
        store = app.store(StoreChoice(kind=store_kind, db=db, kubeconfig=kubeconfig,
                                      create=False))
        return store.get_verdict(node) if store is not None else None
    except (ScreenerError, OSError) as e:
        problems.append(f"the {store_kind} store: {e}")
        return None


def _probe(result: PreflightResult, expected_gpus: Optional[int], app: AppContext) -> None:
    """The health probes once, without the kernel log: the daemon reads that continuously, and
    a reader without its saved position would report every Xid since boot again. NVML is the
    command's (AppContext.nvml), with no event set."""
    from screener.health.probes import run_probes
    from screener.settings.health import ProbeConfig

    t0 = time.monotonic()
    report = run_probes(ProbeConfig(expected_gpus=expected_gpus, kmsg_path=None,
                                    nvml_events=False), nvml=app.nvml(events=False))
    result.seconds["probes"] = time.monotonic() - t0
    result.probe = report.to_dict()
    result.probe_findings = tuple(report.findings)
    result.probe_errors = tuple(report.errors)
    for e in report.errors:
        _warn(result, f"probe: {e}")


def _screen(result: PreflightResult, devices: tuple[str, ...], golden_dir: Optional[str],
            jobs_dir: Optional[str], repeat: int, time_cap: float) -> None:
    """The known-answer subset, judged against the goldens as `screener kat run` judges."""
    from screener.known_answer.engine.screen import resolve_devices, run_screen

    t0 = time.monotonic()
    screen = run_screen(list(result.jobs), resolve_devices(list(devices)), golden_dir=golden_dir,
                        jobs_dir=jobs_dir, repeat=repeat, timeout=time_cap)
    result.seconds["known_answer"] = time.monotonic() - t0
    result.screen = screen.to_dict()
    result.screen_outcome = screen.outcome
    result.screen_exit = ExitCode(screen.exit_code)


def _drop_alarm(result: PreflightResult, alarm_dir: str, job: str, app: AppContext) -> None:
    """Leave an unsettled alarm about this node for its daemon; a folder that cannot be written
    is said and never hides the verdict (the exit code is still 75)."""
    from screener.audit.alarms import write_alarm_file
    from screener.remediation.hyperpod import instance_id_of

    record = alarm_record(result, created=app.clock(), job=job,
                          instance_id=instance_id_of(result.node))
    try:
        result.alarm_file = str(write_alarm_file(record, alarm_dir))
    except OSError as e:
        _warn(result, f"could not write the alarm file into {alarm_dir}: {e.strerror or e}")


def _record_commands(result: PreflightResult) -> list[str]:
    """The `screener golden record` commands the screen's verdicts give, once each."""
    verdicts = (result.screen or {}).get("verdicts", [])
    return list(dict.fromkeys(str(v["evidence"]["command"]) for v in verdicts
                              if (v.get("evidence") or {}).get("command")))


def _inconclusive_text(result: PreflightResult) -> str:
    """Why the screen had nothing to compare with: no golden at all, or goldens of sibling
    platforms (same torch build and dispatch level) that exist and differ; with the command
    that records one, as `kat run` gives it."""
    verdicts = (result.screen or {}).get("verdicts", [])
    reasons = {v.get("reason") for v in verdicts}
    reasons |= {i.get("reason") for v in verdicts
                for i in (v.get("evidence") or {}).get("issues", [])}
    if "sibling_golden_differs" in reasons:
        text = ("inconclusive: golden records of sibling platforms exist but differ from this "
                "platform's results, and none is this platform's")
    else:
        text = "inconclusive: no golden record to compare with on this platform"
    commands = _record_commands(result)
    return text + (f"; record one on a known-good node with: {'; '.join(commands)}"
                   if commands else "")


def _print_text(result: PreflightResult) -> None:
    click.echo(f"node {result.node}: {result.outcome} (exit {int(result.exit_code)})")
    click.echo(f"  fast path: {'taken' if result.fast.taken else 'not taken'}: {result.fast.reason}")
    for f in result.probe_findings:
        if f.severity.label not in ("ok", "info"):
            click.echo(f"  probe {f.severity.label}: {f.code}: {f.message}")
    for v in (result.screen or {}).get("verdicts", []):
        where = "".join(f" {k} {v[k]}" for k in ("job", "step", "tensor") if v.get(k) is not None)
        click.echo(f"  known-answer {v.get('device')}: {v.get('outcome')}"
                   f"{' (' + v['reason'] + ')' if v.get('reason') else ''}{where}")
    for command in _record_commands(result):
        click.echo(f"  record a golden: {command}")
    times = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
    click.echo(f"  jobs: {', '.join(result.jobs) or 'none (fast path)'}; {times}")
    if result.alarm_file:
        click.echo(f"  alarm: {result.alarm_file}")


@click.command("preflight")
@click.option("--job", "-j", "jobs", multiple=True,
              help="Known-answer job to run (repeatable); default: gemm-fp32, gemm-bf16, replay-fp32, train-bf16.")
@click.option("--device", "-d", "devices", multiple=True, default=("all",), show_default=True,
              help="Device to screen: cpu, cuda:N or all (the pod's GPUs, or the CPU). Repeatable.")
@click.option("--golden-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of golden records (default: $SCREENER_GOLDEN_DIR or golden/).")
@click.option("--jobs-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of job specs (default: $SCREENER_JOBS_DIR or jobs/).")
@click.option("--repeat", "-r", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Runs of each job per device.")
@click.option("--time-cap", type=Duration(longest=_DAY), default=DEFAULT_TIME_CAP_S,
              show_default="60s",
              help="Longest a device may go without finishing a job (or starting up) before it "
                   "is killed and reported suspect (timeout).")
@click.option("--fast-window", type=Duration(longest=365 * _DAY, allow_zero=True), default=DEFAULT_FAST_WINDOW_S,
              show_default="6h", envvar="SCREENER_PREFLIGHT_FAST_WINDOW",
              help="Run only the probes when the node passed a screen this recently (its "
                   "screener.io/verdict annotation); 0 turns the fast path off.")
@click.option("--verdict-file", type=click.Path(dir_okay=False), default=None,
              envvar=VERDICT_FILE_ENV,
              help="A file holding the node's verdict annotation (empty: none). "
                   f"${VERDICT_ENV} may hold the JSON itself.")
@click.option("--verdict-store", type=click.Choice(["none", "local", "kube", "auto"]),
              default="none", show_default=True,
              help="Read the node's verdict from this store when neither the file nor "
                   f"${VERDICT_ENV} gives one (kube: get on the Node).")
@click.option("--db", type=click.Path(dir_okay=False), default=None,
              help="The local store's database, for --verdict-store local.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
              help="Kubeconfig for --verdict-store kube (default: as kubectl, then in-cluster).")
@click.option("--node", default=None, help="This node's name (default: $NODE_NAME, else the "
              "hostname).")
@click.option("--alarm-dir", type=click.Path(file_okay=False), default=None,
              help=f"Where a suspect preflight drops its alarm (default: ${ALARM_DIR_ENV} or "
                   f"{DEFAULT_ALARM_DIR}).")
@click.option("--job-name", default="", envvar="SCREENER_JOB_NAME",
              help="The job being gated, recorded in the alarm.")
@click.option("--expected-gpus", type=click.IntRange(0, MAX_PER_NODE),
              help="GPUs this node should have; fewer is critical.")
@click.option("--allow-inconclusive", is_flag=True,
              help="Exit 0 instead of 3 when there is no golden to compare with, so the pod "
                   "starts (the warning and the JSON still say inconclusive).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.pass_context
def preflight_cmd(ctx: click.Context, jobs: tuple[str, ...], devices: tuple[str, ...],
                  golden_dir: Optional[str], jobs_dir: Optional[str], repeat: int,
                  time_cap: float, fast_window: float, verdict_file: Optional[str],
                  verdict_store: str, db: Optional[str], kubeconfig: Optional[str],
                  node: Optional[str], alarm_dir: Optional[str], job_name: str,
                  expected_gpus: Optional[int], allow_inconclusive: bool, as_json: bool) -> None:
    """Gate a job at its start: the health probes, then a quick subset of the known-answer
    jobs judged bit for bit against the golden records.

    Fast path: when the node passed a screen within --fast-window (its verdict annotation, from
    $SCREENER_NODE_VERDICT, --verdict-file or --verdict-store), only the probes run.

    Exit: 0 pass, 75 suspect (an unsettled alarm about this node is left in the alarm folder, so
    the daemon takes the node out of the pool), 3 inconclusive (no golden; 0 with
    --allow-inconclusive), 2 bad input, 1 the preflight itself failed.
    """
    app = ctx.ensure_object(AppContext)
    me = app.node_name(node)
    problems: list[str] = []
    verdict = _read_verdict(app, me, verdict_file, verdict_store, db, kubeconfig, problems)
    fast = fast_path(verdict, app.clock(), fast_window)
    result = PreflightResult(node=me, fast=fast, jobs=() if fast.taken else screen_jobs(jobs))
    for p in problems:
        _warn(result, f"node verdict unreadable, full preflight: {p}")
    t0 = time.monotonic()
    _probe(result, expected_gpus, app)
    if not fast.taken and not result.probe_suspect:
        _screen(result, devices, golden_dir, jobs_dir, repeat, time_cap)
    # The command's wall time (its imports and the verdict read included), not this part's.
    from screener.output import wall

    result.seconds["total"] = max(wall.elapsed(), time.monotonic() - t0)
    code = result.exit_code
    if code == ExitCode.HARDWARE_SUSPECT:
        _drop_alarm(result, alarm_dir or app.environ.get(ALARM_DIR_ENV) or DEFAULT_ALARM_DIR,
                    job_name, app)
    elif code == ExitCode.INCONCLUSIVE:
        _warn(result, _inconclusive_text(result)
              + (" (the pod starts)" if allow_inconclusive else ""))
        if allow_inconclusive:
            code = ExitCode.PASS
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True, default=str))
    else:
        _print_text(result)
    sys.exit(int(code))


__all__ = ["preflight_cmd", "ALARM_CHECK", "FastPath"]
