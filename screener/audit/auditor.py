"""The Auditor: the three in-job SDC checks wired into a PyTorch DDP training loop.

    auditor = Auditor(ddp_model, loss_fn=compute_loss, batch_fn=batch_for,
                      audit_every=50, weights_every=100)
    for step in range(start, total):
        optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(ddp_model, batch_for(rank, step))
        loss.backward()
        auditor.check_gradients(step, loss)   # check 1 every step, check 2 on audit steps
        optimizer.step()
        auditor.check_weights(step)           # check 3 every weights_every steps

Check 1 (every step, nonfinite.py): one all_gather of (loss, local gradient's largest magnitude,
reduced gradient's) per rank. The comm hook (hooks.py) learns both gradients' finiteness from the
one pass that divides the summed buckets by the world size, and measures magnitudes only when
something is not finite (0 stands for a gradient known finite). Finiteness is always a property
of the values, never of a norm that could overflow (a finite gradient of 1e20 is finite). A rank
whose loss or local gradient is NaN/Inf is flagged; its micro-batch is then replayed on another
node: a finite replay names the rank (settled, "nonfinite_local"), a non-finite one means the
model or data produced it (NumericFailure, exit 76).
A non-finite reduced gradient while every local one was finite means the reduction is suspect:
"nonfinite_reduced", nobody named. Every rank replays its step and the bad bucket's all-reduce is
redone once for real on the recomputed gradients, through the job's own reduction (reduction.py
reads it): NaN/Inf again makes the ranks where it shows the candidates; a finite redo is a
one-off, whose candidates are the ranks that held it when only some did (an all-reduce gives
every rank the same result) and nobody when every rank did (no node is suspected).

Check 2 (steps where step % audit_every == 0; ring_audit.py): ring replay (see ring.py). Each
rank replays its assigned owners' micro-batches; the owners' RNG states and loss scales ride in
check 1's all_gather, small digests of the records (loss bits plus a digest of the gradient
fingerprints) come back in one more. Only on a mismatch does a third round run: referees on a third
node replay, full records are gathered, and the result that differs from the other two names the
suspect ("ring_replay"). With fewer than three nodes the mismatch is reported unsettled.

Check 3 (steps where step % weights_every == 0, and in verified_save; weight_check.py): each rank
fingerprints its weights; one all_gather of a digest of those fingerprints; on disagreement the
full fingerprints are gathered and a strict majority names the odd replicas ("weights").

Between audits, the spike sentinel (attribution.py) attributes a jump of the loss or the gradient
before the update. Every collective of a check runs in the order the schedules below list
(DDP_STEP, DDP_WEIGHTS; protocol.py): ranks that left it raise AuditError alike instead of hanging.

Which step a backward belongs to: the hook runs before the loop says which step it is in, so the
auditor expects consecutive steps (the step after the last checked one; the first backward always
records fingerprints unless start_step is given). An audit step whose fingerprints were not recorded
is skipped (counted in `counters["audits_skipped"]`), the same way on every rank.

What a replay reproduces (capture.py): the RNG states the owner's step started from (CPU and the
current CUDA device; captured by a forward pre-hook on the DDP model, or by begin_step()) and the
GradScaler's loss scale, both sent to the replayers in a first all_gather of the audit step, so
plain nn.Dropout and fp16 with a GradScaler replay bit for bit. With gradient accumulation
(accumulation_steps=k) batch_fn returns the k micro-batches and the replay adds their gradients in
order, as .grad does.

Loss scaling (scaler=GradScaler): a step on which every rank's gradient overflowed is the scaler's
business (it skips the optimizer step): no alarm, counted in counters["scaler_skipped"]. Some ranks
only: each is replayed at its own scale on another node; an overflow there too means the data did
it (no alarm, counted), a finite replay is evidence against the owner.

Self-check (self_check_every): on the first audit step and every self_check_every audits after,
each rank also replays its own step; a step that does not reproduce on its own rank is
nondeterministic, which is no hardware verdict: NumericFailure (exit 76). The same for a settled
verdict wider than one node or half the ranks (blast.py): silent data corruption is local.

Setups that cannot be replayed bit for bit are refused at construction with one line
(AuditUsageError, exit 2; refusals.py): torch.compile around the DDP model (found on the first
forward when the Auditor was given the DDP model itself), SyncBatchNorm, CUDA without
deterministic algorithms, ranks with different torch thread counts. Reentrant checkpointing is
replayed with a backward pass (ring.py).

Every check raises SDCAlarm (after the alarm files are written and one JSON line is logged per
rank; reporting.py); nothing is applied to the model by the auditor, so raising before
optimizer.step() keeps the step from running. Every verdict comes from gathered data, so all
ranks raise the same alarm at the same step. A replay that fails with an exception on any rank
raises AuditError on every rank: our own failure, never a hardware verdict (exit 1, guard.py).

Limits: parameters DDP ignores are not checked; buffers are restored after a replay but not sent
to the replayer, so a forward that reads buffers which differ between ranks (an eval-mode BatchNorm
with broadcast_buffers=False) is not reproducible (the self-check says so); optimizer.zero_grad
must set gradients to None (the default since torch 2.0).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from screener.audit import ring
from screener.audit.alarms import AuditError, AuditUsageError
from screener.audit.attribution import LocalRerun, SpikeWatch
from screener.audit.base import AuditorBase
from screener.audit.cadence import Cadence
from screener.audit.config import AuditConfig
from screener.audit.capture import StateCodec, StepState, capture, scaler_scale
from screener.audit.collective import comm_device
from screener.audit.ddp_replay import LocalReplayer, select_parameters
from screener.audit.hooks import GradientRecorder, StepStats, largest_magnitude
from screener.audit.layout import describe, join
from screener.audit.nonfinite import NonFiniteCheck
from screener.audit.pipeline import PipelineAuditor, is_pipeline_schedule
from screener.audit.protocol import OK, Schedule, Walk
from screener.audit.refusals import COMPILED_AROUND_DDP, refuse_compiled_wrapper, \
    refuse_placement, refuse_unreplayable
from screener.audit.reporting import History, Reporter
from screener.audit.ring_audit import RingAudit
from screener.audit.sentinel import SentinelConfig, Sentinel
from screener.audit.sharded import ShardedAuditor, is_sharded
from screener.audit.topology import Topology, job_name
from screener.audit.weight_check import WeightVote

__all__ = ["Auditor", "AuditConfig", "AuditError", "AuditUsageError", "DDP_STEP", "DDP_WEIGHTS"]

log = logging.getLogger("screener.audit")

_UNKNOWN = -1  # fingerprints recorded for a backward whose step was not known in advance
_GROUP = object()  # reduce_state default: the auditor's process group
_NOT_RECORDED = 2  # a rank's status on an audit step whose fingerprints it did not record

# The collectives of check_gradients, in the one order every rank runs them (protocol.py). Each
# is skipped or run on gathered data: "head" every step (the same width on every step);
# "states" on an audit step, and off one when a replay needs them ("head" and "states" are fixed
# rounds: their widths come from what the ranks agreed at construction); "confirm" (a non-finite local
# gradient) or the four "redo" rounds (a non-finite reduced one; "redo_reduce" is the bad
# bucket's all-reduce done again, not a gather), which end the step; "rerun"
# when the sentinel fires off an audit step; "digests" on an audit step; "referee" on a mismatch.
DDP_STEP = Schedule("check_gradients (DDP)", (
    "head", "states", "confirm", "redo_places", "redo_flags", "redo_reduce", "redo_values",
    "rerun", "digests", "referee"), fixed=("head", "states"))
# check_weights: the digest of every rank's fingerprints; the full ones only on disagreement.
DDP_WEIGHTS = Schedule("check_weights (DDP)", ("weights_digest", "weights_full"))


class Auditor(AuditorBase):
    """In-job SDC checks for a DistributedDataParallel model; see the module docstring.

    model: the DDP-wrapped model (the auditor registers a comm hook on it: construct the auditor
    before the first backward, and pass any reduction hook of your own as reduce_hook).
    loss_fn(module, batch) -> scalar loss; batch_fn(global_rank, step) -> that rank's micro-batch.
    Without both, ring replay is off and non-finite ranks are reported unsettled.
    process_group: the DDP's group unless given (WORLD by default). reduce_hook(state, bucket):
    the reduction the comm hook hands each bucket to after recording (default torch's
    allreduce_hook), called with reduce_state (default: the process group). topology: a Topology
    already gathered for this group (skips the start-up all_gather_object).
    scaler: the torch.amp.GradScaler the loop scales its loss with (its scale is used by every
    replay; overflow steps are the scaler's business). accumulation_steps: micro-batches per step
    when the loop accumulates gradients under ddp.no_sync(); batch_fn then returns the list of
    them, loss_fn returns one micro-batch's loss as it is backpropagated (divided by k if the loop
    divides), and check_gradients gets the sum of those losses. self_check_every: see the module
    docstring. Refuses (AuditUsageError, one line, exit 2) a setup it cannot replay bit for bit.

    The Auditor wires the training loop to its collaborators, one per idea: NonFiniteCheck
    (check 1), RingAudit (check 2), WeightVote (check 3), SpikeWatch and LocalRerun (the
    sentinel), LocalReplayer (every replay), Reporter (every verdict) and Cadence (which step
    runs what); each of their collectives walks DDP_STEP or DDP_WEIGHTS.
    """

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> Any:
        # One entry point: a model sharded with fully_shard (FSDP2, HSDP) gets the sharded audit,
        # a pipeline schedule the pipeline audit.
        if cls is Auditor and model is not None and is_sharded(model):
            return ShardedAuditor(model, *args, **kwargs)
        if cls is Auditor and model is not None and is_pipeline_schedule(model):
            return PipelineAuditor(model, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, *,
                 loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
                 batch_fn: Optional[Callable[[int, int], Any]] = None,
                 audit_every: int = 50, weights_every: int = 100,
                 process_group: Optional[dist.ProcessGroup] = None,
                 reduce_hook: Optional[Callable[[Any, Any], Any]] = None,
                 reduce_state: Any = _GROUP, start_step: Optional[int] = None,
                 job: Optional[str] = None, alarm_dir: Optional[str | os.PathLike[str]] = None,
                 check_reduced: bool = True, confirm_nonfinite: bool = True,
                 topology: Optional[Topology] = None, scaler: Any = None,
                 accumulation_steps: int = 1, self_check_every: int = 20,
                 sentinel: Optional[SentinelConfig] = None, optimizer: Any = None,
                 update_sample: Optional[int] = None) -> None:
        if optimizer is not None or update_sample is not None:
            raise AuditUsageError("screener.audit: optimizer= (the optimizer update's buddy) is "
                                  "for models sharded with fully_shard; under DDP every rank "
                                  "holds the whole model and the weight vote compares the "
                                  "replicas' updated weights")
        refuse_compiled_wrapper(model)
        module = getattr(model, "module", None)
        if not isinstance(module, torch.nn.Module) or not hasattr(model, "register_comm_hook"):
            raise AuditUsageError(f"screener.audit: the Auditor audits a DistributedDataParallel "
                                  f"model, or one sharded with fully_shard (FSDP2 on a 1-D "
                                  f"mesh, HSDP on a 2-D one), not {type(model).__name__}")
        self.config = AuditConfig(audit_every=audit_every, weights_every=weights_every,
                                  check_reduced=check_reduced, confirm_nonfinite=confirm_nonfinite,
                                  accumulation_steps=accumulation_steps,
                                  self_check_every=self_check_every,
                                  job=job_name() if job is None else job,
                                  alarm_dir=None if alarm_dir is None else os.fspath(alarm_dir))
        self.model = model
        self.module: torch.nn.Module = module
        self.loss_fn = loss_fn
        self.batch_fn = batch_fn
        if scaler is not None and not all(hasattr(scaler, a) for a in ("get_scale", "is_enabled",
                                                                       "scale")):
            raise AuditUsageError(f"screener.audit: scaler must be a torch.amp.GradScaler, not "
                                  f"{type(scaler).__name__}")
        self.scaler = scaler
        self.sentinel = Sentinel(sentinel)
        # the first steps are audited while the sentinel has no baseline (cadence.py)
        self._guard = self.sentinel.config.warmup if self.sentinel.config.enabled else 0
        if self.sentinel.config.on_data == "skip" and scaler is not None:
            raise AuditUsageError("screener.audit: SentinelConfig(on_data='skip') drops a step's "
                                  "gradients, which a GradScaler's step refuses (no inf checks "
                                  "recorded); use on_data='proceed' with a scaler")
        self._audit_head: Optional[torch.Tensor] = None
        refuse_unreplayable(module)
        self.group = process_group if process_group is not None \
            else getattr(model, "process_group", None)
        self.params = select_parameters(model, module)
        self.device = self.params.device
        self._comm = comm_device(self.group, self.device)
        self._join(topology)  # a collective: every rank reaches it, in this order
        self.counters: Counter[str] = Counter()
        self._assemble()
        self._install_hook(model, reduce_hook, reduce_state, check_reduced, start_step)

        # The RNG states and loss scale the current step started from (capture.py): taken by the
        # first forward after the last check_gradients, or by begin_step().
        self._state: Optional[StepState] = None
        self._compiled_around = False  # the DDP model ran inside torch.compile (refusals.py)
        self._pre_hook = model.register_forward_pre_hook(self._on_forward)
        self._closed = False

    # ---- set-up, in the order __init__ runs it ---------------------------------------------------

    def _join(self, topology: Optional[Topology]) -> None:
        """Where every rank runs (one all_gather_object unless given), and the refusals that need
        to know it: a setup whose replays cannot match bit for bit is refused here, on every rank
        alike, never alarmed on later."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(self.group)
        self._codec = StateCodec(self.device)
        layout = describe(list(zip(self.params.weight_names, self.params.weights)),
                          self.world_size, sharded=False, state_width=self._codec.length)
        self.topology = join(self.group, topology, self.device, layout)
        if self.topology.world_size != self.world_size:
            raise AuditUsageError(f"screener.audit: topology has {self.topology.world_size} ranks, "
                                  f"the process group {self.world_size}")
        me = self.topology.info(self.rank)
        self.hostname, self.node = me.hostname, me.node
        refuse_placement(self.device, [i.threads for i in self.topology.infos])

    def _assemble(self) -> None:
        """The collaborators, one per idea (see the class docstring)."""
        config = self.config
        self.replayer = LocalReplayer(self.model, self.module, self.params, self.topology,
                                      self.rank, loss_fn=self.loss_fn, batch_fn=self.batch_fn,
                                      accumulation_steps=config.accumulation_steps,
                                      audit_every=config.audit_every)
        self.can_replay = self.replayer.can_replay
        self.history = History()
        self.reporter = Reporter(self.topology, self.rank, self.world_size, job=config.job,
                                 alarm_dir=config.alarm_dir)
        self.cadence = Cadence(config.audit_every, config.weights_every, config.self_check_every,
                               self.can_replay, self.counters, guard=self._guard)
        self.nonfinite = NonFiniteCheck(self.replayer, self.reporter, self.history, self.counters,
                                        scaler=self.scaler, confirm=config.confirm_nonfinite,
                                        audits_on=self.cadence.audits_on())
        self.ring_audit = RingAudit(self.replayer, self.reporter, self.history, self.cadence)
        self.weights = WeightVote(self.params.weights, self.params.weight_names, self.reporter,
                                  self.history, self.counters)
        self.spikes = SpikeWatch(self.sentinel, self.reporter, self.counters)
        self.rerun = LocalRerun(self.replayer, self.reporter, self.counters)

    def _install_hook(self, model: Any, reduce_hook: Optional[Callable[[Any, Any], Any]],
                      reduce_state: Any, check_reduced: bool, start_step: Optional[int]) -> None:
        """Register the gradient recorder as DDP's comm hook (DDP takes exactly one)."""
        self._recorder = GradientRecorder(
            self.params.grad_params, reduce_hook=reduce_hook,
            reduce_state=self.group if reduce_state is _GROUP else reduce_state,
            check_reduced=check_reduced,
            grads_are_bucket_views=bool(getattr(model, "gradient_as_bucket_view", False)),
            measure_local=self.sentinel.config.enabled,
            accumulating=self.config.accumulation_steps > 1)
        if start_step is None:
            self._recorder.record_step = _UNKNOWN if self.cadence.audits_on() else None
        else:
            self._recorder.record_step = start_step if self.is_audit_step(start_step) else None
        self.nonfinite.recorder = self._recorder  # check 1 redoes a bad reduction through it
        try:
            model.register_comm_hook(None, self._recorder.hook)
        except RuntimeError as e:
            raise AuditUsageError("screener.audit: could not register the auditor's comm hook (DDP "
                                  "takes one hook, registered before the first backward); pass "
                                  f"your own hook as Auditor(reduce_hook=...): {e}") from e

    # ---- what the collaborators hold, under the names the Auditor had ----------------------------

    @property
    def weight_names(self) -> list[str]:
        return self.params.weight_names

    @property
    def grad_names(self) -> list[str]:
        return self.params.grad_names

    @property
    def _my_replays(self) -> list[int]:
        return self.replayer.my_replays

    @property
    def _replay_mode(self) -> ring.ReplayMode:
        return self.replayer.mode

    # ---- step start and teardown ---------------------------------------------------------------

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        # Traced by dynamo only when the DDP model itself runs inside torch.compile: dynamo
        # replays this store on every call of the compiled code, and check_gradients refuses.
        if torch.compiler.is_compiling():
            self._compiled_around = True
            return
        self._recorder.armed = True  # a training forward: its gradients count (hooks.py)
        if self._state is None:
            self._state = capture(self.device, self.scaler)

    def begin_step(self) -> None:
        """Capture the RNG states (and loss scale) the step starting now draws from.

        Only needed when loss_fn draws random numbers before it calls the model (the forward
        pre-hook captures otherwise); call it before anything of the step uses randomness.
        """
        self._state = capture(self.device, self.scaler)
        self._recorder.armed = True

    def close(self) -> None:
        """Remove the forward pre-hook and drop the auditor's references to the model.

        Call it (or use the Auditor as a context manager) before dist.destroy_process_group(),
        and drop the DDP model too: see examples/train_ddp.py for the teardown order.
        """
        if self._closed:
            return
        self._closed = True
        self._pre_hook.remove()
        self._recorder.record_step = None
        self._recorder.remove()
        self._state = None

    # ---- check 1 and check 2 -----------------------------------------------------------------

    def check_gradients(self, step: int, loss: Any,
                        grad_norm: torch.Tensor | float | None = None) -> None:
        """After backward, before optimizer.step() (and scaler.step()): check 1, and check 2 on
        audit steps.

        loss: the step's loss, unscaled (or what loss_fn returned: a tuple's first element, a
        mapping's "loss"); with accumulation_steps > 1, the sum of the micro-batch losses.
        grad_norm: the total norm of the reduced gradient when the loop already computes it
        (the return value of clip_grad_norm_). Given it, the Auditor may be constructed with
        check_reduced=False: with a reduce_hook of the caller's, the hook then skips its own
        norm of the reduced buckets (the default reduction checks them for free).

        Collective: every rank of the group calls it at every step. Raises SDCAlarm (or
        NumericFailure for numbers no hardware explains) on every rank alike. One all_gather on a
        step without an audit; an audit step has two: the owners' RNG states and loss scales go
        out before the replays, the digests of the replays' records come back after them.
        """
        step = int(step)
        if self._compiled_around:  # every rank runs the same compiled code: all refuse here
            raise AuditUsageError(COMPILED_AROUND_DDP)
        self.cadence.begin(step)
        self.history.note(step)
        loss = self._loss_tensor(loss)
        stats = self._recorder.take(self.device)
        self._recorder.record_step = step + 1 if self.is_audit_step(step + 1) else None
        state = self._state if self._state is not None \
            else StepState(None, None, scaler_scale(self.scaler))
        self._state = None
        self.counters["steps"] += 1
        reduced = stats.reduced_norm if grad_norm is None else self._given_norm(grad_norm)
        head = torch.stack([self._scalar(loss, "loss"),
                            stats.local_norm.to(self._comm, torch.float64),
                            reduced.to(self._comm, torch.float64)])
        walk = DDP_STEP.walk(self.group, self._comm, step)
        g = walk.gather("head", head)  # (world, 3): the same width on every step
        if not self.is_audit_step(step):
            if not self.nonfinite.judge(walk, step, g, lambda: self._gather_states(walk, state)):
                self._sentinel_step(walk, step, g, lambda: self._gather_states(walk, state))
            return
        self._audit(walk, step, loss, stats, state, g)
        # an audit step that passed: its gathered values join the sentinel's baseline (a spike
        # the ring replay reproduced is the data's); gathered, so every rank's baseline is the
        # same and every rank decides alike
        audited = self._audit_head
        if audited is not None:
            self.sentinel.accept("loss", max(abs(float(x)) for x in audited[:, 0]))
            self.sentinel.accept("grad", max(float(x) for x in audited[:, 1]))

    def _audit(self, walk: Walk, step: int, loss: Any, stats: StepStats, state: StepState,
               g: torch.Tensor) -> None:
        """An audit step (the head g gathered): check 1 with the states gathered for the
        replays, then check 2."""
        # Every rank sends the same shape on an audit step, whatever happened here: a rank whose
        # fingerprints were not recorded says so, and all ranks skip the comparison alike (a
        # rank-local decision to send less would leave the others waiting in a different gather).
        recorded = stats.grad_fingerprints is not None and stats.step in (step, _UNKNOWN)
        status = OK if recorded else _NOT_RECORDED
        got1 = walk.gather("states", torch.cat([torch.tensor([status]),
                                                self._codec.encode(state)]))  # (world, 1 + state)
        self._audit_head = g
        states = self._decode_states(got1[:, 1:])
        if self.nonfinite.judge(walk, step, g, lambda: states):
            return  # the scaler skips this step; so does the audit
        if bool((got1[:, 0] == _NOT_RECORDED).any()):
            self.counters["audits_skipped"] += 1
            log.info("screener.audit: step %d not audited (gradient fingerprints were not "
                     "recorded for it on some rank: steps not consecutive?)", step)
            return
        assert stats.grad_fingerprints is not None
        self.ring_audit.run(walk, step, loss, stats.grad_fingerprints, states)

    def _loss_tensor(self, loss: Any) -> Any:
        return loss if isinstance(loss, (int, float)) else ring.loss_of(loss)

    def _scalar(self, value: torch.Tensor | float, what: str) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise AuditUsageError(f"screener.audit: check_gradients needs the scalar {what}, "
                                      f"got shape {tuple(value.shape)}")
            return value.detach().reshape(()).to(self._comm, torch.float64)
        return torch.tensor(float(value), dtype=torch.float64, device=self._comm)

    def _given_norm(self, grad_norm: torch.Tensor | float) -> torch.Tensor:
        """The caller's norm of the reduced gradient; when it is not finite, the largest magnitude
        of the reduced gradient itself: clip_grad_norm_ squares in float32, so its norm is inf
        for a finite gradient element past ~1.8e19, and non-finite must mean non-finite values
        (issue 28). The reduced gradient is in .grad now (clipped: a finite one times 0 stays
        finite, NaN or inf times anything stays non-finite)."""
        norm = self._scalar(grad_norm, "grad_norm")
        if bool(torch.isfinite(norm)):
            return norm
        return largest_magnitude([p.grad for p in self.params.grad_params], self._comm)

    def _decode_states(self, rows: torch.Tensor) -> dict[int, StepState]:
        return {r: self._codec.decode(rows[k]) for k, r in enumerate(self.topology.ranks)}

    def _gather_states(self, walk: Walk, state: StepState) -> dict[int, StepState]:
        """Collective: every rank's step state (only when a replay needs them off an audit step)."""
        row = torch.cat([torch.tensor([OK]), self._codec.encode(state)])  # as on audit steps
        return self._decode_states(walk.gather("states", row)[:, 1:])

    def _sentinel_step(self, walk: Walk, step: int, g: torch.Tensor,
                       states: Callable[[], dict[int, StepState]]) -> None:
        """The spike test on a step without an audit (attribution.py); a data spike with
        on_data="skip" drops the step's gradients."""
        local = [float(x) for x in g[:, 1]]
        self.spikes.step(step, [abs(float(x)) for x in g[:, 0]], local, max(local),
                         lambda spike, suspect: self.rerun.attribute(
                             walk, step, spike, suspect, states, g, self.weights.rollback()),
                         self.params.grad_params)

    # ---- check 3 -------------------------------------------------------------------------------

    def check_weights(self, step: int, *, force: bool = False) -> None:
        """After optimizer.step(): the weight vote every weights_every steps (always if force).

        Collective: every rank of the group calls it. Raises SDCAlarm("weights") on every rank.
        """
        step = int(step)
        if not force and not self.is_weights_step(step):
            return
        self.history.note(step)
        self.weights.check(DDP_WEIGHTS.walk(self.group, self._comm), step)

    def verified_save(self, save_fn: Callable[[], Any], step: int) -> Any:
        """Run the weight vote for `step` (unless it already passed at this step), then save_fn().

        Collective. A failing vote raises SDCAlarm and nothing is saved. When save_fn returns the
        path it wrote (str or PathLike), a marker is written next to it so rollback_target can
        trust it; returns what save_fn returned.
        """
        step = int(step)
        if not self.weights.passed_at(step):
            self.check_weights(step, force=True)
        return self.weights.save(save_fn, step)
