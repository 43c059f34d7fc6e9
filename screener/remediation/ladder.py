"""The repair ladder (issue 24.3): heal an idle quarantined node with the cheapest fix first.

Rungs, in order, each taken once per episode (an episode runs from the node's last time healthy:
a rung that sent it to burnin and a burn-in that failed again make the same episode):
  0. corroboration: where `dcgmi` is on PATH, `dcgmi diag -r LEVEL` on the first idle pass after
     the node entered quarantine; its result goes into the pass report and into the evidence of
     the rung that follows (the durable record). It decides nothing by itself: a DCGM pass never
     clears a node, a DCGM failure never blames one (only the known-answer screens do).
  1. GPU reset: `nvidia-smi -r -i N` for each GPU, only when `nvidia-smi --query-compute-apps`
     shows no process on any of them. When every GPU reset, the lifecycle records a Remediation
     (quarantined -> burnin, RemediationPassed, the reset's output as evidence) and the daemon's
     full burn-in on the idle node is the re-screen: healthy only if it passes, quarantined again
     (a failure, counted by the lemon rule) if not.
  2. reboot (`reboot = "hyperpod"` or `"command"`): a fleet-wide reboot slot is claimed first (at
     most `max_rebooting` nodes reboot at once, however many fail together); then the request is
     RECORDED (quarantined -> quarantined, RepairStep, with the host's boot time) and only then
     asked for, because the daemon asking does not survive the reboot. On a later pass (the
     daemon restarted on the rebooted host) a boot time later than the recorded one proves the
     reboot: a Remediation (quarantined -> burnin) and the slot is freed; the burn-in re-screens.
     A request that failed, or a node not rebooted within `reboot_timeout_s`, is recorded as
     such (RepairStep, phase "abandoned"), its slot freed, and a person decides.
  3. final (`final = "repair"` or `"replace"`): a reset and a reboot did not heal the node: it goes
     to repair (RemediationFailed, a failure for the lemon rule; the request_repair action), and
     with "replace" HyperPod's BatchReplaceClusterNodes is asked for its instance.
  With a rung switched off, the node past the last rung waits for a person
  (`screener hyperpod reboot|replace NODE --yes`).

A rung that could not run (a process on a GPU, a tool missing, a refusal, a timeout) is OUR
failure or the node's business, never a hardware verdict: no move, the attempt in the pass
report, an error metric and a log line, and the next try waits `min_interval_s`.

Budget and rate limit: at most `max_rungs` rungs per node in `window_days`, counted from the
node's own history (a reset, a reboot request and a replacement count; the record of a reboot's
end and the move to repair do not); at most one attempt per `min_interval_s` per node. Fleet-wide,
the nodes in the ladder are quarantined nodes, which the quarantine budget already caps; a reset
is node-local and takes seconds, a reboot takes a node away for minutes, so reboots also take one
of `max_rebooting` slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from screener.lifecycle.machine import Decision, Remediation, RepairStep
from screener.lifecycle.records import Transition
from screener.remediation import gpu_tools
from screener.settings.ladder import LadderConfig
from screener.types import NodeState, Reason

log = logging.getLogger("screener.ladder")

RUNG_RESET = "gpu_reset"
RUNG_REBOOT = "reboot"
RUNG_FINAL = "final"
RUNGS = (RUNG_RESET, RUNG_REBOOT, RUNG_FINAL)
EVIDENCE_KEY = "ladder"
# Phases of a rung's records: a reset is one record; a reboot is requested, then done or
# abandoned. Only the records that took a rung count against the budget.
PHASE_REQUESTED, PHASE_DONE, PHASE_ABANDONED = "requested", "done", "abandoned"
REBOOTED_AFTER_S = 30.0  # a boot time this much later than the recorded one is a new boot


class Slots(Protocol):
    """Fleet-wide slots (screener.stores.slots): at most N nodes hold one at once."""

    def claim(self, node: str) -> Any:
        """The node's slot, or None when every slot is taken."""

    def release(self, node: str) -> None:
        """Free the node's slot."""


@dataclass(frozen=True)
class RepairCall:
    """What asking for a reboot or a replacement did: accepted or not, in words, and the record
    (the request and the answer) that goes into the node's history."""

    ok: bool
    detail: str
    record: Mapping[str, Any] = field(default_factory=dict)
    maybe_sent: bool = False  # not ok, but the request may have gone out (a lost answer)


