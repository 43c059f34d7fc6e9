"""Node burn-in: the known-answer rounds, and the full sequence around them.

`screener burnin` on a new, replaced or repaired node runs, in order (`run_full_burnin`):

1. the probes (NVML, kernel log, host): a node that is already visibly broken is reported so;
2. the known-answer rounds (`run_burnin`, in screener.agent.burnin.rounds): every job on every
   device for the duration, each device in one child process for the whole burn-in; every repeat
   is compared with the first (self-consistency), the first with the golden record of the
   device's platform and with the device's peers. Its BurninReport has a per-device, per-job table;
3. the HBM pattern test on every GPU (screener.health.sources.hbm);
4. the intra-node all-reduce check with its bandwidth (screener.known_answer.collective.allreduce);
5. the cross-check of its known-answer digests with other nodes of the same platform, from their
   annotations (screener.known_answer.verdict.crosscheck; only with the kube store);
   (with --peers, on one machine: the peer burn-in of screener.known_answer.collective.peer_training with simulated peer nodes;)
6. the probes again: counters that rose under the sustained load (ECC, Xid, throttling) show here;
7. the lifecycle: probe findings, then every verdict of the stages as one known-answer screen,
   moving the node to healthy (all pass), suspect, quarantined or repair (lemon rule). Only a FULL
   burn-in can make a node healthy: `missing_for_full` lists what a run lacked against its
   `BurninRequirement` (the probes before and after, every job repeated at least twice on every
   device for the configured duration, the HBM test, the collective when there are several
   devices, the cross-check where the fleet has same-platform peers); a run that lacks anything is
   a partial burn-in, recorded as such, and leaves a burnin node in burnin. A mismatch
   that reproduced (the same wrong result on every round of the burn-in, or a device that
   disagreed with itself, or a stuck memory cell seen twice) counts as confirmed.

Each stage is a function of plain inputs; the known-answer rounds are passed to run_full_burnin
as a callable, so the sequence only orders the stages, collects their verdicts and decides the
exit code. The CLI shows progress through screener.output.progress (run_full_burnin's `progress` and
`step`); `TextProgress` is the older known-answer-only bar, kept for library callers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

# The known-answer rounds (stage 2) live in burnin_rounds; callers import their names from here too.
from screener.agent.burnin.rounds import (DEFAULT_ITERATIONS, BurninReport, BurninRow, TextProgress,
                                          run_burnin)
from screener.agent.burnin.summary import QUICK_SUMMARY, node_line, passed_lines
from screener.health.verdict.rules import is_condition
from screener.known_answer.collective.allreduce import run_collective
from screener.known_answer.verdict.crosscheck import cross_check, peer_digests, platform_digests
from screener.known_answer.engine.screen import ScreenResult
from screener.known_answer.collective.peer_training import PeerOptions, run_local
from screener.lifecycle import machine
from screener.lifecycle.events import EVIDENCE_CONFIRMED
from screener.lifecycle.apply import apply_event
from screener.types import NO_WORK_STATES, ExitCode, NodeState, Outcome, Severity, Verdict

# How long a full burn-in keeps the known-answer jobs running by default. The seeds give no
# number: burn-in is "a short stress run" whose length "operators tune from their own repair data"
# (longer catches more infant mortality, and leaves hardware idle). One hour of sustained load is
# short next to the days a node then serves, and long enough to reach thermal steady state.
DEFAULT_BURNIN_SECONDS = 3600.0
MIN_BURNIN_ITERATIONS = 2  # every job at least twice on every device: self-consistency needs two
CONFIRMING_REASONS = ("golden_mismatch", "peer_mismatch", "self_mismatch")


# --- the full sequence around the known-answer rounds -------------------------------------------


@dataclass(frozen=True)
class BurninPlan:
    """Which stages around the known-answer rounds run, and their sizes."""

    probes: bool = True
    hbm: bool = True
    hbm_fraction: float = 0.5
    hbm_max_bytes: Optional[int] = None
    collective: bool = True
    collective_numel: Optional[int] = None
    crosscheck: bool = True
    lifecycle: bool = True


@dataclass(frozen=True)
class Stage:
    """One stage's outcome, its verdicts, and what it measured."""

    name: str
    outcome: Outcome
    seconds: float
    detail: str = ""
    verdicts: tuple[Verdict, ...] = ()
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "outcome": self.outcome.value, "seconds": round(self.seconds, 3),
                "detail": self.detail, "verdicts": [v.to_dict() for v in self.verdicts],
                "data": dict(self.data)}


@dataclass
class FullBurninReport:
    """Every stage, the node's state before and after, and the exit code."""

    node: str
    stages: list[Stage] = field(default_factory=list)
    known_answer: Optional[BurninReport] = None
    state_before: Optional[NodeState] = None
    state_after: Optional[NodeState] = None
    transitions: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # why it was not a full burn-in
    # The store's first failure (opening it, the cross-check's read, the lifecycle's writes):
    # kept, not raised, so the stages' results are printed before it (issue 35).
    store_error: Optional[str] = None
    store_exit: ExitCode = ExitCode.SCREENER_ERROR
    wall_s: Optional[float] = None  # the command's wall time, when the caller measured it
    # `screener burnin --quick`: every stage, no node state kept; a pass is exit 0 and says
    # what a full burn-in would add (screener.agent.burnin.summary).
    quick: bool = False
    required_seconds: float = DEFAULT_BURNIN_SECONDS  # how long a full run keeps the jobs going

    @property
    def kind(self) -> str:
        """"full" when nothing was missing, else "partial" (see missing_for_full)."""
        return "partial" if self.missing else "full"
    @property
    def outcome(self) -> Outcome:
        outs = {s.outcome for s in self.stages}
        if Outcome.SUSPECT in outs:
            return Outcome.SUSPECT
        if Outcome.INCONCLUSIVE in outs or not self.stages:
            return Outcome.INCONCLUSIVE
        return Outcome.PASS

    @property
    def stays_in_burnin(self) -> bool:
        """Every stage that ran passed, but the burn-in was partial, so the lifecycle kept the
        node in burnin: what a script must not read as a pass."""
        return (bool(self.missing) and self.outcome == Outcome.PASS
                and self.state_after == NodeState.BURNIN)

    @property
    def exit_code(self) -> ExitCode:
        if self.outcome == Outcome.SUSPECT or self.state_after in NO_WORK_STATES:
            return ExitCode.HARDWARE_SUSPECT
        # A hardware verdict stands when the store failed (the device is bad either way); any
        # other result was not recorded, so the run did not do its job: the store's own code.
        if self.store_error is not None:
            return self.store_exit
        if self.outcome == Outcome.INCONCLUSIVE:
            return ExitCode.INCONCLUSIVE
        if self.stays_in_burnin:
            return ExitCode.PARTIAL
        return ExitCode.PASS

    def summary(self) -> str:
        """One line saying what happened to the node; never "pass" for a partial burn-in, but
        "pass" for a quick screen whose every stage passed (it never claims to be a burn-in)."""
        missing = f" (missing: {'; '.join(self.missing)})" if self.missing else ""
        if self.quick and self.state_after is None and self.exit_code == ExitCode.PASS:
            return QUICK_SUMMARY
        if self.store_error is not None and self.outcome != Outcome.SUSPECT:
            return f"{self.outcome.value}, but the node's state was not recorded (the store failed)"
        if self.stays_in_burnin:
            return f"partial: node stays in burnin{missing}"
        if self.missing and self.outcome == Outcome.PASS:
            where = (f"node stays {self.state_after.value}" if self.state_after is not None
                     else "no node state kept")
            return f"partial: the stages that ran passed, {where}{missing}"
        return self.outcome.value

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "burnin", "node": self.node, "outcome": self.outcome.value,
                "exit_code": int(self.exit_code), "burnin_kind": self.kind, "quick": self.quick,
                "summary": self.summary(),
                "missing": list(self.missing), "store_error": self.store_error,
                "state_before": self.state_before.value if self.state_before else None,
                "state_after": self.state_after.value if self.state_after else None,
                "transitions": self.transitions, "stages": [s.to_dict() for s in self.stages],
                "known_answer": self.known_answer.to_dict() if self.known_answer is not None else None}

    def extra(self) -> dict[str, Any]:
        """What the full sequence adds to the known-answer burn-in's JSON report (the overall
        outcome and exit code replace the known-answer ones)."""
        d = self.to_dict()
        d.pop("known_answer")
        d.pop("kind")
        return d

    def table(self) -> str:
        lines = []
        if self.known_answer is not None:
            lines += [self.known_answer.table(), ""]
        lines.append(f"{'stage':14s} {'result':13s} {'seconds':>8s}  detail")
        for s in self.stages:
            lines.append(f"{s.name:14s} {s.outcome.value:13s} {s.seconds:8.1f}  {s.detail}")
        lines.append("")
        move = "; ".join(f"{t['from'] or '(new)'} -> {t['to']}" for t in self.transitions)
        quiet = node_line(self)
        if self.store_error is not None and self.state_after is None:
            lines.append(f"node {self.node}: state not recorded (the store failed)")
        elif quiet is not None:
            lines.append(quiet)
        else:
            lines.append(f"node {self.node}: "
                         f"{self.state_before.value if self.state_before else '(new)'} -> "
                         f"{self.state_after.value if self.state_after else '?'}"
                         + (f" ({move})" if move else " (unchanged)"))
        if not self.quick:  # a quick screen is no burn-in; the lines below say what it lacked
            lines.append(f"burn-in: {self.kind}" + (f" (missing: {'; '.join(self.missing)})"
                                                      if self.missing else ""))
        # What passed and what a full burn-in adds, when every stage passed.
        lines += passed_lines(self)
        # The command's wall time when it measured one (imports, child start-up and the store
        # included), else the stages' own sum.
        seconds = self.wall_s if self.wall_s is not None else sum(st.seconds for st in self.stages)
        lines.append(f"overall: {self.summary()} (exit {int(self.exit_code)}) in {seconds:.1f} s")
        return "\n".join(lines)


# --- stages -----------------------------------------------------------------------------------------


def probe_stage(name: str, probe: Callable[[Any], Any], previous: Any = None) -> tuple[Stage, Any]:
    t0 = time.monotonic()
    report = probe(previous)
    return probe_report_stage(name, report, time.monotonic() - t0), report


def probe_report_stage(name: str, report: Any, seconds: float = 0.0) -> Stage:
    """A probes stage from a ProbeReport already taken (the daemon probes on its own)."""
    worst = max((f.severity for f in report.findings), default=Severity.OK)
    outcome = Outcome.SUSPECT if worst >= Severity.SUSPECT else Outcome.PASS
    relevant = [f for f in report.findings if f.severity >= Severity.WARNING]
    detail = ", ".join(f"{f.code} ({f.severity.label})" for f in relevant) or f"worst {worst.label}"
    return Stage(name, outcome, seconds, detail,
                 data={"findings": [f.to_dict() for f in report.findings],
                       "errors": list(report.errors)})


def known_answer_stage(known_answer: Callable[[], BurninReport]) -> tuple[Stage, BurninReport]:
    t0 = time.monotonic()
    rep = known_answer()
    verdicts = tuple(mark_confirmed(v, rep.screen.iterations.get(v.device, 1))
                     for v in rep.screen.verdicts)
    bad = [v for v in verdicts if v.outcome != Outcome.PASS]
    detail = (f"{len(rep.screen.jobs)} job(s) on {len(verdicts)} device(s), "
              + (", ".join(f"{v.device}: {v.reason}" for v in bad) or "all bit-exact"))
    # What missing_for_full checks: how often and how long every job ran on every device.
    data = {"iterations": dict(rep.screen.iterations), "jobs": list(rep.screen.jobs),
            "devices": [v.device for v in rep.screen.verdicts],
            "seconds": round(rep.finished - rep.started, 3)}
    return Stage("known-answer", rep.screen.outcome, time.monotonic() - t0, detail, verdicts,
                 data), rep


@dataclass(frozen=True)
class BurninRequirement:
    """What a burn-in must have done to count as full (and so be able to make a node healthy).

    min_seconds: how long the known-answer jobs ran (the configured duration; CPU tests use
    seconds). min_iterations: repeats of every job on every device. jobs: the jobs that must all
    have run (empty: whatever the run chose). The probes, HBM test, collective (several devices)
    and cross-check (where peers exist) are always required.
    """

    min_seconds: float = DEFAULT_BURNIN_SECONDS
    min_iterations: int = MIN_BURNIN_ITERATIONS
    jobs: tuple[str, ...] = ()


