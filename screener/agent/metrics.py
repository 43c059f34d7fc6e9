"""The daemon's Prometheus metrics and its one HTTP port: /metrics, /healthz, /readyz and /node.

Metrics live in a registry of their own (not prometheus_client's global one), so a test or a
second daemon in one process starts from zero. Names follow Prometheus conventions (a unit suffix,
_total on counters); every metric carries the node name as a label value set once, so a scrape of
many nodes sums cleanly.

Health:
  /healthz (liveness) answers 200 while the loop has made progress within `liveness_s` (the loop,
    and the screening window while it waits, call `beat()`), else 503: a wedged daemon is
    restarted by the kubelet;
  /readyz (readiness) answers 200 once the daemon has started (store opened, stale taint cleared,
    node state known) and until it begins to shut down, else 503; also 503 while the alarm
    intake is stalled (the alarm folder cannot be listed, or alarm files sit in it that can be
    neither taken nor moved aside) or refuses the folder (not the daemon's own), with the reason
    in the body.
  /node: the node-local health answer (screener.node_answer), when the server is given one.

Exposure: the server binds the address it is given (the pod IP in the manifests, not 0.0.0.0),
reads a request within `read_timeout_s` and holds at most `max_connections` connections: a new
connection beyond the cap closes the oldest one, so idle or slow clients can neither exhaust the
process's file descriptors (which the loop needs for alarm files and the store) nor keep
/healthz from answering. A client that goes away mid-request (a reset, a closed pipe, a timeout)
is one debug line; socketserver's default printed a traceback on stderr for each, which is not
JSON and flooded the daemon's log.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, cast

from screener._optional import require

require("prometheus_client", "the daemon's metrics endpoint")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from screener.agent.daemon.clock import ClockLike, as_clock
from screener.errors import ConfigError
from screener.lifecycle.incidents import mtbi_seconds
from screener.remediation.ladder import RUNGS
from screener.types import AlarmResult, NodeState, Outcome, ScreenStop, Severity

SCREEN_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, float("inf"))


class NeverScreened:
    """The "never screened since" series of the daemon's node: the Unix time since which the
    daemon has known the node without a passing screen. A collector, not a gauge: it exists
    exactly while screener_last_successful_screen_timestamp_seconds has no sample for the node
    (whoever set that gauge), so the node always has one of the two series, and
    ScreenerNotScreening sees a node that never passed (adopted on a busy fleet, its GPUs never
    idle for the window) as well as one whose last pass is old."""

    NAME = "screener_never_screened_since_timestamp_seconds"
    DOC = ("Unix time since which the daemon has known this node without a passing screen "
           "(its start); absent once the node has passed one (see "
           "screener_last_successful_screen_timestamp_seconds).")

    def __init__(self, node: str, since: float, last_success: Gauge) -> None:
        self.node, self.since, self.last_success = node, since, last_success

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.NAME, self.DOC, labels=["node"])]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=["node"])
        if not self._passed():
            family.add_metric([self.node], self.since)
        yield family

    def _passed(self) -> bool:
        return any(s.labels.get("node") == self.node
                   for m in self.last_success.collect() for s in m.samples)


class DaemonMetrics:
    """Every metric the daemon exports, in one registry."""

    def __init__(self, node: str, *, clock: Optional[ClockLike] = None,
                 registry: Optional[CollectorRegistry] = None) -> None:
        """clock: liveness is measured on its monotonic clock (a stepped wall clock must neither
        fail /healthz nor hide a wedged loop); the loop gauge carries its wall time."""
        self.node = node
        self.clock = as_clock(clock)
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._declare(self.registry)
        self.intake_problem = ""
        self._awaiting_seen: dict[tuple[str, str], bool] = {}
        self._seed(node)
        # Every node the daemon knows has a "last screened" or a "never screened since" series.
        self.registry.register(NeverScreened(node, self.clock.wall(), self.last_success))
        self._beat = self.clock.monotonic()
        self.last_loop.labels(node).set(self.clock.wall())
        self.ready = False

    def _declare(self, r: CollectorRegistry) -> None:
        """Every metric, registered in `r`."""
        self.screens = Counter("screener_screens", "Known-answer screens run, by overall outcome "
                               "(pass, suspect, inconclusive).", ["node", "outcome"], registry=r)
        self.verdicts = Counter("screener_verdicts", "Per-device known-answer verdicts, by result "
                                "(pass, suspect, inconclusive).", ["node", "result"], registry=r)
        self.screen_stops = Counter("screener_screen_stops", "Screens stopped before the end, by why "
                                    "(yielded, time_cap, shutdown, error, taint_failed).",
                                    ["node", "reason"], registry=r)
        self.screen_duration = Histogram("screener_screen_duration_seconds", "Wall time of a "
                                         "screening window, taint to untaint.", ["node"],
                                         buckets=SCREEN_BUCKETS, registry=r)
        self.state = Gauge("screener_node_state", "The node's lifecycle state: 1 for the current "
                           "state, 0 for the others.", ["node", "state"], registry=r)
        self.alarms = Counter("screener_alarms", "Alarm files taken in, by what became of them "
                              "(applied, duplicate, rejected).", ["node", "result"], registry=r)
        # Separate from screener_alarms: only an applied alarm's check is trusted (a rejected
        # file's fields are not), and keeping screener_alarms' labels keeps existing queries valid.
        self.alarms_by_check = Counter("screener_alarms_applied", "Alarms applied to the node, by "
                                       "the check that raised them (nonfinite_local, ring_replay, "
                                       "weights, straggler, hardware_error, ...) and whether the "
                                       "audit settled them.", ["node", "check", "settled"],
                                       registry=r)
        self.findings = Counter("screener_findings", "Probe findings, by severity.",
                                ["node", "severity"], registry=r)
        self.probes = Counter("screener_probe_runs", "Health probe runs.", ["node"], registry=r)
        self.transitions = Counter("screener_transitions", "Lifecycle transitions recorded, by the "
                                   "state entered.", ["node", "to"], registry=r)
        self.ladder_rungs = Counter("screener_ladder_rungs", "Repair ladder rungs taken on the "
                                    "node, by rung (gpu_reset, reboot, final).", ["node", "rung"],
                                    registry=r)
        self.errors = Counter("screener_errors", "Failures of the screener itself, by where.",
                              ["node", "where"], registry=r)
        self.last_success = Gauge("screener_last_successful_screen_timestamp_seconds", "Unix time "
                                  "of the last screen that passed.", ["node"], registry=r)
        self.idle = Gauge("screener_node_idle", "1 while the node's GPUs have been idle for the "
                          "idle window.", ["node"], registry=r)
        self.screening = Gauge("screener_screening", "1 while a screening window is open (the node "
                               "carries the screening taint).", ["node"], registry=r)
        self.last_loop = Gauge("screener_last_loop_timestamp_seconds", "Unix time the daemon loop "
                               "last made progress.", ["node"], registry=r)
        self.intake_stalled = Gauge("screener_alarm_intake_stalled", "1 while the alarm intake "
                                    "cannot list its folder or files sit in it that can be "
                                    "neither taken nor moved aside.", ["node"], registry=r)
        self.intake_refused = Gauge("screener_alarm_intake_refused", "1 while the alarm intake "
                                    "refuses its folder: not owned by the daemon's uid, or an "
                                    "aside folder that cannot be made the daemon's own.",
                                    ["node"], registry=r)
        self.alarm_files_deferred = Gauge("screener_alarm_files_deferred", "Alarm files the last "
                                          "intake pass left for the next one (its time or byte "
                                          "budget was spent).", ["node"], registry=r)
        self.alarm_files_stuck = Gauge("screener_alarm_files_stuck", "Alarm files skipped "
                                       "because they could not be moved aside.", ["node"],
                                       registry=r)
        # Time between incidents (issue 24.4): a lemon is visible before the lemon rule trips.
        self.incidents = Gauge("screener_node_incidents", "The node's incidents (failure "
                               "transitions, the ones the lemon rule counts) in the last "
                               "mtbi_days days.", ["node"], registry=r)
        self.mtbi = Gauge("screener_node_mtbi_seconds", "Mean time between the node's incidents "
                          "in the last mtbi_days days (screener.lifecycle.incidents); absent with "
                          "fewer than two incidents.", ["node"], registry=r)

        # The fleet quorum (screener.known_answer.verdict.quorum): a platform with no golden waits
        # for other nodes to agree; the series says so per platform instead of a silent burnin.
        self.awaiting_quorum = Gauge("screener_awaiting_quorum", "Jobs the node's last screen "
                                     "found waiting for a fleet quorum, per platform hash (no "
                                     "golden, and too few other nodes of the platform agree "
                                     "yet); 0 once settled.", ["node", "platform"], registry=r)
        self.promotions = Counter("screener_quorum_promotions", "Goldens this node promoted "
                                  "from a fleet quorum, by what the store did (stored, same: "
                                  "already there, kept: another record is there).",
                                  ["node", "result"], registry=r)

    def _seed(self, node: str) -> None:
        """Make every labelled series exist from the start: a rate() over a counter that appears
        only at its first increment misses that increment."""
        self.intake_stalled.labels(node).set(0)
        self.alarm_files_stuck.labels(node).set(0)
        self.intake_refused.labels(node).set(0)
        self.alarm_files_deferred.labels(node).set(0)
        for o in Outcome:
            self.screens.labels(node, o.value)
            self.verdicts.labels(node, o.value)
        for reason in ScreenStop:
            self.screen_stops.labels(node, reason.value)
        for res in AlarmResult:
            self.alarms.labels(node, res.value)
        for s in Severity:
            self.findings.labels(node, s.label)
        for st in NodeState:
            self.state.labels(node, st.value).set(0)
            self.transitions.labels(node, st.value)
        self.idle.labels(node).set(0)
        self.incidents.labels(node).set(0)
        self.screening.labels(node).set(0)
        self.probes.labels(node)
        self.screen_duration.labels(node)
        for rung in RUNGS:
            self.ladder_rungs.labels(node, rung)
        for result in ("stored", "same", "kept"):
            self.promotions.labels(node, result)

    # --- updates ------------------------------------------------------------------------------

    def beat(self) -> None:
        """The loop made progress (liveness)."""
        self._beat = self.clock.monotonic()
        self.last_loop.labels(self.node).set(self.clock.wall())

    def set_state(self, state: Optional[NodeState]) -> None:
        for s in NodeState:
            self.state.labels(self.node, s.value).set(1 if s == state else 0)

    def screen_done(self, outcome: Outcome, verdict_outcomes: Iterable[Outcome], seconds: float,
                    stopped: str = "", passed_at: Optional[float] = None) -> None:
        self.screens.labels(self.node, outcome.value).inc()
        for v in verdict_outcomes:
            self.verdicts.labels(self.node, v.value).inc()
        if stopped:
            self.screen_stops.labels(self.node, stopped).inc()
        self.screen_duration.labels(self.node).observe(max(0.0, seconds))
        if outcome == Outcome.PASS and passed_at is not None:
            self.last_success.labels(self.node).set(passed_at)

    def set_awaiting(self, waiting: Mapping[str, int]) -> None:
        """The platforms a screen found waiting for a quorum (platform -> jobs); a platform
        seen before that no longer waits goes to 0 (a series that vanished would hide the
        moment it settled)."""
        for (node, platform), _ in list(self._awaiting_seen.items()):
            if platform not in waiting:
                self.awaiting_quorum.labels(node, platform).set(0)
        for platform, jobs in waiting.items():
            self.awaiting_quorum.labels(self.node, platform).set(jobs)
            self._awaiting_seen[(self.node, platform)] = True

    def set_incidents(self, times: Sequence[float]) -> None:
        """The node's incident times in the window: their count, and their MTBI when there are
        two or more (the series is removed otherwise: no gap to measure is not a gap of zero)."""
        self.incidents.labels(self.node).set(len(times))
        mtbi = mtbi_seconds(times)
        if mtbi is None:
            try:
                self.mtbi.remove(self.node)
            except KeyError:  # never set: nothing to remove
                pass
        else:
            self.mtbi.labels(self.node).set(mtbi)

    def intake_pass(self, stuck: int, stalled: str = "", refused: str = "",
                    deferred: int = 0) -> None:
        """Record how an intake pass ended: files it had to skip or left for the next pass, and
        why it could not run (stalled) or would not (refused)."""
        self.alarm_files_stuck.labels(self.node).set(stuck)
        self.alarm_files_deferred.labels(self.node).set(deferred)
        self.intake_refused.labels(self.node).set(1 if refused else 0)
        problem = refused or stalled or (f"{stuck} alarm file(s) can be neither taken nor moved "
                                         f"aside" if stuck else "")
        self.intake_problem = problem
        self.intake_stalled.labels(self.node).set(1 if problem else 0)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, body) for /readyz."""
        ok = self.ready and not self.intake_problem
        body: dict[str, Any] = {"ready": ok}
        if self.intake_problem:
            body["intake"] = self.intake_problem
        return ok, body

    def alarm(self, result: AlarmResult, n: int = 1) -> None:
        """Count `n` alarm files that ended as `result`."""
        if n:
            self.alarms.labels(self.node, result.value).inc(n)

    def alarm_applied(self, check: str, settled: bool) -> None:
        """Count one applied alarm by its check (the intake has validated `check` already)."""
        self.alarms_by_check.labels(self.node, check, "true" if settled else "false").inc()

    def finding(self, severity: Severity) -> None:
        self.findings.labels(self.node, severity.label).inc()

    def rung_taken(self, rung: str) -> None:
        """The repair ladder took a rung (recorded in the node's history)."""
        self.ladder_rungs.labels(self.node, rung).inc()

    def error(self, where: str) -> None:
        self.errors.labels(self.node, where).inc()

    def alive(self, liveness_s: float) -> bool:
        return self.clock.monotonic() - self._beat <= liveness_s

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


