"""SageMaker HyperPod remediation.

Every SageMaker call goes through botocore's Stubber on a real client, which checks each request
and response against the installed SageMaker service model. The Stubber answers before botocore's
retry handler runs, so throttling-then-success is tested with a real client against a local HTTP
endpoint that speaks SageMaker's JSON 1.1 protocol.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from botocore.stub import Stubber
from click.testing import CliRunner

from screener.remediation import hyperpod as hp
from screener.cli import main
from screener.commands.context import AppContext
from screener.errors import BadInputError, ConfigError, ExternalServiceError
from screener.lifecycle.records import Transition
from screener.stores.local import LocalStore
from screener.types import NodeState

CLUSTER = "ml-cluster"
ARN = "arn:aws:sagemaker:us-west-2:123456789012:cluster/abcdefghijkl"
LAUNCH = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)
IDS = [f"i-0{n:016x}" for n in range(1, 40)]  # i- plus 17 hex digits


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    # Credentials and a region for a real client; no user AWS configuration is read.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def client():
    c = hp.make_client("us-west-2")
    with Stubber(c) as stub:
        c.stub = stub
        yield c
        stub.assert_no_pending_responses()


def details(iid, group="workers", status="Running", labels=None, host=None):
    d = {"InstanceGroupName": group, "InstanceId": iid, "InstanceType": "ml.p5.48xlarge",
         "InstanceStatus": {"Status": status}, "LaunchTime": LAUNCH,
         "PrivateDnsHostname": host or f"ip-10-0-0-{IDS.index(iid) + 1}.us-west-2.compute.internal"}
    if labels is not None:
        d["KubernetesConfig"] = {"CurrentLabels": labels}
    return {"NodeDetails": d}


def expect_describe(c, iid, **kw):
    c.stub.add_response("describe_cluster_node", details(iid, **kw),
                        {"ClusterName": CLUSTER, "NodeId": iid})


def summary(iid, group="workers"):
    return {"InstanceGroupName": group, "InstanceId": iid, "InstanceType": "ml.p5.48xlarge",
            "LaunchTime": LAUNCH, "InstanceStatus": {"Status": "Running"},
            "PrivateDnsHostname": f"ip-10-0-0-{IDS.index(iid) + 1}.us-west-2.compute.internal"}


def invoke(args, **fakes):
    """The CLI in this process, with fakes (the stubbed client, a store, clocks) in its context."""
    return CliRunner().invoke(main, args, obj=AppContext(**fakes))


# --- node <-> instance ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,iid", [
    ("hyperpod-i-0123456789abcdef0", "i-0123456789abcdef0"),
    ("aws:///us-west-2a/i-0123456789abcdef0", "i-0123456789abcdef0"),
    ("i-0123456789abcdef0", "i-0123456789abcdef0"),
    ("i-01234567", "i-01234567"),
    ("ip-10-1-2-3.ec2.internal", None),
    ("gpu-node-7", None),
    ("hyperpod-i-0123456789ABCDEF0", None),
    ("hyperpod-i-0123", None),
])
def test_instance_id_of(name, iid):
    assert hp.instance_id_of(name) == iid


def test_hostname_resolved_through_every_page(client):
    client.stub.add_response("list_cluster_nodes",
                             {"ClusterNodeSummaries": [summary(IDS[0]), summary(IDS[1])],
                              "NextToken": "page-2"}, {"ClusterName": CLUSTER})
    client.stub.add_response("list_cluster_nodes",
                             {"ClusterNodeSummaries": [summary(IDS[2], group="spares")]},
                             {"ClusterName": CLUSTER, "NextToken": "page-2"})
    expect_describe(client, IDS[2], group="spares")
    expect_describe(client, IDS[0])
    nodes = hp.resolve_nodes(client, CLUSTER, ["ip-10-0-0-3", "hyperpod-" + IDS[0]])
    assert [(n.node, n.instance_id, n.instance_group) for n in nodes] == [
        ("ip-10-0-0-3", IDS[2], "spares"), ("hyperpod-" + IDS[0], IDS[0], "workers")]


def test_node_of_another_cluster_is_not_hyperpod(client):
    client.stub.add_client_error("describe_cluster_node", "ResourceNotFound", "Node not found",
                                 http_status_code=400,
                                 expected_params={"ClusterName": CLUSTER, "NodeId": IDS[5]})
    with pytest.raises(hp.NotHyperPodNode, match=f"'hyperpod-{IDS[5]}' .* not an instance of HyperPod "
                                                 f"cluster {CLUSTER}"):
        hp.resolve_nodes(client, CLUSTER, ["hyperpod-" + IDS[5]])


def test_unknown_hostname_is_not_hyperpod(client):
    client.stub.add_response("list_cluster_nodes", {"ClusterNodeSummaries": [summary(IDS[0])]},
                             {"ClusterName": CLUSTER})
    with pytest.raises(hp.NotHyperPodNode, match="no node has that private DNS hostname"):
        hp.resolve_nodes(client, CLUSTER, ["ip-10-9-9-9.ec2.internal"])


def test_non_hyperpod_node_is_one_line_and_exit_2(tmp_path):
    env_cmd = [sys.executable, "-m", "screener.cli", "hyperpod", "replace", "gpu-node-7",
               "--cluster", CLUSTER, "--region", "us-west-2", "--db", str(tmp_path / "s.db")]
    r = subprocess.run(env_cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "'gpu-node-7' is not a HyperPod instance" in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


# --- deep health check ------------------------------------------------------------------------------

def test_check_groups_by_instance_group_and_waits(client):
    a, b, c = IDS[0], IDS[1], IDS[2]
    expect_describe(client, a, group="workers")
    expect_describe(client, b, group="spares")
    expect_describe(client, c, group="workers")
    client.stub.add_response(
        "start_cluster_health_check", {"ClusterArn": ARN},
        {"ClusterName": CLUSTER, "DeepHealthCheckConfigurations": [
            {"InstanceGroupName": "workers", "InstanceIds": [a, c],
             "DeepHealthChecks": ["InstanceStress"]},
            {"InstanceGroupName": "spares", "InstanceIds": [b], "DeepHealthChecks": ["InstanceStress"]}]})
    # Poll 1: a has not started yet (and still carries an old Passed label), b and c run.
    old = {hp.LABEL_DEEP_HEALTH: "Passed"}
    expect_describe(client, a, labels=old)
    expect_describe(client, b, group="spares", status=hp.STATUS_IN_PROGRESS)
    expect_describe(client, c, status=hp.STATUS_IN_PROGRESS, labels={hp.LABEL_DEEP_HEALTH: "InProgress"})
    # Poll 2: a runs; b passed; c failed and awaits replacement.
    expect_describe(client, a, status=hp.STATUS_IN_PROGRESS)
    expect_describe(client, b, group="spares", labels={hp.LABEL_DEEP_HEALTH: "Passed"})
    expect_describe(client, c, labels={hp.LABEL_DEEP_HEALTH: "Failed",
                                       hp.LABEL_NODE_HEALTH: "UnschedulablePendingReplacement"})
    # Poll 3: a passed.
    expect_describe(client, a, labels={hp.LABEL_DEEP_HEALTH: "Passed"})
    sleeps = []
    r = invoke(["hyperpod", "check", "hyperpod-" + a, "hyperpod-" + b, c, "--cluster", CLUSTER,
                "--checks", "InstanceStress", "--wait", "--poll", "10", "--json"],
               sagemaker=client, sleep=sleeps.append, monotonic=lambda: 0.0)
    assert r.exit_code == 75, r.output
    doc = json.loads(r.stdout)
    assert doc["start"]["cluster_arn"] == ARN and doc["start"]["dry_run"] is False
    assert [(x["instance_id"], x["outcome"]) for x in doc["results"]] == [
        (a, "passed"), (b, "passed"), (c, "failed")]
    assert "UnschedulablePendingReplacement" in doc["results"][2]["detail"]
    assert sleeps == [10.0, 10.0]


def test_check_not_started_and_timeout_are_inconclusive(client):
    a, b = IDS[0], IDS[1]
    expect_describe(client, a)
    expect_describe(client, b)
    client.stub.add_response("start_cluster_health_check", {"ClusterArn": ARN}, {
        "ClusterName": CLUSTER, "DeepHealthCheckConfigurations": [
            {"InstanceGroupName": "workers", "InstanceIds": [a, b],
             "DeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]}]})
    expect_describe(client, a)  # t=0: not started
    expect_describe(client, b, status=hp.STATUS_IN_PROGRESS)
    expect_describe(client, a)  # t=60: still not, past the grace
    expect_describe(client, b, status=hp.STATUS_IN_PROGRESS)
    expect_describe(client, b, status=hp.STATUS_IN_PROGRESS)  # t=120: past the timeout
    t = [0.0]

    def sleep(s):
        t[0] += s

    nodes = hp.resolve_nodes(client, CLUSTER, [a, b])
    hp.start_health_check(client, nodes)
    res = hp.wait_for_health_check(client, nodes, poll_seconds=60, timeout_seconds=100,
                                   start_grace_seconds=50, clock=lambda: t[0], sleep=sleep)
    assert [r.outcome for r in res] == ["not_started", "timeout"]


def test_check_dry_run_makes_no_call_beyond_reads(client):
    expect_describe(client, IDS[0])
    r = invoke(["hyperpod", "check", IDS[0], "--cluster", CLUSTER, "--dry-run"], sagemaker=client)
    assert r.exit_code == 0, r.output
    assert "would start" in r.stdout and IDS[0] in r.stdout


def test_access_denied_names_the_iam_action(client):
    expect_describe(client, IDS[0])
    client.stub.add_client_error(
        "start_cluster_health_check", "AccessDeniedException",
        "User: arn:aws:sts::123456789012:assumed-role/ops/me is not authorized to perform: "
        "sagemaker:StartClusterHealthCheck", http_status_code=400)
    r = invoke(["hyperpod", "check", IDS[0], "--cluster", CLUSTER], sagemaker=client)
    assert isinstance(r.exception, hp.AccessDenied)
    assert "lacks the IAM action sagemaker:StartClusterHealthCheck" in str(r.exception)
    assert r.exception.exit_code == 1


def test_unknown_check_is_bad_input():
    with pytest.raises(BadInputError, match="unknown deep health check 'DCGM'"):
        hp.health_check_configurations([], ["DCGM"])


def test_on_quarantine_is_off_by_default_and_checks_when_on(client):
    assert hp.on_quarantine(client, hp.HyperPodConfig(cluster=CLUSTER), "hyperpod-" + IDS[3]) is None
    expect_describe(client, IDS[3], group="workers")
    client.stub.add_response("start_cluster_health_check", {"ClusterArn": ARN}, {
        "ClusterName": CLUSTER, "DeepHealthCheckConfigurations": [
            {"InstanceGroupName": "workers", "InstanceIds": [IDS[3]],
             "DeepHealthChecks": ["InstanceStress"]}]})
    cfg = hp.HyperPodConfig.from_mapping({"cluster": CLUSTER, "deep_check_on_quarantine": True,
                                          "checks": ["InstanceStress"]})
    started = hp.on_quarantine(client, cfg, "hyperpod-" + IDS[3])
    assert started is not None and started.cluster_arn == ARN
    with pytest.raises(ConfigError, match=r"hyperpod config: unknown key\(s\) auto_replace"):
        hp.HyperPodConfig.from_mapping({"auto_replace": True})


# --- throttling, through botocore's real retry handler ----------------------------------------------

class _SageMakerEndpoint:
    """A local HTTP endpoint speaking SageMaker's JSON 1.1 protocol from a script of answers."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.requests.append((self.headers.get("X-Amz-Target"), json.loads(body or b"{}")))
                status, doc = outer.answers.pop(0)
                raw = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


