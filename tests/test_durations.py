"""The one duration parser (screener.settings.durations): what `burnin --duration` and
`correlate --window` accept, and their one-line refusals."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from screener.cli import main
from screener.errors import BadInputError
from screener.settings.durations import YEAR_S, parse_duration


@pytest.mark.parametrize("text,seconds", [
    # what correlate accepted
    ("30m", 1800), ("1h30m", 5400), ("90s", 90), ("2d", 172800), ("45", 45), ("500ms", 0.5),
    ("1w", 604800), ("1e3", 1000), (".5", 0.5),
    # what burnin accepted
    ("90", 90), ("10m", 600), ("2h", 7200), ("1.5d", 1.5 * 86400), (" 10 m ", 600),
])
def test_accepts_what_either_command_accepted(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text,why", [
    ("", "is not like"), ("30x", "is not like"), ("m30", "is not like"), ("ten", "is not like"),
    ("5y", "is not like"), ("1h 30m", "is not like"), ("1h30", "is not like"),
    ("-5m", "is not like"), ("0s", "greater than zero"), ("0", "greater than zero"),
    ("nan", "not a number"), ("inf", "too long"), ("9" * 400, "too long"),
])
def test_refuses_with_a_line_naming_the_text(text, why):
    with pytest.raises(BadInputError, match=why) as e:
        parse_duration(text)
    assert repr(text[:40]) in str(e.value) and "\n" not in str(e.value)


def test_zero_only_where_it_means_off():
    with pytest.raises(BadInputError, match="greater than zero"):
        parse_duration("0")
    assert parse_duration("0", allow_zero=True) == 0.0
    assert parse_duration("0s", allow_zero=True) == 0.0
    with pytest.raises(BadInputError, match="greater than zero"):
        parse_duration("-1", allow_zero=True)


def test_longest_bounds_the_result():
    assert parse_duration("365d", longest=YEAR_S) == YEAR_S
    with pytest.raises(BadInputError, match="longer than a year"):
        parse_duration("366d", longest=YEAR_S)
    assert parse_duration("366d") == 366 * 86400  # no bound unless asked


@pytest.mark.parametrize("args", [["burnin", "--duration", "5y"], ["burnin", "--duration", "400d"],
                                  ["correlate", "n1", "--prometheus", "http://127.0.0.1:9",
                                   "--window", "soon"]])
def test_commands_refuse_a_bad_duration_before_doing_anything(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "Invalid value for '--" in r.output and "duration" in r.output, r.output
