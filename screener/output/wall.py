"""When the command started: the one origin of every elapsed time a command prints.

`screener.cli` imports this module first thing, so `started()` is the moment the console script
began running screener (the interpreter's own start-up, tens of milliseconds, is before it);
`invoked()` restarts it for a command run later in the same process (see there).
A summary that says "in 17.5 s" then means the wall time a person waited, torch's import and the
children's start-up included, not the seconds of one stage (`golden record` said 7.8 s of a
17.5 s run when each part measured from its own start).
"""

from __future__ import annotations

import time

_STARTED = time.monotonic()
_INVOKED = False
# A first invocation this long after the import is not the process's own start (a caller that
# runs commands in its process, as the tests' CliRunner does): its clock starts at invocation.
FRESH_S = 5.0


def invoked() -> None:
    """A command starts (the `screener` group's callback, once per invocation). The process's
    first command keeps the import time, so a real command counts its own start-up; any later
    one in the same process (or one long after the import) starts its clock now."""
    global _STARTED, _INVOKED
    now = time.monotonic()
    if _INVOKED or now - _STARTED > FRESH_S:
        _STARTED = now
    _INVOKED = True


def started() -> float:
    """time.monotonic() when the command started (when this module was first imported)."""
    return _STARTED


def elapsed() -> float:
    """Wall seconds since the command started."""
    return time.monotonic() - _STARTED
