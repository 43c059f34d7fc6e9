"""Known-answer screening: run jobs on each device in a child process, compare bits, give Verdicts.

Each device's jobs run in a child process of their own (`python -m screener.known_answer.kat child`), so a
device that hangs or crashes is reported and cannot take the screener down, and every child sets
determinism before CUDA is first touched. Before a job allocates anything its child compares the
job's estimated memory and arithmetic with the device (workloads.check_fits): a job that cannot
fit is bad input (exit 2), not a crash or a timeout.

How a child ends decides what it says about the device, and only evidence about the device makes
it suspect:
- "crash" (suspect): it died of a signal other than SIGKILL, or exited without finishing;
- "killed" (inconclusive): SIGKILL (or exit 137) from someone else, above all the kernel's OOM
  killer (the cgroup's memory.events oom_kill count is read before and after): memory pressure
  on the node says nothing about the GPU's arithmetic;
- "timeout" (no progress within the timeout): suspect only when the same job finished on a peer
  device of the same platform in this run, or when the job's golden records how long it takes
  and the timeout is at least HANG_FACTOR times that; otherwise inconclusive, since a slow job
  and a hung device look the same. A child streams its
results as JSON lines; the parent compares, for each device and job:

(a) with the golden record for the device's platform signature (screener.known_answer.golden); without one,
    with the goldens of sibling platforms (same torch build and dispatch level, or GPU model:
    screener.known_answer.platform.sibling_key): equal bits pass (the verdict names the golden), different
    bits are inconclusive with the record command, never suspect;
(b) with the other devices of the same platform in this run: a device that differs from a strict
    majority is suspect even without a golden;
(c) across repeats on the device itself: a device that disagrees with itself is suspect.

A job that disagrees with itself on every device is a screener bug (NondeterminismError, exit 1,
with the evidence). With no golden and fewer than three agreeing devices the verdict is
inconclusive (exit 3) and names the command that records a golden. In every verdict `expected`
is the golden's (or the majority's) value and `observed` the device's, also when the device went
wrong in its first repeat. A broken golden file is bad
input (GoldenError, exit 2), never a verdict.

`run_screen` is the plain function the CLI, the burn-in and the daemon call; `execute` (run the
children) and `judge` (pure comparison) are its two halves.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from screener.errors import BadInputError, NondeterminismError, ScreenerError
from screener.types import ExitCode, Outcome, Verdict
from screener.known_answer.workloads import (Difference, JobResult, JobSpec, first_difference, select_jobs)

PROTOCOL_PREFIX = "@@screener "
DEFAULT_TIMEOUT = 300.0
STARTUP_TIMEOUT = 120.0  # importing torch and creating a CUDA context can be slow on a busy node
DEFAULT_THREADS = 1
MIN_PEERS = 3  # agreeing devices needed to pass without a golden
HANG_FACTOR = 10.0  # a timeout this many times the golden's recorded job time is a hang

Progress = Callable[[Mapping[str, Any]], None]


# --- faults a child applies (drills and tests) ---------------------------------------------------

_FAULT_MODES = ("flip", "scale", "nan", "inf", "set")  # = screener.known_answer.faults.MODES

@dataclass(frozen=True)
class DeviceFault:
    """A fault for one device's child: an op fault (FaultSpec fields) or a parameter flip.

    job / iteration restrict it to one job and one iteration (None: every one). An op fault uses
    op, call, element, bit, mode, factor, value, output; a parameter fault (train jobs) sets
    `parameter`, `step`, `element` and `bit`: the bit is flipped after that optimizer step.
    """

    op: Optional[str] = None
    call: int = 0
    element: int = 0
    bit: Optional[int] = None
    mode: str = "flip"
    factor: float = 1e4
    value: float = 0.0
    output: int = 0
    parameter: Optional[str] = None
    step: int = 0
    job: Optional[str] = None
    iteration: Optional[int] = None

    def __post_init__(self) -> None:
        # Checked here without importing torch (screener.known_answer.faults does), so the parent process of
        # a screen stays light; the child builds the FaultSpec, which checks again.
        if (self.op is None) == (self.parameter is None):
            raise BadInputError("a fault needs exactly one of op= and parameter=")
        if self.mode not in _FAULT_MODES:
            raise BadInputError(f"fault mode {self.mode!r} is not one of {', '.join(_FAULT_MODES)}")
        if min(self.call, self.element, self.output, self.step) < 0 or (
                self.bit is not None and self.bit < 0):
            raise BadInputError("fault call, element, bit, output and step must be >= 0")

    def fault_spec(self) -> Any:
        from screener.known_answer.faults import FaultSpec

        try:
            return FaultSpec(op=str(self.op), call=self.call, element=self.element, bit=self.bit,
                             mode=self.mode, factor=self.factor, value=self.value,
                             output=self.output)
        except ValueError as e:
            raise BadInputError(f"fault {self}: {e}") from None

    def applies(self, job: str, iteration: int) -> bool:
        return (self.job is None or self.job == job) and (self.iteration is None
                                                          or self.iteration == iteration)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_fault(text: str) -> tuple[Optional[str], DeviceFault]:
    """Parse `key=value,...` (device, op, call, element, bit, mode, factor, value, output,
    parameter, step, job, iteration) into (device or None for every device, DeviceFault)."""
    kv: dict[str, Any] = {}
    device = None
    for part in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise BadInputError(f"fault {text!r}: {part!r} is not key=value")
        key = key.strip()
        value = value.strip()
        if key == "device":
            device = value
            continue
        if key in ("call", "element", "bit", "output", "step", "iteration"):
            try:
                kv[key] = int(value)
            except ValueError:
                raise BadInputError(f"fault {text!r}: {key} must be an integer") from None
        elif key in ("factor", "value"):
            try:
                kv[key] = float(value)
            except ValueError:
                raise BadInputError(f"fault {text!r}: {key} must be a number") from None
        elif key in ("op", "mode", "parameter", "job"):
            kv[key] = value
        else:
            raise BadInputError(f"fault {text!r}: unknown key {key!r}")
    return device, DeviceFault(**kv)


# --- the child process ---------------------------------------------------------------------------

def _emit(event: Mapping[str, Any]) -> None:
    sys.stdout.write(PROTOCOL_PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def _is_device_error(e: BaseException) -> bool:
    """A failure of the device (CUDA error, ECC, illegal access), as opposed to one of ours.

    Running out of memory is not: another process holding the GPU's memory says nothing about
    the hardware, so it must not become a suspect verdict."""
    import torch

    text = str(e)
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text:
        return False
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert",
                            "uncorrectable ECC", "illegal memory access", "unspecified launch"))


def _free_bytes(device: str) -> Optional[float]:
    """Memory a job on this device may use: CUDA's free memory, or on the CPU the smaller of
    MemAvailable and what the cgroup limit leaves; None when it cannot be read."""
    if device.startswith("cuda"):
        import torch

        return float(torch.cuda.mem_get_info(torch.device(device))[0])
    free: Optional[float] = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cg = _cgroup_dir()
    if cg is not None:
        try:
            with open(os.path.join(cg, "memory.max"), encoding="ascii") as f:
                limit = f.read().strip()
            with open(os.path.join(cg, "memory.current"), encoding="ascii") as f:
                used = float(f.read().strip())
            if limit != "max":
                left = float(limit) - used
                free = left if free is None else min(free, left)
        except (OSError, ValueError):
            pass
    return free


def _cgroup_dir() -> Optional[str]:
    """This process's cgroup v2 folder, or None (cgroup v1, or not mounted)."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            for line in f:
                if line.startswith("0::"):
                    d = "/sys/fs/cgroup" + line[3:].strip()
                    return d if os.path.isdir(d) else None
    except OSError:
        pass
    return None


