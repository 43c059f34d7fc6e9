"""The disruptive rungs of the repair ladder, as calls: reboot a node, replace a node.

Two ways to reboot: SageMaker HyperPod's BatchRebootClusterNodes for the node's instance, or a
configured command run on the node itself (for clusters outside HyperPod). Replace is HyperPod's
BatchReplaceClusterNodes, refused unless screener's record holds the node out of service (the
same check `screener hyperpod replace` makes). Each call answers what happened as a RepairCall;
a call that failed (a refusal, a throttle, a missing tool) is OUR failure or the service's, never
a hardware verdict, and the ladder records it as such. The ladder (screener.remediation.ladder)
says what it needs of them (its Repairs protocol); this module is one way to provide it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from screener.errors import ExternalServiceError, ScreenerError
from screener.remediation import gpu_tools, hyperpod
from screener.remediation.ladder import RepairCall
from screener.types import NodeState

REBOOT_TIMEOUT_S = 120.0  # the command must return once the reboot is under way


class HyperPodRepairs:
    """Reboot and replace through SageMaker HyperPod. client: a boto3 SageMaker client;
    state_of: the node's state in screener's record (replace is refused unless it is out)."""

    def __init__(self, client: Any, cluster: str, *,
                 state_of: Callable[[str], Optional[NodeState]]) -> None:
        self.client, self.cluster, self.state_of = client, cluster, state_of

    def _batch(self, node: str, action: str,
               call: Callable[[Sequence[hyperpod.ClusterNode]], hyperpod.BatchResult]) -> RepairCall:
        try:
            nodes = hyperpod.resolve_nodes(self.client, self.cluster, [node])
        except ScreenerError as e:
            return RepairCall(False, f"HyperPod {action} of {node} not asked for: {e}",
                              {"method": "hyperpod", "error": str(e)})
        try:
            res = call(nodes)
        except ScreenerError as e:
            # A refusal (bad input, access denied) never left; a throttle that outlasted the
            # retries or a lost answer may have: the request may be under way.
            sent = isinstance(e, ExternalServiceError) and not isinstance(e, hyperpod.AccessDenied)
            return RepairCall(False, f"HyperPod {action} of {node}: {e}",
                              {"method": "hyperpod", "error": str(e)}, maybe_sent=sent)
        record = {"method": "hyperpod", **res.to_dict()}
        if res.failed:
            why = "; ".join(f"{f['NodeId']}: {f['ErrorCode']} {f['Message']}" for f in res.failed)
            return RepairCall(False, f"HyperPod refused the {action} of {node}: {why}", record)
        ids = ", ".join(res.successful) or "(none)"
        return RepairCall(True, f"HyperPod accepted the {action} of {node} ({ids})", record)

    def reboot(self, node: str) -> RepairCall:
        return self._batch(node, "reboot", lambda nodes: hyperpod.reboot_nodes(
            self.client, nodes, dry_run=False))

    def replace(self, node: str) -> RepairCall:
        # One node at a time, so the quarantine budget's count of one always allows it.
        return self._batch(node, "replacement", lambda nodes: hyperpod.replace_nodes(
            self.client, nodes, state_of=lambda n: self.state_of(n.node), budget=1,
            dry_run=False))


class CommandRepairs:
    """Reboot by a command run on the node; replace through `replacer` (HyperPod) when given,
    else refused (a person replaces the node)."""

    def __init__(self, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
                 timeout_s: float = REBOOT_TIMEOUT_S,
                 replacer: Optional[HyperPodRepairs] = None) -> None:
        self.argv, self.env, self.timeout_s = tuple(argv), env, timeout_s
        self.replacer = replacer

    def reboot(self, node: str) -> RepairCall:
        res = gpu_tools.run_tool(self.argv, env=self.env, timeout_s=self.timeout_s)
        record = {"method": "command", **res.to_dict()}
        if res.error or res.returncode != 0:
            why = res.error or f"exit {res.returncode}: {res.output.strip()[-300:]}"
            # A command that ran out of time may be rebooting the host as it was killed.
            timed_out = res.returncode is None and "did not finish" in res.error
            return RepairCall(False, f"reboot command for {node} failed: {why}", record,
                              maybe_sent=timed_out)
        return RepairCall(True, f"reboot command for {node} ran: {' '.join(self.argv)}", record)

    def replace(self, node: str) -> RepairCall:
        if self.replacer is not None:
            return self.replacer.replace(node)
        return RepairCall(False, f"replacing {node} needs SageMaker HyperPod ([hyperpod] "
                          "cluster); a person replaces it", {"method": "command"})
