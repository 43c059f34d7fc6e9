"""`screener report burnin|fleet`: write a self-contained HTML report with inline SVG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from screener.atomicfile import write_atomic
from screener.commands._params import MAX_DAYS, MAX_FAILURES, positive
from screener.commands.context import AppContext, pass_app
from screener.commands.options import with_store
from screener.errors import BadInputError
from screener.types import ExitCode


def _write(out: str, page: str) -> None:
    """Write the page next to its final name, then rename: a reader never sees half a report."""
    p = Path(out)
    if p.is_dir():
        raise BadInputError(f"{p}: is a folder; --out takes a file name")
    try:
        write_atomic(p, page, public=True)  # a report is an ordinary file, readable by all
    except OSError as e:
        raise BadInputError(f"{p}: cannot write: {e.strerror or e}") from None
    click.echo(str(p))


@click.group("report")
def report_group() -> None:
    """Write an HTML report (one file, plots inline, nothing fetched) of a burn-in or the fleet."""


@report_group.command("burnin")
@click.argument("report_file", metavar="REPORT.json", type=click.Path(dir_okay=False))
@click.option("-o", "--out", default="burnin-report.html", show_default=True,
              type=click.Path(dir_okay=False), help="HTML file to write.")
def burnin_report_cmd(report_file: str, out: str) -> int:
    """A burn-in written by `screener burnin --report REPORT.json`: stages and their time, per-job
    known-answer times per device, HBM bandwidth per device, verdicts, probe findings and the
    node's lifecycle change. Prints the path written."""
    from screener.output.report import burnin_html, load_burnin_report

    data = load_burnin_report(report_file)
    _write(out, burnin_html(data, source=report_file))
    return int(ExitCode.PASS)


@report_group.command("fleet")
@click.option("-o", "--out", default="fleet-report.html", show_default=True,
              type=click.Path(dir_okay=False), help="HTML file to write.")
@click.option("--days", type=positive(max=MAX_DAYS), default=30.0, show_default=True,
              help="History window of the timeline and of the lemon counts.")
@click.option("--min-failures", type=click.IntRange(1, MAX_FAILURES), default=3, show_default=True,
              help="Confirmed failures in the window that make a lemon.")
@click.option("--burnin-report", "burnin_reports", multiple=True, type=click.Path(dir_okay=False),
              help="A burn-in report (screener burnin --report) whose HBM bandwidth per GPU to "
                   "show. Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print the report's data as JSON on stdout "
              "instead of writing HTML.")
@with_store
@pass_app
def fleet_report_cmd(app: AppContext, out: str, days: float, min_failures: int,
                     burnin_reports: tuple[str, ...], as_json: bool, store: Any) -> int:
    """The fleet from the store: nodes per state, every node's states over the window with its
    confirmed failures, lemons (nodes and GPU serials), the last screen's seconds per job and
    device, and HBM bandwidth per GPU. Prints the path written."""
    from screener.output.report import fleet_data, fleet_html, load_burnin_report

    reports = [load_burnin_report(f) for f in burnin_reports]
    data = fleet_data(store, now=app.clock(), days=days, min_failures=min_failures,
                      burnin_reports=reports)
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        _write(out, fleet_html(data))
    return int(ExitCode.PASS)
