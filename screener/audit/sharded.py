"""The in-job audit for FSDP2 and HSDP models (torch.distributed.fsdp.fully_shard).

    auditor = Auditor(fsdp_model, loss_fn=compute_loss, audit_every=50, weights_every=100)
    for step, batch in enumerate(loader):
        loss = compute_loss(fsdp_model, batch); loss.backward()
        auditor.check_gradients(step, loss, batch=batch)   # check 1 every step, 2 on audit steps
        optimizer.step()
        auditor.check_weights(step)                          # check 3 every weights_every steps

`Auditor(...)` hands a model sharded with `fully_shard` to this class (screener.audit.auditor
dispatches); the loop's calls are the same as for DDP. ShardedAuditor wires the loop to its
collaborators, one per idea, as the DDP Auditor does: the reduce-scatter recorders (fsdp_tap.py),
the lockstep rounds (sharded_rounds.py), ShardedNonFinite (check 1, nonfinite.py),
ShardedRingAudit (check 2, ring_audit.py), ShardedWeightCheck (check 3, weight_check.py), the
sentinel (attribution.py), Reporter and Cadence; every collective walks FSDP_STEP or FSDP_WEIGHTS
below (protocol.py). What each check sees:

Check 1 (every step). Every FSDP module's reduce-scatter goes through a recorder of ours
(`FSDPModule.set_custom_reduce_scatter`): before the reduction it learns whether this rank's local
gradient is finite (one min/max pass over the reduce-scatter input: non-finite means NaN or Inf,
never a norm that overflowed) and, on audit steps, the input's fingerprint. One all_gather of
(loss, local finite, reduced finite) per step; the reduced gradient's finiteness comes from
FSDP's all-reduce hook (the reduce-scatter output, or HSDP's replicate all-reduce output; a hook
of the caller's still runs). A rank whose loss or local gradient is not finite is replayed on
another node (a lockstep round, below): finite there names the rank (settled); not finite there
is the data or the model (NumericFailure, exit 76). Every local gradient finite but a reduced shard not: the
reduction went bad. Every rank replays its own step in one lockstep round in which the bad
modules' reduce-scatter (and HSDP's replicate all-reduce) runs once more for real on the
recomputed inputs; what each rank sent there and what the redone collective gave are gathered,
and the rule shared with DDP (reduction.py) says what that supports: a fault that went away and
that every holder of the result saw names and suspects nobody (the alarm says so); one that only
some replicas of a shard saw, or that the redo reproduces, makes those ranks the candidates. The
alarm ("nonfinite_reduced") is never settled.

Check 2 (audit steps). The reduce-scatter input is the rank's whole local gradient (every shard's
chunk, before any rank's contribution is added), so it can be compared bit for bit with a
recomputation elsewhere. The owner's micro-batch travels to its replayer (point to point: the
`batch=` of check_gradients, or `batch_fn(rank, step)` when given), with the RNG states and loss
scale its step started from (capture.py). Replays run in lockstep: every rank runs exactly one
forward and backward per round, through the same model (its all-gathers and, for HSDP, the
replicate all-reduce line up across ranks), with our recorder taking the reduce-scatter input's
fingerprint and skipping the reduction; the sharded gradients are put back afterwards, bit for
bit. A replay whose record differs from the owner's is settled by a referee on a third node (a
second lockstep round); the odd one out is named ("ring_replay"). Self-check: on the first audit
and every self_check_every after, a round in which every rank replays its own step; a step that
does not reproduce on its own rank is not a hardware verdict (NumericFailure).

Check 3 (every weights_every steps). HSDP: the ranks that hold the same shard (one per replica)
vote on its fingerprint; a strict majority names the odd replica. Pure FSDP has no replicas, so
no vote can say whether a shard's bits are right. What it can prove, it does: every rank
all-gathers every parameter (`DTensor.full_tensor`) and the fingerprints must agree on all
ranks, which catches a rank whose all-gather or whose copy of the full weights went bad; a bit
flipped in a rank's own stored shard reaches every rank alike and is not seen (the ring replay
sees what it does to the next step's gradients only if the flip changes them differently on
owner and replayer, which it does not). Use HSDP to have the weight vote.

The optimizer update (audit steps, opt-in: `optimizer=`). Under pure FSDP a shard's update is made
on its owner alone, and a wrong one reaches every rank through the all-gather: no replay or vote
sees it. With the optimizer given, a step pre-hook snapshots a sample of every shard's step
inputs (parameter, reduced gradient, state, hyper-parameters) on audit steps, and check_weights
sends it with the owner's post-step values to a buddy on another node, which recomputes the
update bit for bit; a mismatch is settled by a referee on a third node ("optimizer_update";
update_buddy.py, rounds in FSDP_UPDATE). The shard record then keeps the optimizer state too.

Lockstep has a price: a replay that raises on one rank leaves the others waiting in a collective
until the process group's timeout (a peer failure, exit 77, on the others); loss_fn and the
batch were already run by the training step, so this is rare.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from screener.audit import ring
from screener.audit.alarms import AuditUsageError
from screener.audit.attribution import LockstepRerun, SpikeWatch
from screener.audit.base import AuditorBase
from screener.audit.cadence import Cadence
from screener.audit.capture import StateCodec, StepState, capture, scaler_scale
from screener.audit.collective import comm_device
from screener.audit.config import AuditConfig
from screener.audit.fsdp_tap import fsdp_module_class, install_recorders
from screener.audit.layout import Layout, describe, join
from screener.audit.nonfinite import ShardedNonFinite
from screener.audit.protocol import Schedule
from screener.audit.refusals import refuse_placement, refuse_unreplayable
from screener.audit.reporting import History, Reporter
from screener.audit.ring_audit import ShardedRingAudit
from screener.audit.sentinel import Sentinel, SentinelConfig
from screener.audit.tensor_parallel import TPGroups
from screener.audit.sharded_rounds import H_DRIFT, H_LOCAL_MAG, H_LOSS, H_REDUCED_MAG, \
    NO_BATCH, NOT_RECORDED, OK, Lockstep, encode_batch, from_bits, to_bits
from screener.audit.topology import Topology, job_name
from screener.audit.update_buddy import DEFAULT_SAMPLE, UpdateBuddy, refusal as update_refusal
from screener.audit.weight_check import ShardedWeightCheck

__all__ = ["ShardedAuditor", "fsdp_root", "is_sharded", "FSDP_STEP", "FSDP_WEIGHTS",
           "FSDP_UPDATE"]

# The collectives of check_gradients, in the one order every rank runs them (protocol.py); each
# is run or skipped on gathered data. "head" every step, the same width on every step, and on
# audit steps "audit_states", every rank's step state ("head" and "audit_states" are fixed
# rounds: their widths come from what the ranks agreed at construction). A non-finite local
# gradient: the confirmation's offer, batches shipped, lockstep
# replays, the results. A non-finite reduced one (every local one finite): where, every rank's
# offer, one lockstep replay that redoes the bad reduction, what was sent and redone. A spike:
# the same four for the rerun. An audit step: the owners' batches
# shipped, one lockstep replay per round and the self-check's, the digests; on a mismatch the
# referees' batches, replays and the full records; under HSDP, when the referees' verdicts stay
# in one replica, the shard vote ("locality_vote").
FSDP_STEP = Schedule("check_gradients (FSDP2/HSDP)", (
    "head", "audit_states", "confirm_offer", "confirm_ship", "confirm_replay", "confirm", "redo_places",
    "redo_offer", "redo_replay", "redo_values", "rerun_offer",
    "rerun_ship", "rerun_replay", "rerun", "audit_ship", "replay", "self_replay", "digests",
    "referee_ship", "referee_replay", "referee", "locality_vote"),
    repeatable=("confirm_replay", "replay", "referee_replay"), fixed=("head", "audit_states"))
# check_weights: every rank's fingerprints (of its shards, or of the full weights) in one gather.
FSDP_WEIGHTS = Schedule("check_weights (FSDP2/HSDP)", ("weights",))
# check_weights on audit steps with optimizer= given, before FSDP_WEIGHTS: the update buddy
# (update_buddy.py): every rank's offer, the snapshots shipped to the buddies, their verdicts; on a
# mismatch the referees' snapshots and verdicts.
FSDP_UPDATE = Schedule("the optimizer update's buddy (FSDP2/HSDP)", (
    "update_offer", "update_ship", "update_verdicts", "update_referee_ship", "update_referee"),
    fixed=("update_offer", "update_verdicts", "update_referee"))
# HSDP: the shard vote before a settled alarm that names ranks of one replica (weight_check.py).
FSDP_LOCALITY = Schedule("the shard vote before an alarm (HSDP)", ("locality_vote",))


def fsdp_root(model: Any) -> Optional[Any]:
    """The FSDP2 module under a model (itself, or what torch.compile wrapped), else None."""
    cls = fsdp_module_class()
    if cls is None:
        return None
    for m in (model, getattr(model, "_orig_mod", None)):
        if isinstance(m, cls):
            return m
    return None


def is_sharded(model: Any) -> bool:
    """Whether a model is an FSDP2 (fully_shard) model this module audits."""
    return fsdp_root(model) is not None


class ShardedAuditor(AuditorBase):
    """The three checks for an FSDP2 or HSDP model; see the module docstring.

    model: the root module sharded with `fully_shard` (or torch.compile of it). loss_fn(model,
    batch) -> loss, the same call the loop makes; batch_fn(global_rank, step) is optional (without
    it, pass batch= to check_gradients). Refuses (AuditUsageError, one line) what it cannot audit.

    optimizer: opt-in, the loop's torch.optim.Adam, AdamW or SGD (foreach on or off, momentum or
    not; not fused, capturable or differentiable) over the model's parameters: on audit steps a
    buddy on another node recomputes a sample of this rank's update bit for bit, in
    check_weights (update_buddy.py; refused with one line otherwise). update_sample: the
    elements per rank per audit step it samples (about; at least 4 of every shard).
    """

    def __init__(self, model: torch.nn.Module, *,
                 loss_fn: Optional[Callable[[torch.nn.Module, Any], Any]] = None,
                 batch_fn: Optional[Callable[[int, int], Any]] = None,
                 audit_every: int = 50, weights_every: int = 100,
                 job: Optional[str] = None, alarm_dir: Optional[str | os.PathLike[str]] = None,
                 topology: Optional[Topology] = None, scaler: Any = None,
                 accumulation_steps: int = 1, self_check_every: int = 20,
                 confirm_nonfinite: bool = True, start_step: Optional[int] = None,
                 process_group: Any = None, reduce_hook: Any = None, reduce_state: Any = None,
                 check_reduced: bool = True, sentinel: Optional[SentinelConfig] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 update_sample: int = DEFAULT_SAMPLE) -> None:
        if reduce_hook is not None or reduce_state is not None:
            raise AuditUsageError("screener.audit: reduce_hook is DDP's; an FSDP2 model reduces "
                                  "through fully_shard's reduce-scatter, which the audit records")
        if process_group is not None and process_group is not dist.group.WORLD:
            raise AuditUsageError("screener.audit: the FSDP2/HSDP audit runs on the default "
                                  "process group (its device mesh says how the model is sharded)")
        root = fsdp_root(model)
        if root is None:
            raise TypeError(f"ShardedAuditor needs a model sharded with fully_shard, not "
                            f"{type(model).__name__}")
        self.config = AuditConfig(audit_every=audit_every, weights_every=weights_every,
                                  check_reduced=check_reduced, confirm_nonfinite=confirm_nonfinite,
                                  accumulation_steps=accumulation_steps,
                                  self_check_every=self_check_every,
                                  job=job_name() if job is None else job,
                                  alarm_dir=None if alarm_dir is None else os.fspath(alarm_dir))
        self.model, self.root = model, root
        self.loss_fn, self.batch_fn, self.scaler = loss_fn, batch_fn, scaler
        self.audit_every, self.weights_every = audit_every, weights_every
        self.self_check_every, self.accumulation_steps = self_check_every, accumulation_steps
        self.confirm_nonfinite = confirm_nonfinite
        self.job, self.alarm_dir = self.config.job, self.config.alarm_dir
        self.counters: Counter[str] = Counter()
        guard_config = sentinel if sentinel is not None else SentinelConfig()
        # the first steps are audited while the sentinel has no baseline (cadence.py)
        self._guard = guard_config.warmup if guard_config.enabled else 0
        if not isinstance(update_sample, int) or update_sample < 1:
            raise AuditUsageError(f"screener.audit: update_sample must be a positive number of "
                                  f"elements, not {update_sample!r}")
        self._optimizer, self._update_sample = optimizer, update_sample
        self._select(model)
        self._join(topology)
        self._assemble()
        self._tap.record = start_step is None or self.is_audit_step(start_step)
        self._state: Optional[StepState] = None
        self._pre_hook = model.register_forward_pre_hook(self._on_forward)
        self._closed = False
        self.sentinel = Sentinel(sentinel)
        if self.sentinel.config.on_data == "skip" and scaler is not None:
            raise AuditUsageError("screener.audit: SentinelConfig(on_data='skip') drops a step's "
                                  "gradients, which a GradScaler's step refuses; use "
                                  "on_data='proceed' with a scaler")
        self.spikes = SpikeWatch(self.sentinel, self.reporter, self.counters)

    # ---- set-up -------------------------------------------------------------------------------

    def _select(self, model: torch.nn.Module) -> None:
        """The sharded parameters, the mesh they live on, and what this rank would refuse (the
        ranks agree on it in _join: a refusal is raised on every rank alike, never on some)."""
        refuse_unreplayable(model)
        named = [(n, p) for n, p in model.named_parameters()]
        if not named:
            raise AuditUsageError("screener.audit: the model has no parameters to audit")
        self.weight_names = [n for n, _ in named]
        # FSDP2's parameters are DTensors (to_local, full_tensor); Any spares importing DTensor
        self._params: list[Any] = [p for _, p in named]
        self.layout = describe(named, dist.get_world_size(), sharded=True)
        refusal = self.layout.refusal
        hooked = [n for n, p in named if getattr(p, "_post_accumulate_grad_hooks", None)]
        if hooked and not refusal:  # FSDP runs them after every backward, a replay's too
            refusal = (f"screener.audit: parameter {hooked[0]} has a post-accumulate-grad hook "
                       f"(an optimizer in backward?); a replay's backward would run it too: "
                       f"step the optimizer after check_gradients")
        first = self._params[0]
        mesh = getattr(first, "device_mesh", None)
        self.mesh = mesh
        kind = self.layout.kind
        self.hsdp = kind in ("hsdp", "hsdp_tp")
        self.tp: Optional[TPGroups] = None
        if kind in ("fsdp_tp", "hsdp_tp") and mesh is not None:  # the last dim: TP groups
            width = mesh.mesh.shape[-1]
            self.tp = TPGroups(mesh.mesh.reshape(-1, width).tolist())
        shard_dim = 1 if self.hsdp else 0  # (replicate, shard[, tp]) or (dp[, tp])
        if mesh is not None and mesh.size(shard_dim) < 2 and not refusal:
            refusal = ("screener.audit: the mesh shards over a single rank, so FSDP never "
                       "reduce-scatters and the audit would see nothing; shard over two or more "
                       "ranks (or use DDP for pure replication)")
        if self._optimizer is not None and not refusal:  # agreed in _join, like the others
            refusal = update_refusal(self._optimizer, self._params) or refusal
        self._refusal = refusal
        local = first.to_local() if hasattr(first, "to_local") else first
        self.device = local.device
        self._comm = comm_device(None, self.device)
        self._codec = StateCodec(self.device)

    def _join(self, topology: Optional[Topology]) -> None:
        """Where every rank runs and what each holds (one gather); the refusals that need it."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.layout = Layout(self.layout.kind, self.layout.digest, self.layout.count,
                             self._refusal, self._codec.length)
        self.topology = join(None, topology, self.device, self.layout)
        me = self.topology.info(self.rank)
        self.hostname, self.node = me.hostname, me.node
        refuse_placement(self.device, [i.threads for i in self.topology.infos])

    def _assemble(self) -> None:
        """The recorders in FSDP's reduce-scatters, and the collaborators, one per idea."""
        self._tap, self.module_names = install_recorders(self.model)
        config = self.config
        self.lockstep = Lockstep(self.model, self.root, self._params, self._tap, self.topology,
                                 self.rank, device=self.device, codec=self._codec,
                                 counters=self.counters, loss_fn=self.loss_fn,
                                 batch_fn=self.batch_fn,
                                 accumulation_steps=config.accumulation_steps,
                                 audit_every=config.audit_every,
                                 replicas=self._replicas() if self.hsdp else None,
                                 tp=self.tp)
        if self.tp is not None:  # the same on every rank: gathered topology, agreed mesh
            why = self.tp.check(self.lockstep.plan,
                                lambda o, r: ring.referee_of(self.topology, o, r))
            if why is not None:
                raise AuditUsageError(f"screener.audit: FSDP2 x tensor parallel: {why}")
        self.can_replay = self.lockstep.can_replay
        self.history = History()
        self.reporter = Reporter(self.topology, self.rank, self.world_size, job=config.job,
                                 alarm_dir=config.alarm_dir)
        self.cadence = Cadence(config.audit_every, config.weights_every, config.self_check_every,
                               self.can_replay, self.counters, guard=self._guard)
        self.nonfinite = ShardedNonFinite(self.lockstep, self.reporter, self.counters,
                                          scaler=self.scaler, confirm=config.confirm_nonfinite,
                                          module_names=self.module_names)
        self.weights = ShardedWeightCheck(self._params, self.weight_names, self.mesh, self.hsdp,
                                          self.reporter, self.history, self.counters)
        self.ring_audit = ShardedRingAudit(self.lockstep, self.reporter, self.history,
                                           self.cadence, self.module_names, self.hsdp,
                                           weights=self.weights if self.hsdp else None)
        self.rerun = LockstepRerun(self.lockstep, self.reporter, self.counters)
        self.buddy: Optional[UpdateBuddy] = None
        if self._optimizer is not None:  # the optimizer's update, recomputed on another node
            self.buddy = UpdateBuddy(self._optimizer, self._params, self.weight_names,
                                     self.reporter, self.history, self.counters,
                                     device=self.device, sample=self._update_sample)
            self.weights.extra = self.buddy.state_shards  # the state at rest: the record
        if self.hsdp:  # before an alarm inside one replica, or a numeric failure: the shard
            # vote speaks first (weight_check.ShardedWeightCheck.vote_first)
            self.reporter.before_verdict = lambda step, ranks, settled, evidence: \
                self.weights.vote_first(step, ranks, settled, evidence,
                                        FSDP_LOCALITY.walk(None, self._comm, step))

    def _replicas(self) -> list[set[int]]:
        """HSDP: the ranks of each replica (a row of the replicate x shard mesh)."""
        assert self.mesh is not None
        mesh = self.mesh.mesh
        flat = mesh.reshape(mesh.shape[0], -1)  # a replica: its shards (and TP coordinates)
        return [{int(x) for x in flat[i, :].tolist()} for i in range(flat.shape[0])]

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._tap.replaying:
            return
        self._tap.micro += 1  # the micro-step the next reduce-scatters belong to
        if self._state is None:
            self._state = capture(self.device, self.scaler)

    def begin_step(self) -> None:
        """Capture the RNG states the step starting now draws from (see the DDP Auditor)."""
        self._state = capture(self.device, self.scaler)

    def close(self) -> None:
        """Remove the forward pre-hook; the reduce-scatter recorders stay (they reduce as FSDP
        would) but stop recording."""
        if not self._closed:
            self._closed = True
            self._pre_hook.remove()
            self._tap.record = False
            if self.buddy is not None:
                self.buddy.close()

    # ---- cadence ----------------------------------------------------------------------------

    def is_update_step(self, step: int) -> bool:
        """Whether the update buddy checks this step's optimizer update (the audit steps, with
        optimizer= given; the ring replay need not be on)."""
        every = self.audit_every
        return self.buddy is not None and bool(every) and (step % every == 0
                                                           or self.cadence.guarded(step))

    # ---- check 1 and check 2 -------------------------------------------------------------------

    def check_gradients(self, step: int, loss: Any, *, batch: Any = None,
                        grad_norm: Any = None) -> None:
        """After backward, before optimizer.step(). Collective: every rank, every step.

        batch: this rank's micro-batch of the step (the list of micro-batches with
        accumulation_steps > 1), needed on audit steps unless batch_fn was given; it is sent to
        the replayer only on audit steps. grad_norm is accepted for the DDP signature's sake.
        """
        step = int(step)
        self.cadence.begin(step)
        self.history.note(step)
        if self.buddy is not None and self.is_update_step(step):
            self.buddy.arm(step)  # the snapshot: in the optimizer's step pre-hook
        loss_t = ring.scalar_of(ring.loss_of(loss)) if not isinstance(loss, (int, float)) \
            else torch.tensor(float(loss), dtype=torch.float64)
        tap = self._tap
        reduced_ok = tap.reduced_finite
        state = self._state if self._state is not None else StepState(None, None,
                                                                       scaler_scale(self.scaler))
        self._state = None
        local_ok, recorded, own_fps = tap.local_finite, tap.recorded, tap.fps.clone()
        mags = (tap.local_mag, tap.reduced_mag)
        tap.reset()
        tap.record = self.is_audit_step(step + 1)
        self.counters["steps"] += 1
        audit = self.is_audit_step(step)
        if audit and batch is None and self.batch_fn is not None:
            batch = self.batch_fn(self.rank, step)
        data = encode_batch(batch) if (audit and batch is not None) else None
        status = OK if data is not None and recorded else (
            NO_BATCH if data is None else NOT_RECORDED)
        drifted = self.weights.drifted()  # this rank's shards since the last weight check
        head = torch.tensor([ring.loss_bits(loss_t), int(local_ok and bool(torch.isfinite(
            loss_t.detach().double()).all())), int(reduced_ok), status,
            0 if data is None else data.numel(), to_bits(mags[0]), to_bits(mags[1]),
            int(bool(drifted))], dtype=torch.int64)
        walk = FSDP_STEP.walk(None, self._comm, step)
        got = walk.gather("head", head)  # the same width on every step
        rows = walk.gather("audit_states", self._codec.encode(state)) if audit else None
        if bool(got[:, H_DRIFT].any()):  # a shard changed by itself: before anything it explains
            self.weights.report_drift(step, [self.topology.ranks[k] for k in range(got.shape[0])
                                             if int(got[k, H_DRIFT])], drifted)
        skipped = self.nonfinite.judge(walk, step, got, state, batch, data)
        if not skipped:
            losses = [abs(from_bits(x)) for x in got[:, H_LOSS]]
            skipped = self.spikes.step(
                step, losses, [from_bits(x) for x in got[:, H_LOCAL_MAG]],
                max(from_bits(x) for x in got[:, H_REDUCED_MAG]),
                lambda spike, suspect: self.rerun.attribute(
                    walk, step, spike, suspect, got, state, batch, data,
                    self.weights.rollback()), self._params)
        if audit and not skipped:
            assert rows is not None
            states = self.lockstep.decode_states(rows)
            self.ring_audit.run(walk, step, got, states, loss_t, own_fps, batch, data)

    # ---- check 3 -------------------------------------------------------------------------------

    def check_weights(self, step: int, *, force: bool = False) -> None:
        """After optimizer.step(): on audit steps with optimizer= given, the update buddy
        (update_buddy.py); HSDP votes each shard across its replicas; pure FSDP checks that
        every rank all-gathers the same full weights (see the module docstring)."""
        step = int(step)
        update = self.buddy is not None and self.is_update_step(step)
        if not update and not force and not self.is_weights_step(step):
            return
        if update:
            assert self.buddy is not None
            self.buddy.check(FSDP_UPDATE.walk(None, self._comm, step), step)
        if force or self.is_weights_step(step):
            self.weights.check(FSDP_WEIGHTS.walk(None, self._comm), step)

    def verified_save(self, save_fn: Callable[[], Any], step: int) -> Any:
        """Run the weight check for `step` (forced), then save_fn(); a failing check raises
        SDCAlarm and nothing is saved. The path save_fn returns is the rollback target a later
        spike alarm carries."""
        step = int(step)
        self.check_weights(step, force=True)
        return self.weights.save(save_fn, step)
