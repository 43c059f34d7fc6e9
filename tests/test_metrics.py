"""Metrics, /healthz and /readyz over real HTTP on loopback, parsed with prometheus_client's own
text parser, after real daemon passes (fake clock, scripted NVML, scripted screen runner)."""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from screener.agent.metrics import DaemonMetrics, MetricsServer
from screener.errors import ConfigError
from screener.types import Outcome
from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def scrape(server: MetricsServer) -> dict[tuple[str, tuple], float]:
    status, ctype, body = get(server.url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    key = (name, tuple(sorted({"node": NODE, **labels}.items())))
    assert key in samples, f"{name}{labels} not exported; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.fixture
def served(tmp_path):
    runner = ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.SUSPECT))
    rig = DaemonRig(tmp_path, runner, idle_window_s=0.0, screen_interval_s=3600.0, liveness_s=120.0)
    server = MetricsServer(rig.metrics, "127.0.0.1", 0, liveness_s=120.0).start()
    yield rig, server
    server.stop()
    rig.close()


def test_metrics_health_and_readiness_over_http(served):
    rig, server = served
    # Before start: alive (just created) but not ready.
    assert get(server.url + "/readyz")[0] == 503
    assert get(server.url + "/healthz")[0] == 200
    before = scrape(server)
    assert value(before, "screener_screens_total", outcome="pass") == 0.0

    # A suspect-level event on the first probe (not a persisting condition such as a pending row
    # remap, which would keep the node out whatever the screen says).
    rig.nvml.gpus[0].set_ecc(volatile_uncorrected=1, aggregate_uncorrected=1)
    first = rig.tick()  # burnin -> suspect (finding) -> healthy (screen passed)
    assert first.state.value == "healthy"
    status, _, body = get(server.url + "/readyz")
    assert status == 200 and json.loads(body) == {"ready": True}
    rig.drop_alarm("m-1", settled=False)
    (rig.tmp / "alarms" / "junk.json").write_text("nope")
    rig.tick(advance=3600.0)  # alarm -> suspect; screen (suspect verdicts) -> quarantined

    s = scrape(server)
    assert value(s, "screener_screens_total", outcome="pass") == 1.0
    assert value(s, "screener_screens_total", outcome="suspect") == 1.0
    assert value(s, "screener_verdicts_total", result="pass") == 2.0
    assert value(s, "screener_verdicts_total", result="suspect") == 2.0
    assert value(s, "screener_screen_duration_seconds_count") == 2.0
    assert value(s, "screener_node_state", state="quarantined") == 1.0
    assert value(s, "screener_node_state", state="healthy") == 0.0
    assert value(s, "screener_alarms_total", result="applied") == 1.0
    assert value(s, "screener_alarms_total", result="rejected") == 1.0
    assert value(s, "screener_alarms_applied_total", check="weights", settled="false") == 1.0
    assert value(s, "screener_findings_total", severity="suspect") == 1.0
    # The probe of the first pass ran at the clock's start; the pass was recorded then.
    assert value(s, "screener_last_successful_screen_timestamp_seconds") == 1_000_000.0
    assert value(s, "screener_transitions_total", to="quarantined") == 1.0
    # one probe per pass, and the full burn-in of the first pass probes again after its jobs
    assert value(s, "screener_probe_runs_total") == 3.0
    assert value(s, "screener_screening") == 0.0

    # Liveness: the loop stops making progress for longer than liveness_s.
    rig.clock.advance(121.0)
    status, _, body = get(server.url + "/healthz")
    assert status == 503 and json.loads(body) == {"alive": False}
    rig.tick()
    assert get(server.url + "/healthz")[0] == 200
    assert get(server.url + "/nope")[0] == 404


def test_screening_gauge_is_one_while_the_window_is_open(tmp_path):
    seen = []

    def during(request):
        _, _, body = get(server.url + "/metrics")
        for fam in text_string_to_metric_families(body):
            for smp in fam.samples:
                if smp.name == "screener_screening":
                    seen.append(smp.value)
        # /healthz stays alive during a long screen: the window beats.
        seen.append(get(server.url + "/healthz")[0])
        return None

    rig = DaemonRig(tmp_path, ScriptedRunner(outcome(Outcome.PASS), during=during), idle_window_s=0.0)
    server = MetricsServer(rig.metrics, "127.0.0.1", 0).start()
    try:
        rig.tick()
    finally:
        server.stop()
        rig.close()
    assert seen == [1.0, 200]


def test_a_taken_metrics_port_is_a_config_error_naming_it(served):
    rig, server = served
    with pytest.raises(ConfigError, match=f"127.0.0.1:{server.port}.*metrics_port"):
        MetricsServer(rig.metrics, "127.0.0.1", server.port)


@pytest.mark.slow
def test_idle_connections_cannot_starve_the_server(tmp_path):
    """300 connections that never send a byte: the server holds at most its cap (the oldest are
    closed to make room), so file descriptors stay bounded and /healthz still answers at once."""

    metrics = DaemonMetrics(NODE)
    server = MetricsServer(metrics, "127.0.0.1", 0, max_connections=16, read_timeout_s=30).start()
    idle = []
    try:
        assert server.host == "127.0.0.1"  # the address it was given, not every interface
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        t0 = time.monotonic()
        status, _, body = get(server.url + "/healthz")
        assert status == 200 and json.loads(body) == {"alive": True}
        assert time.monotonic() - t0 < 5
        assert server._server.open_connections <= 16
        # An evicted idle connection was closed by the server: it reads end of input.
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()
        server.stop()


@pytest.mark.slow
def test_a_silent_client_is_dropped_after_the_read_timeout():
    server = MetricsServer(DaemonMetrics(NODE), "127.0.0.1", 0, read_timeout_s=0.5).start()
    try:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the server, not by our own timeout
        assert time.monotonic() - t0 < 5
        s.close()
    finally:
        server.stop()


def test_a_client_that_resets_mid_request_is_one_debug_line(caplog, capfd):
    """500 resets wrote 500 tracebacks (762 KB of non-JSON log) before; now one debug line each,
    and the server still answers."""
    caplog.set_level(logging.DEBUG, logger="screener.metrics")
    server = MetricsServer(DaemonMetrics(NODE), "127.0.0.1", 0).start()
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # linger 0: a reset, not a FIN
        deadline = time.monotonic() + 10
        gone = []
        while len(gone) < 20 and time.monotonic() < deadline:
            gone = [r for r in caplog.records if "went away" in r.getMessage()]
            time.sleep(0.02)
        assert len(gone) == 20 and {r.levelno for r in gone} == {logging.DEBUG}
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        with urllib.request.urlopen(server.url + "/healthz", timeout=10) as r:
            assert r.status == 200
    finally:
        server.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err[:2000]


def test_readiness_says_when_the_intake_is_stalled():
    metrics = DaemonMetrics(NODE)
    server = MetricsServer(metrics, "127.0.0.1", 0).start()
    try:
        metrics.ready = True
        assert get(server.url + "/readyz")[0] == 200
        metrics.intake_pass(0, "cannot list /var/run/screener/alarms: Permission denied")
        status, _, body = get(server.url + "/readyz")
        assert status == 503 and "Permission denied" in json.loads(body)["intake"]
        assert value(scrape(server), "screener_alarm_intake_stalled") == 1.0
        metrics.intake_pass(0, "")
        assert get(server.url + "/readyz")[0] == 200
    finally:
        server.stop()


def test_time_between_incidents_is_exported_from_the_nodes_history(tmp_path):
    """MTBI per node (issue 24.4): seeded at start from the node's own history (one read), an
    incident recorded later counts at once, and one older than mtbi_days leaves the window."""
    from screener.lifecycle.records import Transition
    from screener.stores.local import LocalStore
    from screener.types import NodeState as S

    day = 86400.0
    t0 = 1_000_000.0 + 100 * day
    store = LocalStore(tmp_path / "state.db")
    moves = [(None, S.BURNIN, 30, False), (S.BURNIN, S.HEALTHY, 29, False),
             (S.HEALTHY, S.QUARANTINED, 20, True), (S.QUARANTINED, S.BURNIN, 19, False),
             (S.BURNIN, S.HEALTHY, 18.5, False), (S.HEALTHY, S.QUARANTINED, 14, True),
             (S.QUARANTINED, S.BURNIN, 13, False), (S.BURNIN, S.HEALTHY, 12, False)]
    for frm, to, ago, failure in moves:
        store.record(Transition(node=NODE, time=t0 - ago * day, from_state=frm, to_state=to,
                                reason="test", failure=failure))
    from fakes.clock import FakeClock
    rig = DaemonRig(tmp_path, ScriptedRunner(), store=store, clock=FakeClock(t0),
                    mtbi_days=30.0, screens=False)
    server = MetricsServer(rig.metrics, "127.0.0.1", 0).start()
    try:
        assert rig.tick().state == S.HEALTHY
        s = scrape(server)
        assert value(s, "screener_node_incidents") == 2.0
        assert value(s, "screener_node_mtbi_seconds") == 6 * day
        rig.drop_alarm("lemon-1", settled=True)  # a third failure in 30 days: the lemon rule
        assert rig.tick(advance=5.0).state == S.REPAIR
        s = scrape(server)
        assert value(s, "screener_node_incidents") == 3.0
        assert value(s, "screener_node_mtbi_seconds") == (20 * day + 5.0) / 2
        # 11 days on, the incident of 20 days ago is 31 days old: out of the 30-day window.
        rig.tick(advance=11 * day)
        s = scrape(server)
        assert value(s, "screener_node_incidents") == 2.0
        assert value(s, "screener_node_mtbi_seconds") == 14 * day + 5.0
        # 15 more days: one incident left, no gap to measure, so no MTBI sample at all.
        rig.tick(advance=15 * day)
        s = scrape(server)
        assert value(s, "screener_node_incidents") == 1.0
        assert not [k for k in s if k[0] == "screener_node_mtbi_seconds"]
    finally:
        server.stop()
        rig.close()
