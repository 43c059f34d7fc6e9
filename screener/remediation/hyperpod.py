"""SageMaker HyperPod remediation: node to instance, deep health check, reboot and replace.

This is the only module of the package that imports boto3/botocore. Everything here takes the
SageMaker client as an argument (make_client builds one with botocore's standard retry mode, which
retries throttling and transient errors with backoff), and plain values or callables for what the
lifecycle knows (a node's state, the quarantine budget), so it does not depend on a store.

A Kubernetes node maps to a HyperPod instance through its name (`hyperpod-i-...`), its providerID
(`aws:///<zone>/i-...`), a bare instance ID, or its private DNS hostname (`ip-10-1-2-3...`), which is
matched against ListClusterNodes. Anything else is not a HyperPod instance: BadInputError, exit 2.

Nothing here mutates the cluster unless asked with dry_run=False; replacement is never automatic.
"""

from __future__ import annotations

import functools
import logging
import re
import time as _time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from screener._optional import require

require("boto3", "SageMaker HyperPod remediation")
import boto3
import botocore
import botocore.config
import botocore.exceptions

from screener.errors import BadInputError, ConfigError, ExternalServiceError
# The settings live in a module without boto3, so the daemon validates [hyperpod] at load.
from screener.settings.hyperpod import (DEEP_HEALTH_CHECKS, DEFAULT_CHECKS, HyperPodConfig,  # noqa: F401
                                      validate_checks as _validate_checks)
from screener.types import NodeState

# The name the daemon's JSON log lines have always carried (log queries filter on it), not the
# module's path since the move into subpackages.
log = logging.getLogger("screener.hyperpod")

# The EC2 instance ID pattern SageMaker's service model uses for ClusterNodeId.
_INSTANCE_ID = r"i-[0-9a-f]{8}(?:[0-9a-f]{9})?"
_NODE_NAME_RE = re.compile(rf"hyperpod-({_INSTANCE_ID})")
_PROVIDER_ID_RE = re.compile(rf"aws:///[^/]*/({_INSTANCE_ID})")
_BARE_ID_RE = re.compile(_INSTANCE_ID)
_HOSTNAME_RE = re.compile(r"ip-\d{1,3}-\d{1,3}-\d{1,3}-\d{1,3}(\..*)?")

BATCH_LIMIT = 25  # BatchReboot/BatchReplaceClusterNodes take at most 25 node IDs per request
HEALTH_CHECK_IDS_LIMIT = 500  # InstanceIds per instance group in StartClusterHealthCheck

# Kubernetes labels HyperPod puts on its nodes (reported back by DescribeClusterNode).
LABEL_DEEP_HEALTH = "sagemaker.amazonaws.com/deep-health-check-status"
LABEL_NODE_HEALTH = "sagemaker.amazonaws.com/node-health-status"

STATUS_IN_PROGRESS = "DeepHealthCheckInProgress"
# Instance statuses that mean HyperPod took the node down after the check (it failed and is being
# rebooted or replaced by automatic node recovery).
_FAILED_STATUSES = {"Failure", "ShuttingDown", "Pending", "NotFound"}
_FAILED_HEALTH = {"UnschedulablePendingReplacement", "UnschedulablePendingReboot"}

#: States from which a person may replace a node: the lifecycle already took it out of service.
REPLACEABLE_STATES = (NodeState.QUARANTINED, NodeState.REPAIR)


class NotHyperPodNode(BadInputError):
    """The node is not an instance of the HyperPod cluster (or no instance ID can be found in it)."""


class ReplaceRefused(BadInputError):
    """A replacement was refused: a node not out of service, or more nodes than the budget allows."""


class AccessDenied(ExternalServiceError):
    """SageMaker refused a call for lack of an IAM permission; the message names the IAM action."""


# --- configuration --------------------------------------------------------------------------------


def make_client(region: Optional[str] = None, *, endpoint_url: Optional[str] = None,
                profile: Optional[str] = None, max_attempts: int = 8) -> Any:
    """A boto3 SageMaker client with botocore's standard retry mode (throttling is retried)."""
    config = botocore.config.Config(retries={"mode": "standard", "total_max_attempts": max_attempts})
    try:
        session = _session(profile, region)
        return session.client("sagemaker", endpoint_url=endpoint_url, config=config)
    except botocore.exceptions.ProfileNotFound as e:
        raise BadInputError(f"AWS profile {profile!r} not found") from e
    except botocore.exceptions.NoRegionError as e:
        raise BadInputError("no AWS region: give --region or set AWS_REGION") from e
    except (botocore.exceptions.BotoCoreError, ValueError) as e:
        raise BadInputError(f"cannot build a SageMaker client: {e}") from e


