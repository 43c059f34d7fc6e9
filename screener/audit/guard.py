"""run_guarded: run a training function and turn how it failed into an exit code the scheduler reads.

| failure                                                     | exit code               |
| ----------------------------------------------------------- | ----------------------- |
| SDCAlarm (settled or not)                                   | 75 hardware suspect     |
| CUDA ECC / uncorrectable error (message names it)           | 75 hardware suspect     |
| NumericFailure, FloatingPointError: non-finite, no suspect  | 76 numeric              |
| collective timeout, vanished peer (torch DistError family,  | 77 peer failed          |
| or a message: timed out, connection closed/reset, watchdog) |                         |
| anything else                                               | re-raised (a bug: a person looks) |

The first failing rank is the evidence and the timeouts of the others are noise, so every failure is
logged first as one JSON line that starts with the rank and hostname. The message matching is crude
by nature (it reads what CUDA, NCCL and gloo print); `classify` is public so a job can extend it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import Any, Callable, Optional

import torch.distributed as dist

from screener.audit.alarms import NumericFailure, SDCAlarm, log_json
from screener.audit.topology import node_name
from screener.types import ExitCode

__all__ = ["classify", "run_guarded"]

_ECC = re.compile(r"\becc\b|uncorrectable", re.IGNORECASE)
_PEER = re.compile(
    r"timed out|timeout|connection (?:closed|reset|refused)|broken pipe|watchdog|"
    r"communicator was aborted|ncclremoteerror|remote process exited|peer (?:closed|hung up)|"
    r"socket closed|eof while reading",
    re.IGNORECASE)
_DIST_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(dist, n) for n in ("DistBackendError", "DistNetworkError", "DistStoreError")
    if hasattr(dist, n))


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def classify(exc: BaseException) -> Optional[ExitCode]:
    """The exit code for a training failure, or None when it is not ours to map (re-raise)."""
    chain = _chain(exc)
    if isinstance(exc, SDCAlarm):
        return ExitCode.HARDWARE_SUSPECT
    if isinstance(exc, (NumericFailure, FloatingPointError)):
        return ExitCode.NUMERIC
    runtime = [e for e in chain if isinstance(e, (RuntimeError, OSError))]
    if any(_ECC.search(str(e)) for e in runtime):
        return ExitCode.HARDWARE_SUSPECT
    if any(isinstance(e, _DIST_ERRORS + (ConnectionError, TimeoutError)) for e in chain):
        return ExitCode.PEER_FAILED
    if any(_PEER.search(str(e)) for e in runtime):
        return ExitCode.PEER_FAILED
    return None


def _rank() -> int:
    try:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (RuntimeError, ValueError):
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def run_guarded(main: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run main(*args, **kwargs); return its exit code (0, or the int it returned) or the mapped one.

    Use as `sys.exit(run_guarded(main))`. Failures it does not map are logged and re-raised.
    """
    try:
        result = main(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - classified below, re-raised when not ours
        code = classify(e)
        fields: dict[str, Any] = {"node": node_name(), "exit_code": int(code) if code else None,
                                  "error": type(e).__name__, "message": str(e)[:2000]}
        if isinstance(e, SDCAlarm):
            fields.update(check=e.check, step=e.step, settled=e.settled,
                          suspect_ranks=list(e.suspect_ranks),
                          first_suspect_step=e.first_suspect_step)
        log_json(logging.ERROR, "training_failed", rank=_rank(), hostname=socket.gethostname(),
                 **fields)
        if code is None:
            raise
        return int(code)
    if isinstance(result, bool) or not isinstance(result, int):
        return int(ExitCode.PASS)
    return result