def oom_kills() -> Optional[int]:
    """The oom_kill count of our cgroup's memory.events (None when it cannot be read)."""
    cg = _cgroup_dir()
    if cg is None:
        return None
    try:
        with open(os.path.join(cg, "memory.events"), encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def child_main(request: Mapping[str, Any]) -> int:
    """Run the requested jobs on one device and stream events (see _emit) to stdout."""
    import torch  # noqa: F401  (import time is part of startup, before the first event)

    from screener.determinism import make_deterministic
    from screener.known_answer.faults import corrupt_parameter, inject
    from screener.known_answer.platform import signature
    from screener.known_answer.workloads import check_fits, gemm_shapes, run_job

    device = request["device"]
    threads = int(request.get("threads", DEFAULT_THREADS))
    try:
        make_deterministic(device, threads=threads)
        plat = signature(device)
    except Exception as e:  # noqa: BLE001 - a missing device is bad input, a failing one a verdict
        kind = ("usage" if isinstance(e, BadInputError) else
                "device" if _is_device_error(e) else "screener")
        _emit({"event": "error", "job": None, "iteration": None, "kind": kind,
               "type": type(e).__name__, "message": str(e)[:2000],
               "traceback": traceback.format_exc()[-4000:]})
        return 0
    _emit({"event": "platform", "platform": plat.to_dict(), "platform_hash": plat.numeric_hash})
    specs = [JobSpec.from_dict(d, source=d.get("path", d["name"])) for d in request["jobs"]]
    faults = [DeviceFault(**f) for f in request.get("faults", [])]
    iterations = request.get("iterations")
    duration = request.get("duration")
    t0 = time.monotonic()
    it = 0
    while True:
        for spec in specs:
            _emit({"event": "start", "job": spec.name, "iteration": it})
            mine = [f for f in faults if f.applies(spec.name, it)]
            op_faults = [f.fault_spec() for f in mine if f.op is not None]
            param_faults = [f for f in mine if f.parameter is not None]
            injector = inject(*op_faults) if op_faults else None

            def after_step(step: int, model: Any, _faults=param_faults) -> None:
                for f in _faults:
                    if f.step == step:
                        corrupt_parameter(model, f.parameter, f.element, bit=f.bit or 0)

            try:
                if it == 0:  # before the job allocates anything
                    p = spec.params_for(device)
                    check_fits(spec, device, free_bytes=_free_bytes(device),
                               timeout_s=request.get("timeout"), threads=threads,
                               shapes=gemm_shapes(p, device) if spec.kind == "gemm" else None)
                result = run_job(spec, device, injector=injector,
                                 after_step=after_step if param_faults else None, threads=threads)
            except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
                _emit({"event": "error", "job": spec.name, "iteration": it,
                       "kind": ("usage" if isinstance(e, BadInputError) else
                                "device" if _is_device_error(e) else "screener"),
                       "type": type(e).__name__, "message": str(e)[:2000],
                       "traceback": traceback.format_exc()[-4000:]})
                return 0
            event = {"event": "result", "iteration": it, "result": result.to_dict()}
            if injector is not None:
                event["fired"] = injector.fired
            _emit(event)
        it += 1
        # With both a duration and a count, whichever ends first; always at least one iteration.
        if duration is not None and time.monotonic() - t0 >= float(duration):
            break
        if (iterations is not None or duration is None) and it >= int(iterations or 1):
            break
    _emit({"event": "done", "iterations": it})
    return 0


# --- the parent: run children --------------------------------------------------------------------

@dataclass
class JobRuns:
    """Every run of one job on one device, kept small: the first result, the first differing one."""

    reference: JobResult
    runs: int = 1
    mismatch: Optional[tuple[int, JobResult]] = None  # (iteration, result) first differing run
    seconds: list[float] = field(default_factory=list)
    fired: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class DeviceRun:
    """What a device's child produced: platform, results per job, and how it ended."""

    device: str
    status: str = "ok"  # ok | timeout | crash | killed | device_error | screener_error | bad_input
    detail: str = ""
    platform: Mapping[str, Any] = field(default_factory=dict)
    platform_hash: Optional[str] = None
    jobs: dict[str, JobRuns] = field(default_factory=dict)
    iterations: int = 0
    current: Optional[tuple[str, int]] = None  # (job, iteration) running when it ended
    seconds: float = 0.0
    stderr_tail: str = ""
    timeout_s: Optional[float] = None  # the limit it ran past, when status is "timeout"

    def add(self, iteration: int, result: JobResult, fired: Sequence[dict[str, Any]] = ()) -> None:
        runs = self.jobs.get(result.job)
        if runs is None:
            self.jobs[result.job] = JobRuns(result, seconds=[result.seconds], fired=list(fired))
            return
        runs.runs += 1
        runs.seconds.append(result.seconds)
        runs.fired.extend(fired)
        if runs.mismatch is None and result.digest != runs.reference.digest:
            runs.mismatch = (iteration, result)


class _Child:
    def __init__(self, device: str, request: Mapping[str, Any], events: "queue.Queue[Any]",
                 python: str) -> None:
        self.device = device
        self.run = DeviceRun(device)
        self.stderr = tempfile.TemporaryFile(mode="w+b")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(request.get("threads", DEFAULT_THREADS)))
        env["PYTHONUNBUFFERED"] = "1"
        self.started = time.monotonic()
        self.last = self.started
        self.oom_before = oom_kills()
        self.proc = subprocess.Popen([python, "-m", "screener.known_answer.kat", "child"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=env, start_new_session=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode())
        self.proc.stdin.close()
        self.done = False
        self.reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self.reader.start()

    def _read(self, events: "queue.Queue[Any]") -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(PROTOCOL_PREFIX):
                try:
                    events.put((self, json.loads(line[len(PROTOCOL_PREFIX):])))
                except json.JSONDecodeError:
                    continue
        events.put((self, None))  # end of stream

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()

    def finish(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.stderr.seek(0)
        self.run.stderr_tail = self.stderr.read()[-3000:].decode(errors="replace")
        self.stderr.close()
        self.run.seconds = time.monotonic() - self.started


def execute(specs: Sequence[JobSpec], devices: Sequence[str], *, iterations: Optional[int] = 1,
            duration: Optional[float] = None, timeout: float = DEFAULT_TIMEOUT,
            faults: Optional[Mapping[str, Sequence[DeviceFault]]] = None,
            progress: Optional[Progress] = None, threads: int = DEFAULT_THREADS,
            python: Optional[str] = None,
            startup_timeout: Optional[float] = None) -> dict[str, DeviceRun]:
    """Run every job on every device, one child process per device, all devices at once.

    Jobs run `iterations` times (or, with `duration`, repeatedly until that many seconds have
    passed, finishing the iteration under way). A child that emits nothing for `timeout` seconds
    is killed and reported with status "timeout"; one that dies is "crash". Until its first
    event (importing torch, creating the CUDA context) a child gets `startup_timeout` seconds
    (default: the larger of timeout and STARTUP_TIMEOUT).
    `faults` maps a device to the faults its child applies. `progress` gets each child event
    with its "device" added.
    """
    if not devices:
        raise BadInputError("no devices to screen")
    if len(set(devices)) != len(devices):
        raise BadInputError(f"devices listed twice: {', '.join(devices)}")
    if timeout <= 0:
        raise BadInputError(f"timeout {timeout} must be positive")
    startup = startup_timeout if startup_timeout is not None else max(timeout, STARTUP_TIMEOUT)
    events: "queue.Queue[Any]" = queue.Queue()
    children = []
    for device in devices:
        request = {"device": device, "jobs": [s.to_dict() for s in specs],
                   "iterations": iterations, "duration": duration, "threads": threads,
                   "timeout": timeout,
                   "faults": [f.to_dict() for f in (faults or {}).get(device, ())]}
        children.append(_Child(device, request, events, python or sys.executable))
    live = set(children)
    try:
        while live:
            now = time.monotonic()
            for child in list(live):
                if now - child.last > (timeout if child.run.platform_hash else startup):
                    child.run.status = "timeout"
                    child.run.timeout_s = timeout if child.run.platform_hash else startup
                    where = (f" in job {child.run.current[0]} iteration {child.run.current[1]}"
                             if child.run.current else " during startup")
                    child.run.detail = f"no progress for {timeout:g} s{where}; killed"
                    child.kill()
                    live.discard(child)
                    if progress:
                        progress({"event": "timeout", "device": child.device})
            try:
                child, event = events.get(timeout=0.25)
            except queue.Empty:
                continue
            if child not in live:
                continue
            child.last = time.monotonic()
            if event is None:
                live.discard(child)
                child.proc.wait()
                if not child.done and child.run.status == "ok":
                    rc = child.proc.returncode
                    how = (f"killed by signal {signal.Signals(-rc).name}" if rc < 0
                           else f"exited with code {rc}")
                    where = (f" in job {child.run.current[0]} iteration {child.run.current[1]}"
                             if child.run.current else " before its first job")
                    child.run.status = "crash"
                    if rc in (-signal.SIGKILL, 137):
                        # Not the device: someone killed the child, most often the OOM killer.
                        child.run.status = "killed"
                        after = oom_kills()
                        if child.oom_before is not None and after is not None \
                                and after > child.oom_before:
                            how += (f" by the OOM killer (cgroup oom_kill {child.oom_before}"
                                    f" -> {after})")
                    child.run.detail = f"child {how}{where}"
                continue
            _handle(child, event)
            if progress:
                progress({**event, "device": child.device})
    finally:
        for child in children:
            if child.proc.poll() is None:  # timed out, or we are unwinding an exception
                child.kill()
            child.finish()
    return {c.device: c.run for c in children}


def _handle(child: _Child, event: Mapping[str, Any]) -> None:
    run = child.run
    kind = event.get("event")
    if kind == "platform":
        run.platform = event["platform"]
        run.platform_hash = event["platform_hash"]
    elif kind == "start":
        run.current = (event["job"], int(event["iteration"]))
    elif kind == "result":
        run.add(int(event["iteration"]), JobResult.from_dict(event["result"]),
                event.get("fired") or ())
        run.iterations = max(run.iterations, int(event["iteration"]) + 1)
    elif kind == "error":
        run.status = {"device": "device_error", "usage": "bad_input"}.get(
            str(event.get("kind")), "screener_error")
        where = (f"job {event.get('job')} iteration {event.get('iteration')}"
                 if event.get("job") else "start-up")
        run.detail = f"{where}: {event.get('type')}: {event.get('message')}"
        run.stderr_tail = str(event.get("traceback", ""))
    elif kind == "done":
        child.done = True
        run.current = None


# --- the judgment (pure) -------------------------------------------------------------------------

GoldenLookup = Callable[[JobSpec, str], Any]  # (spec, platform_hash) -> GoldenRecord | None


@dataclass(frozen=True)
class ScreenResult:
    """The outcome of a screen: one Verdict per device, the overall outcome and exit code, the
    result digest of every job on every device, platforms, and timings."""

    verdicts: tuple[Verdict, ...]
    outcome: Outcome
    exit_code: ExitCode
    digests: Mapping[str, Mapping[str, str]]
    platforms: Mapping[str, Mapping[str, Any]]
    timings: Mapping[str, Mapping[str, float]]
    jobs: tuple[str, ...]
    iterations: Mapping[str, int]
    seconds: float = 0.0

    def verdict(self, device: str) -> Verdict:
        return next(v for v in self.verdicts if v.device == device)

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "exit_code": int(self.exit_code),
                "verdicts": [v.to_dict() for v in self.verdicts],
                "digests": {d: dict(j) for d, j in self.digests.items()},
                "platforms": {d: dict(p) for d, p in self.platforms.items()},
                "timings": {d: dict(t) for d, t in self.timings.items()},
                "jobs": list(self.jobs), "iterations": dict(self.iterations),
                "seconds": round(self.seconds, 3)}


def record_command(jobs: Iterable[str], devices: Iterable[str], golden_dir: Optional[str]) -> str:
    """The command that records goldens for these jobs and devices."""
    parts = ["screener golden record"]
    parts += [f"--job {j}" for j in jobs]
    parts += [f"--device {d}" for d in devices]
    if golden_dir:
        parts.append(f"--out {golden_dir}")
    return " ".join(parts)


@dataclass
class _Issue:
    outcome: Outcome
    reason: str
    job: Optional[str] = None
    diff: Optional[Difference] = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"outcome": self.outcome.value, "reason": self.reason, "job": self.job}
        if self.diff is not None:
            d.update(self.diff.to_dict())
        if self.detail:
            d["detail"] = self.detail
        return d


