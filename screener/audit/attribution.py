"""Between audits: the spike sentinel on every step, and a spike's attribution before the update.

sentinel.py decides whether a step's loss or gradient magnitude is a spike. When it fires, the
step is attributed before the optimizer applies it: the suspect (the rank with the largest value)
reruns its step, a rank on another node (its confirmer) and a referee on a third replay it, and
every other rank reruns its own step, all in one round ("rerun"). The other ranks' reruns must
reproduce their own steps, or no rerun can judge anything (NumericFailure). sentinel.rerun_verdict
then says "data" (no alarm; with on_data="skip" the step's gradients are dropped), a transient or
persistent fault of the suspect (SDCAlarm("spike_rerun") with the last verified checkpoint as
rollback target), or unsettled.

`SpikeWatch` (the sentinel step) and `conclude_spike` (the verdict) are both auditors'; `LocalRerun`
is DDP's round (replays local to each rank), `LockstepRerun` the FSDP2/HSDP auditor's (the
suspect's batch shipped to its helpers, one lockstep replay on every rank; sharded_rounds.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import torch

from screener.audit import ring
from screener.audit.alarms import SDCAlarm
from screener.audit.blast import LIKELY_CAUSES
from screener.audit.capture import StepState
from screener.audit.ddp_replay import LocalReplayer
from screener.audit.hooks import largest_magnitude
from screener.audit.protocol import OK, Walk, error_flag, raise_if_failed
from screener.audit.reporting import Reporter
from screener.audit.sentinel import Rerun, Sentinel, Spike, rerun_verdict
from screener.audit.sharded_rounds import H_LOCAL_MAG, H_LOSS, Lockstep
from screener.fingerprint import fingerprints

__all__ = ["SpikeWatch", "LocalRerun", "LockstepRerun", "refuse_irreproducible",
           "conclude_spike"]

# attribute(spike, suspect) -> "data" | "unattributed", or raises for a fault
Attribute = Callable[[Spike, int], str]


class SpikeWatch:
    """The sentinel on a step without an audit: a spike, its suspect, and its attribution."""

    def __init__(self, sentinel: Sentinel, reporter: Reporter, counters: Counter[str]) -> None:
        self.sentinel, self.reporter, self.counters = sentinel, reporter, counters

    def step(self, step: int, losses: list[float], local: list[float], grad: float,
             attribute: Attribute, params: Sequence[Any]) -> bool:
        """The spike test on every rank's |loss| and local magnitude (gathered, in rank order)
        and the gradient value the sentinel follows. Returns True when the step's gradients were
        dropped (a data spike with on_data="skip"); raises SDCAlarm when a rank's hardware did
        it."""
        spike = self.sentinel.check(max(losses), grad)
        if spike is None:
            return False
        self.counters["sentinel_fired"] += 1
        column = losses if spike.what == "loss" else local
        ranks = self.reporter.topology.ranks
        suspect = ranks[max(range(len(ranks)), key=lambda k: column[k])]
        outcome = attribute(spike, suspect)
        self.reporter.log(logging.WARNING, "sentinel", step=step, spike=spike.to_dict(),
                          suspect=suspect, outcome=outcome)
        self.counters[f"sentinel_{outcome}"] += 1
        self.sentinel.accept("loss", max(losses))  # "data" or "unattributed": a fault raised
        self.sentinel.accept("grad", grad)
        if outcome == "data" and self.sentinel.config.on_data == "skip":
            for p in params:
                p.grad = None
            return True
        return False


def refuse_irreproducible(reporter: Reporter, step: int, suspect: int, odd: list[int]) -> None:
    """The ranks that reran their own steps beside the attribution must have reproduced them."""
    if odd:
        reporter.numeric(step, odd, {"check": "spike_rerun", "ranks": odd}, reason=(
            f"step {step} does not reproduce on rank(s) {', '.join(map(str, odd))} that "
            f"reran it, so no rerun can judge the spike on rank {suspect}; {LIKELY_CAUSES}"))


def conclude_spike(reporter: Reporter, counters: Counter[str], step: int, spike: Spike,
                   suspect: int, helpers: tuple[Optional[int], Optional[int]],
                   original: tuple[int, int], rerun: Rerun, replays: list[Optional[Rerun]],
                   others: list[int], rollback: tuple[Optional[int], Optional[str]],
                   group: Sequence[int] = ()) -> str:
    """The verdict on a spike from the suspect's original (loss bits, magnitude bits), its own
    rerun and the replays of its confirmer and referee (`helpers`). Returns "data"; raises
    SDCAlarm("spike_rerun") otherwise. rollback: (last verified step, the checkpoint it saved).
    group: the suspect's tensor-parallel group, which computes as one, so a fault anywhere in it
    shows on every rank of it: a fault names the group (one node), not the rank that showed it
    largest."""
    confirmer, referee = helpers
    verdict = rerun_verdict(original, rerun, replays)
    if verdict == "data":
        return "data"
    # A settled verdict needs evidence that steps reproduce here: the other ranks' reruns
    # just did, or a self-check passed earlier.
    proven = bool(others) or counters["self_checks"] > 0
    evidence = {"spike": spike.to_dict(), "suspect": suspect, "confirmer": confirmer,
                "referee": referee, "verdict": verdict, "reproduced_by": others,
                "loss": {"original": ring.bits_to_float(original[0]),
                         "rerun": ring.bits_to_float(rerun[0])},
                "largest_gradient": {"original": ring.bits_to_float(original[1]),
                                     "rerun": ring.bits_to_float(rerun[1])},
                "rollback_target": rollback[1], "last_verified_step": rollback[0]}
    named = sorted(set(group) | {suspect}) if verdict in ("transient", "persistent") else []
    settled = bool(named) and referee is not None and proven
    reporter.alarm(SDCAlarm("spike_rerun", step, named if settled else (),
                            reporter.topology.suspect_nodes(named) if settled else (), settled,
                            evidence, candidate_ranks=named if settled else
                            [suspect] + [r for r in helpers if r is not None],
                            first_suspect_step=step, key=reporter.key("spike_rerun", step)))


class LocalRerun:
    """DDP's attribution round: each rank recomputes its share locally; one gather of results."""

    def __init__(self, replayer: LocalReplayer, reporter: Reporter, counters: Counter[str]) -> None:
        self.replayer, self.reporter, self.counters = replayer, reporter, counters

    def attribute(self, walk: Walk, step: int, spike: Spike, suspect: int,
                  states: Callable[[], dict[int, StepState]], g: torch.Tensor,
                  rollback: tuple[Optional[int], Optional[str]]) -> str:
        """The suspect reruns its step, a rank on another node and a referee on a third replay
        it, and every other rank reruns its own step; one gather of what each got (g: the
        step's gathered head). Returns "data" or "unattributed"; raises SDCAlarm for a fault."""
        replayer = self.replayer
        if not replayer.can_replay:
            return "unattributed"  # nothing to rerun with: a spike alone is no verdict
        topo = self.reporter.topology
        index = topo.index_of
        original = (ring.loss_bits(float(g[index(suspect), 0])),
                    ring.loss_bits(float(g[index(suspect), 1])))
        owner_states = states()
        confirmer = replayer.confirmer(suspect, {suspect})
        referee = ring.referee_of(topo, suspect, confirmer)
        helpers = [r for r in (confirmer, referee) if r is not None]
        owner = suspect if replayer.rank in [suspect] + helpers else replayer.rank
        row = torch.zeros(5, dtype=torch.int64)
        error: Optional[BaseException] = None
        try:
            rl, rg = replayer.replay(owner, step, owner_states[owner])
            d = fingerprints([fingerprints(rg)])[0]
            mag = float(largest_magnitude(rg, torch.device("cpu")))
            row = torch.tensor([OK, ring.loss_bits(rl), ring.loss_bits(mag), int(d[0]),
                                int(d[1])], dtype=torch.int64)
        except Exception as e:  # noqa: BLE001 - reported collectively below
            error = e
            row[0] = error_flag(e)
        got = walk.gather("rerun", row)
        raise_if_failed(got[:, 0], topo.ranks, error, step, "the spike rerun")
        others = [r for r in topo.ranks if r not in [suspect] + helpers]
        refuse_irreproducible(self.reporter, step, suspect, [
            r for r in others if int(got[index(r), 2]) != ring.loss_bits(float(g[index(r), 1]))])

        def rerun(r: Optional[int]) -> Optional[Rerun]:
            if r is None:
                return None
            a, b, c, d = (int(x) for x in got[index(r), 1:])
            return a, b, c, d

        mine = rerun(suspect)
        assert mine is not None
        return conclude_spike(self.reporter, self.counters, step, spike, suspect,
                              (confirmer, referee), original, mine,
                              [rerun(confirmer), rerun(referee)], others, rollback)