THROTTLED = (400, {"__type": "ThrottlingException", "message": "Rate exceeded"})


def test_throttling_is_retried_then_succeeds():
    ok = (200, {"NodeDetails": {"InstanceGroupName": "workers", "InstanceId": IDS[0],
                                "InstanceStatus": {"Status": "Running"}, "LaunchTime": 1735689600}})
    with _SageMakerEndpoint([THROTTLED, ok]) as ep:
        c = hp.make_client("us-west-2", endpoint_url=ep.url, max_attempts=3)
        [node] = hp.resolve_nodes(c, CLUSTER, ["hyperpod-" + IDS[0]])
    assert node.instance_group == "workers" and node.status == "Running"
    assert [t for t, _ in ep.requests] == ["SageMaker.DescribeClusterNode"] * 2
    assert ep.requests[0][1] == {"ClusterName": CLUSTER, "NodeId": IDS[0]}


def test_throttling_that_does_not_stop_is_our_failure():
    with _SageMakerEndpoint([THROTTLED, THROTTLED]) as ep:
        c = hp.make_client("us-west-2", endpoint_url=ep.url, max_attempts=2)
        with pytest.raises(ExternalServiceError, match="still throttled after retries") as e:
            hp.resolve_nodes(c, CLUSTER, [IDS[0]])
    assert len(ep.requests) == 2 and e.value.exit_code == 1


