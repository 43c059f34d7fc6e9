"""The screening child: runs the requested jobs on one device and streams events to its parent.

Run as `python -m screener.known_answer.engine.child child` by screener.known_answer.engine.supervise, one per
device, so that a device that hangs or crashes cannot take the screener down, and so that
determinism is set before CUDA is first touched. It reads one request (protocol.request) on
stdin and writes protocol events on stdout. Before a job allocates anything the child compares
the job's estimated memory and arithmetic with the device (specs.check_fits): a job that
cannot fit is bad input, not a crash or a timeout.

Every failure, ours included, must reach the parent as an error event: a child that merely died
is judged a crash, and a crash is a hardware verdict. That is why torch and the modules that
import it are imported inside `child_main` (under `main`'s catch-all), not at the top: a broken
torch install is then a screener error, not a suspect device.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

from screener.errors import ScreenerError
from screener.known_answer.engine import protocol
from screener.known_answer.engine.fault_spec import DeviceFault
from screener.known_answer.engine.memory import available_bytes
from screener.known_answer.engine.protocol import ErrorKind, Event
from screener.known_answer.engine.specs import JobSpec


def emit(event: Mapping[str, Any]) -> None:
    """Write one event for the parent, at once (it restarts the parent's timeout)."""
    sys.stdout.write(protocol.encode(event))
    sys.stdout.flush()


def is_device_error(e: BaseException) -> bool:
    """A failure of the device (CUDA error, ECC, illegal access), as opposed to one of ours.

    Running out of memory is not: another process holding the GPU's memory says nothing about
    the hardware, so it must not become a suspect verdict."""
    import torch  # see the module docstring: only inside the child's catch-all

    text = str(e)
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text:
        return False
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert",
                            "uncorrectable ECC", "illegal memory access", "unspecified launch"))


def _kind(e: BaseException) -> ErrorKind:
    return protocol.error_kind(e, device_error=is_device_error(e))


def free_bytes(device: str) -> Optional[float]:
    """Memory a job on this device may use: CUDA's free memory, or on the CPU the smaller of
    MemAvailable and what the cgroup limit leaves; None when it cannot be read."""
    if device.startswith("cuda"):
        import torch  # see the module docstring

        return float(torch.cuda.mem_get_info(torch.device(device))[0])
    return available_bytes()


def _start(device: str, threads: int) -> bool:
    """Set determinism and report the platform; False (after an error event) when it failed."""
    from screener.determinism import make_deterministic  # imports torch: see the docstring
    from screener.known_answer.engine.platform import signature  # imports torch

    try:
        make_deterministic(device, threads=threads)
        plat = signature(device)
    except Exception as e:  # noqa: BLE001 - a missing device is bad input, a failing one a verdict
        emit(protocol.error_event(e, _kind(e)))
        return False
    emit({"event": Event.PLATFORM, "platform": plat.to_dict(),
          "platform_hash": plat.numeric_hash})
    return True


def _after_step(faults: Sequence[tuple[int, DeviceFault]],
                fired: list[dict[str, Any]]) -> Optional[Callable[[int, Any], None]]:
    """The train jobs' hook that flips the parameter faults' bits after their optimizer step;
    each flip is recorded in `fired` with its fault's index in the request."""
    from screener.known_answer.engine.faults import corrupt_parameter  # imports torch

    if not faults:
        return None

    def after_step(step: int, model: Any) -> None:
        for index, f in faults:
            if f.step == step:
                rec = corrupt_parameter(model, str(f.parameter), f.element, bit=f.bit or 0)
                fired.append({**rec, "fault": index, "step": step})

    return after_step


# What a corrupted value can make a job raise: an index out of range (IndexError, or a
# RuntimeError from an index or NaN check), a ValueError or an arithmetic error. Such an
# exception may come from the device's wrong arithmetic, and the judgment decides with the
# evidence (peers, golden). Every other exception is a bug of ours whatever the data (a
# KeyError, an AssertionError, an OSError, a TypeError...), and so are RuntimeErrors whose
# message says the setup is at fault; running out of memory is never the device's (another
# process may hold it) and never a verdict.
_MAYBE_THE_DATA = (IndexError, ValueError, RuntimeError, ArithmeticError)
_SETUP_MESSAGES = ("out of memory", "deterministic", "CUBLAS_WORKSPACE_CONFIG",
                   "not implemented", "expected scalar type", "same device", "dtype")


def _job_kind(e: BaseException) -> ErrorKind:
    """Whose fault an exception raised inside a job's run is."""
    kind = _kind(e)
    if kind != ErrorKind.SCREENER:
        return kind
    text = str(e)
    if isinstance(e, (MemoryError, ScreenerError, NotImplementedError)) \
            or type(e).__name__ == "OutOfMemoryError" \
            or any(m.lower() in text.lower() for m in _SETUP_MESSAGES):
        return ErrorKind.SCREENER
    return ErrorKind.JOB if isinstance(e, _MAYBE_THE_DATA) else ErrorKind.SCREENER


