"""The in-job audit for pipeline parallel training (torch.distributed.pipelining), FSDP2 per stage.

    stage = PipelineStage(fully_shard(stage_module, mesh=mesh["dp"]), s, pp, device,
                          group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)   # or ScheduleGPipe
    auditor = Auditor(schedule, audit_every=50)
    for step in range(start, total):
        losses = []
        if first: schedule.step(tokens)                     ; batch = tokens
        elif last: schedule.step(target=labels, losses=losses); batch = labels
        else: schedule.step()                                ; batch = None
        auditor.check_gradients(step, losses, batch=batch)  # check 1 every step, 2 on audit steps
        optimizer.step(); optimizer.zero_grad()
        auditor.check_weights(step)                          # the shard record, no collective

The job is a grid: pipelines (one rank per stage, joined by the schedule's sends and receives)
across which data parallelism runs stage by stage (each stage's module sharded with fully_shard
over the ranks that hold that stage, the stage's data-parallel group). `batch` is what this rank
handed the schedule: the inputs on the first stage (a tensor, or a tuple of them), the target on
the last, None in between; `losses` the list the schedule filled on the last stage.

What each rank records (pipeline_plan.py has the rule that reads it): the fingerprints of what its
stage sent forward (every micro-batch's outputs, in order; the last stage's losses with them), of
what it sent back (the gradients of its inputs) and of its local weight gradient (FSDP's
reduce-scatter inputs, fsdp_tap.py), and whether each of those was finite.

Check 1 (every step, one all_gather of every rank's record row): a loss or a record that is not
finite is located along the step's data flow (the first stage whose forward output, else the last
whose backward output, went NaN/Inf), and that pipeline's step is replayed by another pipeline
on other nodes (a lockstep round, below): finite there names the rank at that stage
("nonfinite_local", settled); not finite there is the data or the model (NumericFailure, exit 76).
At an audit step the records carry fingerprints, and the rank named is the one where the
finite replay first parts from the step (upstream of the first NaN/Inf when a huge finite value
overflowed downstream). A reduced gradient that is not finite from finite inputs:
"nonfinite_reduced", unsettled, the stage's data-parallel ranks the candidates.

Check 2 (audit steps): pipeline d + shift replays pipeline d's step (its inputs travel to the
replayer's first stage, its target to the replayer's last, every rank's RNG state to the rank
at its stage), through the job's own schedule: every pipeline runs exactly one schedule step per
round, so the stages' all-gathers line up as in training, and the recorders skip the
reductions; gradients and buffers are put back, bit for bit. Owner and replay are compared stage
by stage; a difference is settled by a referee (pipeline d + referee_shift, a third node at every
stage), whose run agrees with one of them, and the rank of the other at the stage where the two
parted is named ("ring_replay"). On the first audit and every self_check_every after, each
pipeline also replays its own step: a step that does not reproduce where it ran is no hardware
verdict (NumericFailure).

The shard record (check_weights, every weights_every steps after optimizer.step()): each rank
fingerprints its own weight shards, and the next check_gradients compares them with the shards
then (a column of the head): a shard that changed in between, with no optimizer step, is named
on its rank ("weights", settled). No stage has a replica under FSDP2, so there is no vote.

Tensor parallel inside the stages (parallelize_module over a "tp" mesh dimension, then
fully_shard over "dp"): a stage's TP ranks belong to pipelines that compute as one; every round
moves whole TP groups of pipelines, coordinate onto coordinate (pipeline_plan.py).

Audited schedules: ScheduleGPipe and Schedule1F1B (one stage per rank; both run the backward of
micro-batch 0 first and accumulate in micro-batch order, and the replay runs the same schedule).
Refused, one line each: schedules with several stages per rank (interleaved 1F1B, looped BFS,
zero-bubble, DualPipeV), a stage not sharded with fully_shard (DDP per stage: torch's pipelining
runs it only with static_graph=True, under which DDP reduces in some micro-batches' backward and
not once per step, so no hook sees a step's gradient whole), a grid
where no pipeline can replay another with every stage on another node. Not run under pipeline
parallel: a weight vote (no stage has a replica under FSDP2) and the redo of a bad reduction.

The spike sentinel (steps without an audit, after its warm-up; the warm-up steps are audited):
the last stage's loss and every rank's largest local gradient magnitude (in the head) against
the baselines; on a spike the suspect's pipeline (with its TP group) reruns its step while the
next pipeline on other nodes and the referee pipeline replay it and every other pipeline reruns
its own, one lockstep round. All reproduce it: the data. The rerun reproduces it and the replays
agree on another value: persistent, named at the stage where the rerun parts from the replay
(both carry fingerprints). The rerun agrees with the replays: a fault of that step alone, whose
records carry no fingerprints to say the stage: the pipeline's ranks are named, settled when
they share one node.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from screener.audit.alarms import AuditUsageError, SDCAlarm
from screener.audit.blast import LIKELY_CAUSES
from screener.audit.base import AuditorBase
from screener.audit.cadence import Cadence
from screener.audit.capture import StateCodec, StepState, capture, restored
from screener.audit.collective import comm_device, exchange
from screener.audit.config import AuditConfig
from screener.audit.fsdp_tap import fsdp_module_class, install_recorders, scan
from screener.audit.layout import tensor_parallel_group
from screener.audit.pipeline_plan import R_BWD, R_FINITE, R_FWD, R_GRAD, R_LOSS, R_MAG, R_STATUS, \
    RECORD, PipelinePlan, Pipelines, first_difference, first_nonfinite, plan, settle_pipelines
from screener.audit.protocol import Schedule, Walk
from screener.audit.refusals import refuse_placement, refuse_unreplayable
from screener.audit.reporting import History, Reporter
from screener.audit.ring import bits_to_float, loss_bits
from screener.audit.attribution import SpikeWatch, refuse_irreproducible
from screener.audit.sentinel import Sentinel, SentinelConfig, Spike, rerun_verdict
from screener.audit.sharded_rounds import decode_batch, encode_batch
from screener.audit.topology import gather_topology, job_name
from screener.fingerprint import fingerprints

__all__ = ["PipelineAuditor", "is_pipeline_schedule", "PIPELINE_STEP", "AUDITED_SCHEDULES"]

log = logging.getLogger("screener.audit")

AUDITED_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
OK, NO_BATCH, NOT_RECORDED = 0, 1, 2  # a rank's status in its record row
# the head: the record row, then whether the reduced gradient was finite and whether this rank's
# weight shards changed since the last check_weights
_H_REDUCED, _H_DRIFT = RECORD, RECORD + 1

# The collectives of check_gradients, in the one order every rank runs them (protocol.py): the
# head every step; a non-finite step's offer (batch sizes, RNG states), batches and lockstep
# replay; an audit step's states, batches, replay and self-replay; on a mismatch the referees'
# batches and replay. Every p2p round ("*_ship") is entered by every rank.
PIPELINE_STEP = Schedule("check_gradients (pipeline parallel)", (
    "head", "confirm_offer", "confirm_ship", "confirm", "rerun_offer", "rerun_ship", "rerun",
    "audit_states", "audit_ship", "replay",
    "self_replay", "referee_ship", "referee"), fixed=("head",))


def is_pipeline_schedule(obj: Any) -> bool:
    """Whether obj is a torch.distributed.pipelining schedule (without importing pipelining)."""
    return any(c.__module__.startswith("torch.distributed.pipelining")
               and c.__name__.startswith(("Schedule", "PipelineSchedule", "_PipelineSchedule"))
               for c in type(obj).__mro__)


def _fold(prev: Optional[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of a sequence of tensors, one more appended (order matters)."""
    fp = fingerprints([t.detach()])[0]
    return fp if prev is None else fingerprints([torch.stack([prev, fp])])[0]


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class _StageRecord:
    """What one run of a step (the training step, or a replay) sent forward and back."""

    def __init__(self, fingerprinting: bool) -> None:
        self.fingerprinting = fingerprinting
        self.fwd: Optional[torch.Tensor] = None
        self.bwd: Optional[torch.Tensor] = None
        self.fwd_finite = True
        self.bwd_finite = True

    def forward(self, outputs: Any) -> None:
        for t in _tensors(outputs):
            self.fwd_finite &= scan(t)[0]
            if self.fingerprinting:
                self.fwd = _fold(self.fwd, t)

    def backward(self, grad: torch.Tensor) -> None:
        self.bwd_finite &= scan(grad)[0]
        if self.fingerprinting:
            self.bwd = _fold(self.bwd, grad)

    def row(self, losses: Sequence[Any], grad_fps: Optional[torch.Tensor], grad_finite: bool,
            status: int, mag: float = 0.0) -> torch.Tensor:
        out = torch.zeros(RECORD, dtype=torch.int64)
        out[R_STATUS] = status
        out[R_MAG] = loss_bits(float(mag))
        loss_ok = True
        if losses:
            stacked = torch.stack([torch.as_tensor(x).detach().reshape(()).float()
                                   for x in losses])
            loss_ok = bool(torch.isfinite(stacked).all())
            out[R_LOSS] = loss_bits(float(stacked.double().sum()))
            if self.fingerprinting:
                self.fwd = _fold(self.fwd, stacked)
        if self.fwd is not None:
            out[R_FWD:R_FWD + 2] = self.fwd
        if self.bwd is not None:
            out[R_BWD:R_BWD + 2] = self.bwd
        if grad_fps is not None:
            out[R_GRAD:R_GRAD + 2] = fingerprints([grad_fps])[0]
        out[R_FINITE] = int(self.fwd_finite and loss_ok)
        out[R_FINITE + 1] = int(self.bwd_finite)
        out[R_FINITE + 2] = int(grad_finite)
        return out


