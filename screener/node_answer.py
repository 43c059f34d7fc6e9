"""The node-local health answer: what the DaemonSet tells a launcher on its node, and how to ask.

The daemon (screener.agent.health_answer) serves one small JSON object, the node's screener state
and last verdict, on a Unix socket on the host and on its HTTP port (GET /node); a launcher
(`screener launch`, an NVRx ft_launcher through screener.agent.nvrx_health) asks it before it
starts or restarts ranks on the node. Writer and reader share this module so they cannot drift:
the schema, the size bound, the default socket path and the client.

The protocol on the socket is plain HTTP/1.0 (`curl --unix-socket PATH http://screener/node`
works): one request, one answer, then the daemon closes the connection.

    {"schema": "screener.io/node-answer/v1", "node": "gpu-7", "state": "healthy",
     "since": 1767225600.0, "reason": "full burn-in passed", "code": "BurninPassed",
     "may_run_jobs": true, "why": "the node is healthy",
     "last_screen": {"time": 1767225600.0, "outcome": "pass", "kind": "full"},
     "daemon": {"started": true, "alive": true, "mode": "enforce", "age_s": 2.1}}

may_run_jobs is true exactly when the node is `healthy` in the daemon's view, the daemon has
started and no evidence about the node waits to be decided, and also in observe mode (the state
is recorded there, never enforced: a launcher that refused would act on the node's scheduling,
which observe mode promises not to). `daemon.alive`
is false when the daemon's loop has not made progress within its liveness window: the answer may
be stale, and the client reports it as unavailable.

`waiting` (omitted when there is none) says what hardware evidence about the node the daemon holds
but could not decide yet: an alarm file, or a probe's finding, while the Kubernetes API is out of
reach at a first start, when the node's state is not known locally. The evidence stays where it
is (the alarm in its file, durable; the finding re-read by the next probe) and is decided through
the lifecycle once the API answers, on the node's real state: a state assumed now could put a
serving node in burnin or undo a person's quarantine. Until then no job may start: a launcher
takes `waiting` as a refusal, not as "no answer", even with `--if-unavailable run`.

Trust: the socket lives in the alarm folder, which only the daemon (its owner) and the alarm
writers' group can enter. A group member could bind a socket of its own at that name while the
daemon is down and answer "healthy"; so the client accepts a socket only when it has the same
owner as its folder (the daemon's uid, which the alarm intake requires of the folder anyway).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from screener import boundedjson
from screener.types import ALARM_DIR_ENV, DEFAULT_ALARM_DIR, NodeState, printable_text

__all__ = ["SCHEMA", "PATH", "SOCKET_NAME", "SOCKET_ENV", "MAX_ANSWER_BYTES", "AnswerUnavailable",
           "NodeAnswer", "answer_body", "default_socket", "encode", "parse_answer", "ask"]

SCHEMA = "screener.io/node-answer/v1"
PATH = "/node"  # the one path, on the socket and on the HTTP port
SOCKET_NAME = "health.sock"  # in the alarm folder; the intake takes only *.json, never this
SOCKET_ENV = "SCREENER_HEALTH_SOCKET"
# An answer is a few hundred bytes; the bound keeps a hostile peer from feeding a launcher an
# endless stream, and the daemon from ever writing more than one socket buffer.
MAX_ANSWER_BYTES = 8192
MAX_TEXT = 300  # a reason or a why, cut to this many characters
ASK_TIMEOUT_S = 2.0


class AnswerUnavailable(Exception):
    """No usable answer: no socket, no daemon behind it, a timeout, a socket not the daemon's,
    or an answer that is not one. The message is one line that says which."""


def default_socket(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where the answer is: $SCREENER_HEALTH_SOCKET, else `health.sock` in the alarm folder
    ($SCREENER_ALARM_DIR, else /var/run/screener/alarms), which job pods already mount."""
    env = os.environ if environ is None else environ
    if env.get(SOCKET_ENV):
        return env[SOCKET_ENV]
    return str(Path(env.get(ALARM_DIR_ENV) or DEFAULT_ALARM_DIR) / SOCKET_NAME)


def _text(value: Any) -> str:
    """Stored free text as the answer carries it: a string, cut, printable characters only."""
    text = str(value or "")[:MAX_TEXT]
    return "".join(c if c.isprintable() else " " for c in text)


def _as_said(state: NodeState) -> str:
    """"suspect", "quarantined", but "in burnin", "in repair": the why is read by people."""
    return f"in {state.value}" if state in (NodeState.BURNIN, NodeState.REPAIR) else state.value


