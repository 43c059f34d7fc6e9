"""The repair ladder (issue 24.3): heal an idle quarantined node with the cheapest fix first.

Rungs, in order (what is implemented is said per rung):
  0. corroboration: where `dcgmi` is on PATH, `dcgmi diag -r LEVEL` on the first idle pass after
     the node entered quarantine; its result goes into the pass report and into the evidence of
     the rung that follows (the durable record). It decides nothing by itself: a DCGM pass never
     clears a node, a DCGM failure never blames one (only the known-answer screens do).
  1. GPU reset: `nvidia-smi -r -i N` for each GPU, only when `nvidia-smi --query-compute-apps`
     shows no process on any of them. When every GPU reset, the lifecycle records a Remediation
     (quarantined -> burnin, RemediationPassed, the reset's output as evidence) and the daemon's
     full burn-in on the idle node is the re-screen: healthy only if it passes, quarantined again
     (a failure, counted by the lemon rule) if not.
  2. reboot and 3. replace: not taken automatically here yet; a node past rung 1 waits for the
     existing paths (`screener hyperpod reboot|replace NODE --yes`, a person).

A reset that could not run (a process on a GPU, the tool missing, a refusal, a timeout) is OUR
failure or the node's business, never a hardware verdict: no transition, the attempt in the pass
report, an error metric and a log line, and the next try waits `min_interval_s`.

Budget and rate limit: at most `max_rungs` rungs per node in `window_days`, counted from the
node's own history (a rung taken is a RemediationPassed transition carrying `ladder` evidence);
at most one attempt per `min_interval_s` per node. Fleet-wide, the nodes in the ladder are
quarantined nodes, and the quarantine budget (one atomic fleet-wide count on both stores) already
caps how many there are at once; a reset is node-local and takes seconds, so no second fleet-wide
count is needed for it (an automatic reboot rung would need one: N reboot slots claimed as the
budget's slots are, so that at most N nodes reboot at once whatever the budget allows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from screener.lifecycle.machine import Remediation
from screener.lifecycle.records import Transition
from screener.remediation import gpu_tools
from screener.settings.ladder import LadderConfig
from screener.types import NodeState, Reason

log = logging.getLogger("screener.ladder")

RUNG_RESET = "gpu_reset"
EVIDENCE_KEY = "ladder"


@dataclass
class LadderStep:
    """What one look at the ladder did: actions for the pass report, and the lifecycle event to
    apply (None: nothing to record)."""

    actions: list[dict[str, Any]] = field(default_factory=list)
    event: Optional[Remediation] = None
    error: str = ""  # our failure, for the error metric


def rungs_taken(history: Sequence[Transition], since: float) -> int:
    """Ladder rungs recorded on the node since `since` (the budget's count)."""
    return sum(1 for t in history if t.time >= since and t.code == Reason.REMEDIATED
               and EVIDENCE_KEY in (t.evidence.get("remediation") or {}))


def quarantine_entry(history: Sequence[Transition]) -> Optional[Transition]:
    """The transition by which the node last entered quarantine (the ladder's episode)."""
    for t in reversed(history):
        if t.to_state == NodeState.QUARANTINED:
            return t
    return None


class RepairLadder:
    """The ladder for one node. env: the environment the tools run in (their PATH); monotonic:
    the clock of the rate limit's interval (history stamps come in with each step)."""

    def __init__(self, config: LadderConfig, *, env: Optional[Mapping[str, str]] = None,
                 monotonic: Callable[[], float]) -> None:
        self.config = config
        self.env = env
        self.monotonic = monotonic
        self._next_try = 0.0
        self._diag: dict[str, Any] = {}  # quarantine transition id -> the dcgmi result

    def step(self, history: Sequence[Transition], gpus: Sequence[int], now: float) -> LadderStep:
        """One look at an idle quarantined node (`history`: its transitions; `gpus`: the GPU
        indices its probe saw; `now`: a history stamp)."""
        out = LadderStep()
        if self.monotonic() < self._next_try:
            return out
        entry = quarantine_entry(history)
        if entry is None:
            return out
        taken = rungs_taken(history, now - self.config.window_days * 86400.0)
        if taken >= self.config.max_rungs:
            out.actions.append({"action": RUNG_RESET, "result": f"not started: the ladder's "
                                f"budget is spent ({taken} of {self.config.max_rungs} rungs in "
                                f"{self.config.window_days:g} days); a person decides"})
            self._next_try = self.monotonic() + self.config.min_interval_s
            return out
        if self._rung_tried(history, entry, RUNG_RESET):
            out.actions.append({"action": RUNG_RESET, "result": "already taken since this "
                                "quarantine's episode began; the next rungs (reboot, replace) "
                                "are a person's: screener hyperpod reboot|replace"})
            self._next_try = self.monotonic() + self.config.min_interval_s
            return out
        diag = self._corroborate(entry, out)
        self._next_try = self.monotonic() + self.config.min_interval_s
        self._reset(gpus, diag, out)
        return out

    def _rung_tried(self, history: Sequence[Transition], entry: Transition, rung: str) -> bool:
        """Whether `rung` was taken since the node's last time healthy (a reset that sent it to
        burnin and a burn-in that failed again make the same episode)."""
        healthy = max((t.time for t in history if t.to_state == NodeState.HEALTHY), default=0.0)
        return any(t.time >= healthy and
                   ((t.evidence.get("remediation") or {}).get(EVIDENCE_KEY) or {}).get("rung")
                   == rung for t in history)

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
        record = res.to_dict()
        self._diag[entry.id] = record
        said = ("no result: " + (res.tool.error if res.tool else "")) if res.passed is None \
            else "passed" if res.passed else f"failed: {', '.join(res.failed)}"
        out.actions.append({"action": "dcgm_diag", "result": said, "diag": record})
        log.warning("dcgmi diag -r %d on entry to quarantine: %s", self.config.dcgm_level, said,
                    extra={"event": "dcgm_diag", "passed": res.passed})
        return record

    def _reset(self, gpus: Sequence[int], diag: Optional[dict[str, Any]],
               out: LadderStep) -> None:
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
        evidence = {"rung": RUNG_RESET, "gpus": list(gpus),
                    "resets": [r.to_dict() for r in results], "dcgm_diag": diag}
        if failed:
            # Not a hardware verdict either way: the reset did not happen, so it proves nothing.
            out.error = "; ".join(r.error for r in failed)
            out.actions.append({"action": RUNG_RESET, "result": f"failed: {out.error}",
                                EVIDENCE_KEY: evidence})
            log.error("GPU reset failed: %s", out.error, extra={"event": "ladder_reset_failed"})
            return
        out.actions.append({"action": RUNG_RESET, "result": f"reset GPU(s) "
                            f"{', '.join(map(str, gpus))}; the burn-in re-screens the node"})
        out.event = Remediation(passed=True, detail=f"GPU reset of {len(gpus)} GPU(s) (repair "
                                "ladder, rung 1)", evidence={EVIDENCE_KEY: evidence})
