"""The one fake clock the tests share: time that moves only when a test moves it.

Called, it answers the wall time (what probes and stamps read). It also has the two methods of
screener.agent.daemon.clock.Clock, `wall()` and `monotonic()`, which advance together; `step(s)`
moves the wall clock alone, as NTP stepping it or an RTC reset would, so the daemon's clock tests
can tell the two apart. `t` is the wall time and may be set directly (`clock.t += 1.5`): the
monotonic clock moves with it, since only `step` separates them.

Thread-safe: a daemon thread reads it while the test advances it.
"""

from __future__ import annotations

import threading
from typing import Optional


class FakeClock:
    """A settable wall clock with a monotonic clock that follows it except across `step`."""

    def __init__(self, t: float = 1_000_000.0, *, monotonic: Optional[float] = None) -> None:
        self._lock = threading.Lock()
        self._wall = t
        # Kept apart from the wall time (not as an offset to it) so both stay exact.
        self._mono = t if monotonic is None else monotonic

    @property
    def t(self) -> float:
        with self._lock:
            return self._wall

    @t.setter
    def t(self, value: float) -> None:
        with self._lock:
            self._mono += value - self._wall
            self._wall = value

    def __call__(self) -> float:
        return self.wall()

    def wall(self) -> float:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, s: float) -> None:
        """Time passes: both clocks move `s` seconds."""
        with self._lock:
            self._wall += s
            self._mono += s

    def step(self, s: float) -> None:
        """The wall clock jumps `s` seconds (either way); the monotonic clock does not."""
        with self._lock:
            self._wall += s
