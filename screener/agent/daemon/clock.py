"""The daemon's two clocks: a monotonic one for every interval it schedules, and wall-clock stamps
for the history that never run backward.

Why two: the wall clock can step (NTP correcting a drifted clock, a hypervisor restoring a
snapshot, an RTC reset at boot). Intervals measured on it break both ways: stepped back a day,
"probe again at next_probe" waits a day; stepped forward, an idle window or a daily screen is
over at once. So every interval (probes, ticks, idle windows, screens and their time cap,
retries, the budget's release look, liveness) runs on `Clock.monotonic`, which never steps.

The history needs wall time (people and other nodes read it), and its stamps must stay
comparable: the lemon rule counts failures in a window ending now, so a failure stamped after
"now" must not fall out of it. `StampClock` gives stamps that never go below the last one it
gave or the newest the node's history holds: after a backward step it counts on from the last
stamp by monotonic time (its "offset"), and takes the wall clock again once that has caught up.
A forward step is taken as it is (stamps stay ordered; a step forward and back again keeps the
stamps ahead until real time catches up, which orders them correctly and is logged).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union, runtime_checkable

log = logging.getLogger("screener.daemon")

# A step smaller than this is the normal jitter of a slewing clock, not worth a log line.
STEP_LOG_S = 1.0


@runtime_checkable
class Clock(Protocol):
    """What the daemon reads time from: `wall()` (unix seconds, may step) and `monotonic()`
    (seconds from an arbitrary origin, never steps)."""

    def wall(self) -> float: ...

    def monotonic(self) -> float: ...


@dataclass(frozen=True)
class SystemClock:
    """The host's clocks: time.time and time.monotonic."""

    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass(frozen=True)
class _OneClock:
    """One callable standing for both clocks: a test clock that never steps."""

    fn: Callable[[], float]

    def wall(self) -> float:
        return self.fn()

    def monotonic(self) -> float:
        return self.fn()


ClockLike = Union[Clock, Callable[[], float]]


def as_clock(clock: Optional[ClockLike]) -> Clock:
    """`clock` as a Clock: None is the system's; a plain callable (a test's fake clock, which
    never steps) serves as both the wall and the monotonic clock."""
    if clock is None:
        return SystemClock()
    if isinstance(clock, Clock):
        return clock
    if callable(clock):
        return _OneClock(clock)
    raise TypeError(f"not a clock: {clock!r}")


class StampClock:
    """Wall-clock stamps that never go backward (see the module docstring).

    `now()` is max(the wall clock, the last stamp + the monotonic time since it). `floor(t)`
    raises the last stamp to `t` (the newest stamp in the node's history, read at start-up), so a
    daemon restarted after a backward step still stamps after what it recorded before.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._last: Optional[tuple[float, float]] = None  # (stamp, monotonic when given)
        self.behind_s = 0.0  # how far the wall clock was behind the last stamp given

    def floor(self, stamp: float) -> None:
        """Never stamp before `stamp` from now on."""
        mono = self.clock.monotonic()
        if self._last is None or stamp > self._carried(mono):
            self._last = (float(stamp), mono)

    def _carried(self, mono: float) -> float:
        assert self._last is not None
        last, at = self._last
        return last + max(0.0, mono - at)

    def now(self) -> float:
        """The stamp for something that happens now."""
        wall, mono = self.clock.wall(), self.clock.monotonic()
        stamp = wall
        if self._last is not None:
            carried = self._carried(mono)
            if wall < carried:
                stamp = carried
                if carried - wall >= STEP_LOG_S and self.behind_s < STEP_LOG_S:
                    log.warning("the wall clock is %.1f s behind the last stamp recorded: "
                                "stamps count on by monotonic time until it catches up",
                                carried - wall, extra={"event": "clock_step",
                                                       "behind_s": round(carried - wall, 3)})
        self.behind_s = stamp - wall
        self._last = (stamp, mono)
        return stamp