# --- reboot -------------------------------------------------------------------------------------------

def test_reboot_dry_run_makes_no_mutating_call(client):
    expect_describe(client, IDS[0])
    # No BatchRebootClusterNodes response is queued: the Stubber would fail on any such call.
    r = invoke(["hyperpod", "reboot", "hyperpod-" + IDS[0], "--cluster", CLUSTER, "--json"],
               sagemaker=client)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["dry_run"] is True and doc["successful"] == [] and doc["nodes"][0]["instance_id"] == IDS[0]


def test_reboot_in_batches_of_25_and_reports_refusals(client):
    ids = IDS[:27]
    for iid in ids:
        expect_describe(client, iid)
    client.stub.add_response("batch_reboot_cluster_nodes", {"Successful": ids[:25]},
                             {"ClusterName": CLUSTER, "NodeIds": ids[:25]})
    client.stub.add_response("batch_reboot_cluster_nodes", {
        "Successful": [ids[25]], "Failed": [{"NodeId": ids[26], "ErrorCode": "InvalidInstanceStatus",
                                             "Message": "node is rebooting"}]},
        {"ClusterName": CLUSTER, "NodeIds": ids[25:]})
    r = invoke(["hyperpod", "reboot", *ids, "--cluster", CLUSTER, "--yes"], sagemaker=client)
    assert r.exit_code == 1, r.output
    assert f"refused: {ids[26]}: InvalidInstanceStatus: node is rebooting" in r.stdout
    assert r.stdout.count("accepted: ") == 26