class PipelineAuditor(AuditorBase):
    """Checks 1 and 2 for a pipeline-parallel job; see the module docstring.

    schedule: this rank's ScheduleGPipe or Schedule1F1B over a PipelineStage whose module is
    sharded with fully_shard over the stage's data-parallel ranks. audit_every, self_check_every,
    weights_every (the shard record), job, alarm_dir, start_step as for the other auditors. Refuses (AuditUsageError, one line, on
    every rank alike) what it cannot replay bit for bit.
    """

    def __init__(self, schedule: Any, *, audit_every: int = 50, weights_every: int = 100,
                 self_check_every: int = 20,
                 job: Optional[str] = None, alarm_dir: Optional[str | os.PathLike[str]] = None,
                 start_step: Optional[int] = None, sentinel: Optional[SentinelConfig] = None,
                 **unsupported: Any) -> None:
        given = sorted(k for k, v in unsupported.items() if v is not None)
        if given:
            raise AuditUsageError(f"screener.audit: pipeline parallel takes no {', '.join(given)} "
                                  f"(the replays run the job's schedule, so no loss_fn or "
                                  f"batch_fn; no GradScaler, accumulation_steps or custom "
                                  f"topology under pipeline parallel yet)")
        self.config = AuditConfig(audit_every=audit_every, weights_every=weights_every,
                                  self_check_every=self_check_every,
                                  job=job_name() if job is None else job,
                                  alarm_dir=None if alarm_dir is None else os.fspath(alarm_dir))
        self.schedule = schedule
        refusal, stage = _refusal(schedule)
        self.stage = stage
        self.module: torch.nn.Module = stage.submod if stage is not None else torch.nn.Module()
        if not refusal:
            refuse_unreplayable(self.module)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        params = list(self.module.parameters())
        local = params[0].to_local() if params and hasattr(params[0], "to_local") else \
            (params[0] if params else torch.empty(0))
        self.device = local.device
        self._comm = comm_device(None, self.device)
        self._codec = StateCodec(self.device)
        group = dist.get_process_group_ranks(stage.group) if stage is not None else []
        tp = tensor_parallel_group(list(self.module.named_parameters()), self.rank)
        if isinstance(tp, str):
            refusal = refusal or f"screener.audit: pipeline parallel: {tp}"
            tp = (self.rank,)
        mine = json.dumps([int(getattr(stage, "stage_index", -1)),
                           int(getattr(stage, "num_stages", 0)), [int(g) for g in group],
                           [int(r) for r in tp]])
        self.topology = gather_topology(None, device=self.device, layout=mine, refusal=refusal)
        me = self.topology.info(self.rank)
        self.hostname, self.node = me.hostname, me.node
        self.plan = self._agree([i.refusal for i in self.topology.infos],
                                [(i.rank, *json.loads(i.layout or "[-1, 0, [], []]"))
                                 for i in self.topology.infos])
        refuse_placement(self.device, [i.threads for i in self.topology.infos])
        self.pipelines = self.plan.pipelines
        self.pipe, self.stage_index = self.pipelines.where(self.rank)
        self.first = self.stage_index == 0
        self.last = self.stage_index == self.pipelines.stages - 1

        self.counters: Counter[str] = Counter()
        self.history = History()
        self.reporter = Reporter(self.topology, self.rank, self.world_size, job=self.config.job,
                                 alarm_dir=self.config.alarm_dir)
        self.sentinel = Sentinel(sentinel)
        guard = self.sentinel.config.warmup if self.sentinel.config.enabled else 0
        # the first steps are audited while the sentinel has no baseline (cadence.py)
        self.cadence = Cadence(audit_every, weights_every, self_check_every, True, self.counters,
                               guard=guard)
        self.spikes = SpikeWatch(self.sentinel, self.reporter, self.counters)
        self._tap, self.module_names = install_recorders(self.module)
        self._tap.record = start_step is None or self.is_audit_step(start_step)
        self._record = _StageRecord(self._tap.record)
        self._replaying = False
        self._state: Optional[StepState] = None
        self._hooks = [self.module.register_forward_pre_hook(self._on_forward),
                       self.module.register_forward_hook(self._on_output)]
        self._closed = False
        self._shards: Optional[torch.Tensor] = None  # fingerprints at the last check_weights

    # ---- set-up -----------------------------------------------------------------------------

    def _agree(self, refusals: list[str], entries: list[tuple[Any, ...]]) -> PipelinePlan:
        """The grid and the replay plan from what every rank said (the same on every rank)."""
        why = next((r for r in refusals if r), "")
        if why:
            raise AuditUsageError(why)
        pipes = Pipelines.from_groups([(int(r), int(s), int(n), list(g))
                                       for r, s, n, g, _ in entries],
                                      tp={int(r): [int(x) for x in t] for r, _, _, _, t in entries})
        if isinstance(pipes, str):
            raise AuditUsageError(f"screener.audit: pipeline parallel: {pipes}")
        got = plan(pipes, self.topology.node_of)
        if isinstance(got, str):
            raise AuditUsageError(f"screener.audit: pipeline parallel: {got}")
        return got

    # ---- hooks on the stage's module ----------------------------------------------------------

    def _initializing(self) -> bool:
        """Whether the schedule is inferring its shapes (its first step runs the stage's forward
        and an input backward on uninitialised tensors): nothing of it is the step's."""
        return not (getattr(self.schedule, "_stage_forward_initialized", True)
                    and getattr(self.schedule, "_stage_backward_initialized", True))

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._initializing():
            return
        if not self._replaying and self._state is None:
            self._state = capture(self.device)
        record = self._record
        for t in _tensors(args):
            # what the previous stage sent: its gradient is what this stage sends back
            if t.requires_grad and t.is_leaf:
                t.register_hook(lambda g, record=record: record.backward(g))

    def _on_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._initializing():
            self._record.forward(output)

    def close(self) -> None:
        """Remove the hooks on the stage's module; the reduce-scatter recorders stop recording."""
        if not self._closed:
            self._closed = True
            for h in self._hooks:
                h.remove()
            self._tap.record = False

    # ---- the shard record ---------------------------------------------------------------------

    def _local_shards(self) -> list[torch.Tensor]:
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.module.parameters()]

    def check_weights(self, step: int, *, force: bool = False) -> None:
        """After optimizer.step(): every weights_every steps, this rank's fingerprints of its
        own weight shards, which the next check_gradients compares with the shards then. No stage
        has a replica under FSDP2, so no vote can say a shard is right; a bit that flips in a
        stored shard between the optimizer step and its next all-gather reaches every pipeline
        alike, and only the rank's own record sees it. No collective."""
        if force or self.is_weights_step(int(step)):
            self._shards = fingerprints(self._local_shards())
            self.counters["shard_records"] += 1

    def _drifted(self) -> list[str]:
        """The parameters whose shard here changed since check_weights recorded it (one look)."""
        if self._shards is None:
            return []
        before, self._shards = self._shards, None
        now = fingerprints(self._local_shards())
        names = [n for n, _ in self.module.named_parameters()]
        return [names[k] for k in (now != before).any(dim=1).nonzero().flatten().tolist()]

    # ---- the step ---------------------------------------------------------------------------

    def check_gradients(self, step: int, losses: Optional[Sequence[Any]] = None, *,
                        batch: Any = None) -> None:
        """After schedule.step(), before optimizer.step(). Collective: every rank, every step.

        losses: the list the schedule filled (last stage; ignored elsewhere). batch: what this
        rank handed the schedule (inputs on the first stage, target on the last)."""
        step = int(step)
        self.cadence.begin(step)
        self.history.note(step)
        tap = self._tap
        record, self._record = self._record, _StageRecord(self.is_audit_step(step + 1))
        state = self._state if self._state is not None else StepState(None, None, None)
        self._state = None
        recorded, fps = tap.recorded, tap.fps.clone()
        local_ok, reduced_ok, local_mag = tap.local_finite, tap.reduced_finite, tap.local_mag
        tap.reset()
        tap.record = self.is_audit_step(step + 1)
        self.counters["steps"] += 1
        audit = self.is_audit_step(step)
        needs_batch = self.first or self.last
        status = NO_BATCH if (needs_batch and batch is None) else \
            OK if (recorded or not audit) else NOT_RECORDED
        row = record.row(list(losses or []) if self.last else [], fps if recorded else None,
                         local_ok, status, local_mag)
        walk = PIPELINE_STEP.walk(None, self._comm, step)
        drifted = self._drifted()
        head = torch.cat([row, torch.tensor([int(reduced_ok), int(bool(drifted))],
                                            dtype=torch.int64)])
        got = walk.gather("head", head)
        own = got[:, :RECORD]
        if bool(got[:, _H_DRIFT].any()):
            self._drift(step, got, drifted)
        if not bool(own[:, R_FINITE:R_FINITE + 3].all()):
            # an audit step's records carry fingerprints: the replay can say where the two runs
            # parted, which can be upstream of the first NaN/Inf (a huge finite value)
            fingerprinted = audit and bool((own[:, R_STATUS] == OK).all())
            self._nonfinite(walk, step, own, state, batch, fingerprinted)
        if not bool(got[:, _H_REDUCED].all()):
            self._reduced(step, got)
        losses_now = [abs(bits_to_float(int(x))) for x in own[:, R_LOSS]]
        mags = [bits_to_float(int(x)) for x in own[:, R_MAG]]
        if audit:  # the replay below judges this step: its values only join the baselines
            self.sentinel.accept("loss", max(losses_now))
            self.sentinel.accept("grad", max(mags))
        elif self.spikes.step(step, losses_now, mags, max(mags),
                              lambda spike, suspect: self._spike(walk, step, spike, suspect, own,
                                                                 state, batch),
                              list(self.module.parameters())):
            return  # a spike of the data's, its gradients dropped (on_data="skip")
        if not audit:
            return
        statuses = [int(x) for x in own[:, R_STATUS]]
        if NO_BATCH in statuses:
            missing = [r for r, s in zip(self.topology.ranks, statuses) if s == NO_BATCH]
            raise AuditUsageError(f"screener.audit: pipeline parallel: rank(s) "
                                  f"{', '.join(map(str, missing))} (first or last stage) passed "
                                  f"no batch= to check_gradients at audit step {step}: the "
                                  f"replay needs the inputs (first stage) and the target (last)")
        if NOT_RECORDED in statuses:
            self.counters["audits_skipped"] += 1
            log.info("screener.audit: step %d not audited (not recorded on some rank: steps not "
                     "consecutive?)", step)
            return
        self._audit(walk, step, own, state, batch)

    # ---- replays ----------------------------------------------------------------------------

    def _row_of(self, got: torch.Tensor, rank: int) -> list[int]:
        return [int(x) for x in got[self.topology.index_of(rank)]]

    def _pipeline_rows(self, got: torch.Tensor, d: int) -> list[list[int]]:
        return [self._row_of(got, r) for r in self.pipelines.rows[d]]

    def _ship(self, walk: Walk, round_: str, moves: Sequence[tuple[int, int]],
              data: Optional[torch.Tensor], sizes: dict[int, int]) -> dict[int, Any]:
        """Point to point: each owner pipeline's end-stage batch to the pipeline replaying it
        (moves: (owner pipeline, replaying pipeline) pairs); returns this rank's, by owner."""
        walk.enter(round_)
        pairs: list[tuple[int, Optional[int]]] = []
        if self.first or self.last:
            s = self.stage_index
            pairs = [(self.pipelines.rows[d][s], self.pipelines.rows[q][s]) for d, q in moves]
        inbox = exchange(pairs, self.rank, data, sizes, walk.comm)
        self.counters["batch_bytes_received"] += sum(t.numel() for t in inbox.values())
        return {o: decode_batch(t, self.device) for o, t in inbox.items()}

    def _replay(self, batch: Any, state: StepState) -> torch.Tensor:
        """One lockstep replay: this pipeline runs the schedule once on `batch` from `state` with
        the reductions skipped; gradients and buffers are put back. Returns the record row."""
        grads = [(p, None if p.grad is None else p.grad.detach().clone())
                 for p in self.module.parameters()]
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        for p, _ in grads:  # the step's own backward started from None (zero_grad)
            p.grad = None
        tap = self._tap
        record, saved = _StageRecord(True), self._record
        self._record, self._replaying = record, True
        losses: list[Any] = []
        tap.start_replay()
        try:
            with restored(state, self.device), torch.enable_grad():
                if self.first:
                    self.schedule.step(*(batch if isinstance(batch, (tuple, list)) else (batch,)))
                elif self.last:
                    self.schedule.step(target=batch, losses=losses)
                else:
                    self.schedule.step()
        finally:
            tap.replaying = False
            self._record, self._replaying = saved, False
            with torch.no_grad():
                for p, g in grads:
                    p.grad = g
                for b, v in buffers:
                    b.copy_(v)
        self.counters["replays"] += 1
        return record.row(losses, tap.replay_fps.clone(), tap.replay_finite, OK, tap.replay_mag)

    def _exchange(self, walk: Walk, ship: str, round_: str, moves: Sequence[tuple[int, int]],
                  batch: Any, states: dict[int, StepState], sizes: dict[int, int],
                  data: Optional[torch.Tensor]) -> torch.Tensor:
        """Ship the owners' batches, replay (this pipeline: its owner in `moves`, else its own
        step) and gather every rank's replay row."""
        inbox = self._ship(walk, ship, moves, data, sizes)
        owner = next((d for d, q in moves if q == self.pipe), self.pipe)
        owner_rank = self.pipelines.rows[owner][self.stage_index]
        mine = batch if owner == self.pipe else inbox.get(owner_rank)
        row = self._replay(mine, states[owner_rank])
        return walk.gather(round_, row)

    def _offer(self, walk: Walk, round_: str, batch: Any, state: StepState
               ) -> tuple[Optional[torch.Tensor], dict[int, int], dict[int, StepState]]:
        data = encode_batch(batch) if batch is not None and (self.first or self.last) else None
        head = torch.cat([torch.tensor([0 if data is None else data.numel()]),
                          self._codec.encode(state)])
        got = walk.gather(round_, head)
        ranks = self.topology.ranks
        return (data, {r: int(got[k, 0]) for k, r in enumerate(ranks)},
                {r: self._codec.decode(got[k, 1:]) for k, r in enumerate(ranks)})

    # ---- check 2 ----------------------------------------------------------------------------

    def _audit(self, walk: Walk, step: int, own: torch.Tensor, state: StepState,
               batch: Any) -> None:
        data, sizes, states = self._offer(walk, "audit_states", batch, state)
        n = self.pipelines.count
        ring = {d: self.plan.replayer(d) for d in range(n)}
        replays = self._exchange(walk, "audit_ship", "replay", list(ring.items()), batch, states,
                                 sizes, data)
        if self.cadence.self_check_due:
            again = walk.gather("self_replay", self._replay(batch, state))
            self._judge_self(step, own, again)
        mismatched = [d for d in range(n) if first_difference(
            self._pipeline_rows(own, d), self._pipeline_rows(replays, ring[d])) is not None]
        if not mismatched:
            self.cadence.audit_passed()
            self.history.last_clean_audit = step
            return
        referees: Optional[torch.Tensor] = None
        if self.plan.referee_shift is not None:
            moves = {d: self.plan.referee(d) for d in self.pipelines.close(mismatched)}
            referees = self._exchange(walk, "referee_ship", "referee",
                                      [(d, q) for d, q in moves.items() if q is not None],
                                      batch, states, sizes, data)
        self._conclude(step, mismatched, own, replays, referees)

    def _judge_self(self, step: int, own: torch.Tensor, again: torch.Tensor) -> None:
        self.cadence.self_checked()
        odd = [r for r in self.topology.ranks
               if self._row_of(own, r)[R_LOSS:R_FINITE] != self._row_of(again, r)[R_LOSS:R_FINITE]]
        if odd:
            self.reporter.numeric(step, odd, {"check": "self_replay", "ranks": odd}, reason=(
                f"step {step} does not reproduce on the pipeline that ran it (rank(s) "
                f"{', '.join(map(str, odd))}): the schedule's step is not a deterministic "
                f"function of weights, batch and RNG state; {LIKELY_CAUSES}"))

    def _conclude(self, step: int, mismatched: list[int], own: torch.Tensor,
                  replays: torch.Tensor, referees: Optional[torch.Tensor]) -> None:
        suspects: set[int] = set()
        candidates: set[int] = set()
        cases = []
        for d in mismatched:
            q, j = self.plan.replayer(d), self.plan.referee(d)
            a, b = self._pipeline_rows(own, d), self._pipeline_rows(replays, q)
            c = None if referees is None or j is None else self._pipeline_rows(referees, j)
            verdict, stage = settle_pipelines(a, b, c)
            where = first_difference(a, b)
            part = None if where is None else where[1]
            if verdict == "owner" and stage is not None:
                suspects.add(self.pipelines.rows[d][stage])
            elif verdict == "replayer" and stage is not None:
                suspects.add(self.pipelines.rows[q][stage])
            else:
                at = range(self.pipelines.stages) if stage is None else [stage]
                candidates.update(self.pipelines.rows[p][s] for p in (d, q) for s in at)
            cases.append({"owner_pipeline": d, "replayer_pipeline": q, "referee_pipeline": j,
                          "verdict": verdict, "stage": stage, "part": part,
                          "owner_rank": None if stage is None else self.pipelines.rows[d][stage],
                          "replayer_rank": None if stage is None else
                          self.pipelines.rows[q][stage]})
        named = sorted(suspects)
        evidence = {"parallelism": "pipeline", "schedule": type(self.schedule).__name__,
                    "cases": cases, "why": "unsettled: fewer than three pipelines on distinct "
                    "nodes" if referees is None else ""}
        self.reporter.alarm(SDCAlarm(
            "ring_replay", step, named, self.topology.suspect_nodes(named),
            bool(named) and not candidates, evidence,
            candidate_ranks=sorted(suspects | candidates),
            first_suspect_step=self.history.window_start(self.history.last_clean_audit, step),
            key=self.reporter.key("ring_replay", step)))

    # ---- the spike sentinel, between audits ---------------------------------------------------

    def _spike(self, walk: Walk, step: int, spike: Spike, suspect: int, own: torch.Tensor,
               state: StepState, batch: Any) -> str:
        """A spike at a step without an audit, before the update: the suspect's pipeline (with
        its TP group) reruns its step, the next pipeline on other nodes replays it and the
        referee pipeline too, every other pipeline reruns its own, all in one lockstep round.
        Returns "data"; raises SDCAlarm("spike_rerun") for a fault."""
        d, stage = self.pipelines.where(suspect)
        group = self.pipelines.close([d])
        helpers = [h for h in (self.plan.shift, self.plan.referee_shift) if h is not None]
        n = self.pipelines.count
        pairs = [(x, (x + k) % n) for k in helpers for x in group]
        data, sizes, states = self._offer(walk, "rerun_offer", batch, state)
        got = self._exchange(walk, "rerun_ship", "rerun", pairs, batch, states, sizes, data)
        q, j = self.plan.replayer(d), self.plan.referee(d)
        index = self.topology.index_of

        def at(rows: torch.Tensor, p: int) -> tuple[int, int, int, int]:
            r = rows[index(self.pipelines.rows[p][stage])]
            fp = fingerprints([r[R_LOSS:R_FINITE].clone()])[0]
            return int(r[R_LOSS]), int(r[R_MAG]), int(fp[0]), int(fp[1])

        # the pipelines that reran their own steps must have reproduced them
        busy = set(group) | {y for _, y in pairs}
        others = [r for p in range(n) if p not in busy for r in self.pipelines.rows[p]]
        refuse_irreproducible(self.reporter, step, suspect, [
            r for r in others if int(got[index(r), R_MAG]) != int(own[index(r), R_MAG])])
        original = (int(own[index(suspect), R_LOSS]), int(own[index(suspect), R_MAG]))
        rerun = at(got, d)
        verdict = rerun_verdict(original, rerun, [at(got, q), None if j is None else at(got, j)])
        if verdict == "data":
            return "data"
        named: list[int] = []
        cases: list[dict[str, Any]] = []
        if verdict == "persistent":  # where the pipeline's rerun parts from its replays
            for p in group:
                qq, jj = self.plan.replayer(p), self.plan.referee(p)
                said, where = settle_pipelines(
                    self._pipeline_rows(got, p), self._pipeline_rows(got, qq),
                    None if jj is None else self._pipeline_rows(got, jj))
                cases.append({"pipeline": p, "verdict": said, "stage": where})
                if said == "owner" and where is not None:
                    named.append(self.pipelines.rows[p][where])
        elif verdict == "transient":  # the step alone: somewhere in the group's pipelines
            ranks = sorted(r for p in group for r in self.pipelines.rows[p])
            if len({self.topology.node_of(r) for r in ranks}) == 1:
                named = ranks
            cases.append({"pipelines": group, "why": "the rerun and the replays agree and "
                          "differ from the step: a fault of that step alone, at a stage its "
                          "records cannot say (no fingerprints between audits)"})
        proven = bool(others) or self.counters["self_checks"] > 0
        named = sorted(set(named))
        settled = bool(named) and j is not None and proven
        evidence = {"parallelism": "pipeline", "spike": spike.to_dict(), "suspect": suspect,
                    "stage": stage, "verdict": verdict, "confirmer_pipeline": q,
                    "referee_pipeline": j, "cases": cases, "reproduced_by": others,
                    "loss": {"original": bits_to_float(original[0]),
                             "rerun": bits_to_float(rerun[0])},
                    "largest_gradient": {"original": bits_to_float(original[1]),
                                         "rerun": bits_to_float(rerun[1])}}
        candidates = sorted(set(named) | {self.pipelines.rows[p][stage] for p in group} |
                            {self.pipelines.rows[y][stage] for _, y in pairs})
        self.reporter.alarm(SDCAlarm(
            "spike_rerun", step, named if settled else (),
            self.topology.suspect_nodes(named) if settled else (), settled, evidence,
            candidate_ranks=named if settled else candidates, first_suspect_step=step,
            key=self.reporter.key("spike_rerun", step)))
        return "unattributed"  # not reached: alarm raises

    # ---- check 1 ----------------------------------------------------------------------------

    def _nonfinite(self, walk: Walk, step: int, own: torch.Tensor, state: StepState,
                   batch: Any, fingerprinted: bool = False) -> None:
        """A NaN/Inf somewhere: where it first appeared in each flagged pipeline, and whether a
        replay by another pipeline reproduces it there. fingerprinted: the step's records carry
        fingerprints (an audit step), so where a finite replay first parts from the step is
        where it went wrong (an exponent flip in stage 0's forward may overflow only in stage
        1's backward)."""
        n = self.pipelines.count
        found = {d: first_nonfinite(self._pipeline_rows(own, d)) for d in range(n)}
        flagged = {d: w for d, w in found.items() if w is not None}
        data, sizes, states = self._offer(walk, "confirm_offer", batch, state)
        # a flagged pipeline's TP partners are replayed with it (not judged): they compute as one
        moves = {d: self.plan.replayer(d) for d in self.pipelines.close(list(flagged))}
        replays = self._exchange(walk, "confirm_ship", "confirm", list(moves.items()), batch,
                                 states, sizes, data)
        reproduced: list[int] = []
        suspects: list[int] = []
        cases: list[dict[str, Any]] = []
        for d, (stage, part) in sorted(flagged.items()):
            q = moves[d]
            again = first_nonfinite(self._pipeline_rows(replays, q))
            parted = first_difference(self._pipeline_rows(own, d), self._pipeline_rows(replays, q)) \
                if fingerprinted and again is None else None
            if parted is not None:
                stage, part = parted
            rank = self.pipelines.rows[d][stage]
            cases.append({"pipeline": d, "stage": stage, "part": part, "rank": rank,
                          "replayer_pipeline": q, "replay_finite": again is None})
            (reproduced if again is not None else suspects).append(rank)
        evidence = {"parallelism": "pipeline", "cases": cases}
        if reproduced:
            self.reporter.numeric(step, reproduced, evidence, reason=(
                f"a NaN/Inf at step {step} (rank(s) {', '.join(map(str, reproduced))}) comes "
                f"back when another pipeline replays the step: the data or the model, not a GPU"))
        self.reporter.alarm(SDCAlarm(
            "nonfinite_local", step, suspects, self.topology.suspect_nodes(suspects), True,
            evidence, first_suspect_step=step, key=self.reporter.key("nonfinite_local", step)))

    def _drift(self, step: int, got: torch.Tensor, mine: list[str]) -> None:
        flagged = [r for k, r in enumerate(self.topology.ranks) if int(got[k, _H_DRIFT])]
        if mine:
            self.reporter.log(logging.ERROR, "weights_drift", step=step, parameters=mine[:8])
        evidence = {"parallelism": "pipeline", "changed_on_ranks": flagged,
                    "stages": sorted({self.pipelines.where(r)[1] for r in flagged}),
                    "why": "a weight shard changed between the record after the optimizer step "
                           "and its next use, with no optimizer step between"}
        self.reporter.alarm(SDCAlarm(
            "weights", step, flagged, self.topology.suspect_nodes(flagged), True, evidence,
            first_suspect_step=step, key=self.reporter.key("weights", step)))

    def _reduced(self, step: int, got: torch.Tensor) -> None:
        bad = [r for k, r in enumerate(self.topology.ranks) if not int(got[k, _H_REDUCED])]
        stages = sorted({self.pipelines.where(r)[1] for r in bad})
        candidates = sorted({row[s] for row in self.pipelines.rows for s in stages})
        self.reporter.alarm(SDCAlarm(
            "nonfinite_reduced", step, (), (), False,
            {"parallelism": "pipeline", "stages": stages, "reduced_nonfinite_on": bad},
            candidate_ranks=candidates, first_suspect_step=step,
            key=self.reporter.key("nonfinite_reduced", step)))


