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
writer that died between its claim and its node write, a node back in service or gone) and
ConfigMaps under a slot's name that are no claim (hand-made), and gives a slot to a node labelled
out of service without one.

Stray slots (issue 36.2): a leftover slot of a node back in service or gone, a slot past the
limit, a hand-made one, or a rewritten record's out-of-service list take names or count as out
without a node out of service, so a mass failure would stop one short of the budget, and a name
that is no claim was picked again and again (one stray made one node do 2,790 requests). Now a
create refused by a name that is no claim marks it taken for every later pick, and an automatic
claim that finds no free name below its limit looks once at which nodes really are out (two
label-selected lists of Node metadata); if a holder is not, it counts the record again at once
(taking the lease), which frees the strays, and picks again. Names are only ever freed by
their holder's release or by that count, so the bound (no more automatic claims than names
below the limit) holds throughout.

Who may write what is held by the admission policies (manifests/admission-policy.yaml): a daemon
creates and deletes only slots naming its own node and adds only its own registration; the lease
holder, the daemon the record names as `counter`, may also free or give others' slots and prune
the shards, and only it may change the count, by at most kf.RECORD_MAX_RAISE nodes up per write.

A claim that loses a race (409 on its create) asks that slot, then lists the slots' names only (a
Table without objects, a fifteenth of the bytes), not the whole budget: at 400 of 3,000 failing
at once the budget's lists were most of what the daemons decoded and the API server encoded.

