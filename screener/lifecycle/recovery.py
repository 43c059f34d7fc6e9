"""Recovery planning: how often to checkpoint, and how much of the wall time does useful work.

Pure arithmetic on plain numbers (minutes and hours), first-order models as the seed articles use
them:

- Young's approximation of the best checkpoint interval: tau = sqrt(2 * C * M), with C the time to
  write one checkpoint and M the job's mean time between interruptions.
- Goodput: every interruption loses, on average, half an interval of work plus the restart time R;
  every interval pays C for its checkpoint. So goodput ~ 1 - (tau / 2 + R) / M - C / tau.
- A job that needs every one of N nodes, each failing at rate r_f, is interrupted at rate N * r_f:
  job MTTF = 1 / (N * r_f).
- The per-node failure rate can be measured from the lifecycle's own history: confirmed failures
  of in-service nodes, per node-hour observed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional

from screener.errors import BadInputError
from screener.lifecycle.records import Transition
from screener.types import BUDGET_STATES

# With zero failures observed in T node-hours, about 3 / T is the 95% upper bound of the rate
# ("rule of three" for a Poisson count); used so that a clean history still gives a usable plan.
_RULE_OF_THREE = 3.0


def young_interval(checkpoint_minutes: float, mttf_minutes: float) -> float:
    """Young's best checkpoint interval in minutes: sqrt(2 * C * M)."""
    _positive("checkpoint time", checkpoint_minutes)
    _positive("job MTTF", mttf_minutes)
    return math.sqrt(2.0 * checkpoint_minutes * mttf_minutes)


def job_mttf_hours(nodes: int, failures_per_node_hour: float) -> float:
    """Mean time between interruptions of a job that needs all `nodes`: 1 / (N * r_f)."""
    if nodes < 1:
        raise BadInputError(f"node count {nodes} must be at least 1")
    _positive("per-node failure rate", failures_per_node_hour)
    return 1.0 / (nodes * failures_per_node_hour)


@dataclass(frozen=True)
class Plan:
    """A checkpoint interval and what the wall time goes to with it."""

    checkpoint_minutes: float
    mttf_minutes: float
    restart_minutes: float
    interval_minutes: float
    lost_per_interruption_minutes: float  # half an interval of work plus the restart
    interruption_share: float  # share of wall time lost to interruptions
    checkpoint_share: float  # share of wall time spent writing checkpoints
    goodput: float  # the rest, clipped at 0
    young: bool  # the interval is Young's (not one the caller fixed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(checkpoint_minutes: float, mttf_minutes: float, restart_minutes: float = 0.0,
         interval_minutes: Optional[float] = None) -> Plan:
    """Goodput of checkpointing every interval_minutes (Young's interval if not given)."""
    _positive("checkpoint time", checkpoint_minutes)
    _positive("job MTTF", mttf_minutes)
    if restart_minutes < 0 or not math.isfinite(restart_minutes):
        raise BadInputError(f"restart time {restart_minutes} must be a finite number >= 0")
    young = interval_minutes is None
    tau = young_interval(checkpoint_minutes, mttf_minutes) if interval_minutes is None \
        else _positive("checkpoint interval", interval_minutes)
    lost = tau / 2.0 + restart_minutes
    interruption_share = lost / mttf_minutes
    checkpoint_share = checkpoint_minutes / tau
    goodput = max(0.0, 1.0 - interruption_share - checkpoint_share)
    return Plan(checkpoint_minutes=checkpoint_minutes, mttf_minutes=mttf_minutes,
                restart_minutes=restart_minutes, interval_minutes=tau,
                lost_per_interruption_minutes=lost, interruption_share=interruption_share,
                checkpoint_share=checkpoint_share, goodput=goodput, young=young)


@dataclass(frozen=True)
class FailureRate:
    """Failures per node-hour measured over a window of the lifecycle history."""

    failures: int
    nodes: int
    node_hours: float
    window_hours: float
    per_node_hour: float
    upper_bound: bool  # no failure seen: per_node_hour is the rule-of-three 95% upper bound

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def failure_rate(transitions: Iterable[Transition], now: float, window_hours: float = 30 * 24.0,
                 first_seen: Optional[Mapping[str, float]] = None) -> FailureRate:
    """Measure the per-node failure rate from recorded transitions within the last window_hours.

    A failure is a transition the lifecycle marked as a confirmed hardware failure (failure=True)
    of a node that was in service: a node already quarantined or in repair interrupts no job when
    its remediation fails. A node is observed from its first record (or the window's start, if
    later) until now; `first_seen` gives each node's first record time when the transitions passed
    in are not the whole history (e.g. only the failures).
    """
    _positive("history window", window_hours)
    start = now - window_hours * 3600.0
    seen: dict[str, float] = dict(first_seen or {})
    failures = 0
    for t in sorted(transitions, key=lambda t: t.time):
        if t.time > now:
            continue
        seen[t.node] = min(seen.get(t.node, t.time), t.time)
        # A failure of a node already out of service interrupts no job.
        if t.time >= start and t.failure and t.from_state not in BUDGET_STATES:
            failures += 1
    seen = {n: t for n, t in seen.items() if t <= now}
    if not seen:
        raise BadInputError("the store holds no node history to measure a failure rate from")
    node_hours = sum((now - max(t, start)) / 3600.0 for t in seen.values())
    if node_hours <= 0:
        raise BadInputError("the recorded history covers no time yet; give --mttf-hours instead")
    upper = failures == 0
    rate = (_RULE_OF_THREE if upper else failures) / node_hours
    return FailureRate(failures=failures, nodes=len(seen), node_hours=node_hours,
                       window_hours=window_hours, per_node_hour=rate, upper_bound=upper)


def _positive(what: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise BadInputError(f"{what} {value!r} must be a finite number > 0")
    return float(value)