@functools.lru_cache(maxsize=8)
def _session(profile: Optional[str], region: Optional[str]) -> Any:
    # One session per profile and region: its loader keeps the parsed SageMaker service model
    # (several MB of JSON), so a second client costs milliseconds instead of a second.
    return boto3.session.Session(profile_name=profile, region_name=region)


# --- calls and error mapping ----------------------------------------------------------------------

def _call(client: Any, operation: str, *, not_found: Optional[Exception] = None,
          **params: Any) -> dict[str, Any]:
    """Call one SageMaker operation (CamelCase name), wrapping vendor errors in ours.

    not_found, if given, is raised instead of the generic error when SageMaker answers
    ResourceNotFound.
    """
    method = getattr(client, _snake(operation), None)
    if method is None:
        raise ExternalServiceError(f"the installed botocore {botocore.__version__} has no SageMaker "
                                   f"{operation}: upgrade boto3/botocore to 1.43 or newer")
    try:
        return method(**params)
    except botocore.exceptions.ClientError as e:
        if not_found is not None and e.response.get("Error", {}).get("Code") == "ResourceNotFound":
            raise not_found from e
        raise _wrap_client_error(e, operation, params) from e
    except botocore.exceptions.ParamValidationError as e:
        raise BadInputError(f"SageMaker {operation}: {e}") from e
    except botocore.exceptions.NoCredentialsError as e:
        raise ExternalServiceError(f"SageMaker {operation}: no AWS credentials found") from e
    except botocore.exceptions.BotoCoreError as e:
        raise ExternalServiceError(f"SageMaker {operation} failed: {e}") from e


def _snake(operation: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", operation).lower()


def _wrap_client_error(e: Any, operation: str, params: Mapping[str, Any]) -> Exception:
    err = e.response.get("Error", {})
    code = str(err.get("Code", "Unknown"))
    msg = str(err.get("Message", "")).strip()
    where = f" on cluster {params['ClusterName']}" if "ClusterName" in params else ""
    if code in ("AccessDeniedException", "AccessDenied", "UnauthorizedOperation"):
        # SageMaker's IAM action names are the API operation names.
        return AccessDenied(f"SageMaker refused {operation}{where}: the caller lacks the IAM action "
                            f"sagemaker:{operation} ({code}: {msg})")
    if code == "ResourceNotFound":
        return BadInputError(f"SageMaker {operation}{where}: not found ({msg})")
    if code in ("ValidationException", "ValidationError"):
        return BadInputError(f"SageMaker {operation}{where} rejected the request: {msg}")
    if code in ("ThrottlingException", "Throttling", "TooManyRequestsException"):
        return ExternalServiceError(f"SageMaker {operation}{where} still throttled after retries: {msg}")
    return ExternalServiceError(f"SageMaker {operation}{where} failed: {code}: {msg}")


# --- node <-> instance ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ClusterNode:
    """A Kubernetes node resolved to its HyperPod instance, cluster and instance group."""

    node: str  # the name we were given
    instance_id: str
    cluster: str
    instance_group: str
    instance_type: str = ""
    status: str = ""
    message: str = ""
    hostname: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "instance_id": self.instance_id, "cluster": self.cluster,
                "instance_group": self.instance_group, "instance_type": self.instance_type,
                "status": self.status, "message": self.message, "hostname": self.hostname}


def instance_id_of(node: str) -> Optional[str]:
    """The EC2 instance ID in a node name, providerID or bare ID; None if it holds none.

    `hyperpod-i-...` (HyperPod EKS node names), `aws:///<zone>/i-...` (a node's providerID) and
    `i-...` are recognised. A private DNS hostname has no instance ID: resolve_nodes looks it up.
    """
    text = node.strip()
    for pattern in (_NODE_NAME_RE, _PROVIDER_ID_RE, _BARE_ID_RE):
        m = pattern.fullmatch(text)
        if m:
            return m.group(1) if pattern.groups else m.group(0)
    return None


def list_cluster_nodes(client: Any, cluster: str) -> list[dict[str, Any]]:
    """Every node summary of a cluster, following NextToken through all pages."""
    out: list[dict[str, Any]] = []
    params: dict[str, Any] = {"ClusterName": cluster}
    missing = BadInputError(f"HyperPod cluster {cluster!r} not found")
    while True:
        page = _call(client, "ListClusterNodes", not_found=missing, **params)
        out.extend(page.get("ClusterNodeSummaries", []))
        token = page.get("NextToken")
        if not token:
            return out
        params["NextToken"] = token