API calls: configmaps list (label-selected; the slots' names as a Table), get, create, update,
delete in the screener namespace; nodes list (metadata) for the count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Callable, Mapping, Optional

from screener.lifecycle.records import BUDGET_STATES, BudgetConflict, Transition
from screener.stores.kube import formats as kf
from screener.stores.kube.calls import ApiCaller, KubeApiError, TransientKubeError
from screener.stores.kube.node import state_of
from screener.stores.kube.semaphore import Semaphore
from screener.types import LABEL_STATE, NodeState

log = logging.getLogger("screener.stores.kube")

FLEET_SHARDS = 8
MAX_REGISTERED = 256  # registrations since the count that make the record count again
STRAY_RECHECK_S = 30.0  # a look at who is really out that found no stray holds this long
STRAY_POLLS = 12  # reads of the budget while another daemon's count frees strays (~10 s)
CLOCK_SKEW_S = 300.0  # a record counted further in the future than this is counted again
# How far ahead of its writer's clock a registration is stamped: past the longest a write can be
# in flight (a call's deadline, and the API server's own 60 s request timeout), so that every
# registration stamped before a count began has landed before the count reads the shards.
REGISTER_AHEAD_S = 105.0


@dataclass
class BudgetView:
    """The budget as one list read it: the record, the slots, the registration shards."""

    record: kf.BudgetRecord
    claims: dict[int, kf.Claim] = field(default_factory=dict)  # slot index -> claim
    shards: dict[int, tuple[dict[str, float], Optional[str]]] = field(default_factory=dict)
    # slot index -> (uid, creation time): ConfigMaps under a slot's name that are no claim
    # (hand-made, or of no screener format): their names are taken, but nobody is out.
    foreign: dict[int, tuple[str, float]] = field(default_factory=dict)
    shard_data: dict[int, dict[str, str]] = field(default_factory=dict)  # as read, for the add
    record_data: dict[str, str] = field(default_factory=dict)  # the record as read, for a lease

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
                 max_registered: int = MAX_REGISTERED,
                 register_ahead_s: float = REGISTER_AHEAD_S) -> None:
        self.calls, self.instance = calls, instance
        self.clock, self.sleep, self.rng = clock, sleep, rng
        self.conflict_attempts = conflict_attempts
        self.recount_s, self.claim_grace_s, self.lease_s = recount_s, claim_grace_s, lease_s
        self.shards, self.max_registered = max(1, shards), max_registered
        self.register_ahead_s = register_ahead_s
        # The slots are places of the fleet semaphore (semaphore.py): claimed by a create, freed
        # by a uid-preconditioned delete; the limit and the strays are this module's rules.
        self.slots: Semaphore[kf.Claim] = Semaphore(
            calls, what="budget slots", selector=f"{kf.LABEL_BUDGET}=true,{kf.LABEL_BUDGET_KIND}=slot",
            name=kf.slot_name, parse=kf.parse_slot)
        self._jitter = rng()  # each store's own extra wait before a record counts as stale
        # Slot names a create found taken by something that is no claim, and not labelled as the
        # budget's (so no list shows them): remembered, so no pick takes them again.
        self._foreign: dict[int, tuple[str, float]] = {}
        self._no_strays: tuple[Any, float] = (None, 0.0)  # what the last look found no stray in
        self._legacy_count = float("-inf")  # when a record's out-of-service list made us count

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
        foreign: dict[int, tuple[str, float]] = {}
        shard_data: dict[int, dict[str, str]] = {}
        record_data: dict[str, str] = {}
        for cm in self.calls.cm_list("list the quarantine budget", f"{kf.LABEL_BUDGET}=true",
                                     cached=True):
            name = str((cm.get("metadata") or {}).get("name") or "")
            if name == kf.BUDGET_CONFIGMAP:
                record = kf.BudgetRecord.from_configmap(cm)
                record_data = {str(k): str(x) for k, x in (cm.get("data") or {}).items()}
            elif name.startswith(kf.SLOT_PREFIX):
                claim = kf.parse_slot(cm)
                if claim is not None:
                    claims[claim.index] = claim
                elif _slot_index(name) is not None:
                    foreign[_slot_index(name) or 0] = _foreign(cm)
            elif name.startswith(kf.SHARD_PREFIX) and name[len(kf.SHARD_PREFIX):].isdigit():
                index = int(name[len(kf.SHARD_PREFIX):])
                shards[index] = (kf.parse_shard(cm), cm["metadata"].get("resourceVersion"))
                shard_data[index] = {str(k): str(v) for k, v in (cm.get("data") or {}).items()}
        if record is None:
            return None
        for index, what in self._foreign.items():
            if index not in claims:
                foreign.setdefault(index, what)
        return BudgetView(record, claims, shards, foreign, shard_data, record_data)

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
        # A count stamped in the future (a rewritten record, or a clock far off) would otherwise
        # never grow stale: it is counted again.
        due = (now - v.record.counted > self.recount_s * (1 + 0.25 * self._jitter)
               or v.record.counted > now + CLOCK_SKEW_S
               or sum(1 for nodes, _ in v.shards.values() for when in nodes.values()
                      if v.record.counted <= when <= now) > self.max_registered)
        if v.record.out and now - self._legacy_count > STRAY_RECHECK_S:
            # An out-of-service list in the record (an earlier version's, or a rewritten record)
            # counts nodes out that the decisions read before any claim: counted now, which
            # moves its entries into slots or drops them (issue 36.2), at most once a while.
            due = True
            self._legacy_count = now
        held = self._held(v.record, now)
        return due and not held

    def _held(self, rec: kf.BudgetRecord, now: float) -> bool:
        """Another daemon holds the lease: named as counter, until a time to come. A lease
        longer than any this code takes (a rewritten record: admission has no clock to refuse
        one) holds nobody off."""
        return (rec.counter not in ("", self.instance) and now < rec.counting_until
                <= now + 2 * self.lease_s)

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
        try:
            written = self.calls.cm_write(self._leased(v.record, v.record_data))
        except KubeApiError as e:
            if e.status != 403:
                raise
            # The policy lets a daemon take the lease only in its own node's name: a store whose
            # instance is not its node counts nothing, and uses the record as it is.
            log.warning("quarantine budget: not counted again: %s", e)
            return v
        if written is None:
            return self.read() or v
        v.record = kf.BudgetRecord.from_configmap(written)
        return self._count(v)

    def _leased(self, rec: kf.BudgetRecord, data: Mapping[str, Any]) -> dict[str, Any]:
        """The record with our lease on it and every other field as read, byte for byte: the
        admission policy lets a daemon that does not hold the lease change nothing else (a
        record re-serialised from a hand-written one would differ)."""
        body = replace(rec, counter=self.instance,
                       counting_until=self.clock() + self.lease_s).configmap(self.calls.namespace)
        if data:
            body["data"] = {**{str(k): str(x) for k, x in data.items()},
                            "counter": body["data"]["counter"],
                            "countingUntil": body["data"]["countingUntil"]}
        return body

    def _count(self, v: BudgetView) -> BudgetView:
        """Count the fleet and who is out from the Nodes' labels, write the record, tidy the
        shards and the slots, then release the lease. Holds the lease throughout: only one daemon
        is here, and the admission policy lets only the record's counter free others' slots and
        prune the shards."""
        start = self.clock()
        fleet, out, labelled = 0, {}, set()
        for obj in self.calls.node_meta(LABEL_STATE):
            state = state_of(obj, warn=False)
            if state is not None:
                fleet += 1
                labelled.add(obj["metadata"]["name"])
                if state in BUDGET_STATES:
                    out[obj["metadata"]["name"]] = state
        # The registrations as they stand after the list (issue 36.7: 1,500 racing left the fleet
        # 2 to 24 short until the next count). One stamped at or after `start` stays a
        # registration under the new record, so the count leaves its node out; one stamped
        # before landed before this read (REGISTER_AHEAD_S): its node is counted, by its label
        # or, still between its registration and its Node write, here.
        self._fresh_shards(v)
        visible = {n for nodes, _ in v.shards.values() for n, when in nodes.items()
                   if when >= start}
        in_flight = {n for nodes, _ in v.shards.values() for n, when in nodes.items()
                     if n not in labelled and n not in visible
                     and max(v.record.counted, start - self.claim_grace_s) <= when < start}
        fleet = len(labelled - visible) + len(in_flight)
        written_fleet = fleet
        if v.record.counted > 0 and fleet > v.record.fleet + kf.RECORD_MAX_RAISE:
            # The policy admits no larger step; the next counts reach the rest (see formats.py).
            written_fleet = v.record.fleet + kf.RECORD_MAX_RAISE
            log.warning("quarantine budget: the fleet grew from %d to %d nodes within one count; "
                        "recorded %d, the next counts add the rest", v.record.fleet, fleet,
                        written_fleet)
        rec = kf.BudgetRecord(fleet=written_fleet, out={}, counted=start,
                              resource_version=v.record.resource_version, counter=self.instance,
                              counting_until=self.clock() + self.lease_s)
        try:
            written = self.calls.cm_write(rec.configmap(self.calls.namespace))
        except KubeApiError as e:
            if e.status != 403:
                raise
            log.error("quarantine budget: the count was refused (%s); the record stays as it is",
                      e)
            return self.read() or v
        if written is None:
            return self.read() or v  # someone rewrote the record meanwhile: theirs stands
        self._prune_shards(v, start)
        self._reconcile_claims(v, out, start)
        released = replace(kf.BudgetRecord.from_configmap(written), counter="", counting_until=0.0)
        self.calls.cm_write(released.configmap(self.calls.namespace))  # a conflict: theirs stands
        log.info("quarantine budget counted: %d nodes, %d out of service", fleet, len(out))
        return self.read() or v

    def _fresh_shards(self, v: BudgetView) -> None:
        """The registration shards read again, by one consistent list (not the cache's): a
        count's read, once an hour or so, not one per event."""
        v.shards.clear()
        v.shard_data.clear()
        for cm in self.calls.cm_list("list the fleet shards",
                                     f"{kf.LABEL_BUDGET}=true,{kf.LABEL_BUDGET_KIND}=shard"):
            name = str((cm.get("metadata") or {}).get("name") or "")
            tail = name[len(kf.SHARD_PREFIX):]
            if not name.startswith(kf.SHARD_PREFIX) or not tail.isdigit() or len(tail) > 3:
                continue
            index = int(tail)
            v.shards[index] = (kf.parse_shard(cm), cm["metadata"].get("resourceVersion"))
            v.shard_data[index] = {str(k): str(x) for k, x in (cm.get("data") or {}).items()}

    def _prune_shards(self, v: BudgetView, counted: float) -> None:
        """Take out the registrations stamped before the count (it holds their nodes); one that
        lands meanwhile makes the write conflict: read again and prune again, a few times (what
        is left is invisible under the record, and the next count prunes it)."""
        for index in list(v.shards):
            for _ in range(3):
                nodes, rv = v.shards[index]
                keep = {n: t for n, t in nodes.items() if t >= counted}
                if len(keep) == len(nodes) and set(v.shard_data.get(index, {})) == set(keep):
                    break
                if self._tidy(self.calls.cm_write, kf.shard_configmap(
                        index, keep, namespace=self.calls.namespace, resource_version=rv)):
                    break
                cm = self.calls.cm_get(kf.shard_name(index))
                if cm is None:
                    break
                v.shards[index] = (kf.parse_shard(cm), cm["metadata"].get("resourceVersion"))
                v.shard_data[index] = {str(k): str(x) for k, x in (cm.get("data") or {}).items()}

    def _tidy(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A count's write about others (a freed or given slot, a pruned shard): one the API
        server refuses (403: the policy did not see this daemon as the lease holder yet) is left
        for the next count, not an error of the node's own transition."""
        try:
            return fn(*args)
        except KubeApiError as e:
            if e.status != 403:
                raise
            log.warning("quarantine budget count: %s", e)
            return None

    def _reconcile_claims(self, v: BudgetView, out: dict[str, NodeState], now: float) -> None:
        """Free slots whose node is not out of service (past the grace a claimer needs between
        its claim and its node write); give a slot to each node out of service without one."""
        for claim in list(v.claims.values()):
            if claim.node not in out and now - claim.since > self.claim_grace_s:
                if self._tidy(self.slots.free, claim.index, claim.uid):
                    log.warning("budget slot %s of %s freed: the node is not out of service",
                                claim.name, claim.node)
                v.claims.pop(claim.index, None)
        for index, (uid, created) in list(v.foreign.items()):
            # Under a slot's name but no claim (hand-made, or of no format screener writes):
            # nobody is out by it, and the name is the budget's.
            if now - created > self.claim_grace_s and uid:
                if self._tidy(self.slots.free, index, uid):
                    log.warning("budget slot %s freed: it holds no claim", kf.slot_name(index))
                v.foreign.pop(index, None)
                self._foreign.pop(index, None)
        by_node: dict[str, list[kf.Claim]] = {}
        for claim in sorted(v.claims.values(), key=lambda c: c.index):
            by_node.setdefault(claim.node, []).append(claim)
        for node, claims in by_node.items():
            for claim in claims[1:]:
                # A node out of service holds one slot (its lowest, as KubeBudget.settle keeps):
                # two claims for it raced (two daemons on one node), and one lost.
                if self._tidy(self.slots.free, claim.index, claim.uid):
                    log.warning("budget slot %s of %s freed: the node holds another", claim.name,
                                node)
                v.claims.pop(claim.index, None)
        held = {c.node for c in v.claims.values()}
        for node, state in sorted(out.items()):
            if node not in held:
                try:
                    v = self.claim(v, node, state, limit=None)
                except KubeApiError as e:
                    if e.status != 403:
                        raise
                    log.warning("quarantine budget count: %s", e)

    # --- claims -----------------------------------------------------------------------------

    def claim(self, v: BudgetView, node: str, state: NodeState,
              limit: Optional[int]) -> BudgetView:
        """Give `node` a slot. limit: the budget its automatic decision was made under (a random
        free slot below it, else BudgetConflict: decide again); None for a decision the budget
        does not limit (a person's), which takes the lowest free slot."""
        taken: set[int] = set()  # slots a create found taken that the cache may not show yet
        looked = False
        for _ in range(self.conflict_attempts * 3):
            if v.claims_of(node):
                return v  # ours already (a retry whose first answer was lost, or a replay)
            index = self._pick(v, node, limit, taken)
            if index is None and limit is not None and not looked:
                looked = True  # once per claim: are the holders that fill the budget out?
                counted = self._free_strays(v)
                if counted is not None:
                    v = counted
                    continue
            if index is None:
                raise BudgetConflict(f"no quarantine budget slot free for {node} "
                                     f"({v.others_out(node)} of {limit} out of service)")
            body = kf.slot_configmap(index, node, state.value, self.clock(),
                                     namespace=self.calls.namespace)
            claim = self.slots.take(body)
            if claim is not None:
                v.claims[claim.index] = claim
                return v
            # Taken meanwhile, or created by our own earlier try whose answer was lost: ask the
            # slot itself (a consistent read), and which names are taken now.
            cm = self.slots.look(index)
            mine = kf.parse_slot(cm) if cm else None
            if mine is not None and mine.node == node:
                v.claims[index] = mine
                continue
            if cm is not None:
                # Someone else's claim, or a ConfigMap under the slot's name that is no claim at
                # all: taken either way (it was picked again on every try before, issue 36.2).
                taken.add(index)
                if mine is None:
                    self._foreign[index] = v.foreign[index] = _foreign(cm)
            # The slots' names only, not the budget again: a pick needs which names are taken,
            # and the whole list (every slot's data and managedFields) was most of what a mass
            # failure's claimers decoded, and the API server encoded (issue 36.6). The view's
            # claims stay as read: a slot freed since stays taken for this claim (fewer names
            # to pick, never more), and a node that finds none decides again on a fresh view.
            taken.update(i for i in map(_slot_index, self.slots.names()) if i is not None)
        raise BudgetConflict(f"budget slots for {node}: still taken after "
                             f"{self.conflict_attempts * 3} tries")

    def _free_strays(self, v: BudgetView) -> Optional[BudgetView]:
        """The budget counted again now if a holder that fills it is not out of service (a
        leftover slot of a node back in service or gone, one past the limit, one that is no
        claim, or a rewritten record's out-of-service list); None when every holder is out,
        or another daemon holds the lease (its count frees them; the claim decides again).

        Only for an automatic claim that found no free name, and at most one look per
        STRAY_RECHECK_S at an unchanged set of holders: two label-selected lists of Node
        metadata (the nodes out of service, a share of the fleet), and a count only when it
        finds a stray."""
        now = self.clock()
        old = [c for c in v.claims.values() if now - c.since > self.claim_grace_s]
        aged = [i for i, (_, created) in v.foreign.items() if now - created > self.claim_grace_s]
        if not old and not aged and not v.record.out:
            return None
        key = (frozenset((c.index, c.uid) for c in old), frozenset(aged),
               frozenset(v.record.out))
        if self._no_strays[0] == key and now - self._no_strays[1] < STRAY_RECHECK_S:
            return None
        out = {str(obj["metadata"]["name"]) for state in sorted(s.value for s in BUDGET_STATES)
               for obj in self.calls.node_meta(f"{LABEL_STATE}={state}")}
        strays = ([c.name for c in old if c.node not in out] + [kf.slot_name(i) for i in aged]
                  + [f"{n} (record)" for n in v.record.out if n not in out])
        if not strays:
            self._no_strays = (key, now)
            return None
        # Whether another daemon counts already, on the record as it is now: a claim's view can
        # be a few lost races old, and counting on its record would race the count under way.
        fresh = self.read() or v
        if self._held(fresh.record, now):
            return self._await_count()
        log.warning("quarantine budget: %s hold the budget but no node out of service; counting "
                    "it again", ", ".join(sorted(strays)[:5]))
        return self._recount(fresh)

    def _await_count(self) -> Optional[BudgetView]:
        """The budget once the lease holder's count is done (its lease released or expired):
        several claimers find the same stray in a mass failure, one counts, and the others
        wait for it rather than give up a place the count is freeing (150 of 1,500 left one
        held in suspect until its next look). None after STRAY_POLLS reads without it."""
        delay = 0.1
        for _ in range(STRAY_POLLS):
            self.sleep(delay * (0.5 + self.rng()))
            delay = min(1.0, delay * 2)
            fresh = self.read()
            if fresh is None:
                return None
            rec = fresh.record
            if rec.counter in ("", self.instance) or rec.counting_until <= self.clock():
                return fresh
        return None

    def _pick(self, v: BudgetView, node: str, limit: Optional[int],
              also_taken: set[int]) -> Optional[int]:
        taken = set(v.claims) | set(v.foreign) | also_taken
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
            self.slots.free(claim.index, claim.uid)
            v.claims.pop(claim.index, None)
        if node in v.record.out:
            self._drop_legacy(node)

    def sync(self, t: Transition, view: Optional[BudgetView] = None, *,
             latest: bool = True) -> None:
        """After t's node write: register a new node, and make the slots agree with t. Every
        step is idempotent, so a replay after a partial write completes it. latest: t is the
        node's newest transition; an older one (finished late) leaves the slots to the newer."""
        into = t.to_state in BUDGET_STATES
        if t.from_state is not None and not into and t.from_state not in BUDGET_STATES:
            return  # healthy/burnin/suspect moves leave the budget alone
        view = view if view is not None else self.view()
        if t.from_state is None:
            self.register(view, t.node)
        if not latest:
            return
        if into and not view.claims_of(t.node):
            # Claimed before the node write when decided through begin(); here for a transition
            # recorded without one (or a claim a count freed meanwhile): it is decided already.
            self.claim(view, t.node, t.to_state, limit=None)
        elif not into and t.node in view.out:
            self.release(view, t.node)

    def slots_of(self, node: str) -> list[kf.Claim]:
        """The node's slots as they stand (a consistent list, not the cache's): for the rare
        paths that must not miss a claim made a moment ago (a lost race, a finished intent)."""
        return sorted((p.claim for p in self.slots.places().values() if p.claim.node == node),
                      key=lambda c: c.index)

    def settle(self, node: str, state: Optional[NodeState]) -> None:
        """One slot per node whatever raced (issue 36.7: two daemons on one node left it holding
        two): with `state`, the node's label as read now, out of service it keeps its lowest
        slot, whoever claimed it, and every other goes; in service, all go. Every daemon that
        settles the same node keeps the same one, so racing settles agree. Called after a claim
        whose node write lost to another writer, and when an unfinished transition is finished."""
        _, freed = self.slots.keep_lowest(node, keep=state in BUDGET_STATES)
        for claim in freed:
            log.info("budget slot %s of %s freed: %s", claim.name, node,
                     "the node holds another" if state in BUDGET_STATES
                     else "the node is not out of service")

    def _drop_legacy(self, node: str) -> None:
        """Take `node` out of an earlier version's out-of-service list in the record. Only the
        lease holder may change that list (the admission policy), so this takes the lease, and
        leaves it to the holder's count (which empties the list) when another holds it."""
        for _ in range(self.conflict_attempts):
            cm = self.calls.cm_get(kf.BUDGET_CONFIGMAP)
            if cm is None:
                return
            rec = kf.BudgetRecord.from_configmap(cm)
            if node not in rec.out:
                return
            if self._held(rec, self.clock()):
                return
            if rec.counter != self.instance:
                leased = self.calls.cm_write(self._leased(rec, cm.get("data") or {}))
                if leased is None:
                    continue
                rec = kf.BudgetRecord.from_configmap(leased)
            del rec.out[node]
            rec = replace(rec, counter="", counting_until=0.0)
            if self.calls.cm_write(rec.configmap(self.calls.namespace)) is not None:
                return
        raise TransientKubeError(f"budget record: {node} still listed after "
                                 f"{self.conflict_attempts} conflicting writes")

    # --- registrations ----------------------------------------------------------------------

    def register(self, v: BudgetView, node: str) -> None:
        """Count a node that is getting its first state: add it to its shard (idempotent), before
        its Node write (KubeTxn.commit; again after it, for a replay). Stamped REGISTER_AHEAD_S
        ahead of now (and never before the record's count): a count that begins while the write
        is in flight leaves it a registration; one that began before it landed reads it and
        counts the node (budget._count), so no count loses it (issue 36.7)."""
        when = max(self.clock() + self.register_ahead_s, v.record.counted)
        index = kf.shard_of(node, self.shards)
        nodes, rv = v.shards.get(index, ({}, None))
        base = v.shard_data.get(index)  # None: no such shard yet, created
        for attempt in range(self.conflict_attempts * 3):
            if node in nodes:
                return
            # Our key added to the shard as read, nothing else changed (what the policy admits).
            body = kf.shard_configmap(index, {node: when}, namespace=self.calls.namespace,
                                      resource_version=rv, base=base)
            written = self.calls.cm_write(body)
            if written is not None:
                v.shards[index] = (kf.parse_shard(written), written["metadata"].get("resourceVersion"))
                v.shard_data[index] = dict(written.get("data") or {})
                return
            self.sleep(min(0.2, 0.005 * 2 ** min(attempt, 5)) * (0.5 + self.rng()))
            cm = self.calls.cm_get(kf.shard_name(index))
            nodes, rv = ((kf.parse_shard(cm), cm["metadata"].get("resourceVersion")) if cm
                         else ({}, None))
            base = dict(cm.get("data") or {}) if cm else None
        raise TransientKubeError(f"fleet shard {index}: {node} not registered after "
                                 f"{self.conflict_attempts * 3} conflicting writes")


def _slot_index(name: str) -> Optional[int]:
    """k of `screener-budget-slot-<k>` (at most 7 digits, as parse_slot reads), else None."""
    tail = name[len(kf.SLOT_PREFIX):]
    return int(tail) if name.startswith(kf.SLOT_PREFIX) and tail.isdigit() and len(tail) <= 7 \
        and tail.isascii() else None


def _foreign(cm: Mapping[str, Any]) -> tuple[str, float]:
    """(uid, creation time) of a ConfigMap under a slot's name that is no claim; an unreadable
    creation time reads as long ago."""
    meta = cm.get("metadata") or {}
    try:
        created = datetime.fromisoformat(str(meta.get("creationTimestamp") or "")
                                         .replace("Z", "+00:00")).timestamp()
    except ValueError:
        created = 0.0
    return str(meta.get("uid") or ""), created


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
