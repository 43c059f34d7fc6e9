"""The node-local health answer (issue 38.2): the daemon's state and last verdict on a real Unix
socket and on the real HTTP port, from a real Daemon (the DaemonRig: real lifecycle, real
LocalStore, real probes over a scripted NVML); `screener launch` asking it before it starts a
real child process. Fakes only at the outer boundary: the clock, NVML, the screen runner.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from cli_util import screener
from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome
from screener.agent.health_answer import SOCKET_MODE, AnswerBoard, HealthSocket
from screener.agent.metrics import DaemonMetrics, MetricsServer
from screener.errors import ConfigError
from screener.node_answer import (MAX_ANSWER_BYTES, SCHEMA, AnswerUnavailable, ask,
                                  default_socket, parse_answer)
from screener.settings.daemon import DaemonConfig
from screener.types import NodeState, Outcome

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sockdir():
    # A short path of its own: a Unix socket's path is limited to 107 bytes, and pytest's
    # tmp_path can be longer than that.
    d = tempfile.mkdtemp(prefix="sa-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def rig(tmp_path):
    r = DaemonRig(tmp_path, ScriptedRunner(outcome(Outcome.PASS)), idle_window_s=0.0)
    yield r
    r.close()


def _serve(board, path, **kw):
    return HealthSocket(board, str(path), **kw).start()


def _http_get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_daemon_answers_its_state_and_last_verdict_on_the_socket_and_the_http_port(
        rig, sockdir):
    path = sockdir / "health.sock"
    sock = _serve(rig.daemon.answer, path)
    http = MetricsServer(rig.metrics, "127.0.0.1", 0, node_answer=rig.daemon.answer.render).start()
    try:
        # Before start-up: the daemon answers, and says it does not know yet.
        before = ask(str(path))
        assert before.state is None and not before.may_run_jobs
        assert _http_get(f"{http.url}/node")[0] == 503

        report = rig.tick()  # start-up (burnin), then the full burn-in passes: healthy
        assert report.state == NodeState.HEALTHY
        answer = ask(str(path))
        assert (answer.node, answer.state, answer.may_run_jobs, answer.alive) == (
            NODE, NodeState.HEALTHY, True, True)
        body = answer.raw
        assert body["schema"] == SCHEMA and body["daemon"]["mode"] == "enforce"
        last = rig.store.history(NODE)[-1]
        assert (body["since"], body["reason"], body["code"]) == (last.time, last.reason, last.code)
        verdict = rig.store.get_verdict(NODE)
        assert body["last_screen"] == {"time": verdict["time"], "outcome": "pass", "kind": "full"}
        code, over_http = _http_get(f"{http.url}/node")
        assert code == 200
        assert {k: v for k, v in over_http.items() if k != "daemon"} == \
            {k: v for k, v in body.items() if k != "daemon"}

        # An unsettled alarm makes the node suspect; the next answer says so, and why.
        rig.drop_alarm("a-1", settled=False)
        assert rig.tick(advance=5.0).state == NodeState.SUSPECT
        answer = ask(str(path))
        assert answer.state == NodeState.SUSPECT and not answer.may_run_jobs
        assert answer.why.startswith("the node is suspect: ")
        assert answer.raw["reason"] == rig.store.history(NODE)[-1].reason
        assert len(json.dumps(answer.raw)) < MAX_ANSWER_BYTES
    finally:
        http.stop()
        sock.stop()
    assert not path.exists()  # removed on stop: a launcher then sees "no socket"


def test_the_socket_in_the_alarm_folder_is_left_alone_by_the_intake(rig):
    path = Path(rig.config.alarm_dir) / "health.sock"
    if len(str(path)) > 100:
        pytest.skip("the test's folder is too deep for a Unix socket path")
    Path(rig.config.alarm_dir).mkdir(parents=True, exist_ok=True)
    sock = _serve(rig.daemon.answer, path)
    try:
        rig.tick()
        rig.drop_alarm("a-2", settled=False)
        report = rig.tick(advance=5.0)
        assert report.state == NodeState.SUSPECT and not report.errors
        assert not rig.metrics.intake_problem and rig.metrics.readiness()[0]
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        rejected = Path(rig.config.alarm_dir) / "rejected"
        assert not rejected.exists() or not any(rejected.iterdir())
        assert ask(str(path)).state == NodeState.SUSPECT
    finally:
        sock.stop()


def test_a_restarted_daemon_answers_from_the_history_it_read_at_start(rig, sockdir, tmp_path):
    rig.tick()
    rig.drop_alarm("a-1", settled=False)
    rig.tick(advance=5.0)
    # A new daemon over the same store: its answer comes from the history and verdict it read.
    again = DaemonRig(tmp_path, ScriptedRunner(), store=rig.store, idle_window_s=1e6)
    again.daemon.start()
    body = again.daemon.answer.body()
    last = rig.store.history(NODE)[-1]
    assert (body["state"], body["since"], body["reason"]) == ("suspect", last.time, last.reason)
    assert body["last_screen"]["outcome"] == "pass"


def test_a_silent_or_trickling_client_neither_stalls_the_loop_nor_keeps_launchers_out(
        rig, sockdir):
    path = sockdir / "health.sock"
    sock = _serve(rig.daemon.answer, path, max_connections=4, read_timeout_s=0.5)
    silent = []
    try:
        rig.tick()
        for _ in range(10):  # more than the cap: the oldest are shut to make room
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(path))
            silent.append(c)
        trickle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        trickle.connect(str(path))
        silent.append(trickle)
        t0 = time.monotonic()
        for _ in range(5):  # the loop goes on at its own pace
            rig.tick(advance=5.0)
        assert time.monotonic() - t0 < 2.0
        answer = ask(str(path), timeout_s=2.0)  # a launcher still gets its answer at once
        assert answer.state == NodeState.HEALTHY
        assert sock.open_connections <= 4
        # A client that trickles a byte at a time is dropped at the deadline from its connect.
        deadline = time.monotonic() + 3.0
        dropped = False
        while time.monotonic() < deadline:
            try:
                trickle.send(b"G")
            except OSError:
                dropped = True
                break
            time.sleep(0.05)
        assert dropped
        # ...and every silent one is gone after the read timeout.
        deadline = time.monotonic() + 3.0
        while sock.open_connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.open_connections == 0
    finally:
        for c in silent:
            c.close()
        sock.stop()


def test_bad_requests_get_one_small_error_and_the_connection_closed(rig, sockdir):
    path = sockdir / "health.sock"
    sock = _serve(rig.daemon.answer, path)
    try:
        def raw(data: bytes) -> bytes:
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.settimeout(5)
            c.connect(str(path))
            c.sendall(data)
            out = b""
            while chunk := c.recv(65536):
                out += chunk
            c.close()
            return out

        assert raw(b"POST /node HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 405")
        assert raw(b"GET /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 404")
        assert raw(b"\r\n\r\n").startswith(b"HTTP/1.0 400")
        # Over the bound: a 400, or (the rest of the request left unread) a reset: either way the
        # daemon reads no more than MAX_REQUEST bytes of it.
        try:
            assert raw(b"GET /node HTTP/1.0\r\nX: " + b"a" * 10000 + b"\r\n\r\n") \
                .startswith(b"HTTP/1.0 400")
        except ConnectionResetError:
            pass
        head = raw(b"HEAD /node HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 503") and head.endswith(b"\r\n\r\n")
    finally:
        sock.stop()


def test_a_stale_socket_is_replaced_at_start_and_the_mode_is_0660(rig, sockdir):
    path = sockdir / "health.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a killed daemon's socket: the file stays, nobody listens
    stale.close()
    with pytest.raises(AnswerUnavailable, match="cannot ask the daemon"):
        ask(str(path))
    sock = _serve(rig.daemon.answer, path)
    try:
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == SOCKET_MODE == 0o660
        assert ask(str(path)).raw["schema"] == SCHEMA
        assert [p.name for p in sockdir.iterdir()] == ["health.sock"]  # no temporary left
    finally:
        sock.stop()
    (sockdir / "d").mkdir()
    with pytest.raises(ConfigError, match="is a folder"):
        HealthSocket(rig.daemon.answer, str(sockdir / "d")).start()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the socket another owner")
def test_a_socket_not_owned_by_its_folders_owner_is_not_the_daemons(rig, sockdir):
    path = sockdir / "health.sock"
    sock = _serve(rig.daemon.answer, path)
    try:
        os.chown(path, 4242, -1, follow_symlinks=False)  # a group member's socket at that name
        with pytest.raises(AnswerUnavailable, match="not the screener daemon's socket"):
            ask(str(path))
    finally:
        sock.stop()


def test_no_socket_and_a_hostile_answer_are_unavailable(sockdir):
    with pytest.raises(AnswerUnavailable, match="no health socket at"):
        ask(str(sockdir / "none.sock"))
    (sockdir / "file").write_text("x")
    with pytest.raises(AnswerUnavailable, match="is not a socket"):
        ask(str(sockdir / "file"))
    for data, why in [(b"nope", "not JSON"), (b'{"schema": "other"}', "not a screener"),
                      (json.dumps({"schema": SCHEMA, "state": "healthy", "may_run_jobs": "yes",
                                   "daemon": {"alive": True}}).encode(), "malformed"),
                      (json.dumps({"schema": SCHEMA, "state": None, "may_run_jobs": True,
                                   "daemon": {"alive": True}}).encode(), "no state"),
                      (json.dumps({"schema": SCHEMA, "state": "great", "may_run_jobs": True,
                                   "daemon": {"alive": True}}).encode(), "unknown node state"),
                      (b"[" * 100 + b"]" * 100, "not JSON"),
                      (b" " * (MAX_ANSWER_BYTES + 1), "not JSON")]:
        with pytest.raises(AnswerUnavailable, match=why):
            parse_answer(data)


def test_observe_mode_records_the_state_and_lets_jobs_run():
    board = AnswerBoard("n1", mode="observe")
    board.update(state=NodeState.SUSPECT, started=True,
                 moved={"time": 5.0, "reason": "an alarm", "code": "RingReplayMismatch"})
    body = board.body()
    assert body["state"] == "suspect" and body["may_run_jobs"] is True
    assert "observe mode" in body["why"]
    # A wedged loop: the answer says it may be stale.
    stuck = AnswerBoard("n1", alive=lambda: False)
    stuck.update(state=NodeState.HEALTHY, started=True)
    assert stuck.body()["daemon"]["alive"] is False


def test_the_socket_path_is_a_daemon_setting_with_the_alarm_folder_as_its_default(tmp_path):
    base = {"node": "n1", "alarm_dir": "/var/run/screener/alarms"}
    assert DaemonConfig.from_mapping(base).health_socket_path() == \
        "/var/run/screener/alarms/health.sock"
    assert DaemonConfig.from_mapping({**base, "health_socket": "off"}).health_socket_path() is None
    cfg = DaemonConfig.load(environ={"NODE_NAME": "n1",
                                     "SCREENER_DAEMON_HEALTH_SOCKET": "/run/x.sock"})
    assert cfg.health_socket_path() == "/run/x.sock"
    with pytest.raises(ConfigError, match="health_socket"):
        DaemonConfig.from_mapping({**base, "health_socket": "relative.sock"})
    assert default_socket({"SCREENER_ALARM_DIR": "/a"}) == "/a/health.sock"
    assert default_socket({"SCREENER_HEALTH_SOCKET": "/b.sock", "SCREENER_ALARM_DIR": "/a"}) \
        == "/b.sock"


def test_the_daemon_command_serves_the_socket_and_one_it_cannot_is_an_error_line(sockdir, caplog):
    from screener.commands.daemon import _answer_servers

    metrics = DaemonMetrics("n1")
    board = AnswerBoard("n1")
    cfg = DaemonConfig.from_mapping({"node": "n1", "alarm_dir": str(sockdir)})
    servers = _answer_servers(cfg, board, metrics)
    try:
        assert [s.path for s in servers] == [str(sockdir / "health.sock")]
        assert ask(str(sockdir / "health.sock")).node == "n1"
    finally:
        for s in servers:
            s.stop()
    bad = DaemonConfig.from_mapping({"node": "n1", "alarm_dir": str(sockdir / "missing")})
    assert _answer_servers(bad, board, metrics) == []
    assert "cannot serve the health answer" in caplog.text
    assert metrics.registry.get_sample_value("screener_errors_total",
                                             {"node": "n1", "where": "health_socket"}) == 1


# --- screener launch --------------------------------------------------------------------------


@pytest.fixture
def answering(sockdir):
    """A real board and socket whose state a test sets, and a child that leaves a mark."""
    board = AnswerBoard("gpu-7")
    sock = _serve(board, sockdir / "health.sock")
    yield board, sockdir
    sock.stop()


def _launch(sockdir, *opts, env=None):
    mark = sockdir / "ran"
    ran = screener("launch", *opts, "--", sys.executable, "-c",
                   f"open({str(mark)!r}, 'w').close()",
                   env={"SCREENER_ALARM_DIR": str(sockdir), "SCREENER_HEALTH_SOCKET": None,
                        **(env or {})})
    started = mark.exists()
    if started:
        mark.unlink()
    return ran, started


def test_launch_starts_workers_on_a_healthy_node_and_refuses_one_that_is_not(answering):
    board, d = answering
    board.update(state=NodeState.HEALTHY, started=True, moved={"time": 1.0, "reason": "passed"})
    ran, started = _launch(d)
    assert ran.returncode == 0 and started, ran.stderr
    board.update(state=NodeState.QUARANTINED, started=True,
                 moved={"time": 2.0, "reason": "known-answer mismatch on GPU 3"})
    ran, started = _launch(d)
    assert ran.returncode == 75 and not started
    (line,) = ran.stderr.strip().splitlines()
    assert line.startswith("screener launch: refusing to start workers: node gpu-7: the node is "
                           "quarantined: known-answer mismatch on GPU 3")
    # --no-health-check starts anyway; --health-socket points elsewhere (here: nowhere).
    ran, started = _launch(d, "--no-health-check")
    assert ran.returncode == 0 and started
    ran, started = _launch(d, "--health-socket", str(d / "other.sock"))
    assert ran.returncode == 0 and started and "no health answer" in ran.stderr


def test_launch_without_an_answer_warns_and_starts_or_refuses_when_asked(sockdir):
    ran, started = _launch(sockdir)
    assert ran.returncode == 0 and started
    assert "warning: no health answer (no health socket at" in ran.stderr
    ran, started = _launch(sockdir, "--if-unavailable", "refuse")
    assert ran.returncode == 1 and not started
    (line,) = ran.stderr.strip().splitlines()
    assert "refusing to start workers: no health answer" in line


def test_launch_takes_a_daemon_not_started_or_stuck_as_no_answer(answering):
    board, d = answering
    ran, started = _launch(d, "--if-unavailable", "refuse")  # never updated: not started
    assert ran.returncode == 1 and not started and "has not started" in ran.stderr
    board.update(state=NodeState.HEALTHY, started=True)
    board._alive = lambda: False  # the loop's liveness, as /healthz sees it
    ran, started = _launch(d, "--if-unavailable", "refuse")
    assert ran.returncode == 1 and "not making progress" in ran.stderr


def test_evidence_waiting_for_a_decision_refuses_the_launch_whatever_if_unavailable(answering):
    """A first start while the API is out of reach: the daemon has not started and knows no
    state, but holds an alarm about its node. That is a refusal (exit 75, one line), not a
    missing answer the default would start the workers on."""
    board, d = answering
    waiting = ("1 alarm file (ring_replay-7.json), held until decided (the node's state is not "
               "known yet)")
    board.update(state=None, started=False, waiting=waiting)
    body = board.body()
    assert body["may_run_jobs"] is False and body["waiting"] == waiting
    assert body["why"] == f"hardware evidence about the node waits to be decided: {waiting}"
    for opts in ((), ("--if-unavailable", "run"), ("--if-unavailable", "refuse")):
        ran, started = _launch(d, *opts)
        assert ran.returncode == 75 and not started, (opts, ran.stderr)
        (line,) = ran.stderr.strip().splitlines()
        assert line.startswith("screener launch: refusing to start workers: node gpu-7: hardware "
                               "evidence about the node waits to be decided: 1 alarm file "
                               "(ring_replay-7.json)"), line
    # Decided: the answer is the state's again (here the alarm made the node suspect).
    board.update(state=NodeState.SUSPECT, started=True, moved={"time": 3.0, "reason": "alarm"})
    assert "waiting" not in board.body()
    ran, started = _launch(d)
    assert ran.returncode == 75 and "the node is suspect: alarm" in ran.stderr
    # Observe mode never holds a job back, for waiting evidence neither.
    observe = AnswerBoard("n1", mode="observe")
    observe.update(state=NodeState.HEALTHY, started=True, waiting=waiting)
    assert observe.body()["may_run_jobs"] is True


def test_an_answer_that_may_run_jobs_while_evidence_waits_is_malformed():
    body = AnswerBoard("n1")
    body.update(state=NodeState.HEALTHY, started=True)
    raw = {**body.body(), "waiting": "1 alarm file (x.json)"}
    with pytest.raises(AnswerUnavailable, match="may run jobs, but evidence waits"):
        parse_answer(json.dumps(raw).encode())
    raw["waiting"] = "1 alarm\u202efile"
    with pytest.raises(AnswerUnavailable, match="waiting holds U\\+202E"):
        parse_answer(json.dumps(raw).encode())


def test_launch_help_explains_the_health_check():
    out = screener("launch", "--help").stdout
    for text in ("--no-health-check", "--health-socket", "--if-unavailable", "exit 75"):
        assert text in out


def test_many_launchers_at_once_all_get_an_answer(rig, sockdir):
    path = sockdir / "health.sock"
    sock = _serve(rig.daemon.answer, path, max_connections=8)
    rig.tick()
    results, errors = [], []

    def one():
        try:
            results.append(ask(str(path), timeout_s=5.0).state)
        except AnswerUnavailable as e:
            errors.append(str(e))

    threads = [threading.Thread(target=one) for _ in range(32)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        sock.stop()
    # The cap may shut an early connection before its answer (the oldest goes first); most get
    # theirs, and none waits past its timeout.
    assert len(results) + len(errors) == 32 and len(results) >= 8, errors
    print(f"{len(results)} answered, {len(errors)} cut by the cap")
    assert set(results) == {NodeState.HEALTHY}
