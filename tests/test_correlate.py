"""DCGM correlation through the Prometheus HTTP API.

Twice over: against the real Prometheus server (Debian's `prometheus` package, started here on
loopback, scraping a dcgm-exporter stand-in served with prometheus_client), and against a small
HTTP server answering the documented query API JSON, which runs everywhere and drives the analysis
through exact timelines.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from cli_util import screener
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from screener.remediation import correlate as corr
from screener.cli import main
from screener.commands.context import AppContext
from screener.errors import BadInputError, ExternalServiceError
from screener.types import Severity
from fakes.promserver import DCGM_LABELS, PROMETHEUS_BIN, FakePrometheus, RealPrometheus

T0 = 1_760_000_000.0  # the alarm, in the fake's timelines
UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]


def dcgm_labels(node: str, gpu: int, metric: str, **extra: str) -> dict[str, str]:
    return {"__name__": metric, "gpu": str(gpu), "UUID": UUIDS[gpu], "device": f"nvidia{gpu}",
            "modelName": "NVIDIA H100 80GB HBM3", "Hostname": node, "job": "dcgm",
            "instance": "10.0.0.7:9400", **extra}


def steady(value: float, start: float = T0 - 600, end: float = T0 + 600, step: float = 15):
    t, out = start, []
    while t <= end:
        out.append((t, value))
        t += step
    return out


def step_at(before: float, after: float, at: float, start: float = T0 - 600,
            end: float = T0 + 600, step: float = 15):
    return [(t, before if t < at else after) for t, _ in steady(0, start, end, step)]


def healthy_node(fake: FakePrometheus, node: str, gpus: int = 4) -> None:
    for g in range(gpus):
        fake.add(dcgm_labels(node, g, "DCGM_FI_DEV_GPU_TEMP"), steady(45 + g))
        fake.add(dcgm_labels(node, g, "DCGM_FI_DEV_POWER_USAGE"), steady(650))
        fake.add(dcgm_labels(node, g, "DCGM_FI_DEV_SM_CLOCK"), steady(1980))
        fake.add(dcgm_labels(node, g, "DCGM_FI_DEV_XID_ERRORS"), steady(0))
        fake.add(dcgm_labels(node, g, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"), steady(0))
        fake.add(dcgm_labels(node, g, "DCGM_FI_DEV_ROW_REMAP_FAILURE"), steady(0))
        fake.add(dcgm_labels(node, g, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"), steady(0x1))  # idle only


def invoke(args, clock=T0 + 3600):
    return CliRunner().invoke(main, args, obj=AppContext(clock=lambda: clock))


# --- the fake server: exact timelines --------------------------------------------------------------

def test_faulty_gpu_is_named_and_clean_one_is_not_cleared():
    with FakePrometheus() as fake:
        healthy_node(fake, "hyperpod-i-0123456789abcdef0")
        n = "hyperpod-i-0123456789abcdef0"
        # GPU 2 goes bad 2 minutes before the alarm.
        fake.add(dcgm_labels(n, 2, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"), step_at(0, 3, T0 - 120))
        fake.add(dcgm_labels(n, 2, "DCGM_FI_DEV_XID_ERRORS"), step_at(0, 48, T0 - 120))
        fake.add(dcgm_labels(n, 2, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"), step_at(1, 2, T0 - 100))
        fake.add(dcgm_labels(n, 2, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"), step_at(0x1, 0x40, T0 - 60))
        # Another node on the same Prometheus stays clean.
        healthy_node(fake, "hyperpod-i-0fedcba9876543210")

        client = corr.PrometheusClient(fake.url)
        c = corr.correlate(client, n, T0 - 1800, T0 + 1800)
        assert c.matched_by == f"Hostname={n}"
        assert [g["gpu"] for g in c.gpus] == ["0", "1", "2", "3"]
        assert c.confirms
        bad = {f.code: f for f in c.findings if f.gpu == UUIDS[2]}
        assert bad["dcgm_ecc_dbe_vol_total"].severity == Severity.CRITICAL
        assert bad["dcgm_ecc_dbe_vol_total"].evidence["increase"] == 3
        assert bad["dcgm_xid"].evidence["xid"] == 48 and bad["dcgm_xid"].severity >= Severity.SUSPECT
        assert bad["dcgm_uncorrectable_remapped_rows"].evidence["increase"] == 1
        assert bad["dcgm_clock_event"].evidence["bit"] == 0x40
        assert not [f for f in c.findings if f.gpu != UUIDS[2]]  # only GPU 2 is blamed
        # Worst first.
        assert c.findings[0].severity == Severity.CRITICAL

        clean = corr.correlate(client, "hyperpod-i-0fedcba9876543210", T0 - 1800, T0 + 1800)
        assert len(clean.gpus) == 4 and not clean.findings and not clean.confirms
        assert clean.to_dict()["clears"] is False
        assert "does not clear" in corr.describe(clean)[-1]


def test_cli_exit_codes_and_json():
    n = "hyperpod-i-0123456789abcdef0"
    with FakePrometheus() as fake:
        healthy_node(fake, n)
        healthy_node(fake, "quiet-node")
        fake.add(dcgm_labels(n, 1, "DCGM_FI_DEV_ROW_REMAP_FAILURE"), step_at(0, 1, T0 - 30))
        around = "2025-10-09T08:53:20Z"  # == T0
        r = invoke(["correlate", n, "--prometheus", fake.url, "--around", around, "--window", "15m",
                    "--json"])
        assert r.exit_code == 75, r.output
        doc = json.loads(r.stdout)
        assert doc["start"] == T0 - 900 and doc["end"] == T0 + 900
        assert doc["confirms"] is True and doc["clears"] is False
        [f] = [f for f in doc["findings"] if f["severity"] == "critical"]
        assert f["code"] == "dcgm_row_remap_failure" and f["gpu"] == UUIDS[1]
        assert "set in the window" in f["message"]
        # The window went to Prometheus as one range selector evaluated at its end.
        q = fake.queries[-1]
        assert q["path"] == "/api/v1/query" and float(q["time"]) == T0 + 900
        assert q["query"].endswith("[1800s]")

        r = invoke(["correlate", "quiet-node", "--prometheus", fake.url, "--around", str(T0)])
        assert r.exit_code == 3, r.output
        assert "this does not clear the node" in r.stdout
        assert "GPU 0" in r.stdout and "temp 45-45 C" in r.stdout

        r = invoke(["correlate", "no-such-node", "--prometheus", fake.url, "--around", str(T0)])
        assert r.exit_code == 3
        assert "no DCGM series found" in r.stdout


def test_counter_reset_split_series_and_xid_history():
    n = "node-a"
    with FakePrometheus() as fake:
        # A driver reload resets the volatile SBE counter mid-window: 5 -> 7, reset, 0 -> 2 = +4.
        fake.add(dcgm_labels(n, 0, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"),
                 [(T0 - 60, 5), (T0 - 45, 7), (T0 - 30, 0), (T0 - 15, 2)])
        # The GPU's series is split by the pod label dcgm-exporter adds while a pod uses it.
        fake.add(dcgm_labels(n, 0, "DCGM_FI_DEV_XID_ERRORS", pod="train-0"),
                 [(T0 - 60, 13), (T0 - 45, 13)])
        fake.add(dcgm_labels(n, 0, "DCGM_FI_DEV_XID_ERRORS", pod="train-1"),
                 [(T0 - 30, 13), (T0 - 15, 79)])
        # Outside the window: must not count.
        fake.add(dcgm_labels(n, 0, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"), [(T0 - 4000, 0), (T0 - 3900, 9)])
        c = corr.correlate(corr.PrometheusClient(fake.url), n, T0 - 120, T0)
    by = {}
    for f in c.findings:
        by.setdefault(f.code, []).append(f)
    [sbe] = by["dcgm_ecc_sbe_vol_total"]
    assert sbe.evidence["increase"] == 4 and sbe.severity == Severity.WARNING
    [before] = by["dcgm_xid_before"]
    assert before.evidence["xid"] == 13 and before.severity == Severity.INFO
    [xid] = by["dcgm_xid"]  # 13 was already there; only the change to 79 is new
    assert xid.evidence["xid"] == 79 and xid.severity == Severity.CRITICAL
    assert "dcgm_ecc_dbe_vol_total" not in by
    assert len(c.gpus) == 1 and c.gpus[0]["metrics"]["DCGM_FI_DEV_XID_ERRORS"]["samples"] == 4


def test_application_xid_does_not_confirm():
    with FakePrometheus() as fake:
        fake.add(dcgm_labels("n1", 0, "DCGM_FI_DEV_XID_ERRORS"), step_at(0, 13, T0))
        c = corr.correlate(corr.PrometheusClient(fake.url), "n1", T0 - 600, T0 + 600)
    [f] = c.findings
    assert f.evidence["xid"] == 13 and f.severity < Severity.SUSPECT
    assert "application" in f.message
    assert not c.confirms


def test_peer_comparison_flags_a_slow_gpu():
    with FakePrometheus() as fake:
        for g in range(4):
            fake.add(dcgm_labels("n1", g, "DCGM_FI_DEV_SM_CLOCK"), steady(1500 if g == 3 else 1980))
            fake.add(dcgm_labels("n1", g, "DCGM_FI_DEV_GPU_TEMP"), steady(88 if g == 1 else 50))
        c = corr.correlate(corr.PrometheusClient(fake.url), "n1", T0 - 600, T0 + 600)
    codes = {(f.code, f.gpu) for f in c.findings}
    assert codes == {("dcgm_slow_clock", UUIDS[3]), ("dcgm_hot_gpu", UUIDS[1])}
    assert not c.confirms  # slow or hot is not a hardware fault by itself


def test_node_found_by_instance_label_or_explicit_match():
    with FakePrometheus() as fake:
        labels = dcgm_labels("ignored", 0, "DCGM_FI_DEV_ROW_REMAP_PENDING")
        del labels["Hostname"]
        labels["instance"] = "ip-10-1-2-3.ec2.internal:9400"
        fake.add(labels, step_at(0, 1, T0))
        client = corr.PrometheusClient(fake.url)
        c = corr.correlate(client, "ip-10-1-2-3.ec2.internal", T0 - 600, T0 + 600)
        assert c.matched_by == "instance=ip-10-1-2-3.ec2.internal" and c.confirms
        # Every candidate label was tried in order before instance matched.
        tried = [q["query"] for q in fake.queries]
        assert [corr.NODE_LABELS[i] + "=~" in tried[i] for i in range(4)] == [True] * 4
        # The dot in the name is a literal, not "any character".
        c = corr.correlate(client, "ip-10-1-2-3xec2.internal", T0 - 600, T0 + 600)
        assert not c.gpus
        c = corr.correlate(client, "whatever", T0 - 600, T0 + 600, match=("device", "nvidia0"))
        assert c.matched_by == "device=nvidia0" and c.confirms
        assert len(fake.queries) == 4 + 4 + 1


def test_prometheus_errors_are_ours_to_report():
    with FakePrometheus() as fake:
        fake.fail_with = (400, json.dumps({"status": "error", "errorType": "bad_data",
                                           "error": "parse error"}).encode())
        client = corr.PrometheusClient(fake.url, headers={"Authorization": "Bearer t0k"})
        with pytest.raises(ExternalServiceError, match="bad_data: parse error"):
            corr.correlate(client, "n1", T0 - 60, T0)
        assert fake.queries[-1]["authorization"] == "Bearer t0k"
        fake.fail_with = (200, b"<html>not prometheus</html>")
        with pytest.raises(ExternalServiceError, match="not JSON"):
            corr.correlate(client, "n1", T0 - 60, T0)
        fake.fail_with = (503, b"unavailable")
        with pytest.raises(ExternalServiceError, match="HTTP 503"):
            corr.correlate(client, "n1", T0 - 60, T0)
        url = fake.url
    with pytest.raises(ExternalServiceError, match="unreachable"):
        corr.correlate(corr.PrometheusClient(url, timeout=2), "n1", T0 - 60, T0)


def test_parse_time():
    assert corr.parse_time("now", 123.0) == 123.0
    assert corr.parse_time("1760000000", 0) == T0
    assert corr.parse_time("2025-10-09T08:53:20Z", 0) == T0
    assert corr.parse_time("2025-10-09T10:53:20+02:00", 0) == T0
    assert corr.parse_time("2025-10-09T08:53:20", 0) == T0  # no zone: UTC
    with pytest.raises(BadInputError, match="ISO 8601"):
        corr.parse_time("yesterday", 0)


def test_bad_input_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "screener.cli", "correlate", "n1", "--prometheus",
                        "ftp://x", "--around", "now"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "not an http(s) URL" in r.stderr
    r = screener("correlate", "n1", "--prometheus", "http://127.0.0.1:9", "--window", "soon")
    assert r.returncode == 2 and "duration 'soon'" in r.stderr


# --- the real server ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS_BIN is None,
                    reason="the prometheus binary is not installed (Debian package: prometheus)")
def test_real_prometheus_scraping_an_exporter(tmp_path):
    registry = CollectorRegistry()
    g = {name: Gauge(name, name, DCGM_LABELS, registry=registry) for name in (
        "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")}
    nodes = ("hyperpod-i-0123456789abcdef0", "hyperpod-i-0fedcba9876543210")

    def labels(node, gpu):
        return dict(gpu=str(gpu), UUID=UUIDS[gpu], device=f"nvidia{gpu}",
                    modelName="NVIDIA H100 80GB HBM3", Hostname=node)

    for node in nodes:
        for gpu in range(2):
            lab = labels(node, gpu)
            g["DCGM_FI_DEV_GPU_TEMP"].labels(**lab).set(40)
            g["DCGM_FI_DEV_POWER_USAGE"].labels(**lab).set(300.5)
            g["DCGM_FI_DEV_SM_CLOCK"].labels(**lab).set(1980)
            for name in ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                         "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ROW_REMAP_FAILURE"):
                g[name].labels(**lab).set(0)
            g["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"].labels(**lab).set(0)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        target = f"127.0.0.1:{server.server_port}"
        with RealPrometheus(tmp_path, [target]) as prom:
            def has(promql, value=None):
                res = prom.instant(promql)
                return bool(res) and (value is None or float(res[0]["value"][1]) == value)

            prom.wait_for(lambda: has("DCGM_FI_DEV_GPU_TEMP"), 30, "scraping")
            # GPU 1 of the first node fails after the first scrape.
            bad = labels(nodes[0], 1)
            g["DCGM_FI_DEV_XID_ERRORS"].labels(**bad).set(79)
            g["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"].labels(**bad).set(2)
            g["DCGM_FI_DEV_ROW_REMAP_FAILURE"].labels(**bad).set(1)
            g["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"].labels(**bad).set(0x40 | 0x1)
            g["DCGM_FI_DEV_GPU_TEMP"].labels(**bad).set(91)
            prom.wait_for(lambda: has(f'DCGM_FI_DEV_XID_ERRORS{{Hostname="{nodes[0]}",gpu="1"}}', 79),
                          30, "scraping the change")

            r = CliRunner().invoke(main, ["correlate", nodes[0], "--prometheus", prom.url,
                                          "--window", "5m", "--json"])
            assert r.exit_code == 75, r.output
            doc = json.loads(r.stdout)
            assert doc["matched_by"] == f"Hostname={nodes[0]}"
            assert [x["gpu"] for x in doc["gpus"]] == ["0", "1"]
            found = {(f["code"], f["gpu"]) for f in doc["findings"]}
            assert {("dcgm_xid", UUIDS[1]), ("dcgm_ecc_dbe_vol_total", UUIDS[1]),
                    ("dcgm_row_remap_failure", UUIDS[1]), ("dcgm_clock_event", UUIDS[1])} <= found
            assert all(gpu == UUIDS[1] for _, gpu in found)
            temp = doc["gpus"][1]["metrics"]["DCGM_FI_DEV_GPU_TEMP"]
            assert (temp["min"], temp["max"], temp["last"]) == (40, 91, 91)

            r = CliRunner().invoke(main, ["correlate", nodes[1], "--prometheus", prom.url,
                                          "--window", "5m"])
            assert r.exit_code == 3, r.output
            assert "this does not clear the node" in r.stdout
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
