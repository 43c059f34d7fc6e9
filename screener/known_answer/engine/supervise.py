"""Process supervision of a screen: one child process per device, watched for progress.

`execute` starts a screener.known_answer.engine.child per device, all at once, feeds each its request,
reads their events (screener.known_answer.engine.protocol) into DeviceRuns and decides how each ended.
How a child ends decides what it says about the device:
- CRASH: it died of a signal other than SIGKILL, or exited without finishing;
- KILLED: SIGKILL (or exit 137) from someone else, above all the kernel's OOM killer (the
  cgroup's memory.events oom_kill count is read before and after);
- TIMEOUT: no event within the timeout (killed here, with its whole process group);
- DEVICE_ERROR / BAD_INPUT / SCREENER_ERROR / JOB_ERROR: the child's own error event said whose
  fault (JOB_ERROR: a job raised, and only the judgment can tell the device's from ours).
What each means for the verdict is screener.known_answer.verdict.judgment's business.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.errors import BadInputError
from screener.known_answer.engine import protocol
from screener.known_answer.engine.fault_spec import DeviceFault
from screener.known_answer.engine.memory import oom_kills
from screener.known_answer.engine.protocol import ErrorKind, Event
from screener.known_answer.verdict.results import JobResult
from screener.known_answer.verdict.runs import DeviceRun
from screener.known_answer.engine.specs import JobSpec
from screener.types import RunStatus

log = logging.getLogger("screener.known_answer")

DEFAULT_TIMEOUT = 300.0
STARTUP_TIMEOUT = 120.0  # importing torch and creating a CUDA context can be slow on a busy node
FINISH_WAIT = 30.0  # seconds a child that sent its last event gets to exit before it is killed
POLL = 0.25  # seconds between timeout checks while no event arrives

Progress = Callable[[Mapping[str, Any]], None]

_STATUS_OF_ERROR: dict[str, RunStatus] = {ErrorKind.DEVICE: RunStatus.DEVICE_ERROR, ErrorKind.USAGE: RunStatus.BAD_INPUT,
                    ErrorKind.JOB: RunStatus.JOB_ERROR}


class _Child:
    """One running child: its process, its DeviceRun, and when it last said something."""

    def __init__(self, device: str, request: Mapping[str, Any], events: "queue.Queue[Any]",
                 python: str) -> None:
        self.device = device
        self.run = DeviceRun(device)
        self.stderr = tempfile.TemporaryFile(mode="w+b")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(request.get("threads", protocol.DEFAULT_THREADS)))
        env["PYTHONUNBUFFERED"] = "1"
        self.started = time.monotonic()
        self.last = self.started
        self.oom_before = oom_kills()
        # A session of its own, so that a timeout kills the child's helpers with it.
        self.proc = subprocess.Popen(protocol.child_argv(python), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=env,
                                     start_new_session=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode())
        self.proc.stdin.close()
        self.done = False
        self.reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self.reader.start()

    def _read(self, events: "queue.Queue[Any]") -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            event = protocol.decode(raw.decode(errors="replace").rstrip("\n"))
            if event is not None:
                events.put((self, event))
        events.put((self, None))  # end of stream

    def where(self, otherwise: str) -> str:
        """' in job J iteration I' for the job under way, else `otherwise`."""
        cur = self.run.current
        return f" in job {cur[0]} iteration {cur[1]}" if cur else otherwise

    def kill(self) -> None:
        """SIGKILL the child's whole process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()

    def finish(self) -> None:
        """Reap the child and keep the tail of its stderr."""
        try:
            self.proc.wait(timeout=FINISH_WAIT)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.stderr.seek(0)
        self.run.stderr_tail = self.stderr.read()[-3000:].decode(errors="replace")
        self.stderr.close()
        self.run.seconds = time.monotonic() - self.started


def _check_arguments(devices: Sequence[str], timeout: float) -> None:
    if not devices:
        raise BadInputError("no devices to screen")
    if len(set(devices)) != len(devices):
        raise BadInputError(f"devices listed twice: {', '.join(devices)}")
    if timeout <= 0:
        raise BadInputError(f"timeout {timeout} must be positive")


def _time_out(child: _Child, timeout: float, startup: float) -> bool:
    """Kill a child that said nothing for too long (the start-up limit until its platform
    event); True when it was killed."""
    limit = timeout if child.run.platform_hash else startup
    if time.monotonic() - child.last <= limit:
        return False
    child.run.status = RunStatus.TIMEOUT
    child.run.timeout_s = limit
    child.run.detail = f"no progress for {timeout:g} s{child.where(' during startup')}; killed"
    child.kill()
    return True


def _ended(child: _Child) -> None:
    """The child's stdout closed: say how it ended unless it finished or already told why."""
    child.proc.wait()
    if child.done or child.run.status != RunStatus.OK:
        return
    rc = child.proc.returncode
    how = f"killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
    child.run.status = RunStatus.CRASH
    if rc in (-signal.SIGKILL, 137):
        # Not the device: someone killed the child, most often the OOM killer.
        child.run.status = RunStatus.KILLED
        after = oom_kills()
        if child.oom_before is not None and after is not None and after > child.oom_before:
            how += f" by the OOM killer (cgroup oom_kill {child.oom_before} -> {after})"
    child.run.detail = f"child {how}{child.where(' before its first job')}"


