"""manifests/observability/: the Grafana dashboard, the PrometheusRule and the PodMonitor say what
the daemon really exports. Metric and label names come from a live DaemonMetrics exposition, not a
list kept here. With promtool (Debian's prometheus package) every rule and every dashboard query
is parsed by Prometheus itself and every alert is fired on made-up series; the Python twins run
everywhere."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from observability_util import OBS, load_rule_groups, rules_file, state_series
from screener.agent.metrics import DaemonMetrics
from screener.types import NodeState, Outcome

ROOT = Path(__file__).resolve().parents[1]
PROMTOOL = shutil.which("promtool")
need_promtool = pytest.mark.skipif(PROMTOOL is None,
                                   reason="no promtool binary (apt-get install prometheus)")
PROMQL_WORDS = {"sum", "by", "max", "min", "count", "avg", "rate", "increase", "time", "or", "and",
                "on", "unless", "without", "histogram_quantile", "clamp_min", "floor", "vector",
                "le", "bool", "ignoring", "group_left", "group_right", "offset", "absent",
                "min_over_time"}


def exported() -> dict[str, set[str]]:
    """Every sample name the daemon exports -> its label names (from a real exposition)."""
    names: dict[str, set[str]] = {}
    # Before its first pass the node has "never screened since" instead of "last screened".
    _names(DaemonMetrics("node-a").exposition(), names)
    m = DaemonMetrics("node-a", clock=lambda: 1000.0)
    m.set_state(NodeState.HEALTHY)
    m.screen_done(Outcome.PASS, [Outcome.PASS], 12.0, passed_at=1000.0)
    m.error("screen")  # errors_total has no series until the first error
    m.alarm_applied("weights", True)  # labelled by check: no series until the first alarm
    m.set_awaiting({"00000000000000aa": 2})  # labelled by platform: none until one waits
    return _names(m.exposition(), names)


def _names(exposition: bytes, names: dict[str, set[str]]) -> dict[str, set[str]]:
    """Add every sample name of an exposition, with its label names, to `names`."""
    for line in exposition.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', line.split("}")[0]))
        names.setdefault(name, set()).update(labels)
    return names


EXPORTED = exported()


def recording_rules() -> dict[str, set[str]]:
    rules = load_rule_groups()
    return {r["record"]: set() for g in rules for r in g["rules"] if "record" in r}


def check_expr(expr: str, where: str) -> set[str]:
    """Every metric in expr is exported (or one of our recording rules); every label it selects
    or groups by exists on the metrics it uses. Returns the metric names used."""
    known = dict(EXPORTED) | recording_rules() | {"up": {"job", "pod", "instance", "namespace"}}
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_ranges = re.sub(r"\[[^\]]*\]", "", no_strings)
    idents = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", no_ranges))
    metrics = {i for i in idents if i.startswith("screener") or i == "up"}
    unknown = metrics - set(known)
    assert not unknown, f"{where}: no such metric {sorted(unknown)} in {expr!r}"
    label_sets = [known[m] for m in metrics if known[m]]
    labels_used = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!=|!~|=)\s*\"", expr))
    for grp in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
        labels_used |= {x.strip() for x in grp.split(",") if x.strip()}
    labels_used -= {"le"} if any(m.endswith("_bucket") for m in metrics) else set()
    for label in labels_used:
        assert any(label in s for s in label_sets), f"{where}: label {label!r} on none of {metrics}"
    others = idents - metrics - PROMQL_WORDS - labels_used - {"__rate_interval", "node", "state"}
    assert not others, f"{where}: unexpected identifiers {sorted(others)} in {expr!r}"
    return metrics


# --- the dashboard --------------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads((OBS / "screener-dashboard.json").read_text())


def test_dashboard_schema_basics():
    d = dashboard()
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["uid"] and d["title"] and isinstance(d["panels"], list) and len(d["panels"]) >= 8
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        assert p["type"] in {"timeseries", "stat", "gauge", "table", "state-timeline", "bargauge"}
        assert p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh")
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip()


def test_dashboard_queries_use_real_metrics_and_cover_the_issue():
    d = dashboard()
    used: set[str] = set()
    for p in d["panels"]:
        for t in p["targets"]:
            used |= check_expr(t["expr"], f"panel {p['title']!r}")
    # states over time, screens and outcomes, alarms, budget, duration, last successful screen
    for m in ("screener_node_state", "screener_screens_total", "screener_verdicts_total",
              "screener_alarms_total", "screener_alarms_applied_total",
              "screener_screen_duration_seconds_bucket",
              "screener_last_successful_screen_timestamp_seconds"):
        assert m in used, f"no panel shows {m}"
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for word in ("states over time", "budget", "screens by outcome", "alarms applied, by check",
                 "duration",
                 "last successful screen"):
        assert word in titles


def test_dashboard_ships_in_a_configmap_for_the_grafana_sidecar():
    k = yaml.safe_load((OBS / "kustomization.yaml").read_text())
    (gen,) = k["configMapGenerator"]
    assert gen["files"] == ["screener-dashboard.json"]
    assert gen["options"]["labels"] == {"grafana_dashboard": "1"}
    assert set(k["resources"]) == {"podmonitor.yaml", "prometheusrule.yaml"}


# --- the rules ------------------------------------------------------------------------------------

ALERTS = {"ScreenerNodeQuarantined", "ScreenerQuarantineBudgetNearlySpent",
          "ScreenerQuarantineBudgetSpent", "ScreenerDaemonDown", "ScreenerDaemonStalled",
          "ScreenerNotScreening", "ScreenerAlarmIntakeStalled", "ScreenerAlarmFilesStuck",
          "ScreenerPlatformAwaitingQuorum"}


def test_rules_twin_names_labels_and_annotations():
    groups = load_rule_groups()
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert set(alerts) == ALERTS
    for name, r in alerts.items():
        check_expr(r["expr"], name)
        assert r["labels"]["severity"] in {"warning", "critical"}, name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        assert re.fullmatch(r"\d+[smhd]", r["for"]), name
    for g in groups:
        for r in g["rules"]:
            if "record" in r:
                check_expr(r["expr"], r["record"])


@need_promtool
def test_promtool_check_rules(tmp_path):
    r = subprocess.run([PROMTOOL, "check", "rules", str(rules_file(tmp_path))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in load_rule_groups())} rules found" in r.stdout


@need_promtool
def test_promtool_parses_every_dashboard_query(tmp_path):
    # Each query as a recording rule, with Grafana's variables as Grafana would fill them in.
    rules = []
    for p in dashboard()["panels"]:
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", "5m").replace("$node", ".*")
            rules.append({"record": f"dashboard:panel{p['id']}:{t['refId']}", "expr": expr})
    f = tmp_path / "dashboard-rules.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
@need_promtool
def test_promtool_fires_every_alert_on_made_up_series(tmp_path):
    rules = rules_file(tmp_path, annotations=False)
    # Ten nodes (budget: one node); node-3 quarantined; node-5's loop stuck; node-7's intake stalled.
    series = []
    for i in range(10):
        node = f"node-{i}"
        series += state_series(node, "quarantined" if i == 3 else "healthy", "Vx40")
        # The loop beats every minute (the value is the scrape's unix time) except on node-5.
        series.append({"series": f'screener_last_loop_timestamp_seconds{{node="{node}"}}',
                       "values": "0x40" if i == 5 else "0+60x40"})
        series.append({"series": f'screener_alarm_intake_stalled{{node="{node}"}}',
                       "values": ("1x40" if i == 7 else "0x40")})
        series.append({"series": f'screener_alarm_files_stuck{{node="{node}"}}', "values": "0x40"})
        series.append({"series": f'up{{job="screener",pod="screener-{i}"}}',
                       "values": "0x40" if i == 9 else "1x40"})
    at = "30m"

    def fired(**labels: str) -> list[dict]:
        return [{"exp_labels": labels}]

    cases = [
        {"eval_time": at, "alertname": "ScreenerNodeQuarantined",
         "exp_alerts": fired(node="node-3", severity="warning")},
        {"eval_time": at, "alertname": "ScreenerQuarantineBudgetNearlySpent",
         "exp_alerts": fired(severity="warning")},
        {"eval_time": at, "alertname": "ScreenerQuarantineBudgetSpent",
         "exp_alerts": fired(severity="critical")},
        {"eval_time": at, "alertname": "ScreenerDaemonDown",
         "exp_alerts": fired(job="screener", pod="screener-9", severity="warning")},
        {"eval_time": at, "alertname": "ScreenerDaemonStalled",
         "exp_alerts": fired(node="node-5", severity="warning")},
        {"eval_time": at, "alertname": "ScreenerAlarmIntakeStalled",
         "exp_alerts": fired(node="node-7", severity="critical")},
        {"eval_time": at, "alertname": "ScreenerAlarmFilesStuck", "exp_alerts": []},
        # Too early for the 10-minute `for` of the daemon-down alert: nothing yet.
        {"eval_time": "5m", "alertname": "ScreenerDaemonDown", "exp_alerts": []},
    ]
    # A healthy node whose last pass was at t=0, evaluated after two days: not screening. Its
    # neighbour passed an hour ago.
    slow = (state_series("node-s", "healthy", "Vx3000")
            + state_series("node-t", "healthy", "Vx3000"))
    slow += [{"series": 'screener_last_successful_screen_timestamp_seconds{node="node-s"}',
              "values": "0x3000"},
             {"series": 'screener_last_successful_screen_timestamp_seconds{node="node-t"}',
              "values": "0+60x3000"}]
    tests = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "alert_rule_test": cases},
        {"interval": "1m", "input_series": slow, "alert_rule_test": [
            {"eval_time": "50h", "alertname": "ScreenerNotScreening",
             "exp_alerts": [{"exp_labels": {"node": "node-s", "severity": "warning"}}]},
            {"eval_time": "47h", "alertname": "ScreenerNotScreening", "exp_alerts": []}]},
        # Platform "p1" waits for 7 hours on two nodes; "p2" settled after 2 hours.
        {"interval": "1m", "input_series": [
            {"series": 'screener_awaiting_quorum{node="node-a",platform="p1"}', "values": "1x480"},
            {"series": 'screener_awaiting_quorum{node="node-b",platform="p1"}', "values": "2x480"},
            {"series": 'screener_awaiting_quorum{node="node-c",platform="p2"}',
             "values": "1x120 0x360"}],
         "alert_rule_test": [
            {"eval_time": "7h", "alertname": "ScreenerPlatformAwaitingQuorum",
             "exp_alerts": [{"exp_labels": {"platform": "p1", "severity": "warning"}}]},
            {"eval_time": "5h", "alertname": "ScreenerPlatformAwaitingQuorum", "exp_alerts": []}]},
    ]}
    t = tmp_path / "tests.yaml"
    t.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", str(t)], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


# --- the PodMonitor -------------------------------------------------------------------------------

def test_podmonitor_selects_the_daemonset_metrics_port():
    pm = yaml.safe_load((OBS / "podmonitor.yaml").read_text())
    ds = yaml.safe_load((ROOT / "manifests" / "daemonset.yaml").read_text())
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["kind"] == "PodMonitor" and pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["namespaceSelector"]["matchNames"] == [ds["metadata"]["namespace"]]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels[pm["spec"]["jobLabel"]] == "screener"  # the rules' up{job="screener"}
    ports = {p["name"]: p for c in ds["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] in ports and ep["path"] == "/metrics"
