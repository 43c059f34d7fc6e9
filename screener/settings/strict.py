"""Build frozen config dataclasses from parsed config tables, strictly.

Every config section (probes, lifecycle, hyperpod, ...) is a frozen dataclass whose fields are the
keys it accepts. A key the dataclass does not know is a typo or a setting from another version, and
silently dropping it would run with a default the operator did not choose, so it is an error that
names the section and the key. A NaN or an infinity anywhere in a section is refused here for
every section at once: `x < 0` is False for NaN, so a range check alone would let it through and
switch a timer off. Value checks stay in each dataclass's __post_init__, which bounds every number
on both sides with `require_number`: a bool is no number (TOML's `true` would be 1, a budget of
100%), and an interval of 1e10 s overflows the waits it reaches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from screener.errors import ConfigError

T = TypeVar("T")


def from_mapping(cls: type[T], mapping: Any, section: str) -> T:
    """cls(**mapping), refusing anything that is not a table and any key cls has no field for.

    Raises ConfigError naming `section`; a value of the wrong type that makes the dataclass's own
    checks fail with TypeError (comparing a string with a number) is a ConfigError too.
    """
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{section} config must be a table, not {type(mapping).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in set(mapping) - known)
    if unknown:
        raise ConfigError(f"{section} config: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    for key, value in mapping.items():
        bad = _non_finite(value)
        if bad is not None:
            raise ConfigError(f"{section} config {key}={bad}: must be a finite number")
    try:
        return cls(**dict(mapping))
    except (TypeError, OverflowError) as e:
        raise ConfigError(f"{section} config: a value has the wrong type ({e})") from e
    except ValueError as e:  # e.g. a dataclass's int(...) of a bad string
        raise ConfigError(f"{section} config: a value is invalid ({e})") from e


def _non_finite(value: Any) -> Any:
    """The first NaN or infinity in a value (scalars and plain lists/tuples), else None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return v
        if isinstance(v, (list, tuple)) and len(stack) < 10_000:
            stack.extend(v)
    return None



def number_problem(value: Any, low: float, high: float, *, integer: bool = False,
                   low_open: bool = False) -> str:
    """Why `value` is not a number in [low, high] (low excluded when low_open; an int when
    `integer`; never a bool or NaN), or "" when it is one."""
    what = "an integer" if integer else "a number"
    lo = f"> {low:g}" if low_open else f">= {low:g}"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return f"must be {what} {lo} and <= {high:g}, not {type(value).__name__}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number {lo} and <= {high:g}"
    if value < low or (low_open and value == low) or value > high:
        return f"must be {what} {lo} and <= {high:g}"
    return ""


def require_number(section: str, name: str, value: Any, low: float, high: float, *,
                   integer: bool = False, low_open: bool = False, unit: str = "") -> None:
    """ConfigError '<section> config <name>=<value>: must be ...' unless number_problem is empty;
    `unit` (e.g. "seconds") ends the message."""
    problem = number_problem(value, low, high, integer=integer, low_open=low_open)
    if problem:
        raise ConfigError(f"{section} config {name}={repr(value)[:40]}: {problem}"
                          f"{f' ({unit})' if unit else ''}")