# Which issue names a device's verdict when it has several: the most specific evidence first.
_REASON_RANK = {"timeout": 0, "crash": 0, "killed": 0, "device_error": 0, "self_mismatch": 1,
                "golden_mismatch": 2, "peer_mismatch": 3, "peer_split": 4,
                "golden_disagrees_with_peers": 5, "sibling_golden_differs": 6, "no_golden": 6,
                "incomplete": 6}


def judge(runs: Mapping[str, DeviceRun], specs: Sequence[JobSpec], golden: GoldenLookup, *,
          golden_dir: Optional[str] = None, seconds: float = 0.0) -> ScreenResult:
    """Compare the runs with goldens, peers and themselves; one Verdict per device.

    Raises NondeterminismError when a job disagrees with itself on every device that ran it
    (with no golden to show it can be reproduced) or when three or more devices of one platform
    all give different results; raises ScreenerError when a child failed in our own code.
    """
    for run in runs.values():
        if run.status == "bad_input":
            msg = run.detail.split(": ", 2)[-1]
            named = msg.startswith((f"device {run.device}", f"device {run.device!r}"))
            raise BadInputError(msg if named else f"device {run.device}: {msg}")
        if run.status == "screener_error":
            raise ScreenerError(f"device {run.device}: the screener failed: {run.detail}\n"
                                f"{run.stderr_tail}".rstrip())
    ok = {d: r for d, r in runs.items() if r.status == "ok"}
    goldens: dict[tuple[str, str], Any] = {}
    for run in ok.values():
        for spec in specs:
            key = (spec.name, run.platform_hash or "")
            if key not in goldens and run.platform_hash:
                goldens[key] = golden(spec, run.platform_hash)
    _check_nondeterminism(ok, specs, goldens)

    issues: dict[str, list[_Issue]] = {d: [] for d in runs}
    for device, run in runs.items():
        if run.status == "killed":
            job = run.current[0] if run.current else None
            issues[device].append(_Issue(Outcome.INCONCLUSIVE, "killed", job, detail=(
                f"{run.detail}: killed from outside (memory pressure, an operator), which says "
                f"nothing about the device")))
        elif run.status == "timeout":
            issues[device].append(_hang(device, run, runs, specs, golden))
        elif run.status != "ok":
            job = run.current[0] if run.current else None
            issues[device].append(_Issue(Outcome.SUSPECT, run.status, job, detail=run.detail))

    groups: dict[str, list[str]] = {}
    for device, run in ok.items():
        groups.setdefault(run.platform_hash or "", []).append(device)

    siblings = getattr(golden, "siblings", None)
    matched: dict[str, dict[str, dict[str, Any]]] = {d: {} for d in runs}
    for spec in specs:
        for phash, members in groups.items():
            record = goldens.get((spec.name, phash))
            kin = (siblings(spec, ok[members[0]].platform)
                   if record is None and siblings is not None and phash else [])
            have = [d for d in members if spec.name in ok[d].jobs]
            for d in members:
                if d not in have:
                    issues[d].append(_Issue(Outcome.INCONCLUSIVE, "incomplete", spec.name,
                                            detail="the job produced no result"))
            refs = {d: ok[d].jobs[spec.name].reference for d in have}
            counts = Counter(r.digest for r in refs.values())
            majority = next((dg for dg, c in counts.items() if c * 2 > len(have)), None)
            for d in have:
                runs_d = ok[d].jobs[spec.name]
                ref = runs_d.reference
                if runs_d.mismatch is not None:
                    it, other = runs_d.mismatch
                    trusted = _trusted_steps(record, kin, ref, other, refs, counts, majority)
                    issues[d].append(_self_mismatch(it, ref, other, trusted, spec.name))
                if record is not None:
                    matched[d][spec.name] = {"golden": record.path, "platform_hash": phash}
                    diff = record.compare(ref)
                    if diff is not None:
                        agreeing = counts[ref.digest]
                        if ref.digest == majority and agreeing >= MIN_PEERS:
                            issues[d].append(_Issue(
                                Outcome.INCONCLUSIVE, "golden_disagrees_with_peers", spec.name,
                                diff, detail=f"{agreeing} devices agree with each other but not "
                                             f"with {record.path}; re-record it if the platform "
                                             f"changed"))
                        else:
                            issues[d].append(_Issue(Outcome.SUSPECT, "golden_mismatch",
                                                    spec.name, diff, detail=record.path))
                        continue
                    continue  # matches the golden
                sibling_differs = False
                if kin:
                    same = next((r for r in kin if r.compare(ref) is None), None)
                    if same is not None:  # a sibling platform's golden, bit for bit
                        matched[d][spec.name] = {"golden": same.path, "platform_hash":
                                                 same.platform_hash, "sibling": True}
                        continue
                    sibling_differs = True
                    issues[d].append(_Issue(
                        Outcome.INCONCLUSIVE, "sibling_golden_differs", spec.name,
                        kin[0].compare(ref),
                        detail=f"no golden for platform {phash}; the results differ from the "
                               f"golden(s) of sibling platforms (same torch build and dispatch "
                               f"level, another library path, thread count or driver): "
                               f"{', '.join(r.path for r in kin)}; record one with: "
                               f"{record_command([spec.name], members, golden_dir)}"))
                if len(have) >= 2 and majority is not None and ref.digest != majority:
                    peer = next(p for p in have if refs[p].digest == majority)
                    issues[d].append(_Issue(
                        Outcome.SUSPECT, "peer_mismatch", spec.name,
                        first_difference(refs[peer].steps, ref.steps),
                        detail=f"differs from the {counts[majority]} of {len(have)} devices "
                               f"that agree (e.g. {peer})"))
                elif len(have) >= 2 and majority is None:
                    issues[d].append(_Issue(
                        Outcome.SUSPECT, "peer_split", spec.name,
                        detail=f"{len(have)} devices of one platform give {len(counts)} different "
                               f"results and no strict majority agrees"))
                elif counts[ref.digest] < MIN_PEERS and not sibling_differs:
                    issues[d].append(_Issue(
                        Outcome.INCONCLUSIVE, "no_golden", spec.name,
                        detail=f"no golden for platform {phash} and only {counts[ref.digest]} "
                               f"agreeing device(s); record one with: "
                               f"{record_command([spec.name], members, golden_dir)}"))

    verdicts = []
    for device, run in runs.items():
        verdicts.append(_verdict(device, run, issues[device], specs, golden_dir,
                                 matched[device]))
    outcomes = {v.outcome for v in verdicts}
    if Outcome.SUSPECT in outcomes:
        outcome, code = Outcome.SUSPECT, ExitCode.HARDWARE_SUSPECT
    elif Outcome.INCONCLUSIVE in outcomes:
        outcome, code = Outcome.INCONCLUSIVE, ExitCode.INCONCLUSIVE
    else:
        outcome, code = Outcome.PASS, ExitCode.PASS
    return ScreenResult(
        verdicts=tuple(verdicts), outcome=outcome, exit_code=code,
        digests={d: {j: r.reference.digest for j, r in run.jobs.items()} for d, run in runs.items()},
        platforms={d: run.platform for d, run in runs.items()},
        timings={d: {j: round(sum(r.seconds) / max(len(r.seconds), 1), 4)
                     for j, r in run.jobs.items()} for d, run in runs.items()},
        jobs=tuple(s.name for s in specs), iterations={d: r.iterations for d, r in runs.items()},
        seconds=seconds)


