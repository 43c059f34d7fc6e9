"""The fire drill: inject a fault into a small training job and follow the alarm to the node label.

Anyone can run it on a laptop (`screener drill`), and it exercises the whole path end to end:

1. a small DDP training (screener.known_answer.engine.synthetic's tiny language model) runs as one process per
   simulated node, gloo on the CPU, with the in-job Auditor checking every step;
2. at step `fault_step` one bit of one matmul output flips on the faulty node (the lowest mantissa
   bit: the smallest error there is);
3. the audit's ring replay sees the mismatch, a rank on a third node settles it, every rank raises
   the same SDCAlarm, and the faulty node's lowest rank writes the alarm file into the alarm folder;
4. one daemon pass per node (screener.agent.daemon.loop, screens off) takes the files in: the faulty
node's
   daemon applies the settled alarm through the lifecycle and records the transition in the store
   (the local SQLite store, or with a kubeconfig the cluster's Node objects);
5. the drill prints the path the alarm took with the time of each hop, and passes (exit 0) when the
   fault was caught and the faulty node, and only it, ended quarantined.

Against a real cluster (`--kubeconfig`, with three real node names) the faulty node is really
labelled and tainted quarantined: release it afterwards with `screener node set NODE burnin`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.agent.daemon.loop import Daemon
from screener.agent.daemon.passreport import PassReport
from screener.agent.daemon.ports import DaemonPorts
from screener.agent.screening.window import ScreenOutcome, ScreenRequest
from screener.errors import BadInputError
from screener.lifecycle.ports import Store
from screener.health.probes import NodeProbes
from screener.known_answer.collective.peer_training import (PeerFault, PeerOptions, PeerResult,
                                                            run_local)
from screener.settings.daemon import DaemonConfig
from screener.settings.health import ProbeConfig
from screener.types import ExitCode, NodeState

DEFAULT_NODES = ("drill-node-a", "drill-node-b", "drill-node-c")


@dataclass(frozen=True)
class DrillOptions:
    """Which simulated nodes take part, which one is faulty, and when the fault strikes."""

    nodes: tuple[str, ...] = DEFAULT_NODES
    faulty: str = "drill-node-b"
    steps: int = 4
    fault_step: int = 2
    op: str = "matmul"
    # The second matmul of the forward (attention weights times values): a flip of the lowest bit
    # of the first one (the attention scores) is rounded away by the softmax and never reaches
    # the result, so it is no fault a drill can show being caught.
    call: int = 1
    element: int = 9
    bit: int = 0

    def __post_init__(self) -> None:
        if len(self.nodes) < 3 or len(set(self.nodes)) != len(self.nodes):
            raise BadInputError("the drill needs three distinct nodes (a third settles the audit)")
        if self.faulty not in self.nodes:
            raise BadInputError(f"the faulty node {self.faulty!r} is not one of {', '.join(self.nodes)}")
        if not 0 <= self.fault_step < self.steps:
            raise BadInputError(f"fault step {self.fault_step} must be within the {self.steps} steps")


@dataclass
class DrillReport:
    """What happened, hop by hop, and whether the drill passed."""

    options: DrillOptions
    hops: list[dict[str, Any]] = field(default_factory=list)  # {"time", "what", "where"}
    alarm: Optional[Mapping[str, Any]] = None
    alarm_files: list[str] = field(default_factory=list)
    states: dict[str, Optional[str]] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    store: str = "local"
    fault_fired: bool = True  # False: the drill tested nothing (exit 2, not a pass or a failure)

    @property
    def caught(self) -> bool:
        return bool(self.alarm and self.alarm.get("settled")
                    and [n["node"] for n in self.alarm.get("suspect_nodes") or ()] == [self.options.faulty])

    @property
    def ok(self) -> bool:
        return self.caught and not self.problems

    @property
    def exit_code(self) -> ExitCode:
        # A drill whose fault never fired tested nothing: its options were wrong (2). One that
        # fails otherwise means the pipeline is broken: the screener failed, not the hardware.
        if not self.fault_fired:
            return ExitCode.USAGE
        return ExitCode.PASS if self.ok else ExitCode.SCREENER_ERROR

    def lines(self) -> list[str]:
        t0 = self.hops[0]["time"] if self.hops else 0.0
        out = [f"fire drill: fault on {self.options.faulty}, nodes {', '.join(self.options.nodes)}, "
               f"store {self.store}", ""]
        for h in self.hops:
            out.append(f"  +{h['time'] - t0:8.3f} s  {h['what']}")
        out.append("")
        for node, state in self.states.items():
            mark = "  <- faulty" if node == self.options.faulty else ""
            out.append(f"  {node:<24} {state}{mark}")
        if self.latency:
            out.append("")
            out += [f"  latency {k.replace('_', ' ')}: {v:.3f} s" for k, v in self.latency.items()]
        out.append("")
        if self.ok:
            out.append("PASS: the fault was caught and the faulty node ended quarantined")
        else:
            out += [f"FAIL: {p}" for p in self.problems or ["the fault was not caught"]]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "exit_code": int(self.exit_code), "caught": self.caught,
                "fault_fired": self.fault_fired,
                "faulty": self.options.faulty, "nodes": list(self.options.nodes),
                "store": self.store, "hops": self.hops, "alarm": self.alarm,
                "alarm_files": self.alarm_files, "states": self.states, "latency": self.latency,
                "problems": self.problems}


def run_job(options: DrillOptions, alarm_dir: Path, *, timeout: float = 300.0) -> PeerResult:
    """Steps 1-3: the audited training with the fault."""
    peers = [n for n in options.nodes if n != options.faulty]
    opts = PeerOptions(under_test=options.faulty, steps=options.steps, audit_every=1,
                       weights_every=0, alarm_dir=str(alarm_dir), job="fire-drill",
                       collective_iterations=1,
                       fault=PeerFault(step=options.fault_step, op=options.op, call=options.call,
                                       element=options.element, mode="flip", bit=options.bit))
    return run_local(opts, peers=peers, timeout=timeout)


def daemon_passes(nodes: Sequence[str], alarm_dir: Path, store: Any, *, taint: Any,
                  state_dir: Path, clock: Callable[[], float] = time.time
                  ) -> dict[str, PassReport]:
    """Step 4: one daemon pass per node over the shared alarm folder; node -> PassReport."""
    probe_cfg = ProbeConfig(kmsg_path=None, disk_paths=(str(state_dir),), nvml_events=False,
                            min_free_disk_fraction=0.0, min_free_memory_fraction=0.0)
    probes = NodeProbes(probe_cfg, clock=clock)

    def no_screens(request: ScreenRequest) -> ScreenOutcome:  # screens are off in the drill
        raise AssertionError("the drill runs no screens")

    reports = {}
    for node in nodes:
        # The simulated nodes share one alarm folder: each leaves the others' files to them.
        config = DaemonConfig(node=node, alarm_dir=str(alarm_dir), screens=False, metrics_port=-1,
                              idle_window_s=0.0, probes=probe_cfg, foreign_alarms="leave")
        daemon = Daemon(config, DaemonPorts(store=store, probes=probes, runner=no_screens,
                                            taint=taint, clock=clock))
        reports[node] = daemon.tick(once=True)
    return reports


def run_drill(options: DrillOptions, workdir: str | os.PathLike[str], *, store: Store,
              taint: Any = None, timeout: float = 300.0,
              clock: Callable[[], float] = time.time,
              progress: Callable[[str], None] = lambda s: None) -> DrillReport:
    """The whole drill (see the module docstring) in `workdir`, moving the nodes in `store`, which
    the caller opens and closes: the local store (with its LocalTaint as `taint`) or a cluster's
    (taint None: the kube store taints the Nodes itself).
    progress(name): a stage starts (screener.output.progress: the CLI shows it with elapsed times)."""
    work = Path(workdir)
    alarm_dir = work / "alarms"
    report = DrillReport(options, store="local" if taint is not None else "kube")
    report.hops.append({"time": clock(), "what": f"training starts: {len(options.nodes)} simulated "
                        f"nodes, one rank each, the audit on every step"})
    progress(f"training on {len(options.nodes)} simulated nodes with the in-job audit")
    result = run_job(options, alarm_dir, timeout=timeout)
    fault = _job_hops(report, options, result)
    _alarm_file_hops(report, alarm_dir)
    progress("daemon passes (alarm intake, transitions)")
    passes = daemon_passes(options.nodes, alarm_dir, store, taint=store if taint is None else taint,
                           state_dir=work, clock=clock)
    _daemon_hops(report, passes)
    report.states = {n: (s.value if (s := store.get_state(n)) else None) for n in options.nodes}
    report.hops.sort(key=lambda h: h["time"])
    _judge(report, options, result, fault)
    return report


def _job_hops(report: DrillReport, options: DrillOptions, result: PeerResult
              ) -> Optional[Mapping[str, Any]]:
    """The training's hops (the fault, the alarm) into `report`; returns the fault that fired."""
    # a rank reports the fault it was asked to apply, with what fired ([] when nothing did)
    fault = next((r["fault"] for r in result.ranks if r.get("fault") and r["fault"].get("fired")),
                 None)
    if fault is not None:
        report.hops.append({"time": fault["time"], "what":
                            f"fault injected on {options.faulty} (rank {_rank_on(result, options.faulty)})"
                            f" at step {fault['step']}: bit {options.bit} of element {options.element} "
                            f"of a {options.op} output flipped"})
    else:
        report.fault_fired = False
        report.problems.append("the fault never fired")
    report.alarm = result.alarm
    if result.alarm:
        a = result.alarm
        named = ", ".join(n["node"] for n in a.get("suspect_nodes") or ()) or "nobody"
        report.hops.append({"time": a["time"], "what":
                            f"in-job audit: {a['check']} alarm at step {a['step']}, "
                            f"{'settled' if a['settled'] else 'unsettled'}, names rank(s) "
                            f"{', '.join(map(str, a['suspect_ranks'])) or '-'} on {named}"})
    else:
        report.problems.append("no alarm was raised")
    return fault


def _alarm_file_hops(report: DrillReport, alarm_dir: Path) -> None:
    """One hop per alarm file the job wrote."""
    files = sorted(alarm_dir.glob("*.json"))
    report.alarm_files = [str(p) for p in files]
    for p in files:
        try:
            rec = json.loads(p.read_text())
            report.hops.append({"time": float(rec.get("created") or p.stat().st_mtime),
                                "what": f"alarm file written for {rec.get('node')}: {p}"})
        except (OSError, ValueError):
            report.problems.append(f"unreadable alarm file {p}")
    if not files:
        report.problems.append(f"no alarm file in {alarm_dir}")


def _daemon_hops(report: DrillReport, passes: Mapping[str, PassReport]) -> None:
    """One hop per transition an alarm caused in a daemon pass; a pass's errors are problems."""
    for node, rep in passes.items():
        for t in rep.transitions:
            if t.get("cause", "").startswith("alarm"):
                report.hops.append({"time": t["time"], "what":
                                    f"daemon on {node}: {t['cause']} taken in, "
                                    f"{t['from']} -> {t['to']} recorded ({t['reason']})"})
        report.problems += [f"daemon pass on {node}: {e}" for e in rep.errors]


def _judge(report: DrillReport, options: DrillOptions, result: PeerResult,
           fault: Optional[Mapping[str, Any]]) -> None:
    """Step 5: whether the faulty node, and only it, ended quarantined; the hops' latencies."""
    if report.states.get(options.faulty) != NodeState.QUARANTINED.value:
        report.problems.append(f"{options.faulty} ended {report.states.get(options.faulty)}, "
                               f"not quarantined")
    wrong = [n for n, s in report.states.items()
             if n != options.faulty and s == NodeState.QUARANTINED.value]
    if wrong:
        report.problems.append(f"healthy node(s) quarantined: {', '.join(wrong)}")
    if result.alarm and not report.caught:
        report.problems.append("the alarm did not name the faulty node alone")
    label = next((h["time"] for h in report.hops if h["what"].startswith(f"daemon on {options.faulty}")),
                 None)
    if fault is not None and result.alarm:
        report.latency["fault_to_alarm"] = result.alarm["time"] - fault["time"]
    written = [h["time"] for h in report.hops if h["what"].startswith("alarm file")]
    if written and label is not None:
        report.latency["alarm_file_to_label"] = label - min(written)
    if fault is not None and label is not None:
        report.latency["fault_to_label"] = label - fault["time"]


def _rank_on(result: Any, node: str) -> str:
    ranks = [str(r["rank"]) for r in result.ranks if r["node"] == node]
    return ", ".join(ranks) or "?"


def with_nodes(options: DrillOptions, nodes: Sequence[str], faulty: Optional[str]) -> DrillOptions:
    """Options for named nodes (a real cluster); the faulty one defaults to the second."""
    nodes = tuple(nodes)
    return replace(options, nodes=nodes, faulty=faulty or (nodes[1] if len(nodes) > 1 else ""))
