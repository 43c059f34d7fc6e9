"""Op censuses for `screener kat coverage`: a user's training step, and the known-answer jobs, each
run under torch.profiler in a child process of its own.

**Why the profiler, not a TorchDispatchMode.** torch.profiler records every op at every level of
the dispatcher, the ops autograd's engine runs in C++ during backward and the ops a composite op
decomposes into (aten::scaled_dot_product_attention and the
aten::_scaled_dot_product_flash_attention_for_cpu inside it), and it computes each op's self time
from the nesting of what it recorded; on CUDA (CUPTI) it also names the kernels that ran and gives
their device time, which is what a GPU spends its time in, and a kernel's name says which
implementation ran (flash or math attention, which GEMM tiles) where the aten name does not. A
TorchDispatchMode sees only what reaches the Python dispatch key: no composite ops, no kernels, and
timing it means a clock (on CUDA a device synchronisation) around every call from Python, which
costs more than the small ops it would time and changes what it measures. The profiler's own cost
(a few microseconds per op) lands on every op alike; the shares are of what it measured.

What a census counts (screener.known_answer.verdict.coverage.Census): on the CPU, every `aten::` op with its
summed self CPU time and its number of calls (the profiler's other events, autograd nodes and
`Optimizer.step#...` ranges, are wrappers around aten ops and carry only their overhead); on CUDA,
every event the GPU ran (kernels, memcpy and memset) with its device time, by name.

**The script contract.** The script is a Python file that runs one training step of the user's
model when run as a program: the child runs it with `runpy.run_path(SCRIPT, run_name="__main__")`,
exactly as `python SCRIPT` would (its folder first on sys.path, sys.argv == [SCRIPT]), so its
top-level code and its `if __name__ == "__main__":` block run, and everything they run is counted,
set-up included, unless the script marks its step: where it runs the step inside
`with torch.profiler.record_function("screener:step"):` (STEP_MARK), only the ops that start inside
a mark count (on any thread; on CUDA the kernels launched inside it). It is run DEFAULT_WARMUP
time(s) uncounted, then DEFAULT_RUNS times under the profiler, all in the one child, so it must
run again in the same process (fresh globals each time); on the CPU with one intra-op thread, as
the jobs run (see _run_script). $SCREENER_DEVICE names the device the coverage is measured on
(cpu or cuda:N); the script should put its step there. Its output goes to the command's stderr.
A script that raises (SystemExit with a non-zero status included) or whose child dies is one line
and exit 2 (BadInputError), naming the file, the script's line and the exception; so is one that
ran no op.

**The jobs' census.** One child runs every job the device runs (the specs given, by default the
quick screen, as `kat run` runs it) through screener.known_answer.engine.workloads.run_job, the runner a
screen's child uses, each job under its own profiler session, so the report can say which job
runs an op. A job that fails there is ours to fix (ScreenerError, exit 1), never a verdict: a
census judges no hardware.

Child protocol: `python -m screener.known_answer.engine.census script|jobs OUT`, the request as JSON on
stdin; the child writes {"census": ...} or {"jobs": {job: census}} to OUT, or {"error": ...,
"whose": "script"|"ours"}; its stdout and stderr are the script's and torch's logs.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.atomicfile import write_atomic
from screener.errors import BadInputError, ScreenerError
from screener.known_answer.verdict.coverage import (KIND_ATEN, KIND_KERNEL, Census, OpStat,
                                            least_disturbed)
from screener.known_answer.engine.protocol import DEFAULT_THREADS
from screener.known_answer.engine.specs import JobSpec

CENSUS_MODULE = "screener.known_answer.engine.census"  # run as `python -m CENSUS_MODULE MODE OUT`
DEVICE_ENV = "SCREENER_DEVICE"  # the device the script is asked to run its step on
# A script that wraps its step in torch.profiler.record_function(STEP_MARK) has only what runs
# inside counted: its model's set-up (parameter initialisation: aten::uniform_, normal_) is not
# the training step, and in examples/llama_step.py it was 6% of a run.
STEP_MARK = "screener:step"
DEFAULT_TIMEOUT = 600.0  # seconds a census child may run: a step, or every job once
# The script's first run is not counted: its first calls pay one-time costs (library start-up,
# primitive caches, lazy imports) that land on whichever op came first; in a cold run of
# examples/llama_step.py aten::_log_softmax's one call was 13% of the step. The counted runs
# then give each op its least disturbed time (coverage.least_disturbed).
DEFAULT_WARMUP = 1
DEFAULT_RUNS = 3


def kind_for(device: str) -> str:
    """What a census on `device` counts: kernels on CUDA (where the time is), else aten ops."""
    return KIND_KERNEL if device.startswith("cuda") else KIND_ATEN


# --- the census itself (runs in a child) --------------------------------------------------------

def aggregate(events: Sequence[Any], kind: str, mark: str = STEP_MARK) -> Census:
    """A census from the profiler's events (torch.autograd.profiler_util.FunctionEvent).

    Where some of the events are ranges named `mark` (record_function(STEP_MARK) in the script),
    only the ops that started inside one count, on whichever thread (autograd's engine runs a
    CUDA backward on a thread of its own, outside the mark's nesting), and on CUDA the kernels
    whose launching op did."""
    from torch.autograd import DeviceType

    ranges = [(e.time_range.start, e.time_range.end) for e in events
              if e.device_type == DeviceType.CPU and e.name == mark]
    by_id = {e.id: e for e in events if e.device_type == DeviceType.CPU} if ranges else {}

    def in_step(e: Any) -> bool:
        if not ranges:
            return True
        launch = by_id.get(getattr(e, "linked_correlation_id", 0)) \
            if e.device_type != DeviceType.CPU else e
        t = (launch or e).time_range.start  # a kernel without its launch: its own start
        return any(start <= t <= end for start, end in ranges)

    ops: dict[str, list[float]] = {}
    for e in events:
        if kind == KIND_ATEN:
            if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
                continue
            t = float(e.self_cpu_time_total)
        else:
            # What the GPU ran (kernels, memcpy, memset), each for its own duration; not the
            # launch ops on the CPU (the kernels' overhead, not their time), and not the GPU's
            # copies of record_function ranges, which span the kernels inside them (torch's
            # own table leaves them out for the same reason).
            if e.device_type != DeviceType.CUDA or e.is_user_annotation \
                    or e.activity_type == "gpu_user_annotation":
                continue
            t = float(e.time_range.elapsed_us())
        if not in_step(e):
            continue
        slot = ops.setdefault(e.name, [0.0, 0])
        slot[0] += max(t, 0.0)
        slot[1] += 1
    return Census(kind, {n: OpStat(v[0], int(v[1])) for n, v in ops.items()}, bool(ranges))


def profiled(fn: Callable[[], Any], device: str) -> Census:
    """Run fn() under torch.profiler and return its census on `device`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:  # the kernels still queued belong to this census
            torch.cuda.synchronize(device)
    return aggregate(prof.events(), kind_for(device))


def _script_line(e: BaseException, path: str) -> Optional[int]:
    """The script's own line an exception came from (its innermost frame in the script, not
    torch's), or None when no frame of the script is on the traceback."""
    if isinstance(e, SyntaxError) and e.lineno and e.filename \
            and os.path.realpath(e.filename) == os.path.realpath(path):
        return e.lineno
    target = os.path.realpath(path)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.realpath(f.filename) == target]
    return frames[-1].lineno if frames else None