def _hang(device: str, run: DeviceRun, runs: Mapping[str, DeviceRun], specs: Sequence[JobSpec],
          golden: GoldenLookup) -> _Issue:
    """A timeout is a hang (suspect) only with evidence that the job finishes in time: a peer of
    the same platform finished it in this run, or its golden says how long it takes."""
    job = run.current[0] if run.current else None
    peers = [d for d, r in runs.items() if d != device and r.platform_hash
             and (run.platform_hash is None or r.platform_hash == run.platform_hash)
             and (job is None or job in r.jobs)]
    if peers:
        return _Issue(Outcome.SUSPECT, "timeout", job, detail=(
            f"{run.detail}; {len(peers)} peer device(s) of the platform finished it "
            f"(e.g. {peers[0]})"))
    spec = next((s for s in specs if s.name == job), None)
    record = None
    if spec is not None and run.platform_hash:
        try:
            record = golden(spec, run.platform_hash)
        except Exception:  # noqa: BLE001 - a broken golden was already reported by the lookup
            record = None
    took = _recorded_seconds(record)
    limit = run.timeout_s
    if took is not None and limit is not None and limit >= HANG_FACTOR * took:
        return _Issue(Outcome.SUSPECT, "timeout", job, detail=(
            f"{run.detail}; its golden records {took:g} s for the job"))
    return _Issue(Outcome.INCONCLUSIVE, "timeout", job, detail=(
        f"{run.detail}; no peer finished the job and its golden records no time for it, so a "
        f"slow job cannot be told from a hung device"))


