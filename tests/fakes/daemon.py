"""The daemon's test rig and scripted stand-ins, shared by every test that runs the daemon loop.

- `DaemonRig`: a real Daemon on a FakeClock, with a real LocalStore and real probes over a scripted
  NVML (two healthy H100s); `tick(advance)` moves the clock and runs one pass.
- `ScriptedRunner`: the screen runner, answering scripted outcomes in turn (in place of the
  known-answer child processes); `wait_for_cancel` makes a screen wait for the daemon's cancel.
- `outcome`, `verdicts`, `as_full_burnin`: build what a quick screen or a full burn-in returns;
  `alarm`, the alarm record a job's auditor drops for the daemon to take in.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

from fakes.clock import FakeClock
from fakes.fake_nvml import FakeNvml, h100
from screener.agent.daemon.loop import Daemon
from screener.agent.metrics import DaemonMetrics
from screener.agent.screening.window import LocalTaint, ScreenOutcome, ScreenRequest
from screener.audit.alarms import write_alarm_file
from screener.health.sources import host
from screener.health.sources.nvml import NvmlAdapter
from screener.health.probes import run_probes
from screener.settings.daemon import DaemonConfig
from screener.settings.health import ProbeConfig
from screener.stores.local import LocalStore
from screener.alarmfile import AlarmRecord
from screener.types import ExitCode, Outcome, SuspectNode, Verdict

__all__ = ["NODE", "DaemonRig", "FakeClock", "ScriptedRunner", "alarm", "as_full_burnin",
           "outcome", "verdicts", "wait_for_cancel"]

NODE = "gpu-node-1"


def alarm(alarm_id: str, *, settled: bool = True, node: str = NODE, step: int = 7) -> AlarmRecord:
    """A ring-replay alarm about `node` (settled: rank 3 named), as a job's auditor writes it."""
    return AlarmRecord(alarm_id=alarm_id, check="ring_replay", step=step, settled=settled,
                       suspect_ranks=(3,) if settled else (),
                       suspect_nodes=(SuspectNode(node=node, hostname=node),), node=node,
                       job="train-llm", created=1000.0, evidence={"rows": [1, 2]})


def verdicts(outcome: Outcome, devices=("cuda:0", "cuda:1"), reason: str = "") -> tuple[Verdict, ...]:
    """One verdict per device, all `outcome`, on one job and platform."""
    return tuple(Verdict(device=d, outcome=outcome, reason=reason, job="gemm-fp32",
                         platform_hash="p1") for d in devices)


def outcome(kind: Outcome, **kw: Any) -> ScreenOutcome:
    """A quick screen's result: `kind` on both GPUs (a suspect one a golden mismatch), with its
    exit code and digests; `kw` sets any other ScreenOutcome field."""
    code = {Outcome.PASS: ExitCode.PASS, Outcome.SUSPECT: ExitCode.HARDWARE_SUSPECT,
            Outcome.INCONCLUSIVE: ExitCode.INCONCLUSIVE}[kind]
    vs = kw.pop("verdicts", None)
    if vs is None:
        vs = verdicts(kind, reason="golden_mismatch" if kind == Outcome.SUSPECT else "")
    return ScreenOutcome(outcome=kind, verdicts=vs, exit_code=code,
                         digests={v.device: {"gemm-fp32": "d1"} for v in vs}, **kw)


def as_full_burnin(o: ScreenOutcome, *, iterations: int = 2, seconds: float = 5.0,
                   hbm: str = "pass") -> ScreenOutcome:
    """What the burn-in worker returns for `o`'s verdicts: its device stages (the known-answer
    rounds with their repeats and time, the HBM test, the collective across the devices)."""
    devices = [v.device for v in o.verdicts]
    stages = (
        {"name": "known-answer", "outcome": o.outcome.value, "seconds": seconds,
         "data": {"iterations": {d: iterations for d in devices}, "devices": devices,
                  "jobs": ["gemm-fp32"], "seconds": seconds}},
        {"name": "hbm", "outcome": hbm, "seconds": 0.1, "data": {}},
        {"name": "collective", "outcome": "pass", "seconds": 0.1, "data": {}},
    )
    return replace(o, kind="full", stages=stages)


class ScriptedRunner:
    """Returns the scripted outcomes in turn; `during(request)` runs inside the screen first
    (to land a job, raise, or wait for the cancel). Asked for a full burn-in, it answers as the
    burn-in worker does (the outcome with its device stages) unless the script gave stages."""

    def __init__(self, *outcomes: ScreenOutcome,
                 during: Optional[Callable[[ScreenRequest], Optional[ScreenOutcome]]] = None) -> None:
        self.outcomes = list(outcomes)
        self.during = during
        self.calls: list[ScreenRequest] = []

    def __call__(self, request: ScreenRequest) -> ScreenOutcome:
        self.calls.append(request)
        if self.during is not None:
            early = self.during(request)
            if early is not None:
                return early
        if not self.outcomes:
            raise AssertionError("the daemon screened more often than the test expected")
        out = self.outcomes.pop(0)
        if request.kind == "full" and not out.stages and not out.stopped:
            out = as_full_burnin(out)
        return out


