"""Where each rank runs: one all_gather_object at start-up maps ranks to nodes, hosts and instances.

A node is the Kubernetes node the pod runs on, taken from the NODE_NAME environment variable (set from
the downward API, `fieldRef: spec.nodeName`); without it, the hostname. Ranks group into nodes by that
name, so tests simulate several nodes on one machine by giving ranks different NODE_NAME values.

Instance IDs: on SageMaker HyperPod clusters orchestrated by EKS, a node is named
`hyperpod-i-<17 hex digits>`; the `i-...` part is the EC2 instance ID that HyperPod's replace and
reboot calls take. Other node names give no instance ID (None): the DaemonSet on the node can still
find it from the node's providerID.

Also used by the straggler detector, so the API (gather_topology, Topology.node_of, ranks_on, nodes,
suspect_node) is kept stable. Imports only torch, the standard library and screener.types.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from screener.types import SuspectNode
from screener.types import node_name as _node_name

__all__ = ["RankInfo", "Topology", "gather_topology", "local_rank_info", "instance_id_of",
           "node_name"]

# HyperPod EKS node names: "hyperpod-i-0123456789abcdef0" (older instances have 8 hex digits).
_HYPERPOD_NODE = re.compile(r"hyperpod-(i-(?:[0-9a-f]{8}|[0-9a-f]{17}))")


def instance_id_of(node: str) -> Optional[str]:
    """The EC2 instance ID held in a HyperPod node name (`hyperpod-i-0abc...` -> `i-0abc...`)."""
    m = _HYPERPOD_NODE.fullmatch(node.strip().lower())
    return m.group(1) if m else None


def node_name() -> str:
    """This process's node: NODE_NAME (Kubernetes downward API) if set and not empty, else
    the hostname."""
    return _node_name()  # the one rule, shared with the daemon that reads this job's alarms


def job_name() -> str:
    """The job this process belongs to, for alarms: SCREENER_JOB, else JOB_NAME, else torchrun's
    TORCHELASTIC_RUN_ID ("none" counts as unset); empty when none is set."""
    for var in ("SCREENER_JOB", "JOB_NAME", "TORCHELASTIC_RUN_ID"):
        v = os.environ.get(var, "").strip()
        if v and v.lower() != "none":
            return v
    return ""


@dataclass(frozen=True)
class RankInfo:
    """What one rank reports about itself at start-up. `rank` is the global rank."""

    rank: int
    local_rank: int
    hostname: str
    node: str
    device: str  # "cuda:3", "cpu"
    gpu_uuid: Optional[str]  # "GPU-..." for CUDA devices, None otherwise
    instance_id: Optional[str]  # from the node name, see the module docstring
    threads: int = 0  # torch intra-op threads: CPU replays are bit-identical only with equal counts
    layout: str = ""  # what the rank holds, as the auditors describe it (layout.Layout.token)
    refusal: str = ""  # why this rank's setup cannot be audited ("" when it can)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpu_uuid(device: torch.device) -> Optional[str]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except (RuntimeError, AttributeError):  # old driver or torch without the uuid property
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def _default_device() -> torch.device:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_rank_info(rank: Optional[int] = None,
                    device: Optional[torch.device | str] = None, *, layout: str = "",
                    refusal: str = "") -> RankInfo:
    """This process's RankInfo. LOCAL_RANK comes from the launcher (torchrun sets it), -1 if
    unset."""
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dev = torch.device(device) if device is not None else _default_device()
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    node = node_name()
    try:
        local = int(os.environ.get("LOCAL_RANK", "-1"))
    except ValueError:
        local = -1
    return RankInfo(rank=int(rank), local_rank=local, hostname=socket.gethostname(), node=node,
                    device=str(dev), gpu_uuid=_gpu_uuid(dev), instance_id=instance_id_of(node),
                    threads=torch.get_num_threads(), layout=layout, refusal=refusal)


class Topology:
    """The ranks of one process group and the nodes they run on.

    Ranks are global ranks. `nodes` is in order of each node's lowest rank, `ranks_on(node)` in
    ascending rank order, so every process derives the same order from the same gathered data.
    """

    def __init__(self, infos: Iterable[RankInfo]) -> None:
        self.infos: tuple[RankInfo, ...] = tuple(infos)  # in group-rank order
        if not self.infos:
            raise ValueError("a topology needs at least one rank")
        self._by_rank = {i.rank: i for i in self.infos}
        if len(self._by_rank) != len(self.infos):
            raise ValueError("two ranks reported the same global rank")
        self._index = {i.rank: k for k, i in enumerate(self.infos)}
        order: dict[str, list[int]] = {}
        for info in sorted(self.infos, key=lambda i: i.rank):
            order.setdefault(info.node, []).append(info.rank)
        self._ranks_on = {n: tuple(r) for n, r in order.items()}
        self._nodes = tuple(order)

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    @property
    def ranks(self) -> list[int]:
        """Global ranks in group-rank order (index k is group rank k)."""
        return [i.rank for i in self.infos]

    @property
    def world_size(self) -> int:
        return len(self.infos)

    def info(self, rank: int) -> RankInfo:
        try:
            return self._by_rank[rank]
        except KeyError:
            raise KeyError(f"rank {rank} is not in this topology (ranks {self.ranks})") from None

    def index_of(self, rank: int) -> int:
        """The group rank of a global rank."""
        self.info(rank)
        return self._index[rank]

    def node_of(self, rank: int) -> str:
        return self.info(rank).node

    def ranks_on(self, node: str) -> list[int]:
        return list(self._ranks_on.get(node, ()))

    def suspect_node(self, rank: int) -> SuspectNode:
        i = self.info(rank)
        return SuspectNode(node=i.node, hostname=i.hostname, instance_id=i.instance_id)

    def suspect_nodes(self, ranks: Sequence[int]) -> tuple[SuspectNode, ...]:
        """The distinct nodes of some ranks, in node order."""
        wanted = {self.node_of(r) for r in ranks}
        first = {n: min(r for r in ranks if self.node_of(r) == n) for n in wanted}
        return tuple(self.suspect_node(first[n]) for n in self._nodes if n in wanted)

    def writer_of(self, node: str) -> int:
        """The rank that writes files for its node: the node's lowest rank in this group."""
        ranks = self._ranks_on.get(node)
        if not ranks:
            raise KeyError(f"no rank of this topology runs on node {node!r}")
        return ranks[0]

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": {n: list(r) for n, r in self._ranks_on.items()},
                "ranks": [i.to_dict() for i in self.infos]}

    def __repr__(self) -> str:
        return f"Topology({ {n: list(r) for n, r in self._ranks_on.items()} })"


def gather_topology(group: Optional[dist.ProcessGroup] = None, *,
                    device: Optional[torch.device | str] = None, layout: str = "",
                    refusal: str = "") -> Topology:
    """Collective: every rank of `group` (WORLD if None) contributes its RankInfo; all get all.
    layout and refusal: what the auditors agree on at construction (layout.py)."""
    mine = local_rank_info(dist.get_rank(), device, layout=layout, refusal=refusal)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine.to_dict(), group=group)
    return Topology(RankInfo(**d) for d in out)
