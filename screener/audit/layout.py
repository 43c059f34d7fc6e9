"""What each rank holds, agreed before any check runs: audit the setup, or refuse it on every rank alike.

Every check compares ranks: a replay of one rank's micro-batch on another, a vote of replicas. That
is only sound between ranks that hold the same parameters, placed the same way. A setup that
looks like one the audit knows but is not (FSDP2 over a tensor-parallel model read as HSDP,
pipeline stages each sharded on their own sub-mesh) would pass construction and then raise an alarm
on every node, or abort in a gather of payloads of different sizes. So at construction each rank
describes what it holds (`describe`: every parameter's name, global shape, dtype and, for a
DTensor, its placements and device mesh; a digest of all of it, and why this rank's setup cannot
be audited, if it cannot), the descriptions travel in the topology gather, and `agreement` turns
the gathered ones into one refusal line or none, the same on every rank.

What is audited, by placement of every parameter:
- DDP: plain tensors (no DTensor), the same on every rank of the DDP's process group;
- FSDP2: DTensors placed (Shard(0),) on one 1-D mesh over every rank of the job;
- HSDP: DTensors placed (Replicate(), Shard(0)) on one 2-D (replicate, shard) mesh over every rank;
- FSDP2 x tensor parallel: DTensors on one 2-D (dp, tp) mesh over every rank, placed first by FSDP
  on dp (Shard(0), or _StridedShard(0) where TP shards the same dim) and then by TP on tp
  (Shard(k) or Replicate()), every parameter on that mesh (tensor_parallel.py says how it is
  replayed).
- HSDP x TP: the same on a 3-D (replicate, shard, tp) mesh, Replicate() first; its weight vote
  runs per shard and TP coordinate across the replicas.
Anything else is refused: a sub-mesh (pipeline stages, each sharded on their data-parallel row), parameters on different meshes (a TP model with parameters
TP left alone), ranks that hold different parameters.

describe and agreement are pure (parameters in, plain strings out); `join` runs the one gather.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from screener.audit.alarms import AuditUsageError
from screener.audit.topology import Topology, gather_topology

__all__ = ["Layout", "describe", "agreement", "join", "SUPPORTED", "tensor_parallel_group"]

SUPPORTED = ("audited: DDP, FSDP2 (Shard(0) on a 1-D mesh), HSDP ((Replicate(), Shard(0)) on "
             "a 2-D mesh), FSDP2 x tensor parallel (FSDP's Shard(0) then the TP placement, on "
             "a 2-D (dp, tp) mesh) and HSDP x TP (on a 3-D (replicate, shard, tp) mesh), each "
             "over every rank of the job, and pipeline parallel through its schedule "
             "(Auditor(schedule): ScheduleGPipe or Schedule1F1B, FSDP2 per stage); run this "
             "job without the Auditor (the node screens still cover its nodes)")


@dataclass(frozen=True)
class Layout:
    """One rank's description: `kind` ("ddp", "fsdp", "hsdp"), a digest of every parameter's
    name, shape, dtype and placement, how many parameters, and why this rank's setup cannot be
    audited ("" when it can)."""

    kind: str
    digest: str
    count: int
    refusal: str = ""
    state_width: int = 0  # int64 words of a step state (capture.StateCodec): the head's width

    @property
    def token(self) -> str:
        """What travels in the topology gather: digest, count and the step state's width."""
        return f"{self.digest}:{self.count}:{self.state_width}"


def _placement(p: Any) -> str:
    # type names, not isinstance: _StridedShard (FSDP over tensor parallel) is a Shard subclass
    return ",".join(f"{type(x).__name__}({getattr(x, 'dim', '')})" for x in p.placements)


def _mesh(p: Any) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
    mesh = p.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    return tuple(mesh.mesh.shape), names, tuple(int(r) for r in mesh.mesh.flatten().tolist())


def _is_dtensor(p: Any) -> bool:
    return hasattr(p, "placements") and hasattr(p, "device_mesh")