# Runs of a job after it raised in one, before the child ends: a job that raised once (a
# corrupted position id) is re-run before any verdict, so that the runs that show it completes
# on this device happen (the judgment: screener.known_answer.verdict.endings).
RERUNS_AFTER_RAISE = 2

_Ran = Literal["ok", "raised", "stop"]


def _run_one(spec: JobSpec, it: int, device: str, request: Mapping[str, Any],
             faults: Sequence[DeviceFault]) -> _Ran:
    """Run one job once and emit its result: "ok"; "raised" when the job raised something a
    corrupted value can cause (the error event says the child goes on); "stop" after any other
    error event (ours, the device's, bad input: the child ends)."""
    from screener.known_answer.engine.faults import inject  # imports torch
    from screener.known_answer.engine.specs import check_fits
    from screener.known_answer.engine.workloads import gemm_shapes, run_job

    threads = int(request.get("threads", protocol.DEFAULT_THREADS))
    emit({"event": Event.START, "job": spec.name, "iteration": it})
    mine = [(i, f) for i, f in enumerate(faults) if f.applies(spec.name, it)]
    op_faults = [(i, f) for i, f in mine if f.op is not None]
    injector = inject(*(f.fault_spec() for _, f in op_faults)) if op_faults else None
    flipped: list[dict[str, Any]] = []
    try:
        if it == 0:  # before the job allocates anything
            p = spec.params_for(device)
            check_fits(spec, device, free_bytes=free_bytes(device),
                       timeout_s=request.get("timeout"), threads=threads,
                       shapes=gemm_shapes(p, device) if spec.kind == "gemm" else None)
        result = run_job(spec, device, injector=injector, threads=threads,
                         after_step=_after_step([(i, f) for i, f in mine if f.parameter is not None],
                                                flipped))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
        kind = _job_kind(e)
        event = protocol.error_event(e, kind, spec.name, it)
        event["fired"] = _fired(injector, op_faults, flipped)
        # A job's own raise leaves the device usable: go on, so the job is run again. A device
        # error (a CUDA context that may be gone), ours or bad input end the child.
        event["continues"] = kind == ErrorKind.JOB
        emit(event)
        return "raised" if kind == ErrorKind.JOB else "stop"
    out: dict[str, Any] = {"event": Event.RESULT, "iteration": it, "result": result.to_dict()}
    if mine:
        out["fired"] = _fired(injector, op_faults, flipped)
    emit(out)
    return "ok"


def _fired(injector: Any, op_faults: Sequence[tuple[int, DeviceFault]],
           flipped: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What fired in a job's run, each record naming its fault's index in the request."""
    recs = [{**r, "fault": op_faults[r["spec"]][0]} for r in (injector.fired if injector else ())]
    return recs + list(flipped)


def child_main(request: Mapping[str, Any]) -> int:
    """Run the requested jobs on one device and stream events (see protocol) to stdout."""
    import torch  # noqa: F401 - import time is part of start-up, before the first event

    device = request["device"]
    if not _start(device, int(request.get("threads", protocol.DEFAULT_THREADS))):
        return 0
    specs = [JobSpec.from_dict(d, source=d.get("path", d["name"])) for d in request["jobs"]]
    faults = [DeviceFault(**f) for f in request.get("faults", [])]
    iterations = request.get("iterations")
    duration = request.get("duration")
    t0 = time.monotonic()
    it = 0
    since_raise: dict[str, int] = {}  # job -> its runs after the first one that raised

    def run(spec: JobSpec) -> bool:
        ran = _run_one(spec, it, device, request, faults)
        if spec.name in since_raise:
            since_raise[spec.name] += 1
        elif ran == "raised":
            since_raise[spec.name] = 0
        return ran != "stop"

    while True:
        for spec in specs:
            if not run(spec):
                return 0
        it += 1
        # With both a duration and a count, whichever ends first; always at least one iteration.
        if duration is not None and time.monotonic() - t0 >= float(duration):
            break
        if (iterations is not None or duration is None) and it >= int(iterations or 1):
            break
    # A job that raised is run again before the child ends (at most RERUNS_AFTER_RAISE more
    # iterations, of those jobs only).
    while rerun := [s for s in specs if since_raise.get(s.name, RERUNS_AFTER_RAISE)
                    < RERUNS_AFTER_RAISE]:
        for spec in rerun:
            if not run(spec):
                return 0
        it += 1
    emit({"event": Event.DONE, "iterations": it})
    return 0


def main(argv: Sequence[str]) -> int:
    """`child`: read the request on stdin and run it; anything else is a usage error (2)."""
    if list(argv[:1]) != ["child"]:
        print(f"usage: python -m {protocol.CHILD_MODULE} child  (internal: reads a JSON request "
              f"on stdin)", file=sys.stderr)
        return 2
    try:
        return child_main(json.loads(sys.stdin.read()))
    except Exception as e:  # noqa: BLE001 - see the module docstring
        # Whatever escaped child_main (a bad request, a bad fault, a bug of ours outside a job)
        # must reach the parent as an error event.
        emit(protocol.error_event(e, _kind(e)))
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
