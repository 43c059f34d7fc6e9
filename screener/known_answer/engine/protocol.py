"""The parent/child protocol of a screen: the request a child reads and the events it writes.

The parent (screener.known_answer.engine.supervise) starts `python -m screener.known_answer.engine.child` per
device, writes one JSON request (`request`) on its stdin and closes it. The child
(screener.known_answer.engine.child) writes one line per event on stdout, each PREFIX + JSON, so that
whatever else lands on stdout (a library's banner) is not mistaken for an event:

- platform  {platform, platform_hash}: the device's platform signature, once, after start-up;
- start     {job, iteration}: a job's run begins (the parent's timeout restarts);
- result    {iteration, result, fired?}: a JobResult.to_dict(), and the faults that fired (each
              naming its index in the request's faults);
- error     {job, iteration, kind, type, message, traceback, fired?, continues?}: the child
              gives up (ErrorKind), with the faults that fired in the job's run; with
              `continues` true (a job's own raise, kind "job") it goes on and runs the job again;
- done      {iterations}: every iteration ran; a child that ends without it crashed.

Both sides import only this module to agree on the format; it needs nothing beyond the standard
library.
"""

from __future__ import annotations

import json
import traceback
from typing import Any, Mapping, Optional, Sequence

from screener.errors import BadInputError
from screener.types import StrValue

PREFIX = "@@screener "
CHILD_MODULE = "screener.known_answer.engine.child"  # run as `python -m CHILD_MODULE`
DEFAULT_THREADS = 1  # intra-op threads of a child: results depend on it, so goldens record it


class Event(StrValue):
    """The `event` field of a child's line."""

    PLATFORM = "platform"
    START = "start"
    RESULT = "result"
    ERROR = "error"
    DONE = "done"
    # Not from a child: what the parent hands its progress callback when it kills a child that
    # made no progress (screener.output.progress reads it).
    TIMEOUT = "timeout"


class ErrorKind(StrValue):
    """Whose fault an error event reports; the parent turns it into a RunStatus."""

    USAGE = "usage"  # bad input: a missing device, a job that cannot fit
    DEVICE = "device"  # the device failed: a CUDA error, ECC, an illegal access
    SCREENER = "screener"  # a bug of ours
    # A job raised inside its run (an IndexError from a corrupted index tensor): the device's
    # wrong arithmetic or our bug; the judgment decides from peers and goldens.
    JOB = "job"


def child_argv(python: str) -> list[str]:
    """The command line of a child run by this Python interpreter."""
    return [python, "-m", CHILD_MODULE, "child"]


def request(device: str, jobs: Sequence[Mapping[str, Any]], *, iterations: Optional[int],
            duration: Optional[float], threads: int, timeout: float,
            faults: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The request a child reads: JobSpec.to_dict()s, DeviceFault.to_dict()s and how long to run
    (`iterations` times, or for `duration` seconds; `timeout` is passed on so the child can
    refuse a job whose estimated time cannot fit in it)."""
    return {"device": device, "jobs": list(jobs), "iterations": iterations,
            "duration": duration, "threads": threads, "timeout": timeout,
            "faults": list(faults)}


def encode(event: Mapping[str, Any]) -> str:
    """One event as the line a child writes (with its newline)."""
    return PREFIX + json.dumps(event) + "\n"


def decode(line: str) -> Optional[dict[str, Any]]:
    """The event of a line a child wrote, or None for a line that is no event (other output,
    or one cut short)."""
    if not line.startswith(PREFIX):
        return None
    try:
        event = json.loads(line[len(PREFIX):])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def error_event(e: BaseException, kind: ErrorKind, job: Optional[str] = None,
                iteration: Optional[int] = None) -> dict[str, Any]:
    """The error event for an exception being handled (its traceback is the current one)."""
    return {"event": Event.ERROR, "job": job, "iteration": iteration, "kind": kind,
            "type": type(e).__name__, "message": str(e)[:2000],
            "traceback": traceback.format_exc()[-4000:]}


def error_kind(e: BaseException, device_error: bool) -> ErrorKind:
    """Whose fault an exception is: bad input, else the device's when `device_error`, else ours."""
    if isinstance(e, BadInputError):
        return ErrorKind.USAGE
    return ErrorKind.DEVICE if device_error else ErrorKind.SCREENER