def _recorded_seconds(record: Any) -> Optional[float]:
    recorded = getattr(record, "recorded", None) or {}
    v = recorded.get("seconds") if isinstance(recorded, Mapping) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e7:
        return float(v)
    return None


def _check_nondeterminism(ok: Mapping[str, DeviceRun], specs: Sequence[JobSpec],
                          goldens: Mapping[tuple[str, str], Any]) -> None:
    for spec in specs:
        ran = [d for d, r in ok.items() if spec.name in r.jobs]
        if not ran:
            continue
        self_bad = [d for d in ran if ok[d].jobs[spec.name].mismatch is not None]
        # One device that disagrees with itself while a golden proves the job reproducible is a
        # suspect device; every device disagreeing with itself is our bug.
        proven = any(_golden_reproduced(goldens.get((spec.name, ok[d].platform_hash or "")),
                                        ok[d].jobs[spec.name]) for d in ran)
        if self_bad and len(self_bad) == len(ran) and not (len(ran) == 1 and proven):
            d = self_bad[0]
            it, other = ok[d].jobs[spec.name].mismatch  # type: ignore[misc]
            diff = first_difference(ok[d].jobs[spec.name].reference.steps, other.steps)
            raise NondeterminismError(
                f"job {spec.name} is nondeterministic: it gave different bits across repeats on "
                f"every device ({', '.join(self_bad)}); e.g. {d} iteration {it} vs 0 at "
                f"{_where(diff)}. This is a screener bug, not a hardware verdict.")
        by_platform: dict[str, list[str]] = {}
        for d in ran:
            by_platform.setdefault(ok[d].platform_hash or "", []).append(d)
        for phash, members in by_platform.items():
            digests = {ok[d].jobs[spec.name].reference.digest for d in members}
            if len(members) >= 3 and len(digests) == len(members) and \
                    goldens.get((spec.name, phash)) is None:
                raise NondeterminismError(
                    f"job {spec.name} gave {len(members)} different results on the "
                    f"{len(members)} devices of platform {phash} ({', '.join(members)}): a "
                    f"screener bug, not a hardware verdict")