def describe_cluster_node(client: Any, cluster: str, instance_id: str,
                          node: Optional[str] = None) -> dict[str, Any]:
    """DescribeClusterNode's NodeDetails for one instance (NotHyperPodNode if the cluster lacks it)."""
    who = f"node {node!r} ({instance_id})" if node and node != instance_id else f"instance {instance_id}"
    missing = NotHyperPodNode(f"{who} is not an instance of HyperPod cluster {cluster}")
    return _call(client, "DescribeClusterNode", not_found=missing, ClusterName=cluster,
                 NodeId=instance_id)["NodeDetails"]


def _from_details(node: str, cluster: str, d: Mapping[str, Any]) -> ClusterNode:
    status = d.get("InstanceStatus") or {}
    kube = d.get("KubernetesConfig") or {}
    return ClusterNode(node=node, instance_id=str(d.get("InstanceId", "")), cluster=cluster,
                       instance_group=str(d.get("InstanceGroupName", "")),
                       instance_type=str(d.get("InstanceType", "")),
                       status=str(status.get("Status", "")), message=str(status.get("Message", "")),
                       hostname=str(d.get("PrivateDnsHostname", "")),
                       labels=dict(kube.get("CurrentLabels") or {}))


def resolve_nodes(client: Any, cluster: str, nodes: Sequence[str]) -> list[ClusterNode]:
    """Resolve node names to HyperPod instances of `cluster`, in the order given.

    Names that hold no instance ID and do not look like a private DNS hostname are refused before
    any call. Instance IDs are described directly (DescribeClusterNode); hostnames are matched
    against one paginated ListClusterNodes. A node the cluster does not know is NotHyperPodNode.
    """
    if not nodes:
        raise BadInputError("no node given")
    if not cluster:
        raise BadInputError("no HyperPod cluster given: use --cluster NAME or SCREENER_HYPERPOD_CLUSTER")
    ids: dict[str, Optional[str]] = {}
    for name in nodes:
        iid = instance_id_of(name)
        if iid is None and not _HOSTNAME_RE.fullmatch(name.strip()):
            raise NotHyperPodNode(
                f"node {name!r} is not a HyperPod instance: no instance ID in its name (expected "
                "hyperpod-i-..., aws:///<zone>/i-..., i-... or an ip-... private DNS hostname)")
        ids[name] = iid
    summaries: Optional[list[dict[str, Any]]] = None
    out = []
    for name in nodes:
        iid = ids[name]
        if iid is None:
            if summaries is None:
                summaries = list_cluster_nodes(client, cluster)
            iid = _match_hostname(name.strip(), summaries)
            if iid is None:
                raise NotHyperPodNode(f"node {name!r} is not an instance of HyperPod cluster "
                                      f"{cluster} (no node has that private DNS hostname)")
        details = describe_cluster_node(client, cluster, iid, node=name)
        out.append(_from_details(name, cluster, details))
    return out


def _match_hostname(name: str, summaries: Iterable[Mapping[str, Any]]) -> Optional[str]:
    short = name.split(".", 1)[0]
    for s in summaries:
        host = str(s.get("PrivateDnsHostname") or "")
        if host and (host == name or host.split(".", 1)[0] == short):
            return str(s["InstanceId"])
    return None


# --- deep health check ----------------------------------------------------------------------------

@dataclass(frozen=True)
class HealthCheckStart:
    """What StartClusterHealthCheck was (or, in a dry run, would be) asked to do."""

    cluster: str
    configurations: tuple[Mapping[str, Any], ...]
    dry_run: bool
    cluster_arn: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "cluster_arn": self.cluster_arn, "dry_run": self.dry_run,
                "configurations": [dict(c) for c in self.configurations]}


def one_cluster(nodes: Sequence[ClusterNode]) -> str:
    """The one cluster every node belongs to: a request to HyperPod names a single cluster, so
    nodes of several (or none) are refused before any call."""
    if not nodes:
        raise BadInputError("no node given")
    clusters = {n.cluster for n in nodes}
    if len(clusters) != 1:
        raise BadInputError(f"nodes span several clusters: {', '.join(sorted(clusters))}")
    return nodes[0].cluster