class Repairs(Protocol):
    """What the ladder needs to reboot or replace its node."""

    def reboot(self, node: str) -> RepairCall:
        """Ask for the node's reboot; returns once it is under way (or refused)."""

    def replace(self, node: str) -> RepairCall:
        """Ask for the node's replacement (its state must already be quarantined or repair)."""


Record = Callable[[Any], Decision]  # feeds one event to the lifecycle and persists its moves


@dataclass
class LadderStep:
    """What one look at the ladder did: actions for the pass report, and our failure (if any) for
    the error metric. The moves it made were recorded through the `record` it was given."""

    actions: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""  # our failure, for the error metric
    taken: list[str] = field(default_factory=list)  # the rungs this look took (for the metric)


FLAT_PREFIX = "ladder_"
_FLAT_KEYS = ("rung", "phase", "method", "slot", "boot_time", "boot_id", "requested_at")


def ladder_evidence(rung: str, *, bulk: Optional[Mapping[str, Any]] = None,
                    **book: Any) -> dict[str, Any]:
    """A rung's evidence: the bookkeeping the ladder reads back (rung, phase, method, boot
    identity, times) as flat scalars, and the bulk (tool output, DCGM's table) nested under
    "ladder". A Kubernetes history entry is shrunk to 2 KiB by dropping nested values first
    (stores.kube.formats.shrink_evidence): the scalars survive, so a rung is never forgotten."""
    flat = {FLAT_PREFIX + k: v for k, v in {"rung": rung, **book}.items() if k in _FLAT_KEYS}
    return {**flat, EVIDENCE_KEY: {"rung": rung, **book, **dict(bulk or {})}}


def ladder_record(t: Transition) -> Optional[Mapping[str, Any]]:
    """The ladder's bookkeeping in a transition's evidence, or None when the ladder did not make
    it (the flat scalars, or the nested record of a history written before them)."""
    rem = t.evidence.get("remediation") or {}
    if not isinstance(rem, Mapping):
        return None
    if FLAT_PREFIX + "rung" in rem:
        return {k[len(FLAT_PREFIX):]: v for k, v in rem.items() if k.startswith(FLAT_PREFIX)}
    rec = rem.get(EVIDENCE_KEY)
    return rec if isinstance(rec, Mapping) else None


def _counts(t: Transition) -> bool:
    rec = ladder_record(t)
    if rec is None:
        return False
    if rec.get("rung") == RUNG_FINAL:
        return rec.get("method") == "replace"
    return rec.get("phase", PHASE_REQUESTED) == PHASE_REQUESTED


def rungs_taken(history: Sequence[Transition], since: float) -> int:
    """Ladder rungs recorded on the node since `since` (the budget's count)."""
    return sum(1 for t in history if t.time >= since and _counts(t))


def quarantine_entry(history: Sequence[Transition]) -> Optional[Transition]:
    """The transition by which the node last entered quarantine (the ladder's episode)."""
    for t in reversed(history):
        if t.to_state == NodeState.QUARANTINED and t.from_state != NodeState.QUARANTINED:
            return t
    return None


def episode(history: Sequence[Transition]) -> list[Mapping[str, Any]]:
    """The ladder's records since the node was last healthy, oldest first."""
    healthy = max((t.time for t in history if t.to_state == NodeState.HEALTHY), default=0.0)
    return [rec for t in history if t.time >= healthy and (rec := ladder_record(t)) is not None]