def _trusted_steps(record: Any, kin: Sequence[Any], ref: JobResult, other: JobResult,
                   refs: Mapping[str, JobResult], counts: "Counter[str]",
                   majority: Optional[str]) -> Any:
    """The steps a device's disagreeing repeats are judged against: its golden, else a sibling
    golden that one repeat reproduces, else the result a strict majority of two or more devices
    agree on; None when nothing outside the device says which repeat is right."""
    if record is not None:
        return record.steps
    for r in kin:
        if r.compare(ref) is None or r.compare(other) is None:
            return r.steps
    if majority is not None and len(refs) >= 2 and counts[majority] >= 2:
        return next(r.steps for r in refs.values() if r.digest == majority)
    return None


def _self_mismatch(it: int, ref: JobResult, other: JobResult, trusted: Any, job: str) -> _Issue:
    """A device that disagrees with itself. Expected is the trusted value (golden or majority)
    and observed the device's wrong one, whichever repeat went wrong: a fault in the first
    repeat must not make the corrupted value 'expected'."""
    if trusted is None:
        return _Issue(Outcome.SUSPECT, "self_mismatch", job,
                      first_difference(ref.steps, other.steps),
                      detail=f"iteration {it} differs from iteration 0 (no golden or majority "
                             f"says which is right; expected is iteration 0's value)")
    ref_diff = first_difference(trusted, ref.steps)
    bad, good, bad_it, good_it = ((ref, other, 0, it) if ref_diff is not None
                                  else (other, ref, it, 0))
    # digests differ, so at least one repeat differs from the trusted result
    diff = ref_diff or first_difference(trusted, bad.steps)
    agrees = first_difference(trusted, good.steps) is None
    return _Issue(Outcome.SUSPECT, "self_mismatch", job, diff,
                  detail=f"iteration {bad_it} differs from the trusted result, which iteration "
                         f"{good_it} {'reproduces' if agrees else 'does not reproduce either'}")


def _golden_reproduced(record: Any, runs: JobRuns) -> bool:
    """Whether any run of the job reproduced its golden bit for bit."""
    if record is None:
        return False
    candidates = [runs.reference] + ([runs.mismatch[1]] if runs.mismatch else [])
    return any(record.compare(r) is None for r in candidates)


def _where(diff: Optional[Difference]) -> str:
    if diff is None:
        return "an unknown place"
    return (f"step {diff.step} ({diff.label}) {diff.tensor}: expected {diff.expected}, "
            f"observed {diff.observed}")


def _verdict(device: str, run: DeviceRun, issues: list[_Issue], specs: Sequence[JobSpec],
             golden_dir: Optional[str],
             matched: Optional[Mapping[str, Mapping[str, Any]]] = None) -> Verdict:
    evidence: dict[str, Any] = {
        "status": run.status,
        "platform": run.platform.get("name") if run.platform else None,
        "iterations": run.iterations,
        # per job: its digest and, when compared with one, the golden (and whether a sibling's)
        "jobs": {j: {"digest": r.reference.digest, "runs": r.runs,
                     "seconds": round(sum(r.seconds), 4), **(matched or {}).get(j, {})}
                 for j, r in run.jobs.items()},
    }
    if issues:
        evidence["issues"] = [i.to_dict() for i in issues]
    fired = {j: r.fired for j, r in run.jobs.items() if r.fired}
    if fired:
        evidence["faults_fired"] = fired
    if run.status != "ok" and run.stderr_tail:
        evidence["stderr_tail"] = run.stderr_tail[-1500:]
    suspects = [i for i in issues if i.outcome == Outcome.SUSPECT]
    inconclusive = [i for i in issues if i.outcome == Outcome.INCONCLUSIVE]
    chosen = min(suspects or inconclusive or [None],
                 key=lambda i: _REASON_RANK.get(i.reason, 9) if i else 0)
    if chosen is None:
        return Verdict(device=device, outcome=Outcome.PASS, reason="", platform_hash=run.platform_hash,
                       evidence=evidence)
    if chosen.reason in ("no_golden", "incomplete", "sibling_golden_differs"):
        names = [i.job for i in inconclusive
                 if i.reason in ("no_golden", "sibling_golden_differs") and i.job]
        if names:
            evidence["command"] = record_command(names, [device], golden_dir)
    diff = chosen.diff
    if chosen.detail:
        evidence["detail"] = chosen.detail
    return Verdict(device=device, outcome=chosen.outcome, reason=chosen.reason, job=chosen.job,
                   step=diff.step if diff else None, tensor=diff.tensor if diff else None,
                   expected=diff.expected if diff else None,
                   observed=diff.observed if diff else None,
                   platform_hash=run.platform_hash, evidence=evidence)


