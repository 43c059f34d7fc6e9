"""The daemon's findings bookkeeping: what the probes found, what is new, what still holds.

The probes report every finding on every run; the lifecycle must see an event finding (a rising
counter, a warning Xid) once and a persisting condition (a pending or failed row remap, retired
pages over the threshold, a GPU off the bus, a critical Xid not yet recovered) on every probe.
`FindingsTracker` keeps what that takes between probes, and nothing else:

- the GPUs and serials this node's NVML has reported since the daemon started (a GPU that
  disappears stays a condition; an alarm's or finding's serials count only when they are ours);
- the findings seen on the last probe (what is new this time) and the event findings whose
  transition is not yet durable (`pending`; a failed write leaves them unseen, so every tick
  retries and nothing is lost);
- the critical Xids not yet recovered (by a reboot, a person, a passing remediation), which stay
  conditions across probes and across a restart of the daemon (`seed_xids`);
- the conditions of the last probe, which hold back screens and block every pass while present.

It holds no store and writes nothing: the daemon hands it a reader of the node's history (called
only when needed) and feeds what `todo` returns to the lifecycle.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from screener.errors import ScreenerError
from screener.health.probes import ProbeReport
from screener.health.verdict.rules import is_condition
from screener.lifecycle import machine
from screener.lifecycle.records import ACTOR_HUMAN
from screener.types import Finding, NodeState, Reason, Severity

FindingKey = tuple[str, str, int]


def finding_key(f: Finding) -> FindingKey:
    """What makes two probes' findings the same finding: its code, GPU and severity."""
    return (f.code, str(f.gpu or ""), int(f.severity))


def xid_key(f: Finding) -> FindingKey:
    """What makes two critical Xid findings the same: the GPU and the Xid number."""
    return ("xid", str(f.gpu or ""), int(f.evidence.get("xid") or 0))


def is_recovery(t: Any) -> bool:
    """A transition after which earlier Xids no longer hold the node: a person's decision, or a
    remediation (deep health check, GPU reset) that passed."""
    return bool(t.actor == ACTOR_HUMAN or t.code == Reason.REMEDIATED)


def _critical_xid(f: Finding) -> bool:
    return f.code == "xid" and f.severity >= Severity.CRITICAL