# --- replace ------------------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    s = LocalStore(tmp_path / "screener.db")
    yield s
    s.close()


def put(store, node, *states, t=1000.0):
    prev = store.get_state(node)
    for i, st in enumerate(states):
        store.record(Transition(node=node, time=t + i, from_state=prev, to_state=st, reason="test"))
        prev = st


def fleet(store, n, quarantined=(), repair=()):
    for i in range(n):
        name = "hyperpod-" + IDS[i]
        if i in quarantined:
            put(store, name, NodeState.BURNIN, NodeState.HEALTHY, NodeState.QUARANTINED)
        elif i in repair:
            put(store, name, NodeState.BURNIN, NodeState.REPAIR)
        else:
            put(store, name, NodeState.BURNIN, NodeState.HEALTHY)


def test_replace_refuses_a_node_in_service(client, store):
    fleet(store, 10)
    expect_describe(client, IDS[4])
    r = invoke(["hyperpod", "replace", "hyperpod-" + IDS[4], "--cluster", CLUSTER, "--yes"],
               sagemaker=client, store=store)
    assert isinstance(r.exception, hp.ReplaceRefused) and r.exception.exit_code == 2
    assert "its state is healthy, not quarantined or repair" in str(r.exception)


def test_replace_refuses_a_node_screener_never_saw(client, store):
    expect_describe(client, IDS[4])
    r = invoke(["hyperpod", "replace", IDS[4], "--cluster", CLUSTER, "--yes"],
               sagemaker=client, store=store)
    assert isinstance(r.exception, hp.ReplaceRefused)
    assert "unknown to screener" in str(r.exception)


def test_replace_refuses_more_than_the_budget(client, store):
    fleet(store, 20, quarantined=(0, 1), repair=(2,))  # budget: 10% of 20 = 2
    for i in range(3):
        expect_describe(client, IDS[i])
    r = invoke(["hyperpod", "replace", *("hyperpod-" + IDS[i] for i in range(3)), "--cluster", CLUSTER,
                "--yes"], sagemaker=client, store=store)
    assert isinstance(r.exception, hp.ReplaceRefused)
    assert "replace 3 nodes at once: the quarantine budget allows 2" in str(r.exception)


