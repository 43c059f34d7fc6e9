"""Prometheus for tests: a real server (Debian's `prometheus` binary) scraping a small dcgm-exporter
stand-in, and a small HTTP server that answers the documented query API JSON.

RealPrometheus starts the binary on 127.0.0.1 with a temporary config and TSDB directory; the test
serves the exporter itself with prometheus_client. FakePrometheus is the always-available twin: it
holds series in memory and evaluates the selectors screener sends (a vector selector, optionally
with a range) the way Prometheus does: labels matched exactly or by fully anchored regex, a range
[d] at time t covering (t - d, t].
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional

PROMETHEUS_BIN = shutil.which("prometheus")

DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")


# --- the fake: documented query API over in-memory series -----------------------------------------

_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_SELECTOR = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*(?:\{(.*)\})?\s*(?:\[(\d+)(ms|s|m|h|d)\])?\s*$",
                       re.S)
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class BadQuery(ValueError):
    pass


def _unquote(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), s)


def parse_selector(q: str) -> tuple[list[tuple[str, str, str]], Optional[float]]:
    """(matchers, range seconds or None) of a PromQL vector selector; BadQuery otherwise."""
    m = _SELECTOR.match(q)
    if not m or (m.group(1) is None and m.group(2) is None):
        raise BadQuery(f"unsupported query {q!r}")
    matchers: list[tuple[str, str, str]] = []
    if m.group(1):
        matchers.append(("__name__", "=", m.group(1)))
    body = m.group(2) or ""
    pos = 0
    while pos < len(body):
        mm = _MATCHER.match(body, pos)
        if not mm:
            raise BadQuery(f"cannot parse matchers at {body[pos:]!r}")
        matchers.append((mm.group(1), mm.group(2), _unquote(mm.group(3))))
        pos = mm.end()
        if pos < len(body):
            if body[pos] != ",":
                raise BadQuery(f"expected ',' at {body[pos:]!r}")
            pos += 1
    rng = float(m.group(3)) * _UNIT[m.group(4)] if m.group(3) else None
    return matchers, rng


def _matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for name, op, value in matchers:
        have = labels.get(name, "")
        if op == "=" and have != value:
            return False
        if op == "!=" and have == value:
            return False
        if op == "=~" and not re.fullmatch(value, have):
            return False
        if op == "!~" and re.fullmatch(value, have):
            return False
    return True


class FakePrometheus:
    """An HTTP server answering /api/v1/query with the documented JSON, over series you add.

    `queries` records every query string received; `fail_with` makes every answer an error
    (status, JSON body or raw bytes) to test the client's error handling.
    """

    LOOKBACK = 300.0

    def __init__(self) -> None:
        self.series: list[tuple[dict[str, str], list[tuple[float, float]]]] = []
        self.queries: list[dict[str, str]] = []
        self.fail_with: Optional[tuple[int, bytes]] = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _params(self) -> dict[str, str]:
                url = urllib.parse.urlparse(self.path)
                params = dict(urllib.parse.parse_qsl(url.query))
                if self.command == "POST":
                    n = int(self.headers.get("Content-Length") or 0)
                    params.update(urllib.parse.parse_qsl(self.rfile.read(n).decode()))
                return params

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                path = urllib.parse.urlparse(self.path).path
                params = self._params()
                fake.queries.append({"path": path, **params,
                                     "authorization": self.headers.get("Authorization", "")})
                if fake.fail_with is not None:
                    self._send(*fake.fail_with)
                    return
                if path != "/api/v1/query":
                    self._send(404, b'404 page not found')
                    return
                try:
                    data = fake.evaluate(params.get("query", ""), float(params.get("time") or time.time()))
                except (BadQuery, ValueError) as e:
                    self._send(400, json.dumps({"status": "error", "errorType": "bad_data",
                                                "error": str(e)}).encode())
                    return
                self._send(200, json.dumps({"status": "success", "data": data}).encode())

            do_GET = _handle
            do_POST = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def add(self, labels: dict[str, str], samples: list[tuple[float, float]]) -> None:
        self.series.append((dict(labels), sorted(samples)))

    def evaluate(self, query: str, t: float) -> dict[str, Any]:
        matchers, rng = parse_selector(query)
        result = []
        for labels, samples in self.series:
            if not _matches(labels, matchers):
                continue
            if rng is not None:
                values = [[ts, _fmt(v)] for ts, v in samples if t - rng < ts <= t]
                if values:
                    result.append({"metric": labels, "values": values})
            else:
                recent = [(ts, v) for ts, v in samples if t - self.LOOKBACK < ts <= t]
                if recent:
                    result.append({"metric": labels, "value": [t, _fmt(recent[-1][1])]})
        return {"resultType": "matrix" if rng is not None else "vector", "result": result}

    def __enter__(self) -> "FakePrometheus":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _fmt(v: float) -> str:
    # Prometheus sends sample values as strings, in Go's float formatting.
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if v != int(v) else str(int(v))


# --- the real thing ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RealPrometheus:
    """The prometheus binary on 127.0.0.1, scraping `targets` every second, data under `workdir`."""

    def __init__(self, workdir: Path, targets: list[str], scrape_interval: str = "1s") -> None:
        if PROMETHEUS_BIN is None:
            raise RuntimeError("prometheus is not installed")
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = self.workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  scrape_timeout: {scrape_interval}\n"
            "scrape_configs:\n"
            "  - job_name: dcgm\n"
            "    static_configs:\n"
            "      - targets: [" + ", ".join(f"'{t}'" for t in targets) + "]\n")
        self.log = self.workdir / "prometheus.log"
        self._args = [PROMETHEUS_BIN, f"--config.file={config}",
                      f"--storage.tsdb.path={self.workdir / 'data'}",
                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def __enter__(self) -> "RealPrometheus":
        logf = open(self.log, "wb")
        self.proc = subprocess.Popen(self._args, stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, "GOMAXPROCS": "1"})
        logf.close()
        self.wait_for(lambda: self._get("/-/ready") is not None, 30, "ready")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def _get(self, path: str) -> Optional[bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.read()
        except OSError:
            return None

    def instant(self, promql: str) -> list[dict[str, Any]]:
        raw = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        if raw is None:
            return []
        return json.loads(raw)["data"]["result"]

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            if cond():
                return
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not {what} after {timeout}s: {self.log.read_text()[-2000:]}")
