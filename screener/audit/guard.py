"""run_guarded: run a training function and turn how it failed into an exit code the scheduler reads.

| failure                                                     | exit code               |
| ----------------------------------------------------------- | ----------------------- |
| SDCAlarm (settled or not)                                   | 75 hardware suspect     |
| CUDA ECC / uncorrectable error (message names it, anywhere  | 75 hardware suspect     |
| in the cause chain, an AuditError's cause included)         |                         |
| NumericFailure, FloatingPointError: non-finite, no suspect  | 76 numeric              |
| AuditUsageError: a setup or argument the Auditor refuses    | 2 usage or bad input    |
| collective timeout, vanished peer (torch DistError family,  | 77 peer failed          |
| or a message: timed out, connection closed/reset, watchdog) |                         |
| AuditError: the auditor itself failed (a replay raised)     | 1 the screener failed   |
| anything else                                               | re-raised (a bug: a person looks) |

Every exception class of screener.audit has its row: what the audit raises ends as one JSON line and
its code, never as a traceback. An AuditError's line names where its cause was raised.

The first failing rank is the evidence and the timeouts of the others are noise, so every failure is
logged first as one JSON line that starts with the rank and hostname.

Two more things happen on the way out, so the verdict reaches whoever acts on it:

- under `screener launch` (SCREENER_EXIT_DIR set), the code is recorded in that directory, one file
  per process, so the launcher exits with 75/77/76 even when torchrun says 1 or the process dies
  in a library's teardown after the verdict (see screener/launch.py);
- a 75 that is not an SDCAlarm (the in-job checks write their own files, about the suspect nodes
  only: a hardware error message such as an uncorrectable ECC error) drops an unsettled alarm file,
  check "hardware_error", about this process's own node into SCREENER_ALARM_DIR, so the DaemonSet
  there makes the node suspect and screens it. The message matching is crude
by nature (it reads what CUDA, NCCL and gloo print); `classify` is public so a job can extend it.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from screener.alarmfile import HARDWARE_ERROR, AlarmRecord, bounded_alarm_id, write_alarm_file
from screener.atomicfile import write_atomic
from screener.audit.alarms import AuditError, AuditUsageError, NumericFailure, SDCAlarm, alarm_dir, \
    log_json
from screener.audit.topology import instance_id_of, job_name, node_name
from screener.types import EXIT_DIR_ENV, ExitCode, SuspectNode

__all__ = ["classify", "run_guarded", "record_exit_code", "hardware_error_alarm", "shutdown"]

log = logging.getLogger("screener.audit")

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
    if isinstance(exc, AuditUsageError):  # our own words, whatever they quote
        return ExitCode.USAGE
    runtime = [e for e in chain if isinstance(e, (RuntimeError, OSError))]
    if any(_ECC.search(str(e)) for e in runtime):
        return ExitCode.HARDWARE_SUSPECT
    if any(isinstance(e, _DIST_ERRORS + (ConnectionError, TimeoutError)) for e in chain):
        return ExitCode.PEER_FAILED
    if any(_PEER.search(str(e)) for e in runtime):
        return ExitCode.PEER_FAILED
    if isinstance(exc, AuditError):  # after the chain: a replay stopped by an ECC error is 75
        return ExitCode.SCREENER_ERROR
    return None


def _where(exc: BaseException) -> Optional[str]:
    """file:line of the innermost frame that raised exc's cause (or exc): the one place a person
    needs when the auditor failed, in place of a traceback."""
    e = exc.__cause__ or exc
    tb = e.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} ({type(e).__name__})"


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


def record_exit_code(code: int, directory: Optional[str] = None) -> Optional[Path]:
    """Record this process's exit code for screener launch (no-op without SCREENER_EXIT_DIR)."""
    d = directory if directory is not None else os.environ.get(EXIT_DIR_ENV, "")
    if not d:
        return None
    path = Path(d) / f"rank{_rank()}-pid{os.getpid()}.code"
    try:
        write_atomic(path, f"{int(code)}\n".encode())
    except OSError as e:  # the verdict still leaves through the exit code
        log.warning("screener.audit: could not record exit code %d in %s: %s", code, d, e)
        return None
    return path


