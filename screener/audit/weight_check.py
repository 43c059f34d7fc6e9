"""Check 3: the weights, every weights_every steps and before every verified save.

DDP (`WeightVote`): every replica holds the whole model and must hold it bit for bit after the
optimizer step. Each rank fingerprints its weights; one gather of a digest of those fingerprints
("weights_digest"); only on disagreement are the full fingerprints gathered ("weights_full") and a
strict majority (vote.py) names the odd replicas ("weights"); without one the alarm is unsettled.

FSDP2/HSDP (`ShardedWeightCheck`): HSDP's ranks that hold the same shard (one per replica) vote on
its fingerprints; pure FSDP has no replicas, so every rank all-gathers every parameter, one at a
time, and the fingerprints must agree on all ranks (which catches a rank whose all-gather or whose
copy of the full weights went bad; a flipped bit in a rank's own stored shard reaches every rank
alike and is not seen). One gather ("weights").

A verified save (`save_verified`) runs the check for its step first and writes a marker next to
the checkpoint with the digest of the weights just checked, so rollback_target can trust it.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import torch

from screener.audit.alarms import SDCAlarm
from screener.audit.checkpoints import write_marker
from screener.audit.protocol import Walk
from screener.audit.reporting import History, Reporter
from screener.audit.ring_audit import MAX_NAMES
from screener.audit.vote import vote
from screener.fingerprint import digest, fingerprints

__all__ = ["WeightVote", "ShardedWeightCheck", "save_verified"]


def _differing(rows: torch.Tensor, reference: torch.Tensor, names: list[str]) -> dict[str, Any]:
    """Which parameters of one replica's fingerprint rows differ from the reference's."""
    k = (rows != reference).any(dim=1).nonzero().flatten().tolist()
    return {"parameters": [names[i] for i in k][:MAX_NAMES], "count": len(k)}


def save_verified(save_fn: Callable[[], Any], step: int, weights_digest: str, job: str
                  ) -> tuple[Any, Optional[str]]:
    """Run save_fn(); when it returns the path it wrote (str or PathLike), write the marker
    next to it. Returns what save_fn returned and that path (or None)."""
    result = save_fn()
    path = os.fspath(result) if isinstance(result, (str, os.PathLike)) else None
    if path is not None:
        write_marker(path, step=step, weights_digest=weights_digest, job=job)
    return result, path


class WeightVote:
    """Check 3 for DDP: a majority vote over whole replicas."""

    def __init__(self, weights: list[torch.nn.Parameter], names: list[str], reporter: Reporter,
                 history: History, counters: Counter[str]) -> None:
        self.weights, self.names = weights, names
        self.reporter, self.history, self.counters = reporter, history, counters
        self.verified: Optional[tuple[int, str]] = None  # (step, weights digest) of the last pass
        self.verified_path: Optional[str] = None  # what the last verified save wrote

    def check(self, walk: Walk, step: int) -> None:
        """The vote at `step`; raises SDCAlarm("weights") on every rank alike."""
        topo = self.reporter.topology
        rows = fingerprints(self.weights)  # (P, 2) int64
        got = walk.gather("weights_digest", fingerprints([rows])[0])  # (world, 2)
        self.counters["weight_checks"] += 1
        result = vote(list(got))
        if result.agree:
            self.history.last_clean_weights = step
            self.verified = (step, digest(dict(zip(self.names, rows.tolist()))))
            return
        full = walk.gather("weights_full", rows)  # (world, P, 2): only on disagreement
        result = vote(list(full))
        ranks = topo.ranks
        reference = full[result.groups[0][0]]
        differing = {str(ranks[i]): _differing(full[g[0]], reference, self.names)
                     for g in result.groups[1:] for i in g}
        evidence = {"groups": [[ranks[i] for i in g] for g in result.groups],
                    "compared_with": [ranks[i] for i in result.groups[0]],
                    "differing": differing, "last_clean_weights": self.history.last_clean_weights}
        first = self.history.window_start(self.history.last_clean_weights, step)
        key = self.reporter.key("weights", step)
        if result.settled:
            named = sorted(ranks[i] for i in result.outliers)
            self.reporter.alarm(SDCAlarm("weights", step, named, topo.suspect_nodes(named), True,
                                         evidence, candidate_ranks=named,
                                         first_suspect_step=first, key=key))
        evidence["why"] = "no strict majority of identical replicas"
        self.reporter.alarm(SDCAlarm("weights", step, (), (), False, evidence,
                                     candidate_ranks=sorted(ranks), first_suspect_step=first,
                                     key=key))

    def passed_at(self, step: int) -> bool:
        """Whether the vote already passed at this step."""
        return self.verified is not None and self.verified[0] == step

    def save(self, save_fn: Callable[[], Any], step: int) -> Any:
        """save_fn() after a vote that passed at `step`, with its marker."""
        assert self.verified is not None and self.verified[0] == step
        result, path = save_verified(save_fn, step, self.verified[1], self.reporter.job)
        if path is not None:
            self.verified_path = path
        self.counters["verified_saves"] += 1
        return result

    def rollback(self) -> tuple[Optional[int], Optional[str]]:
        """(the last step the vote passed, the checkpoint the last verified save wrote)."""
        return (self.verified[0] if self.verified else None), self.verified_path


class ShardedWeightCheck:
    """Check 3 for FSDP2/HSDP: shard replicas vote (HSDP), or every rank's full weights agree."""

    def __init__(self, params: list[Any], names: list[str], mesh: Any, hsdp: bool,
                 reporter: Reporter, history: History, counters: Counter[str]) -> None:
        # FSDP2's parameters are DTensors (to_local, full_tensor); Any spares importing DTensor
        self.params, self.names, self.mesh, self.hsdp = params, names, mesh, hsdp
        self.reporter, self.history, self.counters = reporter, history, counters
        self.passed: Optional[tuple[int, str]] = None  # (step, digest) of the last pass
        self.saved: Optional[tuple[int, Optional[str]]] = None  # (step, path) of the last save
        self.voted_at: Optional[int] = None  # the step of the last vote check 2 asked for
        # this rank's shards as the last weight check left them: (step, fingerprints, names)
        self.stored: Optional[tuple[int, torch.Tensor, list[str]]] = None
        # more of this rank's own tensors the record covers: the optimizer state of its shards
        # when the auditor has the optimizer (update_buddy.UpdateBuddy.state_shards)
        self.extra: Optional[Callable[[], list[tuple[str, torch.Tensor]]]] = None

    def _shards(self) -> tuple[list[str], list[torch.Tensor]]:
        """What the shard record covers: this rank's shards (and `extra`), with their names."""
        names, tensors = list(self.names), [p.to_local() for p in self.params]
        for name, t in (self.extra() if self.extra is not None else []):
            names.append(name)
            tensors.append(t)
        return names, tensors

    def _replicas(self) -> Any:
        """HSDP: the mesh as (replica, rank within it): one row per replica, whose columns are
        (shard, TP coordinate) under HSDP x TP."""
        mesh = self.mesh.mesh  # (replicate, shard) or (replicate, shard, tp) of global ranks
        return mesh.reshape(mesh.shape[0], -1)

    def _shard_groups(self) -> list[list[int]]:
        """HSDP: the global ranks that hold the same shard (one per replica), for every shard
        (and TP coordinate)."""
        flat = self._replicas()
        return [sorted(int(x) for x in flat[:, j].tolist()) for j in range(flat.shape[1])]

    def confined(self, ranks: set[int]) -> bool:
        """HSDP: whether these ranks all lie in one replica (a row of the mesh: the shard group
        that all-gathers a corrupted shard, so every result it computes is off) or all hold one
        shard (a column). There the ring replay's verdict may be a weight shard's: check 2 asks
        this vote before its blast-radius rule (issue 32)."""
        if not self.hsdp or not ranks:
            return False
        flat = self._replicas()
        rows = [{int(x) for x in flat[i, :].tolist()} for i in range(flat.shape[0])]
        return any(ranks <= g for g in rows + [set(c) for c in self._shard_groups()])

    def vote_first(self, step: int, ranks: Sequence[int], settled: bool,
                   evidence: dict[str, Any], walk: Walk) -> None:
        """HSDP, before a verdict is written (Reporter.before_verdict): a settled alarm that
        names ranks of one replica (or of one shard's holders), or a numeric failure (numbers
        no hardware explains), first hears the shard vote (in `walk`'s "locality_vote" round),
        which raises naming the rank whose shard differs if one does. Issue 32: a corrupted
        shard makes every rank that all-gathers it compute wrong numbers; naming those would
        name the wrong GPU (the wrong node, when a shard group spans nodes), and calling it
        software would name none. Once per step."""
        if self.voted_at == step or (settled and not self.confined(set(ranks))):
            return
        if not settled and "numeric_failure" not in evidence:
            return  # an unsettled alarm names no rank: nothing to correct
        self.check(walk, step, context={**evidence, "suspects": list(ranks)})

    def check(self, walk: Walk, step: int, *,
              context: Optional[dict[str, Any]] = None) -> None:
        """The check at `step`; raises SDCAlarm("weights") on every rank alike. context: what
        led to it when check 2 asks for it (its evidence; the vote is then check 2's
        "locality_vote" round, else check_weights' "weights")."""
        self.counters["weight_checks"] += 1
        topo = self.reporter.topology
        if self.hsdp:
            rows = fingerprints([p.to_local() for p in self.params])
            groups = self._shard_groups()
        else:
            with torch.no_grad():  # one full parameter at a time: never the whole model at once
                rows = torch.cat([fingerprints([p.full_tensor()]) for p in self.params])
            groups = [list(topo.ranks)]
        full = walk.gather("weights", rows) if context is None \
            else walk.gather("locality_vote", rows)  # (world, P, 2)
        if context is not None:
            self.voted_at = step
        index = topo.index_of
        outliers: list[int] = []
        unsettled: list[list[int]] = []
        differing: dict[str, Any] = {}
        for members in groups:
            result = vote([full[index(r)] for r in members])
            if result.agree:
                continue
            if not result.settled:
                unsettled.append(members)
                continue
            ref = full[index(members[result.majority[0]])]
            for i in result.outliers:
                r = members[i]
                differing[str(r)] = _differing(full[index(r)], ref, self.names)
                outliers.append(r)
        if not outliers and not unsettled:
            self.history.last_clean_weights = step
            if context is None:  # check_weights, after the optimizer step: the shards to keep
                names, tensors = self._shards()
                self.stored = (step, fingerprints(tensors), names)
            # the same on every rank: the gathered fingerprints of the weights just checked
            n = len(self.params)
            flat = full.reshape(-1, 2).tolist()
            self.passed = (step, digest({f"{k // n}/{self.names[k % n]}": (a, b)
                                         for k, (a, b) in enumerate(flat)}))
            return
        evidence = {"differing": differing, "unsettled_groups": unsettled,
                    "compared": "shard replicas (HSDP)" if self.hsdp else
                    "full weights all-gathered on every rank (FSDP)",
                    "last_clean_weights": self.history.last_clean_weights}
        if context is not None:  # what the vote was asked before (check 2's or a verdict's)
            evidence["prompted_by"] = context
        first = self.history.window_start(self.history.last_clean_weights, step)
        key = self.reporter.key("weights", step)
        if outliers and not unsettled:
            named = sorted(outliers)
            self.reporter.alarm(SDCAlarm("weights", step, named, topo.suspect_nodes(named), True,
                                         evidence, candidate_ranks=named,
                                         first_suspect_step=first, key=key))
        self.reporter.alarm(SDCAlarm("weights", step, (), (), False, evidence,
                                     candidate_ranks=sorted(set(outliers) | {
                                         r for g in unsettled for r in g}),
                                     first_suspect_step=first, key=key))

    def drifted(self) -> list[str]:
        """The parameters whose shard on this rank changed since the last weight check passed
        (and forget it: one look per weight check). Between the optimizer step and the next one
        nothing may write to the stored shards; a bit that flips there in a pure FSDP shard
        reaches every rank through the all-gather, so no comparison between ranks can see it,
        only the rank's own memory of what it held (issue 34.3). With the optimizer given, its
        state of the shards too ("<parameter> (exp_avg)"). Costs one read of them on the step
        after each weight check."""
        if self.stored is None:
            return []
        _, before, names = self.stored
        self.stored = None
        now_names, tensors = self._shards()
        if now_names != names:  # a state appeared or went without an optimizer step
            return sorted(set(now_names) ^ set(names))
        now = fingerprints(tensors)
        return [names[k] for k in (now != before).any(dim=1).nonzero().flatten().tolist()]

    def report_drift(self, step: int, flagged: list[int], mine: list[str]) -> None:
        """Raise for the ranks whose shards changed between the weight check and this step:
        their own memory (settled: one node), or, on ranks of several nodes, the loop writing
        to the weights after check_weights (NumericFailure)."""
        topo = self.reporter.topology
        if mine:  # rank-local: the alarm every rank raises holds gathered data only
            self.reporter.log(logging.ERROR, "weights_drift", step=step,
                              parameters=mine[:MAX_NAMES])
        evidence = {"changed_on_ranks": flagged,
                    "last_clean_weights": self.history.last_clean_weights,
                    "why": "a weight shard (or, with the optimizer given, its optimizer state) "
                           "changed between the weight check after the optimizer step and its "
                           "next use, with no optimizer step between"}
        if len({topo.node_of(r) for r in flagged}) > 1 or 2 * len(flagged) > topo.world_size:
            self.reporter.numeric(step, flagged, evidence, reason=(
                f"the weights changed on {len(flagged)} ranks of several nodes between "
                f"check_weights and step {step}: something in the loop writes to the weights "
                f"after check_weights (an EMA in place, a clamp, a reload); call check_weights "
                f"after every change to the weights"))
        self.reporter.alarm(SDCAlarm("weights", step, flagged, topo.suspect_nodes(flagged), True,
                                     evidence, candidate_ranks=flagged,
                                     first_suspect_step=self.history.window_start(
                                         self.history.last_clean_weights, step),
                                     key=self.reporter.key("weights", step)))

    def save(self, save_fn: Callable[[], Any], step: int) -> Any:
        """save_fn() after a check that passed at `step` (forced by the caller), with its marker."""
        assert self.passed is not None and self.passed[0] == step
        result, path = save_verified(save_fn, step, self.passed[1], self.reporter.job)
        self.saved = (step, path)
        self.counters["verified_saves"] += 1
        return result

    def rollback(self) -> tuple[Optional[int], Optional[str]]:
        """(the step of the last verified save, the checkpoint it wrote)."""
        return (self.saved[0], self.saved[1]) if self.saved else (None, None)