def _run_script(request: Mapping[str, Any]) -> dict[str, Any]:
    """The script's censuses (one per counted run), or why it has none."""
    import torch  # imported before the census starts: not part of the step

    path, device = str(request["path"]), str(request["device"])
    warmup, runs = int(request.get("warmup", 1)), int(request.get("runs", 1))
    if not device.startswith("cuda"):
        # One intra-op thread, as the jobs run: with two on a shared 2-core machine, aten::mm
        # was 20% of examples/llama_step.py in one run and 90% in the next (its threads waiting
        # for each other), with one 23-24% in every run. The op names do not depend on it.
        torch.set_num_threads(int(request.get("threads", DEFAULT_THREADS)))
    failure: list[dict[str, Any]] = []

    def step() -> None:
        if failure:  # a run that failed ends the census; the first failure is the one reported
            return
        # As `python SCRIPT` runs it (runpy.run_path does not put its folder on sys.path).
        folder = os.path.dirname(os.path.abspath(path))
        sys.argv = [path]
        sys.path.insert(0, folder)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                failure.append({"error": f"exited with status {e.code!r}", "whose": "script"})
        except BaseException as e:  # noqa: BLE001 - the script's failure, reported in one line
            failure.append({"error": f"raised {type(e).__name__}: {e}".strip().rstrip(":"),
                            "where": _script_line(e, path), "whose": "script"})
        finally:
            if folder in sys.path:  # the script may have changed sys.path itself
                sys.path.remove(folder)

    for _ in range(warmup):
        step()
    censuses = [profiled(step, device).to_dict() for _ in range(runs)]
    return failure[0] if failure else {"runs": censuses}


