"""screener.settings.strict.from_mapping: the one strict builder of frozen config dataclasses."""

from __future__ import annotations

import dataclasses

import pytest

from screener.settings import strict as configs
from screener.errors import ConfigError
from screener.types import ExitCode


@dataclasses.dataclass(frozen=True)
class _Section:
    limit: int = 3
    name: str = "x"

    def __post_init__(self) -> None:
        if self.limit < 0:  # a string here raises TypeError, which from_mapping turns into ConfigError
            raise ConfigError(f"limit {self.limit} must be >= 0")


def test_builds_with_defaults_and_given_values():
    assert configs.from_mapping(_Section, {}, "demo") == _Section()
    assert configs.from_mapping(_Section, {"limit": 7}, "demo") == _Section(limit=7, name="x")


def test_unknown_keys_name_the_section_and_every_key():
    with pytest.raises(ConfigError) as e:
        configs.from_mapping(_Section, {"limt": 1, "nmae": "y", "limit": 2}, "demo")
    msg = str(e.value)
    assert msg.startswith("demo config: unknown key(s) limt, nmae;")
    assert "known: limit, name" in msg
    assert e.value.exit_code == ExitCode.USAGE


def test_not_a_table_and_wrong_types_are_config_errors():
    with pytest.raises(ConfigError, match="demo config must be a table, not list"):
        configs.from_mapping(_Section, ["limit"], "demo")
    with pytest.raises(ConfigError, match="demo config: a value has the wrong type"):
        configs.from_mapping(_Section, {"limit": "three"}, "demo")
    with pytest.raises(ConfigError, match="must be >= 0"):  # the dataclass's own check still runs
        configs.from_mapping(_Section, {"limit": -1}, "demo")
