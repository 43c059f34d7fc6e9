"""A TCP proxy on 127.0.0.1 in front of the Kubernetes API test server, that can misbehave the way
networks and overloaded API servers do:

  * black-hole: take the connection and the request, answer nothing, keep the socket open (what a
    client sees from a dead load balancer or an API server stuck in its admission chain);
  * reset after: forward the request, let the server apply it, then reset the client's connection
    (RST) instead of passing the answer on: a write whose response was lost;
  * reset before: reset the connection without forwarding (the request never arrived);
  * drip: forward the request and pass the real answer on one byte every `drip_s` seconds (a
    server, or a middlebox, that answers slowly enough to defeat a per-read timeout).

Each applies to requests whose first line matches a pattern (b"^PATCH /api/v1/nodes/"), for the
next `count` of them (None: until cleared). One request per connection, as the test server
(HTTP/1.0) answers; `seen` records each request line with what the proxy did with it.
"""

from __future__ import annotations

import re
import socket
import ssl
import struct
import threading
from dataclasses import dataclass
from typing import Optional


@dataclass
class Rule:
    pattern: "re.Pattern[bytes]"
    action: str  # "blackhole" | "reset-after" | "reset-before" | "drip"
    count: Optional[int]


class TcpProxy:
    """Listen on 127.0.0.1:<port>, forward to target_port; see the module docstring."""

    def __init__(self, target_port: int, hold_s: float = 20.0, drip_s: float = 2.0, *,
                 upstream_tls: bool = False) -> None:
        """hold_s: how long a black-holed connection is held before the proxy closes it (so a
        client without timeouts fails its test instead of hanging it). drip_s: the pause before
        each byte of a dripped answer (a drip ends when the client goes, or at clear()).
        upstream_tls: the target speaks TLS (a real kube-apiserver, its certificate not checked):
        clients speak plain HTTP to the proxy, which asks the target to close after each answer
        (the proxy reads an answer to its end)."""
        self.target = ("127.0.0.1", target_port)
        self.upstream_tls = upstream_tls
        self.hold_s = hold_s
        self.drip_s = drip_s
        self._release = threading.Event()
        self.rules: list[Rule] = []
        self.seen: list[tuple[bytes, str]] = []
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(512)
        self._sock.settimeout(0.05)  # the accept loop looks at _closed this often
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._workers: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._accept, daemon=True, name="tcpproxy")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, action: str, pattern: bytes = b"", count: Optional[int] = None) -> None:
        with self._lock:
            self.rules.append(Rule(re.compile(pattern), action, count))

    def clear(self) -> None:
        """Behave again: forward everything; connections held by a black-hole are closed."""
        with self._lock:
            self.rules.clear()
            held, self._held = self._held, []
            release, self._release = self._release, threading.Event()
        release.set()
        for s in held:
            _close(s)

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        self.clear()
        _close(self._sock)
        for t in self._workers:
            t.join(5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(30)
            worker = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name="tcpproxy-conn")
            self._workers = [t for t in self._workers if t.is_alive()] + [worker]
            worker.start()

    def _action(self, line: bytes) -> str:
        with self._lock:
            for rule in self.rules:
                if rule.pattern.search(line) and rule.count != 0:
                    if rule.count is not None:
                        rule.count -= 1
                    self.seen.append((line, rule.action))
                    return rule.action
            self.seen.append((line, "pass"))
            return "pass"

    def _serve(self, conn: socket.socket) -> None:
        try:
            request = _read_request(conn)
            if request is None:
                _close(conn)
                return
            action = self._action(request.split(b"\r\n", 1)[0])
            if action == "blackhole":
                with self._lock:
                    self._held.append(conn)
                    release = self._release
                release.wait(self.hold_s)
                _close(conn)
                return
            if action == "reset-before":
                _reset(conn)
                return
            upstream = socket.create_connection(self.target, timeout=30)
            if self.upstream_tls:
                tls = ssl.create_default_context()
                tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
                upstream = tls.wrap_socket(upstream, server_hostname="127.0.0.1")
                head, _, body = request.partition(b"\r\n\r\n")
                head = re.sub(rb"(?im)^connection:[^\r\n]*\r\n?", b"", head)
                request = head + b"\r\nConnection: close\r\n\r\n" + body
            upstream.sendall(request)
            answer = b""
            while True:
                chunk = upstream.recv(65536)
                if not chunk:
                    break
                answer += chunk
            _close(upstream)
            if action == "reset-after":
                _reset(conn)
                return
            if action == "drip":
                with self._lock:
                    release = self._release
                for k in range(len(answer)):
                    if release.wait(self.drip_s):
                        break
                    conn.sendall(answer[k:k + 1])
                _close(conn)
                return
            conn.sendall(answer)
            _close(conn)
        except OSError:
            _close(conn)


def _read_request(conn: socket.socket) -> Optional[bytes]:
    """One HTTP request: headers, then Content-Length bytes of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    want = int(m.group(1)) if m else 0
    while len(body) < want:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _reset(s: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a dropped connection looks to the client."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass
