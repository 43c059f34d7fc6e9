"""The quarantine budget on Kubernetes: exact, and without a queue on one object.

A fleet failing at once is the case the budget exists for, so its claims must not serialise on
one record. Each node out of service holds one slot: a ConfigMap `screener-budget-slot-<k>`,
created to claim (a create of a taken name is refused, 409 AlreadyExists, by the API server
atomically) and deleted, with its uid as precondition, to release. An automatic claim takes a
random free slot below the limit its decision was made under (the lifecycle puts the limit in
the transition's evidence), so 150 claimers on 1,500 nodes mostly take different slots at once,
and however many race, automatic claims cannot exceed the limit: there are only that many names
to take. A person's decision (not limited by the budget, but counted in it) takes the lowest free
slot, which may lie past the limit; such slots shorten the range automatic claims may use.

The fleet's size is the record `screener-budget` (counted from one paginated list of Node
metadata) plus the nodes registered since, which each add themselves to one of a few shards
`screener-fleet-<s>` (an idempotent add, so a replayed registration never counts twice, and a
shard's contention is a fraction of the fleet's). One label-selected list reads the record, the
shards and the slots. The record is counted again when it is `recount_s` old (or its shards fill
up), by the one daemon that takes its lease (a write with the record's resourceVersion); the
others use the record as it is. The count also frees slots whose node shows no such state (a
writer that died between its claim and its node write) and gives a slot to a node labelled out of
service without one.

API calls: configmaps list (label-selected), create, update, delete in the screener namespace;
nodes list (metadata) for the count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from screener.lifecycle.records import BUDGET_STATES, BudgetConflict, Transition
from screener.stores import kubeformat as kf
from screener.stores.kubecalls import ApiCaller, TransientKubeError
from screener.stores.kubenode import state_of
from screener.types import LABEL_STATE, NodeState

log = logging.getLogger("screener.stores.kube")

FLEET_SHARDS = 8
MAX_REGISTERED = 256  # registrations since the count that make the record count again


@dataclass
class BudgetView:
    """The budget as one list read it: the record, the slots, the registration shards."""

    record: kf.BudgetRecord
    claims: dict[int, kf.Claim] = field(default_factory=dict)  # slot index -> claim
    shards: dict[int, tuple[dict[str, float], Optional[str]]] = field(default_factory=dict)

    @property
    def registered(self) -> set[str]:
        """Nodes that got their first state after the record's count began."""
        return {n for nodes, _ in self.shards.values() for n, when in nodes.items()
                if when >= self.record.counted}

    @property
    def fleet(self) -> int:
        return self.record.fleet + len(self.registered)

    @property
    def counted(self) -> float:
        return self.record.counted

    @property
    def out(self) -> dict[str, dict[str, Any]]:
        """node -> {"state", "since"}: every node holding a slot, and an earlier version's set."""
        out = {n: dict(c) for n, c in self.record.out.items()}
        out.update({c.node: {"state": c.state, "since": c.since} for c in self.claims.values()})
        return out

    def others_out(self, node: str) -> int:
        return sum(1 for n in self.out if n != node)

    def claims_of(self, node: str) -> list[kf.Claim]:
        return [c for c in self.claims.values() if c.node == node]