def _run_jobs(request: Mapping[str, Any]) -> dict[str, Any]:
    """One census per job, each job run once through the screen's runner."""
    from screener.known_answer.engine.workloads import run_job  # imports torch

    device = str(request["device"])
    threads = int(request.get("threads", DEFAULT_THREADS))
    out: dict[str, Any] = {}
    for d in request["jobs"]:
        spec = JobSpec.from_dict(d, source=d.get("path", d["name"]))
        try:
            out[spec.name] = profiled(lambda: run_job(spec, device, threads=threads),
                                      device).to_dict()
        except Exception as e:  # noqa: BLE001 - reported to the parent in one line
            return {"error": f"job {spec.name}: {type(e).__name__}: {e}", "whose": "ours"}
    return {"jobs": out}


def main(argv: Sequence[str]) -> int:
    """`script OUT` or `jobs OUT`, the request on stdin; anything else is a usage error (2)."""
    if len(argv) != 2 or argv[0] not in ("script", "jobs"):
        print(f"usage: python -m {CENSUS_MODULE} script|jobs OUT  (internal: reads a JSON "
              "request on stdin)", file=sys.stderr)
        return 2
    mode, out = argv
    try:
        request = json.loads(sys.stdin.read())
        result = _run_script(request) if mode == "script" else _run_jobs(request)
    except Exception as e:  # noqa: BLE001 - whatever escaped is ours, and must reach the parent
        result = {"error": f"{type(e).__name__}: {e}", "whose": "ours"}
    # Written whole under a temporary name, then renamed: a child killed half-way leaves no file
    # rather than a truncated one that reads as a bad census.
    write_atomic(out, json.dumps(result))
    return 0


# --- the parent side ----------------------------------------------------------------------------

def _profiler_chatter(line: str) -> bool:
    # Kineto's own two lines around every profiler session ("USDT:... profiler_start"), which no
    # environment variable turns off: noise, not the script's output.
    return line.startswith("USDT:") and ("profiler_start" in line or "profiler_stop" in line)


def _relay(stream: Any, sink: Any) -> None:
    """Copy a child's output to `sink` (the command's stderr) as it comes."""
    for line in iter(stream.readline, ""):
        if not _profiler_chatter(line):
            sink.write(line)
            sink.flush()