def hardware_error_alarm(exc: BaseException, *, job: str = "", step: int = 0) -> AlarmRecord:
    """The unsettled alarm about this process's own node for a hardware error that ended it."""
    node = node_name()
    host = socket.gethostname()
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{job + '-' if job else ''}hardware_error-r{_rank()}")
    evidence = {"error": type(exc).__name__, "message": str(exc)[:2000], "rank": _rank(),
                "local_rank": os.environ.get("LOCAL_RANK"), "candidate_ranks": [_rank()],
                "why": "the worker failed with a hardware error message (exit 75)"}
    return AlarmRecord(alarm_id=bounded_alarm_id(key, node, unique=uuid.uuid4().hex[:8]),
                       check=HARDWARE_ERROR, step=int(step), settled=False, suspect_ranks=(),
                       suspect_nodes=(SuspectNode(node=node, hostname=host,
                                                  instance_id=instance_id_of(node)),),
                       node=node, job=job, created=time.time(), evidence=evidence)


def run_guarded(main: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run main(*args, **kwargs); return its exit code (0, or the int it returned) or the mapped one.

    Use as `sys.exit(run_guarded(main))`. Failures it does not map are logged and re-raised.
    Records the code for screener launch, and drops a node alarm for a non-SDC 75 (see above).
    """
    try:
        result = main(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - classified below, re-raised when not ours
        code = classify(e)
        fields: dict[str, Any] = {"node": node_name(), "exit_code": int(code) if code else None,
                                  "error": type(e).__name__, "message": str(e)[:2000]}
        if isinstance(e, AuditError) and not isinstance(e, AuditUsageError):
            fields["where"] = _where(e)
        if isinstance(e, SDCAlarm):
            fields.update(check=e.check, step=e.step, settled=e.settled,
                          suspect_ranks=list(e.suspect_ranks),
                          first_suspect_step=e.first_suspect_step)
        if code == ExitCode.HARDWARE_SUSPECT and not isinstance(e, SDCAlarm):
            try:
                fields["alarm_file"] = str(write_alarm_file(hardware_error_alarm(e, job=job_name()),
                                                            alarm_dir()))
            except OSError as err:  # never hides the failure itself
                fields["alarm_file_error"] = f"{type(err).__name__}: {err}"
        log_json(logging.ERROR, "training_failed", rank=_rank(), hostname=socket.gethostname(),
                 **fields)
        if code is None:
            record_exit_code(1)
            raise
        record_exit_code(int(code))
        return int(code)
    rc = int(ExitCode.PASS) if isinstance(result, bool) or not isinstance(result, int) else result
    record_exit_code(rc)
    return rc


def shutdown(code: int) -> int:
    """Tear the job's process group down in the order that lets the process exit cleanly; returns
    code, so a script ends with `sys.exit(shutdown(run_guarded(main)))`.

    Why an order at all: a DDP model, its reducer, the comm hook's futures and the Auditor sit in
    reference cycles that hold the gloo process group alive after destroy_process_group() removed
    it; the cycle is then freed during interpreter finalisation, where gloo's worker threads still
    hold work objects with Python references, and the process dies with SIGABRT ("terminate called
    without an active exception") after a healthy run. So: first collect those cycles (the caller
    has dropped its models and closed its Auditor: train() returned), then destroy the group
    while the interpreter is whole. After 77 (a peer is gone) a destroy can wait forever on work
    that will never complete: the process leaves at once with its code instead (the code is
    already recorded for screener launch, and the logs flushed).
    """
    gc.collect()
    if code == ExitCode.PEER_FAILED:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(int(code))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    return code
