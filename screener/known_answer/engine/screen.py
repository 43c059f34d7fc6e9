"""Known-answer screening, end to end: pick the jobs and devices, run them, judge the results.

`run_screen` is the plain function the CLI, the burn-in and the daemon call; `record_goldens`
is `screener golden record`'s. Each is the same two halves: run a child process per device
(screener.known_answer.engine.supervise.execute) and decide (screener.known_answer.verdict.judgment.judge, or
screener.known_answer.engine.recording.write_goldens). The other parts of the engine:

- specs / workloads: the job specs (jobs/*.toml) and the work each describes;
- fault_spec: the `--fault` option's DeviceFault, for drills and tests;
- protocol / child: the request a child reads and the events it streams back;
- runs: what a child produced (DeviceRun), the judgment's input;
- reference / endings / screen_result: the judgment's parts (what results are judged against,
  what a child's ending says, how issues become verdicts);
- results: a job's steps and where two results differ;
- text: the verdict table.

The burn-in and the daemon's screening worker take the engine's entry points from here
(execute, judge, DeviceFault, ScreenResult, DEFAULT_TIMEOUT, Progress, as imported below).

A broken golden file is bad input (GoldenError, exit 2), never a verdict; it is found before
any device runs (prevalidate_goldens).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from screener.errors import BadInputError
from screener.known_answer.engine import golden as _golden
from screener.known_answer.engine import promotion
from screener.known_answer.engine.fault_spec import DeviceFault
from screener.known_answer.verdict.judgment import GoldenLookup, Known, ScreenResult, judge
from screener.known_answer.engine.protocol import DEFAULT_THREADS
from screener.known_answer.verdict.quorum import FleetView
from screener.known_answer.verdict.runs import DeviceRun
from screener.known_answer.engine.recording import RecordResult, write_goldens
from screener.known_answer.engine.supervise import DEFAULT_TIMEOUT, Progress, execute
from screener.known_answer.engine.specs import JobSpec, select_jobs


log = logging.getLogger("screener.known_answer")


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


def _local_devices() -> list[str]:
    # platform imports torch at its top (about 1 s): only when asked for "all", so that
    # `screener kat run --device cpu` and the CLI's start-up do not pay for it.
    from screener.known_answer.engine.platform import local_devices

    return local_devices()


def resolve_devices(devices: Optional[Sequence[str]]) -> list[str]:
    """Device names; None, empty or "all": every local CUDA device, or the CPU without one."""
    if not devices or list(devices) == ["all"]:
        return _local_devices()
    out: list[str] = []
    for d in devices:
        if d == "all":
            out.extend(x for x in _local_devices() if x not in out)
            continue
        if d == "cuda":
            d = "cuda:0"
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()):
            raise BadInputError(f"device {d!r} is not cpu, cuda:N or all")
        if d not in out:
            out.append(d)
    return out


def golden_lookup(golden_dir: Optional[str],
                  promoted: Optional[Mapping[str, Mapping[str, str]]] = None) -> GoldenLookup:
    """The golden records of a folder (default: golden.default_golden_dir()), then the goldens
    the fleet promoted from a quorum (screener.known_answer.engine.promotion; the folder's come first:
    a person's record is never overridden by the fleet's)."""
    d = golden_dir or str(_golden.default_golden_dir())
    cache: dict[tuple[str, str], Any] = {}

    def lookup(spec: JobSpec, platform_hash: str) -> Any:
        key = (spec.name, platform_hash)
        if key not in cache:
            cache[key] = _golden.find(d, spec, platform_hash)
            if cache[key] is None and promoted:
                cache[key] = promotion.load(promoted, spec, platform_hash)
            log.debug("golden for %s on platform %s: %s", spec.name, platform_hash,
                      getattr(cache[key], "path", None) or f"none in {d}")
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
    n = 0
    for spec in specs:
        for p in sorted(Path(golden_dir).glob(f"{spec.name}.*.json")):
            _golden.load(p, spec=spec)
            n += 1
    return n


def run_screen(jobs: Optional[Sequence[str | JobSpec]] = None,
               devices: Optional[Sequence[str]] = ("cpu",), *,
               golden_dir: Optional[str] = None, jobs_dir: Optional[str] = None, repeat: int = 1,
               duration: Optional[float] = None, timeout: float = DEFAULT_TIMEOUT,
               faults: Optional[Mapping[str, Sequence[DeviceFault]]] = None,
               progress: Optional[Progress] = None,
               known: Optional[Known] = None,
               fleet: Optional[FleetView] = None) -> ScreenResult:
    """Screen devices with known-answer jobs (default: the quick screen) and judge the results.

    repeat: runs of each job per device (>= 2 adds the self-consistency check); duration: keep
    repeating for that many seconds instead. known: what this node's earlier screens produced
    (platform hash -> job -> digest): where no golden or majority exists it says which of a
    device's disagreeing repeats is right (screener.known_answer.verdict.judgment). fleet: the other
    nodes' results and the promoted goldens (see judge_runs). Raises GoldenError
    (bad golden, exit 2) or ScreenerError (exit 1, a failure of ours); a bad device is a
    Verdict, never an exception.
    """
    if repeat < 1:
        raise BadInputError(f"repeat {repeat} must be >= 1")
    specs = resolve_jobs(jobs, jobs_dir)
    devs = resolve_devices(devices)
    if golden_dir is None:
        golden_dir = str(_golden.default_golden_dir())
    prevalidate_goldens(golden_dir, specs)
    t0 = time.monotonic()
    runs = execute(specs, devs, iterations=repeat, duration=duration, timeout=timeout,
                   faults=faults, progress=progress)
    return judge_runs(runs, specs, golden_dir, seconds=time.monotonic() - t0, known=known,
                      fleet=fleet)


def judge_runs(runs: Mapping[str, DeviceRun], specs: Sequence[JobSpec], golden_dir: str, *,
               seconds: float, known: Optional[Known] = None,
               fleet: Optional[FleetView] = None) -> ScreenResult:
    """Judge a screen's runs (screener.known_answer.verdict.judgment.judge) against the folder's goldens,
    then the fleet's promoted ones, a quorum of other nodes, and this node's earlier screens;
    with a fleet view, the result carries the goldens this screen promotes
    (ScreenResult.promote: screener.known_answer.engine.promotion), for the caller to store."""
    lookup = golden_lookup(golden_dir, fleet.promoted if fleet is not None else None)
    result = judge(runs, specs, lookup, golden_dir=golden_dir, seconds=seconds, known=known,
                   fleet=fleet)
    if fleet is None:
        return result
    promote = promotion.promotions(result, runs, specs, fleet)
    return replace(result, promote=promote) if promote else result


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
    if repeat < 1:
        raise BadInputError(f"repeat {repeat} must be >= 1")
    out = out_dir or str(_golden.default_golden_dir())
    devs = resolve_devices(devices)
    t0 = time.monotonic()
    runs = execute(specs, devs, iterations=repeat, timeout=timeout, progress=progress,
                   faults=faults)
    return write_goldens(runs, specs, out, repeat=repeat, force=force,
                         seconds=time.monotonic() - t0)


def local_platform(device: str = "cpu", threads: int = DEFAULT_THREADS) -> Any:
    """The platform signature of `device` as a screening child sees it (thread count pinned)."""
    # torch, determinism and platform (both import torch) here, not at the top: importing
    # torch takes about 1 s, and the parent of a screen and the CLI's kat commands stay light.
    import torch

    from screener.determinism import preserved
    from screener.known_answer.engine.platform import signature

    with preserved():
        torch.set_num_threads(threads)
        return signature(device)