def health_check_configurations(nodes: Sequence[ClusterNode],
                                checks: Sequence[str]) -> list[dict[str, Any]]:
    """DeepHealthCheckConfigurations: one entry per instance group (chunked at the API's limit)."""
    checks = list(_validate_checks(checks))
    groups: dict[str, list[str]] = {}
    for n in nodes:
        ids = groups.setdefault(n.instance_group, [])
        if n.instance_id not in ids:
            ids.append(n.instance_id)
    out = []
    for group, ids in groups.items():
        for i in range(0, len(ids), HEALTH_CHECK_IDS_LIMIT):
            out.append({"InstanceGroupName": group, "InstanceIds": ids[i:i + HEALTH_CHECK_IDS_LIMIT],
                        "DeepHealthChecks": list(checks)})
    return out


def start_health_check(client: Any, nodes: Sequence[ClusterNode],
                       checks: Sequence[str] = DEFAULT_CHECKS, *,
                       dry_run: bool = False) -> HealthCheckStart:
    """Start a deep health check on resolved nodes, grouped by instance group (all one cluster).

    While it runs, HyperPod takes the nodes out of scheduling; nodes that fail it are rebooted or
    replaced by HyperPod's own automatic node recovery if the cluster has it enabled.
    """
    cluster = one_cluster(nodes)
    configs = health_check_configurations(nodes, checks)
    if dry_run:
        return HealthCheckStart(cluster, tuple(configs), dry_run=True)
    resp = _call(client, "StartClusterHealthCheck", ClusterName=cluster,
                 DeepHealthCheckConfigurations=configs)
    log.info("started deep health check %s on %s", ",".join(checks),
             ", ".join(n.instance_id for n in nodes))
    return HealthCheckStart(cluster, tuple(configs), dry_run=False,
                            cluster_arn=str(resp.get("ClusterArn", "")))


def start_deep_health_check(client: Any, node: str, cluster: str,
                            checks: Sequence[str] = DEFAULT_CHECKS, *,
                            dry_run: bool = False) -> HealthCheckStart:
    """Resolve one Kubernetes node and start a deep health check on it (the daemon's entry point)."""
    return start_health_check(client, resolve_nodes(client, cluster, [node]), checks, dry_run=dry_run)


def on_quarantine(client: Any, config: HyperPodConfig, node: str) -> Optional[HealthCheckStart]:
    """What the daemon calls when a node enters quarantine: a deep health check if configured.

    Returns None when config.deep_check_on_quarantine is off (the default). Never replaces a node.
    """
    if not config.deep_check_on_quarantine:
        return None
    if not config.cluster:
        raise ConfigError("hyperpod deep_check_on_quarantine is on but no cluster is configured")
    return start_deep_health_check(client, node, config.cluster, config.checks)


@dataclass(frozen=True)
class HealthCheckResult:
    """How a deep health check ended on one node, as DescribeClusterNode reports it."""

    node: ClusterNode
    outcome: str  # "passed", "failed", "timeout" or "not_started"
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**self.node.to_dict(), "outcome": self.outcome, "detail": self.detail}


def _in_progress(n: ClusterNode) -> bool:
    return n.status == STATUS_IN_PROGRESS or n.labels.get(LABEL_DEEP_HEALTH) == "InProgress"


def _finished_outcome(n: ClusterNode) -> tuple[str, str]:
    label = n.labels.get(LABEL_DEEP_HEALTH, "")
    health = n.labels.get(LABEL_NODE_HEALTH, "")
    if label == "Failed" or n.status in _FAILED_STATUSES or health in _FAILED_HEALTH:
        detail = ", ".join(x for x in (f"status {n.status}" if n.status else "",
                                       f"{LABEL_DEEP_HEALTH}={label}" if label else "",
                                       f"{LABEL_NODE_HEALTH}={health}" if health else "",
                                       n.message) if x)
        return "failed", detail
    return "passed", f"status {n.status}" + (f", {LABEL_DEEP_HEALTH}={label}" if label else "")


