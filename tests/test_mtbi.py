"""Time between incidents per node (issue 24.4): the pure rule and `node status`'s column."""

from __future__ import annotations

import json

from click.testing import CliRunner

from screener.cli import main
from screener.commands.context import AppContext
from screener.lifecycle.incidents import format_mtbi, mtbi_seconds
from screener.lifecycle.records import Transition
from screener.stores.local import LocalStore
from screener.types import NodeState

DAY = 86400.0
NOW = 1_800_000_000.0


def test_mtbi_is_the_mean_gap_between_incidents():
    assert mtbi_seconds([]) is None and mtbi_seconds([5.0]) is None
    assert mtbi_seconds([30.0, 0.0, 10.0]) == 15.0
    assert format_mtbi(None) == "-" and format_mtbi(2 * DAY) == "2.0 d"
    assert format_mtbi(5400) == "1.5 h"


def _record(store: LocalStore, node: str, times: list[float]) -> None:
    """Failure transitions healthy -> quarantined at each time (a burn-in back in between)."""
    prev = None
    for i, t in enumerate(times):
        for to, failure in ((NodeState.QUARANTINED, True), (NodeState.HEALTHY, False)):
            store.record(Transition(node=node, from_state=prev, to_state=to, reason="test",
                                    code="KnownAnswerMismatch", time=t + (0 if failure else 60),
                                    failure=failure))
            prev = to


def test_node_status_shows_mtbi_for_a_node_and_for_the_fleet_when_asked(tmp_path):
    db = tmp_path / "state.db"
    store = LocalStore(db)
    _record(store, "lemon", [NOW - 20 * DAY, NOW - 14 * DAY, NOW - 2 * DAY])
    _record(store, "fine", [NOW - 50 * DAY])
    _record(store, "old", [NOW - 400 * DAY, NOW - 300 * DAY])  # outside the 90-day window
    store.close()
    run = lambda *a: CliRunner().invoke(main, ["node", "status", "--store", "local", "--db",  # noqa: E731
                                               str(db), *a], obj=AppContext(clock=lambda: NOW))
    one = json.loads(run("lemon", "--json").output)
    assert one["incidents"] == 3 and one["mtbi_s"] == 9 * DAY
    assert "MTBI 9.0 d" in run("lemon").output
    fleet = {r["node"]: r for r in json.loads(run("--json", "--mtbi").output)["nodes"]}
    assert fleet["lemon"]["mtbi_s"] == 9 * DAY and fleet["fine"]["mtbi_s"] is None
    assert fleet["old"]["incidents"] == 0
    table = run("--mtbi").output.splitlines()
    assert "MTBI" in table[0] and "9.0 d" in next(line for line in table if "lemon" in line)
    assert "MTBI" not in run().output  # the plain fleet view stays one read
