"""`screener launch`: run torchrun (or any command) and exit with the workers' verdict code."""

from __future__ import annotations

import sys

import click


@click.command("launch", context_settings={"ignore_unknown_options": True,
                                           "allow_interspersed_args": False,
                                           "help_option_names": ["-h", "--help"]})
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(command: tuple[str, ...]) -> None:
    """Run COMMAND and exit with the code that matters most among its workers.

    \b
        screener launch -- torchrun --nproc-per-node 8 train.py ...
        screener launch -- python train.py

    torchrun runs in this process, so every worker's exit code is known (torchrun itself exits 1
    whatever they said); run_guarded also records each worker's verdict in SCREENER_EXIT_DIR. The
    exit code is 75 (hardware suspect) if any worker said so, else 77 (a peer failed), else 76
    (numeric), else the first other failure, else 0. A Job's podFailurePolicy can match on it.
    """
    from screener.launch import main

    if not command:
        raise click.UsageError("launch needs a command: screener launch -- torchrun ... script")
    sys.exit(main(list(command)))
