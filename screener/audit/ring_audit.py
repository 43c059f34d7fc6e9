"""Check 2: the ring replay on audit steps, with its self-check and referee rounds.

Each rank replays its assigned owners' steps (ring.py's plan); one gather ("digests") of small
digests of every record: the rank's own (loss bits and gradient fingerprints), its replays of its
owners and, on a self-check audit, its replay of its own step. Only on a mismatch does a second
round run ("referee"): a rank on a third node replays the owner's step and full records are
gathered; ring.settle names the one the referee does not agree with ("ring_replay"). With fewer
than three nodes the mismatch is reported unsettled.

The judgments here are both auditors': a step that does not reproduce on its own rank is no
hardware verdict (`judge_self_check`), nor is most of the world disagreeing with its replays
(`conclude`). `RingAudit` is DDP's way to the records (replays local to each rank);
`ShardedRingAudit` the FSDP2/HSDP auditor's, in lockstep rounds (sharded_rounds.py): the owners'
batches travel to their replayers first, every rank runs one replay per round.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NoReturn, Optional, Protocol, Sequence

import torch

from screener.audit import ring
from screener.audit.alarms import SDCAlarm
from screener.audit.blast import LIKELY_CAUSES
from screener.audit.cadence import Cadence
from screener.audit.capture import StepState
from screener.audit.ddp_replay import LocalReplayer
from screener.audit.protocol import Walk, error_flag, raise_if_failed
from screener.audit.reporting import History, Reporter
from screener.audit.sharded_rounds import H_BYTES, H_LOCAL_MAG, H_STATUS, NO_BATCH, OK, Lockstep

__all__ = ["RingAudit", "ShardedRingAudit", "judge_self_check", "conclude", "MAX_NAMES"]

log = logging.getLogger("screener.audit")

MAX_NAMES = 8  # parameter (or module) names listed in evidence per disagreement


def _hex64(bits: int) -> str:
    return f"0x{bits & 0xFFFFFFFFFFFFFFFF:016x}"


def judge_self_check(reporter: Reporter, cadence: Cadence, step: int, own: torch.Tensor,
                     again: torch.Tensor) -> None:
    """Every rank's digest of its own step (own: (world, 4)) against its own replay of it
    (again): a step that does not reproduce where it ran is NumericFailure, not hardware."""
    cadence.self_checked()
    ranks = reporter.topology.ranks
    odd = [ranks[k] for k in range(len(ranks)) if not torch.equal(own[k], again[k])]
    if not odd:
        return
    loss_differs = [ranks[k] for k in range(len(ranks)) if int(own[k, 0]) != int(again[k, 0])]
    evidence = {"check": "self_replay", "ranks": odd, "loss_differs_on": loss_differs,
                "why": "the step does not reproduce on its own rank"}
    reporter.numeric(step, odd, evidence, reason=(
        f"step {step} does not reproduce on the rank that ran it (rank(s) "
        f"{', '.join(map(str, odd))}): the training step is not a deterministic function of "
        f"weights, batch, RNG state and loss scale, so no replay can judge the hardware; "
        f"{LIKELY_CAUSES}"))


def conclude(reporter: Reporter, history: History, step: int, mismatched: list[int],
             plan: dict[int, Optional[int]], suspects: set[int], unsettled: set[int],
             evidence: dict[str, Any], unit: Callable[[int], Any] = lambda r: r) -> NoReturn:
    """The verdict on the settled mismatches: SDCAlarm("ring_replay"), or NumericFailure when
    most owners disagree with their replayers (the setup, not a GPU). unit: what one fault
    reaches (a rank; under tensor parallel its TP group, which computes as one)."""
    topo = reporter.topology
    world = reporter.world_size
    named = sorted(suspects)
    # One faulty GPU spoils its own record and the replays it computes (2 of 3 owners in a
    # world of three one-rank nodes): when one unit is in every mismatched pair, the referees
    # on the third nodes settle it.
    pairs = [{unit(o), unit(r)} for o in mismatched if (r := plan[o]) is not None]
    one_gpu = len(topo.nodes) >= 3 and bool(pairs) and bool(set.intersection(*pairs))
    if 2 * len(mismatched) > world and not one_gpu:
        evidence["why"] = "most ranks disagree with their replayers"
        reporter.numeric(step, sorted(set(mismatched)), evidence, reason=(
            f"{len(mismatched)} of {world} ranks disagree with their replays at step {step}; "
            f"silent data corruption is local to one GPU, so the replays are not reproducing "
            f"the training step; {LIKELY_CAUSES}"))
    reporter.alarm(SDCAlarm("ring_replay", step, named, topo.suspect_nodes(named),
                            bool(named) and not unsettled, evidence,
                            candidate_ranks=sorted(suspects | unsettled),
                            first_suspect_step=history.window_start(history.last_clean_audit,
                                                                    step),
                            key=reporter.key("ring_replay", step)))


class RingAudit:
    """Check 2 for DDP: this rank's replays, the digests round and, on a mismatch, the referee."""

    def __init__(self, replayer: LocalReplayer, reporter: Reporter, history: History,
                 cadence: Cadence) -> None:
        self.replayer, self.reporter = replayer, reporter
        self.history, self.cadence = history, cadence
        self.topology = reporter.topology

    def run(self, walk: Walk, step: int, loss: torch.Tensor | float, grad_fp: torch.Tensor,
            states: dict[int, StepState]) -> None:
        """Replay, compare digests, settle a mismatch (raises), else count a clean audit."""
        replayer = self.replayer
        self_check = self.cadence.self_check_due
        mine, error = self._replay_mine(step, loss, grad_fp, states, self_check)
        flag = torch.zeros(1, 4, dtype=torch.int64)
        flag[0, 0] = error_flag(error)
        got = walk.gather("digests", torch.cat([flag, ring.record_digest(mine)]))
        raise_if_failed(got[:, 0, 0], self.topology.ranks, error, step, "the ring replay")
        digests = got[:, 1:]  # (world, 1 + M + 1, 4): own, replays, self-replay
        m = replayer.max_replays
        if self_check:
            judge_self_check(self.reporter, self.cadence, step, digests[:, 0], digests[:, 1 + m])
        index = self.topology.index_of
        mismatched = [o for o, r in sorted(replayer.plan.items()) if r is not None
                      and not torch.equal(digests[index(o), 0],
                                          digests[index(r), 1 + replayer.slot[o]])]
        if mismatched:
            self._settle(walk, step, mismatched, mine[:1 + m], states)
        self.history.last_clean_audit = step
        self.cadence.audit_passed()

    def _replay_mine(self, step: int, loss: torch.Tensor | float, grad_fp: torch.Tensor,
                     states: dict[int, StepState], self_check: bool
                     ) -> tuple[torch.Tensor, Optional[BaseException]]:
        """This rank's own record, its replays of its owners, and (on a self-check step) its
        replay of its own step: (1 + M + 1, 1 + P, 2), padded with zeros."""
        replayer = self.replayer
        own = ring.make_record(loss, grad_fingerprints=grad_fp)
        records = [own]
        error: Optional[BaseException] = None
        owners: list[Optional[int]] = list(replayer.my_replays)
        owners += [None] * (replayer.max_replays - len(replayer.my_replays))
        if self_check:
            owners.append(replayer.rank)
        for owner in owners:
            if owner is None or error is not None:
                records.append(torch.zeros_like(own))
                continue
            try:
                rl, rg = replayer.replay(owner, step, states[owner])
                records.append(ring.make_record(rl, rg))
            except Exception as e:  # noqa: BLE001 - reported collectively by the caller
                error = e
                records.append(torch.zeros_like(own))
        if not self_check:
            records.append(torch.zeros_like(own))
        return torch.stack(records), error

    def _settle(self, walk: Walk, step: int, mismatched: list[int], mine: torch.Tensor,
                states: dict[int, StepState]) -> NoReturn:
        """Second round after a ring mismatch: referees on a third node replay; full records."""
        plan = self.replayer.plan
        referee = {o: ring.referee_of(self.topology, o, plan[o]) for o in mismatched}
        got, ref_slot = self._referee_round(walk, step, mismatched, referee, mine, states)
        suspects: set[int] = set()
        unsettled: set[int] = set()
        cases = [self._judge_case(o, referee[o], ref_slot, got, suspects, unsettled)
                 for o in mismatched]
        evidence = {"mismatches": cases, "audit_every": self.cadence.audit_every,
                    "last_clean_audit": self.history.last_clean_audit}
        conclude(self.reporter, self.history, step, mismatched, plan, suspects, unsettled,
                 evidence)

    def _referee_round(self, walk: Walk, step: int, mismatched: list[int],
                       referee: dict[int, Optional[int]], mine: torch.Tensor,
                       states: dict[int, StepState]) -> tuple[torch.Tensor, dict[int, int]]:
        """Each referee replays the owners it referees; every rank sends its full records (own,
        replays, referee replays, status) in one gather. Returns the gathered records and each
        owner's slot among its referee's replays."""
        by_referee: dict[int, list[int]] = {}
        for o in mismatched:
            ref = referee[o]
            if ref is not None:
                by_referee.setdefault(ref, []).append(o)
        ref_slot = {o: i for owners in by_referee.values() for i, o in enumerate(owners)}
        m2 = max((len(v) for v in by_referee.values()), default=0)
        extra: list[torch.Tensor] = []
        error: Optional[BaseException] = None
        for owner in by_referee.get(self.replayer.rank, []):
            try:
                rl, rg = self.replayer.replay(owner, step, states[owner])
                extra.append(ring.make_record(rl, rg))
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
                extra.append(torch.zeros_like(mine[0]))
        while len(extra) < m2:
            extra.append(torch.zeros_like(mine[0]))
        status = torch.zeros_like(mine[0])
        status[0, 0] = error_flag(error)
        full = torch.cat([mine, torch.stack(extra + [status])])  # (1 + M + m2 + 1, 1 + P, 2)
        got = walk.gather("referee", full)
        raise_if_failed(got[:, -1, 0, 0], self.topology.ranks, error, step,
                        "the ring replay referee")
        return got, ref_slot

    def _judge_case(self, o: int, ref: Optional[int], ref_slot: dict[int, int], got: torch.Tensor,
                    suspects: set[int], unsettled: set[int]) -> dict[str, Any]:
        """One mismatched owner: who the referee's result agrees with. Adds to suspects or
        unsettled, and returns the case for the alarm's evidence."""
        replayer = self.replayer
        index = self.topology.index_of
        r = replayer.plan[o]
        assert r is not None
        a, b = got[index(o), 0], got[index(r), 1 + replayer.slot[o]]
        c = got[index(ref), 1 + replayer.max_replays + ref_slot[o]] if ref is not None else None
        differ = ring.differing_rows(a, b)
        case: dict[str, Any] = {
            "owner": o, "replayer": r, "referee": ref,
            "loss": {"owner": ring.bits_to_float(int(a[0, 0])),
                     "replayer": ring.bits_to_float(int(b[0, 0]))},
            "loss_bits": {"owner": _hex64(int(a[0, 0])), "replayer": _hex64(int(b[0, 0]))},
            "differs": self._row_names(differ),
            "n_differ": len(differ),
        }
        if c is not None:
            case["loss"]["referee"] = ring.bits_to_float(int(c[0, 0]))
            case["loss_bits"]["referee"] = _hex64(int(c[0, 0]))
        case["verdict"] = ring.settle(o, r, ref, a, b, c, suspects, unsettled)
        return case

    def _row_names(self, rows: Sequence[int]) -> list[str]:
        names = self.replayer.params.grad_names
        return ["loss" if r == 0 else names[r - 1] for r in rows][:MAX_NAMES]


