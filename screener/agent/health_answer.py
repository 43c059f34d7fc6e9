"""The node-local health answer, served: the node's state and last verdict for launchers.

The schema, the client and the default path are screener.node_answer's; this module holds what
the daemon serves from:

- `AnswerBoard`: the answer in memory. The daemon's loop updates it at start-up and after every
  pass (`update`), from what the loop already holds (its state, the last transition it recorded
  or read at start, the last verdict it wrote or read at start); a request renders it under a lock
  held for microseconds. No request reads the store or calls the API server, so a thousand
  launchers asking at once cost the API server nothing and the loop nothing.
- `HealthSocket`: the answer on a Unix socket (HTTP/1.0, GET /node), in a thread of its own.

Bounds, so a slow or hostile client cannot hold the daemon: every connection is served by a
thread of its own, never the loop; the request must arrive whole (at most MAX_REQUEST bytes)
within `read_timeout_s` of the connect, counted from the connect, so a client trickling a byte at
a time is dropped as surely as one that sends nothing; at most `max_connections` are open, and a
new one beyond that shuts down the oldest (as the HTTP port does: a flood of silent connections
cannot keep a launcher out); the answer is at most node_answer.MAX_ANSWER_BYTES, one socket
buffer, and the daemon closes the connection after it.

The socket file: made under a temporary name in the same folder and renamed over `path`, so a
stale socket a killed daemon left is replaced at once and a launcher never meets a missing file
during a restart; mode 0660. In the DaemonSet the folder is the alarm folder (root-owned, the
alarm writers' group 4190, setgid and sticky: manifests/daemonset.yaml), so the socket inherits
group 4190: the daemon and the pods that may raise alarms can ask, nobody else can even reach
the folder, and the sticky bit keeps a group member from removing or replacing the daemon's
socket. 0660 rather than 0666 because nobody outside that group can reach it anyway, and a
mode that says so is the honest one. On stop the socket is removed when it is still ours.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from screener.agent.daemon.clock import ClockLike, as_clock
from screener.errors import ConfigError
from screener.node_answer import MAX_ANSWER_BYTES, PATH, answer_body, encode
from screener.types import NodeState

log = logging.getLogger("screener.health_answer")

MAX_REQUEST = 4096  # a request line and a few headers; more is not a launcher asking
SOCKET_MODE = 0o660  # see the module docstring


class AnswerBoard:
    """The node's answer in memory, updated by the daemon's loop and read by the servers.

    alive(): whether the daemon's loop has made progress within its liveness window (the metrics'
    own test, the one /healthz answers), so an answer from a wedged loop says it may be stale.
    """

    def __init__(self, node: str, *, mode: str = "enforce",
                 alive: Optional[Callable[[], bool]] = None,
                 clock: Optional[ClockLike] = None) -> None:
        self.node = node
        self.mode = mode
        self.clock = as_clock(clock)
        self._alive = alive or (lambda: True)
        self._lock = threading.Lock()
        self._state: Optional[NodeState] = None
        self._started = False
        self._since: Optional[float] = None
        self._reason = ""
        self._code = ""
        self._screen: Optional[dict[str, Any]] = None
        self._waiting = ""
        self._updated = self.clock.monotonic()

    def update(self, *, state: Optional[NodeState], started: bool,
               moved: Optional[Mapping[str, Any]] = None,
               verdict: Optional[Mapping[str, Any]] = None, waiting: str = "") -> None:
        """What the loop holds now. moved: the newest transition ({"time", "reason", "code"}),
        when there is a newer one than the board has; verdict: the last verdict written or read;
        waiting: the hardware evidence it holds undecided ("" when none)."""
        screen = dict(verdict) if isinstance(verdict, Mapping) else None
        with self._lock:
            self._state, self._started, self._waiting = state, started, waiting
            if moved is not None:
                t = moved.get("time")
                self._since = float(t) if isinstance(t, (int, float)) else None
                self._reason = str(moved.get("reason") or "")
                self._code = str(moved.get("code") or "")
            if screen is not None:
                self._screen = screen
            self._updated = self.clock.monotonic()

    def body(self) -> dict[str, Any]:
        """The answer's JSON object now (node_answer.answer_body)."""
        alive = bool(self._alive())
        with self._lock:
            return answer_body(node=self.node, state=self._state, since=self._since,
                               reason=self._reason, code=self._code, last_screen=self._screen,
                               started=self._started, alive=alive, mode=self.mode,
                               age_s=self.clock.monotonic() - self._updated,
                               waiting=self._waiting)

    def render(self) -> tuple[int, bytes]:
        """(HTTP status, body): 200 once the daemon has started, 503 before (the body says so)."""
        body = self.body()
        data = encode(body)
        if len(data) > MAX_ANSWER_BYTES:  # cannot happen with the cut texts; never send more
            raise AssertionError(f"node answer of {len(data)} bytes")
        return (200 if body["daemon"]["started"] else 503), data