def answer_body(*, node: str, state: Optional[NodeState], since: Optional[float], reason: str,
                code: str, last_screen: Optional[Mapping[str, Any]], started: bool, alive: bool,
                mode: str, age_s: float, waiting: str = "") -> dict[str, Any]:
    """The answer's JSON object (see the module docstring); pure, so both ends test it alike."""
    observe = mode == "observe"
    if waiting and not observe:
        may, why = False, f"hardware evidence about the node waits to be decided: {waiting}"
    elif not started or state is None:
        may, why = False, "the daemon has not started yet: the node's state is not known"
    elif state == NodeState.HEALTHY:
        may, why = True, "the node is healthy"
    elif observe:
        may, why = True, f"the node is {_as_said(state)}, but the daemon runs in observe mode"
    else:
        may, why = False, f"the node is {_as_said(state)}" + (f": {_text(reason)}" if reason
                                                                else "")
    screen: Optional[dict[str, Any]] = None
    if last_screen:
        screen = {}
        for key in ("outcome", "kind"):
            if isinstance(last_screen.get(key), str):
                screen[key] = _text(last_screen[key])[:32]
        t = last_screen.get("time")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            screen["time"] = float(t)
    body = {"schema": SCHEMA, "node": _text(node), "state": state.value if state else None,
            "since": since, "reason": _text(reason), "code": _text(code)[:64],
            "may_run_jobs": may, "why": _text(why),
            "last_screen": screen or None,
            "daemon": {"started": started, "alive": alive, "mode": _text(mode)[:16],
                       "age_s": round(max(0.0, age_s), 3)}}
    if waiting:
        body["waiting"] = _text(waiting)
    return body


@dataclass(frozen=True)
class NodeAnswer:
    """A validated answer, as a launcher reads it."""

    node: str
    state: Optional[NodeState]
    may_run_jobs: bool
    why: str
    alive: bool
    raw: dict[str, Any]
    waiting: str = ""  # undecided evidence about the node (see the module docstring)

    def line(self) -> str:
        """One line for people: the node, its state and why it may or may not run jobs."""
        return f"node {self.node}: {self.why}"


def parse_answer(data: bytes) -> NodeAnswer:
    """Validate an answer's JSON body (hostile until validated: anything wrong is
    AnswerUnavailable, one line)."""
    try:
        obj = boundedjson.loads(data, max_bytes=MAX_ANSWER_BYTES, max_depth=4)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise AnswerUnavailable(f"the answer is not JSON: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise AnswerUnavailable(f"the answer is not a {SCHEMA} object")
    try:
        state = NodeState.parse(obj["state"]) if obj.get("state") is not None else None
        node = printable_text(obj.get("node", ""), "node", 253)
        why = printable_text(obj.get("why", ""), "why", MAX_TEXT)
        waiting = printable_text(obj.get("waiting", ""), "waiting", MAX_TEXT)
    except (ValueError, AttributeError) as e:
        raise AnswerUnavailable(f"the answer is malformed: {e}") from None
    may, daemon = obj.get("may_run_jobs"), obj.get("daemon")
    if not isinstance(may, bool) or not isinstance(daemon, dict) \
            or not isinstance(daemon.get("alive"), bool):
        raise AnswerUnavailable("the answer is malformed: may_run_jobs or daemon.alive missing")
    if may and state is None:
        raise AnswerUnavailable("the answer is malformed: may run jobs, but no state")
    if may and waiting and daemon.get("mode") != "observe":
        raise AnswerUnavailable("the answer is malformed: may run jobs, but evidence waits")
    return NodeAnswer(node=node, state=state, may_run_jobs=may, why=why,
                      alive=daemon["alive"], raw=obj, waiting=waiting)


def _check_owner(path: str) -> None:
    """The socket must be a socket owned by its folder's owner (see the module docstring)."""
    try:
        st = os.lstat(path)
        folder = os.stat(os.path.dirname(os.path.abspath(path)))
    except FileNotFoundError:
        raise AnswerUnavailable(f"no health socket at {path} (is the screener DaemonSet "
                                f"running on this node, and the folder mounted?)") from None
    except OSError as e:
        raise AnswerUnavailable(f"cannot look at {path}: {e.strerror or e}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise AnswerUnavailable(f"{path} is not a socket")
    if st.st_uid != folder.st_uid:
        raise AnswerUnavailable(f"{path} belongs to uid {st.st_uid}, not to its folder's owner "
                                f"(uid {folder.st_uid}): not the screener daemon's socket")


def ask(path: Optional[str] = None, *, timeout_s: float = ASK_TIMEOUT_S) -> NodeAnswer:
    """Ask the daemon on this node for its answer over the Unix socket at `path` (default:
    default_socket()). Every step is within `timeout_s` in all; AnswerUnavailable otherwise."""
    path = path or default_socket()
    _check_owner(path)
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(f"GET {PATH} HTTP/1.0\r\nHost: screener\r\n\r\n".encode())
            chunks, size = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = sock.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_ANSWER_BYTES + 1024:
                    raise AnswerUnavailable(f"the answer on {path} is larger than "
                                            f"{MAX_ANSWER_BYTES} bytes")
        except (TimeoutError, socket.timeout):
            raise AnswerUnavailable(f"the daemon did not answer on {path} within "
                                    f"{timeout_s:g} s") from None
        except OSError as e:
            raise AnswerUnavailable(f"cannot ask the daemon on {path}: "
                                    f"{e.strerror or e}") from None
    finally:
        sock.close()
    head, sep, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/"):
        raise AnswerUnavailable(f"the answer on {path} is not an HTTP response")
    if status[1] not in (b"200", b"503"):  # 503: the daemon answers, but has not started
        raise AnswerUnavailable(f"the daemon on {path} answered HTTP "
                                f"{status[1].decode('ascii', 'replace')[:8]}")
    return parse_answer(body)


def encode(body: Mapping[str, Any]) -> bytes:
    """The answer as it is sent (compact JSON and a newline)."""
    return (json.dumps(body, separators=(",", ":"), sort_keys=True) + "\n").encode()