def missing_for_full(stages: Sequence[Mapping[str, Any]], req: BurninRequirement, *,
                     devices: int, peers_available: bool) -> list[str]:
    """What this burn-in lacked to be full (empty: it was full). `stages` are Stage.to_dict()s.

    devices: how many devices the node has (the collective is required when more than one).
    peers_available: the fleet has same-platform peers whose digests can be cross-checked.
    """
    by = {str(s.get("name")): s for s in stages}
    out: list[str] = []
    for name in ("probes-before", "probes-after"):
        if name not in by:
            out.append(f"{name} did not run")
    known_answer = by.get("known-answer")
    if known_answer is None:
        out.append("the known-answer rounds did not run")
    else:
        d = known_answer.get("data") or {}
        its = {str(k): int(v) for k, v in (d.get("iterations") or {}).items()}
        ran = set(d.get("devices") or its)
        if len(ran) < devices:
            out.append(f"known-answer jobs ran on {len(ran)} of {devices} device(s)")
        low = sorted(k for k, v in its.items() if v < req.min_iterations)
        if low or not its:
            out.append(f"every job must repeat at least {req.min_iterations} times on every device "
                       f"({', '.join(f'{k}: {its[k]}' for k in low) or 'no repeats recorded'})")
        if float(d.get("seconds") or 0.0) < req.min_seconds:
            out.append(f"the known-answer jobs ran {float(d.get('seconds') or 0.0):.0f} s of the "
                       f"required {req.min_seconds:g} s")
        lacking = sorted(set(req.jobs) - set(d.get("jobs") or ()))
        if lacking:
            out.append(f"job(s) not run: {', '.join(lacking)}")
    hbm = by.get("hbm")
    if hbm is None or hbm.get("outcome") == Outcome.INCONCLUSIVE.value:
        out.append("the HBM pattern test did not run" if hbm is None
                   else "the HBM pattern test tested nothing")
    if devices > 1 and "collective" not in by:
        out.append("the intra-node collective did not run")
    if peers_available and "crosscheck" not in by:
        out.append("the cross-check with same-platform peers did not run")
    return out


def mark_confirmed(v: Verdict, iterations: int) -> Verdict:
    """A burn-in mismatch that reproduced is confirmed (see the module docstring)."""
    if v.outcome != Outcome.SUSPECT:
        return v
    if v.reason == "self_mismatch" or (v.reason in CONFIRMING_REASONS and iterations >= 2):
        return replace(v, evidence={**dict(v.evidence), EVIDENCE_CONFIRMED: True})
    return v


def hbm_stage(devices: Sequence[str], plan: BurninPlan, inject: Any = None,
              step: Optional[Callable[[str], None]] = None) -> Stage:
    """The HBM pattern test on every device; step(item) after each pattern (progress)."""
    # Here, not at the top: screener.health.sources.hbm imports torch (2.5 s measured with -X importtime
    # here, against 0.5 s for all of screener.agent.daemon.loop), and the daemon, which imports this
    # module, never runs the HBM test itself (its screen worker does).
    from screener.health.sources.hbm import hbm_test

    t0 = time.monotonic()
    results = [hbm_test(d, fraction=plan.hbm_fraction, max_bytes=plan.hbm_max_bytes,
                        inject=inject.get(d) if isinstance(inject, Mapping) else inject,
                        progress=step)
               for d in dict.fromkeys(devices)]
    verdicts = tuple(r.verdict() for r in results)
    bad = [r for r in results if not r.ok]
    untested = [r for r in results if r.ok and r.bytes_tested == 0]
    gib = sum(r.bytes_tested for r in results) / 2**30
    detail = (f"{gib:.2f} GiB on {len(results)} device(s)"
              + (f", {', '.join(f'{r.device}: {r.mismatches} mismatches' for r in bad)}" if bad
                 else f", {min(r.bandwidth_gbps for r in results):.3g} GB/s"))
    if untested and not bad:
        detail += f", nothing allocatable on {', '.join(r.device for r in untested)}"
    outcome = (Outcome.SUSPECT if bad else Outcome.INCONCLUSIVE if untested else Outcome.PASS)
    return Stage("hbm", outcome, time.monotonic() - t0, detail, verdicts,
                 {"devices": [r.to_dict() for r in results]})


def collective_stage(devices: Sequence[str], plan: BurninPlan, inject: Any = None) -> Stage:
    """The intra-node all-reduce with a known answer over the devices."""
    t0 = time.monotonic()
    r = run_collective(devices, numel=plan.collective_numel, inject=inject)
    if not r.ranks:
        return Stage("collective", Outcome.PASS, time.monotonic() - t0, r.detail,
                     data=r.to_dict())
    detail = (f"{r.backend} over {len(r.ranks)} ranks, busbw {r.busbw_gbps:.2f} GB/s"
              + (f", wrong result on {', '.join(r.mismatched)}" if not r.ok else ""))
    return Stage("collective", Outcome.PASS if r.ok else Outcome.SUSPECT, time.monotonic() - t0,
                 detail, r.verdicts(), r.to_dict())