def _response(code: int, data: bytes) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
              503: "Service Unavailable"}.get(code, "Error")
    head = (f"HTTP/1.0 {code} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data


def _error(code: int, text: str) -> bytes:
    return _response(code, encode({"error": text, "paths": [PATH]}))


class HealthSocket:
    """The answer on a Unix socket at `path`, in a thread of its own (see the module docstring)."""

    def __init__(self, board: AnswerBoard, path: str, *, max_connections: int = 16,
                 read_timeout_s: float = 2.0) -> None:
        if max_connections < 1 or not read_timeout_s > 0:
            raise ConfigError("health socket: max_connections and read_timeout_s must be > 0")
        self.board = board
        self.path = str(path)
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self._open: "OrderedDict[socket.socket, None]" = OrderedDict()
        self._open_lock = threading.Lock()
        self._listener: Optional[socket.socket] = None
        self._inode: Optional[tuple[int, int]] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.served = 0  # answers sent (for tests and a debug line)

    def start(self) -> "HealthSocket":
        """Bind (replacing whatever socket or file is at `path`, never a folder), listen, serve."""
        target = Path(self.path)
        if target.is_dir() and not target.is_symlink():
            raise ConfigError(f"health_socket {self.path} is a folder")
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            sock.bind(str(tmp))
            os.chmod(tmp, SOCKET_MODE)
            sock.listen(64)
            os.replace(tmp, target)  # atomic: the old socket (a killed daemon's) is gone at once
        except OSError as e:
            sock.close()
            try:
                tmp.unlink()
            except OSError:
                pass
            raise ConfigError(f"cannot serve the health answer on {self.path} (health_socket): "
                              f"{e.strerror or e}") from e
        st = os.stat(target)
        self._inode = (st.st_dev, st.st_ino)
        sock.settimeout(0.5)  # the accept loop looks at the stop flag this often
        self._listener = sock
        self._thread = threading.Thread(target=self._serve, name="health-socket", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            try:  # wakes the accept at once (close alone leaves it to its 0.5 s timeout)
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with self._open_lock:
            for conn in list(self._open):
                _shut(conn)
            self._open.clear()
        try:  # remove the socket only while it is still ours (a successor may have replaced it)
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except OSError:
            pass

    @property
    def open_connections(self) -> int:
        with self._open_lock:
            return len(self._open)

    def _serve(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue  # EMFILE and friends: the loop goes on, the next accept may work
            with self._open_lock:
                while len(self._open) >= self.max_connections:
                    oldest, _ = self._open.popitem(last=False)
                    _shut(oldest)
                self._open[conn] = None
            threading.Thread(target=self._handle, args=(conn,), name="health-answer",
                             daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.sendall(self._answer(self._read(conn)))
            self.served += 1
        except (OSError, ValueError) as e:  # a client gone, silent or too slow: routine
            log.debug("health socket client dropped: %s", e,
                      extra={"event": "health_client_gone"})
        except Exception as e:  # noqa: BLE001 - our own bug: one line, the server goes on
            log.error("health answer failed: %r", e, exc_info=True,
                      extra={"event": "health_answer_error"})
        finally:
            with self._open_lock:
                self._open.pop(conn, None)
            _shut(conn)
            conn.close()

    def _read(self, conn: socket.socket) -> bytes:
        """The request head, within read_timeout_s of the connect in all; TimeoutError else."""
        # Real time, whatever clock the board was given: this bounds real sockets.
        deadline = time.monotonic() + self.read_timeout_s
        data = b""
        while b"\r\n\r\n" not in data and b"\n\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no whole request in time")
            conn.settimeout(left)
            chunk = conn.recv(MAX_REQUEST)
            if not chunk:
                break  # the client ended its side: answer what it sent
            data += chunk
            if len(data) > MAX_REQUEST:
                break
        return data

    def _answer(self, request: bytes) -> bytes:
        if len(request) > MAX_REQUEST:
            return _error(400, f"request head over {MAX_REQUEST} bytes")
        parts = request.split(b"\n", 1)[0].split()
        if len(parts) < 2:
            return _error(400, "expected: GET /node HTTP/1.0")
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _error(405, "only GET")
        if target != PATH.encode():
            return _error(404, f"no such path {target.decode('ascii', 'replace')[:100]}")
        code, data = self.board.render()
        response = _response(code, data)
        return response[:response.index(b"\r\n\r\n") + 4] if method == b"HEAD" else response


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
