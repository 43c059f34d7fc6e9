"""`screener ARGS` in the test's own process, through the console entry point (screener.cli.run).

The same exit codes and the same one-line errors on stderr as the installed command, without a
Python start-up and a torch import per call (seconds each on a loaded machine). Fakes go in as an
AppContext (screener.commands.context). Each command group keeps at least one test that runs the
real process, for what only a process shows (the entry point, no traceback on a real stderr).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from click.testing import CliRunner

from screener.cli import run


@dataclass(frozen=True)
class Ran:
    """What a finished command left: like subprocess.CompletedProcess."""

    returncode: int
    stdout: str
    stderr: str


def screener(*args: str, obj: Any = None, env: Optional[Mapping[str, Optional[str]]] = None,
             cwd: Optional[os.PathLike[str] | str] = None) -> Ran:
    """Run `screener ARGS` here; env: variables to set (None: unset) for the call only."""
    code: Any = 0
    before = os.getcwd()
    with CliRunner().isolation(env=env) as (out, err, _):
        try:
            if cwd is not None:
                os.chdir(cwd)
            run(list(args), obj=obj)
        except SystemExit as e:
            code = e.code
        finally:
            os.chdir(before)
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    if not isinstance(code, int):  # sys.exit("message") or sys.exit(None), as Python exits
        code = 0 if code is None else 1
    return Ran(code, stdout, stderr)
