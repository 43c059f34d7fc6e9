"""The `screener` command line: a thin click group that parses, calls and prints.

Subcommands live in `screener/commands/<area>.py` and are imported only when used, so
`screener --help` and `screener platform` do not pay for kubernetes or boto3. They get the node
name, stores and clients from one AppContext (screener.commands.context), the click context object:
the first command that asks makes it, unless the caller (a test, with fakes) passed one as `obj`.
Every command maps ScreenerError to its exit code with one line on stderr and no traceback.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, NoReturn, Optional, Sequence

import click

from screener import __version__
from screener.types import ExitCode
# The command's clock starts here, before any heavy import: every elapsed time it prints is
# measured from this moment (screener.output.wall).
from screener.output import wall

# name -> (module, attribute, short help). Registering a command is one line here.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "kat": ("screener.commands.kat", "kat_group", "Known-answer screen: run jobs, compare bits."),
    "golden": ("screener.commands.kat", "golden_group", "Record, verify and list golden records."),
    "burnin": ("screener.commands.burnin", "burnin_cmd", "Burn in this node: every job, repeated."),
    "platform": ("screener.commands.platform_fingerprint", "platform_cmd",
                 "Show the platform signature of a device and its hash."),
    "fingerprint": ("screener.commands.platform_fingerprint", "fingerprint_cmd",
                    "Fingerprint the tensors of a checkpoint, or compare two."),
    "probe": ("screener.commands.probe", "probe_cmd", "Run the GPU and host health probes once."),
    "preflight": ("screener.commands.preflight", "preflight_cmd", "Gate a job at its start: probes, then a quick known-answer subset."),
    "hyperpod": ("screener.commands.remediate", "hyperpod_group", "SageMaker HyperPod: deep health check, reboot, replace."),
    "correlate": ("screener.commands.remediate", "correlate_cmd", "What a node's DCGM telemetry in Prometheus did around an alarm."),
    "plan": ("screener.commands.remediate", "plan_cmd", "Checkpoint interval (Young) and goodput from MTTF and restart time."),
    "node": ("screener.commands.node", "node_group", "Show and steer node lifecycle states."),
    "lemons": ("screener.commands.node", "lemons_cmd", "List nodes and GPUs that fail repeatedly."),
    "daemon": ("screener.commands.daemon", "daemon_cmd", "Run the per-node DaemonSet loop (or one pass with --once)."),
    "drill": ("screener.commands.daemon", "drill_cmd", "Fire drill: an injected fault followed from the job to the node label."),
    "launch": ("screener.commands.launch", "launch_cmd", "Run torchrun (or a command); exit with the workers' 75/77/76 verdict."),
    "report": ("screener.commands.report", "report_group", "HTML report with plots of a burn-in or of the fleet."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        spec = COMMANDS.get(name)
        if spec is None:
            return None
        module, attr, _ = spec
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing uses the registry's short help so that `screener --help` imports nothing heavy.
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


EXIT_CODES_HELP = "\b\nExit codes (the same for every command):\n" + "\n".join(
    f"  {int(c):<3} {c.meaning}" for c in ExitCode)


@click.group(cls=LazyGroup, epilog=EXIT_CODES_HELP,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="screener")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
def main(verbose: int) -> None:
    """screener: catch GPUs that compute wrong numbers without raising an error.

    Known-answer screening compared bit for bit with golden results and peers, node burn-in,
    GPU health probes, and the node lifecycle (burnin, healthy, suspect, quarantined, repair).
    Results go to stdout, logs to stderr.
    """
    wall.invoked()
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def usage_line(e: click.exceptions.UsageError) -> str:
    """A click usage error as one line: `screener: <command>: <problem> (see '<command> --help')`."""
    names: list[str] = []
    ctx = e.ctx
    while ctx is not None and ctx.parent is not None:  # the root's name is however it was run
        names.insert(0, ctx.info_name or "")
        ctx = ctx.parent
    sub = " ".join(names)
    path = f"screener {sub}".strip()
    message = " ".join(e.format_message().split())
    return f"screener: {sub + ': ' if sub else ''}{message} (see '{path} --help')"


def run(args: Optional[Sequence[str]] = None, obj: Any = None) -> NoReturn:
    """Console entry point: run the group and turn our own errors into one line and an exit code.

    args: the command line without the program name (default sys.argv[1:]). obj: the click
    context object, an AppContext (screener.commands.context) with fakes, for tests that run the
    entry point in their own process; default: the commands build the real one.
    """
    from screener.errors import ScreenerError

    try:
        rv = main.main(args=None if args is None else list(args), obj=obj,
                       standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.exceptions.UsageError as e:
        # One line, as every other bad input (click's own show() prints usage, a hint and the
        # error on three): where, what, and where the help is.
        click.echo(usage_line(e), err=True)
        sys.exit(2)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(2)  # every click error is a usage or bad-input error
    except ScreenerError as e:
        click.echo(f"screener: {e}", err=True)
        sys.exit(int(e.exit_code))
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    run()
