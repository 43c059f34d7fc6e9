"""The NVRx adapter (screener.agent.nvrx_health) against NVRx's node health check protocol as
published in NVIDIA/nvidia-resiliency-ext at commit d8686d9c7015c39ce91dd01788c0ab111a24818b:

- the schema, src/nvidia_resiliency_ext/shared_utils/proto/nvhcd.proto: package nvhcd, service
  HealthCheckService, rpc RunHealthCheck(HealthCheckRequest) returns (HealthCheckResponse);
  HealthCheckRequest {repeated string args = 1}; HealthCheckResponse {bool success = 1;
  int32 exit_code = 2; string output = 3; string error = 4}. Built below field by field with
  protobuf's own descriptor API (not NVRx's file, not the adapter's codec), so protobuf encodes
  and decodes every message the test sends and reads;
- the contract, docs/source/fault_tolerance/usage_guide.rst ("Compatible service contract"):
  gRPC over a Unix socket, args=["--no-slurm"], success=true and {"fail_count": 0} for healthy;
- the client's reading, NodeHealthCheck._perform_health_check in
  src/nvidia_resiliency_ext/shared_utils/health_check.py, restated in `nvrx_says_healthy`: a
  channel to "unix://PATH", the stub's method path /nvhcd.HealthCheckService/RunHealthCheck,
  not success -> unhealthy, no fail_count or a nonzero one -> unhealthy, any gRPC error ->
  skipped (healthy).

The nvidia-resiliency-ext wheels this machine's registry serves (up to 0.4.1) predate the node
health check, so its own client class cannot be run here; the restatement is line for line.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("google.protobuf")

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # noqa: E402

from screener.agent.health_answer import AnswerBoard  # noqa: E402
from screener.agent.nvrx_health import (NvhcdServer, decode_request,  # noqa: E402
                                        encode_response)
from screener.types import NodeState  # noqa: E402

pytestmark = pytest.mark.timeout(60)

F = descriptor_pb2.FieldDescriptorProto


def _published_schema():
    """nvhcd.proto's two messages and its service, as protobuf message classes."""
    fd = descriptor_pb2.FileDescriptorProto(name="screener_test_nvhcd.proto", package="nvhcd",
                                            syntax="proto3")
    req = fd.message_type.add(name="HealthCheckRequest")
    req.field.add(name="args", number=1, type=F.TYPE_STRING, label=F.LABEL_REPEATED)
    resp = fd.message_type.add(name="HealthCheckResponse")
    for name, number, kind in (("success", 1, F.TYPE_BOOL), ("exit_code", 2, F.TYPE_INT32),
                               ("output", 3, F.TYPE_STRING), ("error", 4, F.TYPE_STRING)):
        resp.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
    svc = fd.service.add(name="HealthCheckService")
    svc.method.add(name="RunHealthCheck", input_type=".nvhcd.HealthCheckRequest",
                   output_type=".nvhcd.HealthCheckResponse")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    get = message_factory.GetMessageClass
    return (get(pool.FindMessageTypeByName("nvhcd.HealthCheckRequest")),
            get(pool.FindMessageTypeByName("nvhcd.HealthCheckResponse")),
            pool.FindServiceByName("nvhcd.HealthCheckService"))


Request, Response, SERVICE = _published_schema()


def _call(path: str, args=("--no-slurm",), timeout=5.0):
    """What the generated stub does: a unary call on /<service>/<method> over "unix://PATH"."""
    method = SERVICE.FindMethodByName("RunHealthCheck")
    with grpc.insecure_channel(f"unix://{path}") as channel:
        rpc = channel.unary_unary(f"/{SERVICE.full_name}/{method.name}",
                                  request_serializer=Request.SerializeToString,
                                  response_deserializer=Response.FromString)
        return rpc(Request(args=list(args)), timeout=timeout)


def nvrx_says_healthy(path: str) -> bool:
    """NodeHealthCheck._perform_health_check's reading of the service (see the docstring)."""
    try:
        response = _call(path)
        if not response.success:
            return False
        result = json.loads(response.output)
        fail_count = result.get("fail_count")
        if fail_count is None:
            return False
        if fail_count != 0:
            return False
        return True
    except json.JSONDecodeError:
        return False
    except Exception:  # noqa: BLE001 - NVRx: a connectivity error skips the check
        return True


@pytest.fixture
def served():
    d = tempfile.mkdtemp(prefix="nv-", dir="/tmp")
    board = AnswerBoard("gpu-7")
    path = str(Path(d) / "nvhcd.sock")
    server = NvhcdServer(board, path).start()
    yield board, path
    server.stop()
    shutil.rmtree(d, ignore_errors=True)


