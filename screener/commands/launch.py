"""`screener launch`: run torchrun (or any command) and exit with the workers' verdict code."""

from __future__ import annotations

import sys
from typing import Optional

import click


@click.command("launch", context_settings={"ignore_unknown_options": True,
                                           "allow_interspersed_args": False,
                                           "help_option_names": ["-h", "--help"]})
@click.option("--health-check/--no-health-check", default=True, show_default=True,
              help="Ask the screener DaemonSet on this node for its health answer first, and "
                   "refuse to start on a node that may not run jobs (exit 75).")
@click.option("--health-socket", metavar="PATH",
              help="The health answer's Unix socket (default $SCREENER_HEALTH_SOCKET, else "
                   "health.sock in $SCREENER_ALARM_DIR, else /var/run/screener/alarms/health.sock).")
@click.option("--if-unavailable", type=click.Choice(["run", "refuse"]), default="run",
              show_default=True,
              help="No answer to be had (not a screener node, the daemon not started or stuck): "
                   "start with a warning line, or refuse with exit 1.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(health_check: bool, health_socket: Optional[str], if_unavailable: str,
               command: tuple[str, ...]) -> None:
    """Run COMMAND and exit with the code that matters most among its workers.

    \b
        screener launch -- torchrun --nproc-per-node 8 train.py ...
        screener launch -- python train.py
        screener launch --if-unavailable refuse -- torchrun ...

    First it asks the screener daemon on this node whether the node may run jobs (its state and
    last verdict, over a Unix socket in the alarm folder) and, when it may not, starts nothing:
    one line saying why, exit 75. With no answer to be had it warns and starts, unless
    --if-unavailable refuse (exit 1). --no-health-check skips the question.

    torchrun runs in this process, so every worker's exit code is known (torchrun itself exits 1
    whatever they said); run_guarded also records each worker's verdict in SCREENER_EXIT_DIR. The
    exit code is 75 (hardware suspect) if any worker said so, else 77 (a peer failed), else 76
    (numeric), else the first other failure, else 0. A Job's podFailurePolicy can match on it.
    """
    from screener.launch import main

    if not command:
        raise click.UsageError("launch needs a command: screener launch -- torchrun ... script")
    sys.exit(main(list(command), health_check=health_check, health_socket=health_socket,
                  if_unavailable=if_unavailable))