def wait_for_cancel(limit: float = 20.0) -> Callable[[ScreenRequest], Optional[ScreenOutcome]]:
    """A ScriptedRunner `during` that holds the screen until the daemon cancels it (a job landed)."""
    def during(request: ScreenRequest) -> Optional[ScreenOutcome]:
        if not request.cancel.wait(limit):
            raise AssertionError("the screen was never cancelled")
        return ScreenOutcome.inconclusive("cancelled", "runner saw the cancel")

    return during


class FakeNodeObject:
    """A NodeObject (screener.agent.daemon.ports) for a rig outside a cluster: the pods a test
    scripts, the annotations published kept, the spool replay a test's function (none: 0), no
    intents, no creation time."""

    def __init__(self, pods: Any = None, *, replay: Any = None) -> None:
        self.pods, self._replay = pods, replay
        self.published: list[dict[str, Any]] = []

    def gpu_pods(self) -> list[Any]:
        return list(self.pods()) if self.pods is not None else []

    def publish(self, annotations: Any) -> None:
        self.published.append(dict(annotations))

    def created(self) -> Optional[float]:
        return None

    def replay(self) -> int:
        return int(self._replay()) if self._replay is not None else 0

    def finish(self) -> int:
        return 0


class FnProbes:
    """A Probes port (screener.agent.daemon.ports) over a test's probe function: run(previous)
    calls it; commit() calls `commit` (default: nothing to save)."""

    def __init__(self, fn: Any, commit: Any = None) -> None:
        self.fn, self._commit, self.runs = fn, commit, 0

    def run(self, previous: Any) -> Any:
        self.runs += 1
        return self.fn(previous)

    def commit(self) -> None:
        if self._commit is not None:
            self._commit()


class FakeHost:
    """A Host (screener.agent.daemon.ports) a test scripts: our PIDs (none by default), the boot
    time (the real host's by default), the boot id (None: not read), the uid (the real one by
    default) and the tools' environment (None: the test's own)."""

    def __init__(self, pids: Any = None, *, boot: Any = None, ident: Any = None,
                 uid: Optional[int] = None, env: Optional[dict[str, str]] = None) -> None:
        self.pids, self.boot, self.ident, self._uid, self.env = pids, boot, ident, uid, env

    def own_pids(self) -> set[int]:
        return set(self.pids()) if self.pids is not None else set()

    def boot_time(self) -> float:
        return float(self.boot()) if self.boot is not None else host.boot_time()

    def boot_id(self) -> Optional[str]:
        return self.ident() if self.ident is not None else None

    def uid(self) -> int:
        return os.geteuid() if self._uid is None else self._uid

    def tool_env(self) -> Optional[dict[str, str]]:
        return self.env


class DaemonRig:
    """A daemon on the fake clock with a scripted NVML (two healthy H100s)."""

    def __init__(self, tmp_path: Path, runner: Any, *, store: Any = None, taint: Any = None,
                 node_object: Any = None, nvml: Optional[FakeNvml] = None, own_pids=None, boot=None,
                 env: Optional[dict[str, str]] = None, uid: Optional[int] = None, daemon_kw: Optional[dict[str, Any]] = None, clock: Any = None,
                 **config: Any) -> None:
        self.tmp = tmp_path
        self.clock = clock if clock is not None else FakeClock()
        self.nvml = nvml or FakeNvml([h100(0), h100(1)])
        self.adapter = NvmlAdapter(self.nvml, events=False)
        self.adapter.open()
        probe_cfg = ProbeConfig(kmsg_path=None, disk_paths=(str(tmp_path),),
                                min_free_disk_fraction=0.0, min_free_memory_fraction=0.0)

        self.probes = FnProbes(lambda previous: run_probes(probe_cfg, nvml=self.adapter,
                                                           previous=previous, clock=self.clock))
        settings = dict(node=NODE, alarm_dir=str(tmp_path / "alarms"), store="local",
                        tick_s=5.0, probe_interval_s=60.0, idle_window_s=300.0,
                        screen_interval_s=86400.0, retry_inconclusive_s=600.0,
                        screen_time_cap_s=900.0, job_poll_s=0.02, metrics_port=-1,
                        burnin_duration_s=1.0, untaint_retry_s=0.01)
        settings.update(config)
        self.config = DaemonConfig.from_mapping(settings)
        self.store = store if store is not None else LocalStore(tmp_path / "state.db")
        self.taint = taint if taint is not None else LocalTaint(tmp_path / "taint")
        self.runner = runner
        self.metrics = DaemonMetrics(NODE, clock=self.clock)
        self.stop = threading.Event()
        self.daemon = Daemon(self.config, store=self.store, probes=self.probes, runner=runner,
                             taint=self.taint, node_object=node_object,
                             host=FakeHost(own_pids, boot=boot, env=env, uid=uid), metrics=self.metrics,
                             clock=self.clock, stop=self.stop, **(daemon_kw or {}))

    @property
    def probe_calls(self) -> int:
        return self.probes.runs

    def tick(self, advance: float = 0.0, **kw: Any):
        self.clock.advance(advance)
        return self.daemon.tick(**kw)

    def drop_alarm(self, alarm_id: str, *, settled: bool = True, node: str = NODE) -> None:
        record = AlarmRecord(alarm_id=alarm_id, check="weights", step=12, settled=settled,
                             suspect_ranks=(1,) if settled else (),
                             suspect_nodes=(SuspectNode(node, node),), node=node, job="llm",
                             created=self.clock() - 2.0)
        write_alarm_file(record, self.config.alarm_dir)

    def close(self) -> None:
        self.adapter.close()
        self.store.close()