def describe(named: Sequence[tuple[str, Any]], world_size: int, *, sharded: bool,
             state_width: int = 0) -> Layout:
    """This rank's Layout. `named`: (name, parameter) pairs; `sharded`: the model was given to
    the FSDP2/HSDP auditor (else DDP's); state_width: the step state's width in int64 words."""
    lines: list[str] = []
    for name, p in named:
        line = f"{name}|{tuple(p.shape)}|{p.dtype}"
        if _is_dtensor(p):
            shape, dims, ranks = _mesh(p)
            line += f"|{_placement(p)}|{shape}|{dims}|{ranks}"
        lines.append(line)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    kind = "ddp" if not sharded else "fsdp"
    refusal = _refusal_ddp(named) if not sharded else ""
    if sharded:
        kind, refusal = _sharded_kind(named, world_size)
    return Layout(kind, digest, len(named), refusal, state_width)


def _refusal_ddp(named: Sequence[tuple[str, Any]]) -> str:
    for name, p in named:
        if _is_dtensor(p):
            return (f"screener.audit: parameter {name} of the DDP model is a DTensor placed "
                    f"({_placement(p)}) on a mesh {_mesh(p)[1] or _mesh(p)[0]}: DDP over a "
                    f"tensor-parallel model is not audited yet; {SUPPORTED}")
    return ""


def _sharded_kind(named: Sequence[tuple[str, Any]], world_size: int) -> tuple[str, str]:
    """("fsdp", "hsdp", "fsdp_tp" or "hsdp_tp", "") for a sharding the audit knows, else
    (kind, the refusal)."""
    if not named:
        return "fsdp", "screener.audit: the model has no parameters to audit"
    first_name, first = named[0]
    for name, p in named:
        if not _is_dtensor(p):
            return "fsdp", (f"screener.audit: parameter {name} is not a DTensor: shard every "
                            f"parameter with torch.distributed.fsdp.fully_shard before the "
                            f"Auditor (ignored_params are not audited)")
    mesh = _mesh(first)
    shape, dims, ranks = mesh
    for name, p in named[1:]:
        if _mesh(p) != mesh:
            return "fsdp", (f"screener.audit: parameters {first_name} and {name} live on "
                            f"different device meshes ({dims or shape} and "
                            f"{_mesh(p)[1] or _mesh(p)[0]}): parameters tensor parallel "
                            f"left alone, or a per-parameter mesh, not audited yet; "
                            f"{SUPPORTED}")
    kind = "hsdp" if len(shape) == 2 else "fsdp"
    if len(shape) == 2 and all(_fsdp_then_tp(p) for _, p in named):
        kind = "fsdp_tp"
    if len(shape) == 3 and all(_hsdp_then_tp(p) for _, p in named):
        kind = "hsdp_tp"
    if len(ranks) != world_size:
        return kind, (f"screener.audit: the model's device mesh {dims or shape} spans "
                      f"{len(ranks)} of the job's {world_size} ranks (a sub-mesh, as pipeline "
                      f"stages each sharded on their data-parallel row have): a pipeline-parallel "
                      f"job is audited through its schedule, Auditor(schedule); {SUPPORTED}")
    if kind in ("fsdp_tp", "hsdp_tp"):
        return kind, ""
    want = {1: "Shard(0)", 2: "Replicate(),Shard(0)"}.get(len(shape))
    for name, p in named:
        if _placement(p) != want:
            what = ("tensor parallel (a model split along a mesh dimension of its own, besides "
                    "FSDP's)" if len(shape) >= 2 else "a placement fully_shard does not make")
            return kind, (f"screener.audit: parameter {name} is placed ({_placement(p)}) on a "
                          f"{len(shape)}-D mesh {dims or shape}: {what} is not audited yet; "
                          f"{SUPPORTED}")
    return kind, ""


def _fsdp_then_tp(p: Any) -> bool:
    """FSDP's dp placement on mesh dim 0 (Shard(0), _StridedShard(0) when TP shards dim 0
    too), then TP's on mesh dim 1 (Shard(k) or Replicate())."""
    dp, tp = p.placements
    return (type(dp).__name__ in ("Shard", "_StridedShard") and getattr(dp, "dim", None) == 0
            and type(tp).__name__ in ("Shard", "Replicate"))


def _hsdp_then_tp(p: Any) -> bool:
    """HSDP x TP on a (replicate, shard, tp) mesh: Replicate() on the replicas, FSDP's shard on
    dim 0, then TP's placement."""
    rep, dp, tp = p.placements
    return (type(rep).__name__ == "Replicate"
            and type(dp).__name__ in ("Shard", "_StridedShard") and getattr(dp, "dim", None) == 0
            and type(tp).__name__ in ("Shard", "Replicate"))


