"""The full burn-in sequence around the known-answer rounds, and the lifecycle move at its end.

`screener burnin` on a replaced or repaired node runs, in order:

1. the probes (NVML, kernel log, host): a node that is already visibly broken is reported so;
2. the known-answer burn-in (screener.burnin.run_burnin): every job on every device for the
   duration, compared with goldens, peers and its own repeats every round;
3. the HBM pattern test on every GPU (screener.hbm);
4. the intra-node all-reduce check with its bandwidth (screener.collective);
5. the cross-check of its known-answer digests with other nodes of the same platform, from their
   annotations (screener.crosscheck; only with the kube store);
   (with --peers, on one machine: the peer burn-in of screener.peer with simulated peer nodes;)
6. the probes again: counters that rose under the sustained load (ECC, Xid, throttling) show here;
7. the lifecycle: probe findings, then every verdict of the stages as one known-answer screen,
   moving the node to healthy (all pass), suspect, quarantined or repair (lemon rule). A mismatch
   that reproduced (the same wrong result on every round of the burn-in, or a device that
   disagreed with itself, or a stuck memory cell seen twice) counts as confirmed.

Each stage is a function of plain inputs; the known-answer burn-in itself is passed in as a
callable, so this module only orders the stages, collects their verdicts and decides the exit code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.types import ExitCode, NodeState, Outcome, Severity, Verdict

CONFIRMING_REASONS = ("golden_mismatch", "peer_mismatch", "self_mismatch")
OUT_OF_SERVICE = (NodeState.SUSPECT, NodeState.QUARANTINED, NodeState.REPAIR)


@dataclass(frozen=True)
class BurninPlan:
    """Which extra stages run. Unknown keys are an error (from_mapping)."""

    probes: bool = True
    hbm: bool = True
    hbm_fraction: float = 0.5
    hbm_max_bytes: Optional[int] = None
    collective: bool = True
    collective_numel: Optional[int] = None
    crosscheck: bool = True
    lifecycle: bool = True

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "BurninPlan":
        from dataclasses import fields

        from screener.errors import ConfigError

        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"burn-in plan: unknown keys {unknown}")
        return cls(**dict(d))


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
    kat: Any = None  # screener.burnin.BurninReport
    state_before: Optional[NodeState] = None
    state_after: Optional[NodeState] = None
    transitions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def outcome(self) -> Outcome:
        outs = {s.outcome for s in self.stages}
        if Outcome.SUSPECT in outs:
            return Outcome.SUSPECT
        if Outcome.INCONCLUSIVE in outs or not self.stages:
            return Outcome.INCONCLUSIVE
        return Outcome.PASS

    @property
    def exit_code(self) -> ExitCode:
        if self.outcome == Outcome.SUSPECT or self.state_after in OUT_OF_SERVICE:
            return ExitCode.HARDWARE_SUSPECT
        if self.outcome == Outcome.INCONCLUSIVE:
            return ExitCode.INCONCLUSIVE
        return ExitCode.PASS

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "burnin", "node": self.node, "outcome": self.outcome.value,
                "exit_code": int(self.exit_code),
                "state_before": self.state_before.value if self.state_before else None,
                "state_after": self.state_after.value if self.state_after else None,
                "transitions": self.transitions, "stages": [s.to_dict() for s in self.stages],
                "known_answer": self.kat.to_dict() if self.kat is not None else None}

    def extra(self) -> dict[str, Any]:
        """What the full sequence adds to the known-answer burn-in's JSON report (the overall
        outcome and exit code replace the known-answer ones)."""
        d = self.to_dict()
        d.pop("known_answer")
        d.pop("kind")
        return d

    def table(self) -> str:
        lines = []
        if self.kat is not None:
            lines += [self.kat.table(), ""]
        lines.append(f"{'stage':14s} {'result':13s} {'seconds':>8s}  detail")
        for s in self.stages:
            lines.append(f"{s.name:14s} {s.outcome.value:13s} {s.seconds:8.1f}  {s.detail}")
        lines.append("")
        move = "; ".join(f"{t['from'] or '(new)'} -> {t['to']}" for t in self.transitions)
        lines.append(f"node {self.node}: {self.state_before.value if self.state_before else '(new)'}"
                     f" -> {self.state_after.value if self.state_after else '?'}"
                     + (f" ({move})" if move else " (unchanged)"))
        lines.append(f"overall: {self.outcome.value} (exit {int(self.exit_code)})")
        return "\n".join(lines)


# --- stages -----------------------------------------------------------------------------------------


def probe_stage(name: str, probe: Callable[[Any], Any], previous: Any = None) -> tuple[Stage, Any]:
    t0 = time.monotonic()
    report = probe(previous)
    worst = max((f.severity for f in report.findings), default=Severity.OK)
    outcome = Outcome.SUSPECT if worst >= Severity.SUSPECT else Outcome.PASS
    relevant = [f for f in report.findings if f.severity >= Severity.WARNING]
    detail = ", ".join(f"{f.code} ({f.severity.label})" for f in relevant) or f"worst {worst.label}"
    return Stage(name, outcome, time.monotonic() - t0, detail,
                 data={"findings": [f.to_dict() for f in report.findings],
                       "errors": list(report.errors)}), report


def kat_stage(kat: Callable[[], Any]) -> tuple[Stage, Any]:
    t0 = time.monotonic()
    rep = kat()
    verdicts = tuple(mark_confirmed(v, rep.screen.iterations.get(v.device, 1))
                     for v in rep.screen.verdicts)
    bad = [v for v in verdicts if v.outcome != Outcome.PASS]
    detail = (f"{len(rep.screen.jobs)} job(s) on {len(verdicts)} device(s), "
              + (", ".join(f"{v.device}: {v.reason}" for v in bad) or "all bit-exact"))
    return Stage("known-answer", rep.screen.outcome, time.monotonic() - t0, detail, verdicts), rep


def mark_confirmed(v: Verdict, iterations: int) -> Verdict:
    """A burn-in mismatch that reproduced is confirmed (see the module docstring)."""
    if v.outcome != Outcome.SUSPECT:
        return v
    if v.reason == "self_mismatch" or (v.reason in CONFIRMING_REASONS and iterations >= 2):
        return replace(v, evidence={**dict(v.evidence), "confirmed": True})
    return v


def hbm_stage(devices: Sequence[str], plan: BurninPlan, inject: Any = None) -> Stage:
    from screener.hbm import hbm_test

    t0 = time.monotonic()
    results = [hbm_test(d, fraction=plan.hbm_fraction, max_bytes=plan.hbm_max_bytes,
                        inject=inject.get(d) if isinstance(inject, Mapping) else inject)
               for d in dict.fromkeys(devices)]
    verdicts = tuple(r.verdict() for r in results)
    bad = [r for r in results if not r.ok]
    gib = sum(r.bytes_tested for r in results) / 2**30
    detail = (f"{gib:.2f} GiB on {len(results)} device(s)"
              + (f", {', '.join(f'{r.device}: {r.mismatches} mismatches' for r in bad)}" if bad
                 else f", {min(r.bandwidth_gbps for r in results):.1f} GB/s"))
    return Stage("hbm", Outcome.SUSPECT if bad else Outcome.PASS, time.monotonic() - t0, detail,
                 verdicts, {"devices": [r.to_dict() for r in results]})


def collective_stage(devices: Sequence[str], plan: BurninPlan, inject: Any = None) -> Stage:
    from screener.collective import run_collective

    t0 = time.monotonic()
    r = run_collective(devices, numel=plan.collective_numel, inject=inject)
    if not r.ranks:
        return Stage("collective", Outcome.PASS, time.monotonic() - t0, r.detail,
                     data=r.to_dict())
    detail = (f"{r.backend} over {len(r.ranks)} ranks, busbw {r.busbw_gbps:.2f} GB/s"
              + (f", wrong result on {', '.join(r.mismatched)}" if not r.ok else ""))
    return Stage("collective", Outcome.PASS if r.ok else Outcome.SUSPECT, time.monotonic() - t0,
                 detail, r.verdicts(), r.to_dict())


def crosscheck_stage(node: str, screen: Any, store: Any) -> Stage:
    from screener.crosscheck import cross_check, peer_digests
    from screener.daemon import platform_digests
    from screener.screening import ScreenOutcome

    t0 = time.monotonic()
    own = platform_digests(ScreenOutcome(outcome=screen.outcome, verdicts=tuple(screen.verdicts),
                                         digests=screen.digests))
    cc = cross_check(own, peer_digests(store, node))
    outcome = Outcome.PASS if cc.outcome == Outcome.INCONCLUSIVE else cc.outcome
    # Too few peers is not a reason to hold a node back: the golden decides then.
    return Stage("crosscheck", outcome, time.monotonic() - t0, cc.detail,
                 (cc.verdict(node),) if cc.outcome == Outcome.SUSPECT else (), cc.to_dict())


def peers_stage(node: str, peers: Sequence[str], steps: int) -> Stage:
    """The peer burn-in on this machine (simulated nodes, gloo): screener.peer.run_local."""
    from screener.peer import PeerOptions, run_local

    t0 = time.monotonic()
    r = run_local(PeerOptions(under_test=node, steps=steps), peers=peers)
    v = r.verdict()
    bw = f", all-reduce busbw {r.collective['busbw_gbps']:.2f} GB/s" if r.collective else ""
    return Stage("peers", v.outcome, time.monotonic() - t0, f"{r.detail}{bw}",
                 (v,) if v.outcome == Outcome.SUSPECT else (), r.to_dict())


# --- the sequence ---------------------------------------------------------------------------------


def run_full_burnin(node: str, devices: Sequence[str], kat: Callable[[], Any], *,
                    plan: BurninPlan = BurninPlan(), store: Any = None,
                    probe: Optional[Callable[[Any], Any]] = None, policy: Any = None,
                    clock: Callable[[], float] = time.time, hbm_inject: Any = None,
                    collective_inject: Any = None, peers: Sequence[str] = (),
                    peer_steps: int = 8,
                    progress: Callable[[str], None] = lambda s: None) -> FullBurninReport:
    """Run the stages in order (see the module docstring) and move the node through the lifecycle.

    kat(): runs the known-answer burn-in and returns a screener.burnin.BurninReport. store: the
    node's store (local or kube), or None to move nothing. probe(previous): the health probes.
    peers: names of simulated peer nodes for a local peer burn-in stage (none: no such stage; in a
    cluster the peer burn-in is its own Indexed Job, see screener.peer).
    """
    from screener import lifecycle
    from screener.stores import apply_event

    report = FullBurninReport(node=node)
    findings: list[Any] = []
    before = None
    if plan.probes and probe is not None:
        progress("probes (before)")
        stage, before = probe_stage("probes-before", probe)
        report.stages.append(stage)
        findings += [f for f in before.findings if f.severity >= Severity.WARNING]
    progress("known-answer burn-in")
    stage, report.kat = kat_stage(kat)
    report.stages.append(stage)
    gpus = [d for d in devices if d.startswith("cuda")] or list(devices)[:1]
    if plan.hbm:
        progress("HBM pattern test")
        report.stages.append(hbm_stage(gpus, plan, hbm_inject))
    if plan.collective and len(devices) > 1:
        progress("all-reduce check")
        report.stages.append(collective_stage(devices, plan, collective_inject))
    if plan.crosscheck and store is not None and hasattr(store, "annotations_by_node"):
        progress("cross-check with other nodes")
        report.stages.append(crosscheck_stage(node, report.kat.screen, store))
    if peers:
        progress("peer burn-in")
        report.stages.append(peers_stage(node, peers, peer_steps))
    if plan.probes and probe is not None:
        progress("probes (after)")
        stage, after = probe_stage("probes-after", probe, before)
        report.stages.append(stage)
        findings += [f for f in after.findings if f.severity >= Severity.WARNING]

    if store is not None and plan.lifecycle:
        policy = policy or lifecycle.DEFAULT_POLICY
        report.state_before = store.get_state(node)
        events: list[Any] = [lifecycle.NodeSeen()]
        if findings:
            events.append(lifecycle.Findings(tuple(findings)))
        verdicts = tuple(v for s in report.stages for v in s.verdicts)
        events.append(lifecycle.KatScreen(verdicts))
        for event in events:
            decision = apply_event(store, node, event, now=clock(), policy=policy)
            for t in decision.transitions:
                report.transitions.append({"from": t.from_state.value if t.from_state else None,
                                           "to": t.to_state.value, "reason": t.reason,
                                           "code": t.code})
        report.state_after = store.get_state(node)
        store.set_verdict(node, {"time": clock(), "outcome": report.outcome.value,
                                 "kind": "burnin", "verdicts": [v.to_dict() for v in verdicts]})
    return report
