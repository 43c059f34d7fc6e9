"""The spike sentinel: a cheap test on every step of whether the loss or the gradient jumped.

Coverage of the ring replay is its frequency; a fault on a step between audits flows into every
replica. The faults that destroy runs (an exponent bit, a sign) are also the ones that show: the
loss or the gradient's magnitude jumps. The sentinel watches both on every step against a robust
running baseline and fires on a jump; the Auditor then attributes the step before the update
(a rerun on the same rank and a replay on another node: the data, a transient fault or a
persistent one).

A value x fires when, after `warmup` steps, both hold:
    x > ratio * median                      (default 5: a 5x jump, as ByteRobust treats it)
    x - median > z * 1.4826 * MAD           (default 6: far outside the recent spread)
over the last `window` accepted values (median and MAD, the median absolute deviation, so one
earlier spike cannot move the baseline much). Values compared are the ranks' largest loss and
largest local gradient magnitude (gathered, so every rank holds the same baseline and decides
alike). A value that fired joins the baseline only when the attribution says the data did it,
or could not run (so that a new level does not fire on every step). Losses can
be negative (a log-likelihood): the test then runs on the absolute value.

Pure: numbers in, a decision out; no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["SentinelConfig", "Sentinel", "Spike", "Rerun", "rerun_verdict"]


@dataclass(frozen=True)
class SentinelConfig:
    """Thresholds of the sentinel (see the module docstring); enabled by default."""

    enabled: bool = True
    ratio: float = 5.0
    z: float = 6.0
    warmup: int = 20
    window: int = 100
    on_data: str = "proceed"  # a spike the data explains: "proceed" with the step, or "skip" it

    def __post_init__(self) -> None:
        for name in ("ratio", "z"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 1.0:
                raise ValueError(f"sentinel {name} must be a finite number > 1, not {v!r}")
        for name, low in (("warmup", 3), ("window", 5)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 100_000:
                raise ValueError(f"sentinel {name} must be an integer in [{low}, 100000], "
                                 f"not {v!r}")
        if self.on_data not in ("proceed", "skip"):
            raise ValueError(f"sentinel on_data must be 'proceed' or 'skip', not {self.on_data!r}")


@dataclass(frozen=True)
class Spike:
    """Why the sentinel fired: which value, what it was, and the baseline it jumped from."""

    what: str  # "loss" or "grad"
    value: float
    median: float
    mad: float

    def to_dict(self) -> dict[str, float | str]:
        return {"what": self.what, "value": self.value, "median": self.median, "mad": self.mad,
                "ratio": self.value / self.median if self.median else float("inf")}


@dataclass
class _Series:
    window: int
    values: "deque[float]" = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.values = deque(maxlen=self.window)


class Sentinel:
    """Running baselines of the loss and the reduced gradient's magnitude, and the jump test."""

    def __init__(self, config: Optional[SentinelConfig] = None) -> None:
        self.config = config or SentinelConfig()
        self._series = {"loss": _Series(self.config.window), "grad": _Series(self.config.window)}
        self.fired = 0

    def check(self, loss: float, grad: float) -> Optional[Spike]:
        """The spike of this step, or None; a step that does not fire joins the baseline."""
        if not self.config.enabled:
            return None
        values = {"loss": abs(loss), "grad": abs(grad)}
        for what, x in values.items():
            spike = self._test(what, x)
            if spike is not None:
                self.fired += 1
                return spike
        for what, x in values.items():
            self.accept(what, x)
        return None

    def accept(self, what: str, x: float) -> None:
        """Add a value to its baseline (a step that did not fire, or a spike of the data's)."""
        if math.isfinite(x):
            self._series[what].values.append(abs(x))

    def _test(self, what: str, x: float) -> Optional[Spike]:
        series = self._series[what].values
        if len(series) < self.config.warmup or not math.isfinite(x):
            return None
        median = statistics.median(series)
        mad = statistics.median(abs(v - median) for v in series)
        if x > self.config.ratio * median and x - median > self.config.z * 1.4826 * mad:
            return Spike(what, x, median, mad)
        return None


# A rerun's or a replay's outcome: (loss bits, largest gradient magnitude bits, digest of every
# gradient fingerprint as two ints). The first two are what the training step recorded too.
Rerun = tuple[int, int, int, int]


def rerun_verdict(original: tuple[int, int], rerun: Rerun,
                  others: Sequence[Optional[Rerun]]) -> str:
    """What a spike's attribution says.

    original: the suspect's (loss bits, largest local gradient bits) in the step that fired;
    rerun: the suspect's own rerun of that step on its device; others: the replays of it on
    other nodes (a confirmer, a referee; None where there is none). The step and its reruns are
    compared by the gradient's largest magnitude: its bits come from the same tensors computed
    the same way, whereas the loss the loop passes in may be summed differently (a float64 sum
    of .item()s) than a rerun sums it. Returns
    - "data": the rerun and every replay reproduce the spike (no hardware verdict);
    - "persistent": the suspect reproduces its value, the others agree on another one;
    - "transient": the suspect's rerun differs from its own step and agrees with the others;
    - "unsettled": anything else (nobody can be named).
    """
    mag = original[1]
    same = rerun[1] == mag
    replays = [r for r in others if r is not None]
    if not replays:
        return "data" if same else "unsettled"
    agree = all(r == replays[0] for r in replays)
    if same and all(r[1] == mag for r in replays):
        return "data"
    if same and agree and replays[0][1] != mag:
        return "persistent"
    if not same and agree and rerun == replays[0]:
        return "transient"
    return "unsettled"