def test_replace_is_capped_by_the_configured_budget_not_the_default(client, store, tmp_path):
    """Issue 37: the cap was the default 10 % whatever the daemons' config said. With
    quarantine_budget = 0.2 in the file, 4 of 20 may go at once; with 0.05, only 1."""
    fleet(store, 20, quarantined=(0, 1, 2), repair=(3,))
    wide = tmp_path / "wide.toml"
    wide.write_text("[lifecycle]\nquarantine_budget = 0.2\n")
    for i in range(3):
        expect_describe(client, IDS[i])
    r = invoke(["hyperpod", "replace", *("hyperpod-" + IDS[i] for i in range(3)), "--cluster",
                CLUSTER, "--config", str(wide), "--json"], sagemaker=client, store=store)
    assert r.exception is None, r.output
    assert json.loads(r.output)["budget"] == 4
    narrow = tmp_path / "narrow.toml"
    narrow.write_text("[lifecycle]\nquarantine_budget = 0.05\n")
    for i in range(2):
        expect_describe(client, IDS[i])
    r = invoke(["hyperpod", "replace", *("hyperpod-" + IDS[i] for i in range(2)), "--cluster",
                CLUSTER, "--yes"], sagemaker=client, store=store,
               environ={"SCREENER_CONFIG": str(narrow)})
    assert isinstance(r.exception, hp.ReplaceRefused)
    assert "replace 2 nodes at once: the quarantine budget allows 1" in str(r.exception)


def test_replace_dry_run_then_for_real_records_history(client, store):
    fleet(store, 20, quarantined=(0,), repair=(2,))
    a, b = "hyperpod-" + IDS[0], "hyperpod-" + IDS[2]
    expect_describe(client, IDS[0])
    expect_describe(client, IDS[2])
    r = invoke(["hyperpod", "replace", a, IDS[2], "--cluster", CLUSTER], sagemaker=client,
               store=store)
    assert r.exit_code == 0, r.output
    assert "dry run: nothing was sent" in r.stdout
    assert store.get_state(a) == NodeState.QUARANTINED and len(store.history(a)) == 3

    expect_describe(client, IDS[0])
    expect_describe(client, IDS[2])
    client.stub.add_response("batch_replace_cluster_nodes", {"Successful": [IDS[0], IDS[2]]},
                             {"ClusterName": CLUSTER, "NodeIds": [IDS[0], IDS[2]]})
    r = invoke(["hyperpod", "replace", a, IDS[2], "--cluster", CLUSTER, "--yes", "--reason",
                "SDC confirmed by ring replay", "--json"], sagemaker=client, store=store,
               clock=lambda: 5000.0)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["recorded"] == [a, b] and doc["budget"] == 2
    for name, iid, before in ((a, IDS[0], NodeState.QUARANTINED), (b, IDS[2], NodeState.REPAIR)):
        last = store.history(name)[-1]
        assert (last.from_state, last.to_state, last.actor, last.code, last.time) == (
            before, NodeState.REPAIR, "human", "NodeReplaced", 5000.0)
        assert "SDC confirmed by ring replay" in last.reason and iid in last.reason
        assert last.evidence["hyperpod"]["instance_id"] == iid


def test_check_record_feeds_the_lifecycle(client, store):
    fleet(store, 5, quarantined=(0, 1))
    a, b = IDS[0], IDS[1]
    expect_describe(client, a)
    expect_describe(client, b)
    client.stub.add_response("start_cluster_health_check", {"ClusterArn": ARN}, {
        "ClusterName": CLUSTER, "DeepHealthCheckConfigurations": [
            {"InstanceGroupName": "workers", "InstanceIds": [a, b],
             "DeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]}]})
    expect_describe(client, a, status=hp.STATUS_IN_PROGRESS)
    expect_describe(client, b, status=hp.STATUS_IN_PROGRESS)
    expect_describe(client, a, labels={hp.LABEL_DEEP_HEALTH: "Passed"})
    expect_describe(client, b, status="Failure")
    r = invoke(["hyperpod", "check", a, b, "--cluster", CLUSTER, "--wait", "--record"],
               sagemaker=client, store=store, sleep=lambda s: None, clock=lambda: 9000.0,
               monotonic=lambda: 9000.0)
    assert r.exit_code == 75, r.output
    # Passed goes back through burn-in (never straight to healthy); failed goes to repair.
    assert store.get_state("hyperpod-" + a) == NodeState.BURNIN
    assert store.get_state("hyperpod-" + b) == NodeState.REPAIR
    assert "quarantined -> burnin" in r.stdout and "does not clear a node" in r.stdout