def _ended(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def run_child(mode: str, request: Mapping[str, Any], device: str, *, timeout: float,
              sink: Any = None, python: Optional[str] = None) -> dict[str, Any]:
    """Run a census child and return what it wrote; its output goes to `sink` (default
    sys.stderr). {"error": ..., "whose": "child"} when it died or ran past `timeout` seconds
    without writing anything."""
    sink = sys.stderr if sink is None else sink
    env = dict(os.environ)
    env[DEVICE_ENV] = device
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory(prefix="screener-census-") as tmp:
        out = Path(tmp) / "census.json"
        proc = subprocess.Popen([python or sys.executable, "-m", CENSUS_MODULE, mode, str(out)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        relay = threading.Thread(target=_relay, args=(proc.stdout, sink), daemon=True)
        relay.start()
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(request))
            proc.stdin.close()
        except BrokenPipeError:  # it died at start-up: its exit status says how
            pass
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            relay.join(timeout=5)
            return {"error": f"ran past the {timeout:g} s limit (--timeout) and was killed",
                    "whose": "child"}
        relay.join(timeout=5)
        if not out.exists():
            return {"error": f"its child {_ended(code)} before writing a census",
                    "whose": "child"}
        try:
            result = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ScreenerError(f"census child wrote an unreadable result: {e}") from e
    if not isinstance(result, dict):
        raise ScreenerError(f"census child wrote {type(result).__name__}, not an object")
    return result


def check_script(path: str) -> Path:
    """The script's path, or BadInputError (exit 2, one line) when it is not a file."""
    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"{path}: no such file (the script of one training step)"
                            if not p.exists() else f"{path}: not a file")
    return p


def script_census(path: str, device: str, *, timeout: float = DEFAULT_TIMEOUT,
                  warmup: int = DEFAULT_WARMUP, runs: int = DEFAULT_RUNS,
                  sink: Any = None) -> Census:
    """The census of the script on `device` (see the module docstring's contract): `warmup`
    runs uncounted, then `runs` counted ones combined by coverage.least_disturbed.

    Raises BadInputError (exit 2, one line naming the file) for a path that is not a file, a
    script that raises or exits non-zero, a child that dies or runs past `timeout`, and a script
    that ran no op; ScreenerError (exit 1) when the census itself failed."""
    p = check_script(path)
    request = {"path": str(p), "device": device, "warmup": warmup, "runs": runs,
               "threads": DEFAULT_THREADS}
    result = run_child("script", request, device, timeout=timeout, sink=sink)
    if "runs" in result:
        census = least_disturbed([Census.from_dict(c) for c in result["runs"]])
        if census.total_us <= 0:
            raise BadInputError(
                f"{path}: ran no {census.kind} op on {device}: does it run its step when run as "
                f"a program (at its top level or under `if __name__ == \"__main__\":`), on "
                f"${DEVICE_ENV}, and inside its record_function({STEP_MARK!r}) if it has one?")
        return census
    if result.get("whose") == "ours":
        raise ScreenerError(f"the census of {path} failed: {result.get('error')}")
    # "FILE:LINE: raised E: message", as a compiler names a place: the script's own line that
    # raised (not torch's), with no traceback.
    where = result.get("where")
    raise BadInputError(f"{path}{f':{where}' if isinstance(where, int) else ''}: "
                        f"{result.get('error')}")


def jobs_census(specs: Sequence[JobSpec], device: str, *, timeout: float = DEFAULT_TIMEOUT,
                sink: Any = None) -> dict[str, Census]:
    """Each job's census on `device` (job name -> census), all from one child. Raises
    ScreenerError (exit 1) when a job or the child failed: the jobs are ours."""
    request = {"device": device, "threads": DEFAULT_THREADS,
               "jobs": [s.to_dict() for s in specs]}
    result = run_child("jobs", request, device, timeout=timeout, sink=sink)
    if "jobs" not in result:
        raise ScreenerError(f"the jobs' census on {device} failed: {result.get('error')}")
    jobs = result["jobs"]
    if not isinstance(jobs, dict):
        raise ScreenerError(f"the jobs' census child wrote {type(jobs).__name__}, not an object")
    return {name: Census.from_dict(c) for name, c in jobs.items()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