# --- the plain entry points ----------------------------------------------------------------------

def quick_jobs(jobs_dir: Optional[str] = None) -> list[JobSpec]:
    """The default quick-screen jobs (spec `quick = true`)."""
    return select_jobs(None, jobs_dir=jobs_dir, quick_only=True)


def resolve_jobs(jobs: Optional[Sequence[str | JobSpec]], jobs_dir: Optional[str] = None, *,
                 quick_only: bool = True) -> list[JobSpec]:
    """Job specs from names or specs; None or empty: the quick screen (or every job)."""
    if not jobs:
        return select_jobs(None, jobs_dir=jobs_dir, quick_only=quick_only)
    if all(isinstance(j, JobSpec) for j in jobs):
        return list(jobs)  # type: ignore[arg-type]
    names = [j.name if isinstance(j, JobSpec) else j for j in jobs]
    return select_jobs(names, jobs_dir=jobs_dir)


def resolve_devices(devices: Optional[Sequence[str]]) -> list[str]:
    """Device names; None, empty or "all": every local CUDA device, or the CPU without one."""
    if not devices or list(devices) == ["all"]:
        from screener.known_answer.platform import local_devices  # imports torch: only when asked for "all"

        return local_devices()
    out: list[str] = []
    for d in devices:
        if d == "all":
            from screener.known_answer.platform import local_devices

            out.extend(x for x in local_devices() if x not in out)
            continue
        if d == "cuda":
            d = "cuda:0"
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()):
            raise BadInputError(f"device {d!r} is not cpu, cuda:N or all")
        if d not in out:
            out.append(d)
    return out


def golden_lookup(golden_dir: Optional[str]) -> GoldenLookup:
    """The golden records of a folder (default: screener.known_answer.golden.default_golden_dir())."""
    from screener.known_answer import golden as _golden

    d = golden_dir or str(_golden.default_golden_dir())
    cache: dict[tuple[str, str], Any] = {}

    def lookup(spec: JobSpec, platform_hash: str) -> Any:
        key = (spec.name, platform_hash)
        if key not in cache:
            cache[key] = _golden.find(d, spec, platform_hash)
        return cache[key]

    def siblings(spec: JobSpec, platform: Mapping[str, Any]) -> list[Any]:
        """Goldens of sibling platforms, for a device with none of its own (judge reads it)."""
        return _golden.find_siblings(d, spec, platform)

    lookup.siblings = siblings  # type: ignore[attr-defined]
    return lookup


def prevalidate_goldens(golden_dir: str, specs: Sequence[JobSpec]) -> int:
    """Load every golden file of these jobs (any platform) before any device runs, so a broken
    or stale golden fails at once (GoldenError, exit 2) rather than after the jobs. Returns the
    number of files checked."""
    from screener.known_answer import golden as _golden

    n = 0
    for spec in specs:
        for p in sorted(Path(golden_dir).glob(f"{spec.name}.*.json")):
            _golden.load(p, spec=spec)
            n += 1
    return n


def run_screen(jobs: Optional[Sequence[str | JobSpec]] = None, devices: Sequence[str] = ("cpu",), *,
               golden_dir: Optional[str] = None, jobs_dir: Optional[str] = None, repeat: int = 1,
               duration: Optional[float] = None, timeout: float = DEFAULT_TIMEOUT,
               faults: Optional[Mapping[str, Sequence[DeviceFault]]] = None,
               progress: Optional[Progress] = None) -> ScreenResult:
    """Screen devices with known-answer jobs (default: the quick screen) and judge the results.

    repeat: runs of each job per device (>= 2 adds the self-consistency check); duration: keep
    repeating for that many seconds instead. Raises GoldenError (bad golden, exit 2),
    NondeterminismError or ScreenerError (exit 1); a bad device is a Verdict, never an exception.
    """
    if repeat < 1:
        raise BadInputError(f"repeat {repeat} must be >= 1")
    specs = resolve_jobs(jobs, jobs_dir)
    devs = resolve_devices(devices)
    if golden_dir is None:
        from screener.known_answer.golden import default_golden_dir

        golden_dir = str(default_golden_dir())
    prevalidate_goldens(golden_dir, specs)
    t0 = time.monotonic()
    runs = execute(specs, devs, iterations=repeat, duration=duration, timeout=timeout,
                   faults=faults, progress=progress)
    return judge(runs, specs, golden_lookup(golden_dir), golden_dir=golden_dir,
                 seconds=time.monotonic() - t0)


@dataclass(frozen=True)
class RecordResult:
    """What `record_goldens` did: files written, platforms added to an existing record with the
    same bits, files left unchanged or refused, and its exit code."""

    written: tuple[str, ...]
    unchanged: tuple[str, ...]
    refused: tuple[str, ...]
    exit_code: ExitCode
    screen: Optional[ScreenResult] = None
    added: tuple[str, ...] = ()  # "<path> (platform <hash>)"

    def lines(self) -> list[str]:
        out = [f"wrote     {p}" for p in self.written]
        out += [f"added to  {p}" for p in self.added]
        out += [f"unchanged {p}" for p in self.unchanged]
        out += [f"refused   {r}" for r in self.refused]
        if self.refused and self.screen is not None:
            out.append(format_verdicts(self.screen))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"written": list(self.written), "added": list(self.added),
                "unchanged": list(self.unchanged),
                "refused": list(self.refused), "exit_code": int(self.exit_code),
                "screen": self.screen.to_dict() if self.screen else None}


