"""Every number bounded (issue 23.6): each config key and each number a command takes, fed NaN,
infinities, a negative, a huge value, a bool and a string, is refused with exit 2 and one line
naming it; nothing starts an endless run.

The config keys are enumerated from the dataclasses and the commands from the CLI itself, so a
new key or option is swept without editing this file.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from typing import Any, Iterator

import click
import pytest

import cli_util

from screener.cli import main
from screener.commands._params import Duration, FiniteFloat
from screener.errors import ConfigError
from screener.lifecycle.machine import LifecyclePolicy
from screener.settings.daemon import ENV_PREFIX, DaemonConfig
from screener.settings.health import ProbeConfig
from screener.settings.hyperpod import HyperPodConfig

# --- config keys ---------------------------------------------------------------------------------

SECTIONS: dict[str, type] = {"": DaemonConfig, "probes": ProbeConfig, "lifecycle": LifecyclePolicy,
                             "hyperpod": HyperPodConfig}
# TOML literals: TOML has nan and inf, so the file reaches the dataclasses with them.
HOSTILE_TOML = {"nan": "nan", "inf": "inf", "-inf": "-inf", "negative": "-1",
                "huge float": "1e300", "huge int": "9223372036854775807", "bool": "true",
                "string": '"abc"'}
# What is a valid setting after all: a string for text and path keys, a bool for switches, -1
# for the metrics port (serve nothing).
VALID = {("", "metrics_port", "negative")}


def _base(hint: Any) -> Any:
    """A field's type with Optional[...] taken off."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _config_cases() -> Iterator[tuple[str, str, str]]:
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS:
                continue  # a nested table: swept as its own section
            base = _base(hints[f.name])
            for kind in HOSTILE_TOML:
                if (kind == "string" and base is str) or (kind == "bool" and base is bool) \
                        or (section, f.name, kind) in VALID:
                    continue
                yield section, f.name, kind


CONFIG_CASES = list(_config_cases())


def test_the_sweep_covers_every_key():
    keys = {(s, k) for s, k, _ in CONFIG_CASES}
    assert len(keys) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values()) - 3
    assert ("lifecycle", "quarantine_budget") in keys and ("", "tick_s") in keys


@pytest.mark.parametrize("section,key,kind", CONFIG_CASES)
def test_every_config_key_refuses_a_hostile_value(tmp_path, section, key, kind):
    path = tmp_path / "daemon.toml"
    path.write_text((f"[{section}]\n" if section else "") + f"{key} = {HOSTILE_TOML[kind]}\n")
    with pytest.raises(ConfigError) as e:
        DaemonConfig.load(path, environ={})
    text = str(e.value)
    assert key in text and str(path) in text and "\n" not in text, text
    assert e.value.exit_code == 2


NUMERIC_KEYS = [f.name for f in dataclasses.fields(DaemonConfig)
                if typing.get_type_hints(DaemonConfig)[f.name] in (int, float)]


@pytest.mark.parametrize("key", NUMERIC_KEYS)
def test_every_numeric_environment_setting_refuses_a_hostile_value(key):
    for text in ("nan", "inf", "-1", "1e300", "9" * 30, "true", "abc"):
        if (key, text) == ("metrics_port", "-1"):
            continue  # serve nothing: valid
        name = ENV_PREFIX + key.upper()
        with pytest.raises(ConfigError) as e:
            DaemonConfig.load(None, environ={name: text})
        assert (key in str(e.value) or name in str(e.value)) and "\n" not in str(e.value), \
            (text, str(e.value))


def test_the_issue_cases_are_refused_by_the_daemon_command(tmp_path):
    """In a real process: `tick_s = 1e10` killed the loop, `quarantine_budget = true` was 100%."""
    for text, key in (("tick_s = 1e10\n", "tick_s"),
                      ("[lifecycle]\nquarantine_budget = true\n", "quarantine_budget")):
        path = tmp_path / "daemon.toml"
        path.write_text(text)
        p = subprocess.run([sys.executable, "-m", "screener.cli", "daemon", "--config", str(path),
                            "--once", "--store", "local", "--db", str(tmp_path / "s.db")],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and key in lines[0] and "Traceback" not in p.stderr, p.stderr
        assert not (tmp_path / "s.db").exists()


# --- numbers on the command line -----------------------------------------------------------------

NUMBER_TYPES = (click.types.IntParamType, click.types.FloatParamType, FiniteFloat, Duration)
HOSTILE_CLI = ("nan", "inf", "-inf", "-1", "1e308", "1" + "0" * 30, "true", "abc")
# Numbers bounded somewhere other than their click type (none now); any new unbounded one fails.
UNBOUNDED_ELSEWHERE: set[tuple[str, str]] = set()


def _commands(group: click.Group, ctx: click.Context, path: str = "") -> Iterator[tuple[str, Any]]:
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        full = f"{path} {name}".strip()
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, click.Context(cmd, parent=ctx, info_name=name), full)
        else:
            yield full, cmd


def _numbers() -> list[tuple[str, click.Parameter]]:
    ctx = click.Context(main, info_name="screener")
    return [(path, p) for path, cmd in _commands(main, ctx) for p in cmd.params
            if isinstance(p.type, NUMBER_TYPES)
            and not (isinstance(p, click.Option) and p.is_flag)]


def _bounded(t: click.ParamType) -> bool:
    if isinstance(t, Duration):
        return t.longest is not None
    if isinstance(t, FiniteFloat) or isinstance(t, click.types._NumberRangeBase):
        return t.min is not None and t.max is not None
    return False


NUMBERS = _numbers()


def test_every_cli_number_is_bounded_on_both_sides():
    assert len(NUMBERS) >= 25  # the walk found the commands
    unbounded = {(path, p.name) for path, p in NUMBERS if not _bounded(p.type)}
    assert unbounded == UNBOUNDED_ELSEWHERE


@pytest.mark.parametrize("path,param", NUMBERS, ids=[f"{c}:{p.name}" for c, p in NUMBERS])
def test_every_cli_number_refuses_a_hostile_value(path, param):
    flag = param.opts[-1] if isinstance(param, click.Option) else None
    tried = 0
    for value in HOSTILE_CLI:
        try:  # a value the type takes is in range: running the command is not this test's job
            param.type.convert(value, param, None)
            continue
        except click.BadParameter:
            pass
        args = [*path.split(), *([flag, value] if flag else [value])]
        r = cli_util.screener(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        # One line in all (issue 25.8: click's usage and hint lines are gone).
        errors = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("screener: "), (args, r.stderr)
        assert "Traceback" not in r.stderr, (args, r.stderr)
        assert any(f"'{o}'" in errors[0] for o in param.opts) or param.name in errors[0], errors
        tried += 1
    assert tried >= 5, (path, param.name)  # nan, inf, -inf, the string and more are refused
