"""The node-local health answer in NVRx's published node health check protocol (nvhcd).

nvidia-resiliency-ext's ft_launcher asks an optional node-local health check service before its
workers enter rendezvous, so it does not restart ranks on a bad node. What it publishes, and what
this adapter implements (NVIDIA/nvidia-resiliency-ext at commit
d8686d9c7015c39ce91dd01788c0ab111a24818b):

- the service: gRPC over a Unix domain socket, `nvhcd.HealthCheckService/RunHealthCheck`, request
  `HealthCheckRequest {repeated string args = 1}`, response `HealthCheckResponse {bool success = 1;
  int32 exit_code = 2; string output = 3; string error = 4}`
  (src/nvidia_resiliency_ext/shared_utils/proto/nvhcd.proto);
- the contract (docs/source/fault_tolerance/usage_guide.rst, "Node health check service",
  "Compatible service contract"): NVRx calls with args=["--no-slurm"]; a healthy node answers
  success=true with JSON `{"fail_count": 0}` in output; success=false, a nonzero fail_count, or
  an output without fail_count marks the node unhealthy; a missing socket or a connectivity
  error means "unavailable" and NVRx skips the check;
- the client that reads it: `NodeHealthCheck._perform_health_check` in
  src/nvidia_resiliency_ext/shared_utils/health_check.py, which ft_launcher builds from
  `--ft-node-health-check-endpoint unix:///PATH` (src/nvidia_resiliency_ext/fault_tolerance/
  launcher.py).

The answer, from the same AnswerBoard the socket and /node serve (no store read per call):

- the node may run jobs: success=true, exit_code 0, output `{"fail_count": 0, "failed_checks":
  [], "screener": <the node answer>}`;
- it may not (burnin, suspect, quarantined, repair): success=false, exit_code 75 (the contract's
  hardware suspect), output with fail_count 1 and failed_checks ["screener.io/state=<state>"],
  error the one-line why;
- the daemon has not started, or its loop has stopped making progress: the gRPC status
  UNAVAILABLE, which NVRx takes as "the service is unavailable" (it skips the check), the same
  as a missing socket: screener does not know, so it does not claim either way.

The request's args are read (bounded) and ignored: the answer is the daemon's, not a script run
per call. The messages are encoded here by hand (four fields of the published schema), so the
adapter needs grpcio only, not protobuf or NVRx's generated code; tests/test_nvrx_health.py
checks them against protobuf's own encoding of a schema built field by field from the published
one, and against NVRx's client logic.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent import futures
from typing import Any, Optional

from screener._optional import require
from screener.agent.health_answer import SOCKET_MODE, AnswerBoard
from screener.errors import ConfigError
from screener.types import ExitCode

require("grpc", "the NVRx node health check adapter (nvrx_socket)")
import grpc  # noqa: E402 - after require, which names the extra when grpcio is missing

log = logging.getLogger("screener.nvrx_health")

SERVICE = "nvhcd.HealthCheckService"
METHOD = "RunHealthCheck"
MAX_REQUEST_BYTES = 4096  # a list of a few arguments; more is not NVRx asking


# --- the protobuf wire format, for the two messages (proto3: default values are not sent) -----

def _varint(n: int) -> bytes:
    if n < 0:  # an int32 below zero is sent as its 64-bit two's complement
        n += 1 << 64
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def decode_request(data: bytes) -> list[str]:
    """HealthCheckRequest's args (field 1, repeated string); unknown fields are skipped, as
    protobuf does. ValueError for what is not such a message."""
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError(f"request over {MAX_REQUEST_BYTES} bytes")
    args: list[str] = []
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _read_varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            size, i = _read_varint(data, i)
            if i + size > len(data):
                raise ValueError("truncated field")
            if field == 1:
                args.append(data[i:i + size].decode("utf-8"))
            i += size
        else:
            raise ValueError(f"wire type {wire} in a HealthCheckRequest")
        if i > len(data):
            raise ValueError("truncated field")
    return args


def encode_response(success: bool, exit_code: int, output: str, error: str) -> bytes:
    """HealthCheckResponse {success = 1, exit_code = 2, output = 3, error = 4}."""
    out = bytearray()
    if success:
        out += b"\x08\x01"
    if exit_code:
        out += b"\x10" + _varint(exit_code)
    for tag, text in ((0x1A, output), (0x22, error)):
        if text:
            raw = text.encode("utf-8")
            out += bytes([tag]) + _varint(len(raw)) + raw
    return bytes(out)


def respond(board: AnswerBoard) -> Optional[tuple[bool, int, str, str]]:
    """(success, exit_code, output, error) for the board's answer now; None: unavailable."""
    body = board.body()
    # Evidence waiting to be decided (a first start while the API is out of reach) is a known
    # "no", not an unknown: NVRx skips an unavailable service and would start the ranks.
    held = bool(body.get("waiting")) and not body["may_run_jobs"] and body["daemon"]["alive"]
    if not held and (not body["daemon"]["started"] or not body["daemon"]["alive"]
                     or body["state"] is None):
        return None
    ok = bool(body["may_run_jobs"])
    check = "screener.io/waiting" if held else f"screener.io/state={body['state']}"
    output = json.dumps({"fail_count": 0 if ok else 1,
                         "failed_checks": [] if ok else [check],
                         "screener": body}, separators=(",", ":"), sort_keys=True)
    if ok:
        return True, 0, output, ""
    return False, int(ExitCode.HARDWARE_SUSPECT), output, str(body["why"])


