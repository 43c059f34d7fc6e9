"""The CLI's composition root (screener.commands.context) and the rules it applies once: the node
name, what store "auto" means, which --db a command may create, and that what a command opens is
closed when it ends while what a caller gave is left alone."""

from __future__ import annotations

import socket

import click
import pytest
from click.testing import CliRunner

from screener.cli import main
from screener.commands.context import AppContext, pass_app
from screener.commands.options import store_options, with_store
from screener.settings.daemon import DaemonConfig
from screener.settings.stores import StoreChoice, resolve_store_kind
from screener.stores.local import LocalStore
from screener.types import node_name


@pytest.mark.parametrize("env,expected", [
    ({"NODE_NAME": "gpu-7"}, "gpu-7"), ({"NODE_NAME": "  gpu-7\n"}, "gpu-7"),
    ({"NODE_NAME": "   "}, socket.gethostname()), ({}, socket.gethostname()),
])
def test_one_node_name_rule_for_the_cli_and_the_daemon_config(env, expected):
    assert node_name(env) == expected
    assert AppContext(environ=env).node_name() == expected
    assert AppContext(environ=env).node_name(" given ") == "given"
    assert DaemonConfig.load(None, environ=env).node == expected


@pytest.mark.parametrize("kind,kubeconfig,env,expected", [
    ("auto", None, {}, "local"), ("auto", "kc", {}, "kube"),
    ("auto", None, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "kube"),
    ("local", "kc", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "local"), ("none", None, {}, "none"),
])
def test_one_auto_store_rule(kind, kubeconfig, env, expected):
    assert resolve_store_kind(kind, kubeconfig, env) == expected
    assert StoreChoice(kind, kubeconfig=kubeconfig).resolved(env) == expected
    if kind != "none":
        assert DaemonConfig(store=kind, kubeconfig=kubeconfig).resolved_store(env) == expected


@click.command()
@with_store(create=True)
@pass_app
def _show(app: AppContext, store: LocalStore) -> None:
    click.echo(f"{type(store).__name__} {app.clock():g}")
    app.last = store  # type: ignore[attr-defined]


def test_a_store_opened_for_a_command_is_closed_when_it_ends(tmp_path):
    app = AppContext(environ={}, clock=lambda: 7.0)
    r = CliRunner().invoke(_show, ["--db", str(tmp_path / "s.db"), "--store", "local"], obj=app)
    assert r.exit_code == 0 and r.output == "LocalStore 7\n", r.output
    with pytest.raises(Exception):  # closed: sqlite refuses a closed connection
        app.last.all_states()


def test_a_given_store_is_used_for_every_choice_and_left_open(tmp_path):
    given = LocalStore(tmp_path / "given.db")
    app = AppContext(environ={}, store=given)
    r = CliRunner().invoke(_show, ["--store", "kube", "--kubeconfig", "/nowhere"], obj=app)
    assert r.exit_code == 0 and app.last is given, r.output
    assert given.all_states() == {}  # still open
    given.close()


def test_a_reader_refuses_a_missing_db_and_a_writer_creates_it(tmp_path):
    missing = tmp_path / "no" / "s.db"

    @click.command()
    @store_options(create=False)
    @pass_app
    def reader(app: AppContext, store_choice: StoreChoice) -> None:
        app.store(store_choice)

    r = CliRunner().invoke(reader, ["--db", str(missing)], obj=AppContext(environ={}))
    assert r.exit_code == 2 and "no state database there" in r.output
    assert not missing.parent.exists()
    missing.parent.mkdir()
    r = CliRunner().invoke(main, ["node", "set", "n1", "burnin", "--reason", "new", "--db",
                                  str(missing)], obj=AppContext(environ={}))
    assert r.exit_code == 0 and missing.exists(), r.output


def test_the_store_options_read_the_environment_only_where_asked(tmp_path):
    seen = []

    @click.command()
    @store_options(env=False, spool=False, none_help="nowhere.")
    def burnin_like(store_choice: StoreChoice) -> None:
        seen.append(store_choice)

    r = CliRunner().invoke(burnin_like, ["--store", "none"],
                           env={"SCREENER_DB": str(tmp_path / "x.db")})
    assert r.exit_code == 0 and seen[-1] == StoreChoice("none", create=False), r.output
    r = CliRunner().invoke(main, ["lemons", "--json"], env={"SCREENER_STORE": "local",
                                                            "SCREENER_DB": str(tmp_path / "x.db")})
    assert r.exit_code == 2 and "x.db" in r.output  # node commands do read them


def test_a_close_that_fails_is_a_warning_not_the_commands_exit_code(caplog):
    """A store whose close raises (a full disk under the spool, say) must not turn a command that
    finished, with its verdict as exit code, into an error; the other closes still run."""
    closed = []

    def broken() -> None:
        raise OSError("disk full")

    @click.command()
    @pass_app
    def cmd(app: AppContext) -> None:
        app.on_close(lambda: closed.append("first"))
        app.on_close(broken)
        raise SystemExit(75)

    with caplog.at_level("WARNING", logger="screener.commands.context"):
        r = CliRunner().invoke(cmd, [], obj=AppContext())
    assert r.exit_code == 75, r.output
    assert closed == ["first"]
    assert "disk full" in caplog.text
