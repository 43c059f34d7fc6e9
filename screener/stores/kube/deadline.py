"""A deadline per Kubernetes API call that no server behaviour can stretch (issue 36.4).

Why this module exists: the kubernetes client's `_request_timeout=(connect, read)` becomes a
urllib3 Timeout, and urllib3 sets it as the *socket* timeout, which bounds each blocking
operation (one connect, one recv), not the request. A server that drips its answer, one byte
every few seconds, resets the read timer with every byte and holds the call for as long as it
likes (a campaign saw `daemon --once` still running after 240 s, and SIGTERM left it in poll()
13 minutes later). urllib3's `Timeout(total=...)` does not help: it only shortens the read
timeout by the time the connect took, and the result is again a per-recv timeout. Retrying
within `call_s`, checked only between attempts, let one attempt start at 44 s and run its full
read timeout (a black hole took 70 s against a 45 s bound).

What bounds total time here, whatever the server does:
  * every attempt's connect and read timeouts are cut to the time the call has left, and no
    attempt starts when none is left;
  * a watchdog thread (one per process) holds every call in flight with its deadline; when it
    passes, the watchdog shuts down (shutdown(2), SHUT_RDWR) the sockets that call opened or
    reused. A thread blocked in recv, poll or a TLS read then returns at once with EOF or an
    error, whatever the server is sending, so the call fails as a timeout and the caller spools.
    The sockets are found through the connection classes of the client's urllib3 pool
    (`install`): each connection keeps a dup() of its raw socket (taken before the TLS wrap, so
    the handshake can be cut too, and never a reused descriptor number) and enlists itself with
    the call running on its thread;
  * an owner (a KubeStore's ApiCaller) may lower every deadline at once (`Owner.cap`): on
    SIGTERM the daemon caps all calls, those in flight included, to a few seconds from now, so
    the pod ends within its grace period even while a call is blocked.

A worker thread per call with a deadline on the wait would bound the caller but leave the
request running, holding its connection and its thread; a socket shut down ends it. Not
covered: name resolution (getaddrinfo cannot be interrupted; in a pod the API server is an IP,
$KUBERNETES_SERVICE_HOST) — the caller's thread waits for the resolver's own timeout there.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from typing import Any, Optional

from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

_local = threading.local()


class Owner:
    """What a group of calls shares: a cap on every deadline (monotonic; inf: none)."""

    def __init__(self) -> None:
        self.cap_at = math.inf

    def cap(self, seconds: float) -> None:
        """From now on no call of this owner, in flight or to come, runs past now + seconds."""
        with _WATCHDOG.cond:
            self.cap_at = min(self.cap_at, time.monotonic() + max(0.0, seconds))
            _WATCHDOG.cond.notify()

    def left(self, deadline: float) -> float:
        """Seconds left before `deadline` or this owner's cap."""
        return min(deadline, self.cap_at) - time.monotonic()


class Watch:
    """One call in flight: its deadline, its owner, the connections it used, whether it fired."""

    def __init__(self, owner: Owner, deadline: float) -> None:
        self.owner, self.deadline = owner, deadline
        self.conns: set[Any] = set()
        self.fired = False
        self.done = False

    def due(self) -> float:
        return min(self.deadline, self.owner.cap_at)


class _Watchdog:
    """The one thread that ends calls past their deadline (see the module docstring)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.calls: set[Watch] = set()
        self.thread: Optional[threading.Thread] = None

    def begin(self, owner: Owner, deadline: float) -> Watch:
        w = Watch(owner, deadline)
        with self.cond:
            self.calls.add(w)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="screener-kube-deadline")
                self.thread.start()
            self.cond.notify()
        _local.watch = w
        return w

    def end(self, w: Watch) -> bool:
        """The call is over; True when its deadline fired (its answer, if any, is cut short).
        The last call out stops the thread (none is left running between calls: a process with
        threads cannot fork safely, and torch's spawn is much slower)."""
        _local.watch = None
        idle: Optional[threading.Thread] = None
        with self.cond:
            self.calls.discard(w)
            w.done = True
            w.conns.clear()
            fired = w.fired
            if not self.calls and self.thread is not None:
                idle, self.thread = self.thread, None
                self.cond.notify()
        if idle is not None and idle is not threading.current_thread():
            idle.join()
        return fired

    def enlist(self, conn: Any) -> None:
        """A connection used on this thread belongs to the call running here."""
        w: Optional[Watch] = getattr(_local, "watch", None)
        if w is None:
            return
        with self.cond:
            if w.done:
                return
            if w.fired:
                _abort(conn)
            else:
                w.conns.add(conn)

    def _run(self) -> None:
        me = threading.current_thread()
        with self.cond:
            while self.thread is me:
                now = time.monotonic()
                for w in [w for w in self.calls if w.due() <= now]:
                    w.fired = True
                    self.calls.discard(w)
                    for conn in w.conns:
                        _abort(conn)
                nxt = min((w.due() for w in self.calls), default=math.inf)
                self.cond.wait(None if nxt == math.inf else max(0.0, nxt - now) + 0.001)


_WATCHDOG = _Watchdog()


def begin(owner: Owner, deadline: float) -> Watch:
    """Watch the call about to run on this thread until `end`: past `deadline` (or the owner's
    cap), its sockets are shut down."""
    return _WATCHDOG.begin(owner, deadline)


def end(w: Watch) -> bool:
    return _WATCHDOG.end(w)


def _abort(conn: Any) -> None:
    lock = getattr(conn, "_screener_lock", None)
    if lock is None:
        return
    with lock:
        dup = getattr(conn, "_screener_dup", None)
        if dup is not None:
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Watched:
    """Mixed into urllib3's connection classes: keep a dup of the raw socket, enlist with the
    call running on this thread."""

    _screener_dup: Optional[socket.socket] = None

    def _new_conn(self) -> socket.socket:
        sock: socket.socket = super()._new_conn()  # type: ignore[misc]
        if getattr(self, "_screener_lock", None) is None:
            self._screener_lock = threading.Lock()
        with self._screener_lock:
            old, self._screener_dup = self._screener_dup, None
            if old is not None:
                old.close()
            try:
                self._screener_dup = sock.dup()
            except OSError:
                self._screener_dup = None
        _WATCHDOG.enlist(self)
        return sock

    def request(self, *args: Any, **kwargs: Any) -> Any:
        _WATCHDOG.enlist(self)
        return super().request(*args, **kwargs)  # type: ignore[misc]

    def close(self) -> None:
        try:
            super().close()  # type: ignore[misc]
        finally:
            lock = getattr(self, "_screener_lock", None)
            if lock is not None:
                with lock:
                    dup, self._screener_dup = self._screener_dup, None
                    if dup is not None:
                        dup.close()


class WatchedHTTPConnection(_Watched, HTTPConnection):
    pass


class WatchedHTTPSConnection(_Watched, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = WatchedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = WatchedHTTPSConnection


def install(pool_manager: Any) -> bool:
    """Make a urllib3 PoolManager (the kubernetes client's) open watched connections. False when
    it is not one (a test's stand-in): its calls then have the per-attempt bounds only."""
    if not isinstance(getattr(pool_manager, "pool_classes_by_scheme", None), dict):
        return False
    pool_manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
    pool_manager.clear()  # pools made before this keep plain connections
    return True