MAX_CONNECTIONS = 64
READ_TIMEOUT_S = 10.0
log = logging.getLogger("screener.metrics")


class _CappedServer(ThreadingHTTPServer):
    """A threading HTTP server that holds at most `max_connections` connections: the oldest is
    shut down to make room for a new one (its handler thread then sees end of input and ends)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of connects must not wait on SYN retries

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        self.max_connections = max_connections
        self._open: "OrderedDict[socket.socket, None]" = OrderedDict()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            while len(self._open) >= self.max_connections:
                oldest, _ = self._open.popitem(last=False)
                try:
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._open[request] = None
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    @property
    def open_connections(self) -> int:
        with self._open_lock:
            return len(self._open)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A request that failed: a client that went away is routine (a scraper timing out, a
        connection closed by the cap) and one debug line; anything else is our own error, one
        error line with its traceback in the log record, never on bare stderr."""
        exc = sys.exc_info()[1]
        peer = client_address[0] if isinstance(client_address, tuple) else client_address
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("metrics client %s went away: %s", peer, exc,
                      extra={"event": "metrics_client_gone"})
        else:
            log.error("metrics request from %s failed: %r", peer, exc, exc_info=True,
                      extra={"event": "metrics_error"})


class MetricsServer:
    """One HTTP server for /metrics, /healthz and /readyz, in a daemon thread.

    host: the address to bind (the pod IP from the downward API in a cluster).
    max_connections / read_timeout_s: see the module docstring.
    """

    def __init__(self, metrics: DaemonMetrics, host: str = "0.0.0.0", port: int = 9500, *,
                 liveness_s: float = 300.0, max_connections: int = MAX_CONNECTIONS,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 node_answer: Optional[Callable[[], tuple[int, bytes]]] = None) -> None:
        """node_answer(): (status, JSON body) for GET /node (health_answer.AnswerBoard.render)."""
        if not isinstance(host, str):
            raise ConfigError(f"metrics_host {host!r} is not an address")
        if max_connections < 1 or not read_timeout_s > 0:
            raise ConfigError("metrics server: max_connections and read_timeout_s must be > 0")
        self.metrics = metrics
        self.liveness_s = liveness_s
        self.node_answer = node_answer
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = read_timeout_s  # a client that sends nothing is dropped after this long

            def log_message(self, *args: Any) -> None:  # scrapes every 15 s would flood the log
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, server_self.metrics.exposition(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok = server_self.metrics.alive(server_self.liveness_s)
                    self._json(200 if ok else 503, {"alive": ok})
                elif path == "/readyz":
                    ok, body = server_self.metrics.readiness()
                    self._json(200 if ok else 503, body)
                elif path == "/node" and server_self.node_answer is not None:
                    code, data = server_self.node_answer()
                    self._send(code, data, "application/json")
                else:
                    self._json(404, {"error": f"no such path {path}",
                                     "paths": ["/metrics", "/healthz", "/readyz"]
                                     + (["/node"] if server_self.node_answer else [])})

            def _json(self, code: int, body: Any) -> None:
                self._send(code, (json.dumps(body) + "\n").encode(), "application/json")

            def _send(self, code: int, data: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        try:
            self._server = _CappedServer((host, port), Handler, max_connections)
        except (OSError, OverflowError, UnicodeError) as e:  # the port is taken, or the address is not ours: the config's to fix
            raise ConfigError(f"cannot serve metrics on {host}:{port} (metrics_host, "
                              f"metrics_port): {getattr(e, 'strerror', None) or e}") from e
        self._server.daemon_threads = True
        bound_host, self.port = self._server.server_address[:2]
        self.host = cast(str, bound_host)  # an AF_INET server's address is (str, int)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "MetricsServer":
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics",
                                        kwargs={"poll_interval": 0.5}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"
