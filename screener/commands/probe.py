"""`screener probe`: run every health probe once and print the findings."""

from __future__ import annotations

import json
import sys
from typing import Optional

import click

from screener.commands.context import AppContext, pass_app
from screener.settings.health import MAX_PER_NODE
from screener.types import Severity


def _gpu_column(f: object) -> str:
    ev = getattr(f, "evidence", {}) or {}
    if ev.get("index") is not None:
        return str(ev["index"])
    gpu = getattr(f, "gpu", None)
    return gpu if gpu else "-"


@click.command("probe")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (findings, GPUs, host) instead "
              "of a table.")
@click.option("--kmsg", "kmsg_file", type=click.Path(dir_okay=False, path_type=str),
              help="Read Xid lines from FILE (a saved dmesg, syslog or journal) instead of "
                   "/dev/kmsg.")
@click.option("--kmsg-state", type=click.Path(dir_okay=False, path_type=str),
              help="Keep the kernel-log read position in this file, so a second run reports "
                   "only new Xid lines.")
@click.option("--no-kmsg", is_flag=True, help="Do not read the kernel log.")
@click.option("--expected-gpus", type=click.IntRange(0, MAX_PER_NODE),
              help="GPUs this node should have; fewer is critical (fallen off the bus).")
@click.option("--expected-nvlinks", type=click.IntRange(0, MAX_PER_NODE),
              help="Active NVLinks each GPU should have; fewer is suspect.")
@click.option("--require-mount", "mounts", multiple=True, metavar="PATH",
              help="A mount point that must be mounted (repeatable).")
@click.option("--disk", "disks", multiple=True, metavar="PATH",
              help="A path whose filesystem needs free space (repeatable; default /).")
@pass_app
def probe_cmd(app: AppContext, as_json: bool, kmsg_file: Optional[str], kmsg_state: Optional[str],
              no_kmsg: bool, expected_gpus: Optional[int], expected_nvlinks: Optional[int],
              mounts: tuple[str, ...], disks: tuple[str, ...]) -> None:
    """Run the GPU and host health probes once and print what they found.

    Reads every GPU through NVML (ECC counters, row remapper, retired pages, throttle reasons,
    temperature, power, PCIe and NVLink state, running processes), NVRM Xid lines from the kernel
    log (classified with NVIDIA's Xid catalog: hardware, software or informational), and the
    host (required mounts, memory and disk headroom). Without an NVIDIA driver it reports one info
    finding and goes on.

    Exit 0 when nothing is suspect or worse, 75 when something is, 1 when a probe itself failed.
    """
    from screener.settings.health import ProbeConfig
    from screener.health.sources.kmsg import KernelLogReader
    from screener.health.probes import run_probes

    kwargs: dict[str, object] = {"expected_gpus": expected_gpus,
                                 "expected_nvlinks": expected_nvlinks,
                                 "required_mounts": mounts}
    if disks:
        kwargs["disk_paths"] = disks
    if no_kmsg or kmsg_file:
        kwargs["kmsg_path"] = None
    if kmsg_state:
        kwargs["kmsg_state_file"] = kmsg_state
    config = ProbeConfig(**kwargs)  # type: ignore[arg-type]
    reader = None
    if kmsg_file and not no_kmsg:
        reader = KernelLogReader(kmsg_file, state_file=kmsg_state, user_input=True)
    # NVML through the command's context (opened once, closed when the command ends; tests hand
    # in a fake there). No event set: one read has no time for events to arrive.
    nvml = app.nvml(events=False)
    try:
        report = run_probes(config, nvml=nvml, kmsg=reader)
    finally:
        if reader is not None:
            reader.close()

    for e in report.errors:
        click.echo(f"screener probe: {e}", err=True)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, sort_keys=True, default=str))
    else:
        nv = report.snapshot.nvml
        if nv.available:
            click.echo(f"driver {nv.driver_version or '?'}, {nv.device_count} GPU(s)")
        rows = [(f.severity.label, f.code, _gpu_column(f), f.message) for f in report.findings]
        if rows:
            w0 = max(len("SEVERITY"), *(len(r[0]) for r in rows))
            w1 = max(len("CODE"), *(len(r[1]) for r in rows))
            w2 = min(40, max(len("GPU"), *(len(r[2]) for r in rows)))
            click.echo(f"{'SEVERITY':{w0}}  {'CODE':{w1}}  {'GPU':{w2}}  MESSAGE")
            for sev, code, gpu, msg in rows:
                click.echo(f"{sev:{w0}}  {code:{w1}}  {gpu:{w2}}  {msg}")
            for f in report.findings:
                if f.severity >= Severity.SUSPECT and f.action:
                    click.echo(f"  -> {f.code} ({_gpu_column(f)}): {f.action}")
        else:
            click.echo("no findings")
        click.echo(f"worst: {report.worst.label}")
    sys.exit(int(report.exit_code))