def record_goldens(specs: Sequence[JobSpec], devices: Sequence[str], *,
                   out_dir: Optional[str] = None, repeat: int = 3,
                   timeout: float = DEFAULT_TIMEOUT, force: bool = False,
                   progress: Optional[Progress] = None,
                   faults: Optional[Mapping[str, Sequence[DeviceFault]]] = None) -> RecordResult:
    """Run the jobs `repeat` times on every device and write a golden per (job, platform).

    Nothing is written unless every run on every device of a platform agrees bit for bit: a
    disagreement (or a device that times out or crashes) refuses every record with exit 75 and
    the verdicts as evidence. A valid existing golden with other results is only replaced with
    `force`; a stale or broken one is replaced. (`faults`: as for execute, for drills.)
    """
    from screener.known_answer import golden as _golden

    if repeat < 1:
        raise BadInputError(f"repeat {repeat} must be >= 1")
    out = out_dir or str(_golden.default_golden_dir())
    devs = resolve_devices(devices)
    t0 = time.monotonic()
    runs = execute(specs, devs, iterations=repeat, timeout=timeout, progress=progress,
                   faults=faults)
    return write_goldens(runs, specs, out, repeat=repeat, force=force,
                         seconds=time.monotonic() - t0)


def write_goldens(runs: Mapping[str, DeviceRun], specs: Sequence[JobSpec], out: str, *,
                  repeat: int, force: bool = False, seconds: float = 0.0) -> RecordResult:
    """The deciding half of record_goldens: judge the runs without goldens, then write."""
    from screener.known_answer import golden as _golden
    from screener.errors import GoldenError

    screen = judge(runs, specs, lambda spec, phash: None, golden_dir=out, seconds=seconds)
    bad = [v for v in screen.verdicts if v.outcome == Outcome.SUSPECT]
    if bad:
        return RecordResult((), (), tuple(
            f"{v.device}: {v.reason}" + (f" in {v.job}" if v.job else "") for v in bad),
            ExitCode.HARDWARE_SUSPECT, screen)
    written, unchanged, refused, added = [], [], [], []
    for spec in specs:
        groups: dict[str, list[str]] = {}
        for d, run in runs.items():
            if spec.name in run.jobs:
                groups.setdefault(run.platform_hash or "", []).append(d)
        for phash, members in groups.items():
            results = [(d, runs[d].jobs[spec.name].reference) for d in members]
            record = _golden.record_from_results(spec, runs[members[0]].platform, phash, results,
                                                 repeats=repeat)
            path = _golden.golden_path(out, spec.name, phash)
            if not path.exists():
                # Results equal to an existing golden of another platform: add this platform
                # to that record rather than writing a copy of its bits.
                try:
                    same = [r for r in _golden.job_records(out, spec) if r.digest == record.digest
                            and r.compare(results[0][1]) is None]
                except GoldenError:
                    same = []  # a broken record is replaced by nobody here; write our own
                if same:
                    old = same[0]
                    if phash in old.platform_hashes:
                        unchanged.append(old.path)
                    else:
                        _golden.write(_golden.add_platform(old, record.platform, phash,
                                                           record.recorded), out)
                        added.append(f"{old.path} (platform {phash})")
                    continue
            if path.exists():
                try:
                    old = _golden.load(path, spec=spec, platform_hash=phash)
                except GoldenError:
                    old = None  # stale or broken: replace it
                if old is not None and old.digest == record.digest:
                    unchanged.append(str(path))
                    continue
                if old is not None and not force:
                    diff = old.compare(results[0][1])
                    refused.append(f"{path}: the new runs differ from this valid golden at "
                                   f"{_where(diff)}; use --force to replace it")
                    continue
            written.append(str(_golden.write(record, out)))
    code = ExitCode.HARDWARE_SUSPECT if refused else ExitCode.PASS
    return RecordResult(tuple(written), tuple(unchanged), tuple(refused), code, screen,
                        tuple(added))


def local_platform(device: str = "cpu", threads: int = DEFAULT_THREADS) -> Any:
    """The platform signature of `device` as a screening child sees it (thread count pinned)."""
    import torch

    from screener.determinism import preserved
    from screener.known_answer.platform import signature

    with preserved():
        torch.set_num_threads(threads)
        return signature(device)


def format_verdicts(result: ScreenResult) -> str:
    """A human-readable table of verdicts and a summary line."""
    lines = [f"{'device':10s} {'outcome':13s} {'reason':28s} where"]
    for v in result.verdicts:
        where = ""
        if v.job:
            where = v.job
            if v.step is not None:
                where += f" step {v.step} {v.tensor}"
        lines.append(f"{v.device:10s} {v.outcome.value:13s} {v.reason or '-':28s} {where}")
        if v.expected is not None or v.observed is not None:
            lines.append(f"{'':10s}   expected {v.expected}  observed {v.observed}")
        detail = v.evidence.get("detail")
        if detail and v.outcome != Outcome.PASS and v.reason != "no_golden":
            lines.append(f"{'':10s}   {detail}")
        if v.evidence.get("command"):
            lines.append(f"{'':10s}   record a golden: {v.evidence['command']}")
        kin = sorted({j["golden"] for j in v.evidence.get("jobs", {}).values()
                      if j.get("sibling")})
        if kin:
            lines.append(f"{'':10s}   matched sibling platform golden(s): {', '.join(kin)}")
    lines.append(f"{result.outcome.value} (exit {int(result.exit_code)}): {len(result.jobs)} job(s) "
                 f"on {len(result.verdicts)} device(s) in {result.seconds:.1f} s")
    return "\n".join(lines)


def _main(argv: Sequence[str]) -> int:
    if list(argv[:1]) != ["child"]:
        print("usage: python -m screener.known_answer.kat child  (internal: reads a JSON request on stdin)",
              file=sys.stderr)
        return 2
    try:
        return child_main(json.loads(sys.stdin.read()))
    except Exception as e:  # noqa: BLE001 - see below
        # Whatever escaped child_main (a bad request, a bad fault, a bug of ours outside a job)
        # must reach the parent as an error event: a child that merely died would be judged a
        # crash, and a crash is a hardware verdict.
        kind = ("usage" if isinstance(e, BadInputError) else
                "device" if _is_device_error(e) else "screener")
        _emit({"event": "error", "job": None, "iteration": None, "kind": kind,
               "type": type(e).__name__, "message": str(e)[:2000],
               "traceback": traceback.format_exc()[-4000:]})
        return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
