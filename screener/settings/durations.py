"""Durations typed by a person (`--duration 2h`, `--window 1h30m`): one parser for every command.

Pure: no click, no clock. A bad duration is a BadInputError (exit 2, one line) naming the text;
the CLI turns it into click's usual usage error (screener.commands._params.Duration).
"""

from __future__ import annotations

import math
import re
from typing import Optional

from screener.errors import BadInputError

# seconds per unit; a bare number is seconds
UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0,
                           "w": 604800.0}
YEAR_S = 365 * 86400.0

# One term: a number, optional blanks, an optional unit ("ms" before "m", so 500ms is not 500m).
_TERM = re.compile(r"(\d+(?:\.\d+)?)[ \t]*(ms|s|m|h|d|w)?")
_EXAMPLES = "90, 90s, 500ms, 10m, 1h30m, 2d or 1w"


def parse_duration(text: str, *, longest: Optional[float] = None,
                   allow_zero: bool = False) -> float:
    """Seconds in a duration: a number with an optional unit (ms, s, m, h, d, w; none is seconds),
    or several such terms written together (1h30m, 1d12h).

    Blanks may surround the text and sit between a number and its unit ('10 m'), not between
    terms ('1h 30m' is refused: it reads like two arguments). The result must be finite and
    greater than zero (or zero itself, with allow_zero: a setting where 0 means "off"), and at
    most `longest` seconds when given.
    """
    if not isinstance(text, str):
        raise BadInputError(f"duration {text!r} is not text")
    s = text.strip()
    value, pos, terms = 0.0, 0, 0
    try:  # a bare number in any form Python reads (1e3, .5, +5) is seconds
        value, pos, terms = float(s), len(s), 1
    except ValueError:
        pass
    while pos < len(s):
        m = _TERM.match(s, pos)
        # A unitless number is only valid alone: '90' is seconds, '1h30' is a typo.
        if m is None or (m.group(2) is None and (terms or m.end() != len(s))):
            raise BadInputError(f"duration {text[:40]!r} is not like {_EXAMPLES}")
        value += float(m.group(1)) * UNITS[m.group(2) or "s"]
        pos, terms = m.end(), terms + 1
    if not terms:
        raise BadInputError(f"duration {text[:40]!r} is not like {_EXAMPLES}")
    if math.isnan(value):
        raise BadInputError(f"duration {text[:40]!r} is not a number")
    if math.isinf(value):  # also a string of digits too long for a float
        raise BadInputError(f"duration {text[:40]!r} is too long")
    if value < 0 or (value == 0 and not allow_zero):
        raise BadInputError(f"duration {text[:40]!r} must be greater than zero")
    if longest is not None and value > longest:
        raise BadInputError(f"duration {text[:40]!r} is longer than {_plain(longest)}")
    return value


def _plain(seconds: float) -> str:
    if seconds == YEAR_S:
        return "a year"
    return f"{seconds:g} s"
