"""ScreenerNotScreening sees every node (issue 25.2): a node that passed has "last screened"
(screener_last_successful_screen_timestamp_seconds), one that never did since its daemon
started has "never screened since" (screener_never_screened_since_timestamp_seconds), and the
alert fires for a healthy node whose series is older than two days, whichever it is.

With promtool (Debian's prometheus package, installed by .ci/run) the real rule is evaluated on
made-up series; the twin, which always runs, scrapes a real DaemonMetrics over HTTP with the
Prometheus client's own parser and checks the series the rule needs are there when they must be.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from observability_util import load_rule_groups, rules_file, state_series
from screener.agent.metrics import DaemonMetrics, MetricsServer, NeverScreened
from screener.types import NodeState, Outcome

PROMTOOL = shutil.which("promtool")
LAST = "screener_last_successful_screen_timestamp_seconds"
NEVER = NeverScreened.NAME


@pytest.mark.slow
@pytest.mark.skipif(PROMTOOL is None, reason="no promtool binary (apt-get install prometheus; "
                                             ".ci/run installs it); the twin below still runs")
def test_promtool_not_screening_fires_for_never_and_long_unscreened_nodes(tmp_path):
    minutes = 3000  # 50 h of one-minute samples
    series = []
    for node, state in (("never", "healthy"), ("old", "healthy"), ("fresh", "healthy"),
                        ("restarted", "healthy"), ("passed", "healthy"),
                        ("burning", "burnin")):
        series += state_series(node, state, f"Vx{minutes}")
    series += [
        # Adopted healthy at t=0 and never screened: only "never screened since".
        {"series": f'{NEVER}{{node="never"}}', "values": f"0x{minutes}"},
        # Passed once at t=0, never since; and one that passes every minute.
        {"series": f'{LAST}{{node="old"}}', "values": f"0x{minutes}"},
        {"series": f'{LAST}{{node="fresh"}}', "values": f"0+60x{minutes}"},
        # Never screened; its daemon restarted at 25 h (a new start time): the clock runs on.
        {"series": f'{NEVER}{{node="restarted",pod="p1"}}', "values": "0x1500 stale"},
        {"series": f'{NEVER}{{node="restarted",pod="p2"}}', "values": "_x1500 90000x1500"},
        # Never screened until it passed at 10 h; then "last screened" only, kept fresh.
        {"series": f'{NEVER}{{node="passed"}}', "values": "0x600 stale"},
        {"series": f'{LAST}{{node="passed"}}', "values": f"_x600 36000+60x{minutes - 600}"},
        # Never screened, but in burnin (tainted, screened when idle): not this alert's business.
        {"series": f'{NEVER}{{node="burning"}}', "values": f"0x{minutes}"},
    ]
    fired = [{"exp_labels": {"node": n, "severity": "warning"}}
             for n in ("never", "old", "restarted")]
    tests = {"rule_files": [rules_file(tmp_path, annotations=False).name],
             "evaluation_interval": "1m", "tests": [
                 {"interval": "1m", "input_series": series, "alert_rule_test": [
                     {"eval_time": "50h", "alertname": "ScreenerNotScreening",
                      "exp_alerts": fired},
                     {"eval_time": "47h", "alertname": "ScreenerNotScreening",
                      "exp_alerts": []}]}]}
    t = tmp_path / "tests.yaml"
    t.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", str(t)], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def scrape(server: MetricsServer) -> dict[str, dict[str, float]]:
    """GET /metrics; sample name -> node -> value, parsed by prometheus_client."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[s.labels.get("node", "")] = s.value
    return out


def test_twin_every_node_has_a_last_or_never_screened_series_over_http():
    started = 1_700_000_000.0
    m = DaemonMetrics("gpu-1", clock=lambda: started)
    m.set_state(NodeState.HEALTHY)
    server = MetricsServer(m, "127.0.0.1", 0).start()
    try:
        seen = scrape(server)
        assert seen[NEVER] == {"gpu-1": started} and LAST not in seen
        m.screen_done(Outcome.INCONCLUSIVE, [], 5.0)  # a busy node: screens never pass
        assert scrape(server)[NEVER] == {"gpu-1": started}
        m.screen_done(Outcome.PASS, [Outcome.PASS], 5.0, passed_at=started + 60)
        seen = scrape(server)
        assert seen[LAST] == {"gpu-1": started + 60} and NEVER not in seen
    finally:
        server.stop()
    # A restarted daemon that restores the last pass from the store sets the gauge directly.
    again = DaemonMetrics("gpu-1", clock=lambda: started + 3600)
    again.last_success.labels("gpu-1").set(started + 60)
    assert NEVER + "{" not in again.exposition().decode()


def test_twin_the_rule_reads_both_series_on_healthy_nodes():
    rule = next(r for g in load_rule_groups() for r in g["rules"]
                if r.get("alert") == "ScreenerNotScreening")
    expr = " ".join(rule["expr"].split())
    assert LAST in expr and NEVER in expr and " or " in expr
    assert "min_over_time(" + NEVER in expr  # a restart must not reset the clock
    assert 'state="healthy"' in expr and "2 * 86400" in expr
