"""The screening window: taint the node, screen it with a time cap, yield to jobs, untaint always.

An idle-time screen must never compete with a job for the GPUs, so the daemon opens a window:

1. taints the node `screener.io/screening=true:NoSchedule`, so the scheduler places no new pods;
2. runs the known-answer screen (the `runner`) while it watches the node: a job that lands anyway
   (a pod bound before the taint, one that tolerates it, a process started outside Kubernetes)
   makes it stop the screen at once; so do the time cap and a shutdown (SIGTERM). A stopped screen
   is inconclusive, never a failure: it says nothing about the hardware;
3. removes the taint, always: after a pass, a failure, an exception in the runner, a shutdown. At
   start-up the daemon also removes a screening taint a previous run left (`clear_stale`).

The production runner (`ScreenProcessRunner`) runs screener.known_answer.engine.screen.run_screen (a
quick screen) or the device stages of a full burn-in (screener.agent.burnin.full: the known-answer
rounds for the configured duration, the HBM test, the intra-node collective) in a worker process of
its own (`python -m screener.agent.screening worker`, whose code is
screener.agent.screening.worker), so stopping it is a kill that takes effect at once, and the daemon
itself never imports torch. Test runners are plain functions of a ScreenRequest.

Restart hygiene: each worker runs in a folder of its own under the runner's `work_dir`, with a
`worker.json` naming its PID and start time, and every process of the screen (the worker and the
per-device children, which run in sessions of their own) carries SCREENER_SCREEN_ID in its
environment. A daemon killed mid-screen (kill -9, the OOM killer) leaves them running under PID 1;
`reap_stale_screens(work_dir)` at the next start ends every process tagged with a recorded screen
(checked against its start time, so a reused PID is never hit) and removes the folders.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

from screener.atomicfile import write_atomic
from screener import boundedjson
from screener.health.sources import host
from screener.known_answer.verdict import node_memory
from screener.lifecycle.events import KIND_FULL, KIND_QUICK
from screener.types import ExitCode, Outcome, ScreenStop, Verdict

# The name the daemon's JSON log lines have always carried (log queries filter on it), not the
# module's path since the move into subpackages.
log = logging.getLogger("screener.screening")


@dataclass(frozen=True)
class ScreenRequest:
    """What a runner gets: which screen, when to give up, and an event that says stop now."""

    node: str
    cancel: threading.Event
    deadline: float  # on the window's clock
    clock: Callable[[], float] = time.time
    kind: str = KIND_QUICK
    # the fleet quorum's view (screener.agent.daemon.fleet) and the runs per job it asks for, or
    # None
    fleet: Optional[Mapping[str, Any]] = None
    repeat: Optional[int] = None

    def cancelled(self) -> bool:
        return self.cancel.is_set() or self.clock() >= self.deadline


@dataclass(frozen=True)
class ScreenOutcome:
    """What became of one idle-time screening window, as the daemon records it: the known-answer
    screen's result as its worker reported it
    (screener.known_answer.verdict.screen_result.ScreenResult, through to_dict), or why the window
    stopped without one, with its timing and the taint.

    outcome/verdicts/exit_code: the known-answer screen's (inconclusive with no verdicts when it
    was stopped). stopped: a ScreenStop (why it was stopped), or "" when it ran to the end. digests: device -> job -> result digest, for publishing and cross-checks.
    platforms: device -> platform signature (with its hash) when the runner reports them.
    kind: what ran (KIND_QUICK, or KIND_FULL for a burn-in's device stages); stages: for a
    burn-in, screener.agent.burnin.full.Stage.to_dict() of every stage that ran.
    """

    outcome: Outcome
    verdicts: tuple[Verdict, ...] = ()
    exit_code: ExitCode = ExitCode.INCONCLUSIVE
    stopped: str = ""
    detail: str = ""
    digests: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    platforms: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    started: float = 0.0
    seconds: float = 0.0
    taint_removed: bool = True
    kind: str = KIND_QUICK
    stages: tuple[Mapping[str, Any], ...] = ()
    # platform hash -> job -> golden record text the screen promotes from a fleet quorum
    promote: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @classmethod
    def inconclusive(cls, stopped: str, detail: str, *, code: ExitCode = ExitCode.INCONCLUSIVE,
                     started: float = 0.0, seconds: float = 0.0) -> "ScreenOutcome":
        return cls(outcome=Outcome.INCONCLUSIVE, exit_code=code, stopped=stopped, detail=detail,
                   started=started, seconds=seconds)

    @classmethod
    def from_screen_dict(cls, d: Mapping[str, Any]) -> "ScreenOutcome":
        """From screener.known_answer.engine.screen.ScreenResult.to_dict()."""
        return cls(outcome=Outcome(d["outcome"]),
                   verdicts=tuple(Verdict.from_dict(v) for v in d.get("verdicts") or ()),
                   exit_code=ExitCode(int(d["exit_code"])),
                   digests={k: dict(v) for k, v in (d.get("digests") or {}).items()},
                   platforms={k: dict(v) for k, v in (d.get("platforms") or {}).items()},
                   seconds=float(d.get("seconds") or 0.0),
                   kind=str(d.get("screen_kind") or KIND_QUICK),
                   stages=tuple(dict(x) for x in d.get("stages") or ()),
                   promote={str(p): {str(j): str(t) for j, t in jobs.items()}
                            for p, jobs in (d.get("promote") or {}).items()})

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "exit_code": int(self.exit_code),
                "stopped": self.stopped, "detail": self.detail,
                "verdicts": [v.to_dict() for v in self.verdicts],
                "digests": {k: dict(v) for k, v in self.digests.items()},
                "started": self.started, "seconds": round(self.seconds, 3),
                "taint_removed": self.taint_removed, "kind": self.kind,
                "stages": [dict(x) for x in self.stages]}


ScreenRunner = Callable[[ScreenRequest], ScreenOutcome]


class TaintControl(Protocol):
    """Adds and removes the screening taint (KubeStore has this method)."""

    def set_screening_taint(self, node: str, on: bool) -> None: ...


class LocalTaint:
    """The screening taint outside a cluster: a marker file, so a crash leaves a visible trace
    that the next start clears, exactly as on a Node."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def _path(self, node: str) -> Path:
        return self.directory / f"screening-taint.{node}"

    def set_screening_taint(self, node: str, on: bool) -> None:
        if on:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(self._path(node), f"{time.time()}\n", public=True)
        else:
            try:
                self._path(node).unlink()
            except FileNotFoundError:
                pass

    def present(self, node: str) -> bool:
        return self._path(node).exists()


JobCheck = Callable[[], Optional[str]]  # a description of a job that landed, or None


class ScreeningWindow:
    """Opens one screening window at a time on `node` (see the module docstring).

    job_check(): called every `poll_s` during the screen; returns a description of a job that
        landed on the node, or None. An exception from it is logged and counts as "no job".
        `run` may be given another for one screen (the daemon's reports into that pass).
    stop: set on shutdown (SIGTERM); the screen is stopped and the taint removed.
    heartbeat(): called on every poll, so the liveness probe sees the daemon alive mid-screen.
    """

    def __init__(self, node: str, taint: TaintControl, runner: ScreenRunner,
                 job_check: JobCheck = lambda: None, *, time_cap_s: float, poll_s: float = 2.0, clock: Callable[[], float] = time.time,
                 stop: Optional[threading.Event] = None,
                 heartbeat: Callable[[], None] = lambda: None,
                 untaint_attempts: int = 5, untaint_delay_s: float = 1.0,
                 cancel_grace_s: float = 60.0) -> None:
        self.node = node
        self.taint = taint
        self.runner = runner
        self.job_check = job_check
        self.time_cap_s = float(time_cap_s)
        self.poll_s = float(poll_s)
        self.clock = clock
        self.stop = stop or threading.Event()
        self.heartbeat = heartbeat
        self.untaint_attempts = untaint_attempts
        self.untaint_delay_s = untaint_delay_s
        self.cancel_grace_s = cancel_grace_s
        self.taint_dirty = False  # the taint could not be removed; the daemon retries
        self.active = False

    def clear_stale(self) -> bool:
        """Remove a screening taint left by an earlier run (start-up, or after a failed removal).

        Returns True when the node is known to be untainted now."""
        ok = self._untaint()
        if ok:
            log.info("screening taint cleared on %s (start-up / retry)", self.node)
        return ok

    def _untaint(self) -> bool:
        for attempt in range(self.untaint_attempts):
            try:
                self.taint.set_screening_taint(self.node, False)
                self.taint_dirty = False
                return True
            except Exception as e:  # noqa: BLE001 - keep trying; never leave the node tainted
                log.warning("removing the screening taint from %s failed (attempt %d): %s",
                            self.node, attempt + 1, e)
                if attempt + 1 < self.untaint_attempts:
                    # A plain sleep, not the stop event: a shutdown must not skip these retries.
                    time.sleep(self.untaint_delay_s)
        self.taint_dirty = True
        log.error("screening taint left on %s after %d attempts; will retry", self.node,
                  self.untaint_attempts)
        return False

    def run(self, kind: str = KIND_QUICK, time_cap_s: Optional[float] = None,
            job_check: Optional[JobCheck] = None, *, fleet: Optional[Mapping[str, Any]] = None,
            repeat: Optional[int] = None) -> ScreenOutcome:
        """Taint, screen (`kind`, capped at `time_cap_s`, default the window's; watching for jobs
        with `job_check`, default the window's), untaint. fleet/repeat: for the runner
        (ScreenRequest). Never raises for a runner failure (that is an outcome)."""
        started = self.clock()
        try:
            self.taint.set_screening_taint(self.node, True)
        except Exception as e:  # noqa: BLE001
            log.error("cannot taint %s for a screen: %s", self.node, e)
            # The taint call may have gone through before the error: make sure it is gone.
            self._untaint()
            return ScreenOutcome.inconclusive(ScreenStop.TAINT_FAILED, f"cannot taint the node: {e}",
                                              code=ExitCode.SCREENER_ERROR, started=started)
        self.active = True
        try:
            outcome = self._screen(started, kind,
                                   self.time_cap_s if time_cap_s is None else float(time_cap_s),
                                   job_check or self.job_check, fleet, repeat)
        finally:
            removed = self._untaint()
            self.active = False
        seconds = self.clock() - started
        return _with(outcome, started=started, seconds=seconds, taint_removed=removed)

    def _screen(self, started: float, kind: str, time_cap_s: float, job_check: JobCheck,
                fleet: Optional[Mapping[str, Any]] = None,
                repeat: Optional[int] = None) -> ScreenOutcome:
        cancel = threading.Event()
        request = ScreenRequest(node=self.node, cancel=cancel, deadline=started + time_cap_s,
                                clock=self.clock, kind=kind, fleet=fleet, repeat=repeat)
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["outcome"] = self.runner(request)
            except BaseException as e:  # noqa: BLE001 - reported as an outcome below
                box["error"] = e

        worker = threading.Thread(target=work, name="screen", daemon=True)
        worker.start()
        stopped, detail = "", ""
        while worker.is_alive():
            worker.join(self.poll_s)
            self.heartbeat()
            if not worker.is_alive():
                break
            if self.stop.is_set():
                stopped, detail = ScreenStop.SHUTDOWN, "the daemon is shutting down"
            elif self.clock() - started >= time_cap_s:
                stopped, detail = ScreenStop.TIME_CAP, f"the screen ran past its time cap of {time_cap_s:g} s"
            else:
                try:
                    job = job_check()
                except Exception as e:  # noqa: BLE001 - a failed look is not a job
                    log.warning("looking for jobs on %s failed: %s", self.node, e)
                    job = None
                if job:
                    stopped, detail = ScreenStop.YIELDED, f"a job landed on the node: {job}"
            if stopped:
                log.info("stopping the screen on %s: %s", self.node, detail)
                cancel.set()
                worker.join(self.cancel_grace_s)
                if worker.is_alive():
                    log.error("the screen runner did not stop within %g s", self.cancel_grace_s)
                return ScreenOutcome.inconclusive(stopped, detail)
        if "error" in box:
            err = box["error"]
            log.error("the screen failed: %s: %s", type(err).__name__, err)
            code = getattr(err, "exit_code", ExitCode.SCREENER_ERROR)
            return ScreenOutcome.inconclusive(ScreenStop.ERROR, f"{type(err).__name__}: {err}",
                                              code=ExitCode(code))
        return box["outcome"]


def _with(o: ScreenOutcome, **changes: Any) -> ScreenOutcome:
    return replace(o, **changes)


# --- the production runner: screener.known_answer.engine.screen in a worker process ------------------------------------

SCREEN_ID_ENV = "SCREENER_SCREEN_ID"  # tags every process of one screen (see reap_stale_screens)
WORKER_RECORD = "worker.json"
KNOWN_DIGESTS = "known-digests.json"  # in work_dir: what this node's earlier screens produced


@dataclass(frozen=True)
class ScreenOptions:
    """What the worker passes to screener.known_answer.engine.screen.run_screen, and to the burn-in stages for a full one.

    burnin_seconds / burnin_min_iterations: how long and how often the known-answer jobs repeat in
    a full burn-in; hbm_fraction / hbm_max_bytes: the HBM pattern test's size.
    """

    jobs: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    golden_dir: Optional[str] = None
    jobs_dir: Optional[str] = None
    repeat: int = 1
    job_timeout_s: float = 300.0
    faults: Mapping[str, Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    burnin_seconds: float = 3600.0
    burnin_min_iterations: int = 2
    hbm_fraction: float = 0.5
    hbm_max_bytes: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return {"jobs": list(self.jobs), "devices": list(self.devices),
                "golden_dir": self.golden_dir, "jobs_dir": self.jobs_dir, "repeat": self.repeat,
                "job_timeout_s": self.job_timeout_s,
                "faults": {k: [dict(f) for f in v] for k, v in self.faults.items()},
                "burnin_seconds": self.burnin_seconds,
                "burnin_min_iterations": self.burnin_min_iterations,
                "hbm_fraction": self.hbm_fraction, "hbm_max_bytes": self.hbm_max_bytes}


class ScreenProcessRunner:
    """Runs a screen in `python -m screener.agent.screening worker`, killable at once.

    work_dir: where each screen gets its folder (result, stderr, worker.json); default a fresh
    temporary folder per screen (no restart hygiene). The daemon passes one under its state
    directory so that `reap_stale_screens` can clean up after a crash.
    """

    def __init__(self, options: ScreenOptions, *, python: Optional[str] = None,
                 poll_s: float = 0.2, kill_grace_s: float = 10.0,
                 work_dir: Optional[str | os.PathLike[str]] = None) -> None:
        self.options = options
        self.python = python or sys.executable
        self.poll_s = poll_s
        self.kill_grace_s = kill_grace_s
        self.work_dir = Path(work_dir) if work_dir is not None else None

    def __call__(self, request: ScreenRequest) -> ScreenOutcome:
        screen_id = f"{int(time.time())}-{uuid.uuid4().hex[:12]}"
        if self.work_dir is not None:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.work_dir / f"screen-{screen_id}"
            tmp.mkdir()
        else:
            tmp = Path(tempfile.mkdtemp(prefix="screener-screen-"))
        try:
            return self._run(request, tmp, screen_id)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _run(self, request: ScreenRequest, tmp: Path, screen_id: str) -> ScreenOutcome:
        out = tmp / "result.json"
        env = {**os.environ, SCREEN_ID_ENV: screen_id}
        mode = "burnin" if request.kind == KIND_FULL else "screen"
        with open(tmp / "stderr", "w+b") as err:
            proc = subprocess.Popen([self.python, "-m", "screener.agent.screening", "worker", str(out),
                                     mode], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=err, start_new_session=True, env=env)
            # Recorded before anything else can happen, so a crash of ours from here on is
            # cleaned up by the next start (reap_stale_screens).
            worker = host.find_process(proc.pid)
            record = {"id": screen_id, "pid": proc.pid,
                      "create_time": worker.create_time if worker is not None else None,
                      "started": time.time(), "node": request.node, "kind": request.kind}
            write_atomic(tmp / WORKER_RECORD, json.dumps(record))
            try:
                assert proc.stdin is not None
                opts = {**self.options.to_dict(), "known": self._known()}
                if request.fleet is not None:
                    opts["fleet"] = dict(request.fleet)
                if request.repeat is not None:
                    opts["repeat"] = max(int(opts.get("repeat") or 1), request.repeat)
                proc.stdin.write(json.dumps(opts).encode())
                proc.stdin.close()
                while proc.poll() is None:
                    if request.cancelled():
                        self._stop(proc)
                        return ScreenOutcome.inconclusive(
                            ScreenStop.SHUTDOWN if request.cancel.is_set() else ScreenStop.TIME_CAP,
                            "screen stopped")
                    request.cancel.wait(self.poll_s)
            finally:
                if proc.poll() is None:
                    self._stop(proc)
                err.seek(0)
                tail = err.read()[-2000:].decode(errors="replace")
        if proc.returncode in (0, int(ExitCode.INCONCLUSIVE), int(ExitCode.HARDWARE_SUSPECT)) \
                and out.exists():
            data = json.loads(out.read_text())
            self._remember(data)
            return ScreenOutcome.from_screen_dict(data)
        code = proc.returncode if proc.returncode in (1, 2) else 1
        return ScreenOutcome.inconclusive(ScreenStop.ERROR, f"screen worker exited {proc.returncode}: "
                                          f"{tail.strip()[-500:]}", code=ExitCode(code))

    def _known(self) -> dict[str, Any]:
        """What this node's earlier screens produced (see _remember); {} without a work_dir."""
        if self.work_dir is None:
            return {}
        try:
            data = boundedjson.strict((self.work_dir / KNOWN_DIGESTS).read_text())
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: the screen judges without it
        return data if isinstance(data, dict) else {}

    def _remember(self, screen: Mapping[str, Any]) -> None:
        """Keep the digests of the devices that reproduced themselves with nothing against the
        job (screener.known_answer.verdict.node_memory.remember): when a later screen finds a
        device's repeats disagreeing with no golden or majority, these show the job deterministic on
        the platform, and the device (not the job) is suspect. A different result never
        replaces a kept one: the conflict is logged (and the screen's verdict says it).
        Written atomically; best effort."""
        if self.work_dir is None:
            return
        known, conflicts = node_memory.remember(self._known(), screen)
        for line in conflicts:
            log.warning("known-answer digests: %s", line)
        try:
            write_atomic(self.work_dir / KNOWN_DIGESTS, json.dumps(known, sort_keys=True))
        except OSError as e:
            log.warning("could not keep the known-answer digests in %s: %s", self.work_dir, e)

    def _stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM the worker (its handler kills the per-device children), then make sure."""
        family = host.descendants(proc.pid)  # looked up first: they outlive a killed worker
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(self.kill_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        host.kill(family)  # the per-device children run in sessions of their own


@dataclass(frozen=True)
class Reaped:
    """What reap_stale_screens cleaned up after an earlier daemon."""

    killed: tuple[int, ...] = ()
    folders: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"killed": list(self.killed), "folders": list(self.folders)}


def reap_stale_screens(work_dir: str | os.PathLike[str], *, grace_s: float = 5.0) -> Reaped:
    """End the screen processes an earlier daemon left behind and remove their folders.

    Each `screen-*` folder under work_dir belongs to a screen that did not finish cleanly (a
    finished one removes its folder). Its processes are found by the SCREENER_SCREEN_ID tag in
    their environment (the worker and its per-device children, whatever their parent now is) and
    by the recorded worker PID when its start time still matches (never a reused PID). Each gets
    SIGKILL: a screen whose daemon is gone has nobody to report to. Call it only at start-up,
    before this daemon starts a screen of its own.
    """
    root = Path(work_dir)
    if not root.is_dir():
        return Reaped()
    folders = [d for d in sorted(root.glob("screen-*")) if d.is_dir()]
    if not folders:
        return Reaped()
    records = {str(rec.get("id") or d.name[len("screen-"):]): rec
               for d, rec in ((d, _worker_record(d)) for d in folders)}
    victims = {p.pid: p for p in _recorded_workers(records.values())}
    for p in host.tagged_processes(SCREEN_ID_ENV, records):
        victims.setdefault(p.pid, p)
    for p in list(victims.values()):
        for child in host.descendants(p.pid):
            victims.setdefault(child.pid, child)
    host.kill(victims.values(), wait_s=grace_s)
    for d in folders:
        shutil.rmtree(d, ignore_errors=True)
    if victims:
        log.warning("ended %d screen process(es) left by an earlier daemon: %s", len(victims),
                    ", ".join(str(p) for p in sorted(victims)))
    return Reaped(killed=tuple(sorted(victims)), folders=tuple(str(d) for d in folders))


def _worker_record(folder: Path) -> Mapping[str, Any]:
    """A screen folder's worker.json, or {} when the worker crashed before writing it (the
    environment tag still finds its processes: the folder's name carries the screen id)."""
    try:
        rec = json.loads((folder / WORKER_RECORD).read_text())
        return rec if isinstance(rec, dict) and "id" in rec else {}
    except (OSError, ValueError):
        return {}


def _recorded_workers(records: Iterable[Mapping[str, Any]]) -> list[host.Proc]:
    """The recorded worker processes still running: same PID and the same start time."""
    me = os.getpid()
    found = []
    for rec in records:
        pid, created = rec.get("pid"), rec.get("create_time")
        if isinstance(pid, int) and pid != me and isinstance(created, (int, float)):
            proc = host.find_process(pid, float(created))
            if proc is not None:
                found.append(proc)
    return found

