"""When the command started: the one origin of every elapsed time a command prints.

`screener.cli` imports this module first thing, so `started()` is the moment the console script
began running screener (the interpreter's own start-up, tens of milliseconds, is before it).
A summary that says "in 17.5 s" then means the wall time a person waited, torch's import and the
children's start-up included, not the seconds of one stage (`golden record` said 7.8 s of a
17.5 s run when each part measured from its own start).
"""

from __future__ import annotations

import time

_STARTED = time.monotonic()


def started() -> float:
    """time.monotonic() when the command started (when this module was first imported)."""
    return _STARTED


def elapsed() -> float:
    """Wall seconds since the command started."""
    return time.monotonic() - _STARTED