def wait_for_health_check(client: Any, nodes: Sequence[ClusterNode], *,
                          poll_seconds: float = 30.0, timeout_seconds: float = 4 * 3600.0,
                          start_grace_seconds: float = 600.0,
                          clock: Callable[[], float] = _time.monotonic,
                          sleep: Callable[[float], None] = _time.sleep) -> list[HealthCheckResult]:
    """Poll DescribeClusterNode until the deep health check has ended on every node.

    A node counts as done only after it was seen in progress and is no more, because the
    deep-health-check-status label of an earlier check may still read Passed before this one starts.
    A node never seen in progress within start_grace_seconds is "not_started"; past timeout_seconds,
    "timeout". A passed check is triage, not proof: it does not clear a node.
    """
    start = clock()
    seen: dict[str, bool] = {n.instance_id: False for n in nodes}
    current: dict[str, ClusterNode] = {n.instance_id: n for n in nodes}
    results: dict[str, HealthCheckResult] = {}
    while True:
        for iid, prev in current.items():
            if iid in results:
                continue
            now_node = _from_details(prev.node, prev.cluster,
                                     describe_cluster_node(client, prev.cluster, iid))
            current[iid] = now_node
            if _in_progress(now_node):
                seen[iid] = True
            elif seen[iid]:
                outcome, detail = _finished_outcome(now_node)
                results[iid] = HealthCheckResult(now_node, outcome, detail)
            elif clock() - start >= start_grace_seconds:
                results[iid] = HealthCheckResult(now_node, "not_started",
                                                 f"never seen in progress (status {now_node.status})")
        if len(results) == len(current):
            break
        if clock() - start >= timeout_seconds:
            for iid, n in current.items():
                results.setdefault(iid, HealthCheckResult(n, "timeout",
                                                          f"still {n.status} after {timeout_seconds:.0f}s"))
            break
        sleep(poll_seconds)
    return [results[n.instance_id] for n in nodes]


# --- reboot and replace ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchResult:
    """The outcome of a batch reboot or replace (or what a dry run would have asked for)."""

    action: str  # "reboot" or "replace"
    cluster: str
    nodes: tuple[ClusterNode, ...]
    dry_run: bool
    successful: tuple[str, ...] = ()
    failed: tuple[Mapping[str, str], ...] = ()  # {"NodeId", "ErrorCode", "Message"}

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "cluster": self.cluster, "dry_run": self.dry_run,
                "nodes": [n.to_dict() for n in self.nodes], "successful": list(self.successful),
                "failed": [dict(f) for f in self.failed]}


def _batch(client: Any, operation: str, action: str, nodes: Sequence[ClusterNode],
           dry_run: bool) -> BatchResult:
    cluster = one_cluster(nodes)
    ids = list(dict.fromkeys(n.instance_id for n in nodes))
    if dry_run:
        return BatchResult(action, cluster, tuple(nodes), dry_run=True)
    ok: list[str] = []
    failed: list[Mapping[str, str]] = []
    for i in range(0, len(ids), BATCH_LIMIT):
        resp = _call(client, operation, ClusterName=cluster, NodeIds=ids[i:i + BATCH_LIMIT])
        ok.extend(resp.get("Successful", []))
        failed.extend({"NodeId": f["NodeId"], "ErrorCode": f["ErrorCode"], "Message": f["Message"]}
                      for f in resp.get("Failed", []))
    log.info("%s requested for %s: %d accepted, %d refused", action, ", ".join(ids), len(ok),
             len(failed))
    return BatchResult(action, cluster, tuple(nodes), dry_run=False, successful=tuple(ok),
                       failed=tuple(failed))


def reboot_nodes(client: Any, nodes: Sequence[ClusterNode], *, dry_run: bool = True) -> BatchResult:
    """BatchRebootClusterNodes for resolved nodes; a dry run (the default) makes no call."""
    return _batch(client, "BatchRebootClusterNodes", "reboot", nodes, dry_run)


def check_replace(nodes: Sequence[ClusterNode],
                  state_of: Callable[[ClusterNode], Optional[NodeState]], budget: int) -> None:
    """Refuse a replacement the lifecycle does not allow (ReplaceRefused, exit 2).

    Every node must already be out of service (quarantined or in repair) in screener's own record,
    and no more nodes may be replaced at once than the quarantine budget allows. state_of looks a
    node up in that record (by its Kubernetes name, instance ID or hostname, as the caller knows).
    """
    distinct = list(dict.fromkeys(n.instance_id for n in nodes))
    if len(distinct) > budget:
        raise ReplaceRefused(f"refusing to replace {len(distinct)} nodes at once: the quarantine "
                             f"budget allows {budget}")
    for n in nodes:
        state = state_of(n)
        if state not in REPLACEABLE_STATES:
            now = state.value if state is not None else "unknown to screener"
            raise ReplaceRefused(f"refusing to replace node {n.node} ({n.instance_id}): its state is "
                                 f"{now}, not quarantined or repair")


def replace_nodes(client: Any, nodes: Sequence[ClusterNode], *,
                  state_of: Callable[[ClusterNode], Optional[NodeState]], budget: int,
                  dry_run: bool = True) -> BatchResult:
    """BatchReplaceClusterNodes after check_replace; a dry run (the default) makes no call.

    Replacing a node destroys its root and secondary volumes: checkpoints must be on shared storage.
    """
    check_replace(nodes, state_of, budget)
    return _batch(client, "BatchReplaceClusterNodes", "replace", nodes, dry_run)