def test_a_healthy_node_answers_success_and_fail_count_zero(served):
    board, path = served
    board.update(state=NodeState.HEALTHY, started=True,
                 moved={"time": 1.0, "reason": "full burn-in passed", "code": "BurninPassed"},
                 verdict={"time": 1.0, "outcome": "pass", "kind": "full"})
    response = _call(path)
    assert (response.success, response.exit_code, response.error) == (True, 0, "")
    output = json.loads(response.output)
    assert output["fail_count"] == 0 and output["failed_checks"] == []
    assert output["screener"]["state"] == "healthy"
    assert output["screener"]["last_screen"] == {"time": 1.0, "outcome": "pass", "kind": "full"}
    assert nvrx_says_healthy(path) is True


@pytest.mark.parametrize("state", [NodeState.SUSPECT, NodeState.QUARANTINED, NodeState.BURNIN,
                                   NodeState.REPAIR])
def test_a_node_that_may_not_run_jobs_is_an_explicit_failure(served, state):
    board, path = served
    board.update(state=state, started=True, moved={"time": 2.0, "reason": "an alarm"})
    response = _call(path)
    assert response.success is False and response.exit_code == 75
    output = json.loads(response.output)
    assert output["fail_count"] == 1
    assert output["failed_checks"] == [f"screener.io/state={state.value}"]
    said = f"in {state.value}" if state in (NodeState.BURNIN, NodeState.REPAIR) else state.value
    assert response.error.startswith(f"the node is {said}: an alarm")
    assert nvrx_says_healthy(path) is False


def test_a_daemon_that_does_not_know_is_unavailable_which_nvrx_skips(served):
    board, path = served
    with pytest.raises(grpc.RpcError) as e:  # not started: no state to claim either way
        _call(path)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert nvrx_says_healthy(path) is True
    board.update(state=NodeState.SUSPECT, started=True)
    board._alive = lambda: False  # a stuck loop: its answer may be stale
    with pytest.raises(grpc.RpcError) as e:
        _call(path)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_evidence_waiting_for_a_decision_is_an_explicit_failure_not_unavailable(served):
    """A first start while the API is out of reach: the state is unknown, but an alarm waits to be
    decided. UNAVAILABLE would let NVRx skip the check and start the ranks on the node."""
    board, path = served
    board.update(state=None, started=False,
                 waiting="1 alarm file (x.json), held until decided (the node's state is not known yet)")
    response = _call(path)
    assert response.success is False and response.exit_code == 75
    output = json.loads(response.output)
    assert output["fail_count"] == 1 and output["failed_checks"] == ["screener.io/waiting"]
    assert output["screener"]["waiting"].startswith("1 alarm file (x.json)")
    assert response.error.startswith("hardware evidence about the node waits to be decided")
    assert nvrx_says_healthy(path) is False
    board.update(state=None, started=False, waiting="")  # decided: back to "not known"
    with pytest.raises(grpc.RpcError) as e:
        _call(path)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_any_args_are_taken_and_an_oversized_request_is_refused(served):
    board, path = served
    board.update(state=NodeState.HEALTHY, started=True)
    assert _call(path, args=()).success and _call(path, args=("a", "b" * 100)).success
    with pytest.raises(grpc.RpcError) as e:
        _call(path, args=("x" * 10000,))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_codec_matches_protobufs_encoding_of_the_published_schema():
    for success, code, output, error in [(True, 0, '{"fail_count":0}', ""), (False, 75, "{}", "x"),
                                         (False, 0, "", ""), (True, -1, "é", "ü" * 300),
                                         (False, 2**31 - 1, "o" * 200, "")]:
        ours = encode_response(success, code, output, error)
        assert ours == Response(success=success, exit_code=code, output=output,
                                error=error).SerializeToString()
        back = Response.FromString(ours)
        assert (back.success, back.exit_code, back.output, back.error) == (success, code, output,
                                                                           error)
    for args in ([], ["--no-slurm"], ["a", "", "ü" * 200]):
        assert decode_request(Request(args=args).SerializeToString()) == args
    # Unknown fields (a later NVRx) are skipped, as protobuf does; garbage is refused.
    extra = Request(args=["--no-slurm"]).SerializeToString() + b"\x10\x05" + b"\x1a\x01z"
    assert decode_request(extra) == ["--no-slurm"]
    for bad in (b"\x0a\x05ab", b"\x0a", b"\x0f", b"\xff" * 12):
        with pytest.raises(ValueError):
            decode_request(bad)


def test_a_stale_socket_is_replaced_and_the_mode_is_0660(tmp_path):
    import os
    import socket
    import stat

    d = tempfile.mkdtemp(prefix="nv-", dir="/tmp")
    path = str(Path(d) / "nvhcd.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a killed daemon's socket: the file stays, nobody listens
    stale.close()
    board = AnswerBoard("gpu-7")
    board.update(state=NodeState.HEALTHY, started=True)
    server = NvhcdServer(board, path).start()
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o660
        assert _call(path).success
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)