def _handle(child: _Child, event: Mapping[str, Any]) -> None:
    """Fold one child event into its DeviceRun."""
    run = child.run
    kind = event.get("event")
    if kind == Event.PLATFORM:
        run.platform = event["platform"]
        run.platform_hash = event["platform_hash"]
    elif kind == Event.START:
        run.current = (event["job"], int(event["iteration"]))
    elif kind == Event.RESULT:
        run.add(int(event["iteration"]), JobResult.from_dict(event["result"]),
                event.get("fired") or ())
        run.iterations = max(run.iterations, int(event["iteration"]) + 1)
    elif kind == Event.ERROR:
        where = (f"job {event.get('job')} iteration {event.get('iteration')}"
                 if event.get("job") else "start-up")
        detail = f"{where}: {event.get('type')}: {event.get('message')}"
        for rec in event.get("fired") or ():
            if isinstance(rec, dict) and isinstance(rec.get("fault"), int):
                run.faults_fired.add(rec["fault"])
        if event.get("continues") is True and event.get("kind") == ErrorKind.JOB \
                and event.get("job"):
            # The job raised in this run and the child goes on to run it again: evidence for
            # the judgment, not how the child ended.
            run.add_raised(str(event["job"]), int(event.get("iteration") or 0), detail,
                           str(event.get("traceback", "")))
            run.iterations = max(run.iterations, int(event.get("iteration") or 0) + 1)
            run.current = None
            return
        run.status = _STATUS_OF_ERROR.get(str(event.get("kind")), RunStatus.SCREENER_ERROR)
        run.detail = detail
        run.stderr_tail = str(event.get("traceback", ""))
    elif kind == Event.DONE:
        child.done = True
        run.current = None


def _watch(children: Sequence[_Child], events: "queue.Queue[Any]", timeout: float,
           startup: float, progress: Optional[Progress]) -> None:
    """Read events until every child has ended or been killed for making no progress."""
    live = set(children)
    while live:
        for child in [c for c in live if _time_out(c, timeout, startup)]:
            live.discard(child)
            if progress:
                progress({"event": Event.TIMEOUT, "device": child.device})
        try:
            child, event = events.get(timeout=POLL)
        except queue.Empty:
            continue
        if child not in live:
            continue
        child.last = time.monotonic()
        if event is None:
            live.discard(child)
            _ended(child)
            continue
        _handle(child, event)
        if progress:
            progress({**event, "device": child.device})


def execute(specs: Sequence[JobSpec], devices: Sequence[str], *, iterations: Optional[int] = 1,
            duration: Optional[float] = None, timeout: float = DEFAULT_TIMEOUT,
            faults: Optional[Mapping[str, Sequence[DeviceFault]]] = None,
            progress: Optional[Progress] = None, threads: int = protocol.DEFAULT_THREADS,
            python: Optional[str] = None,
            startup_timeout: Optional[float] = None) -> dict[str, DeviceRun]:
    """Run every job on every device, one child process per device, all devices at once.

    Jobs run `iterations` times (or, with `duration`, repeatedly until that many seconds have
    passed, finishing the iteration under way). A child that emits nothing for `timeout` seconds
    is killed and reported with status TIMEOUT; one that dies is CRASH. Until its first
    event (importing torch, creating the CUDA context) a child gets `startup_timeout` seconds
    (default: the larger of timeout and STARTUP_TIMEOUT).
    `faults` maps a device to the faults its child applies. `progress` gets each child event
    with its "device" added.
    """
    _check_arguments(devices, timeout)
    startup = startup_timeout if startup_timeout is not None else max(timeout, STARTUP_TIMEOUT)
    events: "queue.Queue[Any]" = queue.Queue()
    children = []
    try:
        for device in devices:
            request = protocol.request(
                device, [s.to_dict() for s in specs], iterations=iterations, duration=duration,
                threads=threads, timeout=timeout,
                faults=[f.to_dict() for f in (faults or {}).get(device, ())])
            children.append(_Child(device, request, events, python or sys.executable))
            children[-1].run.faults = list(request["faults"])
            log.debug("child for %s: pid %d, %d job(s), iterations %s, duration %s, timeout %g s",
                      device, children[-1].proc.pid, len(specs), iterations, duration, timeout)
        _watch(children, events, timeout, startup, progress)
    finally:
        for child in children:
            if child.proc.poll() is None:  # timed out, or we are unwinding an exception
                child.kill()
            child.finish()
    for c in children:
        log.debug("child for %s ended: %s%s after %.1f s", c.device, c.run.status,
                  f" ({c.run.detail})" if c.run.detail else "", c.run.seconds)
    return {c.device: c.run for c in children}