def _rerun_key(record: torch.Tensor) -> Rerun:
    """A lockstep replay record (loss row, magnitude row, module fingerprints) as a Rerun."""
    d = fingerprints([record[2:]])[0]
    return int(record[0, 0]), int(record[1, 0]), int(d[0]), int(d[1])


class LockstepRerun:
    """FSDP2/HSDP's attribution round: the suspect's batch shipped to its helpers, one lockstep
    replay on every rank, one gather of the records."""

    def __init__(self, lockstep: Lockstep, reporter: Reporter, counters: Counter[str]) -> None:
        self.lockstep, self.reporter, self.counters = lockstep, reporter, counters

    def attribute(self, walk: Walk, step: int, spike: Spike, suspect: int, got: torch.Tensor,
                  state: StepState, batch: Any, data: Optional[torch.Tensor],
                  rollback: tuple[Optional[int], Optional[str]]) -> str:
        """The suspect reruns its step, a rank on another node and a referee on a third replay
        it, every other rank reruns its own (got: the step's gathered head). Returns "data" or
        "unattributed"; raises on a fault."""
        lockstep = self.lockstep
        topo = self.reporter.topology
        offer = lockstep.offer(walk, "rerun_offer", step, batch, data, state)
        if not (lockstep.can_replay and offer.ready):
            return "unattributed"  # nothing to rerun with: a spike alone is no verdict
        confirmer = lockstep.confirmer(suspect, {suspect})
        referee = ring.referee_of(topo, suspect, confirmer)
        helpers = [r for r in (confirmer, referee) if r is not None]
        # who replays whose batch: the suspect's helpers, and under tensor parallel its TP
        # partners' helpers too (the helpers' partners), so every TP group computes together
        helped: dict[int, int] = {h: suspect for h in helpers}
        tp = lockstep.tp
        if tp is not None:
            for h in helpers:
                helped.update({p: m for m, p in tp.spread(suspect, h).items()})
        received = lockstep.ship(walk, "rerun_ship", [(m, h) for h, m in sorted(helped.items())],
                                 offer.data, offer.sizes)
        owner = helped.get(lockstep.rank)
        rec = lockstep.replay(walk, "rerun_replay",
                              received.get(owner) if owner is not None else offer.batch,
                              offer.states[owner if owner is not None else lockstep.rank])
        full = walk.gather("rerun", rec)
        index = topo.index_of
        original = (int(got[index(suspect), H_LOSS]), int(got[index(suspect), H_LOCAL_MAG]))
        # The other ranks reran their own steps in the same round: they must reproduce them, or
        # no rerun can judge anything. (The suspect's TP partners computed with it: a transient
        # fault of the suspect's is gone from their reruns too, so they are no such witness.)
        group = set(tp.group_of(suspect)) if tp is not None else {suspect}
        others = [r for r in topo.ranks if r not in group and r not in helped]
        refuse_irreproducible(self.reporter, step, suspect, [
            r for r in others if int(full[index(r), 1, 0]) != int(got[index(r), H_LOCAL_MAG])])
        return conclude_spike(self.reporter, self.counters, step, spike, suspect,
                              (confirmer, referee), original, _rerun_key(full[index(suspect)]),
                              [None if r is None else _rerun_key(full[index(r)])
                               for r in (confirmer, referee)], others, rollback,
                              group=sorted(group))