class FindingsTracker:
    """The findings state one daemon keeps between probes (see the module docstring)."""

    def __init__(self) -> None:
        self.known_serials: set[str] = set()  # every serial this node's NVML has reported
        self.known_gpus: dict[str, Any] = {}  # uuid -> GpuSnapshot seen since start
        self.seen: set[FindingKey] = set()  # the findings of the last probe
        self.pending: list[Finding] = []  # event findings whose transition is not yet durable
        self.unwritten = False  # the last feed of findings failed to write: retry every tick
        self.xids: dict[FindingKey, tuple[float, Finding]] = {}  # unrecovered critical Xids
        self.conditions: tuple[Finding, ...] = ()  # what persisted on the last probe

    # --- one probe ------------------------------------------------------------------------------

    def observe(self, report: ProbeReport, now: float,
                history: Callable[[], Sequence[Any]]) -> list[Finding]:
        """Take in one probe's report; returns its findings that are new since the last probe.

        now: the stamp clock's now (compared with the history's stamps). history(): the node's
        transitions, called only while unrecovered Xids are held (a ScreenerError: they are
        kept, the safe side). The new event findings join `pending`, the persisting ones
        become `conditions`, and this probe's findings are marked seen (`not_written` unmarks the
        pending ones when their transition cannot be recorded).
        """
        for g in report.gpus:
            if g.serial:
                self.known_serials.add(str(g.serial))
            if g.uuid:
                self.known_gpus[g.uuid] = g
        findings = [self.localize(f) for f in report.findings] + self._gone(report)
        current = {finding_key(f) for f in findings}
        new = [f for f in findings if finding_key(f) not in self.seen]
        for f in findings:
            if _critical_xid(f):
                self.xids.setdefault(xid_key(f), (now, f))
        self._drop_recovered_xids(history)
        # Event findings are fed once; conditions on every probe (level-triggered).
        pending = {finding_key(p) for p in self.pending}
        self.pending.extend(f for f in new if f.severity >= Severity.WARNING
                            and not is_condition(f) and finding_key(f) not in pending)
        self.conditions = self._current_conditions(findings)
        self.seen = current
        return new

    # --- feeding the lifecycle ------------------------------------------------------------------

    @property
    def needs_retry(self) -> bool:
        """Findings whose transition could not be written: retried on every tick."""
        return bool(self.pending) or self.unwritten

    def undecided(self, state: Optional[NodeState]) -> tuple[Finding, ...]:
        """The findings that would take the node out of service whose transition the last feed
        could not write (a first start while the API is out of reach): what the node's health
        answer holds jobs back for until they are decided."""
        if not self.unwritten:
            return ()
        return tuple(f for f in self.todo(state) if f.severity >= Severity.SUSPECT)

    def todo(self, state: Optional[NodeState]) -> tuple[Finding, ...]:
        """What to feed the lifecycle now: the pending event findings and the conditions that
        can still change the node's state."""
        return tuple(self.pending) + tuple(f for f in self.conditions if could_move(f, state))

    def written(self) -> None:
        """The transition for `todo` is recorded (or spooled): the pending findings are done."""
        self.pending = []
        self.unwritten = False

    def not_written(self) -> None:
        """The transition for `todo` failed: unmark the pending findings, so the next probe and
        every tick try again."""
        self.seen -= {finding_key(f) for f in self.pending}
        self.unwritten = True

    # --- serials --------------------------------------------------------------------------------

    def local_evidence(self, evidence: Mapping[str, Any]) -> dict[str, Any]:
        """Evidence with only the GPU serials this node's NVML reports (never another node's)."""
        return machine.local_serials(evidence, sorted(self.known_serials))

    def localize(self, f: Finding) -> Finding:
        """The finding with its GPU serial under the key the lemon rule reads, when it is one
        this node's NVML reports (never another node's)."""
        keys = (machine.EVIDENCE_SERIAL, machine.EVIDENCE_GPU_SERIAL, machine.EVIDENCE_GPU_SERIALS)
        if not any(k in f.evidence for k in keys):
            return f
        return replace(f, evidence=self.local_evidence(f.evidence))

    # --- what persists --------------------------------------------------------------------------

    def seed_xids(self, history: Iterable[Any]) -> None:
        """Critical Xids recorded since this boot (`history` starts there) and not recovered stay
        conditions across a restart of the daemon (the transition that recorded them is the
        durable record)."""
        for t in history:
            if is_recovery(t):
                self.xids.clear()
                continue
            for d in t.evidence.get("findings") or ():
                try:
                    f = Finding.from_dict(d)
                except (KeyError, TypeError, ValueError):
                    continue
                if _critical_xid(f):
                    self.xids[xid_key(f)] = (t.time, f)

    def _gone(self, report: ProbeReport) -> list[Finding]:
        """A GPU seen since the daemon started and missing now stays a condition (the rules see
        it only against the previous probe) until it is back."""
        if not report.snapshot.nvml.available:
            return []
        now = {g.uuid for g in report.gpus if g.uuid}
        named = {f.evidence.get("uuid") for f in report.findings if f.code == "gpu_missing"}
        out = []
        for uuid, g in self.known_gpus.items():
            if uuid in now or uuid in named:
                continue
            ev = self.local_evidence(dict(g.identity()))
            out.append(Finding(severity=Severity.CRITICAL, code="gpu_missing",
                               message=f"GPU {g.index} ({uuid}) is still missing: fallen off the bus",
                               gpu=g.label, evidence=ev,
                               action="drain the node and reboot it; repair if the GPU stays missing"))
        return out

    def _drop_recovered_xids(self, history: Callable[[], Sequence[Any]]) -> None:
        if not self.xids:
            return
        try:
            transitions = history()
        except ScreenerError:
            return  # cannot tell: keep them (the safe side)
        last = max((t.time for t in transitions if is_recovery(t)), default=None)
        if last is not None:
            self.xids = {k: v for k, v in self.xids.items() if v[0] > last}

    def _current_conditions(self, findings: list[Finding]) -> tuple[Finding, ...]:
        out = [f for f in findings if is_condition(f) and f.code != "xid"]
        out += [f for _, f in self.xids.values()]
        return tuple(out)


def could_move(f: Finding, state: Optional[NodeState]) -> bool:
    """Whether re-applying a persisting condition can still change the node's state; the others
    are skipped, so a node held out costs no store reads per probe."""
    if f.severity < Severity.WARNING or state == NodeState.REPAIR:
        return False
    if state == NodeState.QUARANTINED:
        return f.code in machine.REPAIR_CODES and f.severity >= Severity.CRITICAL
    if state == NodeState.SUSPECT:
        return f.severity >= Severity.CRITICAL
    return True