def pending_reboot(records: Sequence[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """The episode's reboot request that has no end on file yet, or None."""
    reboots = [r for r in records if r.get("rung") == RUNG_REBOOT]
    last = reboots[-1] if reboots else None
    return last if last is not None and last.get("phase") == PHASE_REQUESTED else None


class RepairLadder:
    """The ladder for one node. env: the environment the tools run in (their PATH); monotonic:
    the clock of the rate limit's interval (history stamps come in with each step); boot_time:
    when the host booted (unix seconds); boot_id: the kernel's id of this boot, or None where it
    cannot be read (a changed id proves a reboot; the boot time, which a stepped wall clock
    moves, is the fallback); slots and repairs: the reboot slots and the reboot and replace
    calls, needed when the config takes those rungs."""

    def __init__(self, config: LadderConfig, *, node: str = "",
                 env: Optional[Mapping[str, str]] = None, monotonic: Callable[[], float],
                 boot_time: Optional[Callable[[], float]] = None, slots: Optional[Slots] = None,
                 repairs: Optional[Repairs] = None,
                 boot_id: Optional[Callable[[], Optional[str]]] = None) -> None:
        needs = []
        if config.enabled and config.reboot != "off" and (slots is None or boot_time is None):
            needs.append("reboot slots and the host's boot time")
        if config.enabled and (config.reboot != "off" or config.final == "replace") and \
                repairs is None:
            needs.append("a way to reboot or replace")
        if needs:
            raise ValueError(f"repair ladder: the config needs {' and '.join(needs)}")
        self.config, self.node, self.env, self.monotonic = config, node, env, monotonic
        self.boot_time, self.slots, self.repairs = boot_time, slots, repairs
        self.boot_id = boot_id
        self._next_try = 0.0
        self._diag: dict[str, Any] = {}  # quarantine transition id -> the dcgmi result

    def step(self, history: Sequence[Transition], gpus: Sequence[int], now: float,
             record: Record) -> LadderStep:
        """One look at an idle quarantined node (`history`: its transitions; `gpus`: the GPU
        indices its probe saw; `now`: a history stamp; `record`: applies a lifecycle event)."""
        out = LadderStep()
        entry = quarantine_entry(history)
        if entry is None:
            return out
        records = episode(history)
        pending = pending_reboot(records) if self.config.reboot != "off" else None
        if pending is not None:  # not rate limited: the one cheap look the ladder waits on
            self._await_reboot(pending, now, record, out)
            return out
        if self.monotonic() < self._next_try:
            return out
        self._next_try = self.monotonic() + self.config.min_interval_s
        if any(r.get("rung") == RUNG_REBOOT and r.get("phase") == PHASE_ABANDONED
               for r in records):
            # A reboot that did not happen proves nothing about the node: no further rung.
            out.actions.append({"action": RUNG_REBOOT, "result": "the reboot this episode asked "
                                "for did not happen; a person decides: screener hyperpod "
                                "reboot|replace"})
            return out
        rung = self._next_rung(records)
        if rung is None:
            out.actions.append({"action": RUNG_RESET, "result": "already taken since this "
                                "quarantine's episode began; the next rungs (reboot, replace) "
                                "are a person's: screener hyperpod reboot|replace"})
            return out
        taken = rungs_taken(history, now - self.config.window_days * 86400.0)
        spent = taken >= self.config.max_rungs
        if spent and rung != RUNG_FINAL:  # the final move is the ladder giving up: always made
            out.actions.append({"action": rung, "result": f"not started: the ladder's "
                                f"budget is spent ({taken} of {self.config.max_rungs} rungs in "
                                f"{self.config.window_days:g} days); a person decides"})
            return out
        diag = self._corroborate(entry, out)
        if rung == RUNG_RESET:
            self._reset(gpus, diag, out, record)
        elif rung == RUNG_REBOOT:
            self._reboot(now, diag, out, record)
        else:
            self._final(diag, out, record, replace_allowed=not spent)
        return out

    def _next_rung(self, records: Sequence[Mapping[str, Any]]) -> Optional[str]:
        """The episode's next rung, or None when the configured rungs are spent."""
        tried = {r.get("rung") for r in records}
        if RUNG_RESET not in tried:
            return RUNG_RESET
        if self.config.reboot != "off" and RUNG_REBOOT not in tried:
            return RUNG_REBOOT
        if self.config.final != "none" and RUNG_FINAL not in tried:
            return RUNG_FINAL
        return None

    def _corroborate(self, entry: Transition, out: LadderStep) -> Optional[dict[str, Any]]:
        """dcgmi diag, once per quarantine, where dcgmi exists and a level is set."""
        if self.config.dcgm_level == 0 or not gpu_tools.available(self.config.dcgmi, self.env):
            return None
        if entry.id in self._diag:
            return self._diag[entry.id]
        if self.config.dry_run:
            out.actions.append({"action": "dcgm_diag", "result": "dry run: would run "
                                f"{self.config.dcgmi} diag -r {self.config.dcgm_level}"})
            return None
        res = gpu_tools.dcgm_diag(self.config.dcgm_level, self.config.dcgmi, env=self.env)
        rec = res.to_dict()
        self._diag[entry.id] = rec
        said = ("no result: " + (res.tool.error if res.tool else "")) if res.passed is None \
            else "passed" if res.passed else f"failed: {', '.join(res.failed)}"
        out.actions.append({"action": "dcgm_diag", "result": said, "diag": rec})
        log.warning("dcgmi diag -r %d on entry to quarantine: %s", self.config.dcgm_level, said,
                    extra={"event": "dcgm_diag", "passed": res.passed})
        return rec

    # --- rung 2: reboot ----------------------------------------------------------------------

    def _reboot(self, now: float, diag: Optional[dict[str, Any]], out: LadderStep,
                record: Record) -> None:
        """Claim a reboot slot, record the request, then ask for the reboot."""
        assert self.slots is not None and self.repairs is not None and self.boot_time is not None
        method = self.config.reboot
        if self.config.dry_run:
            out.actions.append({"action": RUNG_REBOOT, "result": f"dry run: would claim one of "
                                f"{self.config.max_rebooting} reboot slot(s) and reboot the node "
                                f"({method})"})
            return
        slot = self.slots.claim(self.node)
        if slot is None:
            out.actions.append({"action": RUNG_REBOOT, "result": f"waiting: all "
                                f"{self.config.max_rebooting} reboot slot(s) are taken by other "
                                f"nodes"})
            return
        booted = self.boot_time()
        evidence = ladder_evidence(RUNG_REBOOT, phase=PHASE_REQUESTED, method=method,
                                   slot=getattr(slot, "index", None), boot_time=booted,
                                   boot_id=self.boot_id() if self.boot_id else None,
                                   requested_at=now, bulk={"dcgm_diag": diag})
        decision = record(RepairStep(detail=f"reboot requested (repair ladder, rung 2, "
                                     f"{method})", evidence=evidence))
        if not decision.changed:  # the node moved meanwhile: no reboot on a stale decision
            self.slots.release(self.node)
            out.actions.append({"action": RUNG_REBOOT, "result": f"not started: {decision.note}"})
            return
        out.taken.append(RUNG_REBOOT)
        call = self.repairs.reboot(self.node)
        if call.ok:
            out.actions.append({"action": RUNG_REBOOT, "result": call.detail})
            log.warning("reboot requested: %s", call.detail, extra={"event": "ladder_reboot"})
            return
        out.error = call.detail
        if call.maybe_sent:
            # The answer was lost, not a refusal: the reboot may be under way. The slot and the
            # request stay; the boot identity or the timeout will say what happened.
            out.actions.append({"action": RUNG_REBOOT, "result": f"no answer: {call.detail}; "
                                "waiting to see whether the node reboots"})
            log.error("reboot request unanswered: %s", call.detail,
                      extra={"event": "ladder_reboot_failed"})
            return
        # Not a hardware verdict: no reboot happened, so it proves nothing about the node.
        self.slots.release(self.node)
        record(RepairStep(detail=f"reboot not done: {call.detail}; a person decides",
                          evidence=ladder_evidence(RUNG_REBOOT, phase=PHASE_ABANDONED,
                                                   bulk={"call": dict(call.record)})))
        out.actions.append({"action": RUNG_REBOOT, "result": f"failed: {call.detail}"})
        log.error("reboot failed: %s", call.detail, extra={"event": "ladder_reboot_failed"})

    def _await_reboot(self, pending: Mapping[str, Any], now: float, record: Record,
                      out: LadderStep) -> None:
        """A reboot was requested: the node is back (a later boot), late, or still on its way."""
        assert self.slots is not None and self.boot_time is not None
        before = float(pending.get("boot_time") or 0.0)
        asked = float(pending.get("requested_at") or 0.0)
        booted = self.boot_time()
        id_before = pending.get("boot_id")
        id_now = self.boot_id() if self.boot_id else None
        if id_before and id_now:  # the kernel's own word; a stepped wall clock cannot fake it
            rebooted = id_now != id_before
        else:
            rebooted = booted > before + REBOOTED_AFTER_S
        if rebooted:
            self.slots.release(self.node)
            record(Remediation(passed=True, detail="rebooted (repair ladder, rung 2)",
                               evidence=ladder_evidence(
                                   RUNG_REBOOT, phase=PHASE_DONE, boot_time=booted,
                                   boot_id=id_now, requested_at=asked,
                                   bulk={"boot_time_before": before, "boot_id_before": id_before})))
            out.actions.append({"action": RUNG_REBOOT, "result": "the node rebooted; the "
                                "burn-in re-screens it"})
            return
        if now - asked > self.config.reboot_timeout_s:
            out.error = (f"the reboot requested {now - asked:.0f} s ago did not happen (the host "
                         f"booted at {booted:.0f}, before the request)")
            self.slots.release(self.node)
            record(RepairStep(detail=f"{out.error}; a person decides",
                              evidence=ladder_evidence(RUNG_REBOOT, phase=PHASE_ABANDONED)))
            out.actions.append({"action": RUNG_REBOOT, "result": f"abandoned: {out.error}"})
            log.error("reboot abandoned: %s", out.error, extra={"event": "ladder_reboot_failed"})
            return
        out.actions.append({"action": RUNG_REBOOT, "result": f"waiting for the reboot requested "
                            f"{now - asked:.0f} s ago"})

    # --- rung 3: repair or replace ------------------------------------------------------------

    def _final(self, diag: Optional[dict[str, Any]], out: LadderStep, record: Record, *,
               replace_allowed: bool) -> None:
        """A reset and a reboot did not heal the node: repair, and replace if configured and the
        budget allows (the move to repair is always made: it is the ladder giving up)."""
        method = self.config.final
        if method == "replace" and not replace_allowed:
            method = "repair"
            out.actions.append({"action": RUNG_FINAL, "result": "no replacement: the ladder's "
                                "budget is spent; a person replaces the node"})
        if self.config.dry_run:
            out.actions.append({"action": RUNG_FINAL, "result": f"dry run: would send the node "
                                f"to repair" + (" and ask HyperPod to replace it"
                                                if method == "replace" else "")})
            return
        decision = record(Remediation(
            passed=False, detail="the repair ladder's rungs did not heal the node",
            evidence=ladder_evidence(RUNG_FINAL, method=method, bulk={"dcgm_diag": diag})))
        if decision.changed:
            out.taken.append(RUNG_FINAL)
        if method != "replace" or not decision.changed or decision.state != NodeState.REPAIR:
            out.actions.append({"action": RUNG_FINAL, "result": f"sent to repair: a person "
                                f"replaces or repairs it" if decision.changed else
                                f"not started: {decision.note}"})
            return
        assert self.repairs is not None
        call = self.repairs.replace(self.node)
        out.actions.append({"action": RUNG_FINAL, "result": call.detail, "call": dict(call.record)})
        if not call.ok:
            out.error = call.detail
            log.error("replacement not asked for: %s", call.detail,
                      extra={"event": "ladder_replace_failed"})
        else:
            log.warning("replacement requested: %s", call.detail,
                        extra={"event": "ladder_replace"})

    # --- rung 1: GPU reset --------------------------------------------------------------------

    def _reset(self, gpus: Sequence[int], diag: Optional[dict[str, Any]],
               out: LadderStep, record: Record) -> None:
        """Rung 1: reset every GPU, only with no process on any of them."""
        if not gpus:
            out.error = "no GPU to reset (the probe saw none)"
            out.actions.append({"action": RUNG_RESET, "result": f"not started: {out.error}"})
            return
        apps, query = gpu_tools.compute_apps(self.config.nvidia_smi, env=self.env)
        if query.error:
            out.error = query.error
            out.actions.append({"action": RUNG_RESET, "result": f"not started: {query.error}",
                                "tool": query.to_dict()})
            return
        if apps:
            out.actions.append({"action": RUNG_RESET, "result": "not started: processes on the "
                                "GPUs: " + ", ".join(f"{a.pid} ({a.name})" for a in apps[:5])})
            return
        if self.config.dry_run:
            out.actions.append({"action": RUNG_RESET, "result": "dry run: would run "
                                + "; ".join(f"{self.config.nvidia_smi} -r -i {i}" for i in gpus)})
            return
        results = [gpu_tools.reset_gpu(i, self.config.nvidia_smi, env=self.env) for i in gpus]
        failed = [r for r in results if r.error]
        evidence = ladder_evidence(RUNG_RESET, bulk={"gpus": list(gpus), "resets": [
            r.to_dict() for r in results], "dcgm_diag": diag})
        if failed:
            # Not a hardware verdict either way: the reset did not happen, so it proves nothing.
            out.error = "; ".join(r.error for r in failed)
            out.actions.append({"action": RUNG_RESET, "result": f"failed: {out.error}",
                                EVIDENCE_KEY: evidence[EVIDENCE_KEY]})
            log.error("GPU reset failed: %s", out.error, extra={"event": "ladder_reset_failed"})
            return
        out.actions.append({"action": RUNG_RESET, "result": f"reset GPU(s) "
                            f"{', '.join(map(str, gpus))}; the burn-in re-screens the node"})
        if record(Remediation(passed=True, detail=f"GPU reset of {len(gpus)} GPU(s) (repair "
                              "ladder, rung 1)", evidence=evidence)).changed:
            out.taken.append(RUNG_RESET)