class KubeBudget:
    """Reads, claims, releases and counts the budget through one store's ApiCaller."""

    def __init__(self, calls: ApiCaller, *, instance: str, clock: Callable[[], float],
                 sleep: Callable[[float], None], rng: Callable[[], float],
                 conflict_attempts: int, recount_s: float, claim_grace_s: float,
                 lease_s: float = 120.0, shards: int = FLEET_SHARDS,
                 max_registered: int = MAX_REGISTERED) -> None:
        self.calls, self.instance = calls, instance
        self.clock, self.sleep, self.rng = clock, sleep, rng
        self.conflict_attempts = conflict_attempts
        self.recount_s, self.claim_grace_s, self.lease_s = recount_s, claim_grace_s, lease_s
        self.shards, self.max_registered = max(1, shards), max_registered
        self._jitter = rng()  # each store's own extra wait before a record counts as stale

    # --- reading ----------------------------------------------------------------------------

    def read(self) -> Optional[BudgetView]:
        """One label-selected list of the budget's objects, from the API server's watch cache
        (resourceVersion=0); None without a record.

        From the cache because a consistent list of ConfigMaps reads the whole namespace from
        etcd (every node's history) and filters it: per event, that grows with the fleet. The
        cache is a prefix of the object's history, a moment behind: a slot it shows free that
        is taken is a 409 on create (we look again), one it shows taken that was just freed
        holds the node in suspect until its next look (release_held, within a minute). Neither
        can put more nodes out than the budget: only creates take slots."""
        record: Optional[kf.BudgetRecord] = None
        claims: dict[int, kf.Claim] = {}
        shards: dict[int, tuple[dict[str, float], Optional[str]]] = {}
        for cm in self.calls.cm_list("list the quarantine budget", f"{kf.LABEL_BUDGET}=true",
                                     cached=True):
            name = str((cm.get("metadata") or {}).get("name") or "")
            if name == kf.BUDGET_CONFIGMAP:
                record = kf.BudgetRecord.from_configmap(cm)
            elif name.startswith(kf.SLOT_PREFIX):
                claim = kf.parse_slot(cm)
                if claim is not None:
                    claims[claim.index] = claim
            elif name.startswith(kf.SHARD_PREFIX) and name[len(kf.SHARD_PREFIX):].isdigit():
                shards[int(name[len(kf.SHARD_PREFIX):])] = (
                    kf.parse_shard(cm), cm["metadata"].get("resourceVersion"))
        return BudgetView(record, claims, shards) if record is not None else None

    def view(self) -> BudgetView:
        """The budget; the record created when missing, counted again when stale (by at most one
        daemon: whoever takes the lease; the others use the record as it is)."""
        for _ in range(self.conflict_attempts):
            v = self.read()
            if v is None:
                v = self._create_record()
                if v is None:
                    continue  # another daemon created it first: read theirs
            if self._stale(v):
                return self._recount(v)
            return v
        raise TransientKubeError("budget record: created and gone again, repeatedly")

    def _stale(self, v: BudgetView) -> bool:
        now = self.clock()
        due = (now - v.record.counted > self.recount_s * (1 + 0.25 * self._jitter)
               or len(v.registered) > self.max_registered)
        held = v.record.counter not in ("", self.instance) and v.record.counting_until > now
        return due and not held

    def _create_record(self) -> Optional[BudgetView]:
        """Create the record with our lease on its first count; None when someone else did."""
        rec = kf.BudgetRecord(fleet=0, counted=0.0, counter=self.instance,
                        counting_until=self.clock() + self.lease_s)
        if self.calls.cm_write(rec.configmap(self.calls.namespace)) is None:
            return None
        v = self.read()  # the slots and shards too (they may outlive a deleted record)
        return self._count(v) if v is not None else None

    # --- counting ---------------------------------------------------------------------------

    def _recount(self, v: BudgetView) -> BudgetView:
        """Take the lease (a write with the record's version); a conflict means another daemon
        has it, and the record is used as it is."""
        leased = replace(v.record, counter=self.instance,
                         counting_until=self.clock() + self.lease_s)
        written = self.calls.cm_write(leased.configmap(self.calls.namespace))
        if written is None:
            return self.read() or v
        v.record = kf.BudgetRecord.from_configmap(written)
        return self._count(v)

    def _count(self, v: BudgetView) -> BudgetView:
        """Count the fleet and who is out from the Nodes' labels, write the record (releasing the
        lease), then tidy the shards and the slots. Holds the lease: only one daemon is here."""
        start = self.clock()
        fleet, out = 0, {}
        for obj in self.calls.node_meta(LABEL_STATE):
            state = state_of(obj, warn=False)
            if state is not None:
                fleet += 1
                if state in BUDGET_STATES:
                    out[obj["metadata"]["name"]] = state
        rec = kf.BudgetRecord(fleet=fleet, out={}, counted=start,
                        resource_version=v.record.resource_version)
        if self.calls.cm_write(rec.configmap(self.calls.namespace)) is None:
            return self.read() or v  # someone rewrote the record meanwhile: theirs stands
        self._prune_shards(v, start)
        self._reconcile_claims(v, out, start)
        log.info("quarantine budget counted: %d nodes, %d out of service", fleet, len(out))
        return self.read() or v

    def _prune_shards(self, v: BudgetView, counted: float) -> None:
        for index, (nodes, rv) in v.shards.items():
            keep = {n: t for n, t in nodes.items() if t >= counted}
            if len(keep) != len(nodes):
                # A conflict: a registration just landed; the next count prunes it.
                self.calls.cm_write(kf.shard_configmap(index, keep, namespace=self.calls.namespace,
                                                       resource_version=rv))

    def _reconcile_claims(self, v: BudgetView, out: dict[str, NodeState], now: float) -> None:
        """Free slots whose node is not out of service (past the grace a claimer needs between
        its claim and its node write); give a slot to each node out of service without one."""
        for claim in list(v.claims.values()):
            if claim.node not in out and now - claim.since > self.claim_grace_s:
                if self.calls.cm_delete(claim.name, claim.uid):
                    log.warning("budget slot %s of %s freed: the node is not out of service",
                                claim.name, claim.node)
                v.claims.pop(claim.index, None)
        held = {c.node for c in v.claims.values()}
        for node, state in sorted(out.items()):
            if node not in held:
                v = self.claim(v, node, state, limit=None)

    # --- claims -----------------------------------------------------------------------------

    def claim(self, v: BudgetView, node: str, state: NodeState,
              limit: Optional[int]) -> BudgetView:
        """Give `node` a slot. limit: the budget its automatic decision was made under (a random
        free slot below it, else BudgetConflict: decide again); None for a decision the budget
        does not limit (a person's), which takes the lowest free slot."""
        taken: set[int] = set()  # slots a create found taken that the cache may not show yet
        for _ in range(self.conflict_attempts * 3):
            if v.claims_of(node):
                return v  # ours already (a retry whose first answer was lost, or a replay)
            index = self._pick(v, node, limit, taken)
            if index is None:
                raise BudgetConflict(f"no quarantine budget slot free for {node} "
                                     f"({v.others_out(node)} of {limit} out of service)")
            body = kf.slot_configmap(index, node, state.value, self.clock(),
                                     namespace=self.calls.namespace)
            created = self.calls.cm_write(body)
            if created is not None:
                claim = kf.parse_slot(created)
                if claim is not None:
                    v.claims[claim.index] = claim
                    return v
            # Taken meanwhile, or created by our own earlier try whose answer was lost: ask the
            # slot itself (a consistent read), and look at the budget again.
            cm = self.calls.cm_get(kf.slot_name(index))
            mine = kf.parse_slot(cm) if cm else None
            v = self.read() or v
            if mine is not None and mine.node == node:
                v.claims[index] = mine
            elif mine is not None:
                taken.add(index)
        raise BudgetConflict(f"budget slots for {node}: still taken after "
                             f"{self.conflict_attempts * 3} tries")

    def _pick(self, v: BudgetView, node: str, limit: Optional[int],
              also_taken: set[int]) -> Optional[int]:
        taken = set(v.claims) | also_taken
        if limit is None:
            return next(k for k in range(len(taken) + 1) if k not in taken)
        if v.others_out(node) + 1 > limit:
            return None
        # Slots past the limit (a person's, or from when the fleet was larger) and an earlier
        # version's claims count too: they shorten the range automatic claims may take.
        claimed = {c.node for c in v.claims.values()}
        beyond = (sum(1 for c in v.claims.values() if c.index >= limit and c.node != node)
                  + sum(1 for n in v.record.out if n not in claimed and n != node))
        free = [k for k in range(max(0, limit - beyond)) if k not in taken]
        if not free:
            return None
        return free[min(len(free) - 1, int(self.rng() * len(free)))]

    def release(self, v: BudgetView, node: str) -> None:
        """Free the node's slot(s); an earlier version's entry for it leaves the record."""
        for claim in v.claims_of(node):
            self.calls.cm_delete(claim.name, claim.uid)
            v.claims.pop(claim.index, None)
        if node in v.record.out:
            self._drop_legacy(node)

    def sync(self, t: Transition, view: Optional[BudgetView] = None) -> None:
        """After t's node write: register a new node, and make the slots agree with t. Every
        step is idempotent, so a replay after a partial write completes it."""
        into = t.to_state in BUDGET_STATES
        if t.from_state is not None and not into and t.from_state not in BUDGET_STATES:
            return  # healthy/burnin/suspect moves leave the budget alone
        view = view if view is not None else self.view()
        if t.from_state is None:
            self.register(view, t.node, t.time)
        if into and not view.claims_of(t.node):
            # Claimed before the node write when decided through begin(); here for a transition
            # recorded without one (or a claim a count freed meanwhile): it is decided already.
            self.claim(view, t.node, t.to_state, limit=None)
        elif not into and t.node in view.out:
            self.release(view, t.node)

    def release_unless_out(self, node: str, state: Optional[NodeState]) -> None:
        """Free the node's slot unless `state`, its label as read now, says it is out (after a
        claim whose node write was refused)."""
        if state not in BUDGET_STATES:
            self.release(self.view(), node)

    def _drop_legacy(self, node: str) -> None:
        for _ in range(self.conflict_attempts):
            cm = self.calls.cm_get(kf.BUDGET_CONFIGMAP)
            if cm is None:
                return
            rec = kf.BudgetRecord.from_configmap(cm)
            if node not in rec.out:
                return
            del rec.out[node]
            if self.calls.cm_write(rec.configmap(self.calls.namespace)) is not None:
                return
        raise TransientKubeError(f"budget record: {node} still listed after "
                                 f"{self.conflict_attempts} conflicting writes")

    # --- registrations ----------------------------------------------------------------------

    def register(self, v: BudgetView, node: str, when: float) -> None:
        """Count a node that got its first state at `when`: add it to its shard (idempotent).
        A registration from before the record's count is in that count already."""
        if when < v.record.counted:
            return
        index = kf.shard_of(node, self.shards)
        nodes, rv = v.shards.get(index, ({}, None))
        for attempt in range(self.conflict_attempts * 3):
            if node in nodes:
                return
            body = kf.shard_configmap(index, {**nodes, node: when},
                                      namespace=self.calls.namespace, resource_version=rv)
            written = self.calls.cm_write(body)
            if written is not None:
                v.shards[index] = (kf.parse_shard(written), written["metadata"].get("resourceVersion"))
                return
            self.sleep(min(0.2, 0.005 * 2 ** min(attempt, 5)) * (0.5 + self.rng()))
            cm = self.calls.cm_get(kf.shard_name(index))
            nodes, rv = ((kf.parse_shard(cm), cm["metadata"].get("resourceVersion")) if cm
                         else ({}, None))
        raise TransientKubeError(f"fleet shard {index}: {node} not registered after "
                                 f"{self.conflict_attempts * 3} conflicting writes")


def decided_limit(t: Transition, view: BudgetView) -> int:
    """The budget limit the lifecycle decided `t` under (its evidence carries it); without it,
    only the next slot: exact, though claims then queue."""
    for key in ("budget", "released_by_budget"):
        figures = t.evidence.get(key)
        if isinstance(figures, dict):
            limit = figures.get("limit")
            if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0:
                return limit
    return view.others_out(t.node) + 1


__all__ = ["BudgetView", "KubeBudget", "FLEET_SHARDS", "decided_limit"]
