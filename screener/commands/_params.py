"""Click parameter types for numbers and durations from the command line: finite, and in range.

click.FloatRange lets `nan` through every bound (each comparison with NaN is False) and accepts
`inf`, so `--timeout nan` switched the hang watchdog off and `--days nan` made an empty window.
FiniteFloat refuses both with click's usual one line and exit 2. Every number a command takes is
bounded on both sides (tests/test_bounds.py walks every command to check it): `--days 1e308`
overflowed the report's date arithmetic, and a count of 10**30 runs or waits for ever.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import click

from screener.errors import BadInputError
from screener.settings.durations import parse_duration


# Upper bounds shared by commands: the longest history window a command reads (a century), and the
# most failures a lemon threshold may ask for.
MAX_DAYS = 36500.0
MAX_FAILURES = 1000


class FiniteFloat(click.ParamType):
    """A finite float in [min, max] (open at either end with min_open / max_open)."""

    name = "number"

    def __init__(self, min: Optional[float] = None, max: Optional[float] = None, *,  # noqa: A002
                 min_open: bool = False, max_open: bool = False) -> None:
        self.min, self.max = min, max
        self.min_open, self.max_open = min_open, max_open

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> float:
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a number", param, ctx)
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError):
            self.fail(f"{str(value)[:40]!r} is not a number", param, ctx)
        if not math.isfinite(v):
            self.fail(f"{str(value)[:40]!r} is not a finite number", param, ctx)
        if self.min is not None and (v < self.min or (self.min_open and v == self.min)):
            self.fail(f"{v:g} is not {'>' if self.min_open else '>='} {self.min:g}", param, ctx)
        if self.max is not None and (v > self.max or (self.max_open and v == self.max)):
            self.fail(f"{v:g} is not {'<' if self.max_open else '<='} {self.max:g}", param, ctx)
        return v

    def __repr__(self) -> str:
        return f"FiniteFloat({self.min}, {self.max})"


def positive(max: Optional[float] = None) -> FiniteFloat:  # noqa: A002
    """A finite number > 0 (seconds, days), at most `max` when given."""
    return FiniteFloat(0.0, max, min_open=True)


class Duration(click.ParamType):
    """Seconds from a duration such as 90s, 10m or 1h30m (screener.settings.durations), at most
    `longest` seconds when given, and 0 only with allow_zero (an option where 0 means "off"); a
    bad one is click's one-line usage error (exit 2)."""

    name = "duration"

    def __init__(self, longest: Optional[float] = None, *, allow_zero: bool = False) -> None:
        self.longest = longest
        self.allow_zero = allow_zero

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> float:
        if isinstance(value, float):  # already converted (a default given in seconds)
            return value
        try:
            return parse_duration(str(value), longest=self.longest, allow_zero=self.allow_zero)
        except BadInputError as e:
            self.fail(str(e), param, ctx)