def tensor_parallel_group(named: Sequence[tuple[str, Any]], rank: int
                          ) -> "tuple[int, ...] | str":
    """The ranks of `rank`'s tensor-parallel group in a module sharded with fully_shard (the last
    dim of the FSDP x TP or HSDP x TP mesh its split parameters live on: (rank,) when none is
    split), or why the parameters do not say one group (split on different meshes)."""
    found: Optional[tuple[str, tuple[int, ...]]] = None
    for name, p in named:
        if not _is_dtensor(p):
            continue
        width = len(p.placements)
        if not ((width == 2 and _fsdp_then_tp(p)) or (width == 3 and _hsdp_then_tp(p))):
            continue
        mesh = p.device_mesh.mesh
        rows = mesh.reshape(-1, mesh.shape[-1]).tolist()
        group = next((tuple(int(r) for r in row) for row in rows if rank in row), None)
        if group is None:
            return f"parameter {name}'s mesh does not hold rank {rank}"
        if found is not None and found[1] != group:
            return (f"parameters {found[0]} and {name} are split over different tensor-parallel "
                    f"groups ({_spans(found[1])} and {_spans(group)})")
        found = found or (name, group)
    return found[1] if found is not None else (rank,)


def _spans(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 6 else \
        f"{', '.join(map(str, ranks[:5]))}, ... ({len(ranks)} ranks)"


def agreement(entries: Sequence[tuple[int, str, str]]) -> Optional[str]:
    """The refusal the gathered descriptions call for, or None: entries are (rank, token,
    refusal) for every rank, in any order; every rank computes the same answer."""
    by_model: dict[tuple[str, str], list[int]] = {}
    by_state: dict[str, list[int]] = {}
    for rank, token, _ in sorted(entries):
        digest, count, state = (token.split(":") + ["", "", ""])[:3]
        by_model.setdefault((digest, count), []).append(rank)
        by_state.setdefault(state, []).append(rank)
    refused = [(rank, why) for rank, _, why in sorted(entries) if why]
    if len(by_model) > 1 and len(refused) == len(entries) \
            and len({count for _, count in by_model}) == 1:
        # the same parameters placed differently (on meshes that depend on the rank, as TP's
        # coordinates do), each refused by its rank: the rank's reason says more
        return refused[0][1]
    if len(by_model) > 1:
        groups = sorted(by_model.items(), key=lambda kv: kv[1][0])
        parts = "; ".join(f"rank(s) {_spans(r)}: {count} parameter tensors, layout {digest}"
                          for (digest, count), r in groups)
        return (f"screener.audit: the ranks do not hold the same model ({parts}): pipeline "
                f"stages, or a model that depends on the rank; every check compares ranks that "
                f"hold the same parameters (a pipeline-parallel job is audited through its "
                f"schedule, Auditor(schedule)); {SUPPORTED}")
    if len(by_state) > 1:
        parts = "; ".join(f"rank(s) {_spans(r)}: {w} words" for w, r in
                          sorted(by_state.items(), key=lambda kv: kv[1][0]))
        return (f"screener.audit: the ranks' RNG states differ in size ({parts}): different "
                f"torch builds or device types, whose replays cannot match bit for bit; run "
                f"every rank on one torch build and one device type")
    if not refused:
        return None
    rank, why = refused[0]
    return why if len(refused) == len(entries) else f"{why} (rank {rank})"


def join(group: Optional[dist.ProcessGroup], topology: Optional[Topology],
         device: torch.device, layout: Layout) -> Topology:
    """Collective: the topology with every rank's layout (gathered with it, or in one more
    all_gather_object when the caller gathered the topology already); raises AuditUsageError
    on every rank alike when the setup is refused (see agreement)."""
    if topology is None:
        topology = gather_topology(group, device=device, layout=layout.token,
                                   refusal=layout.refusal)
        entries = [(i.rank, i.layout, i.refusal) for i in topology.infos]
    else:
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, (dist.get_rank(), layout.token, layout.refusal), group=group)
        entries = [tuple(e) for e in out]
    why = agreement(entries)
    if why is not None:
        raise AuditUsageError(why)
    return topology
