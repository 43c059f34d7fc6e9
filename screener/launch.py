"""Launch a training job so that its exit code is the workers' verdict, not torchrun's 1.

torchrun exits 1 whenever a worker fails, whatever the worker's own code, so a Kubernetes Job's
podFailurePolicy that matches 75 (hardware suspect) or 77 (a peer failed) never fires. This launcher
runs the job and exits with the code that matters most among its workers:

    75 (hardware suspect)  beats  77 (a peer failed)  beats  76 (numeric)  beats  anything else

    screener launch -- torchrun --nproc-per-node 8 train.py ...      # the CLI
    python -m screener.launch --nproc-per-node 8 train.py ...         # same, torchrun's options

How the workers' codes are learned, two ways that back each other up:

1. torchrun runs in this process (`torch.distributed.run.run`, exactly what the torchrun command
   calls), so its ChildFailedError hands over every local worker's exit code (the first to fail,
   and those the agent then stopped with SIGTERM). No log scraping, no error files to parse.
2. The launcher sets SCREENER_EXIT_DIR to a fresh directory for the workers; `run_guarded` writes
   the code it chose there (one file per process, `<anything>.code`, the decimal code) before it
   returns. A worker whose verdict was 75 but that then died at interpreter shutdown (a SIGABRT in
   a library's teardown) or was stopped by the agent before its own exit still counts as 75.

Any other command (`screener launch -- python train.py`, `bash -c ...`) runs as a child process
with SIGTERM/SIGINT passed on; its exit code is combined with the codes recorded in the directory
the same way. A code above 128 is a signal (128 + N, as a shell reports it).

Before it starts any worker, the launcher asks the screener DaemonSet on its node for the node's
health answer (screener.node_answer: a Unix socket in the alarm folder, which job pods mount) and
refuses to start on a node that may not run jobs: one line saying why, exit 75 (hardware
suspect), so a podFailurePolicy that acts on the in-job audit's 75 acts on this too. So does an
answer that says hardware evidence about the node waits to be decided (an alarm the daemon took
in at a first start while the Kubernetes API was out of reach), whatever `if_unavailable`. An answer
that cannot be had (no socket: not on a screener node; a daemon that has not started or whose
loop is stuck; a socket not the daemon's) is one warning line, and the workers start, unless
`if_unavailable="refuse"` (`--if-unavailable refuse`), which refuses with exit 1 (the screener
itself failed: never a hardware verdict). `--no-health-check` skips the question.

Exit codes: the combined code; 0 when everything exited 0; 2 for a bad command line; 75 or 1
for a launch refused by the health check (above).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

from screener.node_answer import AnswerUnavailable, ask, default_socket
from screener.types import EXIT_DIR_ENV, ExitCode

__all__ = ["combine", "recorded_codes", "main", "is_torchrun", "health_gate", "IF_UNAVAILABLE"]

IF_UNAVAILABLE = ("run", "refuse")  # what to do when the node's health answer cannot be had

log = logging.getLogger("screener.launch")

PRIORITY = (int(ExitCode.HARDWARE_SUSPECT), int(ExitCode.PEER_FAILED), int(ExitCode.NUMERIC))


def _shell_code(code: int) -> int:
    """A process's exit status as a shell reports it: a signal N is 128 + N."""
    return 128 - code if code < 0 else code


def combine(worker_codes: Iterable[int], recorded: Iterable[int] = (),
            launcher_code: int = 0) -> int:
    """The job's exit code: 75 > 77 > 76 among everything seen, else the first other failure."""
    workers = [_shell_code(c) for c in worker_codes]
    seen = set(workers) | set(recorded)
    for code in PRIORITY:
        if code in seen:
            return code
    failures = [c for c in workers if c != 0]
    if failures:
        return failures[0]
    return _shell_code(launcher_code)


def recorded_codes(directory: str | os.PathLike[str]) -> list[int]:
    """The codes run_guarded recorded in SCREENER_EXIT_DIR (unreadable entries are skipped)."""
    codes = []
    try:
        entries = sorted(Path(directory).glob("*.code"))
    except OSError:
        return []
    for p in entries:
        try:
            codes.append(int(p.read_text().strip()))
        except (OSError, ValueError):
            continue
    return codes


def is_torchrun(cmd: Sequence[str]) -> Optional[list[str]]:
    """torchrun's own arguments when cmd is a torchrun command line, else None."""
    if not cmd:
        return None
    if os.path.basename(cmd[0]) == "torchrun":
        return list(cmd[1:])
    if len(cmd) >= 3 and os.path.basename(cmd[0]).startswith("python") and cmd[1] == "-m" \
            and cmd[2] == "torch.distributed.run":
        return list(cmd[3:])
    return None