def crosscheck_stage(node: str, screen: ScreenResult, store: Any) -> Stage:
    return crosscheck_digests_stage(node, screen.verdicts, screen.digests, store)


def crosscheck_digests_stage(node: str, verdicts: Sequence[Verdict],
                             digests: Mapping[str, Mapping[str, str]], store: Any) -> Stage:
    """The cross-check of this node's known-answer digests with its same-platform peers'."""
    t0 = time.monotonic()
    cc = cross_check(platform_digests(verdicts, digests), peer_digests(store, node))
    # Too few peers is not a reason to hold a node back: the golden decides then.
    outcome = Outcome.PASS if cc.outcome == Outcome.INCONCLUSIVE else cc.outcome
    return Stage("crosscheck", outcome, time.monotonic() - t0, cc.detail,
                 (cc.verdict(node),) if cc.outcome == Outcome.SUSPECT else (), cc.to_dict())


def peers_stage(node: str, peers: Sequence[str], steps: int) -> Stage:
    """The peer burn-in on this machine (simulated nodes, gloo): screener.known_answer.collective.peer_training.run_local."""
    t0 = time.monotonic()
    r = run_local(PeerOptions(under_test=node, steps=steps), peers=peers)
    v = r.verdict()
    bw = f", all-reduce busbw {r.collective['busbw_gbps']:.2f} GB/s" if r.collective else ""
    return Stage("peers", v.outcome, time.monotonic() - t0, f"{r.detail}{bw}",
                 (v,) if v.outcome == Outcome.SUSPECT else (), r.to_dict())


# --- the sequence ---------------------------------------------------------------------------------


class _StoreAccess:
    """The node's store for one burn-in: opened when a stage first needs it (never before the
    known-answer rounds, so a missing client or a cluster out of reach costs no screen), and
    given up on at its first failure, which is kept in the report instead of raised."""

    def __init__(self, report: FullBurninReport, store: Any,
                 opener: Optional[Callable[[], Any]]) -> None:
        self.report, self.store, self.opener = report, store, opener

    def get(self) -> Any:
        """The store, or None (none asked for, or it failed)."""
        if self.report.store_error is not None:
            return None
        if self.store is None and self.opener is not None:
            opener, self.opener = self.opener, None
            self.run(lambda: setattr(self, "store", opener()))
        return self.store

    def run(self, fn: Callable[[], Any]) -> bool:
        """fn(), or False with its failure kept in the report (and nothing more asked of the
        store). Every exception: whatever the store does, the results are printed first."""
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - reported after the results, with its exit code
            self.report.store_error = str(e) or type(e).__name__
            self.report.store_exit = getattr(e, "exit_code", ExitCode.SCREENER_ERROR)
            self.store = None
            return False


def run_full_burnin(node: str, devices: Sequence[str], known_answer: Callable[[], BurninReport], *,
                    plan: BurninPlan = BurninPlan(), store: Any = None,
                    open_store: Optional[Callable[[], Any]] = None,
                    probe: Optional[Callable[[Any], Any]] = None, policy: Any = None,
                    clock: Callable[[], float] = time.time, hbm_inject: Any = None,
                    collective_inject: Any = None, peers: Sequence[str] = (),
                    peer_steps: int = 8,
                    requirement: Optional[BurninRequirement] = None,
                    progress: Callable[[str], None] = lambda s: None,
                    step: Optional[Callable[[str], None]] = None) -> FullBurninReport:
    """Run the stages in order (see the module docstring) and move the node through the lifecycle.

    known_answer(): runs the known-answer rounds and returns a BurninReport (run_burnin). store: the
    node's store (local or kube), or None to move nothing; open_store(): opens it instead, when a
    stage first needs it (after the known-answer rounds). A failure of the store (opening, reading
    or writing) ends its use and is kept in `store_error`, never raised.
    probe(previous): the health probes.
    peers: names of simulated peer nodes for a local peer burn-in stage (none: no such stage; in a
    cluster the peer burn-in is its own Indexed Job, see
    screener.known_answer.collective.peer_training). requirement: what makes the run full (default
    BurninRequirement(): one hour); a partial run is recorded as partial and never makes a node
    healthy. progress(name): a stage starts; step(item): an item of it finished
    (screener.output.progress).
    """
    report = FullBurninReport(node=node)
    access = _StoreAccess(report, store, open_store)
    before, after, peers_available = _run_stages(
        report, node, devices, known_answer, plan=plan, store=access, probe=probe, hbm_inject=hbm_inject,
        collective_inject=collective_inject, peers=peers, peer_steps=peer_steps,
        progress=progress, step=step)
    report.required_seconds = (requirement or BurninRequirement()).min_seconds
    report.missing = missing_for_full([s.to_dict() for s in report.stages],
                                      requirement or BurninRequirement(),
                                      devices=len(dict.fromkeys(devices)),
                                      peers_available=peers_available)
    opened = access.get() if plan.lifecycle else None
    if opened is not None:
        access.run(lambda: _record(report, node, opened, before, after,
                                   policy=policy or machine.DEFAULT_POLICY, clock=clock))
    return report