class NvhcdServer:
    """The nvhcd gRPC service on a Unix socket at `path`, answering from `board`.

    Bounds: at most `max_concurrent` calls at once (more are refused RESOURCE_EXHAUSTED by
    gRPC itself), requests of at most MAX_REQUEST_BYTES, idle connections closed after
    `idle_s`; the handler only renders the board, so a call takes microseconds. gRPC's own
    threads serve it, never the daemon's loop. gRPC replaces a stale socket file at `path`
    when it binds; the socket is then made 0660 (health_answer.SOCKET_MODE, for the same
    reasons).
    """

    def __init__(self, board: AnswerBoard, path: str, *, max_concurrent: int = 16,
                 idle_s: float = 30.0) -> None:
        self.board = board
        self.path = path
        self.max_concurrent = max_concurrent
        self.idle_s = idle_s
        self._server: Any = None

    def _call(self, request: bytes, context: Any) -> bytes:
        try:
            decode_request(request)
        except (ValueError, UnicodeDecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a HealthCheckRequest: {e}")
        answer = respond(self.board)
        if answer is None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "the screener daemon does not know the node's state yet, or its loop "
                          "is not making progress")
        assert answer is not None
        return encode_response(*answer)

    def start(self) -> "NvhcdServer":
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            METHOD: grpc.unary_unary_rpc_method_handler(
                self._call, request_deserializer=None, response_serializer=None)})
        options = [("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                   ("grpc.max_connection_idle_ms", int(self.idle_s * 1000))]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="nvhcd"),
                             handlers=(handler,), options=options,
                             maximum_concurrent_rpcs=self.max_concurrent)
        try:
            port = server.add_insecure_port(f"unix:{self.path}")
        except RuntimeError as e:
            raise ConfigError(f"cannot serve the NVRx health check on {self.path} "
                              f"(nvrx_socket): {e}") from e
        if not port:
            raise ConfigError(f"cannot serve the NVRx health check on {self.path} (nvrx_socket)")
        server.start()
        try:
            os.chmod(self.path, SOCKET_MODE)
        except OSError as e:
            server.stop(None)
            raise ConfigError(f"cannot set the mode of {self.path} (nvrx_socket): "
                              f"{e.strerror or e}") from e
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0).wait(2.0)
            self._server = None