def _run_torchrun(args: list[str]) -> tuple[int, list[int]]:
    """torch.distributed.run in this process: (launcher code, every failed worker's exit code)."""
    # Here, not at the top: torch takes seconds to import and `screener launch --help` must not.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(args))
    except ChildFailedError as e:
        failures = sorted(e.failures.values(), key=lambda f: f.timestamp)
        return 1, [int(f.exitcode) for f in failures]
    except SignalException as e:
        return -int(e.sigval), []
    return 0, []


def _run_child(cmd: list[str]) -> int:
    """Any other command as a child, with SIGTERM and SIGINT passed on to it."""
    try:
        proc = subprocess.Popen(cmd)
    except OSError as e:
        print(f"screener launch: cannot run {cmd[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 127
    previous = {}

    def forward(signum: int, frame: object) -> None:
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, forward)
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(cmd: Sequence[str]) -> int:
    """Run cmd (torchrun in this process, anything else as a child); return the combined code."""
    cmd = list(cmd)
    torchrun = is_torchrun(cmd)
    with tempfile.TemporaryDirectory(prefix="screener-exit-") as d:
        old = os.environ.get(EXIT_DIR_ENV)
        os.environ[EXIT_DIR_ENV] = d  # inherited by torchrun's workers or the child
        try:
            if torchrun is not None:
                launcher, workers = _run_torchrun(torchrun)
            else:
                launcher = _run_child(cmd)
                workers = [launcher]
        finally:
            if old is None:
                os.environ.pop(EXIT_DIR_ENV, None)
            else:
                os.environ[EXIT_DIR_ENV] = old
        recorded = recorded_codes(d)
    code = combine(workers, recorded, launcher)
    if code != 0:
        print(f"screener launch: worker exit codes {workers or [launcher]}, verdicts recorded by "
              f"run_guarded {sorted(recorded)}: exit {code}", file=sys.stderr, flush=True)
    return code


def health_gate(socket_path: Optional[str] = None, *, if_unavailable: str = "run",
                timeout_s: float = 2.0) -> Optional[int]:
    """Ask the node's health answer (socket_path: default node_answer.default_socket()). None:
    start the workers; else the exit code to refuse with, its one line already on stderr."""
    if if_unavailable not in IF_UNAVAILABLE:
        raise ValueError(f"if_unavailable must be one of {IF_UNAVAILABLE}")
    path = socket_path or default_socket()
    try:
        answer = ask(path, timeout_s=timeout_s)
        if answer.waiting and not answer.may_run_jobs:
            # Evidence about this node that the daemon could not decide yet (a first start
            # while the API is out of reach): a refusal, not a missing answer.
            print(f"screener launch: refusing to start workers: {answer.line()} (the screener "
                  f"daemon's answer on {path}; --no-health-check starts anyway)",
                  file=sys.stderr, flush=True)
            return int(ExitCode.HARDWARE_SUSPECT)
        if answer.state is None or not answer.alive:
            raise AnswerUnavailable(f"{answer.line()}" if answer.state is None else
                                    f"node {answer.node}: the daemon's loop is not making "
                                    f"progress, its answer may be stale")
    except AnswerUnavailable as e:
        if if_unavailable == "refuse":
            print(f"screener launch: refusing to start workers: no health answer: {e} "
                  f"(--if-unavailable run starts without one)", file=sys.stderr, flush=True)
            return int(ExitCode.SCREENER_ERROR)
        print(f"screener launch: warning: no health answer ({e}): starting the workers "
              f"unchecked", file=sys.stderr, flush=True)
        return None
    if not answer.may_run_jobs:
        print(f"screener launch: refusing to start workers: {answer.line()} (the screener "
              f"daemon's answer on {path}; --no-health-check starts anyway)", file=sys.stderr,
              flush=True)
        return int(ExitCode.HARDWARE_SUSPECT)
    log.info("health answer: %s", answer.line())
    return None


USAGE = ("usage: screener launch [--] torchrun [torchrun options] script [args]\n"
         "       screener launch [--] command [args]\n"
         "       python -m screener.launch [torchrun options] script [args]")


def main(argv: Optional[Sequence[str]] = None, *, health_check: bool = True,
         health_socket: Optional[str] = None, if_unavailable: str = "run") -> int:
    """`python -m screener.launch`: the arguments are torchrun's (or `-- command ...`); the
    health check with its defaults (see the module docstring; the socket from
    $SCREENER_HEALTH_SOCKET, else the alarm folder's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    if is_torchrun(args) is None and (args[0].startswith("-") or args[0].endswith(".py")):
        args = ["torchrun", *args]  # torchrun's options and script, as python -m takes them
    if health_check:
        refused = health_gate(health_socket, if_unavailable=if_unavailable)
        if refused is not None:
            return refused
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