def _refusal(schedule: Any) -> tuple[str, Any]:
    """Why this rank's schedule cannot be audited ("" when it can), and its stage."""
    name = type(schedule).__name__
    stage = getattr(schedule, "_stage", None)
    if name not in AUDITED_SCHEDULES or stage is None:
        return (f"screener.audit: pipeline schedule {name} is not audited (audited: "
                f"{', '.join(AUDITED_SCHEDULES)}, one stage per rank; schedules that run several "
                f"stages per rank or split the backward are not replayed yet)", None)
    if isinstance(stage.submod, torch.nn.parallel.DistributedDataParallel):
        return (f"screener.audit: pipeline parallel with DDP per stage is not audited: torch's "
                f"pipelining runs DDP only with static_graph=True, and then DDP reduces in some "
                f"micro-batches' backward and not once per step (on torch 2.13: every micro-batch "
                f"on the first stage, none on the last), so no hook sees a step's gradient whole; "
                f"shard each stage with fully_shard over its data-parallel ranks instead", stage)
    cls = fsdp_module_class()
    if cls is None or not isinstance(stage.submod, cls):
        return (f"screener.audit: pipeline parallel: stage {stage.stage_index}'s module is "
                f"{type(stage.submod).__name__}; the audit needs it sharded with fully_shard "
                f"over the stage's data-parallel ranks", stage)
    return "", stage
