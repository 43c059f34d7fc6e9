"""Recovery planning: Young's interval, goodput, job MTTF, and the failure rate from the store.

The worked examples of the seed article (../shared/seeds/003_*.txt) are the reference values.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from screener.lifecycle import recovery
from screener.cli import main
from screener.commands.context import AppContext
from screener.errors import BadInputError
from screener.lifecycle.records import Transition
from screener.stores.local import LocalStore
from screener.types import NodeState as S

DAY = 86400.0


def test_young_interval_worked_example():
    # C = 1 min, M = 180 min: sqrt(360), about 19 minutes.
    assert round(recovery.young_interval(1, 180)) == 19
    assert recovery.young_interval(1, 180) == pytest.approx(math.sqrt(360))


def test_goodput_of_the_2048_gpu_run_before_and_after():
    # 256 nodes, an interruption every 6 h, C = 2 min, restart 25 min.
    before = recovery.plan(checkpoint_minutes=2, mttf_minutes=360, restart_minutes=25)
    assert round(before.interval_minutes) == 38
    assert before.lost_per_interruption_minutes == pytest.approx(44, abs=0.1)  # 19 + 25
    assert round(before.interruption_share * 100) == 12
    assert round(before.checkpoint_share * 100) == 5
    assert before.goodput == pytest.approx(0.83, abs=0.01)
    # Asynchronous saves (C = 20 s) and hot spares (restart 8 min).
    after = recovery.plan(checkpoint_minutes=20 / 60, mttf_minutes=360, restart_minutes=8)
    assert after.interval_minutes == pytest.approx(15.5, abs=0.1)
    assert after.lost_per_interruption_minutes == pytest.approx(16, abs=0.5)
    assert after.interruption_share == pytest.approx(0.045, abs=0.002)
    assert after.checkpoint_share == pytest.approx(0.02, abs=0.002)
    assert after.goodput == pytest.approx(0.93, abs=0.01)


@settings(max_examples=60, deadline=None)
@given(c=st.floats(0.01, 30), m=st.floats(10, 100_000), r=st.floats(0, 60))
def test_young_interval_is_the_best_interval(c, m, r):
    best = recovery.plan(c, m, r)
    for factor in (0.5, 0.9, 1.1, 2.0):
        other = recovery.plan(c, m, r, interval_minutes=best.interval_minutes * factor)
        assert other.interruption_share + other.checkpoint_share >= \
            best.interruption_share + best.checkpoint_share - 1e-12
    assert 0.0 <= best.goodput <= 1.0 and best.young


def test_job_mttf_from_node_count():
    # A 50,000 h device MTTF: a 1,000-device job is interrupted about every 50 h, 16,000 every ~3 h.
    assert recovery.job_mttf_hours(1000, 1 / 50_000) == pytest.approx(50)
    assert recovery.job_mttf_hours(16_000, 1 / 50_000) == pytest.approx(3.125)


@pytest.mark.parametrize("args", [(0, 180), (1, 0), (-1, 180), (float("nan"), 180), (1, float("inf"))])
def test_bad_numbers_are_bad_input(args):
    with pytest.raises(BadInputError):
        recovery.plan(*args)


def test_goodput_never_negative():
    p = recovery.plan(checkpoint_minutes=30, mttf_minutes=20, restart_minutes=60)
    assert p.goodput == 0.0 and p.interruption_share > 1


# --- the measured failure rate ------------------------------------------------------------------------

NOW = 100 * DAY


def t(node, when, frm, to, failure=False):
    return Transition(node=node, time=when, from_state=frm, to_state=to, reason="test", failure=failure)


def history_store(path):
    """Four nodes, 20 days each in the window; three interrupting failures, one that is not."""
    store = LocalStore(path)
    start = NOW - 20 * DAY
    for i in range(4):
        n = f"node-{i}"
        store.record(t(n, start, None, S.BURNIN))
        store.record(t(n, start + 1, S.BURNIN, S.HEALTHY))
    # node-0: quarantined (a failure), then its deep health check fails (no job interrupted).
    store.record(t("node-0", start + 2 * DAY, S.HEALTHY, S.QUARANTINED, failure=True))
    store.record(t("node-0", start + 3 * DAY, S.QUARANTINED, S.REPAIR, failure=True))
    # node-1: held in suspect by the budget: still a confirmed failure.
    store.record(t("node-1", start + 5 * DAY, S.HEALTHY, S.SUSPECT, failure=True))
    # node-2: an ambiguous signal is no failure; later a confirmed one.
    store.record(t("node-2", start + 6 * DAY, S.HEALTHY, S.SUSPECT))
    store.record(t("node-2", start + 7 * DAY, S.SUSPECT, S.QUARANTINED, failure=True))
    return store


def test_failure_rate_from_the_store(tmp_path):
    store = history_store(tmp_path / "s.db")
    first = {n: store.history(n)[0].time for n in store.all_states()}
    rate = recovery.failure_rate(store.failures(NOW - 30 * DAY), NOW, 30 * 24, first_seen=first)
    store.close()
    assert rate.failures == 3 and rate.nodes == 4 and not rate.upper_bound
    assert rate.node_hours == pytest.approx(4 * 20 * 24)
    assert rate.per_node_hour == pytest.approx(3 / (4 * 20 * 24))
    # A 4-node job is then interrupted every 20 days * 24 h / 3.
    assert recovery.job_mttf_hours(4, rate.per_node_hour) == pytest.approx(160)


def test_failure_rate_window_and_clean_history():
    old = [t("a", NOW - 40 * DAY, None, S.BURNIN),
           t("a", NOW - 35 * DAY, S.HEALTHY, S.QUARANTINED, failure=True)]
    rate = recovery.failure_rate(old, NOW, 30 * 24)
    # The failure is older than the window; the node is observed for the whole window.
    assert rate.failures == 0 and rate.upper_bound
    assert rate.node_hours == pytest.approx(30 * 24)
    assert rate.per_node_hour == pytest.approx(3 / (30 * 24))
    with pytest.raises(BadInputError, match="no node history"):
        recovery.failure_rate([], NOW)


def test_plan_cli_given_mttf():
    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "2", "--mttf-hours", "6",
                                  "--restart-minutes", "25", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert round(doc["interval_minutes"]) == 38 and doc["goodput"] == pytest.approx(0.83, abs=0.01)
    assert doc["mttf_source"] == {"kind": "given"}

    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "1", "--mttf-hours", "3",
                                  "--interval-minutes", "60"])
    assert r.exit_code == 0, r.output
    assert "checkpoint every 19.0 min" in r.stdout and "restart 0 min (not given: assumed 0)" in r.stdout
    assert "at your interval of 60 min" in r.stdout


def test_plan_cli_node_mttf():
    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "1", "--node-mttf-hours", "50000",
                                  "--nodes", "16000", "--json"])
    doc = json.loads(r.stdout)
    assert doc["mttf_hours"] == pytest.approx(3.125)
    assert doc["interval_minutes"] == pytest.approx(math.sqrt(2 * 1 * 3.125 * 60))


def test_plan_cli_history(tmp_path):
    store = history_store(tmp_path / "s.db")
    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "1", "--history", "--json"],
                           obj=AppContext(store=store, clock=lambda: NOW))
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    src = doc["mttf_source"]
    assert (src["kind"], src["failures"], src["nodes"]) == ("history", 3, 4)
    assert doc["mttf_hours"] == pytest.approx(160)
    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "1", "--history", "--nodes", "256"],
                           obj=AppContext(store=store, clock=lambda: NOW))
    assert r.exit_code == 0, r.output
    assert "3 failure(s) in 1920 node-hours over 4 node(s)" in r.stdout and "job of 256 node(s)" in r.stdout
    store.close()


@pytest.mark.parametrize("args", [
    ["--checkpoint-minutes", "1"],
    ["--checkpoint-minutes", "1", "--mttf-hours", "3", "--history"],
    ["--checkpoint-minutes", "1", "--node-mttf-hours", "100"],
])
def test_plan_cli_bad_input(args):
    r = CliRunner().invoke(main, ["plan", *args])
    assert isinstance(r.exception, BadInputError), r.output


def test_plan_numbers_out_of_range_are_usage_errors():
    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "0", "--mttf-hours", "3"])
    assert r.exit_code == 2 and "Invalid value for '--checkpoint-minutes'" in r.output, r.output


def test_plan_bad_input_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "screener.cli", "plan", "--checkpoint-minutes", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "exactly one of --mttf-hours" in r.stderr


def test_plan_history_with_no_failure_and_no_observed_time_refuses_in_one_line(tmp_path):
    # Issue 35.4 (5): one node first seen 14 s ago, no failure: the rule of three bounded the
    # rate at 785 per node-hour, and the plan said "a checkpoint every 0.6 min, 361.8% of wall".
    store = LocalStore(tmp_path / "s.db")
    store.record(t("node-0", NOW - 14, None, S.BURNIN))
    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "2", "--history"],
                           obj=AppContext(store=store, clock=lambda: NOW))
    assert r.exit_code == 3, r.output
    assert r.stdout == "", r.stdout
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "no failure recorded" in line, r.stderr
    assert "0.00389 node-hours" in line and "2 min checkpoint" in line, line
    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "2", "--history", "--json"],
                           obj=AppContext(store=store, clock=lambda: NOW))
    assert r.exit_code == 3 and r.stdout == "", r.output
    store.close()


def test_plan_history_with_no_failure_over_a_long_history_states_a_bound(tmp_path):
    store = LocalStore(tmp_path / "s.db")
    store.record(t("node-0", NOW - 30 * DAY, None, S.BURNIN))
    r = CliRunner().invoke(main, ["plan", "--checkpoint-minutes", "2", "--history"],
                           obj=AppContext(store=store, clock=lambda: NOW))
    store.close()
    assert r.exit_code == 0, r.output
    # 720 node-hours, no failure: MTTF at least 720 / 3 = 240 h, and the goodput at least what
    # the plan computes from it.
    assert "job MTTF at least 240 h" in r.stdout and "goodput at least" in r.stdout, r.stdout
    assert "(upper bound: no failure recorded)" in r.stdout