def _run_stages(report: FullBurninReport, node: str, devices: Sequence[str],
                known_answer: Callable[[], BurninReport], *, plan: BurninPlan, store: _StoreAccess,
                probe: Optional[Callable[[Any], Any]], hbm_inject: Any, collective_inject: Any,
                peers: Sequence[str], peer_steps: int, progress: Callable[[str], None],
                step: Optional[Callable[[str], None]]) -> tuple[Any, Any, bool]:
    """Every stage the plan asks for, in order, into `report.stages`; returns the probe reports
    before and after (None when not probed) and whether same-platform peers were compared."""
    before = after = None
    if plan.probes and probe is not None:
        progress("probes (before)")
        stage, before = probe_stage("probes-before", probe)
        report.stages.append(stage)
    progress("known-answer burn-in")
    stage, report.known_answer = known_answer_stage(known_answer)
    report.stages.append(stage)
    gpus = [d for d in devices if d.startswith("cuda")] or list(devices)[:1]
    if plan.hbm:
        progress("HBM pattern test")
        report.stages.append(hbm_stage(gpus, plan, hbm_inject, step))
    if plan.collective and len(devices) > 1:
        progress("all-reduce check")
        report.stages.append(collective_stage(devices, plan, collective_inject))
    peers_available = False
    opened = store.get() if plan.crosscheck or plan.lifecycle else None
    if plan.crosscheck and opened is not None and hasattr(opened, "annotations_by_node"):
        progress("cross-check with other nodes")
        found: list[Stage] = []
        screen = report.known_answer.screen
        if store.run(lambda: found.append(crosscheck_stage(node, screen, opened))):
            cc = found[0]
            peers_available = int((cc.data or {}).get("nodes_compared") or 0) > 0
            report.stages.append(cc)
    if peers:
        progress("peer burn-in")
        report.stages.append(peers_stage(node, peers, peer_steps))
    if plan.probes and probe is not None:
        progress("probes (after)")
        stage, after = probe_stage("probes-after", probe, before)
        report.stages.append(stage)
    return before, after, peers_available


def _record(report: FullBurninReport, node: str, store: Any, before: Any, after: Any, *,
            policy: Any, clock: Callable[[], float]) -> None:
    """Move the node through the lifecycle on what the burn-in found, and store its verdict."""
    findings = [f for r in (before, after) if r is not None for f in r.findings
                if f.severity >= Severity.WARNING]
    report.state_before = store.get_state(node)
    events: list[Any] = [machine.NodeSeen()]
    # A finding's GPU serial counts for the lemon rule when this node's NVML reports it.
    known = sorted({str(g.serial) for r in (before, after) if r is not None
                    for g in r.gpus if g.serial})
    findings = [replace(f, evidence=machine.local_serials(f.evidence, known)) for f in findings]
    if findings:
        events.append(machine.Findings(tuple(findings)))
    verdicts = tuple(v for s in report.stages for v in s.verdicts)
    # Conditions seen after the load (a pending remap, a GPU gone) keep the node out.
    conditions = tuple(f for f in (after.findings if after is not None else ()) if is_condition(f))
    events.append(machine.KnownAnswerScreen(verdicts, kind=report.kind, conditions=conditions))
    for event in events:
        decision = apply_event(store, node, event, now=clock(), policy=policy)
        for t in decision.transitions:
            report.transitions.append({"from": t.from_state.value if t.from_state else None,
                                       "to": t.to_state.value, "reason": t.reason,
                                       "code": t.code})
    report.state_after = store.get_state(node)
    store.set_verdict(node, {"time": clock(), "outcome": report.outcome.value,
                             "kind": report.kind, "screen": "burnin",
                             "missing": list(report.missing),
                             "verdicts": [v.to_dict() for v in verdicts]})