class ShardVote(Protocol):
    """What check 2 asks of HSDP's weight check (weight_check.ShardedWeightCheck)."""

    def confined(self, ranks: set[int]) -> bool: ...

    def check(self, walk: Walk, step: int, *,
              context: Optional[dict[str, Any]] = ...) -> None: ...


class ShardedRingAudit:
    """Check 2 for FSDP2/HSDP: the owners' batches shipped, lockstep replay rounds, the digests
    round and, on a mismatch, a referee's lockstep rounds."""

    def __init__(self, lockstep: Lockstep, reporter: Reporter, history: History,
                 cadence: Cadence, module_names: list[str], hsdp: bool,
                 weights: Optional["ShardVote"] = None) -> None:
        self.lockstep, self.reporter = lockstep, reporter
        self.weights = weights
        self.history, self.cadence = history, cadence
        self.module_names, self.hsdp = module_names, hsdp
        self.topology = reporter.topology
        self.counters = cadence.counters

    def run(self, walk: Walk, step: int, got: torch.Tensor, states: dict[int, StepState],
            loss: torch.Tensor, own_fps: torch.Tensor, batch: Any,
            data: Optional[torch.Tensor]) -> None:
        """Check 2 on an audit step whose head (got) every rank gathered; raises on a verdict."""
        topo, lockstep = self.topology, self.lockstep
        if bool((got[:, H_STATUS] != OK).any()):
            self.counters["audits_skipped"] += 1
            missing = [topo.ranks[k] for k in range(got.shape[0])
                       if int(got[k, H_STATUS]) == NO_BATCH]
            log.info("screener.audit: step %d not audited (%s)", step,
                     f"no batch= from rank(s) {missing}" if missing else
                     "gradients were not recorded for it on some rank: steps not consecutive?")
            return
        sizes = {r: int(got[k, H_BYTES]) for k, r in enumerate(topo.ranks)}
        plan = lockstep.plan
        mine = lockstep.owners_of.get(lockstep.rank, [])
        received = lockstep.ship(walk, "audit_ship", {o: plan[o] for o in topo.ranks
                                                      if plan[o] is not None}, data, sizes)
        own = torch.cat([torch.tensor([[ring.loss_bits(loss), 1],
                                       [int(got[topo.index_of(lockstep.rank), H_LOCAL_MAG]), 1]]),
                         own_fps])
        records = [own]
        for i in range(lockstep.rounds):
            owner = mine[i] if i < len(mine) else None
            b = received[owner] if owner is not None else batch
            rec = lockstep.replay(walk, "replay", b,
                                  states[owner if owner is not None else lockstep.rank])
            records.append(rec if owner is not None else torch.zeros_like(own))
        self_check = self.cadence.self_check_due
        records.append(lockstep.replay(walk, "self_replay", batch, states[lockstep.rank])
                       if self_check else torch.zeros_like(own))
        stacked = torch.stack(records)
        digests = walk.gather("digests", ring.record_digest(stacked))
        if self_check:
            judge_self_check(self.reporter, self.cadence, step, digests[:, 0], digests[:, -1])
        index = topo.index_of
        slot = {o: lockstep.owners_of[r].index(o) for o, r in plan.items() if r is not None}
        mismatched = [o for o, r in sorted(plan.items()) if r is not None and not
                      torch.equal(digests[index(o), 0], digests[index(r), 1 + slot[o]])]
        if mismatched:
            self._settle(walk, step, mismatched, stacked, states, slot, batch, data, sizes)
        self.history.last_clean_audit = step
        self.cadence.audit_passed()

    def _settle(self, walk: Walk, step: int, mismatched: list[int], stacked: torch.Tensor,
                states: dict[int, StepState], slot: dict[int, int], batch: Any,
                data: Optional[torch.Tensor], sizes: dict[int, int]) -> NoReturn:
        """Referees on a third node replay the mismatched owners in lockstep; full records."""
        topo, lockstep = self.topology, self.lockstep
        plan = lockstep.plan
        # under tensor parallel a TP group replays together: the mismatched owners' partners
        # are refereed too (replayed, not judged); the plan maps groups onto groups
        refereed = lockstep.tp.close(mismatched) if lockstep.tp is not None else mismatched
        referee = {o: ring.referee_of(topo, o, plan[o]) for o in refereed}
        received = lockstep.ship(walk, "referee_ship", referee, data, sizes)
        by_referee: dict[int, list[int]] = {}
        for o, r in referee.items():
            if r is not None:
                by_referee.setdefault(r, []).append(o)
        rounds = max((len(v) for v in by_referee.values()), default=0)
        extra = []
        for i in range(rounds):
            mine = by_referee.get(lockstep.rank, [])
            owner = mine[i] if i < len(mine) else None
            rec = lockstep.replay(walk, "referee_replay",
                                  received[owner] if owner is not None else batch,
                                  states[owner if owner is not None else lockstep.rank])
            extra.append(rec if owner is not None else torch.zeros_like(rec))
        full = walk.gather("referee", torch.cat([stacked] + ([torch.stack(extra)] if extra
                                                             else [])))
        index = topo.index_of
        suspects: set[int] = set()
        unsettled: set[int] = set()
        cases = []
        for o in mismatched:
            r, ref = plan[o], referee[o]
            assert r is not None
            a, b = full[index(o), 0], full[index(r), 1 + slot[o]]
            c = None if ref is None else full[index(ref), stacked.shape[0]
                                              + by_referee[ref].index(o)]
            cases.append(self._case(o, r, ref, a, b, c, suspects, unsettled))
        evidence = {"mismatches": cases, "audit_every": self.cadence.audit_every,
                    "last_clean_audit": self.history.last_clean_audit, "sharding":
                    "hsdp" if self.hsdp else "fsdp"}
        # A corrupted HSDP weight shard reaches its whole shard group through the all-gather:
        # every record computed there is off, so most owners mismatch and the blast-radius rule
        # would call it software. When the referees' verdicts stay inside one replica (or one
        # shard's holders), the shard replicas vote first; a vote that names a rank settles it.
        if self.weights is not None and not unsettled and self.weights.confined(suspects):
            self.weights.check(walk, step,
                               context={"alarm": "ring_replay", "suspects": sorted(suspects),
                                        "mismatches": cases})
        tp = lockstep.tp
        conclude(self.reporter, self.history, step, mismatched, plan, suspects, unsettled,
                 evidence, unit=tp.group_of if tp is not None else lambda r: r)

    def _case(self, o: int, r: int, ref: Optional[int], a: torch.Tensor, b: torch.Tensor,
              c: Optional[torch.Tensor], suspects: set[int], unsettled: set[int]
              ) -> dict[str, Any]:
        differ = ring.differing_rows(a, b)
        case: dict[str, Any] = {
            "owner": o, "replayer": r, "referee": ref,
            "differs": [("loss" if k == 0 else "largest gradient magnitude" if k == 1 else
                         self.module_names[k - 2]) for k in differ][:MAX_NAMES],
            "n_differ": len(differ)}
        case["verdict"] = ring.settle(o, r, ref, a, b, c, suspects, unsettled)
        return case
