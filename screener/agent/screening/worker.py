"""The screen worker: the process in which the daemon's screens run (see
screener.agent.screening.window).

`ScreenProcessRunner` starts it as `python -m screener.agent.screening worker RESULT.json MODE`, with
its ScreenOptions as JSON on stdin. MODE "screen" runs the quick known-answer screen
(screener.known_answer.engine.screen.run_screen); MODE "burnin" runs the device stages of a full
burn-in (the known-answer rounds for the configured duration, the HBM test, the intra-node
collective: screener.agent.burnin.full). It writes the result as JSON and exits with the screen's
code. A process of its own, so that stopping a screen is a kill that takes effect at once, and so
that the daemon never imports torch.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any, Mapping, Optional, Sequence

from screener.atomicfile import write_atomic
from screener.agent.burnin import full as burnin
from screener.errors import ScreenerError
from screener.known_answer.engine.screen import (
    DEFAULT_TIMEOUT,
    DeviceFault,
    resolve_devices,
    resolve_jobs,
    run_screen,
)
from screener.known_answer.verdict.quorum import FleetView
from screener.lifecycle.machine import KIND_FULL
from screener.types import Outcome


def first_is_final(first: burnin.BurninReport, iterations: int) -> bool:
    """Whether the burn-in's timed rounds stand as its result, or a run of `iterations` repeats
    must follow (the duration was too short to repeat every job that often).

    A mismatch always stands: it is evidence against the device, and a second run that happens to
    pass (an intermittent fault) must never replace it.
    """
    return (first.outcome == Outcome.SUSPECT
            or min(first.screen.iterations.values(), default=0) >= iterations)


def _burnin_stages(opts: Mapping[str, Any], faults: Any) -> dict[str, Any]:
    """The device stages of a full burn-in, as a screen result dict with the stages."""
    devices = resolve_devices(opts.get("devices") or None)
    specs = resolve_jobs(opts.get("jobs") or None, opts.get("jobs_dir"), quick_only=False)
    seconds = float(opts.get("burnin_seconds") or 0.0)
    iterations = int(opts.get("burnin_min_iterations") or 2)
    # What this node's earlier screens produced, and what the fleet says: a burn-in judges with
    # them as a screen does.
    known = opts.get("known") or None
    fleet = _fleet(opts)

    def rounds() -> burnin.BurninReport:
        # Both: keep going for the duration, but never fewer than the required repeats.
        if seconds > 0:
            first = burnin.run_burnin(devices, specs, duration=seconds,
                                      golden_dir=opts.get("golden_dir"),
                                      jobs_dir=opts.get("jobs_dir"),
                                      timeout=float(opts.get("job_timeout_s") or DEFAULT_TIMEOUT),
                                      faults=faults, known=known, fleet=fleet)
            if first_is_final(first, iterations):
                return first
        return burnin.run_burnin(devices, specs, iterations=iterations,
                                 golden_dir=opts.get("golden_dir"), jobs_dir=opts.get("jobs_dir"),
                                 timeout=float(opts.get("job_timeout_s") or DEFAULT_TIMEOUT),
                                 faults=faults, known=known, fleet=fleet)

    plan = burnin.BurninPlan(probes=False, crosscheck=False, lifecycle=False,
                             hbm_fraction=float(opts.get("hbm_fraction") or 0.5),
                             hbm_max_bytes=opts.get("hbm_max_bytes"))
    rep = burnin.run_full_burnin("", devices, rounds, plan=plan, store=None)
    assert rep.known_answer is not None
    d = rep.known_answer.screen.to_dict()
    d["screen_kind"] = KIND_FULL
    d["stages"] = [st.to_dict() for st in rep.stages]
    d["verdicts"] = [v.to_dict() for st in rep.stages for v in st.verdicts]
    d["outcome"] = rep.outcome.value
    d["exit_code"] = int(rep.exit_code)
    return d


def _fleet(opts: Mapping[str, Any]) -> Optional[FleetView]:
    """The fleet view the daemon passed (screener.known_answer.verdict.quorum), or None without one."""
    raw = opts.get("fleet")
    return FleetView.from_dict(raw) if isinstance(raw, Mapping) else None


def _worker(result_path: str, mode: str = "screen") -> int:
    """The worker process: read ScreenOptions as JSON on stdin, screen (or run the burn-in's device
    stages), write the result JSON."""

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the screen's execute, which kills its children

    signal.signal(signal.SIGTERM, on_term)
    opts = json.loads(sys.stdin.read() or "{}")
    faults = {dev: [DeviceFault(**f) for f in fs] for dev, fs in (opts.get("faults") or {}).items()}
    try:
        if mode == "burnin":
            data = _burnin_stages(opts, faults or None)
            code = int(data["exit_code"])
        else:
            result = run_screen(opts.get("jobs") or None, opts.get("devices") or None,
                                golden_dir=opts.get("golden_dir"), jobs_dir=opts.get("jobs_dir"),
                                repeat=int(opts.get("repeat") or 1),
                                timeout=float(opts.get("job_timeout_s") or DEFAULT_TIMEOUT),
                                faults=faults or None, known=opts.get("known") or None,
                                fleet=_fleet(opts))
            data, code = result.to_dict(), int(result.exit_code)
    except ScreenerError as e:
        print(f"screener: {e}", file=sys.stderr)
        return int(e.exit_code)
    write_atomic(result_path, json.dumps(data, default=str))
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`worker RESULT.json [screen|burnin]`: the worker's command line (argv without the program)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) in (2, 3) and args[0] == "worker":
        return _worker(args[1], args[2] if len(args) == 3 else "screen")
    print("usage: python -m screener.agent.screening worker RESULT.json [screen|burnin]",
          file=sys.stderr)
    return 2
